"""The Triton kernels as the dispatchers' CUDA form (``forms.choose_form``'s ``triton``).

Decode and verify hand the kernels what their index was built from (``req_to_token`` and the per-request ranges):
the kernels read each request's range from device memory, so a step whose shapes are a graph's block capacity
costs what the real lengths cost. The kernel modules (which import ``triton``) are imported on first use only:
``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates them.
"""
from __future__ import annotations

import functools
import importlib.util

import torch

from .triton_checks import CACHE_DTYPES, MAX_HEAD_DIM, Q_DTYPES

#: programs in flight that keep a GPU's SMs busy (an H100 has 132): the splits of a small batch fill them
_TARGET_PROGRAMS = 264
_MAX_SPLITS = 16
#: keys a split reads at least (fewer make the merge the larger part of the work)
_MIN_SPLIT_KEYS = 256


@torch.compiler.assume_constant_result
def triton_installed() -> bool:
    """Whether ``triton`` can be imported here (a constant to ``torch.compile``)."""
    return _triton_installed()


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_refusal(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str:
    """Why the Triton kernels cannot serve a decode-like call, or "" where they can: triton installed, a query in
    float32/bf16/fp16, caches of one dtype they read (float8 included), head sizes multiples of 16 up to 576."""
    if not triton_installed():
        return "triton is not installed"
    if q.dtype not in Q_DTYPES:
        return f"a {q.dtype} query"
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        return f"caches {k_cache.dtype}/{v_cache.dtype}"
    d, dk, dv = q.shape[-1], k_cache.shape[-1], v_cache.shape[-1]
    if d != dk or d % 16 or dv % 16 or d > MAX_HEAD_DIM or dv > MAX_HEAD_DIM:  # (a rule, not sizes: see forms)
        return f"head sizes not equal multiples of 16 up to {MAX_HEAD_DIM}"
    return ""


def launch_shape(rows: int, num_kv_heads: int, max_keys: int, head_dim: int) -> tuple[int, int]:
    """(num_splits, block_n) for ``rows`` batch rows of ``num_kv_heads`` heads whose ranges reach at most
    ``max_keys`` keys (the table's width): enough splits to fill the GPU at a small batch, none shorter than
    ``_MIN_SPLIT_KEYS``; key blocks of 32, 16 for MLA's 576-wide rows (fewer registers a program)."""
    by_programs = -(-_TARGET_PROGRAMS // max(rows * num_kv_heads, 1))
    by_keys = max(max_keys // _MIN_SPLIT_KEYS, 1)
    return max(1, min(_MAX_SPLITS, by_programs, by_keys)), 16 if head_dim > 256 else 32


def _ranges(index) -> tuple[torch.Tensor, object]:
    """(req_to_token, inputs) an index was built from, or ValueError (an index built by hand)."""
    if index.req_to_token is None or index.inputs is None:
        raise ValueError("the triton form reads each request's range from the index's req_to_token and inputs: "
                         "build the index with build_decode_index / build_verify_index")
    return index.req_to_token, index.inputs


def triton_decode_blocks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index, scale: float,
                         logit_cap: float | None, k_scale: float, v_scale: float,
                         sinks: torch.Tensor | None) -> torch.Tensor:
    """``decode.decode_blocks`` by the Triton kernel. q: [bs, Hq, Dqk]; index: a ``decode.DecodeIndex``
    (``build_decode_index``'s); sinks: [Hq] or None -> [bs, Hq, Dv] in q.dtype."""
    from .triton_decode import triton_decode

    table, inputs = _ranges(index)
    num_splits, block_n = launch_shape(q.shape[0], k_cache.shape[1], table.shape[1], q.shape[-1])
    return triton_decode(q, k_cache, v_cache, table, inputs.req_rows, inputs.kv_lo, inputs.kv_hi, scale=scale,
                         num_splits=num_splits, block_n=block_n, logit_cap=logit_cap or 0.0, k_scale=k_scale,
                         v_scale=v_scale, sinks=None if sinks is None else sinks.float())


def triton_verify_blocks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index, scale: float,
                         logit_cap: float | None, k_scale: float, v_scale: float,
                         sinks: torch.Tensor | None) -> torch.Tensor:
    """``verify.verify_blocks`` by the Triton kernel. q: [bs * k, Hq, Dqk] token-major; index: a
    ``verify.VerifyIndex`` (``build_verify_index``'s) -> [bs * k, Hq, Dv] in q.dtype."""
    from .triton_verify import triton_verify

    table, _ = _ranges(index.prefix)
    rows, prefix = index.inputs.req_rows, index.inputs.prefix_lens
    window = index.sliding_window
    # every key at or after the lowest position a draft token's window reaches; the kernel masks each row's own
    kv_lo = torch.zeros_like(prefix) if window is None else (prefix - window).clamp_min(0)
    num_splits, block_n = launch_shape(prefix.shape[0], k_cache.shape[1], table.shape[1], q.shape[-1])
    return triton_verify(q, k_cache, v_cache, table, rows, kv_lo, prefix, index.inputs.draft_mask, scale=scale,
                         num_splits=num_splits, block_n=block_n, logit_cap=logit_cap or 0.0, k_scale=k_scale,
                         v_scale=v_scale, sinks=None if sinks is None else sinks.float(), sliding_window=window)
