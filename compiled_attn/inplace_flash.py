"""Keys that lie in place: runs of consecutive KV slots read by ATen's CPU flash kernel as views of the cache.

Why: the eager CPU flash forms gather K/V into tiles before the kernel reads them, and at decode that copy costs
about as much as the kernel itself. SGLang's allocator hands a prompt's tokens out as one run of consecutive slots
(a fresh pool's free list is in order, and a page is a run by definition), so most of a request's keys usually
lie in a few long runs. A run of at least ``MIN_RUN`` slots is one kernel call on ``cache[s:s + n]``, no copy; the
rest of the request's keys (the decode steps' scattered slots, a fragmented pool's short runs) are gathered as
before; the pieces are merged by their log-sum-exp. Each piece covers exactly the keys it reads, so no mask and no
slot outside the request's range is ever touched.
"""
from __future__ import annotations

import bisect

import torch

from .block_flash import _flash_cpu, _gather_kv, slots_attention
from .merge import merge_normalised_rows

#: runs of at least this many consecutive slots are read in place. Per key, a kernel call on a run of 64 slots cost
#: 1.7x (float32) and 2.9x (bf16) one on a run of 1024, and for bf16 more than gathering those keys; from 128 on
#: a run in place beat the gathering forms in both dtypes (llama-3-8b heads, 4 query rows per KV head, 2 threads)
MIN_RUN = 128
#: the in-place form is taken when at least this share of a batch's keys lies in such runs
MIN_IN_PLACE_SHARE = 0.5
#: the requests' keys outside long runs (decode steps' scattered slots) go through one padded kernel call when that
#: computes at most this multiple of them and their float32 K fits ``REST_BYTES``; else each request's in chunks
REST_PAD_WASTE = 1.5
REST_BYTES = 4 << 20


def reads_in_place(q_dtype: torch.dtype, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float,
                   v_scale: float) -> bool:
    """The kernel can read the caches as they are: the query's dtype, no dequantisation scale, each slot's
    ``[Hkv, D]`` rows contiguous (what a view ``cache[s:e]`` must give the kernel, as a gathered tile does)."""
    return all(c.dtype == q_dtype and c.stride(2) == 1 and c.stride(1) == c.shape[2] and c.device.type == "cpu"
               for c in (k_cache, v_cache)) and k_scale == 1.0 and v_scale == 1.0


def slot_runs(slots: torch.Tensor, ends: list[int]) -> tuple[list[int], list[int]]:
    """Where ``slots`` (host int64 ``[n]``, several requests' keys end to end, request ``i`` ending at ``ends[i]``)
    breaks into runs of consecutive slots -> (bounds: every run's start position and ``n`` last, first_slots: each
    run's first slot). A request's end always ends a run."""
    n = slots.shape[0]
    if n == 0:
        return [0], []
    brk = torch.ones(n, dtype=torch.bool)
    brk[1:] = slots[1:] != slots[:-1] + 1
    brk[[e for e in ends[:-1] if e < n]] = True
    starts = brk.nonzero().squeeze(1)
    return [*starts.tolist(), n], slots[starts].tolist()


def in_place_share(bounds: list[int]) -> float:
    """The share of keys lying in runs of at least ``MIN_RUN`` slots (``slot_runs``' bounds)."""
    n = bounds[-1]
    long = sum(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b - a >= MIN_RUN)
    return long / n if n else 0.0


def position_slots(runs: torch.Tensor, unit: int, shape: torch.Size) -> torch.Tensor:
    """The slot of every block position, ``shape`` = a block table's ``valid`` ``[nblk, block_size]``, from ``runs``
    (slots, or with ``unit`` > 1 the index of each run of ``unit`` consecutive slots)."""
    if unit == 1:
        return runs
    return (runs[:, :, None] * unit + torch.arange(unit, device=runs.device)).reshape(shape)


