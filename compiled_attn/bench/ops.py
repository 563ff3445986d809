"""``compiled-attn bench-ops``: one attention op, side by side: the per-request SDPA loop (SGLang torch_native's
algorithm), our eager ``run`` and our compiled ``run``, for MHA and absorbed MLA decode at several batch sizes, and
(``--ops extend mla-extend``, ``ops_extend.py``) the tiled extend.

Reports medians, ratios to the loop, and effective GB/s (K/V bytes the batch needs / time) next to a plain copy
bandwidth measured in the same run. The three are timed round-robin (one call of each per round), with glibc's
allocator tuned as in ``compiled-attn bench`` (``--no-malloc-tuning`` turns that off). ``--sweep-len`` (``sweep.py``):
bs=1 MHA decode per context length, with a one-pass read of the same K/V bytes as the physical bound.
``--contend N``: N processes spin on the CPU while everything is measured (``contend.py``); the report says so.
"""
from __future__ import annotations

import torch

from graphs.runner import EAGER_MARGIN, faster_form
from profiling.host import add_malloc_flag, huge_pages_in_use, last_level_cache_bytes, tune_malloc
from profiling.timers import format_table, median, time_fn, time_interleaved

from ..compile_policy import compile_step
from ..decode import build_decode_index, decode_blocks
from ..kv_dtype import FP8_DTYPES
from ..metadata import DecodeInputs
from ..native_decode import native_fits
from ..plan import plan_decode
from .batches import ENGINE_DECODE_TAIL, SLOT_LAYOUTS, make_batch
from .contend import contend, describe
from .loop_baseline import loop_decode
from .models import get_attention_shape
from .ops_extend import COLUMNS as EXTEND_COLUMNS
from .ops_extend import NEW_LENS, PREFIXES, SHAPES, bench_extend_case, matmul_gflops
from .report import OneLineParser, int_at_least

KV_DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                  "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _copy_gbps(nbytes: int = 256 << 20) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / median(time_fn(lambda: dst.copy_(src), warmup=2, iters=5)) / 1e9


def _decode_step(q, k_cache, v_cache, table, inputs: DecodeInputs, scale, v_shares_k, page_size=1, kv_scale=None,
                 native=None):
    """One decode call as the benchmarks time it; ``native=False``: inductor's traced form, not the C++ kernel."""
    return decode_blocks(q, k_cache, v_cache, build_decode_index(table, inputs, page_size), scale,
                         v_shares_k=v_shares_k, k_scale=kv_scale, v_scale=kv_scale, native=native)


def _kv_bytes_copy(b, lens: list[int], mla: bool) -> torch.Tensor:
    """One contiguous 1-D tensor holding the K/V bytes the batch's decode reads (K and V rows of every request's
    tokens; for MLA the latent K only, V is a view of it): a plain ``.sum()`` over it is the one-pass read the
    attention cannot beat (the physical bound column)."""
    slots = torch.cat([b.req_to_token[r, :n].long() for r, n in zip(b.rows.tolist(), lens, strict=True)])
    parts = [b.k_cache[slots].reshape(-1)] + ([] if mla else [b.v_cache[slots].reshape(-1)])
    return float32_words(torch.cat(parts))


def float32_words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as one flat tensor of float32 words, to be summed as a one-pass read (values do
    not matter): ATen's float sum streams at memory speed, while its integer and float8 sums are several times
    slower than a read."""
    flat = t.reshape(-1)
    return flat.view(torch.float32) if flat.dtype != torch.float32 and flat.nbytes % 4 == 0 else flat


def mark_as_bucket(q, k_cache, v_cache, table, block_offsets) -> None:
    """Compile as a ``DecodeGraphs`` / ``VerifyGraphs`` bucket does (``graphs.runner_helpers.mark_fixed_dims``): the
    cache, the table, the block size and q's head dims static, the batch and block counts symbolic."""
    for t in (k_cache, v_cache, table, block_offsets):
        torch._dynamo.mark_static(t)
    for dim in (1, 2):
        torch._dynamo.mark_static(q, dim)


