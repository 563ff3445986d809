"""Bucket policy: which static shapes get a compiled graph (and, on CUDA, a captured CUDA graph).

A captured graph fixes every shape, so a batch is padded up to a bucket. The key of a graph is
``(batch_bucket, kv_bucket)``: the batch-size bucket (SGLang's default list, so a user's mental model carries
over) and a kv-capacity bucket (token capacity of the slot table the step reads; a few geometric steps up to
the context limit, so a short-context batch does not pay for the whole table width).

    policy = BucketPolicy.create(max_batch_size=64, max_kv_tokens=4096)
    key = policy.key(bs=5, kv_tokens=300)      # (8, 512); None when bs is beyond the largest bucket
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_BATCH_SIZES", "BucketPolicy", "cdiv", "kv_capacities"]

# SGLang's default capture list (``cuda_graph_runner.get_batch_sizes_to_capture``, padding enabled).
DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 12) + tuple(range(16, 257, 8))

# kv capacities are rounded up to this many tokens: a whole number of pages for any common page size, and
# aligned rows for the matmuls.
KV_ALIGN = 64


def cdiv(n, d):
    """Ceiling division of a non-negative int or integer tensor ``n`` by a positive ``d``."""
    return (n + d - 1) // d


def _round_up(n: int, multiple: int) -> int:
    return cdiv(n, multiple) * multiple


def _normalize(name: str, values: Iterable[int]) -> tuple[int, ...]:
    """Sorted, de-duplicated positive ints; ValueError naming ``name`` for anything else."""
    try:
        items = list(values)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of positive ints, got {values!r}") from None
    if not items:
        raise ValueError(f"{name} must not be empty")
    for v in items:
        # bool is an int subclass; True as a batch size is almost certainly a bug.
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must contain positive ints only, got {v!r} in {items!r}")
    return tuple(sorted(set(items)))


def _check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def kv_capacities(max_kv_tokens: int, *, min_kv_tokens: int = 256, growth: float = 2.0) -> tuple[int, ...]:
    """Geometric kv capacities ``min_kv_tokens, *growth, ...`` rounded up to multiples of 64, ending exactly at
    ``max_kv_tokens`` (which need not be a multiple of 64). ``min_kv_tokens >= max_kv_tokens`` -> one bucket."""
    _check_positive_int("max_kv_tokens", max_kv_tokens)
    _check_positive_int("min_kv_tokens", min_kv_tokens)
    if not (isinstance(growth, (int, float)) and math.isfinite(growth) and growth > 1.0):
        raise ValueError(f"kv_growth must be a finite number > 1, got {growth!r}")
    caps: list[int] = []
    cap = float(min_kv_tokens)
    while (rounded := _round_up(math.ceil(cap), KV_ALIGN)) < max_kv_tokens:
        if not caps or rounded > caps[-1]:  # a small growth can round to the same multiple twice
            caps.append(rounded)
        cap *= growth
    caps.append(max_kv_tokens)
    return tuple(caps)


@dataclass(frozen=True)
class BucketPolicy:
    """The static shapes to compile/capture: batch-size buckets x kv-capacity buckets.

    batch_sizes:   sorted, unique, positive batch sizes (a batch of ``bs`` rows runs in the smallest >= bs).
    kv_capacities: sorted, unique, positive token capacities (a batch whose longest sequence has ``n`` tokens
                   runs with the smallest capacity >= n).
    Both are normalized (sorted, de-duplicated) on construction; empty or non-positive entries -> ValueError.
    """

    batch_sizes: tuple[int, ...]
    kv_capacities: tuple[int, ...]

    def __post_init__(self) -> None:
        # frozen dataclass: normalize through object.__setattr__ (once, at construction).
        object.__setattr__(self, "batch_sizes", _normalize("batch_sizes", self.batch_sizes))
        object.__setattr__(self, "kv_capacities", _normalize("kv_capacities", self.kv_capacities))

    @classmethod
    def create(
        cls,
        max_batch_size: int,
        max_kv_tokens: int,
        *,
        batch_sizes: Sequence[int] | None = None,
        min_kv_tokens: int = 256,
        kv_growth: float = 2.0,
    ) -> BucketPolicy:
        """Buckets for serving up to ``max_batch_size`` requests of up to ``max_kv_tokens`` tokens.

        Batch sizes, following SGLang: the default list (or ``batch_sizes``) capped at ``max_batch_size``.
        With the default list, ``max_batch_size`` itself is always a bucket (SGLang appends the request-pool
        size, so e.g. 10 -> ``1, 2, 4, 8, 10`` and 300 -> ``..., 256, 300``); an explicit ``batch_sizes`` is
        taken as given apart from the cap (entries above ``max_batch_size`` are dropped, as SGLang does).
        kv capacities: see ``kv_capacities``.
        """
        _check_positive_int("max_batch_size", max_batch_size)
        if batch_sizes is None:
            sizes = [b for b in DEFAULT_BATCH_SIZES if b <= max_batch_size] + [max_batch_size]
        else:
            given = _normalize("batch_sizes", batch_sizes)
            sizes = [b for b in given if b <= max_batch_size]
            if not sizes:
                raise ValueError(
                    f"batch_sizes {list(given)} has no entry <= max_batch_size={max_batch_size}"
                )
        caps = kv_capacities(max_kv_tokens, min_kv_tokens=min_kv_tokens, growth=kv_growth)
        return cls(tuple(sizes), caps)

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    @property
    def max_kv_tokens(self) -> int:
        return self.kv_capacities[-1]

    def batch_bucket(self, bs: int) -> int | None:
        """The smallest batch bucket >= ``bs``; None when ``bs`` exceeds the largest (-> fallback path)."""
        if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0:
            raise ValueError(f"bs must be a positive int, got {bs!r}")
        i = bisect.bisect_left(self.batch_sizes, bs)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def kv_bucket(self, n: int) -> int:
        """The smallest kv capacity >= ``n`` tokens (``n >= 0``); ValueError when ``n`` exceeds the largest."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n (kv tokens) must be a non-negative int, got {n!r}")
        i = bisect.bisect_left(self.kv_capacities, n)
        if i == len(self.kv_capacities):
            raise ValueError(
                f"n={n} kv tokens exceeds the largest kv capacity {self.max_kv_tokens} (max_kv_tokens)"
            )
        return self.kv_capacities[i]

    def key(self, bs: int, kv_tokens: int) -> tuple[int, int] | None:
        """``(batch_bucket(bs), kv_bucket(kv_tokens))``, or None when ``bs`` is beyond the largest bucket."""
        b = self.batch_bucket(bs)
        return None if b is None else (b, self.kv_bucket(kv_tokens))

    def keys(self) -> tuple[tuple[int, int], ...]:
        """Every ``(bs, kv)`` pair, largest first (capture order: smaller graphs then reuse the pool's memory)."""
        return tuple((b, c) for b in reversed(self.batch_sizes) for c in reversed(self.kv_capacities))
