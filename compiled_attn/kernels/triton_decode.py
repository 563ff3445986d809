"""Paged split-KV decode attention in Triton whose work follows each request's real length.

A CUDA graph fixes the launch grid, not the work: one program per (request, KV head, split) reads the request's key
range ``[kv_lo, kv_hi)`` from device memory and loops only over the key blocks inside it, so a step over short
requests costs what their lengths cost even when its shapes are those of the KV pool's capacity. Each program
holds all ``Hq // Hkv`` query heads of its KV head as the rows of one query tile (each K/V tile is read once for
the group) and writes float32 partials (running max, sum, unnormalised output); a second kernel merges the splits
by log-sum-exp and adds the sinks to each row's denominator.

The same partials kernel serves speculative verify (``triton_verify``): there the rows are ``k`` draft tokens times
the group, and the keys at and after ``prefix_len`` (the draft keys) are masked per row.

Ops: ``torch.ops.compiled_attn.triton_decode`` (``torch.library.triton_op``: ``torch.compile`` keeps the kernels in
its graph). Under ``TRITON_INTERPRET=1`` (read by ``triton.jit`` when this module is imported) the kernels run on
CPU tensors through Triton's interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ..kv import compute_dtype
from .triton_checks import check_extras, check_kv, check_rows, check_settings

COMPUTE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _to_compute(x, COMPUTE: tl.constexpr):
    """``x`` in the dtype the dot products take: 0 float32, 1 bfloat16, 2 float16."""
    if COMPUTE == 0:
        return x.to(tl.float32)
    elif COMPUTE == 1:
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float16)


@triton.jit
def _load_kv(ptrs, mask, FP8: tl.constexpr, COMPUTE: tl.constexpr):
    """A K or V tile in the compute dtype; float8 caches arrive as raw bytes (SGLang keeps them as uint8)."""
    if FP8 == 0:
        x = tl.load(ptrs, mask=mask, other=0.0)
    else:
        raw = tl.load(ptrs, mask=mask, other=0)
        if FP8 == 1:
            x = raw.to(tl.float8e4nv, bitcast=True)
        else:
            x = raw.to(tl.float8e5, bitcast=True)
    return _to_compute(x, COMPUTE)


@triton.jit
def _dot(a, b, acc, COMPUTE: tl.constexpr):
    """``acc + a @ b`` in float32; float32 operands in full precision (TF32 would lose the 1e-5 agreement)."""
    if COMPUTE == 0:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


# Only triton.language's core builtins and this module's jit functions are used: tl.max / tl.sum / tl.cdiv /
# tl.zeros are jit functions of triton.language.standard, decorated when triton is first imported, so under
# TRITON_INTERPRET=1 set after that import (a test process that imported triton earlier) they would be compiled
# kernels that the interpreter cannot call.
@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add_combine(a, b):
    return a + b


@triton.jit
def _partials_kernel(
    q_ptr, k_ptr, v_ptr, r2t_ptr, rows_ptr, lo_ptr, hi_ptr, prefix_ptr, dmask_ptr, depth_ptr,
    m_ptr, l_ptr, o_ptr, visited_ptr,
    stride_qt, stride_qh, stride_qd, stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd,
    stride_rr, stride_rp, stride_mb, stride_mi, stride_mj,
    sm_scale, logit_cap, v_scale, window, num_q_heads,
    DQK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr, DRAFT: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr,
    BLOCK_DV: tl.constexpr, FP8: tl.constexpr, COMPUTE: tl.constexpr, HAS_CAP: tl.constexpr,
    HAS_DRAFT_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_VISITED: tl.constexpr,
):
    """Program (b, kv head, split): its split's share of the key blocks of ``[lo[b], hi[b])`` for the tile of
    ``DRAFT * GROUP`` query rows (row r: query token ``r // GROUP``, head ``kv_head * GROUP + r % GROUP``).

    Writes m, l: [T, Hq, NUM_SPLITS] and o: [T, Hq, NUM_SPLITS, DV] (T = bs * DRAFT; o unnormalised, times
    v_scale); a split with no blocks writes (-inf, 0, 0). With HAS_DRAFT_MASK a key at position ``p >= prefix[b]``
    is draft key ``p - prefix[b]``, seen by token i iff dmask[b, i, p - prefix[b]] != 0."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows_ptr + b).to(tl.int64)
    lo = tl.load(lo_ptr + b).to(tl.int32)
    hi = tl.load(hi_ptr + b).to(tl.int32)
    # the real range decides the loop bounds: blocks past hi are never visited, whatever the grid
    n_blocks = (tl.maximum(hi - lo, 0) + BLOCK_N - 1) // BLOCK_N
    per_split = (n_blocks + NUM_SPLITS - 1) // NUM_SPLITS
    blk_start = split * per_split
    blk_end = tl.minimum(blk_start + per_split, n_blocks)

    r = tl.arange(0, BLOCK_M)
    tok = r // GROUP
    head = kvh * GROUP + r % GROUP
    row_ok = r < DRAFT * GROUP
    t = (b * DRAFT + tok).to(tl.int64)
    q_rows = q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh
    d_main = tl.arange(0, D_MAIN)
    q_main = _to_compute(tl.load(q_rows + d_main[None, :] * stride_qd, mask=row_ok[:, None], other=0.0), COMPUTE)
    # head dims that are no power of two (MLA's 576 = 512 + 64) take a second, masked chunk
    if D_TAIL > 0:
        d_tail = D_MAIN + tl.arange(0, D_TAIL)
        q_tail = tl.load(q_rows + d_tail[None, :] * stride_qd, mask=row_ok[:, None] & (d_tail[None, :] < DQK),
                         other=0.0)
        q_tail = _to_compute(q_tail, COMPUTE)
    dv = tl.arange(0, BLOCK_DV)
    if HAS_DRAFT_MASK:
        prefix = tl.load(prefix_ptr + b).to(tl.int32)
    if HAS_WINDOW:
        depth_i = tl.load(depth_ptr + b * DRAFT + tok, mask=row_ok, other=0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)
    loaded = tl.full([], 0, tl.int32)
    for blk in range(blk_start, blk_end):
        pos = lo + blk * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = pos < hi
        slot = tl.load(r2t_ptr + row * stride_rr + pos * stride_rp, mask=key_ok, other=0).to(tl.int64)
        k_cols = k_ptr + slot[None, :] * stride_ks + kvh * stride_kh  # K^T: [D, BLOCK_N]
        k_main = _load_kv(k_cols + d_main[:, None] * stride_kd, key_ok[None, :], FP8, COMPUTE)
        s = _dot(q_main, k_main, tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32), COMPUTE)
        if D_TAIL > 0:
            k_tail = _load_kv(k_cols + d_tail[:, None] * stride_kd, key_ok[None, :] & (d_tail[:, None] < DQK),
                              FP8, COMPUTE)
            s = _dot(q_tail, k_tail, s, COMPUTE)
        s = s * sm_scale
        if HAS_CAP:
            # cap * tanh(s / cap) through exp (tanh is not in tl's core); exp overflow gives the right +-cap
            s = logit_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / logit_cap) + 1.0))
        visible = key_ok[None, :] & row_ok[:, None]
        if HAS_DRAFT_MASK:
            j = pos - prefix
            is_draft = (j >= 0) & key_ok
            seen = tl.load(dmask_ptr + b * stride_mb + tok[:, None] * stride_mi + j[None, :] * stride_mj,
                           mask=row_ok[:, None] & is_draft[None, :], other=0)
            visible = visible & ((j < 0)[None, :] | (seen != 0))
            if HAS_WINDOW:
                # a draft token sits at prefix + its depth; a draft key likewise; window w: key pos >= q pos - w
                depth_j = tl.load(depth_ptr + b * DRAFT + j, mask=is_draft, other=0)
                key_pos = tl.where(is_draft, prefix + depth_j, pos)
                visible = visible & (key_pos[None, :] >= (prefix + depth_i - window)[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))
        # a row that has seen no key yet keeps m = -inf; subtracting 0 then keeps exp() at 0 instead of NaN
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.reduce(p, 1, _add_combine)
        v_ptrs = v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + dv[None, :] * stride_vd
        v = _load_kv(v_ptrs, key_ok[:, None] & (dv[None, :] < DV), FP8, COMPUTE)
        acc = _dot(_to_compute(p, COMPUTE), v, acc * alpha[:, None], COMPUTE)
        m_i = m_new
        loaded += 1

    ml_off = (t * num_q_heads + head) * NUM_SPLITS + split
    tl.store(m_ptr + ml_off, m_i, mask=row_ok)
    tl.store(l_ptr + ml_off, l_i, mask=row_ok)
    tl.store(o_ptr + ml_off[:, None] * DV + dv[None, :], acc * v_scale, mask=row_ok[:, None] & (dv[None, :] < DV))
    if HAS_VISITED:
        tl.store(visited_ptr + (b * tl.num_programs(1) + kvh) * NUM_SPLITS + split, loaded)