def served_form(compiled, eager, iters: int = 2) -> str:
    """What a bucket of ``DecodeGraphs`` would replay for this op: its warm-up's measurement (``iters``
    interleaved runs of each, the fastest of each) and ``graphs.faster_form``: "compiled" or "eager"."""
    t = time_interleaved({"compiled": compiled, "eager": eager}, warmup=0, iters=iters)
    return faster_form(min(t["compiled"]), min(t["eager"]))


def bench_case(name: str, bs: int, lens_kind: str, *, iters: int, dtype, seed: int = 0,
               lens: list[int] | None = None, bound: bool = False, page_size: int = 1,
               kv_dtype: torch.dtype | None = None, slot_layout: str = "scattered", traced: bool = False) -> dict:
    """Decode of one batch (``bs`` requests, contexts from ``lens_kind`` or the explicit ``lens`` override, a
    list of ``bs`` ints): loop, eager and compiled (and with ``bound`` the one-pass K/V read) timed round-robin
    after checking that the three outputs agree. Returns one table row (ms, ratios to the loop, GB/s).
    ``page_size``: the cache's pages (SGLang's paged layout); ``kv_dtype``: the cache's dtype (default ``dtype``;
    float8 caches are read with a scale of 0.5, the loop casting and scaling per request); ``slot_layout``: where
    the tokens' slots lie (``batches.make_batch``: scattered, or as SGLang's allocator hands them out); ``traced``:
    also the compiled step without the C++ kernel (``native_decode``), where the kernel serves the case."""
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
    meta = plan_decode(q, k_cache, v_cache, table, b.rows, b.seq_lens, page_size=page_size)
    args = (q, k_cache, v_cache, table, meta.inputs, scale, shape.mla, page_size, kv_scale)
    mark_as_bucket(q, k_cache, v_cache, table, meta.inputs.block_offsets)
    compiled = compile_step(_decode_step)

    def loop():
        return loop_decode(q, k_cache, v_cache, table, b.rows, b.seq_lens, scale=scale, k_scale=kv_scale,
                           v_scale=kv_scale)

    def eager():
        return _decode_step(*args)

    def comp():
        return compiled(*args)

    ref = loop()
    for fn in (eager, comp):  # the three must agree before any of them is timed
        torch.testing.assert_close(fn().float(), ref.float(), atol=2e-2, rtol=2e-2)
    served = served_form(comp, eager)
    fns = {"loop": loop, "eager": eager, "compiled": comp}
    if traced and not shape.mla and native_fits(q, k_cache, v_cache):
        fns["traced"] = lambda: compiled(*args, False)  # native=False: a graph of its own (a constant to dynamo)
        torch.testing.assert_close(fns["traced"]().float(), ref.float(), atol=2e-2, rtol=2e-2)
    if bound:
        kv = _kv_bytes_copy(b, lens, shape.mla)
        fns["read"] = kv.sum
    # round-robin, so a neighbour's burst on this shared machine slows all of them alike
    times = time_interleaved(fns, warmup=1, iters=iters)
    t = {k: median(v) for k, v in times.items()}
    kv_bytes = sum(lens) * shape.hkv * (shape.dqk + (0 if shape.mla else shape.dv)) * k_cache.element_size()
    row = {"op": f"{name} decode", "bs": bs, "lens": lens_kind, "slots": slot_layout, "page": page_size,
           "kv": str(kv_dtype).replace("torch.", "").replace("float8_", "fp8_"), "loop_ms": t["loop"] * 1e3,
           "eager_ms": t["eager"] * 1e3, "compiled_ms": t["compiled"] * 1e3,
           "eager_x": t["loop"] / t["eager"], "compiled_x": t["loop"] / t["compiled"],
           "served": served, "served_x": t["loop"] / t[served],
           "compiled_GBps": kv_bytes / t["compiled"] / 1e9, "tokens": sum(lens), "kv_bytes": kv_bytes}
    if bound:
        row["read_ms"] = t["read"] * 1e3
        row["x_read"] = t["compiled"] / t["read"]
    if "traced" in t:
        row["traced_ms"] = t["traced"] * 1e3
        row["native_x"] = t["traced"] / t["compiled"]
    return row


