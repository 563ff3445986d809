"""Property (issue #12): whatever sits in a slot no request reads (NaN, inf), every decode form and both forms of
the tiled extend give the same, finite output, eager and compiled."""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiled_attn.bench.batches import make_batch
from compiled_attn.compile_policy import compile_step
from compiled_attn.decode import build_decode_index, decode_blocks
from compiled_attn.extend import build_extend_tile_index, extend_tiles, plan_extend_tiles
from compiled_attn.plan import plan_decode, plan_extend

EAGER = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
COMPILED = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FORMS = {"auto": "auto", "matmul": "matmul", "single": "auto"}  # "single": bs=1, indexed on the host eagerly


def _decode_step(q, k, v, table, inputs, form):
    return decode_blocks(q, k, v, build_decode_index(table, inputs), 0.3, form=form)


def _extend_step(q, k, v, table, inputs, causal, window, cap, form):
    index = build_extend_tile_index(table, inputs, causal=causal, sliding_window=window, with_mask=form != "kernel")
    return extend_tiles(q, k, v, index, 0.3, cap, form=form)


_compiled_decode = compile_step(_decode_step)
_compiled_extend = compile_step(_extend_step)


def _poison(b, rows, lo, hi, value):
    """``value`` into every slot outside the batch's read ranges (slot 0 and the free slots included)."""
    read = torch.zeros(b.k_cache.shape[0], dtype=torch.bool)
    for row, a, z in zip(rows.tolist(), lo.tolist(), hi.tolist(), strict=True):
        read[b.req_to_token[row, a:z].long()] = True
    b.k_cache[~read] = value
    b.v_cache[~read] = value


def _check_decode(lens, heads, window, form, seed, value, fn):
    hq, hkv = heads
    if form == "single":
        lens = lens[:1]
    b = make_batch(lens, hq=hq, hkv=hkv, dqk=16, decode=True, seed=seed)
    q = torch.randn(len(lens), hq, 16, generator=torch.Generator().manual_seed(seed))
    meta = plan_decode(q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, sliding_window=window,
                       block_size=16, block_capacity=None if seed % 2 else 64)  # exact, or a bucket's spare blocks
    clean = fn(q, b.k_cache, b.v_cache, b.req_to_token, meta.inputs, FORMS[form])
    n = len(lens)
    _poison(b, meta.inputs.req_rows[:n], meta.inputs.kv_lo[:n], meta.inputs.kv_hi[:n], value)
    out = fn(q, b.k_cache, b.v_cache, b.req_to_token, meta.inputs, FORMS[form])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, clean, atol=1e-6, rtol=1e-6)


def _check_extend(reqs, heads, causal, window, cap, seed, value, fn):
    hq, hkv = heads
    prefix, seq = [p for p, _ in reqs], [p + n for p, n in reqs]
    b = make_batch(seq, prefix, hq=hq, hkv=hkv, dqk=16, seed=seed)
    meta = plan_extend(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens, b.ext_lens,
                       causal=causal, sliding_window=window, batch_capacity=len(reqs) + seed % 3)
    if meta.num_tokens == 0:
        return
    form = "kernel" if cap is None and seed % 2 == 0 else "matmul"  # the kernel has no soft-cap
    tiles = plan_extend_tiles(meta, tile_q=8, tile_k=8, pair_capacity=None if seed % 3 else 256)
    args = (b.q, b.k_cache, b.v_cache, b.req_to_token, tiles.inputs, meta.causal, meta.sliding_window, cap, form)
    clean = fn(*args)
    n, i = len(reqs), meta.inputs
    _poison(b, i.req_rows[:n], i.kv_lo[:n], i.kv_lo[:n] + i.kv_len[:n], value)
    out = fn(*args)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, clean, atol=1e-6, rtol=1e-6)


lens_st = st.lists(st.integers(0, 150), min_size=1, max_size=6)
heads_st = st.sampled_from([(1, 1), (4, 2), (8, 1), (6, 3)])
window_st = st.one_of(st.none(), st.integers(0, 40))
form_st = st.sampled_from(list(FORMS))
value_st = st.sampled_from([float("nan"), float("inf"), float("-inf")])
reqs_st = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 30)), min_size=1, max_size=5)
cap_st = st.one_of(st.none(), st.floats(0.5, 50.0))


@EAGER
@given(lens=lens_st, heads=heads_st, window=window_st, form=form_st, seed=st.integers(0, 2**16), value=value_st)
def test_decode_unowned_slots_never_reach_outputs(lens, heads, window, form, seed, value):
    _check_decode(lens, heads, window, form, seed, value, _decode_step)


@COMPILED
@given(lens=lens_st, window=window_st, form=form_st, seed=st.integers(0, 2**16), value=value_st)
def test_decode_unowned_slots_never_reach_outputs_compiled(lens, window, form, seed, value):
    _check_decode(lens, (4, 2), window, form, seed, value, _compiled_decode)


@EAGER
@given(reqs=reqs_st, heads=heads_st, causal=st.booleans(), window=window_st, cap=cap_st,
       seed=st.integers(0, 2**16), value=value_st)
def test_extend_unowned_slots_never_reach_outputs(reqs, heads, causal, window, cap, seed, value):
    _check_extend(reqs, heads, causal, window, cap, seed, value, _extend_step)


@COMPILED
@given(reqs=reqs_st, causal=st.booleans(), window=st.sampled_from([None, 3]), seed=st.integers(0, 2**16),
       value=value_st)
def test_extend_unowned_slots_never_reach_outputs_compiled(reqs, causal, window, seed, value):
    _check_extend(reqs, (4, 2), causal, window, None, seed, value, _compiled_extend)
