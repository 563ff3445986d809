"""One decode case of ``compiled-attn bench-ops`` (the ``mha`` / ``mla`` tables, and ``--sweep-len``'s rows): the
per-request SDPA loop (SGLang torch_native's algorithm), our eager and compiled ``decode_blocks``, optionally the
compiled step in the portable matmul form (``portable``), SGLang's own CPU decode kernel (``sglang``: a loaded kit,
``sglang_kit.py``) and a one-pass read of the same K/V bytes (``bound``), checked against each other and then timed
in interleaved rounds in balanced orders (``profiling.timers.time_interleaved``).

``cold_bytes`` > 0: the caches hold copies of the batch's K/V (together at least that many bytes, and one more) and
every timed call, whichever candidate makes it, reads the next copy, as ``ops_verify.py`` does: in a serving step a
layer's K/V comes from memory, while candidates reading one copy after another would find it in a large last-level
cache. 0: one copy, read by every call (``--warm``).
"""
from __future__ import annotations

import itertools

import torch

from profiling.host import CpuShare
from profiling.timers import median, time_interleaved

from ..compile_policy import compile_step
from ..decode import build_decode_index, decode_blocks
from ..kernels.cpu.kernel import native_fits
from ..kv import FP8_DTYPES
from ..plan import DecodeInputs, plan_decode
from . import sglang_kit
from .batches import make_batch
from .loop_baseline import loop_decode
from .models import get_attention_shape
from .ops_common import copies_for, dtype_name, float32_words, mark_as_bucket, served_form

#: the tolerance every candidate's output is held to against the loop's (and SGLang's against ours)
ATOL = RTOL = 2e-2


class SglangMismatch(RuntimeError):
    """SGLang's kernel and ours disagree on a case: its column would not be a measurement of the same work."""


def _decode_step(q, k_cache, v_cache, table, inputs: DecodeInputs, scale, v_shares_k, page_size=1, kv_scale=None,
                 form="auto"):
    """One decode call as the benchmarks time it; ``form="matmul"``: the portable form, not the device's kernel."""
    return decode_blocks(q, k_cache, v_cache, build_decode_index(table, inputs, page_size), scale,
                         v_shares_k=v_shares_k, k_scale=kv_scale, v_scale=kv_scale, form=form)


def _kv_bytes_copy(b, lens: list[int], mla: bool) -> torch.Tensor:
    """One contiguous 1-D tensor holding the K/V bytes the batch's decode reads (K and V rows of every request's
    tokens; for MLA the latent K only, V is a view of it): a plain ``.sum()`` over it is the one-pass read the
    attention cannot beat (the physical bound column)."""
    slots = torch.cat([b.req_to_token[r, :n].long() for r, n in zip(b.rows.tolist(), lens, strict=True)])
    parts = [b.k_cache[slots].reshape(-1)] + ([] if mla else [b.v_cache[slots].reshape(-1)])
    return float32_words(torch.cat(parts))


def _repeat(cache: torch.Tensor, copies: int) -> torch.Tensor:
    """``copies`` copies of a cache one after another along the slots (through bytes: float8 has no repeat)."""
    return cache.view(torch.uint8).repeat(copies, 1, 1).view(cache.dtype) if copies > 1 else cache