def _parse(argv):
    p = OneLineParser(prog="compiled-attn bench-ops", description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", nargs="+", default=None, choices=["mha", "mla", *SHAPES, "verify"],
                   help="default: mha mla (none with --sweep-len); verify: speculative verify of k draft tokens")
    p.add_argument("--draft", nargs="+", default=["2", "4", "8", "tree8"], choices=["2", "4", "8", "tree8"],
                   help="verify: k draft tokens as a chain, or tree8 (a random tree of 8)")
    p.add_argument("--warm", action="store_true",
                   help="verify: every call reads the same K/V (from cache where it fits; default: each call the next "
                        "of copies of it that together exceed 1.5x the last-level cache, from memory)")
    p.add_argument("--window", type=int, nargs="+", default=[None],
                   help="verify: sliding windows (a window layer's, e.g. gpt-oss's 128); default: none")
    p.add_argument("--batch-size", nargs="+", type=int_at_least(1), default=None,
                   help="default: 1 8 32 (decode), 1 4 16 (extend)")
    p.add_argument("--lens", nargs="+", default=["mixed", "1024"], choices=["mixed", "1024"], help="decode contexts")
    p.add_argument("--new", nargs="+", default=["uniform", "mixed"], choices=NEW_LENS,
                   help="extend: new tokens per request (uniform 512, mixed 64..2048)")
    p.add_argument("--prefix", nargs="+", default=["0", "1024", "mixed"], choices=PREFIXES,
                   help="extend: cached prefix per request")
    p.add_argument("--sweep-len", nargs="*", type=int_at_least(1), default=None, metavar="L",
                   help="bs=1 MHA decode per context length L (no L: 64 256 1024 2048 4096 4160 8192 16384)")
    p.add_argument("--contend", type=int_at_least(0), default=0, metavar="N",
                   help="N processes spin on the CPU while timing (default 0)")
    p.add_argument("--iters", type=int_at_least(1), default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="query (model) dtype; verify: the model's and its cache's")
    p.add_argument("--page-size", nargs="+", type=int_at_least(1), default=[1],
                   help="decode: KV cache page sizes (SGLang --page-size; default 1)")
    p.add_argument("--kv-dtype", nargs="+", default=None, choices=list(KV_DTYPE_NAMES),
                   help="decode: KV cache dtypes (default: --dtype); fp8 caches are read with scale 0.5")
    p.add_argument("--slot-layout", nargs="+", default=["scattered"], choices=list(SLOT_LAYOUTS),
                   help="decode and verify: where tokens' KV slots lie: scattered at random (a long-running "
                        "server's free list), or engine (prompts in runs of consecutive slots, the last "
                        f"{ENGINE_DECODE_TAIL} decode steps a batch apart, as a fresh SGLang pool hands them out)")
    p.add_argument("--traced", action="store_true",
                   help="decode: also time the compiled step without the C++ kernel (inductor's traced loops)")
    add_malloc_flag(p)
    return p.parse_args(argv)


