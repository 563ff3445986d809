"""``compiled-attn soak``: a long random serving run through ``DecodeGraphs`` that must stay exact and flat.

Requests arrive and finish at random, so the batch crosses bucket edges all the time; a finished request's slots
go back to the free list poisoned with NaN (as a reused slot or a fresh pool holds junk), its table row keeps its
stale entries, and the padding slot 0 is poisoned before every step. Every ``--check-every`` steps the graph's
output is compared with a float64 per-request reference of the same attention stack. At the end it prints steps,
rate, max error, mismatches, recompiles after warm-up (dynamo's counters), fallbacks and RSS (start, after warm-up,
end) and exits 1 on any mismatch, recompile, fallback or RSS growth over ``--rss-tolerance`` after warm-up.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import dataclass, field

import torch
from torch._dynamo.utils import counters

from ..plan import plan_decode
from ..runners.decode import DecodeGraphs, GraphConfig, RowInput
from .attention_stack import make_caches, make_stack_step
from .models import ATTN_PRESETS, AttnShape, get_attention_shape
from .report import OneLineParser, check_writable, int_at_least

PROG = "compiled-attn soak"
BUCKETS = [1, 2, 4, 8]
TOL = 1e-4  # float32 step against the float64 reference


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass
class Pool:
    """Host bookkeeping of the soak: free slots and rows, and the live requests (row -> [slots])."""

    free_slots: list[int]
    free_rows: list[int]
    live: dict[int, list[int]] = field(default_factory=dict)


class Soak:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        torch.manual_seed(args.seed)
        self.gen = torch.Generator().manual_seed(args.seed)
        self.shape: AttnShape = get_attention_shape(args.model)
        max_bs, width = max(BUCKETS), args.max_context
        num_slots = 2 * max_bs * width + 1
        self.persistent = make_caches(self.shape, args.layers, num_slots)
        self.persistent["req_to_token"] = torch.zeros(4 * max_bs + 1, width, dtype=torch.int32)
        self.step = make_stack_step(self.shape, args.layers)
        config = GraphConfig(max_batch_size=max_bs, max_kv_tokens=max_bs * width, max_context_len=width,
                             cuda_graph_bs=BUCKETS, progress=False)
        self.graphs = DecodeGraphs(self.step, config=config, device="cpu", row_inputs={
            "x": RowInput((self.shape.hq, self.shape.dqk), torch.float32),
            "out_cache_loc": RowInput((), torch.int64, slots=True)})
        self.pool = Pool(list(range(1, num_slots)), list(range(1, self.persistent["req_to_token"].shape[0])))
        self.rng.shuffle(self.pool.free_slots)
        self.caches = [t for name, t in self.persistent.items() if name != "req_to_token"]

    # ---- requests ----

    def _poison(self, slots: list[int]) -> None:
        idx = torch.tensor(slots, dtype=torch.int64)
        for cache in self.caches:
            cache.index_fill_(0, idx, float("nan"))

    def _arrive(self) -> None:
        length = self.rng.randint(1, self.args.max_context - 1)
        row, slots = self.pool.free_rows.pop(), [self.pool.free_slots.pop() for _ in range(length)]
        idx = torch.tensor(slots, dtype=torch.int64)
        for cache in self.caches:
            cache[idx] = torch.randn(len(slots), *cache.shape[1:], generator=self.gen)
        self.persistent["req_to_token"][row, :length] = idx.to(torch.int32)  # past it: stale entries stay
        self.pool.live[row] = slots

    def _finish(self, row: int) -> None:
        slots = self.pool.live.pop(row)
        self._poison(slots)
        self.pool.free_slots.extend(slots)
        self.rng.shuffle(self.pool.free_slots)
        self.pool.free_rows.append(row)

    def _churn(self) -> None:
        """Random finishes and arrivals; a request at the context limit finishes."""
        for row in list(self.pool.live):
            if len(self.pool.live[row]) >= self.args.max_context or self.rng.random() < 0.08:
                self._finish(row)
        target = self.rng.randint(1, max(BUCKETS))
        while len(self.pool.live) < target:
            self._arrive()

    def _batch(self):
        """Every live request decodes one token: a new slot at its next position."""
        rows = sorted(self.pool.live)
        table = self.persistent["req_to_token"]
        locs = []
        for row in rows:
            slot = self.pool.free_slots.pop()
            table[row, len(self.pool.live[row])] = slot
            self.pool.live[row].append(slot)
            locs.append(slot)
        lens = torch.tensor([len(self.pool.live[r]) for r in rows])
        x = torch.randn(len(rows), self.shape.hq, self.shape.dqk, generator=self.gen)
        v0 = self.persistent["k0"][..., : self.shape.dv] if self.shape.mla else self.persistent["v0"]
        meta = plan_decode(x, self.persistent["k0"], v0, table, torch.tensor(rows), lens)
        return meta, {"x": x, "out_cache_loc": torch.tensor(locs)}, rows

    # ---- reference ----

    def _reference(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The attention stack in float64, one request at a time, on a copy of the caches before the step."""
        s, out = self.shape, []
        group = s.hq // s.hkv
        for i, row in enumerate(rows):
            slots = torch.tensor(self.pool.live[row])
            h = x[i].double()
            for layer in range(self.args.layers):
                k = self.persistent[f"k{layer}"][slots].double()
                new_k = h.view(s.hkv, group, s.dqk).mean(1)
                k[-1] = new_k
                if s.mla:
                    v = k[..., : s.dv]
                else:
                    v = self.persistent[f"v{layer}"][slots].double()
                    v[-1] = new_k[..., : s.dv].flip(-1)
                k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
                p = torch.softmax(torch.einsum("hd,khd->hk", h, k) * s.dqk ** -0.5, -1)
                attn = torch.einsum("hk,khd->hd", p, v)
                h = torch.cat([h[..., : s.dv] + attn, h[..., s.dv:]], -1) * 0.5
            out.append(h)
        return torch.stack(out)

    # ---- run ----

    def warmup(self) -> None:
        for cache in self.caches:
            cache.fill_(float("nan"))  # a fresh pool: whatever the allocator held
        self.graphs.warmup(self.persistent)

    def run_step(self, check: bool) -> float | None:
        self._churn()
        meta, inputs, rows = self._batch()
        self._poison([0])  # the padding slot holds whatever padded rows wrote last; here: NaN
        ref = self._reference(inputs["x"], rows) if check else None
        out = self.graphs.run(meta, inputs, self.persistent)
        if ref is None:
            return None
        err = (out.double() - ref).abs().max().item()
        return err if torch.isfinite(out).all() else float("inf")


