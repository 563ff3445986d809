"""Block arithmetic of KV ranges, shared by planning (``plan``, ``verify_plan``, graph checks) and the per-step index
builders (``decode``, ``verify``): ceiling division, the page-run unit a gather reads, where a request's first
block starts and how many blocks a range takes.

The tensor forms are pure tensor code (no ``.item()``, no host sync), so index builders call them inside compiled or
graph-captured steps; the host counts take Python ints (or small host tensors, read once).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["aligned_kv_lo", "cdiv", "decode_blocks_needed", "gather_unit", "total_blocks_needed"]


def cdiv(n, d):
    """Ceiling division of a non-negative int or integer tensor ``n`` by a positive ``d``."""
    return (n + d - 1) // d


def gather_unit(page_size: int, block_size: int) -> int:
    """Positions per gathered run of consecutive slots: ``gcd(page_size, block_size)`` (1 without pages)."""
    a, b = int(page_size), int(block_size)
    if a == 1:  # a token-granular cache, the common case
        return 1
    while b:  # Euclid by hand: dynamo cannot trace math.gcd on a shape
        a, b = b, a % b
    return a


def aligned_kv_lo(kv_lo, unit: int):
    """Where a request's first block starts: ``kv_lo`` (an int or an int64 tensor, any shape) rounded down to a
    multiple of the gather ``unit`` (each run of ``unit`` positions then lies in one page); the fewer than ``unit``
    positions before ``kv_lo`` are masked."""
    return kv_lo if unit == 1 else kv_lo - kv_lo % unit


def decode_blocks_needed(kv_lo: torch.Tensor, kv_hi: torch.Tensor, block_size: int, page_size: int = 1
                         ) -> torch.Tensor:
    """kv_lo, kv_hi: [bs] int64 -> [bs] int64, the blocks each request's range ``[kv_lo, kv_hi)`` takes (its first
    block starting at a run boundary); pure tensor code."""
    start = aligned_kv_lo(kv_lo, gather_unit(page_size, block_size))
    return cdiv((kv_hi - start).clamp_min(0), block_size) * (kv_hi > kv_lo)


def total_blocks_needed(kv_lo: Sequence[int] | torch.Tensor, kv_hi: Sequence[int] | torch.Tensor, block_size: int,
                        page_size: int = 1) -> int:
    """``decode_blocks_needed(...).sum()`` as a Python int, over ranges given as [bs] host tensors (read once) or
    lists of ints: a plan's and a graph check's count without the ~9 small tensor ops of the tensor form (tens of us
    at batch 1)."""
    unit = gather_unit(page_size, block_size)
    if isinstance(kv_lo, torch.Tensor):
        kv_lo, kv_hi = kv_lo.tolist(), kv_hi.tolist()
    return sum([(hi - lo + lo % unit + block_size - 1) // block_size
                for lo, hi in zip(kv_lo, kv_hi, strict=True) if hi > lo])
