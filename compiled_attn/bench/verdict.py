"""Verdicts of ``compiled-attn bench``: per batch size and phase, is one backend faster than another?

Each comparison is judged on its per-round ratios (the other's latency / this one's, both timed in the same
interleaved round; > 1: this one is faster): the call is on their median, and on a distribution-free interval of
that median (order statistics, ``median_interval``). Faster or slower when the interval lies above or below 1.0; the
same speed when it lies within ``SAME_WITHIN`` of 1.0; too noisy to call only when it straddles 1.0 and reaches past
that band, which is when more rounds (or a quieter machine) are needed. With fewer than 6 rounds no interval reaches
95%: the interval is then min..max (every round must agree), and the call says so.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from profiling.timers import format_table, round_ratios, spread

from .report import BUSY_WARNING

CONFIDENCE = 0.95  # the coverage sought for the median's interval
SAME_WITHIN = 0.05  # an interval within 1/1.05..1.05 calls the two the same speed
FEWEST_ROUNDS = 3  # fewer rounds are not judged: min..max of 2 rounds covers the median half the time


def median_interval(ratios: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """``(lo, hi, coverage)``: the order statistics ``x_(k) .. x_(n+1-k)`` of ``ratios`` (n values) that hold their
    population median with probability ``coverage`` >= ``confidence`` (k as large as that allows); min..max, with its
    coverage ``1 - 2^(1-n)``, where no k reaches ``confidence`` (n < 6 at 95%).

    Why order statistics: they assume nothing about how the rounds are distributed (a slow spell gives a long
    tail), only that rounds are independent; min..max, which the bench used before, widens as rounds are added."""
    xs = sorted(ratios)
    n = len(xs)
    if n == 0:
        raise ValueError("median_interval() of no ratios")
    k, cover = 1, _coverage(n, 1)
    while k + 1 <= (n + 1) // 2 and _coverage(n, k + 1) >= confidence:
        k += 1
        cover = _coverage(n, k)
    return xs[k - 1], xs[n - k], cover


def _coverage(n: int, k: int) -> float:
    """P(x_(k) <= median <= x_(n+1-k)) for n independent draws: 1 - 2 P(Binomial(n, 1/2) <= k - 1)."""
    tail = sum(math.comb(n, i) for i in range(k)) / 2 ** n
    return 1.0 - 2.0 * tail


def judge(ratios: Sequence[float], same_within: float = SAME_WITHIN) -> dict:
    """The call on one comparison's per-round ratios: ``call`` ("faster" | "slower" | "same" | "too noisy" | "not
    judged"), ``why`` (a reason for the last two, else None), ``every_round`` (the interval is min..max: every
    round had to agree), and the numbers it rests on (rounds, ratio_median, interval_lo/hi, coverage)."""
    n = len(ratios)
    _, med, _ = spread(ratios)
    lo, hi, cover = median_interval(ratios)
    out = {"rounds": n, "ratio_median": med, "interval_lo": lo, "interval_hi": hi, "coverage": cover,
           "every_round": cover < CONFIDENCE, "why": None}
    if n < FEWEST_ROUNDS:
        return {**out, "call": "not judged", "why": f"{n} round(s) only: too few to judge (--repeats 3 or more)"}
    if lo > 1.0:
        return {**out, "call": "faster"}
    if hi < 1.0:
        return {**out, "call": "slower"}
    if 1.0 / (1.0 + same_within) <= lo and hi <= 1.0 + same_within:
        return {**out, "call": "same"}
    why = f"rounds {lo:.2f}..{hi:.2f} straddle 1" if out["every_round"] else \
        f"{100 * cover:.0f}% interval {lo:.2f}..{hi:.2f} straddles 1"
    return {**out, "call": "too noisy", "why": why}


# ---- the comparisons of one bench run ----

def phase_ratios(ref: dict, res: dict) -> dict[str, list[float]]:
    """Per-round latency ratios ref / res of two batch reports at one batch size: {"prefill": [R], "decode":
    [R * steps]} (> 1: res is faster). A round is one repeat's prefill, or one decode step of one repeat."""
    def flat(r):
        return [t for rep in r["decode_latencies_by_repeat_s"] for t in rep]
    return {"prefill": round_ratios(ref["prefill_latencies_s"], res["prefill_latencies_s"]),
            "decode": round_ratios(flat(ref), flat(res))}


def add_round_ratios(results: dict, bs: int) -> None:
    """``{prefill,decode}_x_loop_{min,median,max}``: the per-round ratio loop / backend, on every backend's
    result at ``bs`` (the side-by-side table's x_loop columns are the medians)."""
    if "loop" not in results:
        return
    ref = results["loop"]["results"][bs]
    for res in results.values():
        r = res["results"][bs]
        for phase, ratios in phase_ratios(ref, r).items():
            lo, med, hi = spread(ratios)
            r.update({f"{phase}_x_loop_min": lo, f"{phase}_x_loop_median": med, f"{phase}_x_loop_max": hi})


