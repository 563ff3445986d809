"""``compiled-attn bench-engine``'s summary: per backend and batch size, the timed rounds' medians and the cold
request against a steady one (``engine_bench.py`` measures, this sums up and formats).

The cold request is each batch size's warm-up batch, the first request of that size the engine served since it
started: from submission to its last token (time to first token plus every decode step), so a compile or a graph
capture shows wherever it lands, in the prefill or in any decode step. The steady request is the same measure over
the timed rounds (median), with prompts and lengths of the same size.
"""
from __future__ import annotations

import statistics

COLD_FLAG = 1.3  # a cold request above this multiple of a steady one gets a line saying where its time went
PHASES = ("prefill_s", "first_decode_s", "median_decode_s", "request_s")


def summarise_one(warmup: dict, runs: list[dict]) -> dict:
    """One backend at one batch size (seconds): the medians over ``runs`` (the timed rounds; ``batch_timings``
    dicts) of prefill, first and median decode; steady_request_s (their median request_s); the warm-up batch's
    request_s, prefill_s and first_decode_s as cold_*; cold_over_steady = cold_request_s / steady_request_s."""
    m = {k: statistics.median(x[k] for x in runs) for k in PHASES}
    steady = m.pop("request_s")
    return dict(m, steady_request_s=steady, cold_request_s=warmup["request_s"], cold_prefill_s=warmup["prefill_s"],
                cold_first_decode_s=warmup["first_decode_s"], cold_over_steady=warmup["request_s"] / steady)


def summarise(results: dict, backends: list[str], batch_sizes: list[int]) -> dict[str, dict]:
    """``summarise_one`` for every ``"{backend} bs={bs}"`` of ``results`` (its ``warmup`` and ``runs``)."""
    keys = [f"{b} bs={bs}" for bs in batch_sizes for b in backends]
    return {key: summarise_one(results["warmup"][key], results["runs"][key]) for key in keys}


def cold_note(backend: str, bs: int, row: dict) -> str | None:
    """Where a cold request's extra time went (before its first token, or in its decode steps), when it took more
    than ``COLD_FLAG`` times a steady request; else None."""
    if row["cold_over_steady"] <= COLD_FLAG:
        return None
    steady_prefill = row["prefill_s"]
    cold_decode = row["cold_request_s"] - row["cold_prefill_s"]
    steady_decode = row["steady_request_s"] - steady_prefill
    return (f"# {backend} bs={bs}: the first request took {_duration(row['cold_request_s'])} against "
            f"{_duration(row['steady_request_s'])} steady: {_duration(row['cold_prefill_s'])} to its first token "
            f"({_duration(steady_prefill)} steady), {_duration(cold_decode)} decoding ({_duration(steady_decode)} "
            f"steady)")


def _duration(s: float) -> str:
    """Seconds as text a reader compares at a glance: ``28.80 s``, ``16.8 ms``."""
    return f"{s:.2f} s" if s >= 1.0 else f"{1000 * s:.1f} ms"


def _ms(s: float) -> str:
    return f"{1000 * s:.1f}"


def format_summary(summary: dict[str, dict], backends: list[str], batch_sizes: list[int]) -> str:
    """The table: per batch size and backend, prefill, first and median decode (ms, medians of the timed rounds),
    first/median, the cold and steady request (ms) and cold/steady; a note on the cold columns; a ``cold_note`` for
    each cold request above ``COLD_FLAG``."""
    head = (f"{'backend':24} {'bs':>4} {'prefill ms':>10} {'1st dec ms':>10} {'med dec ms':>10} {'1st/med':>8} "
            f"{'cold req ms':>11} {'steady req ms':>13} {'cold/steady':>11}")
    lines = [head]
    notes = []
    for bs in batch_sizes:
        for b in backends:
            r = summary[f"{b} bs={bs}"]
            lines.append(f"{b:24} {bs:4d} {_ms(r['prefill_s']):>10} {_ms(r['first_decode_s']):>10} "
                         f"{_ms(r['median_decode_s']):>10} {r['first_decode_s'] / r['median_decode_s']:8.2f} "
                         f"{_ms(r['cold_request_s']):>11} {_ms(r['steady_request_s']):>13} "
                         f"{r['cold_over_steady']:11.2f}")
            if (note := cold_note(b, bs, r)) is not None:
                notes.append(note)
    lines += ["# cold req: the first request of that batch size since start-up, from submission to its last token "
              "(time to first token + every decode step),",
              "# so a compile or capture shows wherever it falls; steady req: the same, median of the timed rounds"]
    return "\n".join(lines + notes)
