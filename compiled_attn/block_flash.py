"""Per-block attention on CPU through ATen's flash kernel, gathering K/V a few blocks at a time.

Why: on CPU the decode step is bound by moving K/V. The matmul form (``decode_blocks``' portable path) gathers a
whole KV head of the batch and then reads it again from DRAM; ATen's flash kernel for CPU runs the per-block
softmax in one pass and returns the log-sum-exp the block merge needs. Gathering only ``chunk_blocks`` blocks at a
time keeps each gathered tile in the core's L2 cache, so the kernel reads it from cache rather than DRAM, and no
gather buffer grows past the allocator's reuse threshold (glibc mmaps blocks over 32 MB and page-faults them
afresh every step). docs/performance.md has the measured effect.

These are eager functions: they read ``valid`` on the host (a CPU tensor, not a device sync) to skip the blocks a
bucket pads with. ``decode_flash`` (one opaque op per layer, the one call ``torch.compile`` sees) runs them.
"""
from __future__ import annotations

import itertools
import threading
import time

import torch

from .kv_dtype import dequantize

#: a chunk this many times slower than the fastest one of its call switches the call's remaining chunks to threads
#: over chunks (``_run_chunks``): a quiet machine's chunks stay within ~2x of each other
SLOW_CHUNK_FACTOR = 4.0
#: bytes of float32 K per gathered chunk: about half of one core's L2 on the CI machine, leaving room for V
CHUNK_BYTES = 1 << 20

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def supports_block_flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         logit_cap: float | None) -> bool:
    """The CPU flash kernel needs one head size for Q, K and V and has no soft-cap; everything else (MLA's
    576/512, soft-capped models, CUDA) takes the matmul form."""
    return (q.device.type == "cpu" and logit_cap is None
            and q.shape[-1] == k_cache.shape[-1] == v_cache.shape[-1])


def gather_units(cache: torch.Tensor, units: torch.Tensor, unit: int) -> torch.Tensor:
    """Rows ``units[i] * unit + j`` (``j < unit``) of ``cache: [S, H, D]`` as ``[len(units) * unit, H, D]``.

    With ``unit`` > 1 (a paged cache: ``unit`` consecutive positions of a request are ``unit`` consecutive slots)
    one index moves a whole run of slots, ``unit`` times fewer and larger copies than a slot-by-slot gather."""
    if unit == 1:
        return cache.index_select(0, units)
    s, h, d = cache.shape
    if cache.is_contiguous():
        return cache[: s - s % unit].view(-1, unit * h * d).index_select(0, units).view(-1, h, d)
    return cache.index_select(0, (units[:, None] * unit + torch.arange(unit, device=units.device)).reshape(-1))


