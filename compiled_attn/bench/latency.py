"""``compiled-attn bench``: SGLang ``bench_one_batch``-style latency of a reference model, per batch size and per
attention backend (``loop``: per-request SDPA, SGLang torch_native's algorithm; ``eager``: ours, uncompiled;
``compiled``: ours, torch.compile + bucketed graphs, warmed before the first request), side by side.

Per batch size it prints prefill latency and throughput, every decode step's latency (the first one marked),
the median decode latency and throughput, and the total; then one table of backend x batch size, and a
self-check that the greedy token ids agree across backends (fp32; exit status 1 if they do not). All engines are
built (and the compiled one warmed) first; then the backends take turns per batch size.

The default run (no flags: llama-3-8b shapes, 2 layers, vocab 4096, no MLP, batch 1 8 32, input 256, output 8,
all three backends) takes under a minute on a 2-core CPU; measurements taken while other processes held > 10% of
the CPUs are flagged.
``--output-len`` counts generated tokens as SGLang does: the prefill yields the first, then ``output_len - 1``
decode steps. On CPU (glibc) the bench keeps freed buffers in the heap (``tune_malloc``; ``--no-malloc-tuning``).

``--enable-torch-compile`` is on by default for ``compiled`` (``--no-enable-torch-compile`` turns it off: the
bucketed step then runs eager on static buffers / CUDA graphs of the eager step).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time

import torch

import profiling
from profiling.host import CpuShare, add_malloc_flag, tune_malloc
from profiling.timers import median

from ..decode_graphs import GraphConfig
from .backends import BACKENDS, make_backend
from .engine import Engine
from .models import PRESETS, build_model, get_config
from .report import (
    OneLineParser,
    agreement,
    check_device,
    check_writable,
    format_batch_report,
    format_side_by_side,
    write_plot,
)

PROG = "compiled-attn bench"


def _fail(msg: str) -> SystemExit:
    return SystemExit(f"{PROG}: {msg}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b", choices=list(PRESETS))
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2, CPU-sized)")
    p.add_argument("--mlp", action="store_true",
                   help="include the SwiGLU MLPs (off by default: the same dense GEMMs in every backend)")
    p.add_argument("--batch-size", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=8, help="generated tokens (prefill's + decode steps)")
    p.add_argument("--backend", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    p.add_argument("--enable-torch-compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the compiled backend's decode step (default: on)")
    p.add_argument("--cuda-graph-bs", nargs="+", type=int, default=None,
                   help="batch-size buckets (default: SGLang's list up to the largest --batch-size)")
    p.add_argument("--torch-compile-max-bs", type=int, default=32)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--plot", default=None, metavar="PATH", help="PNG of median/first decode (needs matplotlib)")
    p.add_argument("--enable-nvtx", action="store_true", help="turn profiling ranges (NVTX + record_function) on")
    p.add_argument("--profile", default="none", choices=["none", "torch"])
    p.add_argument("--trace", default=None, metavar="PATH", help="Chrome trace of the decode steps (--profile torch)")
    add_malloc_flag(p)
    p.add_argument("--quiet", action="store_true", help="no warm-up progress bar")
    args = p.parse_args(argv)
    _validate(p, args)
    return args


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    cfg = PRESETS[args.model]
    for name, values in (("--batch-size", args.batch_size), ("--cuda-graph-bs", args.cuda_graph_bs or [1])):
        if any(v < 1 for v in values):
            p.error(f"{name} values must be >= 1, got {values}")
    if args.layers < 1:
        p.error(f"--layers must be >= 1, got {args.layers}")
    if args.input_len < 1:
        p.error(f"--input-len must be >= 1, got {args.input_len}")
    if args.output_len < 2:
        p.error(f"--output-len must be >= 2 (the prefill's token plus at least one decode step), "
                f"got {args.output_len}")
    if args.input_len + args.output_len > cfg.max_context:
        p.error(f"--input-len + --output-len = {args.input_len + args.output_len} exceeds the context limit "
                f"of {args.model} ({cfg.max_context})")
    if args.torch_compile_max_bs < 1:
        p.error(f"--torch-compile-max-bs must be >= 1, got {args.torch_compile_max_bs}")
    if args.trace and args.profile != "torch":
        p.error("--trace needs --profile torch")
    if args.profile == "torch" and not args.trace:
        p.error("--profile torch needs --trace PATH")
    if args.plot:
        if importlib.util.find_spec("matplotlib") is None:
            p.error("--plot needs matplotlib (pip install 'compiled-attn[plot]')")
    if len(set(args.backend)) != len(args.backend):
        p.error(f"--backend lists a backend twice: {args.backend}")
    check_device(p, args.device)
    for flag, path in (("--json", args.json), ("--plot", args.plot), ("--trace", args.trace)):
        check_writable(p, flag, path)  # now, not after the whole run
    args.batch_size = list(dict.fromkeys(args.batch_size))


def _device_and_dtype(args) -> tuple[torch.device, torch.dtype]:
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise _fail(f"bad --device {name!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise _fail("--device cuda, but no CUDA device is available (this torch: "
                    f"{torch.__version__})")
    if device.type not in ("cpu", "cuda"):
        raise _fail(f"--device must be cpu or cuda, got {name!r}")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    return device, dtype


def graph_config(args, max_context: int, device: torch.device) -> GraphConfig:
    max_bs = max(args.batch_size + (args.cuda_graph_bs or []))
    block = 64
    per_request = -(-max_context // block) * block
    return GraphConfig(max_batch_size=max_bs, max_kv_tokens=max_bs * per_request, max_context_len=max_context,
                       enable_torch_compile=args.enable_torch_compile,
                       torch_compile_max_bs=args.torch_compile_max_bs, cuda_graph_bs=args.cuda_graph_bs,
                       disable_cuda_graph=args.disable_cuda_graph, block_size=block, progress=not args.quiet)


def setup_backend(name: str, model, args, device) -> tuple[Engine, dict]:
    """The backend's engine (the compiled backend warms every bucket here) and its result record."""
    max_context = args.input_len + args.output_len
    backend = make_backend(name, graph_config(args, max_context, device))
    t0 = time.perf_counter()
    engine = Engine(model, backend, max_batch=max(args.batch_size), max_context=max_context, seed=args.seed)
    setup = {"setup_s": time.perf_counter() - t0, **engine.setup_info}
    if name == "compiled":
        g = engine.backend.graphs
        print(f"[{name}] warm-up before the first request: {setup['warmup_s']:.1f} s for {setup['buckets']} "
              f"buckets (batch {list(g.policy.batch_sizes)} x kv tokens {list(g.policy.kv_capacities)}; "
              f"largest first compile {setup['compile_s']:.1f} s)", flush=True)
    return engine, {"label": backend.label, "setup": setup, "results": {}}


