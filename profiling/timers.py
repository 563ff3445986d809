"""Small, generic timing helpers for benchmarks: per-call wall times, medians, aligned text tables.

Example (backend x batch-size latency table)::

    table = LatencyTable(row_label="backend", columns=[1, 8, 64], unit="us")
    for backend in backends:
        for bs in (1, 8, 64):
            secs = time_fn(lambda: step(backend, bs), warmup=5, iters=50, sync=torch.cuda.synchronize)
            table.add(backend, bs, median(secs))
    print(table.format())
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["time_fn", "time_interleaved", "balanced_orders", "median", "spread", "round_ratios",
           "format_table", "LatencyTable", "range_overhead_ns"]

_UNIT_SCALE = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}


def time_fn(fn: Callable[[], Any], *, warmup: int, iters: int,
            sync: Callable[[], Any] | None = None) -> list[float]:
    """Call ``fn()`` ``warmup`` times untimed, then ``iters`` times timed; return seconds per call.

    ``sync`` (e.g. ``torch.cuda.synchronize``) is called before each timed call starts and before its clock
    stops, so asynchronous device work is included; leave it ``None`` for CPU-only work.
    """
    if warmup < 0 or iters < 1:
        raise ValueError(f"time_fn needs warmup >= 0 and iters >= 1, got warmup={warmup}, iters={iters}")
    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
    times = []
    clock = time.perf_counter
    for _ in range(iters):
        start = clock()
        fn()
        if sync is not None:
            sync()
        times.append(clock() - start)
    return times


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` candidates, one per round, in which each candidate follows every other equally often
    (a Williams design: rows ``first + r`` mod n, and their reverses where n is odd); ``[[0, 1]]`` for two (each
    already always follows the other), ``[[0]]`` for one.

    Why: a call leaves the caches holding what it read, so a candidate that always runs right after one reading the
    same data (one decode step after a verify over the same prefix) is timed warm and the others are not
    (docs/measuring.md has the numbers)."""
    if n <= 2:
        return [list(range(n))]
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n - 1, 2, n - 2, ..
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def time_interleaved(fns: dict[str, Callable[[], Any]], *, warmup: int, iters: int,
                     sync: Callable[[], Any] | None = None, budget_s: float | None = None) -> dict[str, list[float]]:
    """Time several callables in rounds (one call of each per round) and return seconds per call by name.

    On a shared machine a slow spell then hits every candidate alike, so their ratios hold where back-to-back
    ``time_fn`` runs would charge it to whichever candidate was running. The rounds take ``balanced_orders``' orders
    in turn, so that no candidate always runs after the same one (whose reads it would find in cache).
    ``budget_s``: run fewer rounds (but at least 3, or ``iters`` if smaller) when the last warm-up round says
    ``iters`` rounds would take longer.
    """
    if warmup < 0 or iters < 1:
        raise ValueError(f"time_interleaved needs warmup >= 0 and iters >= 1, got warmup={warmup}, iters={iters}")
    round_s = 0.0
    for _ in range(warmup):
        round_s = sum(sum(time_fn(fn, warmup=0, iters=1, sync=sync)) for fn in fns.values())
    if budget_s is not None and warmup:
        iters = max(min(3, iters), min(iters, int(budget_s / max(round_s, 1e-9))))
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    orders = balanced_orders(len(names))
    for r in range(iters):
        for i in orders[r % len(orders)]:
            times[names[i]] += time_fn(fns[names[i]], warmup=0, iters=1, sync=sync)
    return times


def median(xs: Iterable[float]) -> float:
    """The median of ``xs`` (raises ``ValueError`` on an empty sequence)."""
    values = list(xs)
    if not values:
        raise ValueError("median() of an empty sequence")
    return statistics.median(values)


def spread(xs: Iterable[float]) -> tuple[float, float, float]:
    """``(min, median, max)`` of ``xs`` (raises ``ValueError`` on an empty sequence)."""
    values = list(xs)
    return min(values), median(values), max(values)


def round_ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """Per-round ratios ``num[i] / den[i]`` of two candidates timed in the same rounds (round-robin).

    A slow spell inside one round hits both candidates, so the per-round ratio is steadier than a ratio of
    medians taken at different times; its min..max says how far a comparison can be trusted.
    """
    if len(num) != len(den) or not num:
        raise ValueError(f"round_ratios needs two equal, non-empty sequences, got {len(num)} and {len(den)}")
    return [a / b for a, b in zip(num, den, strict=True)]