def run(args) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:  # an in-process caller (a test) gets its thread count back
        torch.set_num_threads(threads)


def _run(args) -> dict:
    soak = Soak(args)
    rss_start = rss_bytes()
    t0 = time.perf_counter()
    soak.warmup()
    warmup_s = time.perf_counter() - t0
    graphs_before = counters["stats"]["unique_graphs"]
    max_err, mismatches, rss_warm = 0.0, 0, None
    t1 = time.perf_counter()
    steps = 0
    for i in range(args.steps):
        if args.max_seconds and time.perf_counter() - t1 > args.max_seconds:
            break  # a time-boxed run reports the steps it did
        steps += 1
        err = soak.run_step(check=i % args.check_every == 0)
        if err is not None:
            max_err = max(max_err, err)
            mismatches += not err <= TOL
        if i + 1 == min(args.settle_steps, args.steps):  # baseline after every bucket's first allocations
            rss_warm = rss_bytes()
    elapsed = time.perf_counter() - t1
    rss_end = rss_bytes()
    rss_warm = rss_warm or rss_end
    return {"model": args.model, "seed": args.seed, "steps": steps, "steps_per_s": steps / elapsed,
            "warmup_s": warmup_s, "checked": -(-steps // args.check_every), "max_error": max_err,
            "mismatches": mismatches, "recompiles": counters["stats"]["unique_graphs"] - graphs_before,
            "fallbacks": sum(s.fallbacks for s in soak.graphs.stats), "rss_start_mb": rss_start / 2**20,
            "rss_warm_mb": rss_warm / 2**20, "rss_end_mb": rss_end / 2**20,
            "rss_growth": (rss_end - rss_warm) / rss_warm if rss_warm else 0.0}


def failures(result: dict, rss_tolerance: float) -> list[str]:
    bad = [f"{result[k]} {k}" for k in ("mismatches", "recompiles", "fallbacks") if result[k]]
    if result["rss_growth"] > rss_tolerance:
        bad.append(f"RSS grew {100 * result['rss_growth']:.1f}% after warm-up (limit {100 * rss_tolerance:g}%)")
    return bad


def parse_args(argv):
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int_at_least(1), default=1000)
    p.add_argument("--model", default="tiny-mha", choices=list(ATTN_PRESETS),
                   help="attention preset (default tiny-mha; mha/mla are the real, much slower shapes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int_at_least(1), default=2)
    p.add_argument("--max-context", type=int_at_least(2), default=128, help="tokens per request at most")
    p.add_argument("--check-every", type=int_at_least(1), default=10, help="compare with float64 every K steps")
    p.add_argument("--settle-steps", type=int_at_least(1), default=200,
                   help="steps after warm-up before the RSS baseline is taken")
    p.add_argument("--rss-tolerance", type=float, default=0.02, help="allowed RSS growth after the baseline")
    p.add_argument("--threads", type=int_at_least(1), default=1,
                   help="intra-op threads (default 1: tiny shapes gain nothing from more, and on a shared machine a "
                        "parallel region stalls on a descheduled second thread)")
    p.add_argument("--max-seconds", type=float, default=None, help="stop after this long (reports steps done)")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    if args.max_seconds is not None and not 0 < args.max_seconds < float("inf"):
        p.error(f"--max-seconds must be a finite number > 0, got {args.max_seconds}")
    if not 0 <= args.rss_tolerance < 10:
        p.error(f"--rss-tolerance must lie in [0, 10), got {args.rss_tolerance}")
    check_writable(p, "--json", args.json)
    return args


def main(argv=None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    result = run(args)
    print(f"soak {args.model} seed {args.seed}: {result['steps']} steps at {result['steps_per_s']:.0f} steps/s "
          f"(warm-up {result['warmup_s']:.1f} s); {result['checked']} checked, max error {result['max_error']:.2e}, "
          f"mismatches {result['mismatches']}; recompiles after warm-up {result['recompiles']}; fallbacks "
          f"{result['fallbacks']}; RSS start {result['rss_start_mb']:.0f} MB, after warm-up "
          f"{result['rss_warm_mb']:.0f} MB, end {result['rss_end_mb']:.0f} MB "
          f"({100 * result['rss_growth']:+.2f}%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    bad = failures(result, args.rss_tolerance)
    if bad:
        print(f"{PROG}: FAILED: {'; '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
