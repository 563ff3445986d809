"""Make SGLang 0.5.23 importable and usable outside a server, on a CPU-only machine (tests' helper).

Import order matters on a CPU-only machine: import this module (it applies the fix-up
below) or call :func:`ensure_sglang_importable` before anything imports ``sglang``,
``torchvision`` or ``transformers``' image utilities. SGLang imports ``torchvision`` at module level
(``sglang.srt.configs`` -> ``multimodal/internvl_utils``), and PyPI's torchvision wheel
carries CUDA-linked C++ ops that cannot load beside the CPU build of torch; its Python
then dies on ``register_fake("torchvision::nms")``. We declare the two op schemas it
registers fakes for, which is all its pure-Python part needs. On a machine where the ops
do load (CUDA torch + matching torchvision) nothing is declared.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from contextlib import nullcontext
from types import SimpleNamespace

import torch

SGLANG_VERSION = "0.5.23"

# Keeps the op declarations alive: a torch.library.Library drops its definitions when
# it is garbage-collected.
_TORCHVISION_OPS_LIB = None


def ensure_torchvision_importable() -> bool:
    """Make ``import torchvision`` work beside a CPU torch when its C++ ops can't load.

    Returns True if it had to declare the op schemas. Does nothing (returns False) when
    torchvision is absent, already imported, or its ``_C`` extension loads.
    """
    global _TORCHVISION_OPS_LIB
    if _TORCHVISION_OPS_LIB is not None or "torchvision" in sys.modules:
        return False
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    libs = []
    for loc in spec.submodule_search_locations:
        libs += glob.glob(os.path.join(loc, "_C.so")) + glob.glob(os.path.join(loc, "_C.*.so"))
    if libs:
        try:
            # What torchvision.extension does itself; loading twice is harmless.
            torch.ops.load_library(libs[0])
            return False
        except (OSError, ImportError, RuntimeError):
            pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in (
        "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
        "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    ):
        try:
            lib.define(schema)
        except RuntimeError:  # already declared by someone else
            pass
    _TORCHVISION_OPS_LIB = lib
    return True


# Importing this module is enough: the fix-up runs here, before a test imports sglang.
ensure_torchvision_importable()


def ensure_sglang_importable() -> None:
    """Everything that must happen before the first ``import sglang`` on a CPU machine.

    Besides the torchvision fix-up: ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's switch for its
    CPU server) makes SGLang import ``sgl_kernel`` (its CPU kernel build, not on PyPI) at
    module level; without that package the harness runs SGLang's generic path instead, so
    the variable is dropped here, before SGLang reads it at import.
    """
    ensure_torchvision_importable()
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and "sglang" not in sys.modules:
        if importlib.util.find_spec("sgl_kernel") is None:
            import warnings

            warnings.warn("sglang_harness: SGLANG_USE_CPU_ENGINE=1 needs sgl_kernel, which is "
                          "not installed; unsetting it for this process")
            del os.environ["SGLANG_USE_CPU_ENGINE"]


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
