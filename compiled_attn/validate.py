"""Host-side input checks for ``plan``: clear errors naming the argument and the limit.

They run once per step, outside the compiled hot path; per-request checks take ``[bs]`` host tensors or lists of
Python ints (a batch of one is then a few Python comparisons).
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np
import torch

from graphs.row_inputs import check_slot_values as check_slot_values

__all__ = ["FLOAT_DTYPES", "FP8_DTYPES", "INDEX_DTYPES", "KV_DTYPES", "check_growth", "check_index_rows",
           "check_kv_end", "check_positive_int", "check_positive_number", "check_qkv",
           "check_scales", "check_sinks", "check_slot_values", "check_slots", "check_tensor", "check_window_and_cap",
           "length_values", "table_rows"]

Ints = Sequence[int] | torch.Tensor  # [bs] int64 on the host, or its values as Python ints

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
#: the cache dtypes the library reads (``kv``): the float dtypes, and float8 stored scaled
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
KV_DTYPES = (*FLOAT_DTYPES, *FP8_DTYPES)


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
    if t.is_meta:  # no data to read or attend over; ATen fails deep inside otherwise
        raise ValueError(f"{name} is on the meta device (shape only, no data); pass a tensor with storage")


def check_index_rows(q: torch.Tensor, index_rows: int, tokens: int = 1) -> None:
    """q's rows are the index's batch rows times ``tokens`` (verify's draft tokens): a mismatch would read past
    q's end or keys of rows it does not have."""
    if q.shape[0] != index_rows * tokens:
        per = f" x {tokens} draft tokens" if tokens != 1 else ""
        raise ValueError(f"q has {q.shape[0]} rows, but the index was built for a batch of {index_rows}{per}: build "
                         "the index from the inputs planned for this q")


def check_qkv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Check ``q: [n, Hq, Dqk]`` (float32/bf16/fp16), ``k_cache: [S, Hkv, Dqk]``, ``v_cache: [S, Hkv, Dv]`` (one
    dtype of ``KV_DTYPES``, float8 included); return (Hq, Hkv, Dqk, Dv)."""
    check_tensor("q", q, 3, FLOAT_DTYPES)
    device = q.device
    check_tensor("k_cache", k_cache, 3, KV_DTYPES, device)
    check_tensor("v_cache", v_cache, 3, KV_DTYPES, device)
    if k_cache.dtype != v_cache.dtype:  # the query may differ (a float8 cache, a float32 query over a bf16 cache)
        raise TypeError(f"k_cache and v_cache must share one dtype, got {k_cache.dtype} and {v_cache.dtype}")
    _, hq, dqk = q.shape
    slots, hkv, dk = k_cache.shape
    v_slots, v_heads, dv = v_cache.shape
    if hq < 1 or dqk < 1 or dv < 1:
        raise ValueError(f"q heads, q head dim and v_cache head dim must be >= 1, got {hq}, {dqk}, {dv}")
    if slots < 1:
        raise ValueError(f"k_cache must have >= 1 slot (dim 0), got shape {tuple(k_cache.shape)}")
    if dk != dqk:
        raise ValueError(f"k_cache head dim {dk} must equal q head dim {dqk}")
    if v_slots != slots or v_heads != hkv:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must be [{slots}, {hkv}, Dv] to match k_cache")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"q heads ({hq}) must be a multiple of k_cache heads ({hkv})")
    return hq, hkv, dqk, dv


def _check_vector(name: str, t: torch.Tensor, bs: int, device: torch.device) -> None:
    check_tensor(name, t, 1, INDEX_DTYPES, device)
    if t.shape[0] != bs:
        raise ValueError(f"{name} must have shape [{bs}] (the batch size), got {tuple(t.shape)}")


def length_values(name: str, t: torch.Tensor, bs: int, device: torch.device) -> list[int]:
    """Check a ``[bs]`` integer tensor of lengths (on ``device``, each >= 0); return its values as Python ints."""
    _check_vector(name, t, bs, device)
    values = t.tolist()  # one host read (a sync on CUDA)
    low = min(values, default=0)
    if low < 0:
        raise ValueError(f"{name} must be >= 0, got min {low}")
    return values


def table_rows(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, bs: int, device: torch.device
               ) -> list[int]:
    """Check the request table ``[max_reqs, max_context_len]`` and the batch's rows ``[bs]`` (rows of the table);
    return the rows as Python ints."""
    check_tensor("req_to_token", req_to_token, 2, INDEX_DTYPES, device)
    _check_vector("req_pool_indices", req_pool_indices, bs, device)
    values, max_reqs = req_pool_indices.tolist(), req_to_token.shape[0]
    if values:
        low, high = min(values), max(values)
        if low < 0 or high >= max_reqs:
            raise ValueError(f"req_pool_indices must lie in [0, {max_reqs}) (rows of req_to_token), "
                             f"got range [{low}, {high}]")
    return values


def _values(t: Ints) -> Sequence[int]:
    return t.tolist() if isinstance(t, torch.Tensor) else t


def _host_tensor(t: Ints) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else torch.tensor(t, dtype=torch.int64)


def host_row(table: torch.Tensor, row: int, lo: int, hi: int) -> np.ndarray | None:
    """``table[row, lo:hi]`` of a 2-D CPU tensor as a numpy view (``hi`` clipped to the width), or None where the
    row or ``lo`` lies outside the table or the table is not on the host. Why numpy: a numpy op costs a fraction
    of a torch op on the few small reductions a batch of one needs."""
    if not (table.is_cpu and 0 <= row < table.shape[0] and 0 <= lo) or table.requires_grad:
        return None
    return table.numpy()[row, lo:hi]


def slots_fit(slots: np.ndarray, num_slots: int) -> bool:
    """Every entry of ``slots`` (a ``host_row``) is a slot in ``[0, num_slots)``."""
    # read as unsigned, a negative entry is above any slot count: one reduction checks both ends
    return not slots.size or int(slots.view(f"u{slots.itemsize}").max()) < num_slots


def check_kv_end(kv_end: Ints, width: int, what: str) -> None:
    """Every request's range ends within the table: ``kv_end`` ([bs] host tensor or ints) <= ``width``."""
    end = max(_values(kv_end), default=0)
    if end > width:
        raise ValueError(f"{what} reach position {end}, beyond the req_to_token width {width} (max_context_len)")


def check_window_and_cap(sliding_window, logit_cap) -> None:
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 0):
        raise ValueError(f"sliding_window must be a non-negative int or None, got {sliding_window!r}")
    if logit_cap is not None:
        check_positive_number("logit_cap", logit_cap)


