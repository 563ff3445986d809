"""Host-side input checks for ``plan``: clear errors naming the argument and the limit.

These run once per step, outside the compiled hot path, so they may read small ``[bs]`` tensors on the host.
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(name: str, t, ndim: int, dtypes: tuple, device: torch.device | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the device of q)")


def check_qkv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Check ``q: [n, Hq, Dqk]``, ``k_cache: [S, Hkv, Dqk]``, ``v_cache: [S, Hkv, Dv]``; return (Hq, Hkv, Dqk, Dv)."""
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, 3, FLOAT_DTYPES, q.device)
    check_tensor("v_cache", v_cache, 3, FLOAT_DTYPES, q.device)
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k_cache, v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    hq, dqk = q.shape[1], q.shape[2]
    slots, hkv, dk = k_cache.shape
    if dk != dqk:
        raise ValueError(f"k_cache head dim {dk} must equal q head dim {dqk}")
    if v_cache.shape[0] != slots or v_cache.shape[1] != hkv:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must be [{slots}, {hkv}, Dv] to match k_cache")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"q heads ({hq}) must be a multiple of k_cache heads ({hkv})")
    return hq, hkv, dqk, v_cache.shape[2]


def check_lengths(name: str, t: torch.Tensor, bs: int, device: torch.device) -> torch.Tensor:
    """Check a ``[bs]`` integer tensor of lengths; return it as int64 on the host."""
    check_tensor(name, t, 1, INDEX_DTYPES, device)
    if t.shape[0] != bs:
        raise ValueError(f"{name} must have shape [{bs}] (the batch size), got {tuple(t.shape)}")
    host = t.detach().to("cpu", torch.int64)
    if bs and int(host.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got min {int(host.min())}")
    return host


def check_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, bs: int, device: torch.device):
    """Check the request table and the batch's rows; return the rows as int64 on the host."""
    check_tensor("req_to_token", req_to_token, 2, INDEX_DTYPES, device)
    check_tensor("req_pool_indices", req_pool_indices, 1, INDEX_DTYPES, device)
    if req_pool_indices.shape[0] != bs:
        raise ValueError(f"req_pool_indices must have shape [{bs}] (the batch size), "
                         f"got {tuple(req_pool_indices.shape)}")
    rows = req_pool_indices.detach().to("cpu", torch.int64)
    max_reqs = req_to_token.shape[0]
    if bs and (int(rows.min()) < 0 or int(rows.max()) >= max_reqs):
        raise ValueError(f"req_pool_indices must lie in [0, {max_reqs}) (rows of req_to_token), "
                         f"got range [{int(rows.min())}, {int(rows.max())}]")
    return rows


def check_kv_end(kv_end: torch.Tensor, width: int, what: str) -> None:
    if kv_end.numel() and int(kv_end.max()) > width:
        raise ValueError(f"{what} reach position {int(kv_end.max())}, beyond the req_to_token width {width} "
                         f"(max_context_len)")


def check_window_and_cap(sliding_window, logit_cap) -> None:
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 0):
        raise ValueError(f"sliding_window must be a non-negative int or None, got {sliding_window!r}")
    if logit_cap is not None and not logit_cap > 0:
        raise ValueError(f"logit_cap must be > 0 or None, got {logit_cap!r}")