def bench_case(name: str, bs: int, lens_kind: str, *, iters: int, dtype, seed: int = 0,
               lens: list[int] | None = None, bound: bool = False, page_size: int = 1,
               kv_dtype: torch.dtype | None = None, slot_layout: str = "scattered", portable: bool = False,
               cold_bytes: int = 0, sglang=None) -> dict:
    """Decode of one batch (``bs`` requests, contexts from ``lens_kind`` or the explicit ``lens`` override, a
    list of ``bs`` ints): loop, eager and compiled (and with ``bound`` the one-pass K/V read) timed round-robin
    after checking that the three outputs agree. Returns one table row (ms, ratios to the loop, GB/s).
    ``page_size``: the cache's pages (SGLang's paged layout); ``kv_dtype``: the cache's dtype (default ``dtype``;
    float8 caches are read with a scale of 0.5, the loop casting and scaling per request); ``slot_layout``: where
    the tokens' slots lie (``batches.make_batch``: scattered, or as SGLang's allocator hands them out); ``portable``:
    also the compiled step in the portable matmul form (what a device without a kernel runs), where a kernel serves
    the case;
    ``cold_bytes``: copies of the K/V read in turn (module docstring); ``sglang``: the op namespace of a loaded
    SGLang kit (``sglang_kit.load_kit(...).ops``): its ``decode_attention_cpu`` too, where it takes the dtypes
    (``sglang_ms``, ``sglang/compiled`` = sglang_ms / compiled_ms, > 1: ours is faster; else ``sglang_skipped`` says
    why), after its output is checked against ours on the case's first call (``SglangMismatch`` where it differs).
    ``kv_copies``: the copies read in turn; ``others_cpu``: the share of the CPUs other processes used while the case
    was timed (``profiling.host.CpuShare``; None where it cannot be read or was too short to tell)."""
    shape = get_attention_shape(name)
    g = torch.Generator().manual_seed(seed + bs)
    if lens is None:
        lens = (torch.randint(256, 2049, (bs,), generator=g).tolist() if lens_kind == "mixed" else [1024] * bs)
    elif len(lens) != bs:
        raise ValueError(f"bench_case: {len(lens)} lens for batch size {bs}")
    kv_dtype = kv_dtype or dtype
    b = make_batch(lens, hq=shape.hq, hkv=shape.hkv, dqk=shape.dqk, dv=shape.dv, mla=shape.mla, dtype=dtype,
                   seed=seed, decode=True, page_size=page_size, kv_dtype=kv_dtype, slot_layout=slot_layout)
    q, k_cache, v_cache, table = b.q, b.k_cache, b.v_cache, b.req_to_token
    scale = shape.dqk ** -0.5
    kv_scale = 0.5 if kv_dtype in FP8_DTYPES else None
    # copy c of the K/V at slots + c * S of caches that many times longer, read through its own table
    num_slots = k_cache.shape[0]
    copies = copies_for(cold_bytes, k_cache.nbytes + (0 if shape.mla else v_cache.nbytes))
    k_cache = _repeat(k_cache, copies)
    v_cache = k_cache[..., :shape.dv] if shape.mla else _repeat(v_cache, copies)  # MLA: V stays a view of K
    tables = [table + c * num_slots for c in range(copies)] if copies > 1 else [table]
    for t in tables[1:]:
        torch._dynamo.mark_static(t)  # as mark_as_bucket marks the first (below): no recompile for a copy
    turn = itertools.count()
    meta = plan_decode(q, k_cache, v_cache, table, b.rows, b.seq_lens, page_size=page_size)

    def next_copy() -> int:
        return next(turn) % copies

    mark_as_bucket(q, k_cache, v_cache, table, meta.inputs.block_offsets)
    compiled = compile_step(_decode_step)
    tail = (meta.inputs, scale, shape.mla, page_size, kv_scale)

    def loop(t):
        return loop_decode(q, k_cache, v_cache, t, b.rows, b.seq_lens, scale=scale, k_scale=kv_scale,
                           v_scale=kv_scale)

    def eager(t):
        return _decode_step(q, k_cache, v_cache, t, *tail)

    def comp(t):
        return compiled(q, k_cache, v_cache, t, *tail)

    def timed(fn):  # each call reads the next copy of the K/V, whichever candidate makes it
        return lambda: fn(tables[next_copy()])

    ref = loop(table)  # the candidates agree with the loop before any of them is timed
    torch.testing.assert_close(eager(table).float(), ref.float(), atol=ATOL, rtol=RTOL)
    ours = comp(table)  # the compile happens here
    torch.testing.assert_close(ours.float(), ref.float(), atol=ATOL, rtol=RTOL)
    served = served_form(timed(comp), timed(eager))
    fns = {"loop": timed(loop), "eager": timed(eager), "compiled": timed(comp)}
    if portable and native_fits(q, k_cache, v_cache):
        def matmul(t):
            return compiled(q, k_cache, v_cache, t, *tail, "matmul")  # a graph of its own

        torch.testing.assert_close(matmul(table).float(), ref.float(), atol=ATOL, rtol=RTOL)
        fns["portable"] = timed(matmul)
    sglang_skipped = None
    sglang_diff = None
    if sglang is not None:
        sglang_skipped = sglang_kit.supports(dtype, kv_dtype)
    if sglang is not None and sglang_skipped is None:
        sgl = sglang_kit.decode_fn(sglang, q, k_cache, v_cache, b.rows, b.seq_lens, scale)
        theirs = sgl(table)
        sglang_diff = (theirs.float() - ours.float()).abs().max().item()
        try:
            torch.testing.assert_close(theirs.float(), ours.float(), atol=ATOL, rtol=RTOL)
        except AssertionError:
            raise SglangMismatch(
                f"SGLang's decode_attention_cpu differs from ours on {name} decode bs {bs} lens {lens_kind} "
                f"page {page_size} {dtype_name(dtype)}: max abs diff {sglang_diff:.3g} (tolerance {ATOL} + "
                f"{RTOL} x |ours|); its column would not measure the same work") from None
        fns["sglang"] = timed(sgl)
    if bound:
        kv = _kv_bytes_copy(b, lens, shape.mla)  # the batch's K/V bytes, contiguous: one copy per K/V copy
        reads = [kv] + [kv.clone() for _ in range(copies - 1)]
        fns["read"] = (lambda: reads[next_copy()].sum()) if copies > 1 else kv.sum
    # round-robin, so a neighbour's burst on this shared machine slows all of them alike
    share = CpuShare()  # the timing only: inductor's compile workers are other processes too
    times = time_interleaved(fns, warmup=1, iters=iters)
    others = share.others()
    t = {k: median(v) for k, v in times.items()}
    kv_bytes = sum(lens) * shape.hkv * (shape.dqk + (0 if shape.mla else shape.dv)) * k_cache.element_size()
    row = {"op": f"{name} decode", "bs": bs, "lens": lens_kind, "slots": slot_layout, "page": page_size,
           "kv": dtype_name(kv_dtype), "loop_ms": t["loop"] * 1e3,
           "eager_ms": t["eager"] * 1e3, "compiled_ms": t["compiled"] * 1e3,
           "eager_x": t["loop"] / t["eager"], "compiled_x": t["loop"] / t["compiled"],
           "served": served, "served_x": t["loop"] / t[served],
           "compiled_GBps": kv_bytes / t["compiled"] / 1e9, "tokens": sum(lens), "kv_bytes": kv_bytes,
           "kv_copies": copies, "others_cpu": others}
    if bound:
        row["read_ms"] = t["read"] * 1e3
        row["x_read"] = t["compiled"] / t["read"]
    if "portable" in t:
        row["portable_ms"] = t["portable"] * 1e3
        row["kernel_x"] = t["portable"] / t["compiled"]
    if "sglang" in t:
        row["sglang_ms"] = t["sglang"] * 1e3
        row["sglang/compiled"] = t["sglang"] / t["compiled"]
        row["sglang_diff"] = sglang_diff
    elif sglang_skipped is not None:
        row["sglang_skipped"] = sglang_skipped
    return row
