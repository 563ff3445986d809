"""``compiled-attn bench-ops``: one attention op, side by side: the per-request SDPA loop (SGLang torch_native's
algorithm), our eager ``run`` and our compiled ``run``, for MHA and absorbed MLA decode at several batch sizes
(``ops_decode.py``), speculative verify (``--ops verify``, ``ops_verify.py``) and (``--ops extend mla-extend``,
``ops_extend.py``) the tiled extend.

Reports medians, ratios to the loop, and effective GB/s (K/V bytes the batch needs / time) next to a plain copy
bandwidth measured in the same run. The candidates are timed in interleaved rounds (one call of each per round) in
balanced orders, each decode and verify call reading the next of copies of its K/V that together exceed 1.5x the
last-level cache (``--warm``: one copy, read by every call), with glibc's allocator tuned as in ``compiled-attn
bench`` (``--no-malloc-tuning`` turns that off). ``--against sglang``: SGLang's own CPU decode kernel as one more
decode column (bf16/fp16), from a kit built outside the project (``--sglang-kit``, ``sglang_kit.py``).
``--json FILE``: every table's rows and columns, the notes and the machine (``machine.py``).
``--sweep-len`` (``sweep.py``): bs=1 MHA decode per context length, with a one-pass read of the same K/V bytes as the
physical bound. ``--contend N``: N processes spin on the CPU while everything is measured (``contend.py``); the
report says so.
"""
from __future__ import annotations

import sys
import time

import torch

from graphs.runner import EAGER_MARGIN
from profiling.host import add_malloc_flag, huge_pages_in_use, last_level_cache_bytes, tune_malloc
from profiling.timers import format_table, median, time_fn

from . import sglang_kit
from .batches import ENGINE_DECODE_TAIL, SLOT_LAYOUTS
from .contend import contend, describe
from .machine import describe_machine
from .ops_common import float32_words, mark_as_bucket, served_form
from .ops_decode import SglangMismatch, bench_case
from .ops_extend import COLUMNS as EXTEND_COLUMNS
from .ops_extend import NEW_LENS, PREFIXES, SHAPES, bench_extend_case, matmul_gflops
from .ops_verify import COLUMNS as VERIFY_COLUMNS
from .ops_verify import bench_verify_case
from .report import BUSY_WARNING, OneLineParser, check_writable, int_at_least, write_json
from .sweep import COLUMNS as SWEEP_COLUMNS
from .sweep import SWEEP_LENS, run_sweep

# bench_case and the helpers moved to ops_decode.py / ops_common.py; still importable from here
__all__ = ["KV_DTYPE_NAMES", "SglangMismatch", "bench_case", "float32_words", "main", "mark_as_bucket",
           "served_form"]

KV_DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                  "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
DECODE_COLUMNS = ["op", "bs", "lens", "slots", "page", "kv", "loop_ms", "eager_ms", "compiled_ms", "read_ms",
                  "eager_x", "compiled_x", "served", "served_x", "x_read", "compiled_GBps"]


def _copy_gbps(nbytes: int = 256 << 20) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / median(time_fn(lambda: dst.copy_(src), warmup=2, iters=5)) / 1e9


def _parse(argv):
    p = OneLineParser(prog="compiled-attn bench-ops", description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", nargs="+", default=None, choices=["mha", "mla", *SHAPES, "verify"],
                   help="default: mha mla (none with --sweep-len); verify: speculative verify of k draft tokens")
    p.add_argument("--draft", nargs="+", default=["2", "4", "8", "tree8"], choices=["2", "4", "8", "tree8"],
                   help="verify: k draft tokens as a chain, or tree8 (a random tree of 8)")
    p.add_argument("--warm", action="store_true",
                   help="decode and verify (not --sweep-len): every call reads the same K/V (from cache where it fits; "
                        "default: each call the next of copies of it that together exceed 1.5x the last-level cache, "
                        "from memory)")
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
                   help="query (model) dtype; verify and extend: the model's and its cache's")
    p.add_argument("--page-size", nargs="+", type=int_at_least(1), default=[1],
                   help="decode: KV cache page sizes (SGLang --page-size; default 1)")
    p.add_argument("--kv-dtype", nargs="+", default=None, choices=list(KV_DTYPE_NAMES),
                   help="decode: KV cache dtypes (default: --dtype); fp8 caches are read with scale 0.5")
    p.add_argument("--slot-layout", nargs="+", default=["scattered"], choices=list(SLOT_LAYOUTS),
                   help="decode and verify: where tokens' KV slots lie: scattered at random (a long-running "
                        "server's free list), or engine (prompts in runs of consecutive slots, the last "
                        f"{ENGINE_DECODE_TAIL} decode steps a batch apart, as a fresh SGLang pool hands them out)")
    p.add_argument("--portable", action="store_true",
                   help="decode: also time the compiled step in the portable matmul form (no kernel)")
    p.add_argument("--against", nargs="+", default=[], choices=["sglang"],
                   help="decode (mha, mla; bf16/fp16): also time SGLang's own CPU decode kernel (decode_attention_cpu, "
                        "from the kit at --sglang-kit, built there on first use), checked against ours first; "
                        "sglang/compiled = its time / ours (> 1: ours is faster)")
    p.add_argument("--sglang-kit", default=None, metavar="PATH",
                   help=f"the SGLang CPU attention kit (a folder with its build.py; default: ${sglang_kit.KIT_ENV}, "
                        f"else {sglang_kit.DEFAULT_KIT} where it exists)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write every table's rows and columns, the notes and the machine here")
    add_malloc_flag(p)
    args = p.parse_args(argv)
    check_writable(p, "--json", args.json)
    return args


