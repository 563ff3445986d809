"""``compiled-attn bench-ops --sweep-len [L ...]``: one request (bs=1) of llama-3-8b's attention (32 q / 8 kv heads x
128) decoding at each context length, ours eager and compiled against the per-request loop, next to a one-pass read
of the same K/V bytes (the physical bound), all timed round-robin in the same run.

The question it answers: is the time per token smooth in the context length, or does it step somewhere (e.g.
between 4096 and 4160 tokens, where a bucket or a tile boundary could be crossed)?
"""
from __future__ import annotations

import torch

from profiling.timers import format_table

from .ops_decode import bench_case

SWEEP_LENS = [64, 256, 1024, 2048, 4096, 4160, 8192, 16384]
COLUMNS = ["len", "loop_ms", "eager_ms", "compiled_ms", "read_ms", "loop_us/1k", "eager_us/1k", "compiled_us/1k",
           "read_us/1k", "eager_x", "compiled_x", "served", "served_x", "compiled/read"]
STEP_FACTOR = 1.25  # a rise in time per token this large between neighbouring lengths is called a step


def sweep_row(length: int, *, iters: int, dtype) -> dict:
    """One context length: ms per call, us per 1k context tokens, ratios to the loop and to the bound read."""
    r = bench_case("mha", 1, str(length), iters=iters, dtype=dtype, lens=[length], bound=True)
    per_1k = 1e3 * 1e3 / length  # ms per call -> us per 1k tokens
    row = {"len": length, **{k: r[k] for k in ("loop_ms", "eager_ms", "compiled_ms", "read_ms", "eager_x",
                                                "compiled_x", "served", "served_x")}}
    for name in ("loop", "eager", "compiled", "read"):
        row[f"{name}_us/1k"] = r[f"{name}_ms"] * per_1k
    row["compiled/read"] = r["compiled_ms"] / r["read_ms"]
    return row


def steps(rows: list[dict], factor: float = STEP_FACTOR) -> list[tuple[str, int, int, float]]:
    """Each place where a backend's time per token rises by more than ``factor`` from one length to the next
    (with fixed costs amortised it should only fall): (backend, shorter len, longer len, rise); [] when smooth."""
    out = []
    for name in ("loop", "eager", "compiled"):
        col = f"{name}_us/1k"
        for a, b in zip(rows, rows[1:], strict=False):
            if b[col] > factor * a[col]:
                out.append((name, a["len"], b["len"], b[col] / a[col]))
    return out


def _recheck(found: list[tuple[str, int, int, float]], *, iters: int, dtype) -> list[str]:
    """Re-measure both lengths of every step found and say whether it came back: each length is timed at one
    moment, so a neighbour's burst can fake a step that a second measurement does not show."""
    lines = []
    for name, a, b, rise in found:
        again = steps([sweep_row(n, iters=iters, dtype=dtype) for n in (a, b)])
        seen = [r for n, *_, r in again if n == name]
        verdict = (f"confirmed on re-measure ({seen[0]:.2f}x)" if seen
                   else "not reproduced on re-measure: noise, not the code")
        lines.append(f"{name}: time per 1k tokens rises {rise:.2f}x from {a} to {b} tokens; {verdict}")
    return lines


def run_sweep(lengths: list[int], *, iters: int, dtype=torch.float32) -> list[dict]:
    """Rows of ``sweep_row`` per length (ascending), printed as one table with the step check below it."""
    rows = [sweep_row(n, iters=iters, dtype=dtype) for n in sorted(set(lengths))]
    print("== bs=1 MHA decode (llama-3-8b attention: 32 q / 8 kv heads x 128), per context length; "
          "read = one .sum() over a contiguous copy of the same K/V bytes", flush=True)
    print(format_table(rows, COLUMNS), flush=True)
    found = steps(rows)
    print("\n".join(_recheck(found, iters=iters, dtype=dtype)) if found else
          f"time per token: no rise above {STEP_FACTOR:.2f}x between neighbouring lengths (smooth)")
    return rows
