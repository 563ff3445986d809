"""Planning a verify batch (``verify``'s host side), and the draft-token masks: the chain and SGLang's tree masks.

Custom mask layouts (SGLang's ``TreeMaskMode``), flat bool (or int8/uint8):
  * ``"draft"`` (QLEN_ONLY, SGLang's default on CPU): per request a ``[k, k]`` row-major block, concatenated:
    ``mask[b * k * k + i * k + j]``: query ``i`` of request ``b`` sees draft key ``j``.
  * ``"full"`` (FULL_MASK): per request a ``[k, prefix_len + k]`` row-major block, concatenated; its draft columns
    are ``prefix_b + j``. The prefix columns are not read (as SGLang's ``skip_prefix_custom_mask=True``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import validate
from .plan import DEFAULT_BLOCK_SIZE, cdiv, check_capacity, fields_of, gather_unit, int64_rows, total_blocks_needed

__all__ = ["CPU_MAX_VERIFY_BLOCK", "MASK_LAYOUTS", "VerifyInputs", "VerifyMetadata", "chain_mask", "check_custom_mask",
           "draft_mask_from_custom", "full_mask_numel", "mask_numel", "plan_verify", "prefix_blocks_needed",
           "verify_block_size", "window_start"]


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

    of = classmethod(fields_of)


@dataclass
class VerifyMetadata:
    """A planned verify batch: its step inputs, ``num_real`` rows, ``k`` draft tokens and ``prefix_blocks_needed``."""

    inputs: VerifyInputs
    num_real: int
    draft_len: int
    blocks_needed: int
    page_size: int = 1
    sliding_window: int | None = None


#: the longest prefix block on CPU: its per-thread scratch would crowd K/V out of L2; small batches need more blocks
CPU_MAX_VERIFY_BLOCK = 128


def verify_block_size(draft_len: int, device: torch.device | str | None = None) -> int:
    """Prefix block length for ``k`` draft tokens: ``64 * k`` within [64, 512] (on a CPU ``device``, at most
    ``CPU_MAX_VERIFY_BLOCK``). Why: the matmul form copies a request's ``k * Hq`` query rows per block; longer
    blocks keep that copy small."""
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
    prefix blocks of ``block_size`` tokens (defaults: what the batch needs; ``verify_block_size``).

    q: [bs * k, Hq, Dqk], request b's queries at rows ``[b * k, (b + 1) * k)``; caches and table as ``plan_decode``;
    req_pool_indices, prefix_lens: [bs]; draft_len: k (int >= 1); custom_mask: None (chain) or a flat mask of exactly
    the ``mask_layout``'s size (``mask_numel``); check_slots, page_size: as ``plan_decode`` (over
    ``[0, prefix_len + k)``); sliding_window: as ``build_verify_index`` (sizes the prefix blocks).
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
    rows = validate.table_rows(req_to_token, req_pool_indices, bs, device)
    prefix = validate.length_values("prefix_lens", prefix_lens, bs, device)
    ends = [n + k for n in prefix]  # the draft keys' end: the positions read are [0, prefix_len + k)
    validate.check_kv_end(ends, req_to_token.shape[1], "prefix_lens + draft_len")
    if mask_layout not in MASK_LAYOUTS:
        raise ValueError(f"mask_layout must be one of {MASK_LAYOUTS}, got {mask_layout!r}")
    prefix_host = torch.tensor(prefix, dtype=torch.int64)
    if custom_mask is not None:
        check_custom_mask(custom_mask, prefix_host, k, mask_layout, device)
    if check_slots:  # from position 0
        validate.check_slots(req_to_token, rows, [0] * bs, ends, k_cache.shape[0])
    validate.check_window_and_cap(sliding_window, None)
    needed = prefix_blocks_needed(prefix_host, k, block_size, page_size, sliding_window)
    bs_cap = check_capacity("batch_capacity", batch_capacity, bs)
    nblk = check_capacity("block_capacity", block_capacity, needed)
    mask = chain_mask(bs_cap, k, device).clone()
    if custom_mask is not None and bs:
        mask[:bs] = draft_mask_from_custom(custom_mask, prefix_host.to(device), k, mask_layout)
    req_rows, prefix_lens = int64_rows([rows, prefix], bs_cap, device)
    inputs = VerifyInputs(req_rows, prefix_lens, torch.arange(nblk, device=device),
                          torch.arange(block_size, device=device), mask)
    return VerifyMetadata(inputs, num_real=bs, draft_len=k, blocks_needed=needed, page_size=page_size,
                          sliding_window=sliding_window)


def prefix_blocks_needed(prefix_lens: torch.Tensor, k: int, block_size: int, page_size: int,
                         sliding_window: int | None) -> int:
    """The prefix blocks a batch's rows take (``prefix_lens``: [bs] int64 on the host), from 0 or ``window_start``."""
    lo = torch.zeros_like(prefix_lens) if sliding_window is None else window_start(
        prefix_lens, k, sliding_window, gather_unit(page_size, block_size))
    return total_blocks_needed(lo, prefix_lens, block_size, page_size)