def _run_cases(args) -> None:
    """Every requested table (sweep, decode ops, extend ops) and the copy bandwidth, under one contention."""
    from .sweep import SWEEP_LENS, run_sweep  # sweep imports bench_case from here

    dtype = getattr(torch, args.dtype)
    ops = args.ops if args.ops is not None else ([] if args.sweep_len is not None else ["mha", "mla"])
    if args.sweep_len is not None:
        run_sweep(args.sweep_len or SWEEP_LENS, iters=args.iters, dtype=dtype)
    decode_ops = [op for op in ops if op in ("mha", "mla")]
    extend_ops = [op for op in ops if op in SHAPES]
    if decode_ops:
        kv_dtypes = [KV_DTYPE_NAMES[n] for n in args.kv_dtype] if args.kv_dtype else [dtype]
        rows = [bench_case(op, bs, lens, iters=args.iters, dtype=dtype, page_size=page, kv_dtype=kv, bound=True,
                           slot_layout=layout, traced=args.traced)
                for op in decode_ops for lens in args.lens for bs in args.batch_size or [1, 8, 32]
                for layout in args.slot_layout for page in args.page_size for kv in kv_dtypes
                if not (layout == "engine" and page > 1)]
        cols = ["op", "bs", "lens", "slots", "page", "kv", "loop_ms", "eager_ms", "compiled_ms", "read_ms", "eager_x",
                "compiled_x", "served", "served_x", "x_read", "compiled_GBps"]
        cols += ["traced_ms", "native_x"] if args.traced else []
        print(format_table(rows, cols), flush=True)
        print("x_read: compiled time / the one-pass read of the same cache bytes (.sum over a contiguous copy); "
              "GBps: the cache bytes stored (in the cache's dtype) / compiled time; served: the form a DecodeGraphs "
              "bucket replays (its warm-up times compiled against eager and keeps compiled unless eager is "
              f"{EAGER_MARGIN:.0%} faster), served_x its ratio to the loop"
              + ("; traced: compiled without the C++ kernel, native_x = traced / compiled" if args.traced else ""))
    if "verify" in ops:
        from .ops_verify import COLUMNS as VERIFY_COLUMNS
        from .ops_verify import bench_verify_case

        cold = 0 if args.warm else int(1.5 * last_level_cache_bytes())
        rows = [bench_verify_case(bs, int(d.removeprefix("tree")), d.startswith("tree"), args.iters,
                                  slot_layout=layout, dtype=dtype, window=window, cold_bytes=cold)
                for window in args.window for layout in args.slot_layout for d in args.draft
                for bs in args.batch_size or [1, 8, 32]]
        print(format_table(rows, VERIFY_COLUMNS), flush=True)
        print("x_decode1: verify time / one decode step (the K/V are read once for all k queries); loop_x: the "
              "masked per-request SDPA loop / verify; _eager: uncompiled, as SGLang's CPU speculation runs verify "
              "(eager_x_decode1: verify / decode step, both so); cached_x_decode1: verify over K/V in cache (every "
              "slot folded into a few: the arithmetic alone) / one decode step, the least x_decode1 could be with "
              "every read overlapped; x_read: verify / a one-pass read of the K/V bytes (.sum); "
              + ("every call reads the same K/V, as the call before left it in cache (--warm)" if args.warm else
                 "every call reads its K/V from memory, as a layer's in a serving step (copies of it, "
                 f"{cold / 2**20:.0f} MiB, read in turn; --warm: one)"))
    if extend_ops:
        rows = [bench_extend_case(op, bs, new, prefix, iters=args.iters) for op in extend_ops for new in args.new
                for prefix in args.prefix for bs in args.batch_size or [1, 4, 16]]
        print(format_table(rows, EXTEND_COLUMNS))
        print(f"float32 matmul 2048^3: {matmul_gflops():.0f} GFLOP/s (the compute roof for the GFLOPs column)")
    print(f"plain copy bandwidth (read+write): {_copy_gbps():.1f} GB/s; threads={torch.get_num_threads()}")


def main(argv=None) -> int:
    args = _parse(argv)
    malloc = not args.no_malloc_tuning and tune_malloc()
    torch.manual_seed(0)
    # the spinners run for the whole measurement (compiles included), so every row shares the same load
    with contend(args.contend):
        _run_cases(args)
    print(f"{describe(args.contend)}; malloc tuning {'on' if malloc else 'off'}; "
          f"{huge_pages_in_use() >> 20} MiB on 2 MiB pages")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
