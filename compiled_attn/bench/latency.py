"""``compiled-attn bench``: SGLang ``bench_one_batch``-style latency of a reference model, per batch size and per
attention backend (``loop``: per-request SDPA, SGLang torch_native's algorithm; ``eager``: ours, uncompiled;
``compiled``: ours, torch.compile + bucketed graphs, warmed before the first request), side by side.

All engines are built (and the compiled one warmed) first; then, per batch size, the backends are interleaved per
round (every prefill, then decode step 1 of every backend, step 2, ...; who goes first rotates), ``--repeats R``
whole generations (default 3), so a noisy spell lands on every backend alike. It prints one table of backend x
batch size (medians over the repeats; ``x_loop``: the median per-round ratio to ``loop``), one verdict line per
batch size, and a self-check that the greedy token ids agree across backends (fp32; exit status 1 if they do not).

A verdict (``verdict.py``) compares each backend with ``loop``, and ``compiled`` with ``eager``, per phase, on the
per-round ratios of the two (a round: one repeat's prefill, or one decode step of one repeat): their median, and
whether a distribution-free interval of that median lies above 1.0 (faster), below it (slower), within 5% of it
(the same), or straddles 1.0 beyond that band (too noisy, with the interval). ``--verbose`` adds each backend's
per-step report per batch size (prefill, every decode step, median, total), the spread of each latency and the
per-round ratios behind each verdict. ``--contend N`` runs N spinning processes during the rounds
(``contend.py``); measurements taken while other processes held > 10% of the CPUs are flagged.

The default run (no flags: llama-3-8b shapes, 2 layers, vocab 4096, no MLP, batch 1 8 32, input 256, output 8,
all three backends, 3 repeats: 3 prefill and 21 decode rounds per comparison) takes 3-5 minutes on a shared
2-core CPU: the compiled backend's warm-up (decode buckets, then its prefill buckets, the 8192-token one run three
times) 1-2 minutes of it, each repeat 30-60 s, most of that the batch-32 prefills.
``--output-len`` counts generated tokens as SGLang does: the prefill yields the first, then ``output_len - 1``
decode steps. On CPU (glibc) the bench keeps freed buffers in the heap (``tune_malloc``; ``--no-malloc-tuning``).

``--enable-torch-compile`` is on by default for ``compiled`` (``--no-enable-torch-compile`` turns it off: the
bucketed decode and prefill steps then run eager on static buffers / CUDA graphs of the eager steps).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time

import torch

import profiling
from profiling.host import CpuShare, add_malloc_flag, tune_malloc
from profiling.timers import median, spread

from ..runners.decode import GraphConfig
from .backends import BACKENDS, make_backend
from .contend import contend, describe
from .engine import Engine
from .models import PRESETS, build_model, get_config
from .report import (
    OneLineParser,
    agreement,
    check_device,
    check_writable,
    format_batch_report,
    format_side_by_side,
    int_at_least,
    write_plot,
)
from .verdict import CONFIDENCE, SAME_WITHIN, add_round_ratios, comparisons, format_spread, format_verdicts

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
    p.add_argument("--repeats", type=int_at_least(1), default=3, metavar="R",
                   help="whole generations per batch size, backends interleaved per step (default 3: the prefill "
                        "verdicts need 3 rounds)")
    p.add_argument("--contend", type=int_at_least(0), default=0, metavar="N",
                   help="N processes spin on the CPU while timing (after the warm-ups; default 0)")
    p.add_argument("--enable-torch-compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the compiled backend's decode and prefill steps (default: on)")
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
    p.add_argument("--quiet", action="store_true", help="no warm-up progress bar, no progress lines on stderr")
    p.add_argument("--verbose", action="store_true",
                   help="also every backend's per-step report per batch size, the latency spreads and the per-round "
                        "ratios behind each verdict")
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
    """The backend's engine (the compiled one warms its decode buckets and this run's prefill buckets) and record."""
    max_context = args.input_len + args.output_len
    prefills = [[args.input_len] * bs for bs in args.batch_size]  # the compiled backend warms only their buckets
    backend = make_backend(name, graph_config(args, max_context, device), prefill_lens=prefills)
    t0 = time.perf_counter()
    engine = Engine(model, backend, max_batch=max(args.batch_size), max_context=max_context, seed=args.seed)
    setup = {"setup_s": time.perf_counter() - t0, **engine.setup_info}
    if name == "compiled":
        print(engine.backend.warmup_report(setup), flush=True)
    return engine, {"label": backend.label, "setup": setup, "results": {}}


def _rotated(names: list[str], k: int) -> list[str]:
    """``names`` starting at position ``k``: who goes first changes every round, so no backend always runs right
    after the same one (whose cache footprint or frequency boost it would inherit)."""
    k %= len(names)
    return names[k:] + names[:k]


def _empty_record() -> dict:
    """Raw per-repeat measurements of one backend at one batch size."""
    return {"prefill_s": [], "prefill_buckets": [], "decode_s": [], "buckets": [], "tokens": []}


def run_rounds(engines: dict[str, Engine], args, bs: int, profiler=None) -> dict[str, dict]:
    """``--repeats`` generations of ``bs`` prompts, the backends interleaved: every backend's prefill, then
    decode step 1 of every backend, step 2, ... (each engine keeps its own batch between its steps).

    A slow spell on this shared machine then lands on one round of every backend instead of on one backend's
    whole generation. Returns per backend: prefill_s [R], decode_s [R][steps], buckets [R][steps], tokens
    [R] x [bs, output_len] int64.
    """
    names, rec = list(engines), {name: _empty_record() for name in engines}
    rnd = 0
    for r in range(args.repeats):
        for name in _rotated(names, rnd):
            res = engines[name].admit([args.input_len] * bs, seed=args.seed + bs)
            rec[name]["prefill_s"].append(res.latency_s)
            rec[name]["prefill_buckets"].append(res.bucket)
            rec[name]["tokens"].append([res.tokens[:, None]])
            rec[name]["decode_s"].append([])
            rec[name]["buckets"].append([])
        rnd += 1
        for _ in range(args.output_len - 1):
            for name in _rotated(names, rnd):
                _decode_one(engines[name], rec[name], profiler)
            rnd += 1
        for name in names:
            engines[name].release()
            rec[name]["tokens"][r] = torch.cat(rec[name]["tokens"][r], 1)
    return rec


def _decode_one(engine: Engine, rec: dict, profiler) -> None:
    """One decode step of ``engine``'s admitted batch, appended to the current repeat of ``rec``."""
    if profiler is not None:  # record the decode steps only
        profiler.toggle_collection_dynamic(True, list(profiler.activities))
    out = engine.decode(1)
    if profiler is not None:
        profiler.toggle_collection_dynamic(False, list(profiler.activities))
    rec["decode_s"][-1] += out.latencies_s
    rec["buckets"][-1] += out.buckets
    rec["tokens"][-1].append(out.tokens)