def _note(report: dict, line: str) -> None:
    """Print a line under a table and keep it for the JSON."""
    print(line, flush=True)
    report["notes"].append(line)


def _table(report: dict, name: str, rows: list[dict], columns: list[str]) -> None:
    """Print a table and keep every row (all its keys, printed or not) and the printed columns for the JSON."""
    print(format_table(rows, columns), flush=True)
    report["tables"][name] = {"columns": columns, "rows": rows}


def _cache_note(args, cold: int) -> str:
    return ("every call reads the same K/V, as the call before left it in cache (--warm)" if args.warm else
            "every call reads its K/V from memory, as a layer's in a serving step (copies of it, "
            f"{cold / 2**20:.0f} MiB, read in turn; --warm: one)")


def _load_sglang(args, report: dict, decode_ops: list[str]):
    """The SGLang kit's op namespace where ``--against sglang`` asks for it and it loads, else None (one line)."""
    if "sglang" not in args.against:
        return None
    if not decode_ops:
        _note(report, "sglang: --against sglang adds a column to the mha / mla decode tables only (none requested)")
        return None
    path = args.sglang_kit if args.sglang_kit is not None else sglang_kit.default_kit_path()
    kit = sglang_kit.load_kit(path)
    report["sglang"] = {"kit": kit.path, "library": kit.library, "loaded": kit.ops is not None, "line": kit.line}
    _note(report, kit.line)
    return kit.ops


def _decode_table(args, report: dict, decode_ops: list[str], dtype, cold: int) -> None:
    sglang = _load_sglang(args, report, decode_ops)
    kv_dtypes = [KV_DTYPE_NAMES[n] for n in args.kv_dtype] if args.kv_dtype else [dtype]
    rows = [bench_case(op, bs, lens, iters=args.iters, dtype=dtype, page_size=page, kv_dtype=kv, bound=True,
                       slot_layout=layout, portable=args.portable, cold_bytes=cold, sglang=sglang)
            for op in decode_ops for lens in args.lens for bs in args.batch_size or [1, 8, 32]
            for layout in args.slot_layout for page in args.page_size for kv in kv_dtypes
            if not (layout == "engine" and page > 1)]
    cols = DECODE_COLUMNS + (["portable_ms", "kernel_x"] if args.portable else [])
    cols += ["sglang_ms", "sglang/compiled"] if sglang is not None else []
    for r in rows:
        r["busy"] = "?" if r["others_cpu"] is None else "*" if r["others_cpu"] > BUSY_WARNING else ""
    busy = any(r["busy"] == "*" for r in rows)
    _table(report, "decode", rows, cols + (["busy"] if busy else []))
    if busy:
        _note(report, f"busy *: other processes used > {100 * BUSY_WARNING:.0f}% of the CPUs while that row was "
              "timed (others_cpu in --json): its times are not reliable; ?: too short to tell")
    _note(report, "x_read: compiled time / the one-pass read of the same cache bytes (.sum over a contiguous copy); "
          "GBps: the cache bytes stored (in the cache's dtype) / compiled time; served: the form a DecodeGraphs "
          "bucket replays (its warm-up times compiled against eager and keeps compiled unless eager is "
          f"{EAGER_MARGIN:.0%} faster), served_x its ratio to the loop"
          + ("; portable: compiled matmul form, kernel_x = portable / compiled" if args.portable else "")
          + "; " + _cache_note(args, cold))
    if sglang is not None:
        checked = [r["sglang_diff"] for r in rows if "sglang_ms" in r]
        if checked:
            _note(report, "sglang_ms: SGLang's decode_attention_cpu (its intel_amx backend's call: 8 KV splits, no "
                  "K/V write), timed in the same rounds and on the same K/V copies; sglang/compiled = sglang_ms / "
                  f"compiled_ms (> 1: ours is faster); its output matched ours on each case's first call (max abs "
                  f"diff {max(checked):.2g})")
        for why in dict.fromkeys(r["sglang_skipped"] for r in rows if "sglang_skipped" in r):
            kinds = sorted({r["kv"] for r in rows if r.get("sglang_skipped") == why})
            _note(report, f"sglang: no column for the {'/'.join(kinds)} rows: {why}")


