"""``compiled-attn bench-ops``: one attention op, side by side: the per-request SDPA loop (SGLang torch_native's
algorithm), our eager ``run`` and our compiled ``run``, for MHA and absorbed MLA decode at several batch sizes.

Reports medians, ratios to the loop, and effective GB/s (K/V bytes the batch needs / time) next to a plain copy
bandwidth measured in the same run. The three are timed round-robin (one call of each per round), with glibc's
allocator tuned as in ``compiled-attn bench`` (``--no-malloc-tuning`` turns that off).
"""
from __future__ import annotations

import argparse

import torch

from profiling.host import add_malloc_flag, tune_malloc
from profiling.timers import format_table, median, time_fn, time_interleaved

from .compile_policy import compile_step
from .decode import build_decode_index, decode_blocks
from .loop_baseline import loop_decode
from .plan import plan_decode

SHAPES = {"mha": dict(hq=32, hkv=8, d=128, dv=128, mla=False), "mla": dict(hq=16, hkv=1, d=576, dv=512, mla=True)}


def _make_batch(shape: dict, lens: list[int], dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    slots = total + 1
    k_cache = torch.randn(slots, shape["hkv"], shape["d"], generator=g).to(dtype)
    v_cache = k_cache[..., : shape["dv"]] if shape["mla"] else torch.randn(slots, shape["hkv"], shape["dv"],
                                                                           generator=g).to(dtype)
    perm = (torch.randperm(slots - 1, generator=g) + 1).to(torch.int32)
    table = torch.zeros(len(lens) + 1, max(lens), dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        table[i + 1, :n] = perm[used:used + n]
        used += n
    rows = torch.arange(1, len(lens) + 1)
    q = torch.randn(len(lens), shape["hq"], shape["d"], generator=g).to(dtype)
    return q, k_cache, v_cache, table, rows, torch.tensor(lens)


def _copy_gbps(nbytes: int = 256 << 20) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / median(time_fn(lambda: dst.copy_(src), warmup=2, iters=5)) / 1e9


def _decode_step(q, k_cache, v_cache, table, rows, lo, hi, block_ids, block_offsets, scale, v_shares_k):
    index = build_decode_index(table, rows, lo, hi, block_ids, block_offsets)
    return decode_blocks(q, k_cache, v_cache, index, scale, v_shares_k=v_shares_k)


def bench_case(name: str, bs: int, lens_kind: str, *, iters: int, dtype, seed: int = 0) -> dict:
    shape = SHAPES[name]
    g = torch.Generator().manual_seed(seed + bs)
    lens = (torch.randint(256, 2049, (bs,), generator=g).tolist() if lens_kind == "mixed" else [1024] * bs)
    q, k_cache, v_cache, table, rows, seq_lens = _make_batch(shape, lens, dtype, seed)
    scale = shape["d"] ** -0.5
    meta = plan_decode(q, k_cache, v_cache, table, rows, seq_lens)
    args = (q, k_cache, v_cache, table, meta.req_rows, meta.kv_lo, meta.kv_hi, meta.block_ids, meta.block_offsets)
    compiled = compile_step(_decode_step)
    loop = lambda: loop_decode(q, k_cache, v_cache, table, rows, seq_lens, scale=scale)  # noqa: E731
    eager = lambda: _decode_step(*args, scale, shape["mla"])  # noqa: E731
    comp = lambda: compiled(*args, scale, shape["mla"])  # noqa: E731
    ref = loop()
    for fn in (eager, comp):  # the three must agree before any of them is timed
        torch.testing.assert_close(fn().float(), ref.float(), atol=2e-2, rtol=2e-2)
    # round-robin, so a neighbour's burst on this shared machine slows all three alike
    times = time_interleaved({"loop": loop, "eager": eager, "compiled": comp}, warmup=1, iters=iters)
    t = {k: median(v) for k, v in times.items()}
    kv_bytes = sum(lens) * shape["hkv"] * (shape["d"] + (0 if shape["mla"] else shape["dv"])) * k_cache.element_size()
    return {"op": f"{name} decode", "bs": bs, "lens": lens_kind, "loop_ms": t["loop"] * 1e3,
            "eager_ms": t["eager"] * 1e3, "compiled_ms": t["compiled"] * 1e3,
            "eager_x": t["loop"] / t["eager"], "compiled_x": t["loop"] / t["compiled"],
            "compiled_GBps": kv_bytes / t["compiled"] / 1e9}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="compiled-attn bench-ops", description=__doc__)
    p.add_argument("--ops", nargs="+", default=["mha", "mla"], choices=list(SHAPES))
    p.add_argument("--batch-size", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--lens", nargs="+", default=["mixed", "1024"], choices=["mixed", "1024"])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add_malloc_flag(p)
    args = p.parse_args(argv)
    if any(b < 1 for b in args.batch_size):
        p.error("--batch-size values must be >= 1")
    malloc = not args.no_malloc_tuning and tune_malloc()
    torch.manual_seed(0)
    rows = [bench_case(op, bs, lens, iters=args.iters, dtype=getattr(torch, args.dtype))
            for op in args.ops for lens in args.lens for bs in args.batch_size]
    cols = ["op", "bs", "lens", "loop_ms", "eager_ms", "compiled_ms", "eager_x", "compiled_x", "compiled_GBps"]
    print(format_table(rows, cols))
    print(f"plain copy bandwidth (read+write): {_copy_gbps():.1f} GB/s; threads={torch.get_num_threads()}; "
          f"malloc tuning {'on' if malloc else 'off'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
