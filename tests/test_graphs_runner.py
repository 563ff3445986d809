"""GraphRunner with a toy attention-like step over a persistent cache (``graph_toys``): CPU compiled replay. The
CUDA twins are in ``test_graphs_runner_cuda.py``."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from graph_toys import (
    NUM_SLOTS,
    POLICY,
    D,
    assert_outputs_match,
    compile_count,
    key_for,
    make_buffers_on,
    make_runner,
    real_batch,
    toy_step,
)
from torch._dynamo.utils import counters

from graphs import GraphRunner, StaticBuffers
from profiling import enabled_ranges

# torch's own import of torch.utils.mkldnn (pulled in by inductor) warns about torch.jit.script_method.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from a clean dynamo cache (inductor's on-disk cache keeps that fast)."""
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=4096):
        yield
    torch._dynamo.reset()


@pytest.fixture
def persistent():
    return {"cache": torch.randn(NUM_SLOTS, D, generator=torch.Generator().manual_seed(0))}


# ---------------------------------------------------------------------------------------------------------
# CPU: compiled replay on static buffers


def test_compiled_runner_matches_eager_inside_and_at_bucket_edges(persistent):
    runner = make_runner()
    timings = runner.warmup(persistent)
    assert list(timings) == list(POLICY.keys())  # largest first
    assert all(set(t) == {"compile_s", "warmup_s"} for t in timings.values())
    assert runner.num_captured == 0 and runner.warmed_keys == list(POLICY.keys())
    gen = torch.Generator().manual_seed(1)
    for n in (3, 5, 13, 1, 2, 4, 8, 16):
        for max_len in (7, 16, 17, 32):
            real = real_batch(n, max_len, gen=gen)
            out = runner.run(key_for(real), real, persistent)
            assert out[0].shape == (runner.buffers(key_for(real)).bucket, D)
            assert_outputs_match(out, real, persistent, n)
            sliced = runner.run_sliced(key_for(real), real, persistent)
            assert [t.shape[0] for t in sliced] == [n, n]
    assert runner.stats.replays == 64 and runner.stats.fallbacks == 0


def test_padded_rows_never_leak_into_real_outputs(persistent):
    runner = make_runner(compile_fn=None)  # padding semantics are the runner's, not the compiler's
    runner.warmup(persistent)
    gen = torch.Generator().manual_seed(2)
    full = real_batch(16, 32, gen=gen)
    full["q"] *= 100.0  # make every row of the bucket's buffers loud
    runner.run((16, 32), full, persistent)
    real = real_batch(13, 32, gen=gen)
    out, lse = runner.run((16, 32), real, persistent)
    assert_outputs_match((out, lse), real, persistent, 13)
    # padded rows read the dummy slot 0 with q = 0: finite, and nothing from the previous batch
    torch.testing.assert_close(out[13:], persistent["cache"][0].expand(3, D))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_no_new_compiles_after_warmup(persistent):
    runner = make_runner()
    runner.warmup(persistent)
    before = compile_count()
    assert before[0] >= 1
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    # error_on_recompile turns any guard failure into an exception rather than a silent recompile
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(50):
            real = real_batch(rng.randint(1, 16), rng.randint(1, 32), gen=gen)
            out = runner.run(key_for(real), real, persistent)
            assert_outputs_match(out, real, persistent, real["q"].shape[0])
    assert compile_count() == before
    assert runner.stats.replays == 50


def test_beyond_largest_bucket_runs_fallback_and_warns_once(persistent):
    runner = make_runner()
    runner.warmup(persistent)
    gen = torch.Generator().manual_seed(4)
    with pytest.warns(UserWarning, match=r"batch of 20 rows.*largest bucket is \(16, 32\)") as record:
        for n in (20, 24, 17):
            real = real_batch(n, 30, gen=gen)
            assert key_for(real) is None
            out = runner.run(None, real, persistent)
            assert out[0].shape == (n, D)
            assert_outputs_match(out, real, persistent, n)
            assert [t.shape[0] for t in runner.run_sliced(None, real, persistent)] == [n, n]
    assert len([w for w in record if "no warmed bucket" in str(w.message)]) == 1
    assert runner.stats.fallbacks == 6 and runner.stats.replays == 0


