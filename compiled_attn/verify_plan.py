"""Planning a verify batch (``verify``'s host side): validate it and build its static-shape step inputs.

``plan_verify`` checks the batch (queries, table, prefix lengths, custom mask, slots, page layout) on the host and
pads it to its capacities; ``verify_block_size`` picks the prefix block length; ``window_start`` is where a
sliding-window layer's prefix blocks begin. Everything the step then runs is ``verify``'s tensor code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import validate
from .kv_blocks import aligned_kv_lo, cdiv, gather_unit, total_blocks_needed
from .plan import DEFAULT_BLOCK_SIZE, _capacity, _pad
from .verify_masks import MASK_LAYOUTS, chain_mask, check_custom_mask, draft_mask_from_custom

__all__ = ["CPU_MAX_VERIFY_BLOCK", "VerifyInputs", "VerifyMetadata", "plan_verify", "verify_block_size",
           "window_start"]


class VerifyInputs(NamedTuple):
    """The per-step tensors of a verify batch (padded rows: row 0, empty prefix, the chain mask).

    req_rows:      [bs_cap] int64, request row in req_to_token
    prefix_lens:   [bs_cap] int64, cached keys ``[0, prefix_len)``; the draft keys follow at ``prefix_len + j``
    block_ids:     [num_blocks] int64 arange, the prefix block capacity
    block_offsets: [block_size] int64 arange
    draft_mask:    [bs_cap, k, k] bool, query ``i`` sees draft key ``j`` (its length in dim 1 is ``k``)
    """

    req_rows: torch.Tensor
    prefix_lens: torch.Tensor
    block_ids: torch.Tensor
    block_offsets: torch.Tensor
    draft_mask: torch.Tensor


@dataclass
class VerifyMetadata:
    """A planned verify batch: its step inputs and what the host knows (``num_real`` rows, ``k`` draft tokens)."""

    inputs: VerifyInputs
    num_real: int
    draft_len: int
    blocks_needed: int
    page_size: int = 1


#: the longest prefix block on CPU: the kernel's tile path keeps a block's scores and bf16 weights per thread (1.5
#: KB a position at k = 8), which past 256 positions crowd the K/V stream out of L2, and a batch of one or two
#: requests needs blocks enough for every thread (the kernel folds a row's blocks, so shorter ones cost little)
CPU_MAX_VERIFY_BLOCK = 128


def verify_block_size(draft_len: int, device: torch.device | str | None = None) -> int:
    """Prefix block length for ``k`` draft tokens: ``64 * k`` within [64, 512] (on a CPU ``device``, at most
    ``CPU_MAX_VERIFY_BLOCK``). In the matmul form each block carries a copy of its request's ``k * Hq`` query rows
    and returns as many output rows, a quarter of the K/V bytes at k = 8 with 64-token blocks; longer blocks keep
    that small. The CPU kernel folds a request's blocks as it reads them, so there a block's length sizes only the
    index and the per-thread scratch of one block."""
    longest = CPU_MAX_VERIFY_BLOCK if device is not None and torch.device(device).type == "cpu" else 512
    return min(longest, max(DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE * draft_len))


def plan_verify(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    draft_len: int,
    custom_mask: torch.Tensor | None = None,
    *,
    mask_layout: str = "draft",
    batch_capacity: int | None = None,
    block_capacity: int | None = None,
    block_size: int | None = None,
    check_slots: bool = True,
    page_size: int = 1,
    sliding_window: int | None = None,
) -> VerifyMetadata:
    """Validate a verify batch and build its metadata, padded to ``batch_capacity`` rows and ``block_capacity``
    prefix blocks of ``block_size`` tokens (defaults: what the batch needs).

    q: [bs * k, Hq, Dqk], request b's queries at rows ``[b * k, (b + 1) * k)``; k_cache: [S, Hkv, Dqk];
    v_cache: [S, Hkv, Dv]; req_to_token: [max_reqs, max_context_len]; req_pool_indices, prefix_lens: [bs];
    draft_len: k (int >= 1); custom_mask: None (chain) or flat bool/int8/uint8 of exactly the ``mask_layout``'s size
    (``"draft"``: ``bs * k * k``; ``"full"``: ``k * sum(prefix_lens) + bs * k * k``; see the module docstring).
    block_size: prefix block length (default ``verify_block_size(draft_len, q.device)``);
    check_slots, page_size: as ``plan_decode`` (the checked range is ``[0, prefix_len + k)``);
    sliding_window: as ``build_verify_index`` (sizes the prefix blocks: those of its shorter range).
    """
    validate.check_qkv(q, k_cache, v_cache)
    validate.check_positive_int("draft_len", draft_len)
    block_size = verify_block_size(draft_len, q.device) if block_size is None else block_size
    validate.check_positive_int("block_size", block_size)
    validate.check_positive_int("page_size", page_size)
    device, k = q.device, draft_len
    validate.check_tensor("prefix_lens", prefix_lens, 1, validate.INDEX_DTYPES, device)
    bs = prefix_lens.shape[0]
    if q.shape[0] != bs * k:
        raise ValueError(f"q has {q.shape[0]} tokens but the batch has {bs} requests of draft_len={k} "
                         f"({bs * k} tokens); draft_len must be the same for every request")
    rows = validate.check_table(req_to_token, req_pool_indices, bs, device)
    prefix = validate.check_lengths("prefix_lens", prefix_lens, bs, device)
    validate.check_kv_end(prefix + k, req_to_token.shape[1], "prefix_lens + draft_len")
    if mask_layout not in MASK_LAYOUTS:
        raise ValueError(f"mask_layout must be one of {MASK_LAYOUTS}, got {mask_layout!r}")
    if custom_mask is not None:
        check_custom_mask(custom_mask, prefix, k, mask_layout, device)
    unit = gather_unit(page_size, block_size)
    if check_slots:
        start = aligned_kv_lo(torch.zeros_like(prefix), unit)
        validate.check_slots(req_to_token, rows, start, prefix + k, k_cache.shape[0])
        validate.check_page_layout(req_to_token, rows, start, prefix + k, page_size)
    validate.check_window_and_cap(sliding_window, None)
    lo = torch.zeros_like(prefix) if sliding_window is None else window_start(prefix, k, sliding_window, unit)
    needed = total_blocks_needed(lo, prefix, block_size, page_size)
    bs_cap = _capacity("batch_capacity", batch_capacity, bs)
    nblk = _capacity("block_capacity", block_capacity, needed)
    mask = chain_mask(bs_cap, k, device).clone()
    if custom_mask is not None and bs:
        mask[:bs] = draft_mask_from_custom(custom_mask, prefix.to(device), k, mask_layout)
    inputs = VerifyInputs(
        req_rows=_pad(rows, bs_cap).to(device),
        prefix_lens=_pad(prefix, bs_cap).to(device),
        block_ids=torch.arange(nblk, device=device),
        block_offsets=torch.arange(block_size, device=device),
        draft_mask=mask,
    )
    return VerifyMetadata(inputs, num_real=bs, draft_len=k, blocks_needed=needed, page_size=page_size)


def window_start(prefix: torch.Tensor, k: int, window: int, unit: int) -> torch.Tensor:
    """[bs] where a windowed verify's prefix blocks start: the deepest draft token's first visible position
    (``prefix + k - 1 - window``, at least 0), rounded up to a multiple of the gather ``unit`` (so the blocks hold
    only keys every token sees, from a run boundary on), at most ``prefix``. Pure tensor code."""
    first = (prefix + (k - 1 - window)).clamp_min(0)
    return torch.minimum(cdiv(first, unit) * unit, prefix)
