"""Fix-ups that let SGLang 0.5.23 be imported, and run as a live engine, on a CPU-only machine.

Two users, two modes:

- The layer-level test harness (``compiled_attn.sglang.testing``) runs SGLang's *generic* path: it calls
  :func:`ensure_sglang_importable` (torchvision fix-up; drops ``SGLANG_USE_CPU_ENGINE`` when no ``sgl_kernel``
  is installed) before importing SGLang.
- A live engine/server (``compiled_attn.sglang.serve``) runs SGLang's *CPU engine* path: :func:`apply` must run in
  every SGLang process before that process imports ``torchvision``, ``transformers`` or ``sglang``. The launching
  process calls it itself; SGLang spawns its scheduler and detokenizer with multiprocessing's "spawn", and their
  targets are :data:`run_scheduler_process` / :data:`run_detokenizer_process` (:class:`ChildTarget`), whose
  unpickling in the child calls :func:`apply` before the target's arguments (which import SGLang) are unpickled.
  What SGLang's launcher starts by its own names (the data-parallel controller, attention DP's pre-started
  schedulers: :data:`LAUNCHER_TARGETS`) becomes a :class:`ChildTarget` too, in the launching process
  (:func:`wrap_launcher_targets`); the controller starts its schedulers with the scheduler target it is handed.

The ``sgl_kernel`` stand-in is not all stubs: the ops SGLang's speculative decoding calls on CPU (NGRAM, and the
EAGLE worker's EAGLE / EAGLE3 / STANDALONE) are answered with the PyTorch versions in
:mod:`compiled_attn.sglang.spec_kernels_cpu`, and ``sgl_kernel.speculative`` (its one submodule) holds the n-gram
tree-link op; everything else raises when called.

The two modes are exclusive per process (one sets ``SGLANG_USE_CPU_ENGINE=1``, the other drops it), so a process
that has used the harness must not start a live engine in-process; start it in a subprocess.

Each :func:`apply` fix-up names the last SGLang version known to need it (``FIXUPS``); nothing is applied where CUDA
is available or SGLang is absent or newer. Each also checks that it is still needed here (e.g. a real
``sgl_kernel`` wins over the stand-in; torchvision ops that do load are used as they are).

This module must stay free of module-level imports of sglang, transformers and torchvision.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import sys

from .cpu_compile import compile_decode_once
from .cpu_float8 import admit_float8_caches
from .kernel_stand_in import _stand_in_installed, _StandInFinder, install_sgl_kernel_stand_in  # noqa: F401

# The last SGLang release checked; a fix-up applies to versions up to the one it names (raise it after checking).
SGLANG_0_5_23 = (0, 5, 23)
# torch.library.Library objects drop their definitions when garbage-collected: keep the torchvision one here.
_TORCHVISION_OPS_LIB = None
# What apply() did in this process, by fix-up name (for tests and logs).
APPLIED: dict[str, bool] = {}


def _version_tuple(text: str) -> tuple:
    """``"0.5.23.post1"`` -> ``(0, 5, 23)``: the numeric release part only."""
    out = []
    for part in text.split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits or not part[0].isdigit():
            break
        out.append(int(digits))
    return tuple(out)


def sglang_version() -> tuple | None:
    """Installed SGLang's version from its metadata (no import), or None if SGLang is absent."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return _version_tuple(version("sglang"))
    except PackageNotFoundError:
        return None


def cpu_only() -> bool:
    """True without a usable CUDA device: the only case the live-engine fix-ups are for."""
    import torch

    return not torch.cuda.is_available()


# --- fix-ups (each one line of why in its docstring) -------------------------------------------------------------


def ensure_torchvision_importable() -> bool:
    """PyPI's torchvision ops are CUDA-linked and can't load beside CPU torch; declare the 2 schemas it fakes.

    SGLang imports ``torchvision`` at module level (``sglang.srt.configs`` -> ``multimodal/internvl_utils``), and
    torchvision's Python then dies on ``register_fake("torchvision::nms")``; declaring ``nms``/``qnms`` is all its
    pure-Python part needs. Returns True if it declared them; False (nothing done) when torchvision is absent,
    already imported, already fixed, or its ``_C`` extension loads (CUDA torch + matching torchvision).
    """
    global _TORCHVISION_OPS_LIB
    if _TORCHVISION_OPS_LIB is not None or "torchvision" in sys.modules:
        return False
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    import torch

    for loc in spec.submodule_search_locations:
        for lib in glob.glob(os.path.join(loc, "_C*.so")):
            try:
                torch.ops.load_library(lib)  # what torchvision.extension does itself; loading twice is harmless
                return False
            except (OSError, ImportError, RuntimeError):
                pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                   "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"):
        try:
            lib.define(schema)
        except RuntimeError:  # declared already by someone else
            pass
    _TORCHVISION_OPS_LIB = lib
    return True


