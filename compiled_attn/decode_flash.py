"""The whole CPU decode of one layer as one opaque op: ``decode_flash`` picks, on the host, the cheapest way to run
the planned blocks through ATen's CPU flash kernel and returns the merged, normalised output.

Why one op: at small batches the per-layer cost was dominated by fixed overheads (two custom-op dispatches, the
block merge's dozen small ops, the per-block query copy), so a live engine at batch 1-2 ran slower than SGLang's
per-request loop. The op reads the block table on the host (a CPU tensor in a CPU-only op: no device sync) and
takes one of four paths, all returning the same result up to float rounding:

- **keys in place** (first, in the op; eagerly ``decode._decode_flash`` looks once per step): where the kernel can
  read the cache as it is and at least half the batch's keys lie in runs of ``inplace_flash.MIN_RUN`` consecutive
  slots or more (a prompt as SGLang's allocator hands it out, pages), each request's long runs are kernel calls on
  views of the cache and only the other keys are gathered.
- **one request**: its blocks laid end to end are one sequence, run as one kernel call without a mask; past
  ``SINGLE_REQUEST_CHUNKS`` L2 chunks the sequence is cut into equal segments of at most that size whose
  results are merged by their log-sum-exp (no step in time per token where a longer request switched to the
  split-and-merge path).
- **small batch**: each request's blocks padded to the longest request's count, one gather and one kernel call
  with a mask, no merge, when that pads little (``DENSE_WASTE``) and the gathered K fits ``DENSE_BYTES``.
- **otherwise**: ``block_attention`` (L2-sized chunks of blocks) and the log-sum-exp merge, in the op.
"""
from __future__ import annotations

import torch

from .block_flash import (
    CHUNK_BYTES,
    _flash_cpu,
    _gather_kv,
    block_attention,
    chunk_blocks_for,
    sequence_attention,
    slots_attention,
)
from .inplace_flash import requests_in_place
from .merge import apply_sinks, merge_normalised, merge_partials
from .opaque import opaque_op

#: a single request is run in one kernel call up to this many L2-sized chunks (16 MiB of float32 K: 4096 tokens
#: of llama-3-8b's 8 KV heads); longer ones in equal segments of at most this size
SINGLE_REQUEST_CHUNKS = 16
#: padded (dense) batch: computed positions at most this multiple of the blocks the batch uses ...
DENSE_WASTE = 1.25
#: ... and its gathered float32 K at most this many bytes (larger gathers lose the L2 reuse of the chunked path)
DENSE_BYTES = 4 * CHUNK_BYTES