def check_positive_number(name: str, value) -> float:
    """A finite real number > 0 (a bool is refused); returned as a float. NaN or inf would give an all-NaN output
    with no error further down."""
    if type(value) is float and math.isfinite(value) and value > 0:  # the common case, without the ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a finite number > 0, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_scales(k_scale, v_scale) -> None:
    """The KV dequantisation scales: each a finite number > 0, or None (1); applied to any cache dtype."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None:
            check_positive_number(name, scale)


def check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 1, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value}")
    return value


def check_growth(name: str, value) -> float:
    """A bucket growth factor: an int or float, finite and > 1 (a bool is refused); ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 1:
        raise ValueError(f"{name} must be a finite number > 1, got {value!r}")
    return float(value)


def check_slots(req_to_token: torch.Tensor, rows: Ints, lo: Ints, hi: Ints, num_slots: int) -> None:
    """Every entry a batch reads, positions ``[lo[i], hi[i])`` of row ``rows[i]``, must be a slot in
    ``[0, num_slots)``: out-of-range indices would wrap (a -1 reads the last slot) or fault the device.
    rows, lo, hi: [bs] int64 on the host, or lists of ints. Reads the used table rows (a sync on CUDA)."""
    width = max(_values(hi), default=0)
    if len(rows) == 0 or width <= 0:
        return
    # the common case first: a batch of one on the host in numpy, else the rows' least and greatest entry
    table = None  # [bs, width], the rows read
    if len(rows) == 1:
        one = host_row(req_to_token, int(rows[0]), int(lo[0]), width)
        if one is not None and slots_fit(one, num_slots):
            return
    else:
        table = req_to_token[_host_tensor(rows).to(req_to_token.device), :width]
        low, high = torch.aminmax(table)
        if low.item() >= 0 and high.item() < num_slots:
            return
    rows, lo, hi = (_host_tensor(t) for t in (rows, lo, hi))
    if table is None:
        table = req_to_token[rows.to(req_to_token.device), :width]
    used = table.cpu()  # [bs, width]
    bad = (used < 0) | (used >= num_slots)
    pos = torch.arange(width)
    bad &= (pos >= lo[:, None]) & (pos < hi[:, None])  # stale entries outside the read ranges are allowed
    if bool(bad.any()):
        i, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"req_to_token[{int(rows[i])}, {j}] = {int(used[i, j])} is not a KV slot: slots a batch "
                         f"reads must lie in [0, {num_slots}) (num_slots of k_cache); {int(bad.sum())} such "
                         f"entries")


def check_sinks(sinks, num_heads: int) -> None:
    """Attention sinks: a float tensor of one logit per query head, ``[Hq]``."""
    check_tensor("sinks", sinks, 1, FLOAT_DTYPES)
    if sinks.shape[0] != num_heads:
        raise ValueError(f"sinks must have shape [{num_heads}] (one logit per query head), got {tuple(sinks.shape)}")
