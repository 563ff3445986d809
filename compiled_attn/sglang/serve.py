"""``compiled-attn serve``: SGLang's own server (or ``sglang.Engine``) with the CPU fix-ups, on any machine.

    compiled-attn serve --model-path DIR [any sglang.launch_server flag]

On a CPU-only machine this applies :mod:`compiled_attn.sglang.cpu_fixups` in this process and, through the process
targets it hands to SGLang, in every spawned child, and defaults ``--device cpu`` and ``--attention-backend
compiled_attn``. With CUDA available it applies nothing and only adds the ``--attention-backend`` default. The
server itself is SGLang's, unchanged.

Flags our backend cannot serve (:func:`check_args`) are refused before anything starts, with one message naming
the flag, rather than at the first request. On a CPU-only machine speculative decoding runs as
``--speculative-algorithm NGRAM`` (no draft model) or EAGLE / EAGLE3 / NEXTN / STANDALONE (a draft model:
``--speculative-draft-model-path``), eagerly (no ``--enable-torch-compile``) and with ``--page-size 1``.

Scale-out on a CPU (``--tp-size``, ``--dp-size``, ``--dp-size N --enable-dp-attention``): SGLang runs one scheduler
process per rank and, unless ``SGLANG_CPU_OMP_THREADS_BIND`` gives each its CPUs (``"0-7|8-15"``), asserts that
the ranks fit the NUMA nodes. Without that variable :func:`cpu_thread_binding` splits this process's CPUs evenly
among the ranks (per NUMA node where the ranks divide among them) and says so in one log line; more ranks than CPUs
is refused at start-up. Each rank's process is pinned to its CPUs (``cpu_fixups.pin_rank_threads``). DP attention
runs eagerly there: SGLang 0.5.23's CPU graph runner cannot run it, so ``--enable-torch-compile`` is refused with it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from profiling.host import use_huge_pages

from . import cpu_fixups

BACKEND = "compiled_attn"
# KV-cache dtypes the backend reads ("auto" = the model's dtype; fp8 caches are dequantised in the gather).
SUPPORTED_KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2")


class UnsupportedArgument(ValueError):
    """A server flag ``--attention-backend compiled_attn`` cannot serve; the message names the flag."""


def check_args(*, attention_backend: str | None = BACKEND, kv_cache_dtype: str | None = None,
               speculative_algorithm: str | None = None, page_size: int | None = None,
               enable_torch_compile: bool | None = None, dp_size: int | None = None,
               enable_dp_attention: bool | None = None, attn_dp_size: int | None = None,
               cpu: bool | None = None) -> None:
    """Refuse what :class:`compiled_attn.sglang.backend.CompiledAttnBackend` would refuse at the first request, and
    what SGLang cannot run on this machine with it.

    Only applies when the attention backend is ours (``None`` = our default). ``cpu``: a CPU-only machine (None:
    ``cpu_fixups.cpu_only()``). Raises :class:`UnsupportedArgument`.
    """
    if attention_backend not in (None, BACKEND):
        return
    dp_attention = (enable_dp_attention and int(dp_size or 1) > 1) or int(attn_dp_size or 1) > 1
    if dp_attention and enable_torch_compile and (cpu_fixups.cpu_only() if cpu is None else cpu):
        # CPUGraphRunner.__init__: assert not self.require_mlp_tp_gather (true for every CPU DP-attention layout)
        raise UnsupportedArgument(
            "--enable-torch-compile: SGLang 0.5.23's CPU graph runner does not run DP attention (\"CPUGraphRunner "
            "does not support MLP TP gather yet\"); --enable-dp-attention with --attention-backend "
            f"{BACKEND} on CPU runs eagerly (drop the flag)")
    if kv_cache_dtype is not None and kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        raise UnsupportedArgument(
            f"--kv-cache-dtype {kv_cache_dtype}: not supported by --attention-backend {BACKEND} (it reads "
            f"float32/bfloat16/float16 and float8 caches); use one of {', '.join(SUPPORTED_KV_CACHE_DTYPES)}")
    if speculative_algorithm and (cpu_fixups.cpu_only() if cpu is None else cpu):
        _check_cpu_speculative(str(speculative_algorithm), page_size, enable_torch_compile)
    if page_size is not None and int(page_size) < 1:
        raise UnsupportedArgument(f"--page-size {page_size}: --attention-backend {BACKEND} needs a positive "
                                  "number of tokens per page")


# What SGLang 0.5.23 drafts on a CPU-only machine with this backend: NGRAM (no draft model) and the EAGLE worker's
# algorithms (a draft head or model; NEXTN is EAGLE): their sgl_kernel ops are PyTorch versions in spec_kernels_cpu,
# their draft backends ours (cpu_fixups.eagle_draft_backends). The other workers (DFLASH, UNO, ...) launch triton.
CPU_SPECULATIVE = ("NGRAM", "EAGLE", "EAGLE3", "NEXTN", "STANDALONE")


def _check_cpu_speculative(algorithm: str, page_size, enable_torch_compile) -> None:
    """On a CPU-only machine: the algorithms in :data:`CPU_SPECULATIVE`, eagerly, with page size 1; the backend
    verifies drafts of any algorithm on a GPU."""
    name = algorithm.upper()
    if name not in CPU_SPECULATIVE:
        raise UnsupportedArgument(
            f"--speculative-algorithm {algorithm}: on a CPU-only machine only {', '.join(CPU_SPECULATIVE)} run "
            f"(SGLang 0.5.23's other draft workers need CUDA kernels: sgl_kernel, triton); --attention-backend "
            f"{BACKEND} verifies drafts of every algorithm on a GPU machine (python -m sglang.launch_server ...)")
    if enable_torch_compile:
        # SGLang's CPU graph runner asserts that speculative decoding is off
        raise UnsupportedArgument(
            "--enable-torch-compile: SGLang 0.5.23's CPU graph runner does not run speculative decoding; "
            f"--speculative-algorithm {name} with --attention-backend {BACKEND} on CPU runs eagerly (drop the flag)")
    if page_size is not None and int(page_size) > 1:
        # get_last_loc (SGLang's paged slot allocation for draft tokens) is a triton kernel for every backend but
        # torch_native; trees over pages > 1 SGLang allows only with flashinfer anyway
        raise UnsupportedArgument(
            f"--page-size {page_size}: --speculative-algorithm {name} on a CPU-only machine needs --page-size 1 "
            "(SGLang 0.5.23 allocates draft-token slots over pages > 1 with a triton kernel)")


OMP_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"
# ServerArgs fields that decide how many scheduler processes (ranks) SGLang starts
_LAYOUT = ("tp_size", "dp_size", "pp_size", "enable_dp_attention", "nnodes", "max_total_tokens")
_log = logging.getLogger(__name__)
_BINDING_SET: list[str] = []  # the SGLANG_CPU_OMP_THREADS_BIND values cpu_thread_binding set in os.environ


def scheduler_ranks(*, tp_size=1, dp_size=1, pp_size=1, enable_dp_attention=False, nnodes=1) -> int:
    """SGLang's scheduler processes on this node: one per (pipeline, tensor) rank of each data-parallel replica.
    Attention DP (``--dp-size N --enable-dp-attention``, or ``--attn-dp-size N``) splits the tensor-parallel group
    instead of adding processes."""
    replicas = 1 if enable_dp_attention else int(dp_size or 1)
    ranks = int(tp_size or 1) * int(pp_size or 1) * replicas
    return max(1, -(-ranks // max(1, int(nnodes or 1))))


def numa_cpus() -> list[list[int]]:
    """Each NUMA node's CPUs (sysfs), or one node of every CPU where sysfs does not say."""
    base = "/sys/devices/system/node"
    nodes = []
    if os.path.isdir(base):
        for name in sorted(os.listdir(base), key=lambda n: (len(n), n)):
            path = os.path.join(base, name, "cpulist")
            if name.startswith("node") and name[4:].isdigit() and os.path.exists(path):
                with open(path) as f:
                    cpus = cpu_fixups.parse_cpu_list(f.read().strip())
                if cpus:
                    nodes.append(cpus)
    return nodes or [list(range(os.cpu_count() or 1))]


