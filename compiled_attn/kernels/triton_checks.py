"""Argument checks of the Triton kernels (``triton_decode``, ``triton_verify``): each bad input is a ValueError
naming the argument and the limit, checked on the host before the launch (values inside tensors are the caller's
contract: reading them would sync the device)."""
from __future__ import annotations

import torch

from ..kv import KV_DTYPES
from ..validate import FLOAT_DTYPES, INDEX_DTYPES

MAX_HEAD_DIM = 576
Q_DTYPES = FLOAT_DTYPES  # the queries the library takes, and the caches: the same dtypes as its other forms
CACHE_DTYPES = KV_DTYPES
FP8_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # 0: the cache holds its values as they are


def check_tensor(name: str, t, ndim: int, dtypes: tuple, device: torch.device | None = None) -> None:
    """ValueError naming ``name`` unless ``t`` is a tensor of ``ndim`` dims, one of ``dtypes``, on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} dtype must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the device of q)")


def check_kv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             kv_float8_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Check q: [T, Hq, Dqk], k_cache: [S, Hkv, Dqk], v_cache: [S, Hkv, Dv]; return the caches as the kernel reads
    them (float8 as uint8 views) and the float8 code (0 none, 1 e4m3fn, 2 e5m2)."""
    check_tensor("q", q, 3, Q_DTYPES)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, cache, 3, (*CACHE_DTYPES, torch.uint8), q.device)
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share one dtype, got {k_cache.dtype} and {v_cache.dtype}")
    fp8 = FP8_CODES.get(k_cache.dtype, 0)
    if k_cache.dtype == torch.uint8:
        if kv_float8_dtype not in FP8_CODES:
            raise ValueError(f"kv_float8_dtype must be one of {list(FP8_CODES)} for a uint8 cache, "
                             f"got {kv_float8_dtype}")
        fp8 = FP8_CODES[kv_float8_dtype]
    elif kv_float8_dtype is not None:
        raise ValueError(f"kv_float8_dtype is only for uint8 caches, got a {k_cache.dtype} cache")
    hq, dqk = q.shape[1], q.shape[2]
    slots, hkv, dk = k_cache.shape
    dv = v_cache.shape[2]
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"q heads ({hq}) must be a multiple of k_cache heads ({hkv})")
    if dk != dqk:
        raise ValueError(f"k_cache head dim {dk} must equal q head dim {dqk}")
    if tuple(v_cache.shape[:2]) != (slots, hkv):
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must be [{slots}, {hkv}, Dv] to match k_cache")
    for name, dim in (("q head dim", dqk), ("v_cache head dim", dv)):
        if dim < 16 or dim % 16 or dim > MAX_HEAD_DIM:
            raise ValueError(f"{name} must be a multiple of 16 in [16, {MAX_HEAD_DIM}], got {dim}")
    if fp8:
        return k_cache.view(torch.uint8), v_cache.view(torch.uint8), fp8
    return k_cache, v_cache, fp8


def check_rows(req_to_token: torch.Tensor, req_rows: torch.Tensor, ranges: dict, bs: int,
               device: torch.device) -> None:
    """req_to_token: [R, C] int32; req_rows: [bs] int64; each of ``ranges`` (name -> tensor): [bs] int32/int64.
    Values (rows < R, positions <= C) are the caller's contract: reading them would sync the device."""
    check_tensor("req_to_token", req_to_token, 2, (torch.int32,), device)
    check_tensor("req_rows", req_rows, 1, (torch.int64,), device)
    if req_rows.shape[0] != bs:
        raise ValueError(f"req_rows must have shape [{bs}] (the batch size), got {tuple(req_rows.shape)}")
    for name, t in ranges.items():
        check_tensor(name, t, 1, INDEX_DTYPES, device)
        if t.shape[0] != bs:
            raise ValueError(f"{name} must have shape [{bs}] (the batch size), got {tuple(t.shape)}")


def check_settings(*, scale: float, page_size: int, num_splits: int, block_n: int, logit_cap: float,
                   k_scale: float, v_scale: float) -> None:
    """The launch constants and scalar settings."""
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size}")
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits}")
    if not isinstance(block_n, int) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if not logit_cap >= 0:
        raise ValueError(f"logit_cap must be >= 0 (0: no cap), got {logit_cap}")
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def check_extras(sinks: torch.Tensor | None, visited: torch.Tensor | None, hq: int, visited_shape: tuple,
                 device: torch.device) -> None:
    """sinks: [Hq] float32; visited: int32 of ``visited_shape`` ([bs, Hkv, num_splits])."""
    if sinks is not None:
        check_tensor("sinks", sinks, 1, (torch.float32,), device)
        if sinks.shape[0] != hq:
            raise ValueError(f"sinks must have shape [{hq}] (one logit per q head), got {tuple(sinks.shape)}")
    if visited is not None:
        check_tensor("visited", visited, 3, (torch.int32,), device)
        if tuple(visited.shape) != visited_shape or not visited.is_contiguous():
            raise ValueError(f"visited must be a contiguous int32 tensor of shape {list(visited_shape)}, "
                             f"got {tuple(visited.shape)}")
