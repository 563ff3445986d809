"""Speculative verify attention in Triton: ``k`` draft tokens per request over the request's prefix and the draft
keys, with the decode kernel's split-KV, skipping, paging, float8, soft-cap and sinks (``triton_decode``).

One program per (request, KV head, split) holds the ``k`` draft tokens times the group's query heads as the rows of
one query tile: the prefix keys ``[kv_lo, prefix_len)`` are seen by every row, the draft keys (positions
``prefix_len + j``, slots from ``req_to_token``) per row by ``draft_mask`` (a chain: lower triangular; a tree: any
mask with its diagonal set). Sliding window: draft token ``i`` sits at ``prefix_len + depth_i`` (depth: the number
of draft keys it sees, less one) and sees keys at positions ``>= its position - window`` (draft key ``j`` at
``prefix_len + depth_j``).

Op: ``torch.ops.compiled_attn.triton_verify`` (``torch.library.triton_op``).
"""
from __future__ import annotations

import torch
from torch.library import triton_op

from .triton_checks import check_extras, check_kv, check_rows, check_settings, check_tensor
from .triton_decode import attend


def _verify(q, k_cache, v_cache, req_to_token, req_rows, kv_lo, prefix_lens, draft_mask, sinks, scale, logit_cap,
            v_scale, window, num_splits, block_n, fp8, visited=None):
    """``attend`` for verify: keys ``[kv_lo, prefix_len + k)``; the draft depths only under a window (-1: none)."""
    k = draft_mask.shape[1]
    depth = (draft_mask.sum(-1) - 1).to(torch.int32) if window >= 0 else None  # [bs, k]
    return attend(q, k_cache, v_cache, req_to_token, req_rows, kv_lo, prefix_lens + k, prefix_lens, draft_mask,
                  depth, sinks, scale=scale, logit_cap=logit_cap, v_scale=v_scale, window=max(window, 0),
                  num_splits=num_splits, block_n=block_n, fp8=fp8, draft=k, visited=visited)


@triton_op("compiled_attn::triton_verify", mutates_args=())
def _verify_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
               req_rows: torch.Tensor, kv_lo: torch.Tensor, prefix_lens: torch.Tensor, draft_mask: torch.Tensor,
               sinks: torch.Tensor | None, scale: float, logit_cap: float, v_scale: float, window: int,
               num_splits: int, block_n: int, fp8: int) -> torch.Tensor:
    """The op behind ``triton_verify`` (arguments already checked; draft_mask as uint8, window -1: none)."""
    return _verify(q, k_cache, v_cache, req_to_token, req_rows, kv_lo, prefix_lens, draft_mask, sinks, scale,
                   logit_cap, v_scale, window, num_splits, block_n, fp8)


def triton_verify(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                  req_rows: torch.Tensor, kv_lo: torch.Tensor, prefix_lens: torch.Tensor, draft_mask: torch.Tensor,
                  *, scale: float, page_size: int = 1, num_splits: int, block_n: int, logit_cap: float = 0.0,
                  k_scale: float = 1.0, v_scale: float = 1.0, sinks: torch.Tensor | None = None,
                  kv_float8_dtype: torch.dtype | None = None, sliding_window: int | None = None,
                  visited: torch.Tensor | None = None) -> torch.Tensor:
    """Verify attention: q: [bs * k, Hq, Dqk], token-major (request b's draft tokens at rows b*k .. b*k+k-1).

    Request b reads key positions ``[kv_lo[b], prefix_lens[b] + k)``: the prefix ``[kv_lo, prefix_len)`` (kv_lo:
    0, or with a window at most ``max(0, prefix_len - window)``) and the k draft keys after it;
    draft_mask: [bs, k, k] bool, draft_mask[b, i, j]: token i sees draft key j (diagonal set).
    kv_lo, prefix_lens: [bs] int32/int64; sliding_window: None or w >= 0 (token at position p sees keys >= p - w).
    Caches, req_to_token, req_rows, sinks, scales, cap, float8, num_splits, block_n, page_size and visited as
    ``triton_decode``. Returns [bs * k, Hq, Dv] in q.dtype."""
    k_cache, v_cache, fp8 = check_kv(q, k_cache, v_cache, kv_float8_dtype)
    check_tensor("draft_mask", draft_mask, 3, (torch.bool,), q.device)
    bs, k = draft_mask.shape[0], draft_mask.shape[1]
    if k < 1 or draft_mask.shape[2] != k:
        raise ValueError(f"draft_mask must have shape [bs, k, k] with k >= 1, got {tuple(draft_mask.shape)}")
    if q.shape[0] != bs * k:
        raise ValueError(f"q must have bs * k = {bs * k} rows (draft_mask is [{bs}, {k}, {k}]), got {q.shape[0]}")
    check_rows(req_to_token, req_rows, {"kv_lo": kv_lo, "prefix_lens": prefix_lens}, bs, q.device)
    check_settings(scale=scale, page_size=page_size, num_splits=num_splits, block_n=block_n, logit_cap=logit_cap,
                   k_scale=k_scale, v_scale=v_scale)
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 0):
        raise ValueError(f"sliding_window must be None or an int >= 0, got {sliding_window}")
    check_extras(sinks, visited, q.shape[1], (bs, k_cache.shape[1], num_splits), q.device)
    window = -1 if sliding_window is None else sliding_window
    mask = draft_mask.view(torch.uint8)  # the kernel loads bytes; a bool pointer's width is backend-specific
    args = (q, k_cache, v_cache, req_to_token, req_rows, kv_lo, prefix_lens, mask, sinks, float(scale * k_scale),
            float(logit_cap), float(v_scale), window, num_splits, block_n, fp8)
    if visited is None:
        return torch.ops.compiled_attn.triton_verify(*args)
    return _verify(*args, visited=visited)