def _gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, units: torch.Tensor, unit: int, n: int, length: int,
               dtype: torch.dtype, k_scale: float, v_scale: float, valid: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of ``units`` (``n * length // unit`` runs of ``unit`` slots) as ``[n, Hkv, length, D]`` views of one
    gather each (the kernel reads the transposed strides, so nothing is copied twice), in ``dtype``: converted
    and dequantised on the gathered tile only (``kv_dtype``).

    valid: [n, length] bool, given when whole runs were gathered (``unit`` > 1) and some positions are masked:
    those rows are zeroed. They are slots past the request's end in its last page (never written for it, and
    whatever a page's previous owner left there, NaN included, would survive the additive mask)."""
    hkv, d = k_cache.shape[1], k_cache.shape[2]
    k = dequantize(gather_units(k_cache, units, unit), dtype, k_scale)
    v = dequantize(gather_units(v_cache, units, unit), dtype, v_scale)
    if valid is not None:
        masked = (~valid).reshape(-1).nonzero().squeeze(1)  # a few tail positions per partial block
        k.index_fill_(0, masked, 0)
        v.index_fill_(0, masked, 0)
    return k.view(n, length, hkv, d).transpose(1, 2), v.view(n, length, hkv, d).transpose(1, 2)


def chunk_blocks_for(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """How many blocks one gathered chunk holds so that its float32 K fits ``CHUNK_BYTES``."""
    return max(1, CHUNK_BYTES // (block_size * num_kv_heads * head_dim * 4))


def block_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, units: torch.Tensor,
                    valid: torch.Tensor, scale: float, chunk_blocks: int, unit: int = 1, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each block's queries over that block's keys (eager code: reads ``valid`` on the host).

    q: [nblk, Hkv, group, D] in the kernel's dtype (``kv_dtype.compute_dtype``; a block's queries: its request's
    heads, grouped by KV head); k_cache, v_cache: [num_slots, Hkv, D] (any ``kv_dtype.KV_DTYPES``, dequantised
    with k_scale/v_scale in the gather); units: [nblk, block_size // unit] int64, the runs of ``unit`` slots each
    block reads (``unit`` 1: one slot per position); valid: [nblk, block_size] bool.
    With ``unit`` 1, where ``valid`` is False ``units`` must name a slot with finite data (``build_decode_index``
    gives the block's own first slot): the -inf mask is added to the scores, and -inf + NaN is NaN; with ``unit``
    > 1 masked positions are zeroed after the gather.
    returns o: [nblk, Hkv, group, D] in q's dtype (normalised within the block, zeros for a block with no valid
    key) and lse: [nblk, Hkv, group] float32, the block's log-sum-exp of scaled scores (0 for a block with no key).
    """
    nblk = q.shape[0]
    q = q.contiguous()  # the ATen kernel reads q through its strides unchecked: a strided head dim gave garbage
    # A bucket pads the batch with blocks (rows) and a single request with positions (columns) that have no valid
    # key; they sit after the valid ones. Reading ``valid`` here is a host read of a CPU tensor (this op is
    # CPU-only), not a device sync, and skipping them makes a compiled bucket cost what its batch needs.
    rows = valid.any(1).nonzero()
    if rows.numel() == 0:  # no key anywhere
        return q.new_zeros(q.shape), q.new_zeros(q.shape[:3], dtype=torch.float32)
    n_rows = int(rows[-1]) + 1
    n_units = -(-(int(valid[:n_rows].any(0).nonzero()[-1]) + 1) // unit)
    n_cols = n_units * unit
    units, valid = units[:n_rows, :n_units], valid[:n_rows, :n_cols]
    # the kernel wants the mask in the query's dtype; additive: 0 where valid, -inf elsewhere. None when every key
    # is valid (a single request's exact range, a batch of whole blocks): the kernel is 4-11% faster without one
    bias = None if bool(valid.all()) else torch.where(valid, 0.0, float("-inf")).to(q.dtype)[:, None, None, :]
    # views made once (split), so each chunk is two gathers and one kernel call
    biases = bias.split(chunk_blocks) if bias is not None else itertools.repeat(None)
    chunks = list(zip(units.reshape(-1).split(chunk_blocks * n_units), q[:n_rows].split(chunk_blocks), biases,
                      valid.split(chunk_blocks), strict=False))

    def run_chunk(c):
        flat, q_c, bias_c, valid_c = chunks[c]
        masked = valid_c if unit > 1 and bias_c is not None and not bool(valid_c.all()) else None
        k, v = _gather_kv(k_cache, v_cache, flat, unit, q_c.shape[0], n_cols, q.dtype, k_scale, v_scale, masked)
        return _flash_cpu(q_c, k, v, 0.0, False, attn_mask=bias_c, scale=scale)

    parts = _run_chunks(run_chunk, len(chunks))
    o_parts, lse_parts = [p[0] for p in parts], [p[1] for p in parts]
    if n_rows < nblk:  # the skipped blocks: zeros
        o_parts.append(q.new_zeros((nblk - n_rows, *q.shape[1:])))
        lse_parts.append(q.new_zeros((nblk - n_rows, *q.shape[1:3]), dtype=torch.float32))
    if len(o_parts) == 1:  # one chunk: the kernel's own outputs, no copy
        return o_parts[0].contiguous(), lse_parts[0].contiguous()
    return torch.cat(o_parts), torch.cat(lse_parts)


def _run_chunks(run_chunk, n: int) -> list:
    """``run_chunk(c)`` for c in ``range(n)``, in order, each on the caller's intra-op threads; if a chunk takes
    ``SLOW_CHUNK_FACTOR`` times the fastest one so far, the rest run on ``torch.get_num_threads()`` Python threads
    that pull chunks from a shared counter, each chunk on one intra-op thread.

    Why: each chunk is three OpenMP parallel regions, and on a shared machine a region waits for its slowest
    thread: with one other busy process on 2 cores a step took 19x its quiet time this way, against 2x for the
    threads over chunks (which are 1.23x slower than the regions when the machine is quiet, so they are the
    fallback, not the rule). The switch is decided per call from its own chunk times: no state between calls."""
    out: list = [None] * n
    fastest = float("inf")
    c = 0
    threads = torch.get_num_threads()
    while c < n:
        t0 = time.perf_counter()
        out[c] = run_chunk(c)
        took = time.perf_counter() - t0
        c += 1
        if c >= 2 and threads > 1 and took > SLOW_CHUNK_FACTOR * fastest:
            _run_on_chunk_threads(run_chunk, out, c, n, threads)
            break
        fastest = min(fastest, took)
    return out


def _run_on_chunk_threads(run_chunk, out: list, first: int, n: int, threads: int) -> None:
    """Chunks ``[first, n)`` on ``threads`` Python threads, one intra-op thread each (no barrier between chunks: a
    descheduled thread delays only the chunk it holds)."""
    next_chunk = itertools.count(first)  # next() on a count is atomic under the GIL
    errors: list[BaseException] = []

    def worker():
        torch.set_num_threads(1)
        try:
            for c in iter(lambda: next(next_chunk), None):
                if c >= n:
                    return
                out[c] = run_chunk(c)
        except BaseException as e:  # re-raised in the caller
            errors.append(e)

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    torch.set_num_threads(threads)  # the caller's count, whatever the workers set process-wide
    if errors:
        raise errors[0]


def sequence_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, units: torch.Tensor,
                       valid: torch.Tensor, scale: float, unit: int = 1, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's queries over one sequence of positions whose valid ones are one run: a decode request's
    blocks laid end to end (valid up to the request's end; a bucket's unused blocks follow; with a paged cache the
    first block may start before the request's first key, at its page's start). One gather and one kernel call,
    no mask: the short path for a batch of one, where ``block_flash``'s set-up was a third of the time at a few
    hundred tokens.

    q: [1, Hkv, group, D] in the kernel's dtype; k_cache, v_cache: [num_slots, Hkv, D]; units: [n // unit] int64
    runs of ``unit`` slots; valid: [n] bool
    returns o: [1, Hkv, group, D] in q's dtype (zeros when no position is valid) and its rows' log-sum-exp
    lse: [1, Hkv, group] float32 (the lowest float32 when no position is valid: an empty softmax).
    """
    n = int(valid.sum())
    if n == 0:
        return q.new_zeros(q.shape), q.new_full(q.shape[:3], torch.finfo(torch.float32).min, dtype=torch.float32)
    lead = int(valid.int().argmax())  # the first valid position
    if unit == 1:
        return slots_attention(q, k_cache, v_cache, units[lead:lead + n], scale, k_scale, v_scale)
    first, last = lead // unit, -(-(lead + n) // unit)
    k, v = _gather_kv(k_cache, v_cache, units[first:last], unit, 1, (last - first) * unit, q.dtype, k_scale, v_scale)
    start = lead - first * unit  # only [lead, lead + n) of the gathered pages
    return _flash_one(q, k[:, :, start:start + n], v[:, :, start:start + n], scale)


def slots_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                    scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's queries over the keys at ``slots`` ([n] int64, n >= 1, in position order): one gather and
    one kernel call. q: [1, Hkv, group, D] in the kernel's dtype -> o [1, Hkv, group, D], lse [1, Hkv, group]."""
    k, v = _gather_kv(k_cache, v_cache, slots, 1, 1, slots.shape[0], q.dtype, k_scale, v_scale)
    return _flash_one(q, k, v, scale)


def _flash_one(q, k, v, scale):
    # the kernel does not check q's strides: a query whose head dim is not contiguous returned garbage
    o, lse = _flash_cpu(q.contiguous(), k, v, 0.0, False, scale=scale)
    return o.contiguous(), lse
