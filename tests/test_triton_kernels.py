"""The Triton decode and verify kernels (``compiled_attn.kernels``) against a float64 reference written here.

Without CUDA they run on CPU tensors in Triton's interpreter (``triton_interpret``).
"""
import os

import pytest
import torch
from triton_interpret import DEVICE, import_kernels

td, _tv = import_kernels()
triton_verify = _tv.triton_verify

NAN_SLOT = 0  # holds NaN in the skipping test; no request reads it


# ---------------------------------------------------------------- inputs

def paged_table(lengths: list[int], page_size: int, num_slots: int, capacity: int, gen: torch.Generator,
                fill: int = NAN_SLOT) -> tuple[torch.Tensor, torch.Tensor]:
    """req_to_token: [len(lengths) + 1, capacity] int32, request b in row b + 1 (row 0 unused, as SGLang's padding
    row), pages of page_size consecutive slots at multiples of page_size, in random order, page 0 never used;
    entries past a request's length hold ``fill``. Returns (req_to_token, req_rows: [bs] int64)."""
    pages = (torch.randperm(num_slots // page_size - 1, generator=gen) + 1).tolist()
    table = torch.full((len(lengths) + 1, capacity), fill, dtype=torch.int32)
    for b, n in enumerate(lengths):
        for p in range(0, n, page_size):
            first = pages.pop() * page_size
            span = min(page_size, n - p)
            table[b + 1, p:p + span] = torch.arange(first, first + span, dtype=torch.int32)
    return table, torch.arange(1, len(lengths) + 1, dtype=torch.int64)


def random_caches(num_slots: int, hkv: int, dqk: int, dv: int, dtype: torch.dtype, gen: torch.Generator):
    """(k_cache, v_cache) in ``dtype`` (float32/bf16/fp16)."""
    k = torch.randn(num_slots, hkv, dqk, generator=gen).to(dtype)
    v = torch.randn(num_slots, hkv, dv, generator=gen).to(dtype)
    return k, v


def quantize(x: torch.Tensor, fp8: torch.dtype, scale: float) -> torch.Tensor:
    """A float8 cache storing ``x / scale``."""
    return (x / scale).to(fp8)


# ---------------------------------------------------------------- reference (float64, one request at a time)

def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
               cap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [n, Hq, D], k: [L, Hkv, D], v: [L, Hkv, Dv] (float64), visible: [n, L] bool -> [n, Hq, Dv].
    A row that sees no key gives 0."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("nhd,lhd->nhl", q, k) * scale
    if cap > 0:
        s = cap * torch.tanh(s / cap)
    s = s.masked_fill(~visible[:, None, :], float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[None, :, None].expand(s.shape[0], -1, 1)], -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)[..., :k.shape[0]]
    return torch.einsum("nhl,lhd->nhd", p, v)


def dequant(cache: torch.Tensor, scale: float) -> torch.Tensor:
    return cache.double() * scale


def decode_ref(q, k_cache, v_cache, table, rows, lo, hi, scale, *, cap=0.0, sinks=None, k_scale=1.0, v_scale=1.0):
    """[bs, Hq, Dv] float64: request b over positions [lo[b], hi[b]) of its table row."""
    kd, vd = dequant(k_cache, k_scale), dequant(v_cache, v_scale)
    out = torch.zeros(q.shape[0], q.shape[1], v_cache.shape[2], dtype=torch.float64)
    for b in range(q.shape[0]):
        slots = table[rows[b], lo[b]:hi[b]].long()
        visible = torch.ones(1, len(slots), dtype=torch.bool)
        out[b] = attend_ref(q[b:b + 1].double(), kd[slots], vd[slots], visible, scale, cap, sinks)[0]
    return out


def verify_ref(q, k_cache, v_cache, table, rows, lo, prefix, mask, scale, *, cap=0.0, sinks=None, window=None):
    """[bs * k, Hq, Dv] float64: token i of request b sees positions [lo, prefix) and draft key j iff mask[b, i, j];
    with a window, keys at (tree) positions >= its own position - window."""
    k = mask.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v_cache.shape[2], dtype=torch.float64)
    for b in range(mask.shape[0]):
        p0 = int(prefix[b])
        slots = table[rows[b], lo[b]:p0 + k].long()
        n_prefix = p0 - int(lo[b])
        visible = torch.cat([torch.ones(k, n_prefix, dtype=torch.bool), mask[b]], 1)
        if window is not None:
            depth = mask[b].sum(-1) - 1
            key_pos = torch.cat([torch.arange(int(lo[b]), p0), p0 + depth])
            visible &= key_pos[None, :] >= (p0 + depth - window)[:, None]
        rows_q = q[b * k:(b + 1) * k].double()
        out[b * k:(b + 1) * k] = attend_ref(rows_q, k_cache.double()[slots], v_cache.double()[slots], visible,
                                            scale, cap, sinks)
    return out


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


