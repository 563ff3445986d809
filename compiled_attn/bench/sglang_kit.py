"""SGLang's own CPU decode kernel as a measuring stick for ``compiled-attn bench-ops --against sglang``.

The kernel is not part of this project: a kit outside it (``--sglang-kit PATH``; default ``$COMPILED_ATTN_SGLANG_KIT``,
else ``../shared/peers/sglang-cpu-attn`` from the current directory where that exists) holds SGLang's
``decode_attention_cpu`` sources and a ``build.py`` that compiles them against the installed torch as
``torch.ops.sgl_kernel_cpu_attn.*`` into ``$SGL_CPU_ATTN_BUILD`` (default ``~/.cache/sgl_cpu_attn``) /
``sgl_cpu_attn.so``. This module loads that library where it is built and newer than the kit's sources, else runs
the kit's ``build.py`` in a subprocess first, and calls the op as SGLang's ``intel_amx`` backend does (an
``attn_logits`` scratch of ``NUM_KV_SPLITS`` splits per step, the output allocated per call, key/value ``None``: no
K/V write). Nothing of the kit is copied here; where it is missing or does not build, ``load_kit`` says why in one
line and the benchmark runs without the column.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

KIT_ENV = "COMPILED_ATTN_SGLANG_KIT"
DEFAULT_KIT = os.path.join("..", "shared", "peers", "sglang-cpu-attn")
BUILD_ENV = "SGL_CPU_ATTN_BUILD"  # the kit's build.py: where it builds (and caches) the extension
LIBRARY = "sgl_cpu_attn.so"
NAMESPACE = "sgl_kernel_cpu_attn"
NUM_KV_SPLITS = 8  # SGLang's intel_amx backend: attn_logits [bs, Hq, 8, Dv + 1] float32
DTYPES = (torch.bfloat16, torch.float16)  # the kernel dispatches on reduced floating types only
BUILD_TIMEOUT_S = 1200


@dataclass
class Kit:
    """``ops``: ``torch.ops.sgl_kernel_cpu_attn`` where the kernel loaded, else None; ``line``: one line saying
    which library was loaded (and whether it was built now), or why there is no sglang column."""

    ops: object | None
    line: str
    path: str | None = None
    library: str | None = None


def default_kit_path() -> str | None:
    """``$COMPILED_ATTN_SGLANG_KIT``, else ``../shared/peers/sglang-cpu-attn`` where that folder exists, else None."""
    env = os.environ.get(KIT_ENV)
    if env:
        return env
    return DEFAULT_KIT if os.path.isdir(DEFAULT_KIT) else None


def build_dir() -> str:
    """Where the kit's ``build.py`` puts the extension (its ``BUILD``)."""
    return os.environ.get(BUILD_ENV) or os.path.expanduser("~/.cache/sgl_cpu_attn")


def _registered():
    """The op namespace when ``decode_attention_cpu`` is registered in this process, else None."""
    try:
        ops = getattr(torch.ops, NAMESPACE)
        ops.decode_attention_cpu  # noqa: B018 (raises where the library is not loaded)
        return ops
    except (AttributeError, RuntimeError):
        return None


def _sources(kit: str) -> list[str]:
    return [os.path.join(kit, "build.py"), *glob.glob(os.path.join(kit, "csrc", "*")),
            *glob.glob(os.path.join(kit, "ext", "*"))]


def _fresh(library: str, kit: str) -> bool:
    """The library exists and is newer than every source of the kit."""
    if not os.path.isfile(library):
        return False
    built = os.path.getmtime(library)
    return all(os.path.getmtime(s) <= built for s in _sources(kit) if os.path.isfile(s))


