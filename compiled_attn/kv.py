"""The KV cache: its storage dtypes (how a gathered K/V tile becomes what a kernel reads) and its write.

float8 caches (SGLang's ``--kv-cache-dtype fp8_e4m3|fp8_e5m2``) store ``value / scale``, one Python-float scale per
layer for K and one for V, dequantised inside the gather. Layout (SGLang's): ``k: [num_slots, Hkv, Dqk]``,
``v: [num_slots, Hkv, Dv]`` (MLA: V a view of the latent cache's first columns).
"""
from __future__ import annotations

import torch

from . import validate
from .validate import FP8_DTYPES as FP8_DTYPES
from .validate import KV_DTYPES as KV_DTYPES

HALF_DTYPES = (torch.bfloat16, torch.float16)


def compute_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype K/V are handed to a kernel in: the query's half precision when the cache is stored in that dtype
    or in float8, else float32 (a float32 cache is never rounded down)."""
    if q_dtype in HALF_DTYPES and (kv_dtype == q_dtype or kv_dtype in FP8_DTYPES):
        return q_dtype
    return torch.float32


# float8 layouts: (mantissa bits, exponent bias); targets: (same-width integer dtype, mantissa bits, bias)
_FP8_LAYOUT = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}
_TARGET_LAYOUT = {torch.float32: (torch.int32, 23, 127), torch.bfloat16: (torch.int16, 7, 127),
                  torch.float16: (torch.int16, 10, 15)}


def fp8_to(x: torch.Tensor, dtype: torch.dtype, scale: float | None = None) -> torch.Tensor:
    """A float8 tile (contiguous) as float32/bf16/fp16 times ``scale``, by moving bits (faster than ATen on CPU):
    the byte's bits at the top of the target's give the value times ``2 ** (target bias - float8 bias)``, which one
    multiply undoes. Exact for every finite code; NaN/Inf codes become large finite values."""
    man8, bias8 = _FP8_LAYOUT[x.dtype]
    int_dtype, man, bias = _TARGET_LAYOUT[dtype]
    bits = 8 * torch.tensor([], dtype=int_dtype).element_size()
    shift = man - man8
    mask = (1 << (bits - 1)) | (0x7F << shift)  # the sign bit and the byte's 7 low bits, moved
    mask -= 1 << bits  # as a signed integer of the target's width
    # the sign-extended byte moved left: every bit above the moved 7 is the sign, the mask keeps only the top one
    out = x.view(torch.int8).to(int_dtype).bitwise_left_shift_(shift).bitwise_and_(mask).view(dtype)
    factor = 2.0 ** (bias - bias8) * (1.0 if scale is None else scale)
    return out.mul_(factor) if factor != 1.0 else out


def gather_rows(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``cache.index_select(0, index)``; a float8 cache is gathered as the bytes it holds (a uint8 view, as SGLang
    stores it), since CUDA's index_select does not take every float8 dtype. cache: [S, ...] -> [len(index), ...]."""
    if cache.dtype in FP8_DTYPES:
        return cache.view(torch.uint8).index_select(0, index).view(cache.dtype)
    return cache.index_select(0, index)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float | None) -> torch.Tensor:
    """``x`` (a freshly gathered tile, any shape) in ``dtype``, times ``scale`` when given and not 1 (in place on
    the converted copy, never on the cache)."""
    if x.dtype in FP8_DTYPES and dtype in _TARGET_LAYOUT:
        return fp8_to(x.contiguous(), dtype, scale)
    converted = x.dtype != dtype
    if converted:
        x = x.to(dtype)
    if scale is not None and scale != 1.0:
        x = x.mul_(scale) if converted else x * scale
    return x


def scale_pair(k_scale: float | None, v_scale: float | None) -> tuple[float, float]:
    """Optional K/V dequantisation scales as the two floats the CPU kernel ops take (None meaning 1)."""
    return 1.0 if k_scale is None else k_scale, 1.0 if v_scale is None else v_scale


def scale_value(scale) -> float | None:
    """A layer's scale as SGLang holds it (None, a float, or a one-element tensor) as a Python float; read once,
    at set-up, never per step."""
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"KV scale must be one number per layer, got a tensor of shape {tuple(scale.shape)}")
        return float(scale.detach().cpu())
    return float(scale)


def write_kv(cache: torch.Tensor, loc: torch.Tensor, new: torch.Tensor, scale: float | None = None) -> None:
    """Write ``new: [n, H, D]`` into ``cache: [num_slots, H, D]`` at slots ``loc: [n]``, stored as ``new / scale``
    in the cache's dtype. Outside compiled code and CUDA-graph capture ``loc`` is checked to lie in
    ``[0, num_slots)`` (a -1 would overwrite the last slot); inside one the caller checks it."""
    if not _in_graph(loc):
        validate.check_slot_values("loc (out_cache_loc)", loc, cache.shape[0])
    stored = (new if scale is None or scale == 1.0 else new / scale).to(cache.dtype)
    if cache.dtype in FP8_DTYPES:  # ATen has no float8 index_copy on CPU: write the same bytes as uint8
        cache, stored = cache.view(torch.uint8), stored.view(torch.uint8)
    cache.index_copy_(0, loc.to(torch.int64), stored)


def _in_graph(t: torch.Tensor) -> bool:
    """Inside torch.compile tracing or a CUDA-graph capture, where a host read is impossible."""
    return torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing())