def set_cpu_engine_env() -> bool:
    """SGLang takes its CPU engine path only with ``SGLANG_USE_CPU_ENGINE=1`` (else its rotary embedding needs vllm)."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        return False
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # inherited by the spawned children
    return True


def skip_cpu_compile_fake_ops() -> bool:
    """``--enable-torch-compile`` registers fakes for ``sgl_kernel::*`` ops the stand-in lacks: make that a no-op.

    The fakes serve only graphs that call sgl_kernel ops, which a CPU without the real kernels never does.
    Runs only once this process has imported SGLang (after the torchvision fix-up).
    """
    if not _stand_in_installed():
        return False
    from sglang.srt.model_executor import cpu_graph_runner

    def register_fake_ops(tp_size: int) -> None:
        """No-op: the stand-in ``sgl_kernel`` defines no torch ops to fake."""

    cpu_graph_runner.register_fake_ops = register_fake_ops  # CPUGraphRunner looks the name up at call time
    return True


# SGLang 0.5.23's layer-boundary records that every decoder layer builds on its forward (module, class name)
_LAYER_BOUNDARY_RECORDS = (
    ("sglang.srt.layers.layer_boundary.residual.stream", "Contribution"),
    ("sglang.srt.layers.layer_boundary.exit", "ExitDecision"),
)


def plain_record_class(struct_cls: type) -> type:
    """A plain-Python class with ``struct_cls``'s fields (positional order and defaults) and methods: a
    ``msgspec.Struct`` stand-in that dynamo can construct and mutate inside a compiled graph."""
    import dataclasses

    fields = struct_cls.__struct_fields__
    defaults = struct_cls.__struct_defaults__
    first_default = len(fields) - len(defaults)  # msgspec's defaults belong to the last fields, as a dataclass's
    spec = [(name, object) if i < first_default
            else (name, object, dataclasses.field(default=defaults[i - first_default]))
            for i, name in enumerate(fields)]
    methods = {k: v for k, v in vars(struct_cls).items() if callable(v) and not k.startswith("__")}
    return dataclasses.make_dataclass(struct_cls.__name__, spec, namespace={
        **methods, "__doc__": struct_cls.__doc__, "__module__": struct_cls.__module__}, eq=False)


def plain_layer_boundary_records() -> bool:
    """Under ``--enable-torch-compile`` dynamo cannot build SGLang's ``msgspec`` layer-boundary records and breaks
    the CPU graph runner's graph twice per decoder layer: swap in plain-Python classes with the same fields."""
    import msgspec

    swapped = False
    for module_name, name in _LAYER_BOUNDARY_RECORDS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        cls = getattr(module, name, None)
        if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
            setattr(module, name, plain_record_class(cls))  # the module's functions look the name up per call
            swapped = True
    return swapped


def eager_cpu_moe_loop() -> bool:
    """Under ``--enable-torch-compile`` SGLang's CPU MoE (``moe_forward_native``: a host loop over the experts with
    data-dependent token counts) recompiles its activation for every new count (~0.1 s each, up to dynamo's
    recompile limit), so the first decodes of a live MoE engine spike: run that loop eagerly, as it runs between
    graph breaks anyway."""
    import torch

    try:
        from sglang.srt.layers.moe import fused_moe_native
    except ImportError:
        return False
    loop = fused_moe_native.moe_forward_native
    if getattr(loop, "_torchdynamo_disable", False):
        return False
    fused_moe_native.moe_forward_native = torch.compiler.disable(loop)  # callers import the name per call
    return True


