"""Verify's prefixes on CPU through ATen's flash kernel: each request's ``k * group`` query rows per KV head over
its whole prefix, read in L2-sized chunks of gathered K/V (``verify_flash``, an opaque op as ``decode_flash``).

Why a form of its own: at ``k`` draft tokens a request's queries are ``k`` times decode's rows, so the flash
kernel's GEMMs pay for the gather there, where the in-place fused form (``decode_fused``), whose work grows with
the rows, does not (``verify.FUSED_MAX_ROWS``).
"""
from __future__ import annotations

import torch

from .block_flash import _flash_cpu, _gather_kv, slots_attention
from .decode import DecodeIndex
from .decode_flash import one_call_fits
from .inplace_flash import index_in_place, requests_in_place
from .kv_dtype import compute_dtype, scale_pair
from .merge import merge_two
from .opaque import opaque_op

_LOWEST = torch.finfo(torch.float32).min
#: bytes of float32 K per gathered chunk of one request's prefix (``verify_flash``): 512 tokens of llama-3-8b's 8 KV
#: heads; 1, 2 and 4 MiB measured within 10% of each other (2 MiB best) at bs 1..32, k 4..8, one thread
VERIFY_CHUNK_BYTES = 2 << 20


def prefix_flash(qg, k_cache, v_cache, index: DecodeIndex, scale, k_scale, v_scale):
    """The prefixes through ``verify_flash`` -> (o [bs, Hkv, k * group, D] normalised, lse [bs, Hkv, k * group])."""
    hkv, d = qg.shape[1], qg.shape[3]
    scales = scale_pair(k_scale, v_scale)
    qg = qg.to(compute_dtype(qg.dtype, k_cache.dtype))
    single = index.single
    compiling = torch.compiler.is_compiling()
    chunk = max(VERIFY_CHUNK_BYTES // (hkv * d * 4) // index.unit, 1) * index.unit
    if not compiling:  # keys in long runs of slots read in place, the runs found once per step (inplace_flash)
        found = index_in_place(qg, k_cache, v_cache, index, scale, chunk, *scales)
        if found is not None:
            return found
    if single is not None and single.shape[0] and one_call_fits(single.shape[0], index.block_size, hkv, d) \
            and not compiling:
        # a batch of one indexed on the host: its prefix's slots in one gather and one kernel call, as decode does
        o, lse = slots_attention(qg, k_cache, v_cache, single, scale, *scales)
        return o.float(), lse
    return verify_flash(qg, k_cache, v_cache, index.runs, index.valid, index.block_req, scale, chunk, index.unit,
                        *scales, find_runs=compiling)


@opaque_op
def verify_flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, runs: torch.Tensor,
                 valid: torch.Tensor, block_req: torch.Tensor, scale: float, chunk_tokens: int, unit: int = 1,
                 k_scale: float = 1.0, v_scale: float = 1.0, find_runs: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's queries over its whole prefix, read in chunks of ``chunk_tokens`` positions.

    q: [bs, Hkv, R, D] in the kernel's dtype (a request's ``k * group`` query rows per KV head); k_cache,
    v_cache: [num_slots, Hkv, D]; runs, valid, block_req: a ``DecodeIndex`` over ``[0, prefix_len)``'s
    (``runs``: [nblk, block_size // unit], ``valid``: [nblk, block_size], ``block_req``: [nblk], ``bs`` for unused).
    returns o: [bs, Hkv, R, D] float32, normalised over the prefix (zeros without one), and lse: [bs, Hkv, R]
    float32 (the float32 minimum without a prefix, so the merge gives it no weight).

    Why not ``block_flash.block_attention`` over the blocks: every block then carries a copy of its request's ``k *
    Hq`` query rows and returns as many output rows (a quarter of the K/V bytes at k = 8 with 64-token blocks), and
    the blocks' outputs are concatenated and merged again. A request's blocks are consecutive and, from position 0,
    its valid keys one run of positions; so each chunk is one gather and one unmasked kernel call (the last chunk
    trimmed to the valid length) with the request's queries as they are, merged into a running log-sum-exp.
    Where most keys lie in long runs of slots and the caches need no conversion, ``inplace_flash.requests_in_place``
    reads those runs in place instead (``find_runs``: eager callers have looked already, once per step). Host
    reads of ``valid``/``block_req`` (CPU tensors in a CPU-only op, as ``decode_flash``), never a sync.
    """
    # keys in long runs of slots (inplace_flash), unless an eager caller has looked already
    found = requests_in_place(q, k_cache, v_cache, runs, valid, block_req, scale, chunk_tokens, unit, k_scale,
                              v_scale) if find_runs else None
    if found is not None:
        return found
    bs, blocks = q.shape[0], valid.shape
    lens = valid.sum(1).new_zeros(bs + 1).index_add_(0, block_req, valid.sum(1))[:bs].tolist()
    nblocks = torch.bincount(block_req, minlength=bs + 1)[:bs]
    firsts = ((torch.cumsum(nblocks, 0) - nblocks) * blocks[1]).tolist()  # flat position of each request's key 0
    flat = runs.reshape(-1)
    o = q.new_zeros(q.shape, dtype=torch.float32)
    lse = torch.full(q.shape[:3], _LOWEST, dtype=torch.float32, device=q.device)
    for b, (n, start) in enumerate(zip(lens, firsts, strict=True)):
        q_b = q[b:b + 1]
        for c0 in range(0, n, chunk_tokens):
            c1 = min(n, c0 + chunk_tokens)
            r0, r1 = (start + c0) // unit, -(-(start + c1) // unit)  # start and c0 are multiples of unit
            k, v = _gather_kv(k_cache, v_cache, flat[r0:r1], unit, 1, (r1 - r0) * unit, q.dtype, k_scale, v_scale)
            o_c, lse_c = _flash_cpu(q_b, k[:, :, :c1 - c0], v[:, :, :c1 - c0], 0.0, False, scale=scale)
            if c0 == 0:
                o[b], lse[b] = o_c[0], lse_c[0]
                continue
            o[b], lse[b] = merge_two(o[b], lse[b], o_c[0].float(), lse_c[0])
    return o, lse


@torch.library.register_fake(verify_flash)
def _verify_flash_fake(q, k_cache, v_cache, runs, valid, block_req, scale, chunk_tokens, unit=1, k_scale=1.0,
                       v_scale=1.0, find_runs=True):
    return q.new_empty(q.shape, dtype=torch.float32), q.new_empty(q.shape[:3], dtype=torch.float32)