def _cpu_list(cpus: list[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"``."""
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _split(cpus: list[int], parts: int) -> list[list[int]]:
    """``cpus`` in ``parts`` consecutive groups whose sizes differ by at most one (the first ones larger)."""
    size, extra = divmod(len(cpus), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(cpus[start:end])
        start = end
    return out


def split_cpus(ranks: int, cpus=None, nodes: list[list[int]] | None = None) -> str:
    """A ``SGLANG_CPU_OMP_THREADS_BIND`` value giving each of ``ranks`` ranks its own CPUs: ``"0|1"`` for 2 ranks on
    2 CPUs, ``"0-7|8-15"`` for 2 on 16.

    ``cpus``: the CPUs to share (default: this process's affinity, ``os.sched_getaffinity``); ``nodes``: each NUMA
    node's CPUs (default :func:`numa_cpus`). Where the ranks divide evenly among the nodes that hold ``cpus``, each
    rank's CPUs lie on one node; otherwise ``cpus`` are split in order. Raises ``ValueError`` for more ranks than
    CPUs.
    """
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if ranks > len(cpus):
        raise ValueError(f"{ranks} ranks need {ranks} CPUs, this process may run on {len(cpus)}")
    mine = set(cpus)
    on_nodes = [sorted(mine.intersection(n)) for n in (numa_cpus() if nodes is None else nodes)]
    on_nodes = [n for n in on_nodes if n]
    if (len(on_nodes) > 1 and sum(map(len, on_nodes)) == len(cpus) and ranks % len(on_nodes) == 0
            and all(len(n) >= ranks // len(on_nodes) for n in on_nodes)):
        groups = [g for n in on_nodes for g in _split(n, ranks // len(on_nodes))]
    else:
        groups = _split(cpus, ranks)
    return "|".join(_cpu_list(g) for g in groups)


def _say(line: str) -> None:
    """One log line (stderr where nobody configured logging)."""
    if not _log.handlers and not logging.getLogger().handlers:
        _log.addHandler(logging.StreamHandler())
        _log.setLevel(logging.INFO)
    _log.info(line)


def cpu_thread_binding(*, tp_size=1, dp_size=1, pp_size=1, enable_dp_attention=False, nnodes=1,
                       max_total_tokens=None, cpus=None, nodes=None, environ=None, announce=True) -> str | None:
    """On a CPU, give each SGLang rank its own CPUs: sets ``SGLANG_CPU_OMP_THREADS_BIND`` in ``environ`` (default
    ``os.environ``, which the spawned ranks inherit) from :func:`split_cpus` when there is more than one rank and the
    variable is not set, and says so in one log line (``announce``). Returns the value set (None: nothing to do).

    Raises :class:`UnsupportedArgument` naming ``--tp-size`` / ``--dp-size`` / ``--pp-size`` when this machine has
    fewer CPUs than ranks. SGLang sizes each rank's KV pool from the whole node's free memory once the variable is
    set, so the line asks for ``--max-total-tokens`` where it is not given.
    """
    environ = os.environ if environ is None else environ
    if environ is os.environ and _BINDING_SET and environ.get(OMP_BIND_ENV) == _BINDING_SET[-1]:
        del environ[OMP_BIND_ENV]  # ours, for an earlier engine of this process: not the user's choice
    ranks = scheduler_ranks(tp_size=tp_size, dp_size=dp_size, pp_size=pp_size,
                            enable_dp_attention=enable_dp_attention, nnodes=nnodes)
    if ranks <= 1 or environ.get(OMP_BIND_ENV):
        return None
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if ranks > len(cpus):
        sizes = [f"--{flag}-size {size}" for flag, size in (("tp", tp_size), ("dp", dp_size), ("pp", pp_size))
                 if int(size or 1) > 1]
        dp_attn = " --enable-dp-attention" if enable_dp_attention and int(dp_size or 1) > 1 else ""
        raise UnsupportedArgument(
            f"{' '.join(sizes)}{dp_attn}: {ranks} scheduler processes, each needing CPUs of its own, but this "
            f"process may run on {len(cpus)} CPUs; use fewer ranks, or set {OMP_BIND_ENV} to place them yourself")
    value = split_cpus(ranks, cpus, nodes)
    environ[OMP_BIND_ENV] = value
    if environ is os.environ:
        _BINDING_SET.append(value)
    memory = "" if max_total_tokens else "; each sizes its KV pool from the whole node's memory: set --max-total-tokens"
    if announce:
        _say(f"compiled-attn serve: {OMP_BIND_ENV}={value} ({ranks} ranks, each pinned to its CPUs){memory}")
    return value


def _flag_values(argv: list[str]) -> dict:
    """The flags :func:`check_args` looks at, read from ``argv`` without importing SGLang."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--attention-backend")
    p.add_argument("--kv-cache-dtype")
    p.add_argument("--speculative-algorithm", "--speculative-algo")
    p.add_argument("--page-size", type=int)
    p.add_argument("--enable-torch-compile", action="store_true")
    p.add_argument("--dp-size", "--data-parallel-size", type=int)
    p.add_argument("--attn-dp-size", "--attention-data-parallel-size", type=int)
    p.add_argument("--enable-dp-attention", action="store_true")
    known, _ = p.parse_known_args(argv)
    return dict(attention_backend=known.attention_backend or BACKEND, kv_cache_dtype=known.kv_cache_dtype,
                speculative_algorithm=known.speculative_algorithm, page_size=known.page_size,
                enable_torch_compile=known.enable_torch_compile, dp_size=known.dp_size,
                attn_dp_size=known.attn_dp_size, enable_dp_attention=known.enable_dp_attention)


def _layout_values(argv: list[str]) -> dict:
    """The flags :func:`cpu_thread_binding` looks at, read from ``argv`` without importing SGLang (the spellings
    SGLang lists; :func:`main` checks SGLang's own parse again)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--dp-size", "--data-parallel-size", type=int, default=1)
    p.add_argument("--pp-size", "--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--enable-dp-attention", action="store_true")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--max-total-tokens", type=int)
    known, _ = p.parse_known_args(argv)
    return vars(known)


def _has_flag(argv: list[str], flag: str) -> bool:
    """True if ``flag`` appears in ``argv`` as ``--flag value`` or ``--flag=value``."""
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def server_argv(argv: list[str], cpu: bool) -> list[str]:
    """``argv`` with our defaults added for flags the user did not give."""
    out = list(argv)
    if not _has_flag(out, "--attention-backend"):
        out += ["--attention-backend", BACKEND]
    if cpu and not _has_flag(out, "--device"):
        out += ["--device", "cpu"]
    return out


_ENGINE_CLASSES: dict = {}  # scheduler target -> engine class


def engine_class(scheduler_target: cpu_fixups.ChildTarget | None = None):
    """``sglang.Engine`` with child-process targets that apply the fix-ups in the child before SGLang loads.

    ``run_scheduler_process_func`` / ``run_detokenizer_process_func`` are the class attributes SGLang offers for
    replacing those targets. A subclass, so SGLang's own ``Engine`` is left as it is. ``scheduler_target``
    replaces SGLang's scheduler process function (a benchmark's or test's wrapper that patches something in the
    scheduler process, then runs SGLang's ``run_scheduler_process``).
    """
    target = scheduler_target or cpu_fixups.run_scheduler_process
    if target not in _ENGINE_CLASSES:
        from sglang.srt.entrypoints.engine import Engine

        class CPUEngine(Engine):
            run_scheduler_process_func = staticmethod(target)
            run_detokenizer_process_func = staticmethod(cpu_fixups.run_detokenizer_process)

        _ENGINE_CLASSES[target] = CPUEngine
    return _ENGINE_CLASSES[target]


def _prepare() -> bool:
    """Fix-ups in this process (before SGLang is imported); returns True on a CPU-only machine, where the
    spawned SGLang processes also get 2 MiB pages for their large buffers (weights, KV pool:
    ``profiling.host.use_huge_pages``; ``THP_MEM_ALLOC_ENABLE=0`` in the environment keeps 4 KiB pages)."""
    cpu_fixups.apply()
    cpu = cpu_fixups.cpu_only()
    if cpu:
        use_huge_pages()
    return cpu


def _wrap_launcher() -> None:
    """The fix-ups that patch SGLang's launcher (its own process targets: the data-parallel controller, attention
    DP's schedulers), with the launcher imported."""
    import importlib

    importlib.import_module(cpu_fixups.LAUNCHER)
    cpu_fixups.apply()


def engine(*, scheduler_target: cpu_fixups.ChildTarget | None = None, **server_args_kwargs):
    """A ``sglang.Engine`` with the CPU fix-ups (on a CPU-only machine) and our backend as default.

    Takes ``sglang.Engine``'s keyword arguments (``model_path=...``, ``enable_torch_compile=True``, ...). Raises
    :class:`UnsupportedArgument` before starting anything for settings our backend cannot serve.
    ``scheduler_target``: as :func:`engine_class`'s.
    """
    server_args_kwargs.setdefault("attention_backend", BACKEND)
    check_args(**{k: server_args_kwargs.get(k) for k in
                  ("attention_backend", "kv_cache_dtype", "speculative_algorithm", "page_size",
                   "enable_torch_compile", "dp_size", "enable_dp_attention", "attn_dp_size")})
    device = server_args_kwargs.get("device")
    if (device or "cpu") == "cpu" and cpu_fixups.cpu_only():
        cpu_thread_binding(**{k: server_args_kwargs[k] for k in _LAYOUT if server_args_kwargs.get(k) is not None})
    cpu = _prepare()
    if not cpu and scheduler_target is None:
        from sglang.srt.entrypoints.engine import Engine

        return Engine(**server_args_kwargs)
    if cpu:
        server_args_kwargs.setdefault("device", "cpu")
    cls = engine_class(scheduler_target)
    _wrap_launcher()
    return cls(**server_args_kwargs)  # with CUDA the fix-ups in the children do nothing


def main(argv: list[str] | None = None) -> int:
    """Run SGLang's HTTP server with ``argv`` (``sglang.launch_server``'s flags) after the fix-ups."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        print("\nAll other flags are sglang.launch_server's: python -m sglang.launch_server --help")
        return 0
    try:
        check_args(**_flag_values(argv))
        if cpu_fixups.cpu_only():  # a layout this machine can't run: refused before SGLang is imported
            cpu_thread_binding(**_layout_values(argv), environ=dict(os.environ), announce=False)
    except UnsupportedArgument as e:
        print(f"compiled-attn serve: {e}", file=sys.stderr)
        return 2
    cpu = _prepare()
    from sglang.launch_server import run_server
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()  # registers --attention-backend compiled_attn before the flags are parsed
    server_args = prepare_server_args(server_argv(argv, cpu))
    if cpu:
        _wrap_launcher()
    if cpu and server_args.device in (None, "cpu"):
        try:  # before resolution, which reads the variable (per-rank memory)
            cpu_thread_binding(**{k: getattr(server_args, k) for k in _LAYOUT})
        except UnsupportedArgument as e:
            print(f"compiled-attn serve: {e}", file=sys.stderr)
            return 2
    try:
        server_args.resolve_once()  # what run_server does first; idempotent
        cfg = resolving_view(server_args)
        if cpu and not (cfg.encoder_only or cfg.smg_grpc_mode or cfg.use_ray):
            # run_server's default (HTTP) branch, with the child-process targets that apply the fix-ups
            from sglang.srt.entrypoints.http_server import launch_server

            launch_server(server_args, run_scheduler_process_func=cpu_fixups.run_scheduler_process,
                          run_detokenizer_process_func=cpu_fixups.run_detokenizer_process)
        else:
            run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)  # as sglang.launch_server does on exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
