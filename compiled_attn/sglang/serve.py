"""``compiled-attn serve``: SGLang's own server (or ``sglang.Engine``) with the CPU fix-ups, on any machine.

    compiled-attn serve --model-path DIR [any sglang.launch_server flag]

On a CPU-only machine this applies :mod:`compiled_attn.sglang.cpu_fixups` in this process and, through the process
targets it hands to SGLang, in every spawned child, and defaults ``--device cpu`` and ``--attention-backend
compiled_attn``. With CUDA available it applies nothing and only adds the ``--attention-backend`` default. The
server itself is SGLang's, unchanged.

Flags our backend cannot serve (:func:`check_args`) are refused before anything starts, with one message naming
the flag, rather than at the first request. On a CPU-only machine speculative decoding runs as
``--speculative-algorithm NGRAM`` only (no draft model), eagerly (no ``--enable-torch-compile``) and with
``--page-size 1``.
"""

from __future__ import annotations

import argparse
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
               enable_torch_compile: bool | None = None, cpu: bool | None = None) -> None:
    """Refuse what :class:`compiled_attn.sglang.backend.CompiledAttnBackend` would refuse at the first request, and
    what SGLang cannot run on this machine with it.

    Only applies when the attention backend is ours (``None`` = our default). ``cpu``: a CPU-only machine (None:
    ``cpu_fixups.cpu_only()``). Raises :class:`UnsupportedArgument`.
    """
    if attention_backend not in (None, BACKEND):
        return
    if kv_cache_dtype is not None and kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        raise UnsupportedArgument(
            f"--kv-cache-dtype {kv_cache_dtype}: not supported by --attention-backend {BACKEND} (it reads "
            f"float32/bfloat16/float16 and float8 caches); use one of {', '.join(SUPPORTED_KV_CACHE_DTYPES)}")
    if speculative_algorithm and (cpu_fixups.cpu_only() if cpu is None else cpu):
        _check_cpu_speculative(str(speculative_algorithm), page_size, enable_torch_compile)
    if page_size is not None and int(page_size) < 1:
        raise UnsupportedArgument(f"--page-size {page_size}: --attention-backend {BACKEND} needs a positive "
                                  "number of tokens per page")


def _check_cpu_speculative(algorithm: str, page_size, enable_torch_compile) -> None:
    """On a CPU-only machine only NGRAM drafts (no draft model; its ops have PyTorch versions in the
    ``sgl_kernel`` stand-in, ``spec_kernels_cpu``); the backend verifies drafts of any algorithm on a GPU."""
    if algorithm.upper() != "NGRAM":
        raise UnsupportedArgument(
            f"--speculative-algorithm {algorithm}: on a CPU-only machine only NGRAM runs (SGLang 0.5.23's "
            f"draft-model workers need CUDA kernels: sgl_kernel, triton); --attention-backend {BACKEND} "
            "verifies drafts of every algorithm on a GPU machine (python -m sglang.launch_server ...)")
    if enable_torch_compile:
        # SGLang's CPU graph runner asserts that speculative decoding is off
        raise UnsupportedArgument(
            "--enable-torch-compile: SGLang 0.5.23's CPU graph runner does not run speculative decoding; "
            f"--speculative-algorithm NGRAM with --attention-backend {BACKEND} on CPU runs eagerly (drop the flag)")
    if page_size is not None and int(page_size) > 1:
        # get_last_loc (SGLang's paged slot allocation for draft tokens) is a triton kernel for every backend but
        # torch_native; trees over pages > 1 SGLang allows only with flashinfer anyway
        raise UnsupportedArgument(
            f"--page-size {page_size}: --speculative-algorithm NGRAM on a CPU-only machine needs --page-size 1 "
            "(SGLang 0.5.23 allocates draft-token slots over pages > 1 with a triton kernel)")


def _flag_values(argv: list[str]) -> dict:
    """The flags :func:`check_args` looks at, read from ``argv`` without importing SGLang."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--attention-backend")
    p.add_argument("--kv-cache-dtype")
    p.add_argument("--speculative-algorithm", "--speculative-algo")
    p.add_argument("--page-size", type=int)
    p.add_argument("--enable-torch-compile", action="store_true")
    known, _ = p.parse_known_args(argv)
    return dict(attention_backend=known.attention_backend or BACKEND, kv_cache_dtype=known.kv_cache_dtype,
                speculative_algorithm=known.speculative_algorithm, page_size=known.page_size,
                enable_torch_compile=known.enable_torch_compile)


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


def engine(*, scheduler_target: cpu_fixups.ChildTarget | None = None, **server_args_kwargs):
    """A ``sglang.Engine`` with the CPU fix-ups (on a CPU-only machine) and our backend as default.

    Takes ``sglang.Engine``'s keyword arguments (``model_path=...``, ``enable_torch_compile=True``, ...). Raises
    :class:`UnsupportedArgument` before starting anything for settings our backend cannot serve.
    ``scheduler_target``: as :func:`engine_class`'s.
    """
    server_args_kwargs.setdefault("attention_backend", BACKEND)
    check_args(**{k: server_args_kwargs.get(k) for k in
                  ("attention_backend", "kv_cache_dtype", "speculative_algorithm", "page_size",
                   "enable_torch_compile")})
    cpu = _prepare()
    if not cpu and scheduler_target is None:
        from sglang.srt.entrypoints.engine import Engine

        return Engine(**server_args_kwargs)
    if cpu:
        server_args_kwargs.setdefault("device", "cpu")
    return engine_class(scheduler_target)(**server_args_kwargs)  # with CUDA the fix-ups in the children do nothing


def main(argv: list[str] | None = None) -> int:
    """Run SGLang's HTTP server with ``argv`` (``sglang.launch_server``'s flags) after the fix-ups."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        print("\nAll other flags are sglang.launch_server's: python -m sglang.launch_server --help")
        return 0
    try:
        check_args(**_flag_values(argv))
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
