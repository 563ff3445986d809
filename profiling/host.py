"""The benchmark host: keep glibc's allocator from page-faulting large buffers afresh every step, and say how much
of the machine other processes used during a measurement (these 2-core machines are shared)."""
from __future__ import annotations

import ctypes
import os
import sys
import time

__all__ = ["CpuShare", "add_malloc_flag", "tune_malloc"]


def add_malloc_flag(parser) -> None:
    """The benchmarks' shared ``--no-malloc-tuning`` switch (they call ``tune_malloc`` unless it is given)."""
    parser.add_argument("--no-malloc-tuning", action="store_true",
                        help="CPU: keep glibc's default of returning large buffers to the OS (see README)")


def tune_malloc() -> bool:
    """CPU, glibc: keep freed buffers in the heap (no mmap for large blocks, no trimming).

    glibc serves blocks over its mmap threshold with fresh mmaps and unmaps them on free, so every step of a
    batched op page-faults its multi-MB scratch afresh; on this project's VMs that made step latencies swing
    several-fold between runs. jemalloc/tcmalloc via LD_PRELOAD do the same job. Returns whether it was applied.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4
        # mallopt takes a C int: 2**31 - 1 (2 GiB) is the largest trim threshold it can be given
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
    except (OSError, AttributeError):
        return False


class CpuShare:
    """Share of the machine's CPU time used by *other* processes during a measurement (Linux ``/proc``; None
    elsewhere). On a shared machine this says whether a latency is the code's or a neighbour's."""

    def __init__(self):
        self._start = self._sample()

    @staticmethod
    def _sample():
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
            with open("/proc/self/stat") as f:
                own = f.read().rsplit(")", 1)[1].split()
            busy = sum(fields) - fields[3] - fields[4]  # minus idle and iowait
            return busy, int(own[11]) + int(own[12]), time.monotonic()  # utime + stime (all threads)
        except (OSError, ValueError, IndexError):
            return None

    def others(self) -> float | None:
        end = self._sample()
        if self._start is None or end is None:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        if end[2] - self._start[2] < 50 / hz:  # too short for the kernel's tick counters to say anything
            return None
        total = (end[2] - self._start[2]) * hz * (os.cpu_count() or 1)
        other = (end[0] - self._start[0]) - (end[1] - self._start[1])
        return max(0.0, other / total) if total > 0 else None