def run_batch(name: str, engine: Engine, args, bs: int, profiler=None) -> dict:
    """Prefill ``bs`` prompts, decode, release; print and return the batch's report."""
    share = CpuShare()
    prefill = engine.admit([args.input_len] * bs, seed=args.seed + bs)
    if profiler is not None:  # record the decode steps only
        profiler.toggle_collection_dynamic(True, list(profiler.activities))
    decode = engine.decode(args.output_len - 1)
    if profiler is not None:
        profiler.toggle_collection_dynamic(False, list(profiler.activities))
    engine.release()
    res = _summarise(bs, args, prefill, decode)
    res["cpu_share_of_other_processes"] = share.others()
    print(format_batch_report(name, engine.backend.label, res), flush=True)
    return res


def run_backends(model, args, device, profiler=None) -> dict:
    """Every backend's engine first (warm-ups included), then each batch size with the backends taking turns,
    so a slow spell on this shared machine lands on all of them rather than on whichever ran then."""
    engines, results = {}, {}
    for name in args.backend:
        engines[name], results[name] = setup_backend(name, model, args, device)
    for bs in args.batch_size:
        for name, engine in engines.items():
            results[name]["results"][bs] = run_batch(name, engine, args, bs, profiler)
    if "compiled" in engines:
        backend = engines["compiled"].backend
        results["compiled"]["setup"]["graph_stats"] = [vars(s) for s in backend.graphs.stats]
        results["compiled"]["setup"]["compiles_after_warmup"] = backend.compiles_since_warmup()
    return results


