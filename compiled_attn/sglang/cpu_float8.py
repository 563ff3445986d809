"""Float8 KV caches (``--kv-cache-dtype fp8_e4m3|fp8_e5m2``) for ``compiled_attn`` on a CPU-only machine.

SGLang 0.5.23 refuses both on CPU for every attention backend but its own AMX one: ``fp8_e5m2`` "is not supported on
CPU" (``mem_cache.kv_cache_dtype.configure_kv_cache_dtype``), and ``fp8_e4m3`` needs Intel AMX and the ``intel_amx``
backend, whose AMX kernels read a CPU float8 store of its own (``KVCacheConfigurator``: both asked through
``current_platform.is_cpu()``). Our backend reads the plain float8 ``MHATokenToKVPool`` that SGLang builds for these
caches on a GPU (per-layer scales included: tests/test_live_kv_formats.py), so :func:`admit_float8_caches` lifts
those two checks while ``compiled_attn`` is the configured attention backend (prefill or decode), and only then;
any other backend meets SGLang's refusal as before.
"""
from __future__ import annotations


def compiled_attn_configured() -> bool:
    """Whether SGLang's configured attention backends (prefill, decode) include ``compiled_attn``."""
    from sglang.srt.runtime_context import attention_backends

    return "compiled_attn" in set(attention_backends())


class PlatformForCompiledAttn:
    """SGLang's ``current_platform``, but not a CPU to ``kv_cache_configurator`` (the module that asks it only to
    gate and choose its CPU float8 store) while ``compiled_attn`` is configured; every other question passes
    through."""

    def __init__(self, platform):
        self._platform = platform

    def __getattr__(self, name):
        return getattr(self._platform, name)

    def is_cpu(self) -> bool:
        return self._platform.is_cpu() and not compiled_attn_configured()


def admit_float8_caches() -> bool:
    """The fix-up (``cpu_fixups.FIXUPS``): False if already applied."""
    import torch
    from sglang.srt.mem_cache import kv_cache_configurator, kv_cache_dtype

    configure = kv_cache_dtype.configure_kv_cache_dtype
    if getattr(configure, "compiled_attn", False):
        return False

    def configure_kv_cache_dtype(*, server_args_kv_cache_dtype: str, **kwargs):
        if server_args_kv_cache_dtype == "fp8_e5m2" and compiled_attn_configured():
            return None, torch.float8_e5m2  # what SGLang resolves on a GPU
        return configure(server_args_kv_cache_dtype=server_args_kv_cache_dtype, **kwargs)

    configure_kv_cache_dtype.compiled_attn = True
    kv_cache_dtype.configure_kv_cache_dtype = configure_kv_cache_dtype
    kv_cache_configurator.current_platform = PlatformForCompiledAttn(kv_cache_configurator.current_platform)
    return True
