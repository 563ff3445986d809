"""ExtendGraphs on CPU: bucketed extend steps against the float64 reference (mixed lengths, prefixes, causal and
not, sliding window, zero-length requests), exact recompile counts after warm-up, fallback, bad input. (The CUDA
twin at the end runs through profiling/gpu_check.sh.)

Tiny heads and tiles, two token buckets, so the one inductor compile (the CPU flash form) takes a few seconds;
the other mask settings and the matmul form replay the eager step on the same static buffers (the bucketing,
padding and slicing are the same code either way).
"""
import warnings

import pytest
import torch
from reference import reference_attention
from torch._dynamo.utils import counters

from compiled_attn.bench.batches import assign_requests
from compiled_attn.extend import ExtendTileInputs, build_extend_tile_index, extend_tiles
from compiled_attn.plan import plan_extend
from compiled_attn.runners.decode import RowInput
from compiled_attn.runners.extend import ExtendGraphConfig, ExtendGraphs, ExtendKey
from graphs.runner_helpers import key_attrs

HQ, HKV, D = 4, 2, 16
SCALE = D ** -0.5
WIDTH = 96  # table width: the longest request (prefix + new)
NUM_SLOTS = 1024
TILE = 16

# torch's own import of torch.utils.mkldnn (pulled in by inductor) warns about torch.jit.script_method.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def _config(**kw):
    kw = {"max_tokens": 128, "min_tokens": 64, "max_pairs": 128, "min_pairs": 64, "tile_q": TILE, "tile_k": TILE,
          "max_context_len": WIDTH, "max_requests": 8, "progress": False, **kw}
    return ExtendGraphConfig(**kw)


def _step_for(causal, window, form):
    def step(inputs, persistent):
        index = build_extend_tile_index(persistent["req_to_token"], ExtendTileInputs.of(inputs), causal=causal,
                                        sliding_window=window, with_mask=form != "kernel")
        return extend_tiles(inputs["q"], persistent["k"], persistent["v"], index, SCALE, form=form)
    return step


def _persistent(device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"k": torch.randn(NUM_SLOTS, HKV, D, generator=g).to(device),
            "v": torch.randn(NUM_SLOTS, HKV, D, generator=g).to(device),
            "req_to_token": torch.zeros(24, WIDTH, dtype=torch.int32, device=device)}


def _graphs(causal=True, window=None, form="kernel", compile=False, device="cpu", **kw):
    return ExtendGraphs(_step_for(causal, window, form), config=_config(enable_torch_compile=compile, **kw),
                        device=device, token_inputs={"q": RowInput((HQ, D), torch.float32)}, causal=causal,
                        sliding_window=window)


def _batch(persistent, ext, prefix, seed, causal=True, window=None):
    """New random requests in the shared table and caches: ext[i] new tokens after prefix[i] cached ones."""
    table = persistent["req_to_token"]
    g = torch.Generator().manual_seed(seed)
    seq = torch.tensor([e + p for e, p in zip(ext, prefix, strict=True)])
    rows = assign_requests(table, NUM_SLOTS, seq.tolist(), g)
    q = torch.randn(sum(ext), HQ, D, generator=g).to(table.device)
    meta = plan_extend(q, persistent["k"], persistent["v"], table, rows, seq.to(table.device),
                       torch.tensor(prefix, device=table.device), torch.tensor(ext, device=table.device),
                       causal=causal, sliding_window=window)
    ref = reference_attention(q.cpu(), persistent["k"].cpu(), persistent["v"].cpu(), table.cpu(), rows.cpu(), seq,
                              prefix, ext, scale=SCALE, causal=causal, sliding_window=window)
    return meta, q, ref


@pytest.fixture(scope="module")
def warmed():
    """The served form: the CPU flash step compiled by inductor (compile_policy), both buckets warmed."""
    torch._dynamo.reset()
    graphs, persistent = _graphs(compile=True), _persistent()
    before = counters["stats"]["unique_graphs"]
    timings = graphs.warmup(persistent)
    return graphs, persistent, timings, counters["stats"]["unique_graphs"] - before


BATCHES = {  # name: (new tokens, cached prefix) per request
    "mixed": ([40, 1, 23, 9], [0, 30, 5, 0]),
    "prefixes": ([17, 33], [60, 63]),
    "zero_length": ([5, 0, 30, 0], [2, 7, 0, 0]),
    "one_request": ([96], [0]),
}


