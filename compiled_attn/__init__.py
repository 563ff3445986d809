"""compiled-attn: static-shape, compiled, graph-captured torch-native attention (MHA and MLA) for LLM serving.

The library is this package's top level (plan, run, KV formats, compile policy), its kernels (``kernels``: the CPU
kernels in ``kernels/cpu``, the GPU's Triton kernels) and its bucketed graph runners (``runners``);
its SGLang integration is ``compiled_attn.sglang`` and its benchmark tooling ``compiled_attn.bench``.

Names are imported on first use: SGLang imports ``compiled_attn.sglang.plugin`` in each of its processes, and
that must not pull in the kernels (and register their ops) until the backend is created.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "api": ["decode_attention", "extend_attention", "softmax_scale", "v_is_prefix_of_k"],
    "compile_policy": ["allow_data_dependent_sizes"],
    "decode": ["DecodeIndex", "SlotMap", "build_decode_index", "decode_blocks", "translate_slots"],
    "extend": ["ExtendTileIndex", "ExtendTileInputs", "build_extend_tile_index", "extend_tiled", "extend_tiles",
               "plan_extend_tiles", "tile_index"],
    "forms": ["FORMS", "FormChoice", "choose_extend_form", "choose_form"],
    "kernels.cpu.kernel": ["native_available"],
    "kv": ["FP8_DTYPES", "KV_DTYPES", "scale_value", "write_kv"],
    "plan": ["DEFAULT_BLOCK_SIZE", "DecodeInputs", "DecodeMetadata", "ExtendInputs", "ExtendMetadata", "cdiv",
             "gather_unit", "normalize_window", "plan_decode", "plan_extend"],
    "runners.decode": ["DecodeGraphs", "GraphConfig", "RowInput"],
    "runners.extend": ["ExtendGraphConfig", "ExtendGraphs", "ExtendKey"],
    "runners.verify": ["VerifyGraphs", "VerifyKey"],
    "verify": ["VerifyIndex", "VerifyInputs", "VerifyMetadata", "build_verify_index", "plan_verify", "verify_attention",
               "verify_blocks"],
    "verify_plan": ["check_custom_mask", "draft_mask_from_custom", "mask_numel"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'compiled_attn' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
