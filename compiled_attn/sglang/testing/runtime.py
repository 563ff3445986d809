"""Import SGLang's attention classes and run them outside a server (for tests and benchmarks)."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

from ..cpu_fixups import ensure_sglang_importable

SGLANG_VERSION = "0.5.23"


def sglang_available() -> bool:
    """True if ``sglang`` imports here (after the torchvision fix-up)."""
    ensure_sglang_importable()
    try:
        import_sglang()
    except ImportError:
        return False
    return True


def import_sglang() -> SimpleNamespace:
    """Import the SGLang classes the harness uses; raises ImportError if SGLang is absent."""
    ensure_sglang_importable()
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
    from sglang.srt.mem_cache.memory_pool import (
        MHATokenToKVPool,
        MLATokenToKVPool,
        ReqToTokenPool,
    )
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    return SimpleNamespace(
        AttentionBackend=AttentionBackend,
        TorchNativeAttnBackend=TorchNativeAttnBackend,
        AttentionType=AttentionType,
        RadixAttention=RadixAttention,
        ReqToTokenPool=ReqToTokenPool,
        MHATokenToKVPool=MHATokenToKVPool,
        MLATokenToKVPool=MLATokenToKVPool,
        ForwardBatch=ForwardBatch,
        ForwardMode=ForwardMode,
        ForwardContext=ForwardContext,
        forward_context=forward_context,
    )


# Parallel-topology names SGLang reads on the attention path (MLATokenToKVPool.set_kv_buffer
# asserts on ``dcp_enabled``; ``set_mla_kv_buffer`` reads ``attn_dcp_size``). Outside a
# server nothing publishes them and reading raises, so the harness states single-rank values
# for the names that are unset, scoped to each call.
PARALLEL_DEFAULTS = dict(dcp_enabled=False, attn_dcp_size=1, attn_dcp_rank=0,
                         attn_tp_size=1, attn_tp_rank=0)


def parallel_scope():
    """Context manager: single-rank values for the unset parallel names, else a no-op."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    missing = {}
    for name, value in PARALLEL_DEFAULTS.items():
        try:
            getattr(parallel, name)
        except (RuntimeError, ValueError):
            missing[name] = value
    return parallel.override(**missing) if missing else nullcontext()
