"""The CPU decode/verify kernel in C++ (``csrc/``), built on first use (``build``), called as a torch op: each
block's partial softmax read from the paged cache in place and merged per row in one call (docs/design.md).

``kernel_path`` says which of its ``PATHS`` a call takes and why; the op checks every tensor and the kernel every
index it reads (a ValueError naming the argument). ``COMPILED_ATTN_ISA`` caps the build's level (``ISA_LEVELS``),
``COMPILED_ATTN_NATIVE=0`` turns it off; where the build fails, one warning and the portable matmul form.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch

from ...compile_policy import opaque_op

# the build's names re-exported: callers and tests find them here
from .build import CACHE_ENV as CACHE_ENV
from .build import SOURCE as SOURCE
from .build import KernelLibrary, _cpu_flags, build, load
from .build import cache_dir as cache_dir

ENABLE_ENV = "COMPILED_ATTN_NATIVE"
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
_KIND_NAMES = ", ".join(str(dtype).removeprefix("torch.") for dtype in KINDS)


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


@functools.cache
def library() -> KernelLibrary | None:
    """This process's kernel library, built on the first call for ``COMPILED_ATTN_ISA``'s level (default the whole
    CPU); None when turned off (``COMPILED_ATTN_NATIVE=0``) or when the build failed (one warning says why). A bad
    ``COMPILED_ATTN_ISA`` is a ValueError (``requested_isa``)."""
    isa = requested_isa()
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return None
    return library_for(isa)


@functools.cache
def library_for(isa: str | None) -> KernelLibrary | None:
    """The kernel built for ``isa`` (an ``ISA_LEVELS`` name, or None: the whole CPU), or None (with a warning)
    where the build fails. The tests run each level the machine supports through it."""
    try:
        return load(build(march=ISA_LEVELS[isa][0] if isa else "native"))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"compiled_attn: the C++ decode kernel is not available, the CPU decode uses the portable "
                      f"matmul form ({e})", RuntimeWarning, stacklevel=2)
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
def _isa_bits(lib: KernelLibrary) -> int:
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


def _ops(lib: KernelLibrary | None):
    """The torch op of ``library()``'s build (``build.KernelLibrary.ops``), or RuntimeError where there is
    none."""
    if lib is None:
        raise RuntimeError("the C++ decode kernel is not built here (COMPILED_ATTN_NATIVE=0, or the build failed): "
                           "see native_refusal")
    return lib.ops


def _rows_per_kv_head(q: torch.Tensor, k_cache: torch.Tensor, tokens: int = 1) -> int:
    """G of a token-major q [rows * tokens, Hq, D] (0 where the shapes do not fit: the op then names them)."""
    ok = q.dim() == 3 and k_cache.dim() == 3 and k_cache.shape[1] > 0
    return tokens * (q.shape[1] // k_cache.shape[1]) if ok else 0


# a torch op rather than one ctypes struct: its schema checks the types, and the call costs less than ctypes'
@opaque_op
def native_decode_blocks(q: torch.Tensor, block_req: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float, v_scale: float,
                         logit_cap: float, num_rows: int, sinks: torch.Tensor | None = None,
                         q_bf16_scale: float = 0.0, draft_slots: torch.Tensor | None = None,
                         draft_mask: torch.Tensor | None = None, tokens: int = 1, path: str = "") -> torch.Tensor:
    """The whole decode by the C++ kernel: the partial softmax of each block whose ``block_req`` is below
    ``num_rows`` (a bucket's unused blocks are skipped) and ``decode.merge_blocks`` of them, in one call.

    q: [num_rows * tokens, Hq, D] float32, bf16 or fp16, token-major (row r's ``tokens`` queries at ``r * tokens``;
    decode: tokens = 1); a score is q . K times k_scale (the softmax scale rides on it). block_req: [n] int64, each
    block's row; slots: [n, B] int64, each position's KV slot (``DecodeIndex.slots``); valid: [n, B] bool; k_cache:
    [num_slots, Hkv, D], v_cache: [num_slots, Hkv, Dv] (a ``KINDS`` dtype, last dim contiguous); k_scale, v_scale:
    dequantisation scales (1.0: none); logit_cap: soft-cap (0.0: none); sinks: [Hkv, G] float32 logits or None
    (G = tokens x group); q_bf16_scale: ``bf16_query_scale``'s; path: one of ``PATHS``, "" for ``kernel_path``'s.
    Verify's draft keys join each row's merge: draft_slots [>= num_rows, nd] int64, their slots; draft_mask
    [>= num_rows, tokens, nd] bool, which of them each query token sees.
    -> [num_rows * tokens, Hq, Dv] in q.dtype (zeros for a row with no key). A slot outside the cache at a position
    read, a negative block row, tensors that do not fit or a path that does not serve the call: ValueError.
    Why one op: the blocks are merged straight from the kernel's scratch, where ATen ops would write them and read
    them back through five ops; the same holds for the draft keys and for the queries' and output's layouts."""
    ops = _ops(library())
    g = _rows_per_kv_head(q, k_cache, tokens)
    number = _path_number(path, k_cache, q_bf16_scale, g, q.shape[-1], v_cache.shape[-1])
    return ops.decode_blocks(q, block_req, slots, valid, k_cache, v_cache, k_scale, v_scale, logit_cap,
                             num_rows, sinks, q_bf16_scale, draft_slots, draft_mask, tokens, number)


@torch.library.register_fake(native_decode_blocks)
def _native_decode_blocks_fake(q, block_req, slots, valid, k_cache, v_cache, k_scale, v_scale, logit_cap,
                               num_rows, sinks=None, q_bf16_scale=0.0, draft_slots=None, draft_mask=None, tokens=1,
                               path=""):
    return q.new_empty((q.shape[0], q.shape[1], v_cache.shape[2]))