@triton.jit
def _merge_kernel(
    m_ptr, l_ptr, o_ptr, sinks_ptr, out_ptr, stride_ot, stride_oh, stride_od, num_q_heads,
    DV: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Program (t, head): out[t, head] = sum_s o_s exp(m_s - M) / (sum_s l_s exp(m_s - M) [+ exp(sink - M)]);
    a row with no keys gives 0 (with a sink too: its denominator holds no value). The splits are few (a launch
    constant): one unrolled pass for the max, one for the sums."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    base = (t.to(tl.int64) * num_q_heads + h) * NUM_SPLITS
    m_max = tl.load(m_ptr + base)
    for s in tl.static_range(1, NUM_SPLITS):
        m_max = tl.maximum(m_max, tl.load(m_ptr + base + s))
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h)
        m_max = tl.maximum(m_max, sink)  # the sink is one more term of the max, so no exp() below overflows
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    dv = tl.arange(0, BLOCK_DV)
    den = tl.full([], 0.0, tl.float32)
    if HAS_SINKS:
        den = tl.exp(sink - m_use)
    num = tl.full([BLOCK_DV], 0.0, tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        w = tl.exp(tl.load(m_ptr + base + s) - m_use)
        den = den + tl.load(l_ptr + base + s) * w
        num = num + tl.load(o_ptr + (base + s) * DV + dv, mask=dv < DV, other=0.0) * w
    out = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dv * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=dv < DV)


