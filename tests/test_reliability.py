"""Issue #12, one reproducer per defect, eager and compiled (CUDA twins marked ``cuda``): strided queries, NaN in slots
no request owns, out-of-range slots, bad scale / logit_cap, empty decode, and arguments that failed deep inside."""
import math
import re

import pytest
import torch

from compiled_attn import decode_attention, extend_attention
from compiled_attn.bench.batches import make_batch
from compiled_attn.compile_policy import compile_step
from compiled_attn.decode import build_decode_index, decode_blocks
from compiled_attn.extend import build_extend_tile_index, extend_tiles, plan_extend_tiles
from compiled_attn.kv import write_kv
from compiled_attn.plan import plan_decode, plan_extend


def _decode_fn(q, k_cache, v_cache, table, inputs, scale, form):
    return decode_blocks(q, k_cache, v_cache, build_decode_index(table, inputs), scale, form=form)


_compiled_decode = compile_step(_decode_fn)


def _decode(b, q, *, compiled=False, form="auto", scale=0.125):
    meta = plan_decode(q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens)
    fn = _compiled_decode if compiled else _decode_fn
    return fn(q, b.k_cache, b.v_cache, b.req_to_token, meta.inputs, scale, form)


def _poison_unowned(b, lo, hi):
    """NaN into every slot no request reads (positions [lo[i], hi[i]) of its row), slot 0 included."""
    owned = torch.zeros(b.k_cache.shape[0], dtype=torch.bool, device=b.k_cache.device)
    for row, a, z in zip(b.rows.tolist(), lo.tolist(), hi.tolist(), strict=True):
        owned[b.req_to_token[row, a:z].long()] = True
    b.k_cache[~owned] = float("nan")
    if b.v_cache.untyped_storage().data_ptr() != b.k_cache.untyped_storage().data_ptr():
        b.v_cache[~owned] = float("nan")
    return owned


# ---- 1. a query whose head dim is not contiguous ----

@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("bs,form", [(1, "auto"), (1, "matmul"), (3, "auto"), (3, "matmul")])
def test_strided_query_equals_contiguous(bs, form, compiled):
    b = make_batch([70] * bs, hq=8, hkv=2, dqk=64, decode=True, seed=1)
    q = torch.randn(bs, 64, 8).transpose(1, 2)  # [bs, 8, 64], head dim strided: the reproducer
    assert q.stride(-1) != 1
    out = _decode(b, q, compiled=compiled, form=form)
    torch.testing.assert_close(out, _decode(b, q.contiguous(), form=form), atol=1e-5, rtol=1e-5)


def test_strided_query_public_functions():
    b = make_batch([70], hq=8, hkv=2, dqk=64, decode=True, seed=2)
    q = torch.randn(1, 64, 8).transpose(1, 2)
    args = (b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens)
    torch.testing.assert_close(decode_attention(q, *args), decode_attention(q.contiguous(), *args))
    e = make_batch([9, 5], [3, 0], hq=8, hkv=2, dqk=64, seed=3)
    qe = e.q.transpose(0, 2).contiguous().transpose(0, 2)  # same values, strided head dim
    eargs = (e.k_cache, e.v_cache, e.req_to_token, e.rows, e.seq_lens, e.prefix_lens, e.ext_lens)
    torch.testing.assert_close(extend_attention(qe, *eargs), extend_attention(e.q, *eargs))


# ---- 2. NaN/Inf in slots no request owns ----

def _decode_batch(lens, seed=0):
    b = make_batch(lens, hq=4, hkv=2, dqk=16, decode=True, seed=seed)
    q = torch.randn(len(lens), 4, 16, generator=torch.Generator().manual_seed(seed))
    return b, q


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("lens,form", [([70], "auto"), ([70], "matmul"), ([5, 70, 0, 130], "auto"),
                                       ([5, 70, 0, 130], "matmul")])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_decode_ignores_unowned_slots(lens, form, compiled, poison):
    b, q = _decode_batch(lens, seed=4)
    clean = _decode(b, q, compiled=compiled, form=form)
    owned = _poison_unowned(b, torch.zeros(len(lens), dtype=torch.long), b.seq_lens)
    b.k_cache[~owned] = poison
    out = _decode(b, q, compiled=compiled, form=form)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, clean, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("cap", [None, 5.0])
@pytest.mark.parametrize("window", [None, 3])
def test_extend_ignores_unowned_slots(window, cap):
    b = make_batch([9, 5, 0, 12], [3, 0, 0, 12], hq=4, hkv=2, dqk=16, seed=5)
    args = (b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens, b.ext_lens)
    clean = extend_attention(*args, sliding_window=window, logit_cap=cap)
    _poison_unowned(b, torch.zeros(4, dtype=torch.long), b.seq_lens)
    out = extend_attention(*args, sliding_window=window, logit_cap=cap)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, clean, atol=1e-6, rtol=1e-6)


