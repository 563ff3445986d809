"""Which code computes a call, and why: ``choose_form`` (decode, verify's prefix) and ``choose_extend_form``.

``kernel`` on CPU, ``triton`` on CUDA, ``matmul`` (portable PyTorch) wherever no kernel serves the call;
``form="auto"`` chooses, a form's name runs it. ``COMPILED_ATTN_EXPLAIN=1`` logs each distinct choice once.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

from .kernels.cpu import kernel as cpu_kernel
from .kernels.cpu.extend_flash import tile_flash_refusal
from .kernels.cpu.kernel import bf16_query_scale, kernel_path, native_refusal
from .kernels.triton_form import triton_installed, triton_refusal

__all__ = ["EXPLAIN_ENV", "EXTEND_FORMS", "FORMS", "FormChoice", "choose_extend_form", "choose_form"]

EXPLAIN_ENV = "COMPILED_ATTN_EXPLAIN"
#: "auto" chooses; each other name runs that form (``choose_form``)
FORMS = ("auto", "kernel", "triton", "matmul")
#: extend's forms: "kernel" is ATen's CPU flash kernel over tile spans (no Triton extend kernel yet)
EXTEND_FORMS = ("auto", "kernel", "matmul")

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FormChoice:
    """form: one of ``FORMS`` but "auto"; path: the kernel's path (``kernels.cpu.kernel.PATHS``; extend:
    ``flash_tiles``) with form ``kernel``, else ""; reason: why, in one line."""

    form: str
    path: str
    reason: str


def choose_form(site: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                rows_per_kv_head: int, form: str | None = "auto") -> FormChoice:
    """The form (and kernel path) that computes a decode-like call, and why.

    site: "decode" or "verify"; q: [rows, Hq, Dqk]; rows_per_kv_head: query rows a KV head's keys meet (decode:
    Hq // Hkv; verify: k times that); form: "auto" (or None) or a form's name (ValueError where it cannot serve
    the call, or for an unknown name)."""
    if form not in (None, *FORMS):
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if torch.compiler.is_compiling():
        return _choose_form(q, k_cache, v_cache, rows_per_kv_head, form or "auto")
    # eagerly, a call of the same shapes, dtypes and form chooses the same: memoised (it runs on every layer)
    key = (q.device.type, q.dtype, k_cache.dtype, v_cache.dtype, *q.shape[1:], *k_cache.shape[1:], v_cache.shape[2],
           k_cache.stride(-1), v_cache.stride(-1), rows_per_kv_head, form, cpu_kernel.native_available(),
           cpu_kernel.kernel_isa_bits(), triton_installed())
    choice = _EAGER_CHOICES.get(key)
    if choice is None:
        choice = _choose_form(q, k_cache, v_cache, rows_per_kv_head, form or "auto")
        if len(_EAGER_CHOICES) >= _EAGER_CHOICES_KEPT:
            _EAGER_CHOICES.clear()
        _EAGER_CHOICES[key] = choice
    return choice


#: the eager choices made so far, by call (``choose_form``); a memo of a pure function, bounded
_EAGER_CHOICES: dict[tuple, FormChoice] = {}
_EAGER_CHOICES_KEPT = 1024


def _choose_form(q, k_cache, v_cache, rows: int, form: str) -> FormChoice:
    """``choose_form``'s decision. A named kernel may run off its device (Triton on CPU: ``TRITON_INTERPRET=1``)."""
    if form == "matmul":
        return FormChoice("matmul", "", "form='matmul' given: gathered blocks and batched matmuls")
    kernel = form if form != "auto" else ("triton" if q.device.type == "cuda" else "kernel")
    if kernel == "triton":
        name, refusal = "the Triton kernel", triton_refusal(q, k_cache, v_cache)
    else:
        name, refusal = "the C++ kernel", native_refusal(q, k_cache, v_cache)
    if refusal and form != "auto":
        raise ValueError(f"form={form!r}: {name} cannot serve this call ({refusal})")
    if refusal:
        return FormChoice("matmul", "", f"no kernel serves it ({refusal}): gathered blocks and batched matmuls")
    given = "given" if form != "auto" else "serves it"
    if kernel == "triton":
        return FormChoice("triton", "", f"{name} {given}: each request's blocks up to its length")
    path, reason = kernel_path(k_cache.dtype, bf16_query_scale(q, k_cache, 1.0) > 0, rows, q.shape[-1],
                               v_cache.shape[-1])
    return FormChoice("kernel", path, f"{name} {given}: {reason}")


def choose_extend_form(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, logit_cap: float | None,
                       form: str | None = "auto") -> FormChoice:
    """The form that computes an extend call, and why: ``kernel`` (path ``flash_tiles``) where it serves the call,
    else ``matmul``. form: "auto" (or None), "kernel" or "matmul" (ValueError as ``choose_form``)."""
    if form not in (None, *EXTEND_FORMS):
        raise ValueError(f"form must be one of {EXTEND_FORMS} for extend, got {form!r}")
    if form == "matmul":
        return FormChoice("matmul", "", "form='matmul' given: chunks of tile pairs and batched matmuls")
    refusal = tile_flash_refusal(q, k_cache, v_cache, logit_cap)
    if refusal and form == "kernel":
        raise ValueError(f"form='kernel': ATen's CPU flash kernel cannot serve this call ({refusal})")
    if refusal:
        return FormChoice("matmul", "", f"no kernel serves it ({refusal}): chunks of tile pairs and batched matmuls")
    given = "given" if form == "kernel" else "serves it"
    return FormChoice("kernel", "flash_tiles", f"ATen's CPU flash kernel {given}: each query tile's key spans")


def explain(site: str, choice: FormChoice, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            rows_per_kv_head: int) -> None:
    """Log ``choice`` once per process where ``COMPILED_ATTN_EXPLAIN=1`` (while compiling: at trace time)."""
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