def to_device(*ts):
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in ts]


def run_decode(q, k_cache, v_cache, table, rows, lo, hi, **kw):
    q, k_cache, v_cache, table, rows, lo, hi = to_device(q, k_cache, v_cache, table, rows, lo, hi)
    if kw.get("sinks") is not None:
        kw["sinks"] = kw["sinks"].to(DEVICE)
    return td.triton_decode(q, k_cache, v_cache, table, rows, lo, hi, **kw).cpu()


# ---------------------------------------------------------------- decode

def decode_case(hq, hkv, d, dv, dtype, lengths, page_size=1, seed=0, q_dtype=None, lo=None):
    gen = torch.Generator().manual_seed(seed)
    num_slots = 512
    table, rows = paged_table(lengths, page_size, num_slots, capacity=128, gen=gen)
    k_cache, v_cache = random_caches(num_slots, hkv, d, dv, dtype, gen)
    q = torch.randn(len(lengths), hq, d, generator=gen).to(q_dtype or dtype)
    hi = torch.tensor(lengths, dtype=torch.int64)
    lo = torch.zeros_like(hi) if lo is None else torch.tensor(lo, dtype=torch.int64)
    return q, k_cache, v_cache, table, rows, lo, hi


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_heads_and_dtypes(hq, hkv, dtype):
    q, k, v, table, rows, lo, hi = decode_case(hq, hkv, 32, 32, dtype, [37, 1, 64], seed=hq + hkv)
    out = run_decode(q, k, v, table, rows, lo, hi, scale=32 ** -0.5, num_splits=2, block_n=16)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), decode_ref(q, k, v, table, rows, lo, hi, 32 ** -0.5),
                               atol=tolerance(dtype), rtol=tolerance(dtype))


def test_decode_fp32_query_over_bf16_cache():
    q, k, v, table, rows, lo, hi = decode_case(8, 2, 48, 16, torch.bfloat16, [20, 33], q_dtype=torch.float32)
    out = run_decode(q, k, v, table, rows, lo, hi, scale=0.1, num_splits=1, block_n=16)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), decode_ref(q, k, v, table, rows, lo, hi, 0.1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fp8,q_dtype,as_bytes", [(torch.float8_e4m3fn, torch.float32, True),
                                                  (torch.float8_e5m2, torch.float16, False)],
                         ids=["e4m3-uint8-fp32q", "e5m2-fp16q"])
def test_decode_float8_with_scales(fp8, q_dtype, as_bytes):
    q, k, v, table, rows, lo, hi = decode_case(8, 2, 32, 32, torch.float32, [45, 17], q_dtype=q_dtype)
    k8, v8 = quantize(k, fp8, 0.5), quantize(v, fp8, 2.0)
    kw = {"kv_float8_dtype": fp8} if as_bytes else {}
    kc, vc = (k8.view(torch.uint8), v8.view(torch.uint8)) if as_bytes else (k8, v8)
    out = run_decode(q, kc, vc, table, rows, lo, hi, scale=0.2, num_splits=2, block_n=16, k_scale=0.5,
                     v_scale=2.0, **kw)
    ref = decode_ref(q, k8, v8, table, rows, lo, hi, 0.2, k_scale=0.5, v_scale=2.0)
    tol = 1e-5 if q_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_pages_and_sliding_window(page_size):
    # kv_lo > 0: a sliding window's first position (not a page boundary)
    q, k, v, table, rows, lo, hi = decode_case(8, 2, 32, 32, torch.float32, [70, 9, 40], page_size=page_size,
                                               lo=[53, 0, 7])
    out = run_decode(q, k, v, table, rows, lo, hi, scale=0.2, page_size=page_size, num_splits=3, block_n=16)
    torch.testing.assert_close(out.double(), decode_ref(q, k, v, table, rows, lo, hi, 0.2), atol=1e-5, rtol=1e-5)


