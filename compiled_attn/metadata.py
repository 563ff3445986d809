"""Per-batch metadata built by ``plan``: small tensors padded to a batch bucket, plus shape carriers.

Each stage has one named type for the tensors its per-step index builder reads (``DecodeInputs``; the tiled
extend's ``ExtendTileInputs``, planned from ``ExtendInputs``): ``plan_*`` returns them inside the metadata,
``build_*_index`` takes them, and a captured step's static buffers hold exactly their fields. Capacities are
carried as the *lengths* of ``arange`` tensors (``block_ids``, ``q_ids``, ``k_ids``), never as Python ints, so a
compiled step sees one tensor signature per bucket and new values never recompile it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["DecodeInputs", "DecodeMetadata", "ExtendInputs", "ExtendMetadata"]


class DecodeInputs(NamedTuple):
    """The per-step tensors of a decode batch (padded rows: row 0, empty range).

    req_rows:      [bs_cap] int64, request row in req_to_token
    kv_lo, kv_hi:  [bs_cap] int64, the key positions ``[kv_lo, kv_hi)`` each request reads
    block_ids:     [num_blocks] int64 arange, the block capacity of this bucket
    block_offsets: [block_size] int64 arange
    """

    req_rows: torch.Tensor
    kv_lo: torch.Tensor
    kv_hi: torch.Tensor
    block_ids: torch.Tensor
    block_offsets: torch.Tensor

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> DecodeInputs:
        """The fields picked by name from a mapping that may hold more (a captured step's static buffers)."""
        return cls(*(tensors[name] for name in cls._fields))


class ExtendInputs(NamedTuple):
    """The per-step tensors of an extend batch. Key ``j`` of request ``b`` is position ``kv_lo[b] + j`` of its
    req_to_token row; query ``i`` sits at ``q_first[b] + i`` in the same coordinates (causal: ``j <= q_first + i``).

    req_rows:      [bs_cap] int64
    kv_lo:         [bs_cap] int64, first key position read (encoder offset, sliding-window start)
    kv_len:        [bs_cap] int64, keys read
    q_first:       [bs_cap] int64, first query's position relative to kv_lo
    q_len:         [bs_cap] int64, new tokens (queries) of the request
    q_offsets:     [bs_cap] int64, where the request's queries start in the packed q
    """

    req_rows: torch.Tensor
    kv_lo: torch.Tensor
    kv_len: torch.Tensor
    q_first: torch.Tensor
    q_len: torch.Tensor
    q_offsets: torch.Tensor


@dataclass
class DecodeMetadata:
    """A planned decode batch: its step inputs (padded to ``bs_cap`` rows) and what the host knows about it.

    num_real:      real batch size (rows past it are padding)
    blocks_needed: blocks the real batch uses (<= num_blocks)
    slots_checked: plan checked that every req_to_token entry the batch reads is a slot (``check_slots``)
    page_size:     the cache's page size the blocks were planned for (pass it to ``build_decode_index``)
    """

    inputs: DecodeInputs
    num_real: int
    blocks_needed: int
    slots_checked: bool = False
    page_size: int = 1

    @property
    def block_size(self) -> int:
        return self.inputs.block_offsets.shape[0]


@dataclass
class ExtendMetadata:
    """A planned extend batch: its step inputs, the per-layer static settings, and host counts.

    causal, sliding_window: static settings (one compiled graph per value)
    num_real, num_tokens: real batch size and packed query count
    """

    inputs: ExtendInputs
    causal: bool
    sliding_window: int | None
    num_real: int
    num_tokens: int
