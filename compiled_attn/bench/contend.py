"""``--contend N``: N processes that spin on the CPU while a benchmark times, so its numbers can be read under a
known load (issue #16: does the compiled path still pay for itself when the cores are shared?).

    with contend(2) as procs:      # both spinning (started and confirmed running) when the body starts
        times = time_interleaved(...)
    # every spinner is stopped and reaped here, also after an exception or KeyboardInterrupt

The spinners are plain Python busy loops (no torch, no affinity: the scheduler places them as it would a
neighbour's job). They also stop on their own when the benchmark process dies without cleaning up.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["contend", "describe"]

_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 5.0
_CHECK_EVERY = 200_000  # loop iterations between parent checks (~10 ms of pure Python)


def _spin(parent: int, started) -> None:
    """Busy loop until killed, or until the parent is gone (re-parented: a crash that skipped the cleanup)."""
    started.release()
    x = 0
    while True:
        for i in range(_CHECK_EVERY):
            x ^= i
        if os.getppid() != parent:
            return


def _context():
    # fork: a spawned child would re-import the benchmark's __main__ (torch included) before it spins
    return mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")


def _stop(procs: list) -> None:
    """SIGTERM each spinner, then SIGKILL any that outlived the timeout; join all (no zombies left)."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(_STOP_TIMEOUT_S)
        if p.is_alive():
            p.kill()
            p.join(_STOP_TIMEOUT_S)


@contextmanager
def contend(n: int) -> Iterator[list]:
    """Start ``n`` >= 0 spinning processes, wait until each runs, yield them (``multiprocessing.Process``
    list); stop and reap them on exit, however the body ends."""
    if n < 0:
        raise ValueError(f"contend needs n >= 0, got {n}")
    ctx = _context()
    started = ctx.Semaphore(0)
    procs: list = []
    try:
        for i in range(n):
            p = ctx.Process(target=_spin, args=(os.getpid(), started), name=f"contend-{i}", daemon=True)
            p.start()
            procs.append(p)
        for _ in range(n):  # timing starts only once every spinner is really running
            if not started.acquire(timeout=_START_TIMEOUT_S):
                raise RuntimeError(f"contend: a spinner did not start within {_START_TIMEOUT_S:.0f} s")
        yield procs
    finally:
        _stop(procs)


def describe(n: int) -> str:
    """The report line that says what load the numbers were measured under."""
    if n == 0:
        return "contention: none (no spinning processes)"
    return f"contention: {n} spinning process{'es' if n != 1 else ''} ({os.cpu_count()} CPUs)"
