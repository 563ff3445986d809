"""``compiled-attn bench-ops --ops extend mla-extend``: the tiled extend against the per-request loop.

Cases: batch sizes x new-token lengths (``uniform``: 512 each; ``mixed``: 64..2048) x cached prefixes (``0``,
``1024``, ``mixed``: 0..1024), for MHA (32/8 heads x 128) and MLA "normal" (16 heads, 192/128). Columns: the loop
(SGLang torch_native's algorithm), ours eager and compiled (the per-step index and the layer; the host plan is
timed on its own), ratios to the loop, ``waste`` (computed / useful (query, key) pairs at the run's tiles, and at
64 x 64 tiles), and useful GFLOP/s next to a large float32 matmul's GFLOP/s measured in the same run.
"""
from __future__ import annotations

import time

import torch

from profiling.timers import median, time_fn, time_interleaved

from ..compile_policy import compile_step
from ..extend import build_extend_tile_index, default_tile_q, extend_tiles, plan_extend_tiles
from ..forms import choose_extend_form
from ..plan import plan_extend
from .batches import make_batch
from .loop_baseline import loop_extend

SHAPES = {"extend": (32, 8, 128, 128), "mla-extend": (16, 16, 192, 128)}  # hq, hkv, dqk, dv
NEW_LENS = ("uniform", "mixed")
PREFIXES = ("0", "1024", "mixed")


def _lengths(bs: int, new_kind: str, prefix_kind: str, seed: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    new = [512] * bs if new_kind == "uniform" else torch.randint(64, 2049, (bs,), generator=g).tolist()
    if prefix_kind == "mixed":
        prefix = torch.randint(0, 1025, (bs,), generator=g).tolist()
    else:
        prefix = [int(prefix_kind)] * bs
    return new, prefix


def _step(q, k_cache, v_cache, table, inputs, scale, form):
    index = build_extend_tile_index(table, inputs, causal=True, sliding_window=None, with_mask=form != "kernel")
    return extend_tiles(q, k_cache, v_cache, index, scale, form=form)


def matmul_gflops(n: int = 2048) -> float:
    """This machine's float32 GEMM rate now: the compute roof the extend's GFLOP/s is read against."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / median(time_fn(lambda: a @ b, warmup=1, iters=5)) / 1e9


def bench_extend_case(op: str, bs: int, new_kind: str, prefix_kind: str, *, iters: int, seed: int = 0,
                      dtype: torch.dtype = torch.float32) -> dict:
    """One row: ``op``'s shapes at ``bs`` requests, q and caches in ``dtype``."""
    hq, hkv, dqk, dv = SHAPES[op]
    new, prefix = _lengths(bs, new_kind, prefix_kind, seed + bs)
    b = make_batch([n + p for n, p in zip(new, prefix, strict=True)], prefix, hq=hq, hkv=hkv, dqk=dqk, dv=dv,
                   seed=seed, dtype=dtype)
    scale = dqk ** -0.5
    form = choose_extend_form(b.q, b.k_cache, b.v_cache, None).form
    start = time.perf_counter()
    meta = plan_extend(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens, b.ext_lens)
    tiles = plan_extend_tiles(meta, tile_q=default_tile_q(form))
    plan_ms = (time.perf_counter() - start) * 1e3
    at64 = plan_extend_tiles(meta, tile_q=64, tile_k=64)
    args = (b.q, b.k_cache, b.v_cache, b.req_to_token, tiles.inputs, scale, form)
    compiled = compile_step(_step)

    def loop():
        return loop_extend(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                           b.ext_lens, scale=scale)

    fns = {"loop": loop, "eager": lambda: _step(*args), "compiled": lambda: compiled(*args)}
    ref = loop()
    tol = 2e-3 if dtype == torch.float32 else 2e-2  # half-precision outputs round at 2^-8 relative
    for name in ("eager", "compiled"):  # all agree before any is timed (the compile happens here)
        torch.testing.assert_close(fns[name](), ref, atol=tol, rtol=tol)
    t = {k: median(v) for k, v in time_interleaved(fns, warmup=1, iters=iters).items()}
    flops = 2 * tiles.useful_qk * hq * (dqk + dv)
    return {"op": op, "bs": bs, "new": new_kind, "prefix": prefix_kind, "dtype": str(dtype).removeprefix("torch."),
            "loop_ms": t["loop"] * 1e3,
            "eager_ms": t["eager"] * 1e3, "compiled_ms": t["compiled"] * 1e3, "plan_ms": plan_ms,
            "eager_x": t["loop"] / t["eager"], "compiled_x": t["loop"] / t["compiled"],
            "waste": tiles.computed_qk / tiles.useful_qk, "waste_64": at64.computed_qk / at64.useful_qk,
            "GFLOPs": flops / t["eager"] / 1e9}


COLUMNS = ["op", "bs", "new", "prefix", "dtype", "loop_ms", "eager_ms", "compiled_ms", "plan_ms", "eager_x",
           "compiled_x", "waste", "waste_64", "GFLOPs"]