def run_backends(model, args, device, profiler=None) -> dict:
    """Every backend's engine first (warm-ups included); then, per batch size and under ``--contend``, the
    interleaved rounds of ``run_rounds``. When a batch size ends: each backend's batch report (``--verbose``), else
    one progress line on stderr (unless ``--quiet``)."""
    engines, results = {}, {}
    for name in args.backend:
        engines[name], results[name] = setup_backend(name, model, args, device)
    with contend(args.contend):
        for bs in args.batch_size:
            share, t0 = CpuShare(), time.perf_counter()
            rec = run_rounds(engines, args, bs, profiler)
            other = share.others()
            for name in engines:
                res = _summarise(bs, args, rec[name])
                res["cpu_share_of_other_processes"] = other
                results[name]["results"][bs] = res
            add_round_ratios(results, bs)
            if args.verbose:
                for name, engine in engines.items():
                    print(format_batch_report(name, engine.backend.label, results[name]["results"][bs]), flush=True)
            elif not args.quiet:
                print(f"{PROG}: batch size {bs} measured ({args.repeats} repeat(s), {time.perf_counter() - t0:.0f} s)",
                      file=sys.stderr, flush=True)
    if "compiled" in engines:
        backend = engines["compiled"].backend
        results["compiled"]["setup"]["graph_stats"] = [vars(s) for s in backend.graphs.stats]
        results["compiled"]["setup"]["prefill_graph_stats"] = vars(backend.extend_graphs.stats)
        results["compiled"]["setup"]["compiles_after_warmup"] = backend.compiles_since_warmup()
    return results


