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

import torch

from .block_flash import _flash_cpu, slots_attention

#: runs of at least this many consecutive slots are read in place. Per key, a kernel call on a run of 64 slots cost
#: 1.7x (float32) and 2.9x (bf16) one on a run of 1024, and for bf16 more than gathering those keys; from 128 on
#: a run in place beat the gathering forms in both dtypes (llama-3-8b heads, 4 query rows per KV head, 2 threads)
MIN_RUN = 128
#: the in-place form is taken when at least this share of a batch's keys lies in such runs
MIN_IN_PLACE_SHARE = 0.5


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


def runs_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   bounds: list[int], first_slots: list[int], scale: float, chunk_tokens: int,
                   k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's queries over its keys, given as runs (``slot_runs`` over its ``slots``: [n] host int64, n >= 1,
    position order): runs of ``MIN_RUN`` slots or more in place, the rest gathered in chunks of ``chunk_tokens``.

    q: [1, Hkv, R, D] in the kernel's dtype (the caches' where they are read in place: ``reads_in_place``);
    returns o: [1, Hkv, R, D] float32 normalised, lse: [1, Hkv, R] float32.
    """
    q = q.contiguous()  # the kernel reads q through its strides unchecked
    parts, rest = [], []
    for (a, b), first in zip(zip(bounds[:-1], bounds[1:], strict=True), first_slots, strict=True):
        if b - a >= MIN_RUN:
            k = k_cache[first:first + b - a].unsqueeze(0).transpose(1, 2)  # [1, Hkv, n, D], the gathered strides
            v = v_cache[first:first + b - a].unsqueeze(0).transpose(1, 2)
            parts.append(_flash_cpu(q, k, v, 0.0, False, scale=scale)[:2])
        else:
            rest.append(slots[a:b])
    if rest:
        scattered = torch.cat(rest) if len(rest) > 1 else rest[0]
        for c in range(0, scattered.shape[0], chunk_tokens):
            parts.append(slots_attention(q, k_cache, v_cache, scattered[c:c + chunk_tokens], scale, k_scale, v_scale))
    return merge_normalised(parts)


def request_in_place(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, scale: float,
                     chunk_tokens: int, k_scale: float = 1.0, v_scale: float = 1.0
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``runs_attention`` over one request's ``slots`` ([n] host int64, n >= 1) when the kernel can read the caches
    as they are and at least ``MIN_IN_PLACE_SHARE`` of the keys lie in long runs; None otherwise (gather them)."""
    if not reads_in_place(q.dtype, k_cache, v_cache, k_scale, v_scale):
        return None
    bounds, firsts = slot_runs(slots, [slots.shape[0]])
    if in_place_share(bounds) < MIN_IN_PLACE_SHARE:
        return None
    return runs_attention(q, k_cache, v_cache, slots, bounds, firsts, scale, chunk_tokens, k_scale, v_scale)


def merge_normalised(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised partial softmaxes of the same rows, ``(o [..., R, D], lse [..., R])`` each, -> one, float32."""
    if len(parts) == 1:
        return parts[0][0].float(), parts[0][1]
    o = torch.stack([p[0].float() for p in parts])
    lse = torch.stack([p[1] for p in parts])
    total = torch.logsumexp(lse, 0)
    return (o * torch.exp(lse - total)[..., None]).sum(0), total