def test_buckets_and_warmup(warmed):
    graphs, _, timings, compiled = warmed
    assert graphs.keys() == [ExtendKey(64, 64), ExtendKey(64, 128), ExtendKey(128, 64), ExtendKey(128, 128)]
    assert set(timings) == set(graphs.keys()) and set(graphs.choices()) == set(graphs.keys())
    assert set(graphs.choices().values()) <= {"compiled", "eager"}
    assert 1 <= compiled <= 2  # dynamic sizes: every bucket replays one compiled graph
    for key in graphs.keys():  # the warm-up batch did real work: pairs with keys, queries inside the bucket
        t = graphs.runner.buffers(key).tensors
        assert int(t["k_count"].sum()) > 0 and int(t["q_start"][t["q_count"] > 0].max()) < key.tokens
    assert graphs.key_for_lengths([100]) == ExtendKey(128, 64)
    assert graphs.key_for_lengths([96, 96]) is None  # 192 tokens: beyond the largest token bucket
    assert key_attrs(ExtendKey(128, 64)) == {"tokens": 128, "pairs": 64}  # names in progress bars and ranges


def test_unreachable_buckets_are_skipped():
    """64 tokens (at most 8 requests of <= 96 keys, 4-key tiles) never need more than 300 pairs; 513..1024
    tokens always need more than 128 (a query sees its own position: >= one key tile per 4 queries)."""
    keys = _graphs(max_tokens=1024, max_pairs=1024, tile_k=4).keys()
    assert ExtendKey(64, 512) in keys and ExtendKey(64, 1024) not in keys
    assert ExtendKey(1024, 256) in keys and ExtendKey(1024, 128) not in keys


@pytest.mark.parametrize("name", list(BATCHES))
def test_replay_equals_reference(warmed, name):
    graphs, persistent, _, _ = warmed
    meta, q, ref = _batch(persistent, *BATCHES[name], seed=len(name))
    out = graphs.run(meta, {"q": q}, persistent)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_no_new_graphs_across_batches_of_one_bucket(warmed):
    """Several batches with different token counts (65..128) and pairs, all in bucket (128, 64): 0 new graphs."""
    graphs, persistent, _, _ = warmed
    before, replays = counters["stats"]["unique_graphs"], graphs.stats.replays
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed, (ext, prefix) in enumerate((([40, 25], [0, 10]), ([70, 3, 20], [0, 50, 1]),
                                              ([96, 32], [0, 0]), ([11, 12, 13, 14, 15], [0, 1, 2, 3, 4]))):
            meta, q, ref = _batch(persistent, ext, prefix, seed)
            assert graphs.key_for(meta.num_tokens, 0) == ExtendKey(128, 64)
            torch.testing.assert_close(graphs.run(meta, {"q": q}, persistent).double(), ref, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == before
    assert graphs.stats.replays == replays + 4 and graphs.stats.fallbacks == 0


@pytest.mark.parametrize("form", ["kernel", "matmul"])
@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, 0), (True, 7)])
def test_mask_settings_and_forms(causal, window, form):
    graphs, persistent = _graphs(causal, window, form), _persistent(seed=1)
    graphs.warmup(persistent)
    for seed, (ext, prefix) in enumerate(BATCHES.values()):
        meta, q, ref = _batch(persistent, ext, prefix, seed, causal, window)
        out = graphs.run(meta, {"q": q}, persistent)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert graphs.stats.fallbacks == 0


