"""Issue #12 on the planned/graph path: DecodeGraphs' compiled CPU replay (CUDA-graph twins marked ``cuda``) ignores
NaN in slots no request owns, refuses out-of-range slots before the replay, and names bad configs and inputs."""
import pytest
import torch
from test_graph_decode import _batch, _plain, _setup

from compiled_attn.plan import plan_decode
from compiled_attn.runners.decode import DecodeGraphs, GraphConfig, RowInput


@pytest.fixture(scope="module", params=["tiny-mha", "tiny-mla"])
def warmed(request):
    torch._dynamo.reset()
    shape, step, graphs, persistent = _setup(model=request.param, buckets=[1, 4], max_kv=256)
    graphs.warmup(persistent)
    return shape, step, graphs, persistent  # out_cache_loc: an integer RowInput, checked by default


def _owned(persistent, meta):
    table, n = persistent["req_to_token"], meta.num_real
    owned = torch.zeros(persistent["k0"].shape[0], dtype=torch.bool)
    for row, lo, hi in zip(*(getattr(meta.inputs, f)[:n].tolist() for f in ("req_rows", "kv_lo", "kv_hi")),
                           strict=True):
        owned[table[row, lo:hi].long()] = True
    return owned


@pytest.mark.parametrize("bs", [1, 3, 4])
def test_replay_ignores_poisoned_unowned_slots(warmed, bs):
    shape, step, graphs, persistent = warmed
    meta, rows = _batch(shape, persistent, bs, torch.Generator().manual_seed(20 + bs))
    clean = {k: v.clone() for k, v in persistent.items()}
    expected = graphs.run(meta, rows, clean).clone()
    poisoned = {k: v.clone() for k, v in persistent.items()}
    owned = _owned(poisoned, meta)
    owned[rows["out_cache_loc"]] = False  # the new tokens' slots: written by the step before it reads them
    for t in poisoned.values():
        if t.is_floating_point():
            t[~owned] = float("nan")  # slot 0, free slots, the new tokens' slots before the write
    out = graphs.run(meta, rows, poisoned)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bad", [-1, "num_slots"])
def test_replay_refuses_out_of_range_table_slot(warmed, bad):
    """The issue's reproducer: -1 in req_to_token silently read the last slot in the compiled (MLA) step."""
    shape, _, graphs, persistent = warmed
    meta, rows = _batch(shape, persistent, 3, torch.Generator().manual_seed(30))
    table = persistent["req_to_token"]
    row = int(meta.inputs.req_rows[int(meta.inputs.kv_hi[:3].argmax())])
    keep = table[row, 0].clone()
    table[row, 0] = -1 if bad == -1 else persistent["k0"].shape[0]
    try:
        replanned = plan_decode(rows["x"], persistent["k0"], persistent["k0"][..., : shape.dv], table,
                                meta.inputs.req_rows[:3], meta.inputs.kv_hi[:3], check_slots=False)
        with pytest.raises(ValueError, match=rf"req_to_token\[{row}, 0\] = -?\d+ is not a KV slot"):
            graphs.run(replanned, rows, persistent)
        with pytest.raises(ValueError, match=rf"req_to_token\[{row}, 0\]"):  # plan's own check (default on)
            plan_decode(rows["x"], persistent["k0"], persistent["k0"][..., : shape.dv], table,
                        meta.inputs.req_rows[:3], meta.inputs.kv_hi[:3])
    finally:
        table[row, 0] = keep


@pytest.mark.parametrize("bad", [-1, 2048])
def test_replay_refuses_out_of_range_out_cache_loc(warmed, bad):
    shape, _, graphs, persistent = warmed
    meta, rows = _batch(shape, persistent, 2, torch.Generator().manual_seed(31))
    before = {k: v.clone() for k, v in persistent.items()}
    rows = dict(rows, out_cache_loc=torch.tensor([1, bad]))
    with pytest.raises(ValueError, match=r"out_cache_loc must hold KV slots in \[0, 2048\)"):
        graphs.run(meta, rows, persistent)
    for name, t in before.items():  # refused before the replay: nothing written
        assert torch.equal(t.nan_to_num(), persistent[name].nan_to_num())


def test_plain_step_refuses_out_of_range_loc():
    shape, step, _, persistent = _setup(buckets=[1], max_kv=256, compile=False)
    meta, rows = _batch(shape, persistent, 1, torch.Generator().manual_seed(32))
    with pytest.raises(ValueError, match="out_cache_loc"):
        _plain(step, meta, dict(rows, out_cache_loc=torch.tensor([-1])), persistent)


