"""What a benchmark's JSON says about the machine it ran on: the CPU (vendor, model, the flags the kernels turn on),
the threads and the software (``describe_machine``)."""
from __future__ import annotations

import os
import platform

import torch

from profiling.host import last_level_cache_bytes

from ..kernels.cpu.kernel import cpu_isa_levels

#: ``/proc/cpuinfo`` flags that decide which kernel paths run (ours and SGLang's)
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                "amx_tile", "amx_bf16", "amx_int8")


def cpuinfo(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's ``key: value`` lines of ``/proc/cpuinfo`` ({} where it cannot be read)."""
    out: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    if out:
                        break
                    continue
                key, _, value = line.partition(":")
                out.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return out


def describe_machine(path: str = "/proc/cpuinfo") -> dict:
    """CPU vendor and model, which of ``KERNEL_FLAGS`` it has, our kernel's ISA levels on it, logical CPUs, the
    last-level cache, ``OMP_NUM_THREADS`` and torch's threads, torch / Python / OS versions."""
    info = cpuinfo(path)
    flags = set((info.get("flags") or info.get("Features") or "").split())
    return {
        "cpu_vendor": info.get("vendor_id") or info.get("CPU implementer") or None,
        "cpu_model": info.get("model name") or platform.processor() or None,
        "cpu_family_model_stepping": [info.get(k) for k in ("cpu family", "model", "stepping")],
        "cpu_flags": {f: f in flags for f in KERNEL_FLAGS},
        "kernel_isa_levels": cpu_isa_levels(info.get("flags", "")),
        "logical_cpus": os.cpu_count(),
        "last_level_cache_bytes": last_level_cache_bytes(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
