"""compiled-attn: static-shape, compiled, graph-captured torch-native attention (MHA and MLA) for LLM serving."""
from .api import decode_attention, decode_index, extend_attention, extend_index, v_is_prefix_of_k
from .decode import DecodeIndex, build_decode_index, decode_blocks
from .extend import ExtendIndex, build_extend_index, extend_padded
from .kv_pool import PAD_REQ_ROW, PAD_SLOT, MHAKVPool, MLAKVPool, ReqToTokenTable, SlotAllocator, write_kv
from .metadata import DecodeMetadata, ExtendMetadata
from .plan import DEFAULT_BLOCK_SIZE, plan_decode, plan_extend

__all__ = [
    "decode_attention", "extend_attention", "decode_index", "extend_index", "v_is_prefix_of_k",
    "DecodeIndex", "build_decode_index", "decode_blocks",
    "ExtendIndex", "build_extend_index", "extend_padded",
    "MHAKVPool", "MLAKVPool", "ReqToTokenTable", "SlotAllocator", "write_kv", "PAD_SLOT", "PAD_REQ_ROW",
    "DecodeMetadata", "ExtendMetadata", "DEFAULT_BLOCK_SIZE", "plan_decode", "plan_extend",
]