def _summarise(bs: int, args, prefill, decode) -> dict:
    lat = decode.latencies_s
    med = median(lat)
    total = prefill.latency_s + sum(lat)
    tokens = torch.cat([prefill.tokens[:, None], decode.tokens], 1)
    return {
        "batch_size": bs, "input_len": args.input_len, "output_len": args.output_len,
        "prefill_latency_s": prefill.latency_s,
        "prefill_throughput_tok_s": bs * args.input_len / prefill.latency_s,
        "decode_latencies_s": lat, "decode_buckets": decode.buckets,
        "first_decode_s": lat[0], "median_decode_s": med,
        "median_decode_throughput_tok_s": bs / med,
        "first_over_median": lat[0] / med,
        "total_latency_s": total,
        "total_throughput_tok_s": bs * (args.input_len + args.output_len) / total,
        "tokens": tokens.cpu().tolist(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # the ranges switch is process-wide: restore it, so an in-process caller (a test) is left as it was
    with profiling.enabled_ranges(args.enable_nvtx or args.profile == "torch"):
        return _run(args)


def _run(args) -> int:
    device, dtype = _device_and_dtype(args)
    start = time.perf_counter()
    malloc = device.type == "cpu" and not args.no_malloc_tuning and tune_malloc()
    torch.manual_seed(args.seed)
    cfg = get_config(args.model, layers=args.layers, mlp=args.mlp)
    model = build_model(cfg, seed=args.seed, dtype=dtype, device=device)
    print(f"{PROG}: {cfg.name} ({cfg.kind}, {cfg.num_layers} layers, hidden {cfg.hidden}, {cfg.num_heads} q / "
          f"{cfg.num_kv_heads} kv heads, vocab {cfg.vocab}, mlp {'on' if cfg.mlp else 'off'}) on {device} "
          f"{str(dtype).replace('torch.', '')}, threads {torch.get_num_threads()}, "
          f"malloc tuning {'on' if malloc else 'off'}", flush=True)
    profiler = None
    if args.profile == "torch":
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                          + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda"
                                             else []))
        profiler.start()
        profiler.toggle_collection_dynamic(False, list(profiler.activities))
    results = run_backends(model, args, device, profiler)
    if profiler is not None:
        profiler.stop()
        profiler.export_chrome_trace(args.trace)
        print(f"torch.profiler trace of the decode steps: {args.trace}")
    print(format_side_by_side(results, args.batch_size))
    check = agreement(results, args.batch_size)
    strict = dtype == torch.float32
    print(check["line"] + ("" if strict or check["ok"] else " (not fp32: reported, not enforced)"))
    wall = time.perf_counter() - start
    print(f"wall time: {wall:.1f} s")
    report = {"config": {**{k: v for k, v in vars(args).items()}, "device": str(device),
                         "dtype": str(dtype).replace("torch.", ""), "malloc_tuning": malloc,
                         "model_config": vars(cfg).copy(), "threads": torch.get_num_threads(),
                         "torch": torch.__version__},
              "backends": results, "token_agreement": check, "wall_s": wall}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    if args.plot:
        write_plot(results, args.batch_size, args.plot)
        print(f"plot: {args.plot}")
    return 0 if check["ok"] or not strict else 1


if __name__ == "__main__":
    raise SystemExit(main())
