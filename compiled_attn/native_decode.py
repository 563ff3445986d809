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

Build: ``$CXX`` (default ``g++``) ``-O3 -march=native -fopenmp`` into a cache folder (``COMPILED_ATTN_CACHE_DIR``,
default ``~/.cache/compiled_attn``), keyed by the source, the compiler, the flags and the CPU's feature flags, so
a second process loads it at once. The OpenMP runtime is the one PyTorch already loaded (same soname), and each
call runs on ``torch.get_num_threads()`` threads. ``COMPILED_ATTN_NATIVE=0`` turns the kernel off; a machine where
the build fails (no compiler) gets one warning and the traced form.
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
#: the cache dtypes the kernel reads, by the kind number it takes
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_ARGTYPES = [ctypes.c_int, *[_PTR] * 6, *[_I64] * 11, _F32, _F32, _F32, _PTR, _PTR, _PTR, ctypes.c_int, _I64, _PTR,
             _PTR, _I64, _F32, _PTR, _PTR, _I64, _I64, ctypes.c_int, _I64, ctypes.c_int]
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
    out = out_dir / f"{source.stem}-{key[:16]}.so"
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
    lib.ca_tiles_available.restype = ctypes.c_int
    lib.ca_tiles_available.argtypes = []
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """This process's kernel library, built on the first call; None when turned off (``COMPILED_ATTN_NATIVE=0``)
    or when the build failed (one warning says why)."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return None
    try:
        return load(build())
    except (RuntimeError, OSError) as e:
        warnings.warn(f"compiled_attn: the C++ decode kernel is not available, the CPU decode uses the traced form "
                      f"({e})", RuntimeWarning, stacklevel=2)
        return None


def native_fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel serves a decode-like call: CPU tensors, one cache dtype it reads, head sizes that are
    multiples of 16, each cache row's last dim contiguous, and the library available (built on the first call)."""
    return (q.device.type == "cpu" and k_cache.device.type == "cpu" and k_cache.dtype in KINDS
            and v_cache.dtype == k_cache.dtype and q.shape[-1] == k_cache.shape[-1]
            and k_cache.shape[-1] % 16 == 0 and v_cache.shape[-1] % 16 == 0
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and native_available())


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
def native_tiles_available() -> bool:
    """Whether the kernel has its tile path here: built for a CPU with AMX (bf16) and the OS lets this process use
    the tile registers. A constant to ``torch.compile``."""
    return library() is not None and library().ca_tiles_available() == 1


def tiles_serve(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows_per_kv_head: int) -> bool:
    """Whether the kernel's tile path serves a call with ``rows_per_kv_head`` query rows per KV head (the
    conditions of ``csrc/tile_blocks.h``: a bf16 query, a ``TILE_KV_DTYPES`` cache, head sizes multiples of 32, 8 to
    16 rows or a multiple of 16, tiles available). Where it does, the kernel's time grows little with the rows."""
    return (bf16_query_scale(q, k_cache, 1.0) > 0 and q.shape[-1] % 32 == 0 and v_cache.shape[-1] % 32 == 0
            and (8 <= rows_per_kv_head <= 16 or rows_per_kv_head % 16 == 0) and native_fits(q, k_cache, v_cache)
            and native_tiles_available())


def wide_serves(rows_per_kv_head: int) -> bool:
    """Whether the kernel's wide path (``csrc/wide_blocks.h``) serves ``rows_per_kv_head`` query rows per KV head
    where the tile path does not (any cache dtype, float32 products): a multiple of 16, the rows of a vector. Its
    time grows with the rows at the machine's FMA rate (outer products), not a dot product's."""
    return rows_per_kv_head >= 16 and rows_per_kv_head % 16 == 0


@torch.compiler.assume_constant_result
def native_available() -> bool:
    """``library() is not None``, as a constant to ``torch.compile`` (which cannot trace a build or ctypes)."""
    return library() is not None


def _run(q, block_req, runs, valid, unit, k_cache, v_cache, k_scale, v_scale, logit_cap, m, lsum, o,
         num_rows=0, sinks=None, out=None, q_bf16_scale=0.0, draft_slots=None, draft_mask=None, tokens=1) -> None:
    """One call of the kernel (``ca_block_partials``) on checked, contiguous tensors: q [rows, Hkv, G, D] float32
    (tokens 1, the partials form) or, with out, token-major [num_rows * tokens, Hq, D] as ``native_decode_blocks``'."""
    n, hkv, d, dv = block_req.shape[0], k_cache.shape[1], q.shape[-1], v_cache.shape[2]
    g = q.shape[2] if q.dim() == 4 else tokens * q.shape[1] // hkv
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
        int(out is not None and out.dtype == torch.bfloat16))
    if rc == 3:  # checked in the kernel: a bad table must never become a read outside the cache
        raise ValueError(f"native decode kernel: a valid position's KV slot lies outside the cache (num_slots "
                         f"{min(k_cache.shape[0], v_cache.shape[0])}): check req_to_token and the planned block table")
    if rc != 0:
        raise ValueError(f"native decode kernel: head sizes {d}/{dv} must be multiples of 16, the cache a dtype "
                         f"of {list(KINDS)} and the query one of {list(QUERY_KINDS)}")


