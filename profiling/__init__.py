"""Profiling helpers for compiled-attn: NVTX/torch.profiler ranges, benchmark timers, trace summaries.

This package imports nothing from ``graphs`` or ``compiled_attn`` (they import it).

* ``range(name, **attrs)`` / ``ranged(...)``: named ranges visible in nsys and torch.profiler
  (see ``profiling.ranges``); off unless ``COMPILED_ATTN_NVTX=1`` or ``set_enabled(True)``.
* ``profiling.timers``: ``time_fn``, ``time_interleaved``, ``median``, ``format_table``, ``range_overhead_ns``.
* ``profiling.host``: ``tune_malloc`` (glibc: no per-step page faults of large buffers), ``CpuShare``.
* ``profiling.summary``: one summary format for torch.profiler Chrome traces and ``nsys stats`` CSVs
  (``python -m profiling.summary TRACE``).
"""

from profiling.ranges import DOMAIN, enabled, enabled_ranges, format_message, phase_of, range, ranged, set_enabled

__all__ = ["DOMAIN", "enabled", "enabled_ranges", "format_message", "phase_of", "range", "ranged", "set_enabled"]
