"""The CPU decode kernel in C++ (``csrc/block_partials.cpp``): each block's partial softmax, reading K/V in place
from the paged cache, built with this machine's compiler on first use and called through ``ctypes``.

Why a hand-written kernel: the decode's work is a few small dot products per cached key row, and what bounds it
is how the rows are read. Inductor's loops for the same computation (``decode_fused.fused_block_partials``) read
each row once per query row, reduce every dot product to a scalar on its own and issue no prefetches, so they are
compute-bound at several times the time of one pass over the cache bytes, and a bf16 cache saves almost
nothing over float32. This kernel scores all query rows of a head against each key row while the row is in
registers, converts bf16/fp16/float8 there, prefetches the rows a few positions ahead and runs the softmax and
the V sum vectorised. It computes exactly what ``fused_block_partials`` computes (its outputs feed the same
``merge_blocks``), which stays as the fallback and as the reference form in tests. On a CPU with AMX, a bf16 query
with 8 or more query rows per KV head (GQA's groups times verify's draft tokens) runs as bf16 tile products
(``csrc/tile_blocks.h``, ``tiles_serve``): its time then grows little with the rows; without tiles, 16 rows or a
multiple take outer products in float32 (``csrc/wide_blocks.h``, ``wide_serves``).

Which path runs is the caller's choice (``kernel_path``, called by ``forms.choose_form``); the kernel refuses a
path this build or the call's shapes cannot run, so the choice and the kernel never disagree silently.

Build: ``$CXX`` (default ``g++``) ``-O3 -march=native -fopenmp`` into a cache folder (``COMPILED_ATTN_CACHE_DIR``,
default ``~/.cache/compiled_attn``), keyed by the source, the compiler, the flags and the CPU's feature flags, so
a second process loads it at once. ``COMPILED_ATTN_ISA=avx2|avx512|avx512_bf16|amx`` builds for that level
instead of the whole CPU (``ISA_LEVELS``; refused above what the CPU has): how a machine runs and tests the paths
an older CPU takes. The OpenMP runtime is the one PyTorch already loaded (same soname), and each call runs on
``torch.get_num_threads()`` threads. ``COMPILED_ATTN_NATIVE=0`` turns the kernel off; a machine where the build
fails (no compiler) gets one warning and the traced form.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from .opaque import opaque_op

SOURCE = Path(__file__).parent / "csrc" / "block_partials.cpp"
ENABLE_ENV = "COMPILED_ATTN_NATIVE"
CACHE_ENV = "COMPILED_ATTN_CACHE_DIR"
ISA_ENV = "COMPILED_ATTN_ISA"
#: the instruction-set levels a build can be capped at, lowest first: the ``-march`` each is built with and the
#: ``/proc/cpuinfo`` flags a CPU needs for it beyond the level before (each level includes those below it)
ISA_LEVELS = {
    "avx2": ("haswell", ("avx2", "fma", "f16c", "bmi2")),
    "avx512": ("skylake-avx512", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd")),
    "avx512_bf16": ("cooperlake", ("avx512_bf16", "avx512_vnni")),
    "amx": ("sapphirerapids", ("amx_tile", "amx_bf16")),
}
#: ``ca_isa()``'s bits: what a build runs
ISA_AVX2, ISA_AVX512, ISA_AVX512_BF16, ISA_AMX, ISA_TILES_USABLE = 1, 2, 4, 8, 16
#: the kernel's paths by the number it takes (``KernelPath`` in ``csrc/kernel_math.h``)
PATHS = ("vector", "vector_bf16", "wide", "tile")
#: the cache dtypes the kernel reads, by the kind number it takes
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_ARGTYPES = [ctypes.c_int, *[_PTR] * 6, *[_I64] * 11, _F32, _F32, _F32, _PTR, _PTR, _PTR, ctypes.c_int, _I64, _PTR,
             _PTR, _I64, _F32, _PTR, _PTR, _I64, _I64, ctypes.c_int, _I64, ctypes.c_int, ctypes.c_int, _I64]
_KIND_NAMES = ", ".join(str(dtype).removeprefix("torch.") for dtype in KINDS)
#: the query dtypes the merged op reads as they are, by the kind number it takes (its output: float32 or bfloat16)
QUERY_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def cache_dir() -> Path:
    """Where built kernels are kept: ``$COMPILED_ATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/compiled_attn``, else
    ``~/.cache/compiled_attn``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "compiled_attn"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def cpu_isa_levels(flags: str | None = None) -> list[str]:
    """The ``ISA_LEVELS`` this CPU runs, lowest first (``flags``: a ``/proc/cpuinfo`` flags line; default this
    machine's). Empty on a CPU below AVX2 or not x86."""
    have = set((_cpu_flags() if flags is None else flags).replace(":", " ").split())
    levels = []
    for name, (_, needs) in ISA_LEVELS.items():
        if not have.issuperset(needs):
            break
        levels.append(name)
    return levels