def decode_flash_eager(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, runs: torch.Tensor,
                       valid: torch.Tensor, block_req: torch.Tensor, scale: float, chunk_blocks: int, unit: int = 1,
                       k_scale: float = 1.0, v_scale: float = 1.0, sinks: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """One query per request over its planned KV blocks (``decode.DecodeIndex``), merged. Called directly when
    not compiling (no dispatch through the op).

    q: [bs, Hkv, group, D] in the kernel's dtype (``kv_dtype.compute_dtype``); k_cache, v_cache: [num_slots, Hkv, D];
    runs: [nblk, block_size // unit] (``DecodeIndex.runs``); valid: [nblk, block_size] bool; block_req: [nblk]
    (``bs`` for unused blocks); sinks: [Hkv, group] float32 or None.
    returns [bs, Hkv, group, D] float32 (zeros for a request with no key).
    """
    bs = q.shape[0]
    q = q.contiguous()  # the ATen kernel reads q through its strides unchecked
    scales = (k_scale, v_scale)
    if bs == 1:
        o, lse = _single_request(q, k_cache, v_cache, runs, valid, scale, chunk_blocks, unit, scales)
        return apply_sinks(o, lse, sinks)
    counts = torch.bincount(block_req, minlength=bs + 1)[:bs]  # blocks per request (host: CPU-only op)
    widest = int(counts.max()) if bs else 0
    used = int(counts.sum())
    active = (counts > 0).nonzero().squeeze(1)  # a bucket's padding rows (empty ranges) take no part
    n = active.shape[0]
    dense_k_bytes = n * widest * valid.shape[1] * k_cache.shape[1] * k_cache.shape[2] * 4
    if used and n * widest <= DENSE_WASTE * used and dense_k_bytes <= DENSE_BYTES:
        o, lse = _dense(q if n == bs else q.index_select(0, active), k_cache, v_cache, runs, valid, counts,
                        active, widest, scale, unit, scales)
        o = apply_sinks(o, lse, sinks)
        return o if n == bs else o.new_zeros(q.shape).index_copy_(0, active, o)
    qb = q.index_select(0, block_req.clamp_max(bs - 1))
    o, lse = block_attention(qb, k_cache, v_cache, runs, valid, scale, chunk_blocks, unit, *scales)
    # a flash block's output is already normalised: merge with its log-sum-exp as max and 1 as sum
    return merge_partials(lse, torch.ones_like(lse), o, block_req, bs, sinks)


def one_call_fits(n: int, block_size: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether one request's ``n`` keys are read in one kernel call (``SINGLE_REQUEST_CHUNKS`` L2 chunks at most)."""
    return n <= SINGLE_REQUEST_CHUNKS * chunk_blocks_for(block_size, num_kv_heads, head_dim) * block_size


def single_request_flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                         scale: float, block_size: int, k_scale: float = 1.0, v_scale: float = 1.0,
                         sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """A batch of one whose key slots the host already holds (``DecodeIndex.single``): one gather, one kernel
    call, none of the block table's reads. None when the request is long enough for ``_single_request``'s
    segments (the caller then runs the block path). q: [1, Hkv, group, D] -> [1, Hkv, group, D] float32."""
    n = slots.shape[0]
    if not one_call_fits(n, block_size, k_cache.shape[1], k_cache.shape[2]):
        return None
    if n == 0:
        return q.new_zeros(q.shape, dtype=torch.float32)
    o, lse = slots_attention(q, k_cache, v_cache, slots, scale, k_scale, v_scale)
    return apply_sinks(o, lse, sinks)


@opaque_op
def decode_flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, runs: torch.Tensor,
                 valid: torch.Tensor, block_req: torch.Tensor, scale: float, chunk_blocks: int, unit: int = 1,
                 k_scale: float = 1.0, v_scale: float = 1.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``decode_flash_eager`` as one opaque op for ``torch.compile`` (``opaque.py``), keys in long runs of slots
    read in place first (``inplace_flash``; eager callers look for them once per step, ``index_in_place``)."""
    found = requests_in_place(q, k_cache, v_cache, runs, valid, block_req, scale, chunk_blocks * valid.shape[1], unit,
                              k_scale, v_scale)
    if found is not None:
        return apply_sinks(*found, sinks)
    return decode_flash_eager(q, k_cache, v_cache, runs, valid, block_req, scale, chunk_blocks, unit, k_scale,
                              v_scale, sinks)


@torch.library.register_fake(decode_flash)
def _decode_flash_fake(q, k_cache, v_cache, runs, valid, block_req, scale, chunk_blocks, unit=1, k_scale=1.0,
                       v_scale=1.0, sinks=None):
    return q.new_empty(q.shape, dtype=torch.float32)


def _single_request(q, k_cache, v_cache, runs, valid, scale, chunk_blocks, unit, scales):
    """One request's blocks (the first ones of the table, valid positions one run) as one sequence, or as equal
    segments of at most ``SINGLE_REQUEST_CHUNKS`` chunks merged by log-sum-exp. -> o [1, Hkv, group, D], lse."""
    nblk, block_size = valid.shape
    flat_runs, flat_valid = runs.reshape(-1), valid.reshape(-1)
    if nblk <= SINGLE_REQUEST_CHUNKS * chunk_blocks:  # the common case: no count needed, one call
        return sequence_attention(q, k_cache, v_cache, flat_runs, flat_valid, scale, unit, *scales)
    n = int(flat_valid.sum())
    count = -(-(int(flat_valid.int().argmax()) + n) // block_size) if n else 0  # blocks up to the last valid one
    if count == 0:
        return q.new_zeros(q.shape), q.new_full(q.shape[:3], torch.finfo(torch.float32).min, dtype=torch.float32)
    limit = max(1, SINGLE_REQUEST_CHUNKS * chunk_blocks)
    segments = max(1, -(-count // limit))
    per = -(-count // segments)  # equal segments: no short tail segment that costs a kernel call for little work
    parts = []
    for s in range(0, count, per):
        lo, hi = s * block_size, min(s + per, count) * block_size
        parts.append(sequence_attention(q, k_cache, v_cache, flat_runs[lo // unit:hi // unit], flat_valid[lo:hi],
                                        scale, unit, *scales))
    return merge_normalised(parts)


def _dense(q, k_cache, v_cache, runs, valid, counts, active, widest, scale, unit, scales):
    """The ``active`` requests' blocks (those with a key; q holds their rows) padded to ``widest`` and run as one
    batch: one gather each for K and V, one kernel call, a mask for the padding. -> o [n, Hkv, group, D], lse."""
    bs = q.shape[0]
    block_size = valid.shape[1]
    firsts = (torch.cumsum(counts, 0) - counts)[active]
    counts = counts[active]
    j = torch.arange(widest)
    # a padding block repeats the request's last block (finite keys it owns), masked out below
    blocks = firsts[:, None] + torch.minimum(j[None, :], (counts - 1).clamp_min(0)[:, None])  # [bs, widest]
    dense_valid = (valid[blocks] & (j[None, :] < counts[:, None])[..., None]).reshape(bs, widest * block_size)
    length = widest * block_size
    all_valid = bool(dense_valid.all())
    k, v = _gather_kv(k_cache, v_cache, runs[blocks].reshape(-1), unit, bs, length, q.dtype, *scales,
                      dense_valid if unit > 1 and not all_valid else None)
    bias = None if all_valid else torch.where(dense_valid, 0.0, float("-inf")).to(q.dtype)[:, None, None, :]
    return _flash_cpu(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