def run_parts(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              bounds: list[int], first_slots: list[int], scale: float
              ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
    """One request's runs (``slot_runs`` over ``slots``; ``bounds`` its runs' starts and its end, positions into
    ``slots``): each run of ``MIN_RUN`` slots or more as a kernel call on views of the caches -> (its normalised
    partials ``(o [1, Hkv, R, D], lse [1, Hkv, R])``, the slots of the request's other keys or None).
    q: [1, Hkv, R, D] contiguous, in the caches' dtype (``reads_in_place``)."""
    parts, rest = [], []
    for (a, b), first in zip(zip(bounds[:-1], bounds[1:], strict=True), first_slots, strict=True):
        if b - a >= MIN_RUN:
            k = k_cache[first:first + b - a].unsqueeze(0).transpose(1, 2)  # [1, Hkv, n, D], the gathered strides
            v = v_cache[first:first + b - a].unsqueeze(0).transpose(1, 2)
            parts.append(_flash_cpu(q, k, v, 0.0, False, scale=scale)[:2])
        else:
            rest.append(slots[a:b])
    return parts, (torch.cat(rest) if len(rest) > 1 else rest[0]) if rest else None


def request_in_place(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, scale: float,
                     chunk_tokens: int, k_scale: float = 1.0, v_scale: float = 1.0
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One request's queries (q: [1, Hkv, R, D]) over its keys at ``slots`` ([n] host int64, n >= 1, position
    order), its long runs in place and the rest gathered in chunks of ``chunk_tokens``, when the kernel can read the
    caches as they are and at least ``MIN_IN_PLACE_SHARE`` of the keys lie in long runs; None otherwise (gather
    them all). -> o [1, Hkv, R, D] float32 normalised, lse [1, Hkv, R]."""
    if not reads_in_place(q.dtype, k_cache, v_cache, k_scale, v_scale):
        return None
    bounds, firsts = slot_runs(slots, [slots.shape[0]])
    if in_place_share(bounds) < MIN_IN_PLACE_SHARE:
        return None
    q = q.contiguous()  # the kernel reads q through its strides unchecked
    parts, rest = run_parts(q, k_cache, v_cache, slots, bounds, firsts, scale)
    if rest is not None:
        parts += [slots_attention(q, k_cache, v_cache, rest[c:c + chunk_tokens], scale)
                  for c in range(0, rest.shape[0], chunk_tokens)]
    return merge_normalised(parts)


def requests_in_place(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, runs: torch.Tensor,
                      valid: torch.Tensor, block_req: torch.Tensor, scale: float, chunk_tokens: int, unit: int
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A batch's queries over its block table (decode's or verify's ``DecodeIndex``: ``runs`` [nblk, block_size //
    unit], ``valid`` [nblk, block_size], ``block_req`` [nblk], a request's valid positions one range of its
    consecutive blocks), each request's long runs in place and all requests' other keys in one padded kernel call,
    when the kernel can read the caches as they are (the caller checks ``reads_in_place``) and at least
    ``MIN_IN_PLACE_SHARE`` of the batch's keys lie in long runs; None otherwise.

    q: [bs, Hkv, R, D] in the caches' dtype -> o [bs, Hkv, R, D] float32 normalised (zeros for a request with no
    key), lse [bs, Hkv, R] (the float32 minimum there)."""
    bs = q.shape[0]
    slots = position_slots(runs, unit, valid.shape).reshape(-1)[valid.reshape(-1)]  # each request's keys, in turn
    per_block = valid.sum(1)
    ends = torch.cumsum(per_block.new_zeros(bs + 1).index_add_(0, block_req, per_block)[:bs], 0).tolist()
    bounds, firsts = slot_runs(slots, ends)
    if in_place_share(bounds) < MIN_IN_PLACE_SHARE:
        return None
    q = q.contiguous()  # the kernel reads q through its strides unchecked
    outs, lses, part_rows = [], [], []  # every partial, and the request it belongs to
    rest_rows, rests = [], []
    j = 0  # the first run of request i
    for i, end in enumerate(ends):
        if bounds[j] == end:  # no key
            continue
        last = bisect.bisect_left(bounds, end, j)  # bounds[last] == end: a request's end ends a run
        parts, rest = run_parts(q[i:i + 1], k_cache, v_cache, slots, bounds[j:last + 1], firsts[j:last], scale)
        for o, lse in parts:
            outs.append(o)
            lses.append(lse)
            part_rows.append(i)
        if rest is not None:
            rest_rows.append(i)
            rests.append(rest)
        j = last
    if rests:
        o, lse = _rests_attention(q, k_cache, v_cache, rest_rows, rests, scale, chunk_tokens)
        outs.append(o)
        lses.append(lse)
        part_rows += rest_rows
    return merge_normalised_rows(torch.cat(outs), torch.cat(lses), torch.tensor(part_rows), bs)


def _rests_attention(q, k_cache, v_cache, rows: list[int], rests: list[torch.Tensor], scale: float,
                     chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The requests ``rows``' keys outside long runs (``rests``: slots, position order): one gather and one kernel
    call for all, each padded to the longest with its own last key masked out, when that pads at most
    ``REST_PAD_WASTE``x and fits ``REST_BYTES``; else each request's in chunks. -> (o, lse), a partial per row."""
    lens = [r.shape[0] for r in rests]
    width, hkv, d = max(lens), k_cache.shape[1], k_cache.shape[2]
    if len(rests) * width > REST_PAD_WASTE * sum(lens) or len(rests) * width * hkv * d * 4 > REST_BYTES:
        parts = []
        for i, r in zip(rows, rests, strict=True):
            chunks = range(0, r.shape[0], chunk_tokens)
            parts.append(merge_normalised([slots_attention(q[i:i + 1], k_cache, v_cache, r[c:c + chunk_tokens],
                                                           scale) for c in chunks]))
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    n = torch.tensor(lens)
    starts = torch.cumsum(n, 0) - n
    # a padding position repeats the request's last key (finite data it owns), masked out below
    pos = starts[:, None] + torch.minimum(torch.arange(width)[None, :], (n - 1)[:, None])
    k, v = _gather_kv(k_cache, v_cache, torch.cat(rests)[pos].reshape(-1), 1, len(rests), width, q.dtype, 1.0, 1.0)
    bias = None
    if min(lens) < width:
        keep = torch.arange(width)[None, :] < n[:, None]
        bias = torch.where(keep, 0.0, float("-inf")).to(q.dtype)[:, None, None, :]
    o, lse = _flash_cpu(q[rows], k, v, 0.0, False, attn_mask=bias, scale=scale)[:2]
    return o, lse


def merge_normalised(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised partial softmaxes of the same rows, ``(o [..., R, D], lse [..., R])`` each, -> one, float32."""
    if len(parts) == 1:
        return parts[0][0].float(), parts[0][1]
    o = torch.stack([p[0].float() for p in parts])
    lse = torch.stack([p[1] for p in parts])
    total = torch.logsumexp(lse, 0)
    return (o * torch.exp(lse - total)[..., None]).sum(0), total
