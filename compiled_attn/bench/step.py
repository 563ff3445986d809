"""``compiled-attn bench-step``: an N-layer decode step through ``DecodeGraphs`` (issue: graphs).

Reports, per batch size: first step after ``warmup()`` / median step, the same ratio for a compiled step that
was *not* warmed up (its first call compiles: the spike warm-up removes), compiled vs eager median, and the cold
warm-up time for every bucket. ``--restart`` runs the command twice in fresh processes sharing one inductor cache
directory (and a saved artifacts file) and compares cold vs warm start-up.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from profiling.host import add_malloc_flag, tune_malloc
from profiling.timers import format_table, median, time_fn, time_interleaved

from ..compile_policy import compile_step
from ..plan import plan_decode
from ..runners.decode import DecodeGraphs, GraphConfig, RowInput
from .attention_stack import make_caches, make_stack_step
from .batches import assign_requests
from .models import ATTN_PRESETS, AttnShape, get_attention_shape
from .report import OneLineParser, check_device, check_writable, int_at_least


def _batch(shape: AttnShape, persistent: dict, bs: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    table = persistent["req_to_token"]
    dev = table.device
    rows = assign_requests(table, persistent["k0"].shape[0], [length] * bs, g)
    lens = torch.full((bs,), length, device=dev)
    x = torch.randn(bs, shape.hq, shape.dqk, generator=g).to(dev)
    v0 = persistent["k0"][..., : shape.dv] if shape.mla else persistent["v0"]
    meta = plan_decode(x, persistent["k0"], v0, table, rows, lens)
    rows_in = {"x": x, "out_cache_loc": table[rows, length - 1].long()}
    return meta, rows_in


def _step_inputs(meta, rows_in):
    return {**meta.inputs._asdict(), **rows_in}


def run(args) -> dict:
    if args.cache_dir:
        set_cache_dir(args.cache_dir)
    if args.artifacts:
        load_artifacts(args.artifacts)
    torch.manual_seed(0)
    shape = get_attention_shape(args.model)
    max_bs = max(args.batch_size)
    num_slots = max_bs * args.length + 16
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    persistent = make_caches(shape, args.layers, num_slots, device=dev)
    for t in persistent.values():
        t.normal_()
    persistent["req_to_token"] = torch.zeros(max_bs + 1, args.length, dtype=torch.int32, device=dev)
    step = make_stack_step(shape, args.layers)
    config = GraphConfig(max_batch_size=max_bs, max_kv_tokens=max_bs * args.length, max_context_len=args.length,
                         cuda_graph_bs=args.cuda_graph_bs, progress=not args.quiet,
                         measure_compile=args.measure_compile)
    graphs = DecodeGraphs(step, config=config, device=dev,
                          row_inputs={"x": RowInput((shape.hq, shape.dqk), torch.float32),
                                      "out_cache_loc": RowInput((), torch.int64, slots=True)})
    # a restart reuses the first start's measured compiled-vs-eager choices, saved beside the artifacts
    choices_path = args.artifacts + ".choices.json" if args.artifacts else None
    start = time.perf_counter()
    timings = graphs.warmup(persistent, _load_choices(choices_path))
    warmup_s = time.perf_counter() - start
    if args.artifacts and not os.path.exists(args.artifacts):
        save_artifacts(args.artifacts)
        with open(choices_path, "w") as f:
            json.dump({f"{bs},{kv}": c for (bs, kv), c in graphs.choices().items()}, f)
    rows = []
    for bs in args.batch_size:
        meta, rows_in = _batch(shape, persistent, bs, args.length, seed=bs)
        if sync:
            sync()
        first_start = time.perf_counter()
        graphs.run(meta, rows_in, persistent)
        if sync:
            sync()
        first = time.perf_counter() - first_start
        inputs = _step_inputs(meta, rows_in)
        # round-robin, so a neighbour's burst on this shared machine slows both alike
        times = time_interleaved({"graph": functools.partial(graphs.run, meta, rows_in, persistent),
                                  "eager": functools.partial(step, inputs, persistent)},
                                 warmup=0, iters=args.iters, sync=sync)
        graph_t, eager_t = times["graph"], times["eager"]
        rows.append({"bs": bs, "first_ms": first * 1e3, "median_ms": median(graph_t) * 1e3,
                     "first/median": first / median(graph_t), "eager_ms": median(eager_t) * 1e3,
                     "eager/compiled": median(eager_t) / median(graph_t)})
    if args.no_warmup_check:
        # a compiled step that was never warmed: its first call pays the compile (what warm-up removes)
        torch._dynamo.reset()  # forget the warmed graphs, so this one really compiles at its first call
        cold = compile_step(make_stack_step(shape, args.layers))
        meta, rows_in = _batch(shape, persistent, args.batch_size[0], args.length, seed=99)
        inputs = _step_inputs(meta, rows_in)
        t0 = time.perf_counter()
        cold(inputs, persistent)
        if sync:
            sync()
        first = time.perf_counter() - t0
        med = median(time_fn(lambda: cold(inputs, persistent), warmup=0, iters=args.iters, sync=sync))
        rows.append({"bs": f"{args.batch_size[0]} (no warm-up)", "first_ms": first * 1e3, "median_ms": med * 1e3,
                     "first/median": first / med})
    # per bucket: its first (compiling) run, and which form it replays (warm-up measured compiled vs eager on CPU)
    per_bucket = [{"bs": k[0], "kv_tokens": k[1], "compile_s": round(t["compile_s"], 3),
                   "choice": t.get("choice", "captured" if dev.type == "cuda" else "compiled"),
                   **{f"{n}_ms": round(t[f"{n}_s"] * 1e3, 3) for n in ("compiled", "eager") if f"{n}_s" in t}}
                  for k, t in timings.items()]
    return {"model": args.model, "layers": args.layers, "length": args.length, "warmup_s": warmup_s,
            "buckets": len(timings), "rows": rows, "device": str(dev), "per_bucket": per_bucket}


def _load_choices(path: str | None) -> dict[tuple[int, int], str] | None:
    """The per-bucket choices an earlier start saved (``{"bs,kv": "compiled" | "eager"}``), or None."""
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return {tuple(int(x) for x in key.split(",")): c for key, c in json.load(f).items()}


def _restart(argv: list[str]) -> int:
    """Run twice in fresh processes sharing one inductor cache dir and artifacts file: cold, then warm."""
    with tempfile.TemporaryDirectory() as tmp:
        out = []
        for name in ("cold", "warm"):
            path = os.path.join(tmp, f"{name}.json")
            cmd = [sys.executable, "-m", "compiled_attn.bench.step", *argv, "--cache-dir", os.path.join(tmp, "c"),
                   "--artifacts", os.path.join(tmp, "artifacts.bin"), "--json", path, "--quiet"]
            subprocess.run(cmd, check=True)
            with open(path) as f:
                out.append(json.load(f)["warmup_s"])
        print(f"start-up warm-up: cold {out[0]:.1f} s, warm restart {out[1]:.1f} s "
              f"({100 * out[1] / out[0]:.0f}% of cold)")
    return 0


def _validate(p, args) -> None:
    """Every flag checked before the warm-up starts (which compiles for a minute or more)."""
    check_device(p, args.device)
    check_writable(p, "--json", args.json)
    check_writable(p, "--artifacts", args.artifacts)
    if args.cache_dir and os.path.exists(args.cache_dir) and not os.path.isdir(args.cache_dir):
        p.error(f"--cache-dir {args.cache_dir!r} exists and is not a directory")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = OneLineParser(prog="compiled-attn bench-step", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mha", choices=list(ATTN_PRESETS))
    p.add_argument("--layers", type=int_at_least(1), default=4)
    p.add_argument("--batch-size", nargs="+", type=int_at_least(1), default=[1, 8, 32])
    p.add_argument("--cuda-graph-bs", nargs="+", type=int_at_least(1), default=None)
    p.add_argument("--length", type=int_at_least(1), default=1024, help="context length of every request")
    p.add_argument("--iters", type=int_at_least(1), default=10)
    p.add_argument("--no-warmup-check", action="store_true", help="also time a compiled step never warmed up")
    p.add_argument("--restart", action="store_true", help="measure cold vs warm start-up in two processes")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--artifacts", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--measure-compile", action=argparse.BooleanOptionalAction, default=True,
                   help="CPU: time compiled vs eager per bucket at warm-up and replay the faster (default: on)")
    p.add_argument("--device", default="cpu")
    add_malloc_flag(p)
    args = p.parse_args(argv)
    _validate(p, args)
    if args.restart:
        return _restart([a for a in argv if a != "--restart"])
    if args.device == "cpu" and not args.no_malloc_tuning:
        tune_malloc()
    result = run(args)
    print(f"{args.model} x{args.layers} layers, context {args.length}: warm-up {result['warmup_s']:.1f} s for "
          f"{result['buckets']} buckets")
    print(format_table(result["rows"], ["bs", "first_ms", "median_ms", "first/median", "eager_ms", "eager/compiled"]))
    slowest = sorted(result["per_bucket"], key=lambda b: -b["compile_s"])[:3]
    eager = [f"{b['bs']}x{b['kv_tokens']}" for b in result["per_bucket"] if b["choice"] == "eager"]
    firsts = ", ".join("{}x{} {:.1f} s".format(b["bs"], b["kv_tokens"], b["compile_s"]) for b in slowest)
    print(f"slowest first runs (compile): {firsts}; buckets replaying the eager step (measured faster at "
          f"warm-up): {', '.join(eager) or 'none'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# inductor's caches across restarts (the second start compiles less)

def set_cache_dir(path: str | None) -> None:
    """Point inductor's on-disk caches at ``path`` (kept across restarts, so the second start compiles less)."""
    if path:
        os.makedirs(path, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path


def save_artifacts(path: str) -> bool:
    """Save inductor's compiled artifacts of this process to ``path``; False when torch lacks the API."""
    save = getattr(torch.compiler, "save_cache_artifacts", None)
    if save is None:
        return False
    result = save()
    if result is None:
        return False
    data, _info = result
    with open(path, "wb") as f:
        f.write(data)
    return True


def load_artifacts(path: str) -> bool:
    """Load artifacts saved by ``save_artifacts`` (hot-loads the caches); False when absent or unsupported."""
    load = getattr(torch.compiler, "load_cache_artifacts", None)
    if load is None or not os.path.exists(path):
        return False
    with open(path, "rb") as f:
        load(f.read())
    return True