def test_custom_fallback_and_unwarmed_key(persistent):
    calls = []

    def fallback(real, pers):
        calls.append(real["q"].shape[0])
        return toy_step(real, pers)

    runner = make_runner(compile_fn=None, keys=[(4, 16)], fallback_fn=fallback)
    runner.warmup(persistent)
    real = real_batch(3, 20)  # kv bucket 32 was not warmed
    with pytest.warns(UserWarning, match="no warmed bucket"):
        out = runner.run((4, 32), real, persistent)
    assert_outputs_match(out, real, persistent, 3)
    assert calls == [3]


def test_replaced_persistent_tensor_of_other_shape_is_detected(persistent):
    runner = make_runner()
    runner.warmup(persistent)
    real = real_batch(5, 12)
    runner.run(key_for(real), real, persistent)
    bigger = {"cache": torch.randn(2 * NUM_SLOTS, D)}
    with pytest.warns(UserWarning, match=r"'cache' was replaced \(shape \(64, 8\) -> \(128, 8\)"):
        out = runner.run(key_for(real), real, bigger)
    assert_outputs_match(out, real, bigger, 5)  # follows the new tensor
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same tensor again: no second warning
        runner.run(key_for(real), real, bigger)


def test_cpu_path_reads_cache_updates_in_place(persistent):
    runner = make_runner(compile_fn=None)
    runner.warmup(persistent)
    real = real_batch(3, 10)
    first = [t.clone() for t in runner.run(key_for(real), real, persistent)]
    persistent["cache"].mul_(2.0).add_(1.0)
    second = runner.run(key_for(real), real, persistent)
    assert not torch.allclose(first[0][:3], second[0][:3])
    assert_outputs_match(second, real, persistent, 3)


def test_run_before_warmup_and_after_reset_raises(persistent):
    runner = make_runner(compile_fn=None, keys=[(2, 16)])
    real = real_batch(2, 5)
    with pytest.raises(RuntimeError, match="warmup"):
        runner.run((2, 16), real, persistent)
    runner.warmup(persistent)
    runner.run((2, 16), real, persistent)
    runner.reset()
    assert runner.warmed_keys == [] and runner.num_captured == 0
    with pytest.raises(RuntimeError, match="warmup"):
        runner.run((2, 16), real, persistent)


def test_constructor_validation():
    with pytest.raises(ValueError, match="CUDA device"):
        GraphRunner(toy_step, make_buffers=make_buffers_on("cpu"), keys=[(1, 16)], device="cpu", use_cuda_graph=True)
    with pytest.raises(ValueError, match="warmup_iters"):
        make_runner(keys=[(1, 16)], warmup_iters=0)
    with pytest.raises(ValueError, match="unique"):
        make_runner(keys=[(1, 16), (1, 16)])
    with pytest.raises(ValueError, match="empty"):
        make_runner(keys=[])


def test_bad_step_output_and_bad_buffers_rejected_at_warmup(persistent):
    runner = GraphRunner(
        lambda i, p: {"out": i["q"]}, make_buffers=make_buffers_on("cpu"), keys=[(1, 16)], device="cpu",
        use_cuda_graph=False, progress=False,
    )
    with pytest.raises(TypeError, match="step_fn must return"):
        runner.warmup(persistent)
    runner = GraphRunner(
        toy_step, make_buffers=lambda key: {"q": torch.zeros(1)}, keys=[(1, 16)], device="cpu",
        use_cuda_graph=False, progress=False,
    )
    with pytest.raises(TypeError, match="StaticBuffers"):
        runner.warmup(persistent)


def test_warmup_iters_and_compile_called_once(persistent):
    calls = {"step": 0, "compile": 0}

    def counting_step(inputs, pers):
        calls["step"] += 1
        return toy_step(inputs, pers)

    def compile_fn(fn):
        calls["compile"] += 1
        return fn

    runner = GraphRunner(
        counting_step, make_buffers=make_buffers_on("cpu"), keys=POLICY.keys(), device="cpu",
        use_cuda_graph=False, compile_fn=compile_fn, warmup_iters=3, progress=False,
    )
    runner.warmup(persistent)
    assert calls == {"step": 3 * len(POLICY.keys()), "compile": 1}