def requested_isa(value: str | None = None) -> str | None:
    """The level ``COMPILED_ATTN_ISA`` (or ``value``) asks for; None (unset, empty or ``native``) builds for the
    whole CPU. ValueError naming the variable for an unknown level or one above what this CPU supports."""
    value = os.environ.get(ISA_ENV, "") if value is None else value
    if value in ("", "native"):
        return None
    levels = cpu_isa_levels()
    supported = ", ".join(levels) or "none of them"
    if value not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV}={value!r} is not a level: one of {', '.join(ISA_LEVELS)} or native (this CPU "
                         f"supports: {supported})")
    if value not in levels:
        raise ValueError(f"{ISA_ENV}={value!r} is above what this CPU supports ({supported}): a build for it would "
                         "not run here")
    return value


def build(source: Path = SOURCE, out_dir: Path | None = None, *, cxx: str | None = None,
          march: str = "native") -> Path:
    """Compile ``source`` into a shared library in ``out_dir`` (default ``cache_dir()``) unless an identical
    build is there; returns its path. Raises ``RuntimeError`` (with the compiler's message) when it cannot."""
    cxx = cxx or os.environ.get("CXX") or "g++"
    exe = shutil.which(cxx)
    if exe is None:
        raise RuntimeError(f"no C++ compiler: {cxx!r} is not on PATH (set CXX)")
    flags = ["-O3", f"-march={march}", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    # the headers beside the source are part of it (it includes them by name)
    texts = [source.read_text(), *(h.read_text() for h in sorted(source.parent.glob("*.h")))]
    key = hashlib.sha256("\0".join([*texts, exe, version, *flags, _cpu_flags()]).encode()).hexdigest()
    out_dir = Path(out_dir) if out_dir is not None else cache_dir()
    out = out_dir / f"{source.stem}-{march}-{key[:16]}.so"
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    # built under a name of its own, then renamed into place: a process starting beside this one never loads a
    # half-written file, and two building at once both end with a whole one
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([exe, *flags, "-o", tmp, str(source)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed on {source.name}:\n{done.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load(path: Path) -> ctypes.CDLL:
    """The built library with its entry point's signature set (after ``import torch``: its OpenMP is reused)."""
    lib = ctypes.CDLL(str(path))
    lib.ca_block_partials.restype = ctypes.c_int
    lib.ca_block_partials.argtypes = _ARGTYPES
    lib.ca_isa.restype = ctypes.c_int
    lib.ca_isa.argtypes = []
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """This process's kernel library, built on the first call for ``COMPILED_ATTN_ISA``'s level (default the whole
    CPU); None when turned off (``COMPILED_ATTN_NATIVE=0``) or when the build failed (one warning says why). A bad
    ``COMPILED_ATTN_ISA`` is a ValueError (``requested_isa``)."""
    isa = requested_isa()
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return None
    return library_for(isa)


@functools.cache
def library_for(isa: str | None) -> ctypes.CDLL | None:
    """The kernel built for ``isa`` (an ``ISA_LEVELS`` name, or None: the whole CPU), or None (with a warning)
    where the build fails. The tests run each level the machine supports through it."""
    try:
        return load(build(march=ISA_LEVELS[isa][0] if isa else "native"))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"compiled_attn: the C++ decode kernel is not available, the CPU decode uses the traced form "
                      f"({e})", RuntimeWarning, stacklevel=2)
        return None


def native_refusal(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str:
    """Why the kernel cannot serve a decode-like call, or "" where it can: it needs CPU tensors, one cache dtype
    it reads, head sizes that are multiples of 16, each cache row's last dim contiguous, and the library built."""
    if q.device.type != "cpu" or k_cache.device.type != "cpu":
        return f"not a CPU call ({q.device.type})"
    if k_cache.dtype not in KINDS or v_cache.dtype != k_cache.dtype:
        return f"caches {k_cache.dtype}/{v_cache.dtype}: the kernel reads one of {_KIND_NAMES} for both"
    # reasons name rules, not sizes: under torch.compile a size may be a symbol (text of it is no constant)
    if q.shape[-1] != k_cache.shape[-1] or k_cache.shape[-1] % 16 or v_cache.shape[-1] % 16:
        return "head sizes not equal multiples of 16"
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        return "a cache row's last dim is not contiguous"
    if not native_available():
        return "the C++ kernel is not built here (off, or no compiler)"
    return ""


def native_fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel serves a decode-like call (``native_refusal`` gives the reason where not)."""
    return not native_refusal(q, k_cache, v_cache)


#: caches whose values bfloat16 holds exactly: with a bf16 query the kernel may take its tile path
TILE_KV_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def bf16_query_scale(q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> float:
    """The kernel's ``q_bf16_scale`` for its queries q times ``scale`` (``scaled_queries(q, ..., scale)``, or q
    itself with scale 1, as ``native_decode_blocks`` takes it): ``scale`` when q is bf16 and the
    cache one of ``TILE_KV_DTYPES``, so the kernel may take the query back to bf16 exactly and run the block as bf16
    tile products (AMX, where the CPU has it: ``csrc/tile_blocks.h``; the softmax weights rounded to bf16 for the V
    sum, float32 sums), else 0.0 (float32 products)."""
    return float(scale) if q.dtype == torch.bfloat16 and k_cache.dtype in TILE_KV_DTYPES else 0.0


@torch.compiler.assume_constant_result
def kernel_isa_bits() -> int:
    """What this process's kernel build runs (``ca_isa``: the ``ISA_*`` bits), 0 without one. A constant to
    ``torch.compile``."""
    lib = library()
    return 0 if lib is None else _isa_bits(lib)


@functools.cache
def _isa_bits(lib: ctypes.CDLL) -> int:
    return lib.ca_isa()  # asked once per build: a ctypes call is microseconds, on every call's choice


def native_tiles_available() -> bool:
    """Whether the kernel has its tile path here: built for a CPU with AMX (bf16) and the OS lets this process use
    the tile registers."""
    return bool(kernel_isa_bits() & ISA_TILES_USABLE)


def path_fits(path: str, kv_dtype: torch.dtype, q_bf16: bool, rows_per_kv_head: int, d: int, dv: int,
              isa_bits: int) -> bool:
    """Whether a kernel built with ``isa_bits`` runs ``path`` for a call with ``rows_per_kv_head`` query rows per KV
    head, head sizes d/dv and a ``kv_dtype`` cache; ``q_bf16``: the query is bf16 (``bf16_query_scale`` > 0). The
    kernel checks the same conditions (``path_fits`` in ``csrc/block_partials.cpp``) and refuses any other."""
    g, bf16_exact = rows_per_kv_head, q_bf16 and kv_dtype in TILE_KV_DTYPES
    if path == "tile":  # 8 rows at least: below that the vector path is as fast
        return (bool(isa_bits & ISA_TILES_USABLE) and bf16_exact and d % 32 == 0 and dv % 32 == 0 and g >= 8
                and (g <= 16 or g % 16 == 0))
    if path == "wide":  # the rows of a float32 vector
        return g >= 16 and g % 16 == 0
    if path == "vector_bf16":  # pairs of bf16 products: a compiled-in head size, 4 rows at a time
        return bool(isa_bits & ISA_AVX512_BF16) and bf16_exact and d in (64, 128, 256) and g % 4 == 0
    return path == "vector"


def kernel_path(kv_dtype: torch.dtype, q_bf16: bool, rows_per_kv_head: int, d: int, dv: int,
                isa_bits: int | None = None) -> tuple[str, str]:
    """The path the kernel runs a call on (the first of tile, wide, vector_bf16, vector that ``path_fits``) and
    why: ``(path, reason)``. isa_bits: the build's (default this process's, ``kernel_isa_bits``)."""
    bits = kernel_isa_bits() if isa_bits is None else isa_bits
    args = (kv_dtype, q_bf16, rows_per_kv_head, d, dv, bits)
    path = next(p for p in ("tile", "wide", "vector_bf16", "vector") if path_fits(p, *args))
    # the reasons name rules, not sizes: under torch.compile the rows may be a symbol (shared by every draft length
    # of a dynamic compile), and text of a symbol is no constant
    kv = str(kv_dtype).removeprefix("torch.")
    if path == "tile":
        return path, f"bf16 query and {kv} cache, 8-16 rows per KV head or a multiple of 16, AMX tiles usable"
    if path == "wide":
        no_tiles = "" if bits & ISA_TILES_USABLE else " (no AMX tiles in this build)"
        return path, f"rows per KV head a multiple of 16: float32 outer products{no_tiles}"
    if path == "vector_bf16":
        return path, (f"bf16 query and {kv} cache, head size 64, 128 or 256, rows per KV head a multiple of 4: "
                      "AVX512-BF16 pair products")
    no_pairs = "" if bits & ISA_AVX512_BF16 else " (no AVX512-BF16 in this build)"
    return path, f"float32 products{no_pairs}"


@torch.compiler.assume_constant_result
def native_available() -> bool:
    """``library() is not None``, as a constant to ``torch.compile`` (which cannot trace a build or ctypes)."""
    return library() is not None


def _path_number(path: str, k_cache: torch.Tensor, q_bf16_scale: float, g: int, d: int, dv: int) -> int:
    """The kernel's number for ``path`` ("" picks ``kernel_path``'s), or ValueError naming an unknown one."""
    if not path:
        path = kernel_path(k_cache.dtype, q_bf16_scale > 0, g, d, dv)[0]
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS} (or empty: the kernel_path choice), got {path!r}")
    return PATHS.index(path)


def _run(q, block_req, runs, valid, unit, k_cache, v_cache, k_scale, v_scale, logit_cap, m, lsum, o,
         num_rows=0, sinks=None, out=None, q_bf16_scale=0.0, draft_slots=None, draft_mask=None, tokens=1,
         path="") -> None:
    """One call of the kernel (``ca_block_partials``) on checked, contiguous tensors: q [rows, Hkv, G, D] float32
    (tokens 1, the partials form) or, with out, token-major [num_rows * tokens, Hq, D] as ``native_decode_blocks``';
    path: one of ``PATHS`` ("": ``kernel_path``'s)."""
    n, hkv, d, dv = block_req.shape[0], k_cache.shape[1], q.shape[-1], v_cache.shape[2]
    g = q.shape[2] if q.dim() == 4 else tokens * q.shape[1] // hkv
    path_number = _path_number(path, k_cache, q_bf16_scale, g, d, dv)
    if n == 0 and draft_slots is None:
        return
    nd, mask_tokens = (0, 0) if draft_slots is None else (draft_slots.shape[1], draft_mask.shape[1])
    rc = library().ca_block_partials(
        KINDS[k_cache.dtype], q.data_ptr(), block_req.data_ptr(), runs.data_ptr(), valid.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), n, hkv, g, d, dv, valid.shape[1], unit, k_scale, v_scale, logit_cap,
        m.data_ptr(), lsum.data_ptr(), o.data_ptr(), torch.get_num_threads(), num_rows,
        None if sinks is None else sinks.data_ptr(), None if out is None else out.data_ptr(),
        min(k_cache.shape[0], v_cache.shape[0]), q_bf16_scale, None if draft_slots is None else draft_slots.data_ptr(),
        None if draft_mask is None else draft_mask.data_ptr(), nd, mask_tokens, QUERY_KINDS[q.dtype], tokens,
        int(out is not None and out.dtype == torch.bfloat16), path_number, q.shape[0])
    if rc == 3:  # checked in the kernel: a bad table must never become a read outside the cache
        raise ValueError(f"native decode kernel: a valid position's KV slot lies outside the cache (num_slots "
                         f"{min(k_cache.shape[0], v_cache.shape[0])}): check req_to_token and the planned block table")
    if rc == 5:
        raise ValueError(f"native decode kernel: block_req holds a row outside [0, {q.shape[0]}) (q's rows"
                         f"{'' if out is None else ', or past them for an unused block'}): check the block table")
    if rc == 4:
        raise ValueError(f"native decode kernel: path {PATHS[path_number]!r} does not serve this call (cache "
                         f"{k_cache.dtype}, {g} query rows per KV head, head sizes {d}/{dv}, q_bf16_scale "
                         f"{q_bf16_scale}) in this build (ISA bits {library().ca_isa()}): see kernel_path")
    if rc != 0:
        raise ValueError(f"native decode kernel: head sizes {d}/{dv} must be multiples of 16, the cache a dtype "
                         f"of {list(KINDS)} and the query one of {list(QUERY_KINDS)}")


def _check_blocks(block_req: torch.Tensor, runs: torch.Tensor, valid: torch.Tensor, unit: int) -> None:
    """The block table's tensors as the kernel reads them (``DecodeIndex``'s), or ValueError naming the one that
    does not fit: block_req [n] int64, runs [n, B // unit] int64, valid [n, B] bool, B a multiple of unit."""
    n = block_req.shape[0] if block_req.dim() == 1 else -1
    if block_req.dtype != torch.int64 or n < 0:
        raise ValueError(f"block_req must be int64 [n], got {block_req.dtype} {tuple(block_req.shape)}")
    if valid.dtype != torch.bool or valid.dim() != 2 or valid.shape[0] != n:
        raise ValueError(f"valid must be bool [n={n}, B], got {valid.dtype} {tuple(valid.shape)}")
    b = valid.shape[1]
    if not isinstance(unit, int) or unit < 1 or b % unit:
        raise ValueError(f"unit must be an int >= 1 dividing the block size {b}, got {unit!r}")
    if runs.dtype != torch.int64 or tuple(runs.shape) != (n, b // unit):
        raise ValueError(f"runs must be int64 [n={n}, B // unit={b // unit}], got {runs.dtype} {tuple(runs.shape)}")


def _partials_like(like: torch.Tensor, n: int, hkv: int, g: int, dv: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised float32 m, lsum [n, Hkv, G] and o [n, Hkv, G, Dv] on ``like``'s device."""
    m, lsum = (like.new_empty((n, hkv, g), dtype=torch.float32) for _ in range(2))
    return m, lsum, like.new_empty((n, hkv, g, dv), dtype=torch.float32)


@opaque_op
def native_block_partials(qs: torch.Tensor, block_req: torch.Tensor, runs: torch.Tensor, valid: torch.Tensor,
                          unit: int, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float, v_scale: float,
                          logit_cap: float, q_bf16_scale: float = 0.0, path: str = ""
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each block's partial softmax (``decode_fused.fused_block_partials``' outputs), by the C++ kernel.

    qs: [rows, Hkv, G, D] float32 (a score is qs . K times k_scale: scaled queries, or unscaled ones with the
    softmax scale in k_scale); block_req: [n] int64, the row of each block (every entry < rows);
    runs: [n, B // unit] int64 (``DecodeIndex.runs``); valid: [n, B] bool; k_cache: [num_slots, Hkv, D],
    v_cache: [num_slots, Hkv, Dv] (a ``KINDS`` dtype, last dim contiguous); k_scale, v_scale: dequantisation
    scales (1.0 for none); logit_cap: soft-cap, 0.0 for none; q_bf16_scale: ``bf16_query_scale``'s (0.0: the
    products in float32 on the vector path); path: one of ``PATHS``, "" for ``kernel_path``'s (a path that does not
    serve the call is a ValueError).
    returns m, lsum: [n, Hkv, G] float32 and o: [n, Hkv, G, Dv] float32.
    Invalid positions are never read; a valid position whose slot lies outside the cache is a ValueError (checked
    in the kernel, which reads nothing there).
    """
    _check_blocks(block_req, runs, valid, unit)
    qs, block_req, runs, valid = qs.contiguous(), block_req.contiguous(), runs.contiguous(), valid.contiguous()
    m, lsum, o = _partials_like(qs, block_req.shape[0], *qs.shape[1:3], v_cache.shape[2])
    _run(qs, block_req, runs, valid, unit, k_cache, v_cache, k_scale, v_scale, logit_cap, m, lsum, o,
         q_bf16_scale=q_bf16_scale, path=path)
    return m, lsum, o


@torch.library.register_fake(native_block_partials)
def _native_block_partials_fake(qs, block_req, runs, valid, unit, k_cache, v_cache, k_scale, v_scale, logit_cap,
                                q_bf16_scale=0.0, path=""):
    return _partials_like(qs, block_req.shape[0], *qs.shape[1:3], v_cache.shape[2])


def _check_draft(g, num_rows, draft_slots, draft_mask):
    """The draft keys' tensors as the kernel reads them (contiguous; the mask as bytes), or ValueError (g: query
    rows per KV head)."""
    if draft_slots is None and draft_mask is None:
        return None, None
    if draft_slots is None or draft_mask is None:
        raise ValueError("draft_slots and draft_mask go together")
    if draft_slots.dtype != torch.int64 or draft_slots.dim() != 2 or draft_slots.shape[0] < num_rows:
        raise ValueError(f"draft_slots must be int64 [>= num_rows={num_rows}, nd], got {draft_slots.dtype} "
                         f"{tuple(draft_slots.shape)}")
    nd = draft_slots.shape[1]
    if (draft_mask.dim() != 3 or draft_mask.shape[0] < num_rows or draft_mask.shape[2] != nd or draft_mask.shape[1] < 1
            or g % draft_mask.shape[1]):
        raise ValueError(f"draft_mask must be [>= num_rows={num_rows}, tokens dividing G={g}, nd={nd}], got "
                         f"{tuple(draft_mask.shape)}")
    return draft_slots.contiguous(), draft_mask.to(torch.bool).contiguous()


def _check_queries(q, num_rows, tokens, hkv):
    """q's query rows per KV head (G = tokens x group), or ValueError."""
    if q.dtype not in QUERY_KINDS or q.dim() != 3 or q.shape[0] != num_rows * tokens or q.shape[1] % hkv:
        raise ValueError(f"q must be [num_rows * tokens = {num_rows * tokens}, Hq (a multiple of Hkv={hkv}), D] in "
                         f"one of {list(QUERY_KINDS)}, got {q.dtype} {tuple(q.shape)}")
    return tokens * (q.shape[1] // hkv)


@opaque_op
def native_decode_blocks(q: torch.Tensor, block_req: torch.Tensor, runs: torch.Tensor, valid: torch.Tensor,
                         unit: int, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float, v_scale: float,
                         logit_cap: float, num_rows: int, sinks: torch.Tensor | None = None,
                         q_bf16_scale: float = 0.0, draft_slots: torch.Tensor | None = None,
                         draft_mask: torch.Tensor | None = None, tokens: int = 1, path: str = "") -> torch.Tensor:
    """The whole decode by the C++ kernel: ``native_block_partials`` over the blocks whose ``block_req`` is below
    ``num_rows`` (a bucket's unused blocks are skipped, no host read needed) and ``decode.merge_blocks`` of them,
    in one call. q: [num_rows * tokens, Hq, D] float32, bf16 or fp16, token-major (row r's ``tokens`` query
    tokens at ``r * tokens ..``; decode: tokens = 1), as the model holds it: the kernel groups a row's tokens by KV
    head itself, its rows ``t * group + g`` of KV head h being token t's head ``h * group + g`` (a score is q . K
    times k_scale: the softmax scale rides on k_scale); other arguments as ``native_block_partials``; sinks:
    [Hkv, G] float32 logits or None (G = tokens x group).
    Verify's draft block joins each row's merge: draft_slots [>= num_rows, nd] int64, the KV slots of a row's nd
    keys beyond its blocks (its draft tokens', after a window's edge keys), draft_mask [>= num_rows, tokens, nd]
    bool, which of them each of its query tokens sees (query row i of a KV head is token i // group); path: as
    ``native_block_partials``'.
    -> [num_rows * tokens, Hq, Dv] in q.dtype, token-major as q (zeros for a row with no key).

    Why one op: the merge as ATen ops was a third of this backend's attention time in a live bs-8 step (its block
    outputs written, then read by a scatter-max, an exp, two index_adds and a division); here each row's blocks are
    merged straight from the kernel's scratch, and a step makes one op call instead of four. The same for verify's
    draft block (as ATen ops: gathers of the draft keys, two batched matmuls and the join), and for the queries'
    and the output's layouts (a grouping copy before the kernel and a transposing cast after it)."""
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    g = _check_queries(q, num_rows, tokens, hkv)
    _check_blocks(block_req, runs, valid, unit)
    if sinks is not None and sinks.numel() != hkv * g:
        raise ValueError(f"sinks must hold Hkv x G = {hkv * g} logits, got {tuple(sinks.shape)}")
    sinks = None if sinks is None else sinks.float().contiguous()
    draft_slots, draft_mask = _check_draft(g, num_rows, draft_slots, draft_mask)
    q, block_req, runs, valid = q.contiguous(), block_req.contiguous(), runs.contiguous(), valid.contiguous()
    # the kernel writes float32 or bfloat16 (rounded as torch rounds); a float16 result is cast from float32
    out = q.new_empty((*q.shape[:2], dv), dtype=torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32)
    if block_req.shape[0] == 0 and draft_slots is None:  # the kernel is not called: nothing to merge
        return out.zero_().to(q.dtype)
    none = q.new_empty(0, dtype=torch.float32)  # the merged form keeps its partials in scratch of its own
    _run(q, block_req, runs, valid, unit, k_cache, v_cache, k_scale, v_scale, logit_cap, none, none, none, num_rows,
         sinks, out, q_bf16_scale, draft_slots, draft_mask, tokens, path)
    return out.to(q.dtype)


@torch.library.register_fake(native_decode_blocks)
def _native_decode_blocks_fake(q, block_req, runs, valid, unit, k_cache, v_cache, k_scale, v_scale, logit_cap,
                               num_rows, sinks=None, q_bf16_scale=0.0, draft_slots=None, draft_mask=None, tokens=1,
                               path=""):
    return q.new_empty((q.shape[0], q.shape[1], v_cache.shape[2]))