def _summarise(bs: int, args, rec: dict) -> dict:
    """The batch report of one backend: the existing fields (prefill: median over repeats; decode_latencies_s:
    per step, the median over repeats; median_decode_s: over every step of every repeat) plus spreads."""
    by_step = [median(step) for step in zip(*rec["decode_s"], strict=True)]
    d_min, d_med, d_max = spread(t for rep in rec["decode_s"] for t in rep)
    p_min, p_med, p_max = spread(rec["prefill_s"])
    total = p_med + sum(by_step)
    tokens = rec["tokens"]
    return {
        "batch_size": bs, "input_len": args.input_len, "output_len": args.output_len,
        "prefill_latency_s": p_med,
        "prefill_throughput_tok_s": bs * args.input_len / p_med, "prefill_bucket": rec["prefill_buckets"][0],
        "decode_latencies_s": by_step, "decode_buckets": rec["buckets"][0],
        "first_decode_s": by_step[0], "median_decode_s": d_med,
        "median_decode_throughput_tok_s": bs / d_med,
        "first_over_median": by_step[0] / d_med,
        "total_latency_s": total,
        "total_throughput_tok_s": bs * (args.input_len + args.output_len) / total,
        "tokens": tokens[0].cpu().tolist(),
        # spread over --repeats (decode: over every step of every repeat)
        "repeats": args.repeats, "prefill_latencies_s": rec["prefill_s"], "prefill_min_s": p_min,
        "prefill_max_s": p_max, "decode_latencies_by_repeat_s": rec["decode_s"], "decode_min_s": d_min,
        "decode_max_s": d_max, "tokens_same_across_repeats": all(torch.equal(t, tokens[0]) for t in tokens),
    }


def _busy_by_batch(results: dict, batch_sizes: list[int]) -> dict[int, float]:
    """Per batch size, the share of the CPUs other processes used while its rounds ran (one measurement covers
    every backend: they ran interleaved)."""
    first = next(iter(results.values()))["results"]
    return {bs: share for bs in batch_sizes if (share := first[bs].get("cpu_share_of_other_processes")) is not None}


def _repeat_check(results: dict, check: dict) -> dict:
    """Fold "same greedy ids in every repeat" (per backend, per batch size) into the agreement check."""
    bad = [f"{name} bs={bs}" for name, res in results.items() for bs, r in res["results"].items()
           if not r["tokens_same_across_repeats"]]
    if bad:
        check = {**check, "ok": False, "line": check["line"] + "; repeats disagree: " + ", ".join(bad)}
    return check


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
    comps = comparisons(results, args.batch_size)
    if args.verbose:
        print(format_spread(results, args.batch_size, comps))
    print(format_side_by_side(results, args.batch_size))
    print(format_verdicts(comps, args.batch_size, _busy_by_batch(results, args.batch_size)))
    print(describe(args.contend))
    check = _repeat_check(results, agreement(results, args.batch_size))
    strict = dtype == torch.float32
    print(check["line"] + ("" if strict or check["ok"] else " (not fp32: reported, not enforced)"))
    wall = time.perf_counter() - start
    print(f"wall time: {wall:.1f} s")
    report = {"config": {**{k: v for k, v in vars(args).items()}, "device": str(device),
                         "dtype": str(dtype).replace("torch.", ""), "malloc_tuning": malloc,
                         "model_config": vars(cfg).copy(), "threads": torch.get_num_threads(),
                         "torch": torch.__version__},
              "backends": results, "token_agreement": check, "comparisons": comps,
              "verdict_rule": {"confidence": CONFIDENCE, "same_within": SAME_WITHIN},
              "contention": describe(args.contend), "wall_s": wall}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    if args.plot:
        write_plot(results, args.batch_size, args.plot)
        print(f"plot: {args.plot}")
    return 0 if check["ok"] or not strict else 1


if __name__ == "__main__":
    raise SystemExit(main())