def test_beyond_the_largest_bucket_falls_back_once():
    graphs, persistent = _graphs(), _persistent(seed=2)
    graphs.warmup(persistent, keys=[ExtendKey(64, 64)])  # only the smaller bucket
    assert graphs.choices() == {ExtendKey(64, 64): "compiled"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed, ext in enumerate(([50, 40], [96, 90], [10])):
            meta, q, ref = _batch(persistent, ext, [0] * len(ext), seed)
            torch.testing.assert_close(graphs.run(meta, {"q": q}, persistent).double(), ref, atol=1e-5, rtol=1e-5)
    assert sum("no warmed bucket" in str(w.message) for w in caught) == 1
    assert graphs.stats.fallbacks == 2 and graphs.stats.replays == 1


def test_measured_choice_replays_the_faster_form():
    """A compiled step slower than the eager one (here: made so) is measured at warm-up; its buckets replay the
    eager step, with the same outputs."""
    import time

    graphs, persistent = _graphs(compile=False), _persistent(seed=5)
    eager = graphs._step
    calls = {"slow": 0}

    def slow(inputs, persistent):
        calls["slow"] += 1
        time.sleep(0.02)
        return eager(inputs, persistent)

    graphs._compiled = slow  # stands in for a compiled step that lost to the eager one
    timings = graphs.warmup(persistent, keys=[(64, 64)])
    assert graphs.choices() == {ExtendKey(64, 64): "eager"}
    assert timings[ExtendKey(64, 64)]["compiled_s"] > timings[ExtendKey(64, 64)]["eager_s"]
    before = calls["slow"]
    meta, q, ref = _batch(persistent, [20, 9], [3, 0], 0)
    torch.testing.assert_close(graphs.run(meta, {"q": q}, persistent).double(), ref, atol=1e-5, rtol=1e-5)
    assert calls["slow"] == before  # the replay ran the eager step


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="ExtendGraphConfig.max_tokens"):
        ExtendGraphConfig(max_tokens=0)
    with pytest.raises(TypeError, match="ExtendGraphConfig.tile_q"):
        ExtendGraphConfig(tile_q=16.0)
    with pytest.raises(ValueError, match="token_growth"):
        ExtendGraphConfig(token_growth=1.0)
    step = _step_for(True, None, "kernel")
    with pytest.raises(ValueError, match="token_inputs"):
        ExtendGraphs(step, config=_config(), device="cpu", token_inputs={})
    with pytest.raises(TypeError, match="token_inputs\\['q'\\]"):
        ExtendGraphs(step, config=_config(), device="cpu", token_inputs={"q": (HQ, D)})
    with pytest.raises(ValueError, match="token_inputs\\['full'\\]"):
        ExtendGraphs(step, config=_config(), device="cpu", token_inputs={"full": RowInput((), torch.bool)})
    with pytest.raises(TypeError, match="config"):
        ExtendGraphs(step, config=None, device="cpu", token_inputs={"q": RowInput((HQ, D), torch.float32)})
    graphs, persistent = _graphs(), _persistent(seed=3)
    meta, q, _ = _batch(persistent, [9, 4], [0, 3], 0)
    with pytest.raises(RuntimeError, match="before warmup"):
        graphs.run(meta, {"q": q}, persistent)
    with pytest.raises(ValueError, match="req_to_token"):
        graphs.warmup({"k": persistent["k"], "v": persistent["v"]})
    with pytest.raises(ValueError, match="keys"):
        graphs.warmup(persistent, keys=[(100, 64)])
    graphs.warmup(persistent, keys=[(64, 64)])
    with pytest.raises(ValueError, match="tokens\\['q'\\] has shape"):
        graphs.run(meta, {"q": q[:-1]}, persistent)
    with pytest.raises(ValueError, match="missing inputs \\['q'\\]"):
        graphs.run(meta, {"x": q}, persistent)
    with pytest.raises(TypeError, match="meta"):
        graphs.run(meta.inputs, {"q": q}, persistent)
    other, _, _ = _batch(persistent, [9, 4], [0, 3], 0, causal=False)
    with pytest.raises(ValueError, match="causal=False"):
        graphs.run(other, {"q": q}, persistent)


def test_slot_inputs_are_checked_before_a_replay():
    """A step that writes the new tokens' K/V: an out-of-range slot is a ValueError naming the input, not a
    wrapped index inside the replay."""
    def step(inputs, persistent):
        persistent["k"].index_copy_(0, inputs["loc"], inputs["q"][:, :HKV])
        return _step_for(True, None, "kernel")(inputs, persistent)

    graphs = ExtendGraphs(step, config=_config(enable_torch_compile=False), device="cpu",
                          token_inputs={"q": RowInput((HQ, D), torch.float32), "loc": RowInput((), torch.int64,
                                                                                               slots=True)})
    persistent = _persistent(seed=4)
    graphs.warmup(persistent, keys=[(64, 64)])
    meta, q, _ = _batch(persistent, [9, 4], [0, 3], 0)
    loc = torch.arange(13)
    assert graphs.run(meta, {"q": q, "loc": loc}, persistent).shape == (13, HQ, D)
    with pytest.raises(ValueError, match="tokens\\['loc'\\] must hold KV slots"):
        graphs.run(meta, {"q": q, "loc": loc + NUM_SLOTS}, persistent)


@pytest.mark.cuda
def test_cuda_graph_replay_equals_reference():
    """The matmul form (CUDA's) compiled and captured per bucket: equal to the reference, new cache contents
    read at replay, no new graph across batches of one bucket."""
    graphs, persistent = _graphs(form="matmul", compile=True, device="cuda", tile_q=None), _persistent("cuda")
    graphs.warmup(persistent)
    assert set(graphs.choices().values()) == {"captured"}
    before = counters["stats"]["unique_graphs"]
    for seed, (ext, prefix) in enumerate(BATCHES.values()):
        meta, q, ref = _batch(persistent, ext, prefix, seed)
        out = graphs.run(meta, {"q": q}, persistent)
        torch.testing.assert_close(out.double().cpu(), ref, atol=1e-4, rtol=1e-4)
    persistent["k"].mul_(-1.5)
    meta, q, ref = _batch(persistent, *BATCHES["mixed"], seed=9)
    torch.testing.assert_close(graphs.run(meta, {"q": q}, persistent).double().cpu(), ref, atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == before and graphs.stats.fallbacks == 0
