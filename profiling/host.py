"""The benchmark and serving host: keep glibc's allocator from page-faulting large buffers afresh every step, back
large buffers with 2 MiB pages, and say how much of the machine other processes used during a measurement (these
2-core machines are shared), and how large its last-level cache is (a benchmark that means to read from memory
reads more than that between two calls of one op)."""
from __future__ import annotations

import ctypes
import os
import sys
import time

__all__ = ["CpuShare", "add_malloc_flag", "huge_pages_in_use", "last_level_cache_bytes", "tune_malloc",
           "use_huge_pages"]


def add_malloc_flag(parser) -> None:
    """The benchmarks' shared ``--no-malloc-tuning`` switch (they call ``tune_malloc`` unless it is given)."""
    parser.add_argument("--no-malloc-tuning", action="store_true",
                        help="CPU: keep glibc's default of returning large buffers to the OS and PyTorch's 4 KiB "
                             "pages (see README)")


def tune_malloc(huge_pages: bool = True) -> bool:
    """CPU, glibc: keep freed buffers in the heap (no mmap for large blocks, no trimming), and with ``huge_pages``
    back large buffers with 2 MiB pages (:func:`use_huge_pages`; call this before the process's first tensor).

    glibc serves blocks over its mmap threshold with fresh mmaps and unmaps them on free, so every step of a
    batched op page-faults its multi-MB scratch afresh; on this project's VMs that made step latencies swing
    several-fold between runs. jemalloc/tcmalloc via LD_PRELOAD do the same job. Returns whether glibc was tuned.
    """
    if not sys.platform.startswith("linux"):
        return False
    if huge_pages:
        use_huge_pages()
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4
        # mallopt takes a C int: 2**31 - 1 (2 GiB) is the largest trim threshold it can be given
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
    except (OSError, AttributeError):
        return False


THP_ENV = "THP_MEM_ALLOC_ENABLE"  # PyTorch's CPU allocator: madvise(MADV_HUGEPAGE) on buffers of 2 MiB and more


def use_huge_pages() -> bool:
    """Linux: have PyTorch's CPU allocator back its large buffers (KV caches, weights) with transparent 2 MiB pages.

    Why: the decode reads K/V rows of a few hundred bytes scattered over the cache, each row in another 4 KiB page,
    so every row costs a TLB miss (a two-level page walk in a VM). With 2 MiB pages the compiled decode of
    ``bench-ops`` (bs 32, mixed lengths) ran 14% faster, and so did the loop and a plain read of the cache.
    PyTorch reads the variable once, at the process's first allocation: call this before any tensor is made
    (spawned child processes inherit it). A value already in the environment is kept. Returns whether large
    buffers will be madvised (False where the kernel's transparent huge pages are off).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return False
    except OSError:
        return False
    return os.environ.setdefault(THP_ENV, "1") == "1"


def huge_pages_in_use() -> int:
    """Bytes of this process's memory on transparent huge pages (Linux; 0 elsewhere): whether
    :func:`use_huge_pages` took effect."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def last_level_cache_bytes(default: int = 64 << 20) -> int:
    """The size of the CPU's largest cache (Linux sysfs: cpu0's highest cache level), ``default`` where it cannot be
    read."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    sizes = []
    try:
        for entry in os.listdir(base):
            if entry.startswith("index"):
                with open(os.path.join(base, entry, "size")) as f:
                    text = f.read().strip()
                scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
                sizes.append(int(text.rstrip("KMG")) * scale)
    except (OSError, ValueError):
        return default
    return max(sizes, default=default)


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