def head_dim_chunks(dqk: int) -> tuple[int, int]:
    """(D_MAIN, D_TAIL): the largest power of two <= dqk, and the rest padded to a power of two (0 if none);
    576 -> (512, 64), 192 -> (128, 64), 128 -> (128, 0), 80 -> (64, 16)."""
    main = 1 << (dqk.bit_length() - 1)
    rest = dqk - main
    return main, (triton.next_power_of_2(rest) if rest else 0)


def launch_warps(block_m: int, block_n: int, d_main: int, block_dv: int) -> int:
    """Warps of a partials program: 8 once a K/V tile holds 4096 elements or the query tile 64 rows. The gathered
    tiles' per-element 64-bit addresses dominate the registers; ptxas for sm_90 (compiled offline) spilled with 4
    warps at 128 x 32 and 512 x 16 tiles, not with 8 (MLA: 576/512, block_n 16; GQA: 128, block_n 32)."""
    return 8 if max(d_main, block_dv) * block_n >= 4096 or block_m >= 64 else 4


def is_interpreted() -> bool:
    """True when this module's kernels run in Triton's interpreter (TRITON_INTERPRET=1 when it was imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_partials_kernel, InterpretedFunction)


def compute_code(q_dtype: torch.dtype, cache_dtype: torch.dtype, fp8: int) -> int:
    """The dot products' dtype: the query's half precision over a cache of that dtype or float8, else float32 (a
    float32 cache is never rounded down). The interpreter holds bfloat16 as raw uint16 (its dot would multiply the
    bits), so there bf16 runs in float32."""
    # a float8 cache arrives as its uint8 bytes: named by its float8 dtype for the library's rule
    dtype = compute_dtype(q_dtype, torch.float8_e4m3fn if fp8 else cache_dtype)
    if dtype == torch.bfloat16 and is_interpreted():
        dtype = torch.float32
    return COMPUTE_CODES[dtype]


def _skip_launch(t: torch.Tensor) -> bool:
    """Interpreted kernels cannot run on fake tensors (``wrap_triton`` hands them back unwrapped), so the op's
    fake (shape) pass allocates its outputs and stops; real kernels go through ``wrap_triton``'s tracing."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) and is_interpreted()