def eagle_draft_backends() -> bool:
    """SGLang's EAGLE worker builds its draft backends from name tables without ``compiled_attn``
    (``speculative/draft_utils.py``: "EAGLE is not supported in attention backend compiled_attn"): add it, ours for
    the draft extend and ``spec_kernels_cpu.DraftDecodeSteps`` for the multi-step draft decode."""
    from sglang.srt.speculative.draft_utils import DraftBackendFactory as factory

    make = factory._create_backend
    if getattr(make, "_compiled_attn", False):
        return False

    def _create_backend(self, backend_name, backend_map, error_template, stamps_children=False):
        from .plugin import BACKEND_NAME, create_backend
        from .spec_kernels_cpu import DraftDecodeSteps

        def ours():  # stamps_children: the per-step decode backends
            return BACKEND_NAME, (DraftDecodeSteps(self.draft_model_runner, self.topk, self.speculative_num_steps)
                                  if stamps_children else create_backend(self.draft_model_runner))

        return make(self, backend_name, {**backend_map, BACKEND_NAME: ours}, error_template, stamps_children)

    _create_backend._compiled_attn = True
    factory._create_backend = _create_backend  # the factory's methods look it up per call
    return True


# What SGLang 0.5.23's launcher (sglang/srt/entrypoints/engine.py) starts by its own module-level names rather than
# through Engine's replaceable run_*_process_func targets: (name there, defining module). Pickled by name, each one's
# spawned child imports SGLang (torchvision first) to unpickle it, before any fix-up could run.
LAUNCHER = "sglang.srt.entrypoints.engine"
LAUNCHER_TARGETS = (
    # the data-parallel controller (--dp-size > 1, attention DP included): engine.py:974-975
    ("run_data_parallel_controller_process", "sglang.srt.managers.data_parallel_controller"),
    # attention DP: each scheduler is started before the controller and waits for its ranks: engine.py:943, 956
    ("run_scheduler_process_with_init_pipe", "sglang.srt.managers.data_parallel_controller"),
    # --detokenizer-worker-num > 1: the router in front of the detokenizers: engine.py:1088-1089
    ("run_multi_detokenizer_router_process", "sglang.srt.managers.multi_tokenizer_mixin"),
)


