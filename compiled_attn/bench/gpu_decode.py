"""The SGLang backend's decode step on a GPU, driven in SGLang's CUDA-graph order (``sglang.testing.graph_order``),
against the one-pass read of the K/V bytes the step must read.

    python -m compiled_attn.bench.gpu_decode --out gpu_decode.json [--bs 1 8 32 64] [--ctx 1024 8192 32768]

Per geometry (``gqa``: Llama-3-8B's 32/8 heads of 128; ``mla``: DeepSeek-V3's absorbed 576/512 latent, 16 heads
per tensor-parallel rank of 8), context and batch size (every request at the full context), in ms:

  first     the first step after capture: static inputs filled, out-of-graph metadata, replay, synchronized
  step      the median of the same
  replay    the median of the graph's replay alone (CUDA events; --iters replays, at least 20 on CUDA)
  compiled  the median step with ``forward_decode`` under ``torch.compile`` (``compile_policy.compile_step``) and
            no graph: the same static inputs and metadata, the block index built eagerly; ``compile_s`` its
            first call (the compile)
  eager     the median of SGLang's path without graphs: ``init_forward_metadata`` on the unpadded batch, then
            ``forward_decode`` eagerly
  bound     the median of one ``.sum()`` over exactly the K/V rows the batch reads (``GB/s``: those bytes / bound)
and the ratios replay / bound, compiled / bound, eager / bound and first / step.

Capacity cost: bs 1 at ``--capacity-ctx`` tokens, replayed through a graph whose block capacity is sized for
``--capacity-big`` tokens (a request table that wide, ``COMPILED_ATTN_GRAPH_KV_TOKENS`` that large) and through
one sized for the batch: both replay medians and their ratio.

Without CUDA it runs a tiny smoke configuration with ``capture=False`` (the CPU twin: the same calls, no graphs)
and says so; its numbers are no GPU's. ``--nvtx`` marks the phases with ``profiling.range`` (NVTX, for nsys);
``--torch-profile TRACE`` records them with torch.profiler (``python -m profiling.summary TRACE``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch

import profiling
from profiling.ranges import format_message

from ..compile_policy import compile_step
from ..sglang import testing as H
from ..sglang.backend_util import GRAPH_KV_TOKENS_ENV
from ..sglang.testing import graph_order as GO
from .gpu_report import disagreeing, format_rows, report
from .report import OneLineParser, check_writable, int_at_least

GPU_GEOMETRIES = {"gqa": H.gqa(num_heads=32, num_kv_heads=8, head_dim=128, name="gqa"),
                  "mla": H.mla_absorbed(num_heads=16)}
SMOKE_GEOMETRIES = {"gqa": H.GEOMETRIES["gqa"], "mla": H.GEOMETRIES["mla_absorbed"]}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MIN_CUDA_ITERS = 20

# --------------------------------------------------------------------------------------------- ranges and clocks


def phase(name: str, **attrs):
    """A named range around a phase: ``profiling.range`` (NVTX + torch.profiler) where ranges are on, else a
    torch.profiler ``record_function`` while a profiler records (no nvtx package needed), else nothing."""
    if profiling.enabled():
        return profiling.range(name, **attrs)
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(format_message(name, attrs))
    return contextlib.nullcontext()


class Clock:
    """Milliseconds of calls on ``device``: CUDA events on CUDA (device time between two points of the stream,
    host gaps included), the host clock elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def once(self, fn: Callable[[], object]) -> float:
        """One call, synchronized before and after, by the host clock (what a caller waits)."""
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return (time.perf_counter() - start) * 1e3

    def each(self, fn: Callable[[], object], iters: int) -> list[float]:
        """``iters`` calls, each timed alone."""
        if not self.cuda:
            return [self.once(fn) for _ in range(iters)]
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return times


# --------------------------------------------------------------------------------------------- the steps


def compiled_forward(backend) -> GO.Forward:
    """A ``graph_order`` layer call whose ``forward_decode`` runs under ``compile_step`` (one compile per backend)."""
    step = compile_step(lambda q, k, v, layer, fb: backend.forward_decode(q, k, v, layer, fb))

    def forward(world, _backend, layer, q, k, v, fb):
        # what RadixAttention.forward does before it reaches the backend
        k3 = k.view(-1, layer.tp_k_head_num, layer.qk_head_dim)
        v3 = v.view(-1, layer.tp_v_head_num, layer.v_head_dim)
        return step(q, k3, v3, layer, fb)

    return forward