def attend(q, k_cache, v_cache, req_to_token, req_rows, kv_lo, kv_hi, prefix, draft_mask, depth, sinks, *,
           scale: float, logit_cap: float, v_scale: float, window: int, num_splits: int, block_n: int,
           fp8: int, draft: int, visited: torch.Tensor | None = None) -> torch.Tensor:
    """Launch partials + merge; shapes as checked by the callers (no checks here).

    q: [bs * draft, Hq, Dqk]; k_cache: [S, Hkv, Dqk], v_cache: [S, Hkv, Dv] (uint8 when ``fp8``);
    req_to_token: [R, C]; req_rows, kv_lo, kv_hi, prefix: [bs]; draft_mask: [bs, draft, draft] uint8 or None;
    depth: [bs, draft] int32 (window only) or None; sinks: [Hq] float32 or None; visited: [bs, Hkv, splits] int32.
    ``scale`` includes k_scale. Returns [bs * draft, Hq, Dv] in q.dtype."""
    tokens, hq, dqk = q.shape
    bs, hkv, dv = req_rows.shape[0], k_cache.shape[1], v_cache.shape[2]
    group = hq // hkv
    m = torch.empty((tokens, hq, num_splits), dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    o = torch.empty((tokens, hq, num_splits, dv), dtype=torch.float32, device=q.device)
    out = torch.empty((tokens, hq, dv), dtype=q.dtype, device=q.device)
    if _skip_launch(q):
        return out
    d_main, d_tail = head_dim_chunks(dqk)
    has_mask = draft_mask is not None
    dmask = draft_mask if has_mask else req_to_token  # never read without HAS_DRAFT_MASK
    mask_strides = dmask.stride() if has_mask else (0, 0, 0)
    compute = compute_code(q.dtype, k_cache.dtype, fp8)
    block_dv = max(16, triton.next_power_of_2(dv))
    block_m = max(16, triton.next_power_of_2(draft * group))
    warps = launch_warps(block_m, block_n, d_main, block_dv)
    wrap_triton(_partials_kernel)[(bs, hkv, num_splits)](
        q, k_cache, v_cache, req_to_token, req_rows, kv_lo, kv_hi,
        prefix if prefix is not None else kv_hi, dmask, depth if depth is not None else kv_hi,
        m, lsum, o, visited if visited is not None else m,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), req_to_token.stride(0), req_to_token.stride(1),
        mask_strides[0], mask_strides[1], mask_strides[2],
        scale, logit_cap, v_scale, window, hq,
        DQK=dqk, DV=dv, GROUP=group, DRAFT=draft, NUM_SPLITS=num_splits,
        BLOCK_M=block_m, BLOCK_N=block_n, D_MAIN=d_main, D_TAIL=d_tail,
        BLOCK_DV=block_dv, FP8=fp8, COMPUTE=compute, HAS_CAP=logit_cap > 0,
        HAS_DRAFT_MASK=has_mask, HAS_WINDOW=depth is not None, HAS_VISITED=visited is not None,
        num_warps=warps, num_stages=2,
    )
    wrap_triton(_merge_kernel)[(tokens, hq)](
        m, lsum, o, sinks if sinks is not None else m, out, out.stride(0), out.stride(1), out.stride(2), hq,
        DV=dv, NUM_SPLITS=num_splits, BLOCK_DV=block_dv, HAS_SINKS=sinks is not None,
        num_warps=4,
    )
    return out