def wrap_launcher_targets() -> bool | None:
    """SGLang's launcher starts the data-parallel controller (and attention DP's schedulers) with targets of its own,
    which the children unpickle by importing SGLang before any fix-up: make each a :class:`ChildTarget`.

    The controller starts its schedulers with the scheduler target the engine hands it (ours), so they are covered
    too. Runs in the launching process, once it has imported SGLang's launcher; None (tried again at the next
    :func:`apply`) where it has not.
    """
    launcher = sys.modules.get(LAUNCHER)
    if launcher is None:
        return None
    wrapped = False
    for name, module in LAUNCHER_TARGETS:
        if hasattr(launcher, name) and not isinstance(getattr(launcher, name), ChildTarget):
            setattr(launcher, name, ChildTarget(module, name))  # the launcher looks each name up per launch
            wrapped = True
    return wrapped


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` (a ``SGLANG_CPU_OMP_THREADS_BIND`` entry, a sysfs cpulist) -> ``[0, 1, 2, 3, 8, 10, 11]``."""
    cpus: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def _pin_process(cpus: list[int]) -> None:
    """Every thread of this process onto ``cpus`` (threads started later inherit it), and torch's intra-op pool sized
    to them, as sgl_kernel's ``init_cpu_threads_env`` does."""
    import torch

    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that ended meanwhile
            pass
    torch.set_num_threads(len(cpus))


def pin_rank_threads() -> bool:
    """SGLang applies a rank's ``SGLANG_CPU_OMP_THREADS_BIND`` entry only through sgl_kernel's AMX build
    (``init_cpu_threads_env``); with the stand-in every rank would run its threads on every CPU: pin the rank's
    process to its entry (the string ``numa_utils.init_threads_binding`` picks for it) and size torch's pool to it."""
    if not _stand_in_installed():
        return False
    from sglang.srt.utils import numa_utils

    picked = numa_utils.init_threads_binding
    if getattr(picked, "_compiled_attn_pins", False):
        return False

    def init_threads_binding(*args, **kwargs):
        cpu_ids = picked(*args, **kwargs)
        if os.environ.get("SGLANG_CPU_OMP_THREADS_BIND") and isinstance(cpu_ids, str):
            _pin_process(parse_cpu_list(cpu_ids))
        return cpu_ids

    init_threads_binding._compiled_attn_pins = True
    numa_utils.init_threads_binding = init_threads_binding  # bootstrap looks the name up per call
    return True


def ensure_sglang_importable() -> None:
    """Harness mode: everything before the first ``import sglang`` to run SGLang's generic path on a CPU machine.

    Besides the torchvision fix-up: ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's switch for its CPU server) makes SGLang
    import ``sgl_kernel`` (its CPU kernel build, not on PyPI) at module level; without that package (and without
    :func:`apply`'s stand-in) the harness runs SGLang's generic path instead, so the variable is dropped here,
    before SGLang reads it at import.
    """
    ensure_torchvision_importable()
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and "sglang" not in sys.modules:
        if importlib.util.find_spec("sgl_kernel") is None:
            import warnings

            warnings.warn("compiled_attn: SGLANG_USE_CPU_ENGINE=1 needs sgl_kernel, which is "
                          "not installed; unsetting it for this process", stacklevel=2)
            del os.environ["SGLANG_USE_CPU_ENGINE"]


# --- live-engine mode ------------------------------------------------------------------------------------------

# (name, function, last SGLang version that needs it, needs SGLang imported). The first three must run before
# SGLang is imported; the others patch SGLang modules, so they wait until this process has imported SGLang (the
# child targets below call apply() again once SGLang is loaded), which keeps apply() cheap where SGLang is unused.
# A fix-up that returns None found nothing to patch in this process yet; the next apply() tries it again.
FIXUPS = (
    ("torchvision", ensure_torchvision_importable, SGLANG_0_5_23, False),
    ("cpu_engine_env", set_cpu_engine_env, SGLANG_0_5_23, False),
    ("sgl_kernel_stand_in", install_sgl_kernel_stand_in, SGLANG_0_5_23, False),
    ("skip_cpu_compile_fake_ops", skip_cpu_compile_fake_ops, SGLANG_0_5_23, True),
    ("plain_layer_boundary_records", plain_layer_boundary_records, SGLANG_0_5_23, True),
    ("eager_cpu_moe_loop", eager_cpu_moe_loop, SGLANG_0_5_23, True),
    ("pin_rank_threads", pin_rank_threads, SGLANG_0_5_23, True),
    ("launcher_targets", wrap_launcher_targets, SGLANG_0_5_23, True),
    ("eagle_draft_backends", eagle_draft_backends, SGLANG_0_5_23, True),
    ("compile_decode_once", compile_decode_once, SGLANG_0_5_23, True),
    ("admit_float8_caches", admit_float8_caches, SGLANG_0_5_23, True),
)
_version: tuple | None = None  # SGLang's version where the fix-ups are considered (CPU-only), else ()


def apply() -> dict[str, bool]:
    """Live-engine mode: apply every fix-up this machine and SGLang version need; safe to call any number of times.

    Returns ``{fix-up name: applied}`` for the fix-ups handled so far in this process; empty where CUDA is
    available or SGLang is absent or newer than every fix-up's version (then nothing is touched).
    """
    global _version
    if _version is None:
        _version = (sglang_version() or ()) if cpu_only() else ()
    for name, fn, until, after_sglang in FIXUPS:
        if not _version or _version > until or name in APPLIED:
            continue
        if after_sglang and "sglang" not in sys.modules:
            continue
        done = fn()
        if done is not None:
            APPLIED[name] = done
    return APPLIED


class ChildTarget:
    """A picklable process target: SGLang's ``module.name``, with :func:`apply` run first in the spawned child.

    A spawned child unpickles its process object, target first and arguments after; the arguments (SGLang's
    ``ServerArgs``) import SGLang. Unpickling this target calls :func:`_child_target`, which applies the fix-ups,
    so they are in place before that. Constructing one has no side effects.
    """

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name
        self.__name__ = self.__qualname__ = name  # read by SGLang/multiprocessing for names and logs

    def __call__(self, *args, **kwargs):
        apply()
        return getattr(importlib.import_module(self.module), self.name)(*args, **kwargs)

    def __reduce__(self):
        return _child_target, (self.module, self.name)

    def __repr__(self) -> str:
        return f"ChildTarget({self.module!r}, {self.name!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, ChildTarget) and (self.module, self.name) == (other.module, other.name)

    def __hash__(self) -> int:
        return hash((self.module, self.name))


def _child_target(module: str, name: str) -> ChildTarget:
    """Unpickling hook for :class:`ChildTarget`: applies the fix-ups in the child, then rebuilds the target."""
    apply()
    return ChildTarget(module, name)


# Targets for sglang.Engine's run_scheduler_process_func / run_detokenizer_process_func (and launch_server's
# arguments of the same names).
run_scheduler_process = ChildTarget("sglang.srt.managers.scheduler", "run_scheduler_process")
run_detokenizer_process = ChildTarget("sglang.srt.managers.detokenizer_manager", "run_detokenizer_process")