@pytest.mark.parametrize("name,value", [("x", lambda r: r["x"].half()), ("x", lambda r: r["x"].double()),
                                        ("out_cache_loc", lambda r: r["out_cache_loc"].float())])
def test_replay_refuses_inexact_input_dtype(warmed, name, value):
    shape, _, graphs, persistent = warmed
    meta, rows = _batch(shape, persistent, 2, torch.Generator().manual_seed(33))
    with pytest.raises(TypeError, match=f"'{name}'.*does not cast exactly"):
        graphs.run(meta, dict(rows, **{name: value(rows)}), persistent)


def test_int64_into_int32_input_is_refused():
    from graphs import BufferSpec, StaticBuffers
    b = StaticBuffers({"loc": BufferSpec((4,), torch.int32)}, "cpu")
    with pytest.raises(TypeError, match="'loc'.*int64.*does not cast exactly"):
        b.copy_in({"loc": torch.tensor([2**40])})
    b.copy_in({"loc": torch.tensor([1, 2], dtype=torch.int16)})  # a wider integer is exact


@pytest.mark.parametrize("field,value,exc", [
    ("block_size", 0, ValueError), ("block_size", -64, ValueError), ("block_size", 64.0, TypeError),
    ("max_batch_size", 0, ValueError), ("max_kv_tokens", -1, ValueError), ("torch_compile_max_bs", 0, ValueError),
    ("min_kv_tokens", 0, ValueError), ("max_context_len", 0, ValueError), ("warmup_iters", 0, ValueError),
    ("kv_growth", 1.0, ValueError), ("kv_growth", float("inf"), ValueError), ("cuda_graph_bs", [0, 4], ValueError),
    ("cuda_graph_bs", [], ValueError), ("max_batch_size", True, TypeError),
])
def test_graph_config_fields_are_validated(field, value, exc):
    with pytest.raises(exc, match=field):
        GraphConfig(**{field: value})


def test_warmup_needs_req_to_token():
    _, _, graphs, persistent = _setup(buckets=[1], max_kv=256, compile=False)
    del persistent["req_to_token"]
    with pytest.raises(ValueError, match="persistent must hold 'req_to_token'"):
        graphs.warmup(persistent)


def test_row_input_checks():
    with pytest.raises(TypeError, match="integer dtype"):
        RowInput((), torch.float32, slots=True)
    with pytest.raises(TypeError, match=r"row_inputs\['x'\] must be a RowInput"):
        DecodeGraphs(lambda i, p: i["x"], config=GraphConfig(progress=False), device="cpu",
                     row_inputs={"x": (4,)})


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["tiny-mha", "tiny-mla"])
def test_cuda_graph_replay_ignores_unowned_and_refuses_bad_slots(model):
    shape, step, graphs, persistent = _setup(device="cuda", model=model, buckets=[1, 4], max_kv=256)
    graphs.warmup(persistent)
    meta, rows = _batch(shape, persistent, 3, torch.Generator().manual_seed(34))
    expected = graphs.run(meta, rows, persistent).clone()
    owned = _owned({k: v.cpu() for k, v in persistent.items()}, meta).cuda()
    owned[rows["out_cache_loc"]] = True  # keep the new tokens' slots: the replay writes them again
    for t in persistent.values():
        if t.is_floating_point():
            t[~owned] = float("nan")
    out = graphs.run(meta, rows, persistent)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="out_cache_loc"):
        graphs.run(meta, dict(rows, out_cache_loc=torch.full_like(rows["out_cache_loc"], -1)), persistent)


def test_integer_row_inputs_are_checked_slots_unless_they_say_not():
    """An integer per-row input (a write location) is checked against the caches by default; token ids and
    positions opt out with ``slots=False``; floats and bools are never slots."""
    from compiled_attn.runners.decode import RowInput

    assert RowInput((), torch.int64).slots and RowInput((), torch.int32).slots
    assert not RowInput((), torch.int64, slots=False).slots
    assert not RowInput((4,), torch.float32).slots and not RowInput((), torch.bool).slots


def test_replay_refuses_metadata_whose_blocks_needed_is_short(warmed):
    """A hand-built DecodeMetadata whose ``blocks_needed`` is below what its ranges take would pick a bucket too
    small and drop keys: refused before the replay, naming the field."""
    import dataclasses

    shape, _, graphs, persistent = warmed
    meta, rows = _batch(shape, persistent, 3, torch.Generator().manual_seed(32))
    short = dataclasses.replace(meta, blocks_needed=1)
    with pytest.raises(ValueError, match=rf"metadata blocks_needed 1 is below the {meta.blocks_needed} blocks"):
        graphs.run(short, rows, persistent)
