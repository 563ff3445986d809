"""Per-batch metadata built by ``plan``: small tensors padded to a batch bucket, plus shape carriers.

Capacities are carried as the *lengths* of ``arange`` tensors (``block_ids``, ``q_ids``, ``kv_ids``), never as
Python ints, so a compiled ``run`` sees one tensor signature per bucket and new values never recompile it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DecodeMetadata:
    """Decode batch, padded to ``bs_cap`` rows (padded rows: row 0, empty range).

    req_rows:      [bs_cap] int64, request row in req_to_token
    kv_lo, kv_hi:  [bs_cap] int64, the key positions ``[kv_lo, kv_hi)`` each request reads
    block_ids:     [num_blocks] int64 arange, the block capacity of this bucket
    block_offsets: [block_size] int64 arange
    num_real:      real batch size (rows past it are padding)
    blocks_needed: blocks the real batch uses (<= num_blocks)
    """

    req_rows: torch.Tensor
    kv_lo: torch.Tensor
    kv_hi: torch.Tensor
    block_ids: torch.Tensor
    block_offsets: torch.Tensor
    num_real: int
    blocks_needed: int

    def step_inputs(self) -> dict[str, torch.Tensor]:
        """The tensors a captured decode step reads, by name."""
        return {"req_rows": self.req_rows, "kv_lo": self.kv_lo, "kv_hi": self.kv_hi,
                "block_ids": self.block_ids, "block_offsets": self.block_offsets}


@dataclass
class ExtendMetadata:
    """Extend batch, padded to ``[bs_cap, q_cap]`` queries and ``[bs_cap, kv_cap]`` keys per request.

    Key ``j`` of request ``b`` is position ``kv_lo[b] + j`` of its req_to_token row; query ``i`` sits at
    ``q_first[b] + i`` in the same coordinates (so causal is ``j <= q_first + i``).

    req_rows:      [bs_cap] int64
    kv_lo:         [bs_cap] int64, first key position read (encoder offset, sliding-window start)
    kv_len:        [bs_cap] int64, keys read
    q_first:       [bs_cap] int64, first query's position relative to kv_lo
    q_len:         [bs_cap] int64, new tokens (queries) of the request
    q_offsets:     [bs_cap] int64, where the request's queries start in the packed q
    q_ids:         [q_cap] int64 arange; kv_ids: [kv_cap] int64 arange
    causal, sliding_window: per-layer settings, static
    num_real, num_tokens: real batch size and packed query count
    """

    req_rows: torch.Tensor
    kv_lo: torch.Tensor
    kv_len: torch.Tensor
    q_first: torch.Tensor
    q_len: torch.Tensor
    q_offsets: torch.Tensor
    q_ids: torch.Tensor
    kv_ids: torch.Tensor
    causal: bool
    sliding_window: int | None
    num_real: int
    num_tokens: int
