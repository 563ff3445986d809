"""Which code computes a decode-like call (a decode step, verify's prefix), and why: ``choose_form``.

The forms, by what computes each block of keys:
- ``kernel``: the C++ kernel (``native_decode``), reading K/V in place on one of its paths (``native_decode.PATHS``:
  ``tile`` AMX bf16 products, ``wide`` float32 outer products, ``vector_bf16`` AVX512-BF16 pair products,
  ``vector`` float32 products). The CPU's form wherever the kernel is built and serves the shapes.
- ``traced``: inductor's loops over the same computation (``decode_fused``), only while compiling for a CPU without
  the kernel (one head size, V a cache of its own).
- ``flash``: ATen's CPU flash kernel over gathered runs of keys (``decode_flash``, ``verify_flash``): the CPU's
  eager form without the kernel (one head size, no soft-cap).
- ``triton``: the Triton kernels (``kernels/triton_decode.py``), reading each request's range from device memory and
  skipping every block past it: CUDA's form (a graph's block capacity then costs nothing past the real lengths).
- ``matmul``: gathered blocks and batched matmuls (other devices, CUDA without Triton, CPU calls no other form
  serves).

The dispatchers (``decode.decode_blocks``, ``verify.verify_blocks``) run what ``choose_form`` returns, and tests ask
it what a call will run instead of predicting from CPU flags. ``COMPILED_ATTN_EXPLAIN=1`` logs each distinct
choice once per process (at trace time for a compiled step): the site, the shapes and dtypes, the form, the path
and the reason.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

from . import native_decode
from .block_flash import supports_block_flash
from .kernels.triton_form import triton_installed, triton_refusal
from .kv_dtype import HALF_DTYPES
from .native_decode import bf16_query_scale, kernel_path, native_refusal

__all__ = ["EXPLAIN_ENV", "FUSED_MAX_ROWS", "FORMS", "NATIVE_MAX_ROWS", "FormChoice", "choose_form"]

EXPLAIN_ENV = "COMPILED_ATTN_EXPLAIN"
FORMS = ("kernel", "triton", "traced", "flash", "matmul")
#: verify's query rows per KV head (``k * Hq // Hkv``) up to which the traced form reads the prefix in place: above
#: it the flash kernel's GEMMs win (the traced loops score row by row, their work grows with the rows), and on a
#: bf16/fp16 cache the flash op's half-precision kernel beat them at any row count
FUSED_MAX_ROWS = 8
#: the same limit for the kernel's vector paths, which score the rows with less work per key (bs 32, float32, 16
#: rows: 35-39 ms against the flash op's 56-84); the tile and wide paths have none (their time grows little with
#: the rows, or at the FMA rate: at 32 rows half the flash op's)
NATIVE_MAX_ROWS = 16

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FormChoice:
    """form: one of ``FORMS``; path: the kernel's path (``native_decode.PATHS``) with form ``kernel``, else "";
    reason: why, in one line."""

    form: str
    path: str
    reason: str


def choose_form(site: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                rows_per_kv_head: int, v_shares_k: bool = False, logit_cap: float | None = None,
                form: str | None = None, fused: bool | None = None, cpu_flash: bool | None = None,
                native: bool | None = None, compiling: bool | None = None) -> FormChoice:
    """The form (and kernel path) that computes a decode-like call, and why.

    site: "decode" or "verify" (verify limits the vector forms' rows: ``FUSED_MAX_ROWS``, ``NATIVE_MAX_ROWS``);
    q: [rows, Hq, Dqk]; caches [num_slots, Hkv, D]; rows_per_kv_head: query rows a KV head's keys meet (decode:
    Hq // Hkv; verify: k times that); v_shares_k: V a view of K's rows (MLA's latent); form: one of ``FORMS`` to
    run that form (ValueError where it cannot serve the call), or None to choose. The older overrides as the
    dispatchers take them: fused (True: an in-place form, the kernel where it fits, else traced; False: not),
    cpu_flash (True: the flash form), native (False: not the device's kernel, C++ or Triton). None picks.
    compiling: whether the call is being traced by ``torch.compile`` (None: ``torch.compiler.is_compiling()``; a
    test asks what a compiled call runs). ValueError where the overrides name two forms."""
    args = (site, q, k_cache, v_cache, rows_per_kv_head, v_shares_k, logit_cap, form, fused, cpu_flash, native,
            compiling)
    if torch.compiler.is_compiling():
        return _choose_form(*args)
    # eagerly, a call of the same shapes, dtypes and settings on the same build chooses the same: looked up (the
    # choice ran on every layer of every step, a few us each)
    key = (site, q.device.type, q.dtype, k_cache.dtype, v_cache.dtype, *q.shape[1:], *k_cache.shape[1:],
           v_cache.shape[2], k_cache.stride(-1), v_cache.stride(-1), rows_per_kv_head, v_shares_k, logit_cap is None,
           form, fused, cpu_flash, native, compiling, native_decode.native_available(),
           native_decode.kernel_isa_bits(), triton_installed())
    choice = _EAGER_CHOICES.get(key)
    if choice is None:
        choice = _choose_form(*args)
        if len(_EAGER_CHOICES) >= _EAGER_CHOICES_KEPT:
            _EAGER_CHOICES.clear()
        _EAGER_CHOICES[key] = choice
    return choice


#: the eager choices made so far, by call (``choose_form``); a memo of a pure function, bounded
_EAGER_CHOICES: dict[tuple, FormChoice] = {}
_EAGER_CHOICES_KEPT = 1024


def _choose_form(site, q, k_cache, v_cache, rows_per_kv_head, v_shares_k, logit_cap, form, fused, cpu_flash, native,
                 compiling) -> FormChoice:
    """``choose_form``'s decision (its arguments, positionally)."""
    if form is not None:
        if fused is not None or cpu_flash is not None or native is not None:
            raise ValueError(f"form={form!r} names the form: pass it without fused=, cpu_flash= or native=")
        return _named_form(form, q, k_cache, v_cache, rows_per_kv_head, logit_cap)
    if fused and cpu_flash:
        raise ValueError("fused=True and cpu_flash=True name two different forms; pass one of them")
    if q.device.type == "cuda" and fused is None and cpu_flash is None and native is not False:
        refusal = triton_refusal(q, k_cache, v_cache)
        if not refusal:
            return FormChoice("triton", "", "CUDA: the Triton kernel, each request's blocks up to its length")
        return FormChoice("matmul", "", f"CUDA without the Triton kernel ({refusal}): gathered blocks and batched "
                                        "matmuls")
    refusal = "native=False" if native is False else native_refusal(q, k_cache, v_cache)
    # branches on sizes guard them under torch.compile (a dynamic compile keeps one graph for every draft length);
    # the reasons name rules, never sizes: text of a symbolic size is no constant
    rows, d, dv = rows_per_kv_head, q.shape[-1], v_cache.shape[-1]
    path, path_reason = ("", "") if refusal else _kernel_path(q, k_cache, rows, d, dv)
    rows_reason = ""
    if site == "verify":
        if not refusal and rows > NATIVE_MAX_ROWS and path not in ("tile", "wide"):
            rows_reason = f"over {NATIVE_MAX_ROWS} rows per KV head on the kernel's {path} path"
        elif refusal and rows > FUSED_MAX_ROWS:
            rows_reason = f"over {FUSED_MAX_ROWS} rows per KV head for the traced form"
        elif refusal and k_cache.dtype in HALF_DTYPES:
            rows_reason = f"a {k_cache.dtype} cache for the traced form (the flash op's half precision is faster)"
    compiling = torch.compiler.is_compiling() if compiling is None else compiling
    traced_fits = compiling and not v_shares_k and d == dv
    if fused is None and cpu_flash is None and not rows_reason and q.device.type == "cpu":
        if not refusal:
            return FormChoice("kernel", path, f"the C++ kernel serves it: {path_reason}")
        if traced_fits:
            return FormChoice("traced", "", f"compiling without the C++ kernel ({refusal}): inductor's loops")
    if fused:
        if not refusal:
            return FormChoice("kernel", path, f"fused=True: the C++ kernel, {path_reason}")
        return FormChoice("traced", "", f"fused=True without the C++ kernel ({refusal}): the traced form")
    why_not = (rows_reason or refusal) if q.device.type == "cpu" else f"a {q.device.type} device"
    flash_fits = supports_block_flash(q, k_cache, v_cache, logit_cap)
    if cpu_flash and not flash_fits:
        raise ValueError("cpu_flash=True needs a CPU q, Dqk == Dv and logit_cap=None; got device "
                         f"{q.device.type}, Dqk {int(d)}, Dv {int(dv)}, logit_cap {logit_cap}")
    if cpu_flash or cpu_flash is None and flash_fits:
        given = "cpu_flash=True" if cpu_flash else f"no in-place form ({why_not})"
        return FormChoice("flash", "", f"{given}: ATen's CPU flash kernel")
    given = "cpu_flash=False" if cpu_flash is False and flash_fits else f"no in-place form ({why_not})"
    flash_why = "" if flash_fits else (", no flash form (soft-cap, head sizes differ or not a CPU)"
                                      if q.device.type == "cpu" else "")
    return FormChoice("matmul", "", f"{given}{flash_why}: gathered blocks and batched matmuls")


def _kernel_path(q: torch.Tensor, k_cache: torch.Tensor, rows: int, d: int, dv: int) -> tuple[str, str]:
    """The C++ kernel's (path, reason) for a call it serves."""
    return kernel_path(k_cache.dtype, bf16_query_scale(q, k_cache, 1.0) > 0, rows, d, dv)


def _named_form(form: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: int,
                logit_cap: float | None) -> FormChoice:
    """``form`` as asked, where it can serve the call (ValueError naming ``form`` and why not)."""
    given = f"form={form!r} given"
    if form == "kernel":
        refusal = native_refusal(q, k_cache, v_cache)
        if refusal:
            raise ValueError(f"form='kernel': the C++ kernel cannot serve this call ({refusal})")
        path, reason = _kernel_path(q, k_cache, rows, q.shape[-1], v_cache.shape[-1])
        return FormChoice("kernel", path, f"{given}: {reason}")
    if form == "triton":
        refusal = triton_refusal(q, k_cache, v_cache)
        if refusal:
            raise ValueError(f"form='triton': the Triton kernel cannot serve this call ({refusal})")
        return FormChoice("triton", "", f"{given}: the Triton kernel")
    if form == "flash":
        if not supports_block_flash(q, k_cache, v_cache, logit_cap):
            raise ValueError("form='flash' needs a CPU q, Dqk == Dv and logit_cap=None")
        return FormChoice("flash", "", f"{given}: ATen's CPU flash kernel")
    if form in ("traced", "matmul"):
        return FormChoice(form, "", given)
    raise ValueError(f"form must be one of {FORMS} or None (choose), got {form!r}")


def explain(site: str, choice: FormChoice, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            rows_per_kv_head: int) -> None:
    """Log ``choice`` once per process where ``COMPILED_ATTN_EXPLAIN=1`` (while compiling: once per trace, at
    trace time). The batch size is left out of the line: one choice serves every batch of a shape."""
    if not _explaining():
        return
    compiling = torch.compiler.is_compiling()
    q_dtype, kv_dtype = str(q.dtype).removeprefix("torch."), str(k_cache.dtype).removeprefix("torch.")
    path = f" path {choice.path}" if choice.path else ""
    if compiling:  # sizes may be symbols of a dynamic compile: text of one is no constant, its value a guard
        shapes = f"q {q_dtype}, kv {kv_dtype} (sizes traced)"
    else:
        shapes = (f"q [*, {q.shape[1]}, {q.shape[2]}] {q_dtype}, kv [*, {k_cache.shape[1]}, {k_cache.shape[2]}/"
                  f"{v_cache.shape[2]}] {kv_dtype}, {rows_per_kv_head} rows per KV head")
    _log_once(f"compiled_attn: {site} ({'compiled' if compiling else 'eager'}, {q.device.type}) {shapes} -> form "
              f"{choice.form}{path}: {choice.reason}")


@torch.compiler.assume_constant_result
def _explaining() -> bool:
    """``COMPILED_ATTN_EXPLAIN`` is set (a constant to ``torch.compile``: read once per trace)."""
    return os.environ.get(EXPLAIN_ENV, "0") not in ("", "0")


@torch.compiler.assume_constant_result
def _log_once(line: str) -> bool:
    """Log ``line`` the first time this process sees it (run at trace time under ``torch.compile``)."""
    return _log_line(line)


@functools.cache
def _log_line(line: str) -> bool:
    if not _log.handlers and not logging.getLogger().handlers:  # nobody configured logging: stderr
        _log.addHandler(logging.StreamHandler())
        _log.setLevel(logging.INFO)
    _log.info(line)
    return True