def test_decode_soft_cap_and_sinks_and_empty_row():
    q, k, v, table, rows, lo, hi = decode_case(8, 2, 32, 32, torch.float32, [50, 0, 23], seed=3)
    q = q * 4  # scores well past the cap
    sinks = torch.randn(8) + 1.0
    for cap, sk in ((5.0, None), (0.0, sinks), (5.0, sinks)):
        out = run_decode(q, k, v, table, rows, lo, hi, scale=0.3, num_splits=2, block_n=16, logit_cap=cap, sinks=sk)
        ref = decode_ref(q, k, v, table, rows, lo, hi, 0.3, cap=cap, sinks=sk)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(out[1], torch.zeros_like(out[1]))  # the padded row (kv_lo == kv_hi)


def test_decode_mla_absorbed_v_is_view_of_k():
    # MLA absorbed: one latent cache [S, 1, 576] whose first 512 columns are V (a strided view, never copied)
    q, k, _, table, rows, lo, hi = decode_case(16, 1, 576, 16, torch.float16, [21, 34], seed=5)
    v = k[..., :512]
    assert not v.is_contiguous()
    out = run_decode(q, k, v, table, rows, lo, hi, scale=576 ** -0.5, num_splits=2, block_n=16)
    assert out.shape == (2, 16, 512)
    torch.testing.assert_close(out.double(), decode_ref(q, k, v, table, rows, lo, hi, 576 ** -0.5),
                               atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------- work follows the real lengths

def expected_visits(lo: list[int], hi: list[int], hkv: int, num_splits: int, block_n: int) -> torch.Tensor:
    """[bs, Hkv, num_splits]: each program's share of its request's ceil((hi - lo) / block_n) blocks."""
    out = torch.zeros(len(lo), hkv, num_splits, dtype=torch.int32)
    for b, (a, z) in enumerate(zip(lo, hi, strict=True)):
        blocks = -(-max(z - a, 0) // block_n)
        per = -(-blocks // num_splits)
        for s in range(num_splits):
            out[b, :, s] = max(0, min(per, blocks - s * per))
    return out


def poison_unread(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, lo, hi):
    """NaN in every cache slot no request reads, and the NaN slot in every table entry outside [lo, hi)."""
    read = torch.zeros(k.shape[0], dtype=torch.bool)
    table = table.clone()
    for b in range(len(rows)):
        read[table[rows[b], lo[b]:hi[b]].long()] = True
        table[rows[b], :lo[b]] = NAN_SLOT
        table[rows[b], hi[b]:] = NAN_SLOT
    assert not read[NAN_SLOT]
    k, v = k.clone(), v.clone()
    k[~read] = float("nan")
    v[~read] = float("nan")
    return k, v, table


def test_decode_skips_blocks_past_each_length():
    lengths, lo_list, hkv, splits = [20, 1, 0, 45, 100], [0, 0, 0, 30, 0], 2, 4
    q, k, v, table, rows, lo, hi = decode_case(8, hkv, 32, 32, torch.float32, lengths, seed=7, lo=lo_list)
    ref = decode_ref(q, k, v, table, rows, lo, hi, 0.2)
    k, v, table = poison_unread(k, v, table, rows, lo_list, lengths)
    visited = torch.full((5, hkv, splits), -1, dtype=torch.int32, device=DEVICE)
    q_, k_, v_, table_, rows_, lo_, hi_ = to_device(q, k, v, table, rows, lo, hi)
    out = td.triton_decode(q_, k_, v_, table_, rows_, lo_, hi_, scale=0.2, num_splits=splits, block_n=16,
                           visited=visited).cpu()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # the table holds 128 positions per request (8 blocks): the programs loaded only the real ones
    assert torch.equal(visited.cpu(), expected_visits(lo_list, lengths, hkv, splits, 16))
    assert visited[4, 0].tolist() == [2, 2, 2, 1] and visited[2].sum() == 0
    assert int(visited.sum()) == hkv * (2 + 1 + 0 + 1 + 7)
    # the op (no debug tensor) gives the same output
    torch.testing.assert_close(run_decode(q, k, v, table, rows, lo, hi, scale=0.2, num_splits=splits, block_n=16),
                               out, atol=0, rtol=0)


# ---------------------------------------------------------------- verify

CHAIN = torch.tril(torch.ones(4, 4, dtype=torch.bool))
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)  # depths 0 1 1 2


def verify_case(hq, hkv, d, dv, dtype, prefixes, mask, seed=0, page_size=1):
    gen = torch.Generator().manual_seed(seed)
    k = mask.shape[0]
    table, rows = paged_table([p + k for p in prefixes], page_size, 512, capacity=128, gen=gen)
    k_cache, v_cache = random_caches(512, hkv, d, dv, dtype, gen)
    q = torch.randn(len(prefixes) * k, hq, d, generator=gen).to(dtype)
    masks = mask[None].expand(len(prefixes), -1, -1).contiguous()
    return q, k_cache, v_cache, table, rows, torch.tensor(prefixes, dtype=torch.int64), masks


def run_verify(q, k_cache, v_cache, table, rows, lo, prefix, mask, **kw):
    q, k_cache, v_cache, table, rows, lo, prefix, mask = to_device(q, k_cache, v_cache, table, rows, lo, prefix, mask)
    if kw.get("sinks") is not None:
        kw["sinks"] = kw["sinks"].to(DEVICE)
    return triton_verify(q, k_cache, v_cache, table, rows, lo, prefix, mask, **kw).cpu()


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_verify_chain_and_tree(shape, dtype):
    mask, page_size = (CHAIN, 1) if shape == "chain" else (TREE, 4)
    q, k, v, table, rows, prefix, mask = verify_case(8, 2, 32, 32, dtype, [40, 0, 17], mask, page_size=page_size)
    lo = torch.zeros_like(prefix)
    out = run_verify(q, k, v, table, rows, lo, prefix, mask, scale=0.2, num_splits=2, block_n=16,
                     page_size=page_size)
    assert out.shape == (12, 8, 32) and out.dtype == dtype
    torch.testing.assert_close(out.double(), verify_ref(q, k, v, table, rows, lo, prefix, mask, 0.2),
                               atol=tolerance(dtype), rtol=tolerance(dtype))


def test_verify_sinks_soft_cap_window_and_skipping():
    q, k, v, table, rows, prefix, mask = verify_case(4, 1, 16, 32, torch.float32, [50, 3], TREE, seed=2)
    q = q * 4
    sinks = torch.randn(4)
    window = 20
    lo = (prefix - window).clamp_min(0)  # the shallowest token's window start: every deeper one starts later
    ref = verify_ref(q, k, v, table, rows, lo, prefix, mask, 0.3, cap=4.0, sinks=sinks, window=window)
    hi = (prefix + 4).tolist()
    k, v, table = poison_unread(k, v, table, rows, lo.tolist(), hi)
    visited = torch.full((2, 1, 4), -1, dtype=torch.int32, device=DEVICE)
    args = to_device(q, k, v, table, rows, lo, prefix, mask)
    kw = {"scale": 0.3, "num_splits": 4, "block_n": 16, "logit_cap": 4.0, "sliding_window": window}
    out = triton_verify(*args, sinks=sinks.to(DEVICE), visited=visited, **kw).cpu()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(visited.cpu(), expected_visits(lo.tolist(), hi, 1, 4, 16))
    torch.testing.assert_close(run_verify(q, k, v, table, rows, lo, prefix, mask, sinks=sinks, **kw), out,
                               atol=0, rtol=0)


def test_verify_float8_gqa():
    q, k, v, table, rows, prefix, mask = verify_case(8, 2, 32, 16, torch.float32, [30], CHAIN[:3, :3], seed=4)
    k8, v8 = quantize(k, torch.float8_e4m3fn, 0.25), quantize(v, torch.float8_e4m3fn, 0.5)
    lo = torch.zeros_like(prefix)
    out = run_verify(q, k8.view(torch.uint8), v8.view(torch.uint8), table, rows, lo, prefix, mask, scale=0.2,
                     num_splits=1, block_n=32, k_scale=0.25, v_scale=0.5, kv_float8_dtype=torch.float8_e4m3fn)
    ref = verify_ref(q, dequant(k8, 0.25), dequant(v8, 0.5), table, rows, lo, prefix, mask, 0.2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- argument checks

def _decode_args():
    q, k, v, table, rows, lo, hi = decode_case(8, 2, 32, 32, torch.float32, [5, 9])
    return {"q": q, "k_cache": k, "v_cache": v, "req_to_token": table, "req_rows": rows, "kv_lo": lo, "kv_hi": hi,
            "scale": 0.1, "num_splits": 2, "block_n": 16}


@pytest.mark.parametrize("change,name", [
    ({"q": torch.randn(2, 5, 32)}, "q heads"),
    ({"q": torch.randn(2, 8, 24), "k_cache": torch.randn(512, 2, 24)}, "head dim"),
    ({"q": torch.randn(2, 8, 32, dtype=torch.float64)}, "q dtype"),
    ({"req_rows": torch.tensor([1, 2], dtype=torch.int32)}, "req_rows"),
    ({"kv_lo": torch.zeros(2)}, "kv_lo"),
    ({"kv_hi": torch.tensor([5])}, "kv_hi"),
    ({"req_to_token": torch.zeros(3, 128, dtype=torch.int64)}, "req_to_token"),
    ({"num_splits": 0}, "num_splits"),
    ({"block_n": 24}, "block_n"),
    ({"sinks": torch.zeros(3)}, "sinks"),
    ({"k_cache": torch.zeros(512, 2, 32, dtype=torch.uint8), "v_cache": torch.zeros(512, 2, 32, dtype=torch.uint8)},
     "kv_float8_dtype"),
    ({"v_cache": torch.randn(100, 2, 32)}, "v_cache"),
    ({"page_size": 0}, "page_size"),
])
def test_decode_bad_arguments(change, name):
    args = {**_decode_args(), **change}
    with pytest.raises(ValueError, match=name):
        td.triton_decode(**args)


def test_verify_bad_arguments():
    q, k, v, table, rows, prefix, mask = verify_case(8, 2, 32, 32, torch.float32, [5, 9], CHAIN)
    lo = torch.zeros_like(prefix)
    with pytest.raises(ValueError, match="q must have bs"):
        triton_verify(q[:-1], k, v, table, rows, lo, prefix, mask, scale=0.1, num_splits=1, block_n=16)
    with pytest.raises(ValueError, match="draft_mask"):
        triton_verify(q, k, v, table, rows, lo, prefix, mask.int(), scale=0.1, num_splits=1, block_n=16)
    with pytest.raises(ValueError, match="sliding_window"):
        triton_verify(q, k, v, table, rows, lo, prefix, mask, scale=0.1, num_splits=1, block_n=16, sliding_window=-2)


# ---------------------------------------------------------------- torch.compile keeps the ops in one graph

def test_fullgraph_compile_calls_the_ops():
    from torch._dynamo.testing import CompileCounterWithBackend

    q, k, v, table, rows, lo, hi = to_device(*decode_case(8, 2, 32, 32, torch.float32, [30, 12]))
    qv, kv, vv, tv, rv, prefix, mask = to_device(*verify_case(8, 2, 32, 32, torch.float32, [25], CHAIN))
    sinks = torch.randn(8, device=DEVICE)

    def step(q, lo, hi, qv, prefix):
        dec = td.triton_decode(q, k, v, table, rows, lo, hi, scale=0.2, num_splits=2, block_n=16, sinks=sinks)
        ver = triton_verify(qv, kv, vv, tv, rv, torch.zeros_like(prefix), prefix, mask, scale=0.2, num_splits=2,
                            block_n=16)
        return dec, ver

    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    got, want = compiled(q, lo, hi, qv, prefix), step(q, lo, hi, qv, prefix)
    assert counter.frame_count == 1
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    ops = {n.target for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert {torch.ops.compiled_attn.triton_decode, torch.ops.compiled_attn.triton_verify} <= ops
    # new lengths, same shapes: no recompile
    compiled(q, lo, hi - 3, qv, prefix - 2)
    assert counter.frame_count == 1


# ---------------------------------------------------------------- the real compiler accepts the kernels

_COMPILE_FOR_SM90 = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from compiled_attn.kernels import triton_decode as td

assert not td.is_interpreted()
FLOATS = {"sm_scale", "logit_cap", "v_scale"}


def signature(kernel, pointers, constexprs):
    sig = {}
    for p in kernel.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            sig[p.name] = pointers.get(p.name, "*fp32")
        else:
            sig[p.name] = "fp32" if p.name in FLOATS else "i64"
    return ASTSource(kernel, sig, constexprs)


def partials(kv, q, fp8, compute, dqk, dv, group, draft, block_n, flags):
    d_main, d_tail = td.head_dim_chunks(dqk)
    block_m, block_dv = max(16, triton.next_power_of_2(draft * group)), triton.next_power_of_2(dv)
    cons = dict(DQK=dqk, DV=dv, GROUP=group, DRAFT=draft, NUM_SPLITS=4, BLOCK_M=block_m, BLOCK_N=block_n,
                D_MAIN=d_main, D_TAIL=d_tail, BLOCK_DV=block_dv, FP8=fp8, COMPUTE=compute,
                HAS_CAP=flags, HAS_DRAFT_MASK=flags, HAS_WINDOW=flags, HAS_VISITED=flags)
    pointers = {"q_ptr": "*" + q, "k_ptr": "*" + kv, "v_ptr": "*" + kv, "r2t_ptr": "*i32", "rows_ptr": "*i64",
                "lo_ptr": "*i64", "hi_ptr": "*i64", "prefix_ptr": "*i64", "dmask_ptr": "*u8", "depth_ptr": "*i32",
                "visited_ptr": "*i32"}
    warps = td.launch_warps(block_m, block_n, d_main, block_dv)
    return signature(td._partials_kernel, pointers, cons), warps


target = GPUTarget("cuda", 90, 32)
for src, warps in [partials("fp16", "fp16", 0, 2, 128, 128, 4, 1, 32, False),
                   partials("u8", "bf16", 1, 1, 576, 512, 16, 1, 16, False),
                   partials("fp32", "fp32", 0, 0, 80, 48, 2, 3, 16, True)]:
    triton.compile(src, target=target, options={"num_warps": warps, "num_stages": 2})
merge = dict(DV=512, NUM_SPLITS=4, BLOCK_DV=512, HAS_SINKS=True)
triton.compile(signature(td._merge_kernel, {"out_ptr": "*bf16"}, merge), target=target, options={"num_warps": 4})
print("compiled")
'''


def test_kernels_compile_for_sm90_without_a_gpu(tmp_path):
    """The interpreter runs Python and accepts code Triton's compiler rejects (scoping, loop-carried types, dot
    shapes): compile decode (GQA fp16), MLA (576/512 over a float8 cache) and verify (mask, window, cap, visited)
    for sm_90 through ptxas, in a process that imports the kernels as GPU kernels."""
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia", reason="triton's NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled afresh, not found in a cache
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
