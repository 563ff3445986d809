"""compiled-attn: static-shape, compiled, graph-captured torch-native attention (MHA and MLA) for LLM serving.

The library is this package's top level (plan, run, KV pools, compile policy, bucketed decode, extend and verify
graphs); its SGLang integration is ``compiled_attn.sglang`` and its benchmark tooling ``compiled_attn.bench``.

Names are imported on first use: SGLang imports ``compiled_attn.sglang.plugin`` in each of its processes, and
that must not pull in the kernels (and register their ops) until the backend is created.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "api": ["decode_attention", "extend_attention", "v_is_prefix_of_k"],
    "compile_policy": ["allow_data_dependent_sizes"],
    "decode": ["DecodeIndex", "SlotMap", "build_decode_index", "decode_blocks", "translate_slots"],
    "extend": ["ExtendTileIndex", "ExtendTileInputs", "build_extend_tile_index", "extend_tiled", "extend_tiles",
               "plan_extend_tiles", "tile_index"],
    "extend_flash": ["supports_tile_flash"],
    "kv_blocks": ["cdiv", "gather_unit"],
    "kv_dtype": ["FP8_DTYPES", "KV_DTYPES", "scale_value"],
    "kv_pool": ["PAD_REQ_ROW", "PAD_SLOT", "MHAKVPool", "MLAKVPool", "ReqToTokenTable", "SlotAllocator", "write_kv"],
    "metadata": ["DecodeInputs", "DecodeMetadata", "ExtendInputs", "ExtendMetadata"],
    "native_decode": ["native_available"],
    "plan": ["DEFAULT_BLOCK_SIZE", "normalize_window", "plan_decode", "plan_extend"],
    "decode_graphs": ["DecodeGraphs", "GraphConfig", "RowInput"],
    "extend_graphs": ["ExtendGraphConfig", "ExtendGraphs", "ExtendKey"],
    "verify": ["VerifyIndex", "VerifyInputs", "VerifyMetadata", "build_verify_index", "plan_verify", "verify_attention",
               "verify_blocks"],
    "verify_graphs": ["VerifyGraphs", "VerifyKey"],
    "verify_masks": ["check_custom_mask", "draft_mask_from_custom", "mask_numel"],
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
