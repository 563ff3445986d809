"""Import the Triton kernels so that they run on this machine: on a GPU as they are, without one through Triton's
interpreter (CPU tensors).

``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates a function: triton's own library functions when triton
is first imported, the kernels when their module is. So triton is imported as it would be anyway, the variable is
set only around the kernel modules' first import (they use core builtins only) and removed again: left set, it
would reach every later test and the SGLang processes the live tests start."""
import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def import_kernels():
    """(triton_decode module, triton_verify module), interpreted without CUDA; skips the calling test module where
    triton is missing or the kernels were already decorated for a GPU that is not here."""
    pytest.importorskip("triton", reason="needs triton (the kernels are written in Triton)")
    added = DEVICE == "cpu" and "TRITON_INTERPRET" not in os.environ
    if added:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        from compiled_attn.kernels import triton_decode, triton_verify
    finally:
        if added:
            del os.environ["TRITON_INTERPRET"]
    if DEVICE == "cpu" and not triton_decode.is_interpreted():
        pytest.skip("no CUDA, and the triton kernels were decorated for a GPU (their module was imported before "
                    "TRITON_INTERPRET=1 was set)", allow_module_level=True)
    return triton_decode, triton_verify