def _partials_like(like: torch.Tensor, n: int, hkv: int, g: int, dv: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised float32 m, lsum [n, Hkv, G] and o [n, Hkv, G, Dv] on ``like``'s device."""
    m, lsum = (like.new_empty((n, hkv, g), dtype=torch.float32) for _ in range(2))
    return m, lsum, like.new_empty((n, hkv, g, dv), dtype=torch.float32)


@opaque_op
def native_block_partials(qs: torch.Tensor, block_req: torch.Tensor, runs: torch.Tensor, valid: torch.Tensor,
                          unit: int, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float, v_scale: float,
                          logit_cap: float, q_bf16_scale: float = 0.0
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each block's partial softmax (``decode_fused.fused_block_partials``' outputs), by the C++ kernel.

    qs: [rows, Hkv, G, D] float32 (a score is qs . K times k_scale: scaled queries, or unscaled ones with the
    softmax scale in k_scale); block_req: [n] int64, the row of each block (every entry < rows);
    runs: [n, B // unit] int64 (``DecodeIndex.runs``); valid: [n, B] bool; k_cache: [num_slots, Hkv, D],
    v_cache: [num_slots, Hkv, Dv] (a ``KINDS`` dtype, last dim contiguous); k_scale, v_scale: dequantisation
    scales (1.0 for none); logit_cap: soft-cap, 0.0 for none; q_bf16_scale: ``bf16_query_scale``'s (0.0: the
    products in float32 on the vector path).
    returns m, lsum: [n, Hkv, G] float32 and o: [n, Hkv, G, Dv] float32.
    Invalid positions are never read; a valid position whose slot lies outside the cache is a ValueError (checked
    in the kernel, which reads nothing there).
    """
    qs, block_req, runs, valid = qs.contiguous(), block_req.contiguous(), runs.contiguous(), valid.contiguous()
    m, lsum, o = _partials_like(qs, block_req.shape[0], *qs.shape[1:3], v_cache.shape[2])
    _run(qs, block_req, runs, valid, unit, k_cache, v_cache, k_scale, v_scale, logit_cap, m, lsum, o,
         q_bf16_scale=q_bf16_scale)
    return m, lsum, o


@torch.library.register_fake(native_block_partials)
def _native_block_partials_fake(qs, block_req, runs, valid, unit, k_cache, v_cache, k_scale, v_scale, logit_cap,
                                q_bf16_scale=0.0):
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
                         draft_mask: torch.Tensor | None = None, tokens: int = 1) -> torch.Tensor:
    """The whole decode by the C++ kernel: ``native_block_partials`` over the blocks whose ``block_req`` is below
    ``num_rows`` (a bucket's unused blocks are skipped, no host read needed) and ``decode.merge_blocks`` of them,
    in one call. q: [num_rows * tokens, Hq, D] float32, bf16 or fp16, token-major (row r's ``tokens`` query
    tokens at ``r * tokens ..``; decode: tokens = 1), as the model holds it: the kernel groups a row's tokens by KV
    head itself, its rows ``t * group + g`` of KV head h being token t's head ``h * group + g`` (a score is q . K
    times k_scale: the softmax scale rides on k_scale); other arguments as ``native_block_partials``; sinks:
    [Hkv, G] float32 logits or None (G = tokens x group).
    Verify's draft block joins each row's merge: draft_slots [>= num_rows, nd] int64, the KV slots of a row's nd
    keys beyond its blocks (its draft tokens', after a window's edge keys), draft_mask [>= num_rows, tokens, nd]
    bool, which of them each of its query tokens sees (query row i of a KV head is token i // group).
    -> [num_rows * tokens, Hq, Dv] in q.dtype, token-major as q (zeros for a row with no key).

    Why one op: the merge as ATen ops was a third of this backend's attention time in a live bs-8 step (its block
    outputs written, then read by a scatter-max, an exp, two index_adds and a division); here each row's blocks are
    merged straight from the kernel's scratch, and a step makes one op call instead of four. The same for verify's
    draft block (as ATen ops: gathers of the draft keys, two batched matmuls and the join), and for the queries'
    and the output's layouts (a grouping copy before the kernel and a transposing cast after it)."""
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    g = _check_queries(q, num_rows, tokens, hkv)
    sinks = None if sinks is None else sinks.float().contiguous()
    draft_slots, draft_mask = _check_draft(g, num_rows, draft_slots, draft_mask)
    q, block_req, runs, valid = q.contiguous(), block_req.contiguous(), runs.contiguous(), valid.contiguous()
    # the kernel writes float32 or bfloat16 (rounded as torch rounds); a float16 result is cast from float32
    out = q.new_empty((*q.shape[:2], dv), dtype=torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32)
    if block_req.shape[0] == 0 and draft_slots is None:  # the kernel is not called: nothing to merge
        return out.zero_().to(q.dtype)
    none = q.new_empty(0, dtype=torch.float32)  # the merged form keeps its partials in scratch of its own
    _run(q, block_req, runs, valid, unit, k_cache, v_cache, k_scale, v_scale, logit_cap, none, none, none, num_rows,
         sinks, out, q_bf16_scale, draft_slots, draft_mask, tokens)
    return out.to(q.dtype)


@torch.library.register_fake(native_decode_blocks)
def _native_decode_blocks_fake(q, block_req, runs, valid, unit, k_cache, v_cache, k_scale, v_scale, logit_cap,
                               num_rows, sinks=None, q_bf16_scale=0.0, draft_slots=None, draft_mask=None, tokens=1):
    return q.new_empty((q.shape[0], q.shape[1], v_cache.shape[2]))