def _cell(value: Any, precision: int) -> str:
    """Text for one table cell: floats with fixed precision, ``None``/NaN as ``-``."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{precision}f}"
    return str(value)


def format_table(rows: Sequence[Sequence[Any]] | Sequence[dict], columns: Sequence[str], *,
                 precision: int = 2) -> str:
    """Aligned plain-text table. ``rows`` are sequences (in column order) or dicts keyed by column name.

    The first column is left-aligned, the others right-aligned (numbers). Missing values print as ``-``.
    """
    columns = [str(c) for c in columns]
    text_rows = []
    for row in rows:
        values = [row.get(c) for c in columns] if isinstance(row, dict) else list(row)
        if len(values) != len(columns):
            raise ValueError(f"row {row!r} has {len(values)} values for {len(columns)} columns")
        text_rows.append([_cell(v, precision) for v in values])
    widths = [max([len(c)] + [len(r[i]) for r in text_rows]) for i, c in enumerate(columns)]

    def line(cells: Sequence[str]) -> str:
        parts = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=False)]
        return "  ".join(parts).rstrip()

    out = [line(columns), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in text_rows)
    return "\n".join(out)


class LatencyTable:
    """Collects latencies (in seconds) keyed by (row, column) and prints them in ``unit``.

    Rows appear in insertion order; columns are fixed up front (e.g. batch sizes). Missing cells print ``-``.
    """

    def __init__(self, row_label: str, columns: Sequence[Any], *, unit: str = "us", precision: int = 2):
        if unit not in _UNIT_SCALE:
            raise ValueError(f"unit must be one of {sorted(_UNIT_SCALE)}, got {unit!r}")
        self.row_label = row_label
        self.columns = list(columns)
        self.unit = unit
        self.precision = precision
        self._cells: dict[Any, dict[Any, float]] = {}

    def add(self, row: Any, column: Any, seconds: float) -> None:
        """Record one latency in seconds."""
        if column not in self.columns:
            raise KeyError(f"unknown column {column!r}; columns are {self.columns}")
        self._cells.setdefault(row, {})[column] = seconds

    def get(self, row: Any, column: Any) -> float | None:
        """The recorded latency in seconds, or ``None``."""
        return self._cells.get(row, {}).get(column)

    def format(self, title: str | None = None) -> str:
        """The table as text; the header names the unit."""
        scale = _UNIT_SCALE[self.unit]
        header = [f"{self.row_label} ({self.unit})"] + [str(c) for c in self.columns]
        rows = []
        for row, cells in self._cells.items():
            values = [cells[c] * scale if c in cells else None for c in self.columns]
            rows.append([str(row)] + values)
        text = format_table(rows, header, precision=self.precision)
        return f"{title}\n{text}" if title else text

    def __str__(self) -> str:
        return self.format()


def _per_range_ns(n: int, repeats: int) -> float:
    """Median over ``repeats`` runs of the per-range cost of ``with range("attn", layer=0, bs=8): pass``."""
    from profiling.ranges import range as prange

    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(n):
            with prange("attn", layer=0, bs=8):
                pass
        samples.append((time.perf_counter_ns() - start) / n)
    return median(samples)


def range_overhead_ns(n: int = 100_000, repeats: int = 5) -> dict[str, float]:
    """Median cost in ns of entering+leaving one ``profiling.range`` with ranges off and on.

    Returns ``{"off": ns, "on": ns, "loop": ns}``, where ``loop`` is the empty-loop baseline (not subtracted).
    "on" without an attached NVTX tool (no nsys) measures our code, the nvtx dummy domain and
    record_function with no active profiler; under nsys the NVTX push/pop adds the tool's own cost.
    """
    from profiling.ranges import enabled_ranges

    start = time.perf_counter_ns()
    for _ in range(n):
        pass
    loop = (time.perf_counter_ns() - start) / n
    with enabled_ranges(False):
        off = _per_range_ns(n, repeats)
    with enabled_ranges(True):
        on = _per_range_ns(max(1, n // 10), repeats)
    return {"off": off, "on": on, "loop": loop}


if __name__ == "__main__":
    print(range_overhead_ns())
