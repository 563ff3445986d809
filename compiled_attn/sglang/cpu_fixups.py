"""Make SGLang 0.5.23 importable on a CPU-only machine (fix-ups applied before SGLang is imported).

Import order matters on a CPU-only machine: import this module (it applies the fix-up
below) or call :func:`ensure_sglang_importable` before anything imports ``sglang``,
``torchvision`` or ``transformers``' image utilities. SGLang imports ``torchvision`` at module level
(``sglang.srt.configs`` -> ``multimodal/internvl_utils``), and PyPI's torchvision wheel
carries CUDA-linked C++ ops that cannot load beside the CPU build of torch; its Python
then dies on ``register_fake("torchvision::nms")``. We declare the two op schemas it
registers fakes for, which is all its pure-Python part needs. On a machine where the ops
do load (CUDA torch + matching torchvision) nothing is declared.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

import torch

# Keeps the op declarations alive: a torch.library.Library drops its definitions when
# it is garbage-collected.
_TORCHVISION_OPS_LIB = None


def ensure_torchvision_importable() -> bool:
    """Make ``import torchvision`` work beside a CPU torch when its C++ ops can't load.

    Returns True if it had to declare the op schemas. Does nothing (returns False) when
    torchvision is absent, already imported, or its ``_C`` extension loads.
    """
    global _TORCHVISION_OPS_LIB
    if _TORCHVISION_OPS_LIB is not None or "torchvision" in sys.modules:
        return False
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    libs = []
    for loc in spec.submodule_search_locations:
        libs += glob.glob(os.path.join(loc, "_C.so")) + glob.glob(os.path.join(loc, "_C.*.so"))
    if libs:
        try:
            # What torchvision.extension does itself; loading twice is harmless.
            torch.ops.load_library(libs[0])
            return False
        except (OSError, ImportError, RuntimeError):
            pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in (
        "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
        "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    ):
        try:
            lib.define(schema)
        except RuntimeError:  # already declared by someone else
            pass
    _TORCHVISION_OPS_LIB = lib
    return True


def ensure_sglang_importable() -> None:
    """Everything that must happen before the first ``import sglang`` on a CPU machine.

    Besides the torchvision fix-up: ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's switch for its
    CPU server) makes SGLang import ``sgl_kernel`` (its CPU kernel build, not on PyPI) at
    module level; without that package the harness runs SGLang's generic path instead, so
    the variable is dropped here, before SGLang reads it at import.
    """
    ensure_torchvision_importable()
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and "sglang" not in sys.modules:
        if importlib.util.find_spec("sgl_kernel") is None:
            import warnings

            warnings.warn("compiled_attn: SGLANG_USE_CPU_ENGINE=1 needs sgl_kernel, which is "
                          "not installed; unsetting it for this process", stacklevel=2)
            del os.environ["SGLANG_USE_CPU_ENGINE"]