def eager_step(world: GO.World, backend, batch: GO.DecodeBatch, fb) -> list[torch.Tensor]:
    """SGLang without graphs: metadata for this batch, then every layer eagerly. [n, Hq * Dv] per layer."""
    with world.scope(backend, fb):
        backend.init_forward_metadata(fb)
        return [GO.layer_call(world, backend, layer, batch.q[i], batch.k[i], batch.v[i], fb)
                for i, layer in enumerate(world.layers)]


def kv_read(world: GO.World, batch: GO.DecodeBatch) -> Callable[[], list[torch.Tensor]]:
    """One ``.sum()`` per layer over the K (and V) rows of the batch's slots: they are one run of the pool's rows
    (``make_batch`` places a batch's keys in consecutive slots, in shuffled order), so the read is the exact bytes."""
    lo, hi = int(batch.slots.min()), int(batch.slots.max()) + 1
    if hi - lo != batch.slots.numel():
        raise ValueError(f"batch: its {batch.slots.numel()} slots are not one run of the pool's rows")
    pool, mla = world.pool, world.geometry.mla
    parts = [pool.get_key_buffer(i)[lo:hi] for i in range(len(world.layers))]
    if not mla:
        parts += [pool.get_value_buffer(i)[lo:hi] for i in range(len(world.layers))]
    return lambda: [p.sum() for p in parts]


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


@contextlib.contextmanager
def _graph_kv_tokens(tokens: int | None):
    """COMPILED_ATTN_GRAPH_KV_TOKENS while a replica allocates its graph state (None: the pool's size)."""
    old = os.environ.get(GRAPH_KV_TOKENS_ENV)
    if tokens is not None:
        os.environ[GRAPH_KV_TOKENS_ENV] = str(tokens)
    else:
        os.environ.pop(GRAPH_KV_TOKENS_ENV, None)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(GRAPH_KV_TOKENS_ENV, None)
        else:
            os.environ[GRAPH_KV_TOKENS_ENV] = old


def measure_context(args, cls, geom_name: str, geom, ctx: int, emit: Callable[[dict], None]) -> None:
    """Every batch size at context ``ctx``: one world (pool of max_bs * ctx slots, table ctx wide, so each graph's
    capacity is its batch's blocks), graphs for all sizes, then per size the columns of the module docstring."""
    sizes = sorted(args.bs)
    world = GO.make_world(geom, device=args.device, dtype=args.dtype, num_layers=args.layers,
                          max_num_reqs=sizes[-1], max_context_len=ctx, pool_size=sizes[-1] * ctx,
                          standin=args.standin, seed=ctx)
    with _graph_kv_tokens(None):
        replica = GO.DecodeGraphReplica(cls(world.runner), world, sizes, capture=args.capture)
    with phase("capture", geom=geom_name, ctx=ctx):
        capture_ms = Clock(args.device).once(replica.capture_all)
    compiled = None
    if args.compiled:
        backend_c = cls(world.runner)
        with _graph_kv_tokens(None):
            compiled = GO.DecodeGraphReplica(backend_c, world, sizes, capture=False,
                                             forward=compiled_forward(backend_c), warmups=0)
        compiled.capture_all()
    eager_backend = cls(world.runner)
    for bs in sizes:
        batch = GO.make_batch(world, [ctx] * bs, first_row=1, first_slot=1, slot_run=args.slot_run)
        row = dict(geometry=geom_name, ctx=ctx, bs=bs, layers=args.layers, dtype=str(args.dtype).replace("torch.", ""),
                   kv_bytes=GO.kv_bytes_read(world, batch), capture_all_ms=capture_ms,
                   graph_blocks=replica.backend.graph_block_capacity(bs))
        row.update(measure_batch(args, world, batch, replica, compiled, eager_backend, dict(geom=geom_name, ctx=ctx,
                                                                                            bs=bs)))
        emit(row)


