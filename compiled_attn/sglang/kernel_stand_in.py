"""The ``sgl_kernel`` stand-in for a CPU-only machine (a :mod:`compiled_attn.sglang.cpu_fixups` fix-up): SGLang's CPU
engine imports ``sgl_kernel`` at module level and PyPI has no CPU build of it.

This module must stay free of module-level imports of sglang, transformers and torchvision.
"""

from __future__ import annotations

import importlib.util
import sys
import types


class _KernelStandIn(types.ModuleType):
    """``sgl_kernel`` for a CPU without it: the speculative ops in pure PyTorch, every other name a function
    raising ``NotImplementedError`` when called.

    SGLang's CPU modules import ``*_cpu`` kernels from ``sgl_kernel`` at module level, so the names must exist.
    Most are called only on CPUs with AMX (and PyPI has no CPU build): a call means a path we don't support. With
    SGLang 0.5.23 the names taken at import are ``assign_req_to_token_pool_cpu``, ``copy_all_layer_kv_cache_cpu``,
    ``assign_extend_cache_locs_cpu``, ``assign_draft_cache_locs_contiguous_cpu``,
    ``build_tree_kernel_efficient_cpu``, ``fill_accept_out_cache_loc_cpu``, ``fill_bonus_tokens_cpu``,
    ``verify_tree_greedy_cpu`` and ``rotate_input_ids_cpu``: all are real
    (:data:`compiled_attn.sglang.spec_kernels_cpu.OPS`: what NGRAM and the EAGLE worker's algorithms call), as is
    ``build_draft_decode_metadata_cpu`` (intel_amx's draft decode). Any name is answered, so a new import doesn't
    break start-up.
    """

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        from .spec_kernels_cpu import OPS

        op = OPS.get(name)
        if op is None:
            def op(*args, **kwargs):
                raise NotImplementedError(f"{self.__name__}.{name}: sgl_kernel is not installed (CPU-only stand-in)")

            op.__name__ = op.__qualname__ = name
        setattr(self, name, op)
        return op


class _StandInFinder:
    """Meta-path finder that makes ``sgl_kernel`` importable as a :class:`_KernelStandIn`, and of its submodules only
    ``sgl_kernel.speculative`` (holding just the ops in ``spec_kernels_cpu.SPECULATIVE_OPS``).

    Other submodules stay missing on purpose: SGLang wraps ``from sgl_kernel.<sub> import ...`` in ``try/except
    ImportError`` with CPU fallbacks (e.g. ``sgl_kernel.scalar_type``), which a stand-in would defeat; for the same
    reason a name ``sgl_kernel.speculative`` lacks is an ``ImportError``, not a raising function.
    """

    ROOT = "sgl_kernel"
    SPECULATIVE = "sgl_kernel.speculative"

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in (self.ROOT, self.SPECULATIVE):
            return None
        # the root is a package (empty __path__) so that `import sgl_kernel.speculative` reaches this finder
        return importlib.util.spec_from_loader(fullname, self, is_package=fullname == self.ROOT)

    def create_module(self, spec):
        if spec.name == self.ROOT:
            return _KernelStandIn(spec.name)
        from .spec_kernels_cpu import SPECULATIVE_OPS

        module = types.ModuleType(spec.name, "CPU stand-in: sgl_kernel's speculative ops in pure PyTorch")
        module.__dict__.update(SPECULATIVE_OPS)
        return module

    def exec_module(self, module):
        pass


def _stand_in_installed() -> bool:
    return any(isinstance(f, _StandInFinder) for f in sys.meta_path)


def install_sgl_kernel_stand_in() -> bool:
    """SGLang's CPU engine imports ``sgl_kernel`` at module level and PyPI has no CPU build: answer with a stand-in
    (speculative ops real, in PyTorch; the rest raise when called)."""
    if _stand_in_installed():
        return False
    if "sgl_kernel" in sys.modules or importlib.util.find_spec("sgl_kernel") is not None:
        return False  # a real sgl_kernel is installed: use it
    sys.meta_path.append(_StandInFinder())  # appended: a real package installed later still wins
    return True
