"""The draft-token masks of speculative verify: the chain, and SGLang's flat tree masks.

Custom mask layouts (SGLang 0.5.23, ``speculative.eagle_utils.TreeMaskMode``), flat bool (or int8/uint8):
  * ``"draft"`` (QLEN_ONLY, SGLang's default on CPU): per request a ``[k, k]`` row-major block, concatenated:
    ``mask[b * k * k + i * k + j]``: query ``i`` of request ``b`` sees draft key ``j``.
  * ``"full"`` (FULL_MASK, the GPU kernels' layout): per request a ``[k, prefix_len + k]`` row-major block,
    concatenated: request ``b`` starts at ``sum_{c < b} k * (prefix_c + k)``; its draft columns are
    ``prefix_b + j``. As SGLang's triton extend kernel (``skip_prefix_custom_mask=True``), the prefix columns are
    not read: the prefix is always fully visible.
"""
from __future__ import annotations

import torch

from . import validate

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
    would read another request's rows); TypeError/ValueError naming ``custom_mask`` and the rule otherwise."""
    validate.check_tensor("custom_mask", custom_mask, 1, MASK_DTYPES, device)
    want = mask_numel(prefix_lens, k, layout)
    if custom_mask.numel() != want:
        rule = "bs * k * k" if layout == "draft" else "k * sum(prefix_lens) + bs * k * k"
        raise ValueError(f"custom_mask has {custom_mask.numel()} elements; mask_layout={layout!r} with "
                         f"bs={prefix_lens.shape[0]}, draft_len={k} needs {rule} = {want}")
