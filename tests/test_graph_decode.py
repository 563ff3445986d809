"""DecodeGraphs on CPU: per-bucket compiled replay equals the plain step; no recompiles after warm-up; fallback;
replaced buffers are detected. (CUDA twins at the end run through profiling/gpu_check.sh.)"""
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from compiled_attn.bench.attention_stack import make_caches, make_stack_step
from compiled_attn.bench.batches import assign_requests
from compiled_attn.bench.models import get_attention_shape
from compiled_attn.plan import plan_decode
from compiled_attn.runners.decode import DecodeGraphs, GraphConfig, RowInput

BUCKETS = [1, 2, 4, 8, 16]
MAX_CONTEXT = 64
NUM_LAYERS = 2


def _setup(device="cpu", model="tiny-mha", buckets=BUCKETS, max_kv=1024, compile=True):
    shape = get_attention_shape(model)
    persistent = make_caches(shape, NUM_LAYERS, 2048, device=device)
    for t in persistent.values():
        t.normal_()
    persistent["req_to_token"] = torch.zeros(40, MAX_CONTEXT, dtype=torch.int32, device=device)
    step = make_stack_step(shape, NUM_LAYERS)
    config = GraphConfig(max_batch_size=max(buckets), max_kv_tokens=max_kv, cuda_graph_bs=buckets,
                         enable_torch_compile=compile, progress=False)
    graphs = DecodeGraphs(step, config=config, device=device,
                          row_inputs={"x": RowInput((shape.hq, shape.dqk), torch.float32),
                                      "out_cache_loc": RowInput((), torch.int64)})
    return shape, step, graphs, persistent


def _batch(shape, persistent, bs, gen, block_size=64):
    """A random decode batch: random rows, random lengths (0 included), scattered slots."""
    table = persistent["req_to_token"]
    dev = table.device
    num_slots = persistent["k0"].shape[0]
    lens = torch.randint(0, MAX_CONTEXT + 1, (bs,), generator=gen)
    lens[torch.randint(0, bs, (1,), generator=gen)] = max(1, int(lens.max()))
    rows = assign_requests(table, num_slots, lens.tolist(), gen).cpu()
    x = torch.randn(bs, shape.hq, shape.dqk, generator=gen).to(dev)
    # the new token's slot is the request's last position; an empty request writes the padding slot
    loc = torch.where(lens > 0, table[rows, (lens - 1).clamp_min(0)].cpu().long(), 0).to(dev)
    v0 = persistent["k0"][..., : shape.dv] if shape.mla else persistent["v0"]
    meta = plan_decode(x, persistent["k0"], v0, table, rows.to(dev), lens.to(dev), block_size=block_size)
    return meta, {"x": x, "out_cache_loc": loc}


def _plain(step, meta, rows, persistent):
    clone = {k: v.clone() for k, v in persistent.items()}
    return step({**meta.inputs._asdict(), **rows}, clone), clone


@pytest.fixture(scope="module")
def warmed():
    torch._dynamo.reset()
    shape, step, graphs, persistent = _setup()
    before = counters["stats"]["unique_graphs"]
    timings = graphs.warmup(persistent)
    return shape, step, graphs, persistent, timings, counters["stats"]["unique_graphs"] - before


def test_warmup_covers_every_bucket(warmed):
    _, _, graphs, _, timings, compiled_graphs = warmed
    assert set(timings) == set(graphs.policy.keys())
    assert {k[0] for k in timings} == set(BUCKETS)
    # dynamic shapes: one graph serves all 15 buckets (a one-row bucket's buffers hold a padding row, so nothing
    # compiles a size-1 specialization)
    assert compiled_graphs == 1
    one_row = graphs.runners[0].buffers((1, min(graphs.policy.kv_capacities)))
    assert one_row.tensors["kv_hi"].shape == (2,)


@pytest.mark.parametrize("bs", [3, 5, 13, 1, 2, 4, 8, 16])
def test_replay_equals_plain_step(warmed, bs):
    shape, step, graphs, persistent, _, _ = warmed
    meta, rows = _batch(shape, persistent, bs, torch.Generator().manual_seed(bs))
    expected, cache_after = _plain(step, meta, rows, persistent)
    out = graphs.run(meta, rows, persistent)
    assert out.shape == (bs, shape.hq, shape.dqk)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for name in ("k0", "v0", "k1"):  # the step's KV writes landed where the plain step put them
        torch.testing.assert_close(persistent[name], cache_after[name])