def _run_cases(args, report: dict) -> None:
    """Every requested table (sweep, decode ops, verify, extend ops) and the copy bandwidth, under one contention;
    each table and the lines under it also go into ``report``."""
    dtype = getattr(torch, args.dtype)
    ops = args.ops if args.ops is not None else ([] if args.sweep_len is not None else ["mha", "mla"])
    cold = 0 if args.warm else int(1.5 * last_level_cache_bytes())
    report["cold_bytes"] = cold
    if args.sweep_len is not None:
        report["tables"]["sweep"] = {"columns": SWEEP_COLUMNS,
                                     "rows": run_sweep(args.sweep_len or SWEEP_LENS, iters=args.iters, dtype=dtype)}
    decode_ops = [op for op in ops if op in ("mha", "mla")]
    extend_ops = [op for op in ops if op in SHAPES]
    if decode_ops:
        _decode_table(args, report, decode_ops, dtype, cold)
    else:
        _load_sglang(args, report, decode_ops)  # says that the column is the decode tables' only, where asked
    if "verify" in ops:
        rows = [bench_verify_case(bs, int(d.removeprefix("tree")), d.startswith("tree"), args.iters,
                                  slot_layout=layout, dtype=dtype, window=window, cold_bytes=cold)
                for window in args.window for layout in args.slot_layout for d in args.draft
                for bs in args.batch_size or [1, 8, 32]]
        _table(report, "verify", rows, VERIFY_COLUMNS)
        _note(report, "x_decode1: verify time / one decode step (the K/V are read once for all k queries); loop_x: "
              "the masked per-request SDPA loop / verify; _eager: uncompiled, as SGLang's CPU speculation runs "
              "verify (eager_x_decode1: verify / decode step, both so); cached_x_decode1: verify over K/V in cache "
              "(every slot folded into a few: the arithmetic alone) / one decode step, the least x_decode1 could be "
              "with every read overlapped; x_read: verify / a one-pass read of the K/V bytes (.sum); "
              + _cache_note(args, cold))
    if extend_ops:
        rows = [bench_extend_case(op, bs, new, prefix, iters=args.iters, dtype=dtype) for op in extend_ops
                for new in args.new for prefix in args.prefix for bs in args.batch_size or [1, 4, 16]]
        _table(report, "extend", rows, EXTEND_COLUMNS)
        report["matmul_GFLOPs"] = matmul_gflops()
        _note(report, f"float32 matmul 2048^3: {report['matmul_GFLOPs']:.0f} GFLOP/s (the compute roof for the "
              "GFLOPs column)")
    report["copy_GBps"] = _copy_gbps()
    _note(report, f"plain copy bandwidth (read+write): {report['copy_GBps']:.1f} GB/s; "
          f"threads={torch.get_num_threads()}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    malloc = not args.no_malloc_tuning and tune_malloc()
    torch.manual_seed(0)
    start = time.perf_counter()
    report = {"command": "bench-ops", "argv": argv, "tables": {}, "notes": []}
    # the spinners run for the whole measurement (compiles included), so every row shares the same load
    with contend(args.contend):
        try:
            _run_cases(args, report)
        except SglangMismatch as e:  # SGLang's kernel computed something else: no column, no table
            print(f"compiled-attn bench-ops: error: {e}", file=sys.stderr)
            return 1
    _note(report, f"{describe(args.contend)}; malloc tuning {'on' if malloc else 'off'}; "
          f"{huge_pages_in_use() >> 20} MiB on 2 MiB pages")
    if args.json:
        report["config"] = {**vars(args), "threads": torch.get_num_threads(), "malloc_tuning": malloc,
                            "contention": describe(args.contend), "huge_pages_bytes": huge_pages_in_use()}
        report["machine"] = describe_machine()
        report["wall_s"] = time.perf_counter() - start
        write_json(args.json, report)
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
