"""Decode attention as one fused pass over the cache, for ``torch.compile`` on CPU: each block's K/V rows are read
straight from the cache through the block table (an indirect load inside inductor's kernel), never gathered into
a copy first.

Why: on CPU the decode is bound by moving K/V. The eager forms gather each block's rows into a tile and then run
a kernel over the tile, so every byte is read, written and read again, and with 64-token blocks the flash
kernel's per-call set-up outweighs its tiny GEMMs. Written as products and reductions over the indexed cache,
inductor's C++ backend emits loops that load each K and V row from where it lies and convert bf16/fp16/float8 to
float32 in registers. Eagerly the same code materialises every intermediate (a copy of all of K), so
``decode.decode_blocks`` picks it only while compiling for a CPU; eager calls are for tests. Where the C++ kernel
is built (``native_decode``, the same computation by hand: faster, and eager too) it replaces this traced form,
which stays as the fallback and the reference twin.

Pure tensor code: no ``.item()``, no value-dependent branch; the one host read is inside the ``used_blocks`` op
(CPU tensors, never a device sync).
"""
from __future__ import annotations

import torch

from .kv_dtype import dequantize, gather_rows
from .opaque import opaque_op


def fused_block_partials(qb: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, runs: torch.Tensor,
                         valid: torch.Tensor, unit: int, logit_cap: float | None = None,
                         k_scale: float | None = None, v_scale: float | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each block's partial softmax over its keys, reading K/V in place.

    qb: [nblk, Hkv, group, D] float32, already scaled; k_cache, v_cache: [num_slots, Hkv, D] (any
    ``kv_dtype.KV_DTYPES``; float8 read as ``stored * scale``); runs: [nblk, block_size // unit] int64
    (``DecodeIndex.runs``: slots when ``unit`` is 1, else runs of ``unit`` consecutive slots); valid:
    [nblk, block_size] bool.
    returns m, lsum: [nblk, Hkv, group] float32 (block max and sum of exp; the lowest float32 and 0 for a block
    with no valid key) and o: [nblk, Hkv, group, D] float32, unnormalised (``decode.merge_blocks``' inputs).
    """
    nblk, block_size = valid.shape
    # The index as a stored buffer, column-major. Stored: else inductor folds the block table's whole computation
    # into every load (5x slower). Column-major: with a row-major index read per position, inductor vectorised the
    # value reduction over positions, one scalar load per element (5x slower); this way it runs over the head dim,
    # which is contiguous in the cache.
    runs = index_columns(runs).t()
    k = _rows(k_cache, runs, unit, k_scale).reshape(nblk, block_size, *k_cache.shape[1:])
    v = _rows(v_cache, runs, unit, v_scale).reshape(nblk, block_size, *v_cache.shape[1:])
    keep = valid[:, :, None, None]
    if unit > 1:  # a page's tail past its request's end was never written for it (NaN survives 0 * x)
        v = torch.where(keep, v, 0.0)
    s = (qb[:, :, :, None, :] * k.permute(0, 2, 1, 3)[:, :, None]).sum(-1)  # [nblk, Hkv, group, block_size]
    if logit_cap is not None:
        s = logit_cap * torch.tanh(s / logit_cap)
    keep = valid[:, None, None, :]
    s = torch.where(keep, s, torch.finfo(torch.float32).min)  # select, never add: a NaN score is replaced
    m = s.amax(-1)
    p = torch.where(keep, torch.exp(s - m[..., None]), 0.0)
    o = (p[..., None] * v.permute(0, 2, 1, 3)[:, :, None]).sum(-2)  # [nblk, Hkv, group, D]
    return m, p.sum(-1), o


def used_block_partials(q: torch.Tensor, index, num_kv_heads: int, scale: float, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, logit_cap: float | None, k_scale: float | None,
                        v_scale: float | None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fused_block_partials`` over the used blocks of ``index`` (a ``decode.DecodeIndex``; a bucket's unused
    blocks are not computed at all): q [bs, R, D], each block's R rows grouped ``[Hkv, R // Hkv]``. (Where the C++
    kernel serves a call, decode and verify use its merged ops instead.)
    -> (block_req [n], m, lsum [n, Hkv, R // Hkv], o [n, Hkv, R // Hkv, Dv]): ``decode.merge_blocks``' inputs."""
    n = used_prefix(index.block_req, q.shape[0])
    block_req = index.block_req[:n]  # used blocks only: every entry a row of q
    qs = scaled_queries(q, num_kv_heads, scale)
    # each block's queries read through block_req inside the kernel's loads, from one small stored buffer, not a
    # per-block copy of them (nblk x the queries' bytes, written and read again)
    m, lsum, o = fused_block_partials(qs[block_req], k_cache, v_cache, index.runs[:n], index.valid[:n], index.unit,
                                      logit_cap, k_scale, v_scale)
    return block_req, m, lsum, o


def _rows(cache: torch.Tensor, runs: torch.Tensor, unit: int, scale: float | None) -> torch.Tensor:
    """The rows of ``unit``-slot runs ``runs`` as float32 times ``scale``: an indexing expression that inductor
    folds into its consumers' loads. -> [*runs.shape, unit, H, D]."""
    s, h, d = cache.shape
    rows = cache[: s - s % unit].view(-1, unit, h, d)[runs].float()
    return rows if scale is None or scale == 1.0 else rows * scale


def grouped_queries(q: torch.Tensor, block_req: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Each block's queries grouped by KV head (GQA never expands K/V): q [bs, Hq, D], block_req [nblk] (``bs`` for
    unused blocks, which read the last row) -> [nblk, Hkv, Hq // Hkv, D] float32, a new tensor."""
    bs, hq, d = q.shape
    return q.index_select(0, block_req.clamp_max(bs - 1)).view(-1, num_kv_heads, hq // num_kv_heads, d).float()


@opaque_op
def scaled_queries(q: torch.Tensor, num_kv_heads: int, scale: float) -> torch.Tensor:
    """q [bs, Hq, D] (any float dtype) -> [bs, Hkv, Hq // Hkv, D] float32, scaled, grouped by KV head. An op of its
    own so that the fused kernel starts from a stored buffer: with q's producers (rotary embedding, projections)
    folded in, every layer of a model compiled its own variant of the attention kernel, one C++ compile of seconds
    each at a cold start; this way the layers share one. (The C++ kernel's merged op reads q as it is.)"""
    bs, hq, d = q.shape
    return q.reshape(bs, num_kv_heads, hq // num_kv_heads, d).float().mul(scale)


@torch.library.register_fake(scaled_queries)
def _scaled_queries_fake(q, num_kv_heads, scale):
    return q.new_empty((q.shape[0], num_kv_heads, q.shape[1] // num_kv_heads, q.shape[2]), dtype=torch.float32)


@opaque_op
def used_blocks(block_req: torch.Tensor, num_rows: int) -> torch.Tensor:
    """How many blocks a batch uses, as the length of the returned ``[n]`` int64 arange: block_req [nblk] (the
    used blocks first, then ``num_rows`` for each unused one).

    Why: a graph's block list is sized for its bucket's worst batch (in SGLang's graphs, every row at the longest
    context), and the fused kernel's cost follows the blocks it is given, so a batch of 1k-token requests in a graph
    sized for 4k computed about 4x its work. Under ``torch.compile`` this op's length is a data-dependent size
    (read on the host when the compiled step runs, never traced as a value), so the kernel loops over the used
    blocks only, and one compile serves every count. CPU only: a CUDA graph cannot record a host read."""
    return torch.arange(int((block_req < num_rows).sum()), device=block_req.device)


@torch.library.register_fake(used_blocks)
def _used_blocks_fake(block_req, num_rows):
    return block_req.new_empty(torch.library.get_ctx().new_dynamic_size())


def used_prefix(index_block_req: torch.Tensor, num_rows: int) -> int | torch.SymInt:
    """``used_blocks``' count: an int eagerly, a data-dependent size under ``torch.compile``, known to be at most the
    block count (so slicing ``[:n]`` needs no clamp)."""
    n = used_blocks(index_block_req, num_rows).shape[0]
    torch._check(n <= index_block_req.shape[0])
    return n


@opaque_op
def index_columns(index: torch.Tensor) -> torch.Tensor:
    """A 2-D index transposed into a new contiguous tensor ([a, b] -> [b, a]). An op of its own so that inductor
    reads it as a stored buffer in that layout instead of folding the transpose (or the index's computation) into
    the loads that use it."""
    return index.t().clone(memory_format=torch.contiguous_format)


@torch.library.register_fake(index_columns)
def _index_columns_fake(index):
    return index.new_empty(index.shape[1], index.shape[0])


@opaque_op
def gather_heads_float(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [S, H, D] rows at slots [b, n] as float32 (``kv_dtype.dequantize``, unscaled) laid out [b, H, n, D],
    by ATen's row copy and one transposed copy. An op of its own for small CPU gathers (verify's draft keys):
    inductor folded the slots' computation and the matmul's transpose into a per-element loop (index arithmetic and
    bounds checks per element, slower than the matmul it fed)."""
    rows = dequantize(gather_rows(cache, slots.reshape(-1)), torch.float32, None)
    return rows.view(*slots.shape, *cache.shape[1:]).transpose(1, 2).contiguous()


@torch.library.register_fake(gather_heads_float)
def _gather_heads_float_fake(cache, slots):
    return cache.new_empty((slots.shape[0], cache.shape[1], slots.shape[1], cache.shape[2]), dtype=torch.float32)