def window_start(prefix: torch.Tensor, k: int, window: int, unit: int) -> torch.Tensor:
    """[bs] where a windowed verify's prefix blocks start: the deepest draft token's first visible position, rounded
    up to a multiple of the gather ``unit`` (keys every token sees, from a page boundary), at most ``prefix``."""
    first = (prefix + (k - 1 - window)).clamp_min(0)
    return torch.minimum(cdiv(first, unit) * unit, prefix)


MASK_LAYOUTS = ("draft", "full")
MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)


def chain_mask(bs: int, k: int, device=None) -> torch.Tensor:
    """[bs, k, k] bool: the causal chain (topk 1), query ``i`` sees draft keys ``j <= i``."""
    return torch.ones(k, k, dtype=torch.bool, device=device).tril().expand(bs, k, k)


def draft_mask_from_custom(custom_mask: torch.Tensor, prefix_lens: torch.Tensor, k: int, layout: str = "draft"
                           ) -> torch.Tensor:
    """SGLang's flat custom mask -> [bs, k, k] bool (the draft columns only); pure tensor code.

    custom_mask: flat, at least the layout's size (a larger pre-allocated buffer's tail is ignored);
    prefix_lens: [bs] int64 (read by the ``"full"`` layout only, to find each request's block)."""
    bs = prefix_lens.shape[0]
    if layout == "draft":
        return custom_mask[: bs * k * k].view(bs, k, k) != 0
    width = prefix_lens + k  # [bs], each request's row length
    starts = torch.cumsum(k * width, 0) - k * width
    ar = torch.arange(k, device=prefix_lens.device)
    idx = starts[:, None, None] + ar[None, :, None] * width[:, None, None] + prefix_lens[:, None, None] + ar
    return custom_mask.index_select(0, idx.reshape(-1)).view(bs, k, k) != 0


def full_mask_numel(prefix_lens: torch.Tensor, k: int) -> int:
    """Elements a ``"full"``-layout mask of this batch holds: ``k * sum(prefix_lens) + bs * k * k``."""
    return int(k * prefix_lens.sum()) + prefix_lens.shape[0] * k * k


def mask_numel(prefix_lens: torch.Tensor, k: int, layout: str) -> int:
    """Elements a custom mask of this batch holds in ``layout``: ``bs * k * k`` (draft) or ``full_mask_numel``."""
    return prefix_lens.shape[0] * k * k if layout == "draft" else full_mask_numel(prefix_lens, k)


def check_custom_mask(custom_mask: torch.Tensor, prefix_lens: torch.Tensor, k: int, layout: str,
                      device: torch.device) -> None:
    """A batch's custom mask: flat, a mask dtype, on ``device``, exactly ``mask_numel`` elements (a wrong size
    would read another request's rows); TypeError/ValueError otherwise."""
    validate.check_tensor("custom_mask", custom_mask, 1, MASK_DTYPES, device)
    want = mask_numel(prefix_lens, k, layout)
    if custom_mask.numel() != want:
        rule = "bs * k * k" if layout == "draft" else "k * sum(prefix_lens) + bs * k * k"
        raise ValueError(f"custom_mask has {custom_mask.numel()} elements; mask_layout={layout!r} with "
                         f"bs={prefix_lens.shape[0]}, draft_len={k} needs {rule} = {want}")
