"""``cpu_float8.admit_float8_caches``: SGLang's CPU refusals of float8 KV caches lifted for ``compiled_attn`` only.

Checked on SGLang's own functions: with ``compiled_attn`` configured, ``fp8_e5m2`` resolves to ``torch.float8_e5m2``
and the KV-cache configurator no longer sees a CPU (so it builds the plain float8 pool, not the AMX backend's store);
with another backend SGLang's own answers stand. tests/test_live_kv_formats.py serves these caches live. Skipped where
SGLang isn't installed.
"""
import pytest
import torch

import compiled_attn.sglang.testing as H
from compiled_attn.sglang import cpu_fixups, cpu_float8

H.ensure_sglang_importable()
pytest.importorskip("sglang")

from sglang.srt.mem_cache import kv_cache_configurator, kv_cache_dtype  # noqa: E402

E5M2_ARGS = dict(server_args_kv_cache_dtype="fp8_e5m2", model=None, model_dtype=torch.float32, is_draft_worker=False,
                 is_dflash=False, speculative_draft_attention_backend=None)


@pytest.fixture
def admitted(monkeypatch):
    """The fix-up applied, SGLang's functions restored afterwards; returns a setter of the configured backend."""
    monkeypatch.setattr(kv_cache_dtype, "configure_kv_cache_dtype", kv_cache_dtype.configure_kv_cache_dtype)
    monkeypatch.setattr(kv_cache_configurator, "current_platform", kv_cache_configurator.current_platform)
    assert cpu_float8.admit_float8_caches()
    assert not cpu_float8.admit_float8_caches()  # applied once

    def configured(backend: str):
        monkeypatch.setattr(cpu_float8, "compiled_attn_configured", lambda: backend == "compiled_attn")
    return configured


def test_e5m2_resolves_for_compiled_attn(admitted):
    admitted("compiled_attn")
    assert kv_cache_dtype.configure_kv_cache_dtype(**E5M2_ARGS) == (None, torch.float8_e5m2)
    assert not kv_cache_configurator.current_platform.is_cpu()


def outcome(fn, **kwargs):
    try:
        return fn(**kwargs)
    except ValueError as e:  # SGLang's refusal (where this process runs its CPU path)
        return str(e)


def test_other_backends_meet_sglangs_own_answer(monkeypatch):
    original, platform = kv_cache_dtype.configure_kv_cache_dtype, kv_cache_configurator.current_platform
    monkeypatch.setattr(kv_cache_dtype, "configure_kv_cache_dtype", original)
    monkeypatch.setattr(kv_cache_configurator, "current_platform", platform)
    assert cpu_float8.admit_float8_caches()
    monkeypatch.setattr(cpu_float8, "compiled_attn_configured", lambda: False)
    assert outcome(kv_cache_dtype.configure_kv_cache_dtype, **E5M2_ARGS) == outcome(original, **E5M2_ARGS)
    assert kv_cache_configurator.current_platform.is_cpu() == platform.is_cpu()


def test_fixup_is_listed_for_the_live_engine():
    assert "admit_float8_caches" in [name for name, *_ in cpu_fixups.FIXUPS]