def test_padded_rows_do_not_leak(warmed):
    """Real rows give the same output whatever the bucket pads them with."""
    shape, step, graphs, persistent, _, _ = warmed
    meta, rows = _batch(shape, persistent, 3, torch.Generator().manual_seed(7))
    first = graphs.run(meta, rows, persistent).clone()
    buf = graphs.runners[0].buffers(graphs.key_for(meta))
    buf.tensors["x"][3:].fill_(1e6)  # poison padding; copy_in must refill it
    again = graphs.run(meta, rows, persistent)
    torch.testing.assert_close(again, first)
    assert torch.isfinite(again).all()


def test_cpu_warmup_runs_the_decode_kernel_on_full_buckets(monkeypatch):
    """On CPU the warm-up batch does each bucket's full work: the C++ decode kernel runs in warm-up (on an
    all-padding batch it would skip everything and leave its first-call costs to the first request), on every
    key."""
    import compiled_attn.decode as decode
    from compiled_attn.kernels.cpu.kernel import native_available

    if not native_available():
        pytest.skip("needs the C++ kernel (not built here)")
    calls = []
    real_native = decode.native_decode_blocks
    def counting_native(qs, block_req, slots, valid, k, v, ks, vs, cap, rows, *rest, **kwargs):
        calls.append(int(valid[block_req < rows].sum()) // rows)  # keys per request (a warm-up's rows alike)
        return real_native(qs, block_req, slots, valid, k, v, ks, vs, cap, rows, *rest, **kwargs)

    monkeypatch.setattr(decode, "native_decode_blocks", counting_native)
    shape, step, graphs, persistent = _setup(buckets=[1, 4], max_kv=512, compile=False)
    graphs.warmup(persistent)
    keys = [k for r in graphs.runners for k in r.keys]
    assert len(keys) >= 4 and len(calls) >= len(keys) * NUM_LAYERS
    assert max(calls) == MAX_CONTEXT  # bs=1 reads one whole table row (the table width bounds the batch)
    # the real batch afterwards still matches the plain step (its padding rows are reset by copy_in)
    meta, rows = _batch(shape, persistent, 3, torch.Generator().manual_seed(5))
    out = graphs.run(meta, rows, persistent)
    ref, _ = _plain(step, meta, rows, persistent)
    torch.testing.assert_close(out, ref[:3], atol=1e-5, rtol=1e-5)


def test_no_recompiles_after_warmup(warmed):
    shape, _, graphs, persistent, _, _ = warmed
    gen = torch.Generator().manual_seed(123)
    before = dict(counters["stats"])
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(200):
            bs = int(torch.randint(1, max(BUCKETS) + 1, (1,), generator=gen))
            meta, rows = _batch(shape, persistent, bs, gen)
            graphs.run(meta, rows, persistent)
    assert counters["stats"]["unique_graphs"] == before["unique_graphs"]
    assert sum(s.fallbacks for s in graphs.stats) == 0


def test_beyond_largest_bucket_falls_back_once():
    shape, step, graphs, persistent = _setup(buckets=[1, 2], max_kv=256, compile=False)
    graphs.warmup(persistent)
    gen = torch.Generator().manual_seed(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for bs in (3, 5):
            meta, rows = _batch(shape, persistent, bs, gen)
            expected, _ = _plain(step, meta, rows, persistent)
            torch.testing.assert_close(graphs.run(meta, rows, persistent), expected, atol=1e-5, rtol=1e-5)
    assert sum("largest" in str(w.message) or "bucket" in str(w.message) for w in caught) == 1
    assert graphs.stats[0].fallbacks == 2


def test_replaced_cache_is_detected():
    shape, step, graphs, persistent = _setup(buckets=[1, 2], max_kv=256, compile=False)
    graphs.warmup(persistent)
    meta, rows = _batch(shape, persistent, 2, torch.Generator().manual_seed(1))
    grown = dict(persistent, k0=torch.zeros(4096, shape.hkv, shape.dqk))
    with pytest.warns(UserWarning, match="k0"):
        graphs.run(meta, rows, grown)


def test_mla_stack_replay_equals_plain_step():
    shape, step, graphs, persistent = _setup(model="tiny-mla", buckets=[4], max_kv=512, compile=False)
    graphs.warmup(persistent)
    meta, rows = _batch(shape, persistent, 3, torch.Generator().manual_seed(3))
    expected, _ = _plain(step, meta, rows, persistent)
    torch.testing.assert_close(graphs.run(meta, rows, persistent), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["tiny-mha", "tiny-mla"])
def test_cuda_graph_replay_equals_eager_and_reads_new_cache(model):
    shape, step, graphs, persistent = _setup(device="cuda", model=model, buckets=[1, 4, 8], max_kv=1024)
    graphs.warmup(persistent)
    gen = torch.Generator().manual_seed(11)
    meta, rows = _batch(shape, persistent, 5, gen)
    expected, _ = _plain(step, meta, rows, persistent)
    torch.testing.assert_close(graphs.run(meta, rows, persistent), expected, atol=1e-4, rtol=1e-4)
    for t in persistent.values():  # new cache contents between replays must be read, not baked in
        if t.is_floating_point():
            t.mul_(-1.5)
    expected, _ = _plain(step, meta, rows, persistent)
    torch.testing.assert_close(graphs.run(meta, rows, persistent), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
def test_cuda_first_step_after_warmup_is_not_a_spike():
    import time
    shape, step, graphs, persistent = _setup(device="cuda", buckets=[1, 4, 8], max_kv=1024)
    graphs.warmup(persistent)
    meta, rows = _batch(shape, persistent, 4, torch.Generator().manual_seed(2))
    times = []
    for _ in range(30):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graphs.run(meta, rows, persistent)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    assert times[0] <= 1.2 * sorted(times)[len(times) // 2] + 2e-4  # 0.2 ms slack for timer granularity


def test_one_row_bucket_eager_form_drops_the_padding_row():
    """A compiled one-row bucket holds a padding row (no size-1 graph); its eager form, timed against the compiled
    one at warm-up, runs on the real row only (the batch-of-one path), with the same output."""
    torch._dynamo.reset()
    shape, step, graphs, persistent = _setup(buckets=[1, 4], max_kv=256)
    seen = []

    def recording(inputs, pers):
        seen.append(inputs["x"].shape[0])
        return step(inputs, pers)

    graphs._step_fn = recording  # the eager form's step (the compiled one was made from `step`)
    graphs.warmup(persistent)
    assert 1 in seen and 2 not in seen  # the one-row bucket measured its eager form on one row
    key = (1, min(graphs.policy.kv_capacities))
    inputs = graphs.runners[0].buffers(key).tensors
    assert inputs["x"].shape[0] == 2
    eager = graphs._eager_step(inputs, {k: v.clone() for k, v in persistent.items()})
    compiled = graphs.runners[0]._fn(inputs, {k: v.clone() for k, v in persistent.items()})
    assert eager.shape[0] == 1
    torch.testing.assert_close(eager, compiled[:1], atol=1e-5, rtol=1e-5)


def test_sizes_fixed_in_every_bucket_are_static_to_the_compile():
    """Warm-up tells dynamo which sizes never change (every dim of the persistent tensors, each buffer dim equal in
    every bucket: heads, head size, block size), so the one dynamic compile traces fewer symbols; the batch and
    block-capacity dims stay dynamic (one graph still serves every bucket)."""
    torch._dynamo.reset()
    shape, step, graphs, persistent = _setup(buckets=[1, 4], max_kv=256)
    before = counters["stats"]["unique_graphs"]
    graphs.warmup(persistent)
    assert counters["stats"]["unique_graphs"] - before == 1

    def static(t):  # the dims torch._dynamo.mark_static marked
        return getattr(t, "_dynamo_static_indices", set())

    assert static(persistent["k0"]) == {0, 1, 2}
    runner = graphs.runners[0]
    one, four = (runner.buffers((bs, 256)).tensors for bs in (1, 4))
    assert static(four["x"]) == {1, 2} and static(one["x"]) == {1, 2}  # batch dim: 2 (padded) vs 4, dynamic
    assert static(four["block_offsets"]) == {0}


def test_eager_buckets_run_on_the_real_rows(monkeypatch):
    """A bucket whose warm-up measured the eager step faster runs it on the batch's own rows: same output as the
    plain step, the bucket's buffers untouched (nothing is replayed from them), bad inputs still refused."""
    from graphs import GraphRunner

    monkeypatch.setattr(GraphRunner, "EAGER_MARGIN", -10.0)  # every bucket picks the eager step
    torch._dynamo.reset()
    shape, step, graphs, persistent = _setup(buckets=[1, 4], max_kv=256)
    graphs.warmup(persistent)
    assert set(graphs.choices().values()) == {"eager"}
    meta, rows = _batch(shape, persistent, 3, torch.Generator().manual_seed(9))
    key = graphs.key_for(meta)
    buffers = graphs.runners[0].buffers(key).tensors
    before = {k: v.clone() for k, v in buffers.items()}
    expected, _ = _plain(step, meta, rows, persistent)
    out = graphs.run(meta, rows, persistent)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert out.shape[0] == 3 and all(torch.equal(buffers[k], v) for k, v in before.items())
    with pytest.raises(ValueError, match="x"):
        graphs.run(meta, {**rows, "x": rows["x"][:, :1]}, persistent)