def comparison_pairs(names: Sequence[str]) -> list[tuple[str, str]]:
    """(backend, against): every backend against ``loop``, and ``compiled`` against ``eager`` (does compiling pay
    for itself?); ``compiled`` first, the backend the bench is about."""
    order = sorted((n for n in names if n != "loop"), key=lambda n: n != "compiled")
    pairs = [(name, "loop") for name in order if "loop" in names]
    if "compiled" in names and "eager" in names:
        pairs.append(("compiled", "eager"))
    return pairs


def comparisons(results: dict, batch_sizes: list[int]) -> list[dict]:
    """Per batch size, phase and pair of ``comparison_pairs``: the per-round ratio's min/median/max and ``judge``'s
    call. ``noisy`` is the reason where the call is "too noisy" or "not judged", else None."""
    out = []
    for bs in batch_sizes:
        for name, ref in comparison_pairs(list(results)):
            ratios = phase_ratios(results[ref]["results"][bs], results[name]["results"][bs])
            for phase, rs in ratios.items():
                lo, _, hi = spread(rs)
                call = judge(rs)
                out.append({"bs": bs, "backend": name, "against": ref, "phase": phase, "ratio_min": lo,
                            "ratio_max": hi, **call, "noisy": call["why"]})
    return out


def verdict_phrase(c: dict) -> str:
    """One comparison in words: ``compiled 1.65x loop (faster)``; the number is the median per-round ratio."""
    head = f"{c['backend']} {c['ratio_median']:.2f}x {c['against']}"
    every = f" in all {c['rounds']} rounds" if c["every_round"] else ""
    if c["call"] in ("faster", "slower"):
        return f"{head} ({c['call']}{every})"
    if c["call"] == "same":
        return f"{head} (same within {100 * SAME_WITHIN:.0f}%{every})"
    return f"{head} ({c['call']}: {c['why']})"


def format_verdicts(comps: list[dict], batch_sizes: list[int], busy: dict[int, float] | None = None) -> str:
    """One line per batch size: each phase's rounds and its comparisons' calls; ``busy[bs]``, the share of the
    CPUs other processes used while it was measured, is added where it passed ``BUSY_WARNING``."""
    lines = []
    for bs in batch_sizes:
        parts = []
        for phase in ("decode", "prefill"):
            here = [c for c in comps if c["bs"] == bs and c["phase"] == phase]
            if here:
                parts.append(f"{phase} ({here[0]['rounds']} rounds) " + ", ".join(verdict_phrase(c) for c in here))
        share = (busy or {}).get(bs)
        note = f"; measured while other processes used {100 * share:.0f}% of the CPUs" \
            if share is not None and share > BUSY_WARNING else ""
        nothing = "nothing to compare (that takes loop and another backend, or eager and compiled)"
        lines.append(f"verdict bs {bs}: " + ("; ".join(parts) or nothing) + note)
    return "\n".join(lines)


def format_spread(results: dict, batch_sizes: list[int], comps: list[dict]) -> str:
    """``--verbose``: per backend and batch size, median and min..max of prefill and decode latency (ms); then
    each comparison's per-round ratios and the interval its verdict rests on (the calls: the verdict lines)."""
    rows = [{"backend": name, "bs": bs, "prefill_ms": r["prefill_latency_s"] * 1e3,
             "prefill_min": r["prefill_min_s"] * 1e3, "prefill_max": r["prefill_max_s"] * 1e3,
             "decode_ms": r["median_decode_s"] * 1e3, "decode_min": r["decode_min_s"] * 1e3,
             "decode_max": r["decode_max_s"] * 1e3}
            for bs in batch_sizes for name, res in results.items() if (r := res["results"].get(bs))]
    repeats = next(iter(results.values()))["results"][batch_sizes[0]]["repeats"]
    text = [f"\n== spread over {repeats} repeat(s), backends interleaved per round (ms; decode: every step of "
            f"every repeat)", format_table(rows, list(rows[0]))]
    if comps:
        crows = [{"bs": c["bs"], "compare": f"{c['backend']}/{c['against']}", "phase": c["phase"],
                  "rounds": c["rounds"], "x_median": c["ratio_median"], "x_min": c["ratio_min"],
                  "x_max": c["ratio_max"], "interval": f"{c['interval_lo']:.2f}..{c['interval_hi']:.2f}",
                  "coverage": f"{100 * c['coverage']:.0f}%"} for c in comps]
        text += ["\nper-round ratio (the other's latency / this one's; > 1: faster) and the interval of its median "
                 "the verdict rests on", format_table(crows, list(crows[0]))]
    return "\n".join(text)