def measure_batch(args, world: GO.World, batch: GO.DecodeBatch, replica: GO.DecodeGraphReplica,
                  compiled: GO.DecodeGraphReplica | None, eager_backend, tag: dict) -> dict:
    """One batch's columns (ms; ``compile_s`` in s)."""
    clock, bs, row = Clock(args.device), replica.bucket(batch.batch_size), {}

    def graph_step():
        return replica.launch(replica.load(batch))

    with phase("replay_first", **tag):
        row["first_ms"] = clock.once(graph_step)
    with phase("decode_step", form="graph", **tag):
        row["step_ms"] = _median(clock.each(graph_step, args.iters))
    replica.load(batch)
    with phase("replay", **tag):
        row["replay_ms"] = _median(clock.each(lambda: replica.launch(bs), args.iters))
    if compiled is not None:
        def compiled_step():
            return compiled.launch(compiled.load(batch))

        try:
            with phase("compile", **tag):
                row["compile_s"] = clock.once(compiled_step) / 1e3
            with phase("decode_step", form="compiled", **tag):
                row["compiled_ms"] = _median(clock.each(compiled_step, args.iters))
        except Exception as e:  # the other columns still say something; the error is reported with the row
            row["compiled_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    fb = GO.plain_forward_batch(world, batch)
    # the replay and the eager step agree (a fast step that is wrong would not be worth a number); the first eager
    # call also keeps its one-time set-up out of the median
    graphed = [o[: batch.batch_size].float() for o in replica.launch(replica.load(batch))]
    eager = eager_step(world, eager_backend, batch, fb)
    row["max_diff_vs_eager"] = max(float((g - e.float()).abs().max()) for g, e in zip(graphed, eager, strict=True))
    with phase("decode_step", form="eager", **tag):
        row["eager_ms"] = _median(clock.each(lambda: eager_step(world, eager_backend, batch, fb), args.iters))
    read = kv_read(world, batch)
    read()
    with phase("bound", **tag):
        row["bound_ms"] = _median(clock.each(read, args.iters))
    return row


def measure_capacity(args, cls, geom_name: str, geom) -> dict:
    """bs 1 at ``capacity_ctx`` tokens through a graph sized for ``capacity_big`` tokens and one sized for the
    batch (one world whose table is ``capacity_big`` wide; the two graphs differ in COMPILED_ATTN_GRAPH_KV_TOKENS)."""
    clock, small, big = Clock(args.device), args.capacity_ctx, args.capacity_big
    world = GO.make_world(geom, device=args.device, dtype=args.dtype, num_layers=args.layers, max_num_reqs=2,
                          max_context_len=big, pool_size=small, standin=args.standin, seed=7)
    batch = GO.make_batch(world, [small], first_row=1, first_slot=1, slot_run=args.slot_run)
    result = dict(geometry=geom_name, bs=1, ctx=small, big_tokens=big, small_tokens=small)
    for label, tokens in (("big", big), ("small", small)):
        with _graph_kv_tokens(tokens):
            replica = GO.DecodeGraphReplica(cls(world.runner), world, [1], capture=args.capture)
        replica.capture_all()
        replica.launch(replica.load(batch))
        with phase("replay", capacity=label, tokens=tokens):
            result[f"{label}_ms"] = _median(clock.each(lambda r=replica: r.launch(1), args.iters))
        result[f"{label}_blocks"] = replica.backend.graph_block_capacity(1)
        del replica
    result["ratio"] = result["big_ms"] / result["small_ms"]
    return result


def _versions(args) -> dict:
    info = dict(torch=torch.__version__, cuda=torch.version.cuda, device=str(args.device),
                device_name=torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu",
                capture=args.capture, smoke=args.smoke, sglang="stand-ins" if args.standin else "SGLang",
                layers=args.layers, dtype=str(args.dtype).replace("torch.", ""), iters=args.iters,
                slot_run=args.slot_run)
    return info


def run(args) -> dict:
    """Every measurement; the JSON (also written to ``args.out`` after each row, so a run cut short keeps its
    rows)."""
    cls = GO.load_backend_class(args.standin)
    geoms = SMOKE_GEOMETRIES if args.smoke else GPU_GEOMETRIES
    result = dict(run=_versions(args), notes=list(args.notes), rows=[], capacity=[], errors=[])

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    def emit(row):
        result["rows"].append(row)
        save()
        print(format_rows([row]).splitlines()[-1], flush=True)

    def failed(what: dict):
        # a configuration that fails is a finding: reported, and the run goes on to the next one
        traceback.print_exc()
        err = sys.exc_info()[1]
        result["errors"].append(dict(what, error=f"{type(err).__name__}: {err}"))
        save()
        print(f"ERROR {what}: {type(err).__name__}: {err}", flush=True)

    print(format_rows([]), flush=True)
    for name in args.geoms:
        for ctx in args.ctx:
            try:
                measure_context(args, cls, name, geoms[name], ctx, emit)
            except Exception:
                failed(dict(geometry=name, ctx=ctx))
            if args.device.type == "cuda":  # the context's pool and graphs are gone: hand their memory back
                torch.cuda.empty_cache()
    if args.capacity:
        for name in args.geoms:
            try:
                result["capacity"].append(measure_capacity(args, cls, name, geoms[name]))
            except Exception:
                failed(dict(geometry=name, capacity=True))
            save()
    return result


# --------------------------------------------------------------------------------------------- CLI


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(prog="gpu_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_decode.json", help="JSON file (default gpu_decode.json)")
    p.add_argument("--bs", nargs="+", type=int_at_least(1), help="batch sizes (CUDA default 1 8 32 64)")
    p.add_argument("--ctx", nargs="+", type=int_at_least(1), help="context tokens (CUDA default 1024 8192 32768)")
    p.add_argument("--geoms", nargs="+", choices=sorted(GPU_GEOMETRIES), default=sorted(GPU_GEOMETRIES))
    p.add_argument("--layers", type=int_at_least(1), default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), help="CUDA default bfloat16, CPU float32")
    p.add_argument("--iters", type=int_at_least(1), help=f"timed calls per median (CUDA default and least "
                                                          f"{MIN_CUDA_ITERS})")
    p.add_argument("--slot-run", type=int_at_least(1), default=16,
                   help="a request's keys sit in runs of this many consecutive slots, in random order (default 16)")
    p.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=None,
                   help="time the compiled step without graphs (default: on CUDA only; a CPU compile takes minutes)")
    p.add_argument("--capacity", action=argparse.BooleanOptionalAction, default=True, help="the capacity cost")
    p.add_argument("--capacity-ctx", type=int_at_least(1), help="its batch's tokens (CUDA default 1024)")
    p.add_argument("--capacity-big", type=int_at_least(1), help="its large graph's tokens (CUDA default 131072)")
    p.add_argument("--smoke", action="store_true", help="the tiny CPU configuration (the default without CUDA)")
    p.add_argument("--standin", action="store_true", help="SGLang's types as stand-ins even where SGLang imports")
    p.add_argument("--nvtx", action="store_true", help="NVTX ranges around the phases (needs the nvtx package)")
    p.add_argument("--torch-profile", metavar="TRACE", help="record the run with torch.profiler into this .json")
    args = p.parse_args(argv)
    check_writable(p, "--out", args.out)
    check_writable(p, "--torch-profile", args.torch_profile)
    cuda = torch.cuda.is_available()
    args.notes = []
    args.smoke = args.smoke or not cuda
    args.device = torch.device("cuda" if cuda and not args.smoke else "cpu")
    args.capture = args.device.type == "cuda"
    if not args.capture:
        why = "no CUDA device" if not cuda else "--smoke"
        args.notes.append(f"{why}: tiny CPU smoke configuration, capture=False (the same calls, no graphs); "
                          f"these are not GPU numbers")
    big = not args.smoke
    args.bs = args.bs or ([1, 8, 32, 64] if big else [1, 2])
    args.ctx = args.ctx or ([1024, 8192, 32768] if big else [64, 160])
    args.dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if big else torch.float32)
    args.iters = args.iters or (MIN_CUDA_ITERS if big else 3)
    if args.capture and args.iters < MIN_CUDA_ITERS:
        p.error(f"--iters must be >= {MIN_CUDA_ITERS} on CUDA (a median of fewer replays says little), got "
                f"{args.iters}")
    args.compiled = args.capture if args.compiled is None else args.compiled
    args.capacity_ctx = args.capacity_ctx or (1024 if big else 64)
    args.capacity_big = args.capacity_big or (131072 if big else 2048)
    if args.capacity_big < args.capacity_ctx:
        p.error(f"--capacity-big ({args.capacity_big}) must be >= --capacity-ctx ({args.capacity_ctx})")
    H.ensure_sglang_importable()
    if not args.standin and not H.sglang_available():
        args.standin = True
        args.notes.append("SGLang not installed: its types are the replica's stand-ins (graph_order)")
    if args.nvtx:
        try:
            import nvtx  # noqa: F401
        except ImportError:
            args.notes.append("--nvtx: the nvtx package is not installed; phases are torch.profiler ranges only")
        else:
            profiling.set_enabled(True)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    for note in args.notes:
        print(f"note: {note}", flush=True)
    profiler = contextlib.nullcontext()
    if args.torch_profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities)
    with profiler as prof:
        result = run(args)
    if args.torch_profile:
        prof.export_chrome_trace(args.torch_profile)
        print(f"torch.profiler trace: {args.torch_profile}", flush=True)
    print(report(result), flush=True)
    print(f"JSON: {args.out}", flush=True)
    failed = bool(result["errors"] or disagreeing(result)) or any("compiled_error" in r for r in result["rows"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
