"""One summary format for our ranges, from a torch.profiler trace or from Nsight Systems.

Inputs (auto-detected by extension):

* ``*.json`` / ``*.json.gz``: a Chrome trace written by ``prof.export_chrome_trace(path)``. Our ranges are
  ``"ph": "X"`` events with ``"cat": "user_annotation"`` (from ``torch.profiler.record_function``); ``ts``
  and ``dur`` are in microseconds.
* ``*.csv``: ``nsys stats --report nvtx_sum --format csv`` output (older nsys: ``nvtxsum`` / ``nvtxppsum``).
  Columns: ``"Time (%)","Total Time (ns)","Instances","Avg (ns)","Med (ns)","Min (ns)","Max (ns)",
  "StdDev (ns)","Style","Range"``; older versions spell them ``Average``/``Median``/``Minimum``/``Maximum``
  and may lack the median or style. Columns are matched by name and the time unit is read from the header.
  Range names may carry the domain (``compiled_attn:decode_step bs=8``) or a leading ``:``; both are stripped.

Output, per range: count, total ms, median ms, share (%) of the step. The step reference is the summed time
of the ranges whose name starts with one of the step prefixes (default ``decode_step``, ``prefill_step``,
``extend_step``); without any, the whole trace's span (torch) or the sum of all ranges (nsys) is used.
Nested ranges are listed by their own names; a child's time is also contained in its parent's.

CLI: ``python -m profiling.summary TRACE [--group-by name|full]`` (also ``compiled-attn profile-summary``).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import re
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from profiling.ranges import DOMAIN
from profiling.timers import format_table

__all__ = ["RangeStat", "Summary", "DEFAULT_STEP_PREFIXES", "strip_attributes", "summarize_torch_trace",
           "summarize_nsys_csv", "format_summary", "main"]

DEFAULT_STEP_PREFIXES = ("decode_step", "prefill_step", "extend_step")
_UNITS_PER_MS = {"ns": 1e6, "us": 1e3, "μs": 1e3, "ms": 1.0, "s": 1e-3}


@dataclass
class RangeStat:
    """Aggregated timings of one range name. ``share`` is in percent of the reference (see ``Summary``)."""

    name: str
    count: int
    total_ms: float
    median_ms: float
    share: float = 0.0
    is_step: bool = False
    median_exact: bool = True  # False when merged nsys rows only allow an approximate median


class Summary(list):
    """A ``list[RangeStat]`` that also says what ``share`` is relative to."""

    def __init__(self, stats: Iterable[RangeStat], *, source: str, reference: str, reference_ms: float):
        super().__init__(stats)
        self.source = source
        self.reference = reference
        self.reference_ms = reference_ms


def strip_attributes(message: str) -> str:
    """The range name without its ``key=value`` attributes: ``"attn layer=3 bs=8"`` -> ``"attn"``."""
    tokens = []
    for token in message.split():
        if "=" in token:
            break
        tokens.append(token)
    return " ".join(tokens) or message.strip()


def _strip_domain(name: str, domain: str = DOMAIN) -> str:
    """Drop an nsys domain prefix (``compiled_attn:``) or a bare leading ``:``."""
    if name.startswith(domain + ":"):
        return name[len(domain) + 1:]
    return name[1:] if name.startswith(":") else name


def _is_step(name: str, step_prefixes: Sequence[str]) -> bool:
    return any(name.startswith(p) for p in step_prefixes)


def _finish(groups: dict[str, RangeStat], *, source: str, step_prefixes: Sequence[str],
            fallback_label: str, fallback_ms: float) -> Summary:
    """Mark step ranges, compute shares and sort (largest total first)."""
    for stat in groups.values():
        stat.is_step = _is_step(stat.name, step_prefixes)
    step_ms = sum(s.total_ms for s in groups.values() if s.is_step)
    if step_ms > 0:
        label = "step ranges (" + ", ".join(step_prefixes) + ")"
        ref_ms = step_ms
    else:
        label, ref_ms = fallback_label, fallback_ms
    for stat in groups.values():
        stat.share = 100.0 * stat.total_ms / ref_ms if ref_ms > 0 else 0.0
    ordered = sorted(groups.values(), key=lambda s: (not s.is_step, -s.total_ms, s.name))
    return Summary(ordered, source=source, reference=label, reference_ms=ref_ms)


# ---- torch.profiler Chrome trace ----

def _load_json(path: str) -> dict | list:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        # Some profiler versions leave a trailing comma before the closing bracket.
        fixed = re.sub(r",\s*([\]}])", r"\1", text)
        try:
            return json.loads(fixed)
        except json.JSONDecodeError:
            raise ValueError(f"{path}: not a valid Chrome trace JSON ({e})") from None


def _trace_events(data, path: str) -> list[dict]:
    """The event list of a Chrome trace: ``{"traceEvents": [...]}`` or a bare list, of JSON objects."""
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path}: not a Chrome trace: expected an object with a 'traceEvents' list or a list of "
                         f"events, got {type(events).__name__}")
    bad = next((i for i, ev in enumerate(events) if not isinstance(ev, dict)), None)
    if bad is not None:
        raise ValueError(f"{path}: not a Chrome trace: event {bad} is a {type(events[bad]).__name__}, expected an "
                         f"object")
    return events


def _event_number(ev: dict, field: str, i: int, path: str) -> float:
    try:
        value = float(ev[field])
    except (TypeError, ValueError):
        raise ValueError(f"{path}: event {i} ({ev.get('name', '?')!r}) has a non-numeric {field!r}: "
                         f"{ev[field]!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{path}: event {i} ({ev.get('name', '?')!r}) has a non-finite {field!r}: {ev[field]!r}")
    return value


def _regex(text: str) -> re.Pattern:
    """``--match``: a valid regular expression (argparse ``type`` and library check alike)."""
    try:
        return re.compile(text)
    except re.error as e:
        raise ValueError(f"--match {text!r} is not a valid regular expression: {e}") from None


def summarize_torch_trace(path: str, *, group_by: str = "full",
                          step_prefixes: Sequence[str] = DEFAULT_STEP_PREFIXES,
                          categories: Sequence[str] = ("user_annotation",),
                          match: str | None = None) -> Summary:
    """Summarize the ``user_annotation`` events of a torch.profiler Chrome trace (see module docstring)."""
    events = _trace_events(_load_json(path), path)
    durations: dict[str, list[float]] = {}
    start, end = float("inf"), float("-inf")
    pattern = _regex(match) if match else None
    for i, ev in enumerate(events):
        if ev.get("ph") != "X" or "dur" not in ev or "ts" not in ev:
            continue
        ts, dur = _event_number(ev, "ts", i, path), _event_number(ev, "dur", i, path)
        start, end = min(start, ts), max(end, ts + dur)
        name = ev.get("name", "")
        if ev.get("cat") not in categories or name.startswith("ProfilerStep#"):
            continue
        key = strip_attributes(name) if group_by == "name" else name
        if pattern and not pattern.search(key):
            continue
        durations.setdefault(key, []).append(dur / 1e3)
    groups = {k: RangeStat(k, len(v), sum(v), statistics.median(v)) for k, v in durations.items()}
    span_ms = (end - start) / 1e3 if end > start else 0.0
    return _finish(groups, source=f"{path} (torch.profiler trace)", step_prefixes=step_prefixes,
                   fallback_label="the whole trace span", fallback_ms=span_ms)


# ---- nsys stats nvtx_sum CSV ----

_COLUMN_ALIASES = {
    "total": ("totaltime", "total"),
    "instances": ("instances", "count", "calls"),
    "median": ("med", "median"),
    "range": ("range", "name"),
    "style": ("style",),
}


def _normalize_header(cell: str) -> tuple[str, str | None]:
    """``"Total Time (ns)"`` -> ``("totaltime", "ns")``; unit ``None`` when the header has none."""
    m = re.search(r"\(([^)%]*)\)", cell)
    unit = m.group(1).strip() if m else None
    key = re.sub(r"[^a-z]", "", re.sub(r"\(.*?\)", "", cell.lower()))
    return key, unit


def _find_header(rows: list[list[str]], path: str) -> int:
    """Index of the header row (nsys may print notices before it)."""
    for i, row in enumerate(rows):
        keys = {_normalize_header(c)[0] for c in row}
        if "range" in keys and "instances" in keys:
            return i
    text = " ".join(" ".join(r) for r in rows[:3])[:200]
    raise ValueError(f"{path}: no nsys nvtx_sum header (expected columns 'Instances' and 'Range'); "
                     f"file starts with: {text!r}")


def _column(header: list[str], field: str, path: str, required: bool = True) -> tuple[int, str] | None:
    """(index, unit) of ``field`` in the header."""
    for i, cell in enumerate(header):
        key, unit = _normalize_header(cell)
        if key in _COLUMN_ALIASES[field]:
            return i, unit or "ns"
    if required:
        raise ValueError(f"{path}: nsys CSV lacks a {field!r} column; header is {header}")
    return None


def _number(text: str) -> float:
    return float(text.replace(",", "").strip() or "nan")


def _weighted_median(pairs: list[tuple[float, int]]) -> float:
    """Median of values weighted by counts (approximates the median of merged nsys rows)."""
    pairs = sorted(pairs)
    half, acc = sum(n for _, n in pairs) / 2.0, 0
    for value, n in pairs:
        acc += n
        if acc >= half:
            return value
    return pairs[-1][0]


def summarize_nsys_csv(path: str, *, group_by: str = "full",
                       step_prefixes: Sequence[str] = DEFAULT_STEP_PREFIXES,
                       domain: str = DOMAIN, match: str | None = None) -> Summary:
    """Summarize an ``nsys stats --report nvtx_sum --format csv`` file (see module docstring)."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = [r for r in csv.reader(f) if r and any(c.strip() for c in r)]
    if not rows:
        raise ValueError(f"{path}: empty file (did the nsys run record NVTX ranges? use --enable-nvtx)")
    h = _find_header(rows, path)
    header = rows[h]
    total_i, total_unit = _column(header, "total", path)
    count_i, _ = _column(header, "instances", path)
    range_i, _ = _column(header, "range", path)
    med = _column(header, "median", path, required=False)
    pattern = _regex(match) if match else None
    merged: dict[str, list] = {}
    for row in rows[h + 1:]:
        if len(row) <= max(total_i, count_i, range_i):
            continue
        name = _strip_domain(row[range_i].strip(), domain)
        key = strip_attributes(name) if group_by == "name" else name
        if pattern and not pattern.search(key):
            continue
        total_ms = _number(row[total_i]) / _UNITS_PER_MS.get(total_unit, 1e6)
        count = int(_number(row[count_i]))
        median_ms = _number(row[med[0]]) / _UNITS_PER_MS.get(med[1], 1e6) if med else total_ms / max(count, 1)
        merged.setdefault(key, []).append((total_ms, count, median_ms))
    groups = {}
    for key, parts in merged.items():
        count = sum(p[1] for p in parts)
        median_ms = _weighted_median([(p[2], p[1]) for p in parts])
        groups[key] = RangeStat(key, count, sum(p[0] for p in parts), median_ms,
                                median_exact=bool(med) and len(parts) == 1)
    all_ms = sum(s.total_ms for s in groups.values())
    return _finish(groups, source=f"{path} (nsys nvtx_sum)", step_prefixes=step_prefixes,
                   fallback_label="the sum of all ranges", fallback_ms=all_ms)