def test_extend_query_without_keys_reads_poisoned_pad_slot():
    """Cross-attention with an empty encoder: the query sees no key, reads the padding slot, must give zeros."""
    b = make_batch([3], hq=4, hkv=2, dqk=16, encoder_lens=[0], seed=6)
    b.k_cache[0], b.v_cache[0] = float("nan"), float("nan")
    out = extend_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                           b.ext_lens, encoder_lens=b.encoder_lens, is_cross_attn=True)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("form", ["kernel", "matmul"])
def test_extend_compiled_ignores_unowned_slots(form):
    b = make_batch([9, 5, 12], [3, 0, 12], hq=4, hkv=2, dqk=16, seed=7)

    def step(q, k, v, table, inputs):
        index = build_extend_tile_index(table, inputs, causal=True, sliding_window=None, with_mask=form != "kernel")
        return extend_tiles(q, k, v, index, 0.25, form=form)

    meta = plan_extend(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens, b.ext_lens,
                       batch_capacity=4)
    tiles = plan_extend_tiles(meta, tile_q=8, tile_k=8, pair_capacity=32)  # padded as a bucket would be
    compiled = compile_step(step)
    clean = compiled(b.q, b.k_cache, b.v_cache, b.req_to_token, tiles.inputs)
    _poison_unowned(b, torch.zeros(3, dtype=torch.long), b.seq_lens)
    out = compiled(b.q, b.k_cache, b.v_cache, b.req_to_token, tiles.inputs)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, clean, atol=1e-6, rtol=1e-6)


# ---- 3. slots outside [0, num_slots) ----

@pytest.mark.parametrize("bad", [-1, "num_slots", 10**6])
@pytest.mark.parametrize("fn", ["decode", "extend", "plan_decode", "plan_extend"])
def test_out_of_range_table_slot_is_named(fn, bad):
    b = make_batch([5, 9], [4, 8], hq=4, hkv=2, dqk=16, seed=8)
    num_slots = b.k_cache.shape[0]
    b.req_to_token[int(b.rows[1]), 3] = num_slots if bad == "num_slots" else bad
    dq = torch.randn(2, 4, 16)
    calls = {
        "decode": lambda: decode_attention(dq, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens),
        "extend": lambda: extend_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens,
                                           b.prefix_lens, b.ext_lens),
        "plan_decode": lambda: plan_decode(dq, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens),
        "plan_extend": lambda: plan_extend(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens,
                                           b.prefix_lens, b.ext_lens),
    }
    with pytest.raises(ValueError, match=re.escape(f"req_to_token[{int(b.rows[1])}, 3]") + f".*\\[0, {num_slots}\\)"):
        calls[fn]()


def test_out_of_range_beyond_the_read_range_is_ignored():
    """Only the entries a batch reads are checked: stale entries past a request's length are SGLang's normal."""
    b = make_batch([5, 9], hq=4, hkv=2, dqk=16, decode=True, seed=9)
    b.req_to_token[int(b.rows[0]), 5:] = -1
    q = torch.randn(2, 4, 16)
    decode_attention(q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens)


@pytest.mark.parametrize("bad_at, named", [(2, False), (18, False), (10, True), (16, True)])
def test_one_request_checks_its_read_range_only(bad_at, named):
    """A batch of one checks the slots of its own read range (a view of its table row): with a window of 6 keys
    over 17 positions it reads positions [10, 17); a bad entry before (2) or past (18) that range is stale."""
    b = make_batch([17], hq=4, hkv=2, dqk=16, decode=True, seed=11)
    row = int(b.rows[0])
    b.req_to_token[row, bad_at] = -1
    q = torch.randn(1, 4, 16)

    def plan():
        return plan_decode(q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, sliding_window=6)

    if named:
        with pytest.raises(ValueError, match=re.escape(f"req_to_token[{row}, {bad_at}] = -1 is not a KV slot")):
            plan()
    else:
        assert plan().slots_checked


def test_check_slots_switch():
    b = make_batch([5], hq=4, hkv=2, dqk=16, decode=True, seed=10)
    b.req_to_token[int(b.rows[0]), 0] = -1
    q = torch.randn(1, 4, 16)
    meta = plan_decode(q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, check_slots=False)
    assert not meta.slots_checked
    with pytest.raises(ValueError, match="req_to_token"):
        plan_decode(q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens)


@pytest.mark.parametrize("bad", [-1, 16])
def test_write_kv_refuses_out_of_range_loc(bad):
    cache = torch.zeros(16, 2, 4)
    with pytest.raises(ValueError, match=r"loc \(out_cache_loc\) must hold KV slots in \[0, 16\)"):
        write_kv(cache, torch.tensor([3, bad]), torch.ones(2, 2, 4))
    assert cache.abs().sum() == 0  # nothing written


# ---- 4. scale and logit_cap ----

