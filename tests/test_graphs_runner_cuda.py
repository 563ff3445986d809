"""GraphRunner's CUDA twins (graph capture and replay) over the toy step of ``graph_toys``; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from graph_toys import (
    NUM_SLOTS,
    POLICY,
    D,
    assert_outputs_match,
    inductor,
    key_for,
    make_runner,
    real_batch,
)

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # each test compiles afresh
    yield


@cuda
@needs_cuda
@pytest.mark.parametrize("compile_fn", [None, inductor], ids=["eager", "inductor"])
def test_cuda_graph_replay_matches_eager(compile_fn):
    persistent = {"cache": torch.randn(NUM_SLOTS, D, device="cuda")}
    runner = make_runner("cuda", compile_fn=compile_fn)
    timings = runner.warmup(persistent)
    assert runner.num_captured == len(POLICY.keys())
    assert all("capture_s" in t for t in timings.values())
    gen = torch.Generator().manual_seed(5)
    for n in (3, 5, 13, 1, 16):
        real = real_batch(n, 20, "cuda", gen=gen)
        out = runner.run(key_for(real), real, persistent)
        assert_outputs_match(out, real, persistent, n)
    assert runner.stats.replays == 5
    runner.reset()
    assert runner.num_captured == 0


@cuda
@needs_cuda
def test_cuda_graph_replay_reads_new_cache_data():
    persistent = {"cache": torch.randn(NUM_SLOTS, D, device="cuda")}
    runner = make_runner("cuda", compile_fn=None)
    runner.warmup(persistent)
    real = real_batch(5, 12, "cuda")
    first = [t.clone() for t in runner.run(key_for(real), real, persistent)]
    persistent["cache"].copy_(torch.randn(NUM_SLOTS, D, device="cuda"))
    second = runner.run(key_for(real), real, persistent)
    assert not torch.allclose(first[0][:5], second[0][:5])
    assert_outputs_match(second, real, persistent, 5)


@cuda
@needs_cuda
def test_cuda_replaced_persistent_tensor_triggers_recapture():
    persistent = {"cache": torch.randn(NUM_SLOTS, D, device="cuda")}
    runner = make_runner("cuda", compile_fn=None, keys=[(8, 16), (4, 16)])
    runner.warmup(persistent)
    real = real_batch(3, 10, "cuda")
    runner.run(key_for(real), real, persistent)
    for replacement in (torch.randn(NUM_SLOTS, D, device="cuda"), torch.randn(2 * NUM_SLOTS, D, device="cuda")):
        new = {"cache": replacement}
        if runner.stats.recaptures == 0:
            with pytest.warns(UserWarning, match="'cache' was replaced.*re-capturing all 2 CUDA graphs"):
                out = runner.run(key_for(real), real, new)
        else:
            out = runner.run(key_for(real), real, new)  # warned once per runner
        assert_outputs_match(out, real, new, 3)
        assert runner.num_captured == 2
    assert runner.stats.recaptures == 2
    del persistent  # the original cache is freed: the graphs no longer point at it
    out = runner.run(key_for(real), real, new)
    assert_outputs_match(out, real, new, 3)


@cuda
@needs_cuda
def test_cuda_replaced_persistent_tensor_raises_without_recapture():
    persistent = {"cache": torch.randn(NUM_SLOTS, D, device="cuda")}
    runner = make_runner("cuda", compile_fn=None, keys=[(4, 16)], recapture_on_change=False)
    runner.warmup(persistent)
    real = real_batch(3, 10, "cuda")
    with pytest.raises(RuntimeError, match="'cache' was replaced"):
        runner.run((4, 16), real, {"cache": persistent["cache"].clone()})