# ---- output ----

def format_summary(stats: Sequence[RangeStat]) -> str:
    """The common text format: header lines, then one row per range (median marked ``~`` if approximate)."""
    lines = []
    if isinstance(stats, Summary):
        lines.append(f"Range summary of {stats.source}")
        lines.append(f"share = % of {stats.reference} = {stats.reference_ms:.3f} ms")
    lines.append("Nested ranges are listed by their own names; a child's time is also included in its parent's.")
    rows = []
    for s in stats:
        med = f"{s.median_ms:.3f}" + ("" if s.median_exact else "~")
        rows.append([s.name, s.count, f"{s.total_ms:.3f}", med, f"{s.share:.2f}"])
    lines.append(format_table(rows, ["range", "count", "total ms", "median ms", "share %"]))
    if any(not s.median_exact for s in stats):
        lines.append("~ approximate median (nsys report without a median column, or several rows merged)")
    return "\n".join(lines)


def summarize(path: str, **kwargs) -> Summary:
    """Dispatch on the file extension: ``.csv`` -> nsys, ``.json``/``.json.gz`` -> torch.profiler."""
    lower = path.lower()
    if lower.endswith(".csv"):
        kwargs.pop("categories", None)
        return summarize_nsys_csv(path, **kwargs)
    if lower.endswith(".json") or lower.endswith(".json.gz"):
        return summarize_torch_trace(path, **kwargs)
    raise ValueError(f"{path}: unknown trace type; expected a torch.profiler .json(.gz) or an nsys stats .csv")