@pytest.mark.parametrize("value,exc", [(float("nan"), ValueError), (float("inf"), ValueError), (0.0, ValueError),
                                       (-1.0, ValueError), ("abc", TypeError), (True, TypeError)])
@pytest.mark.parametrize("name", ["scale", "logit_cap"])
@pytest.mark.parametrize("fn", ["decode", "extend"])
def test_scale_and_cap_must_be_finite_positive(fn, name, value, exc):
    b = make_batch([5, 9], [4, 8], hq=4, hkv=2, dqk=16, seed=11)
    if fn == "decode":
        call = lambda **kw: decode_attention(torch.randn(2, 4, 16), b.k_cache, b.v_cache, b.req_to_token,  # noqa
                                             b.rows, b.seq_lens, **kw)
    else:
        call = lambda **kw: extend_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens,  # noqa
                                             b.prefix_lens, b.ext_lens, **kw)
    with pytest.raises(exc, match=f"{name} must be a finite number > 0"):
        call(**{name: value})


def test_decode_blocks_validates_scale():
    b, q = _decode_batch([5])
    meta = plan_decode(q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens)
    with pytest.raises(ValueError, match="scale"):
        decode_blocks(q, b.k_cache, b.v_cache, build_decode_index(b.req_to_token, meta.inputs), math.nan)


# ---- 5. an empty decode batch ----

@pytest.mark.parametrize("mla", [False, True])
def test_empty_decode_batch(mla):
    b = make_batch([5], hq=4, hkv=1, dqk=24, dv=16, mla=mla, decode=True)
    empty = torch.zeros(0, dtype=torch.int64)
    out = decode_attention(torch.randn(0, 4, 24), b.k_cache, b.v_cache, b.req_to_token, empty, empty)
    assert out.shape == (0, 4, 16)


# ---- arguments that failed deep inside ----

def _dec_args(**over):
    b = make_batch([5, 9], hq=4, hkv=2, dqk=16, decode=True, seed=12)
    args = dict(q=torch.randn(2, 4, 16), k_cache=b.k_cache, v_cache=b.v_cache, req_to_token=b.req_to_token,
                req_pool_indices=b.rows, seq_lens=b.seq_lens)
    args.update(over)
    return args


@pytest.mark.parametrize("over,exc,words", [
    (dict(q=torch.randn(2, 4, 16, device="meta")), ValueError, "q is on the meta device"),
    (dict(sliding_window=True), ValueError, "sliding_window must be a non-negative int"),
    (dict(q=torch.randn(2, 4, 0), k_cache=torch.randn(30, 2, 0), v_cache=torch.randn(30, 2, 0)), ValueError,
     "head dim must be >= 1"),
    (dict(k_cache=torch.randn(0, 2, 16), v_cache=torch.randn(0, 2, 16)), ValueError, "k_cache must have >= 1 slot"),
])
def test_poor_arguments_are_named(over, exc, words):
    args = _dec_args(**over)
    window = args.pop("sliding_window", None)
    with pytest.raises(exc, match=re.escape(words)):
        decode_attention(**args, sliding_window=window)


@pytest.mark.parametrize("block_size,exc", [(0, ValueError), (-64, ValueError), (64.0, TypeError), (True, TypeError)])
def test_plan_decode_block_size(block_size, exc):
    a = _dec_args()
    with pytest.raises(exc, match="block_size must be an int >= 1"):
        plan_decode(a["q"], a["k_cache"], a["v_cache"], a["req_to_token"], a["req_pool_indices"], a["seq_lens"],
                    block_size=block_size)


# ---- CUDA twins ----

@pytest.mark.cuda
def test_cuda_strided_query_and_poisoned_slots():
    b, _ = _decode_batch([5, 70, 0, 130], seed=13)
    for name in ("k_cache", "v_cache", "req_to_token", "rows", "seq_lens"):
        setattr(b, name, getattr(b, name).cuda())
    q = torch.randn(4, 16, 4, device="cuda").transpose(1, 2)
    clean = _decode(b, q)
    torch.testing.assert_close(clean, _decode(b, q.contiguous()))
    _poison_unowned(b, torch.zeros(4, dtype=torch.long), b.seq_lens.cpu())
    out = _decode(b, q)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, clean, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_cuda_out_of_range_slot_is_named():
    b = make_batch([5, 9], hq=4, hkv=2, dqk=16, decode=True, seed=14)
    table = b.req_to_token.cuda()
    table[int(b.rows[1]), 2] = -1
    with pytest.raises(ValueError, match="req_to_token"):
        plan_decode(torch.randn(2, 4, 16, device="cuda"), b.k_cache.cuda(), b.v_cache.cuda(), table, b.rows.cuda(),
                    b.seq_lens.cuda())
    with pytest.raises(ValueError, match="out_cache_loc"):
        write_kv(b.k_cache.cuda(), torch.tensor([-1], device="cuda"), torch.ones(1, 2, 16, device="cuda"))