@triton_op("compiled_attn::triton_decode", mutates_args=())
def _decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
               req_rows: torch.Tensor, kv_lo: torch.Tensor, kv_hi: torch.Tensor, sinks: torch.Tensor | None,
               scale: float, logit_cap: float, v_scale: float, num_splits: int, block_n: int,
               fp8: int) -> torch.Tensor:
    """The op behind ``triton_decode`` (arguments already checked; float8 caches as uint8 with ``fp8`` 1/2)."""
    return attend(q, k_cache, v_cache, req_to_token, req_rows, kv_lo, kv_hi, None, None, None, sinks,
                  scale=scale, logit_cap=logit_cap, v_scale=v_scale, window=0, num_splits=num_splits,
                  block_n=block_n, fp8=fp8, draft=1)


def triton_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                  req_rows: torch.Tensor, kv_lo: torch.Tensor, kv_hi: torch.Tensor, *, scale: float,
                  page_size: int = 1, num_splits: int, block_n: int, logit_cap: float = 0.0, k_scale: float = 1.0,
                  v_scale: float = 1.0, sinks: torch.Tensor | None = None,
                  kv_float8_dtype: torch.dtype | None = None, visited: torch.Tensor | None = None) -> torch.Tensor:
    """Paged decode attention: one query token per request over keys ``[kv_lo[b], kv_hi[b])``.

    q: [bs, Hq, Dqk] (float32/bf16/fp16); k_cache: [S, Hkv, Dqk], v_cache: [S, Hkv, Dv] (any strides: v_cache may
    be a view of k_cache's first Dv columns); float32/bf16/fp16, float8 e4m3fn/e5m2, or uint8 with
    ``kv_float8_dtype`` (stored values times k_scale / v_scale); req_to_token: [R, C] int32 (slot of each
    position); req_rows: [bs] int64; kv_lo, kv_hi: [bs] int32/int64 (kv_lo == kv_hi: a padded row, output 0);
    sinks: [Hq] float32 logits joining each row's denominator. page_size: checked only (the table is read per
    position, right for every page size). num_splits, block_n: launch constants (grid (bs, Hkv, num_splits), key
    blocks of block_n); logit_cap > 0: scores = cap * tanh(scores / cap).
    visited: debug, an int32 [bs, Hkv, num_splits] tensor that receives the number of key blocks each program
    loaded; eager only (it is written, so that call bypasses the op). Returns [bs, Hq, Dv] in q.dtype."""
    k_cache, v_cache, fp8 = check_kv(q, k_cache, v_cache, kv_float8_dtype)
    bs, hq = q.shape[0], q.shape[1]
    check_rows(req_to_token, req_rows, {"kv_lo": kv_lo, "kv_hi": kv_hi}, bs, q.device)
    check_settings(scale=scale, page_size=page_size, num_splits=num_splits, block_n=block_n, logit_cap=logit_cap,
                   k_scale=k_scale, v_scale=v_scale)
    check_extras(sinks, visited, hq, (bs, k_cache.shape[1], num_splits), q.device)
    args = (q, k_cache, v_cache, req_to_token, req_rows, kv_lo, kv_hi)
    if visited is not None:
        return attend(*args, None, None, None, sinks, scale=scale * k_scale, logit_cap=float(logit_cap),
                      v_scale=float(v_scale), window=0, num_splits=num_splits, block_n=block_n, fp8=fp8, draft=1,
                      visited=visited)
    return torch.ops.compiled_attn.triton_decode(*args, sinks, float(scale * k_scale), float(logit_cap),
                                                 float(v_scale), num_splits, block_n, fp8)