class _OneLineParser(argparse.ArgumentParser):
    """A bad flag gives one line ``profile-summary: error: ...`` (no usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _match_arg(text: str) -> str:
    try:
        _regex(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 2 bad input)."""
    parser = _OneLineParser(prog="profile-summary", description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", metavar="TRACE", help="torch.profiler Chrome trace (.json) or nsys nvtx_sum CSV")
    parser.add_argument("--group-by", choices=("name", "full"), default="full",
                        help="'full': one row per message incl. attributes (default); 'name': attributes stripped")
    parser.add_argument("--step-prefix", action="append", default=None,
                        help=f"name prefix of step ranges (repeatable; default {', '.join(DEFAULT_STEP_PREFIXES)})")
    parser.add_argument("--match", default=None, type=_match_arg,
                        help="only ranges whose (grouped) name matches this regex")
    args = parser.parse_args(argv)
    steps = tuple(args.step_prefix) if args.step_prefix else DEFAULT_STEP_PREFIXES
    try:
        stats = summarize(args.trace, group_by=args.group_by, step_prefixes=steps, match=args.match)
    except (OSError, ValueError) as e:
        print(f"profile-summary: error: {e}", file=sys.stderr)
        return 2
    if not stats:
        print(f"profile-summary: no ranges found in {args.trace} (were ranges enabled? COMPILED_ATTN_NVTX=1 "
              f"or --enable-nvtx)", file=sys.stderr)
        return 2
    print(format_summary(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