def _build(kit: str, timeout_s: float) -> str | None:
    """Run the kit's ``build.py`` in a subprocess (in the kit's folder, this Python); None, or why it failed."""
    print(f"sglang: building SGLang's CPU attention kit ({kit}/build.py, about 60 s, cached in {build_dir()}) ...",
          flush=True)
    try:
        proc = subprocess.run([sys.executable, "build.py"], cwd=kit, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"its build.py ran past {timeout_s:.0f} s"
    except OSError as e:
        return f"its build.py could not run ({e})"
    if proc.returncode != 0:
        tail = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        return f"its build.py exited with {proc.returncode}: {tail[-1] if tail else 'no output'}"
    return None


def load_kit(path: str | None, *, build: bool = True, timeout_s: float = BUILD_TIMEOUT_S) -> Kit:
    """The kit's decode op: already registered, or its built library (``build_dir()``/``sgl_cpu_attn.so``, newer
    than the kit's sources), or built now by its ``build.py`` (with ``build``). Never raises for a missing or broken
    kit: ``Kit.ops`` is None and ``Kit.line`` says why."""
    skip = "sglang column skipped: "
    if path is None:
        return Kit(None, skip + f"no kit (give --sglang-kit PATH or set ${KIT_ENV}; {DEFAULT_KIT} does not exist "
                               "from here)")
    kit = os.path.abspath(path)
    if not os.path.isfile(os.path.join(kit, "build.py")):
        why = "does not exist" if not os.path.exists(kit) else "has no build.py"
        return Kit(None, skip + f"SGLang kit {path!r} {why}", path)
    ops = _registered()
    if ops is not None:
        return Kit(ops, f"sglang: SGLang's decode_attention_cpu (already loaded) from the kit at {kit}", kit)
    library = os.path.join(build_dir(), LIBRARY)
    built_now = None
    if not _fresh(library, kit):
        if not build:
            return Kit(None, skip + f"the kit at {kit} is not built ({library} missing or older than its sources)",
                       kit)
        start = time.perf_counter()
        failed = _build(kit, timeout_s)
        if failed is not None:
            return Kit(None, skip + f"the kit at {kit} did not build: {failed}", kit)
        built_now = time.perf_counter() - start
    if not os.path.isfile(library):
        return Kit(None, skip + f"the kit's build left no {library}", kit)
    try:
        torch.ops.load_library(library)
    except (OSError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return Kit(None, skip + f"{library} does not load into this torch {torch.__version__}: {first}", kit)
    ops = _registered()
    if ops is None:
        return Kit(None, skip + f"{library} loaded but registers no {NAMESPACE}.decode_attention_cpu", kit)
    how = f"built now in {built_now:.0f} s" if built_now is not None else "built before"
    return Kit(ops, f"sglang: SGLang's decode_attention_cpu from the kit at {kit} ({library}, {how})", kit, library)


def supports(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> str | None:
    """None where the kernel takes this query and cache dtype, else why not (one phrase)."""
    if q_dtype not in DTYPES:
        return f"SGLang's CPU decode kernel has no {str(q_dtype).replace('torch.', '')} (bf16 and fp16 only)"
    if kv_dtype != q_dtype:
        return ("SGLang's CPU decode kernel (these sources) reads the cache in the query's dtype (no "
                f"{str(kv_dtype).replace('torch.', '')} cache, no fp8 scales)")
    return None


def decode_fn(ops, q, k_cache, v_cache, rows, seq_lens, scale: float):
    """A callable ``(req_to_token) -> [bs, Hq, Dv]`` running SGLang's decode over the caches, as its intel_amx
    backend calls it: ``attn_logits`` once per step (here: per case), the output per call, no K/V write (key and
    value None). MLA where V is a view of K's storage with one KV head and Dk = Dv + 64 (the kernel decides)."""
    bs, hq, dv = q.shape[0], q.shape[1], v_cache.shape[-1]
    attn_logits = torch.empty(bs, hq, NUM_KV_SPLITS, dv + 1, dtype=torch.float32)
    loc = torch.zeros(bs, dtype=torch.int64)  # unused without key/value
    rows = rows.to(torch.int64)
    seq_lens = seq_lens.to(torch.int64)
    op = ops.decode_attention_cpu

    def run(req_to_token):
        out = q.new_empty(bs, hq, dv)
        op(q, k_cache, v_cache, out, None, None, loc, attn_logits, req_to_token, rows, seq_lens, scale, 0.0, False,
           0, None, None)
        return out

    return run