@pytest.mark.parametrize("slow", ["compiled", "eager"])
def test_each_bucket_replays_the_form_measured_faster(persistent, slow, caplog):
    """With ``eager_fn`` the CPU warm-up times both forms per bucket and keeps the faster; the slow form here
    sleeps 20 ms per call (a margin no scheduler noise reaches). Outputs are the same either way."""
    import time as _time

    calls = {"compiled": 0, "eager": 0}

    def form(name):
        def step(inputs, pers):
            calls[name] += 1
            if name == slow:
                _time.sleep(0.02)
            return toy_step(inputs, pers)
        return step

    keys = [(1, 16), (4, 32)]
    runner = GraphRunner(form("compiled"), make_buffers=make_buffers_on("cpu"), keys=keys, device="cpu",
                         use_cuda_graph=False, progress=False, eager_fn=form("eager"), measure_iters=2)
    with caplog.at_level("INFO", logger="graphs.runner"):
        timings = runner.warmup(persistent)
    fast = "eager" if slow == "compiled" else "compiled"
    assert sum(f"replays the {fast} step" in r.getMessage() for r in caplog.records) == len(keys)
    assert runner.choices() == {k: fast for k in keys}
    for k in keys:
        assert timings[k]["choice"] == fast and timings[k][f"{slow}_s"] > timings[k][f"{fast}_s"] + 0.01
    before = dict(calls)
    real = real_batch(3, 20, gen=torch.Generator().manual_seed(1))
    assert_outputs_match(runner.run_sliced(key_for(real), real, persistent), real, persistent, 3)
    assert calls[fast] == before[fast] + 1 and calls[slow] == before[slow]


def test_progress_bar_names_the_bucket(persistent, capsys):
    runner = GraphRunner(
        toy_step, make_buffers=make_buffers_on("cpu"), keys=[(4, 16), (2, 32)], device="cpu",
        use_cuda_graph=False, progress=True,
    )
    runner.warmup(persistent)
    err = capsys.readouterr().err
    assert "bs=4 kv=16" in err and "bs=2 kv=32" in err


def test_profiler_ranges_around_warmup_replay_and_fallback(persistent):
    runner = make_runner(compile_fn=None, keys=[(4, 16)])
    with enabled_ranges(True), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        runner.warmup(persistent)
        runner.run((4, 16), real_batch(3, 9), persistent)
        with pytest.warns(UserWarning):
            runner.run(None, real_batch(6, 9), persistent)
    names = {e.name for e in prof.events()}
    for expected in ("warmup bs=4 kv=16", "compile bs=4 kv=16", "replay bs=4 kv=16", "fallback bs=6"):
        assert expected in names, (expected, sorted(n for n in names if "=" in n))


def test_integer_keys_work(persistent):
    """Keys are opaque to the runner: a plain batch-size key works too."""

    def make_buffers(bs: int) -> StaticBuffers:
        return make_buffers_on("cpu")((bs, 16))

    runner = GraphRunner(toy_step, make_buffers=make_buffers, keys=[2, 8, 4], device="cpu", use_cuda_graph=False,
                         progress=False)
    assert runner.keys == [8, 4, 2]
    runner.warmup(persistent)
    real = real_batch(3, 16)
    assert_outputs_match(runner.run(4, real, persistent), real, persistent, 3)


def test_choices_from_an_earlier_start_skip_the_measurement(persistent):
    """A restart passes the first start's ``choices()``: no timing runs, the same forms replayed."""
    calls = {"compiled": 0, "eager": 0}

    def form(name):
        def step(inputs, pers):
            calls[name] += 1
            return toy_step(inputs, pers)
        return step

    keys = [(1, 16), (4, 32)]
    runner = GraphRunner(form("compiled"), make_buffers=make_buffers_on("cpu"), keys=keys, device="cpu",
                         use_cuda_graph=False, progress=False, eager_fn=form("eager"), measure_iters=2,
                         warmup_iters=1)
    timings = runner.warmup(persistent, {(1, 16): "eager", (4, 32): "compiled"})
    assert runner.choices() == {(1, 16): "eager", (4, 32): "compiled"}
    assert calls == {"compiled": 2, "eager": 1}  # one warm-up run per key, plus the eager bucket's first call
    assert "compiled_s" not in timings[(1, 16)] and timings[(1, 16)]["choice"] == "eager"
