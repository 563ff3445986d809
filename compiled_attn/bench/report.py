"""Text, agreement check and plot of ``compiled-attn bench`` results (``bench.py`` runs, this formats)."""
from __future__ import annotations

import argparse
import json
import os

import torch

from profiling.timers import format_table

MAX_STEPS_SHOWN = 16
BUSY_WARNING = 0.1  # share of the CPUs used by other processes above which a measurement is flagged


def format_batch_report(backend: str, label: str, r: dict) -> str:
    """One batch size of one backend, in SGLang bench_one_batch's wording."""
    bs = r["batch_size"]
    bucket = f", bucket: {r['prefill_bucket']}" if "prefill_bucket" in r else ""
    lines = [f"== {label}, batch size {bs}, input {r['input_len']}, output {r['output_len']}",
             f"Prefill. latency: {r['prefill_latency_s']:.5f} s, throughput: "
             f"{r['prefill_throughput_tok_s']:10.2f} token/s{bucket}"]
    lat, buckets = r["decode_latencies_s"], r["decode_buckets"]
    for i, (t, bucket) in enumerate(zip(lat, buckets, strict=False)):
        if i == MAX_STEPS_SHOWN:
            lines.append(f"Decode ... {len(lat) - MAX_STEPS_SHOWN} more steps (all in --json)")
            break
        mark = " (first)" if i == 0 else ""
        lines.append(f"Decode {i}.{mark} batch size: {bs}, latency: {t:.5f} s, throughput: {bs / t:10.2f} "
                     f"token/s, bucket: {bucket}")
    lines.append(f"Decode.  median latency: {r['median_decode_s']:.5f} s, median throughput: "
                 f"{r['median_decode_throughput_tok_s']:10.2f} token/s; first/median: "
                 f"{r['first_over_median']:.2f}")
    lines.append(f"Total. latency: {r['total_latency_s']:.3f} s, throughput: {r['total_throughput_tok_s']:10.2f} "
                 f"token/s")
    other = r.get("cpu_share_of_other_processes")
    if other is not None and other > BUSY_WARNING:
        lines.append(f"warning: other processes used {100 * other:.0f}% of the CPUs during this measurement; "
                     f"its latencies are not reliable")
    return "\n".join(lines)


def side_by_side_rows(results: dict, batch_sizes: list[int]) -> list[dict]:
    """Rows of backend x batch size: median/first decode, prefill (ms), and speed-ups over ``loop``: the median of
    the per-round ratios ``loop / backend`` where the rounds were interleaved (``verdict.add_round_ratios``; what the
    verdicts are called on), else the ratio of the medians."""
    loop = results.get("loop", {}).get("results", {})
    rows = []
    for bs in batch_sizes:
        for name, res in results.items():
            r = res["results"].get(bs)
            if r is None:
                continue
            ref = loop.get(bs)
            rows.append({
                "backend": name, "bs": bs,
                "median_decode_ms": r["median_decode_s"] * 1e3,
                "first_decode_ms": r["first_decode_s"] * 1e3,
                "first/median": r["first_over_median"],
                "prefill_ms": r["prefill_latency_s"] * 1e3,
                "decode_x_loop": _x_loop(r, ref, "decode", "median_decode_s"),
                "prefill_x_loop": _x_loop(r, ref, "prefill", "prefill_latency_s"),
                "busy": _busy_mark(r, ref),
            })
    return rows


def _x_loop(r: dict, ref: dict | None, phase: str, latency: str) -> float | None:
    """loop's latency / this backend's in ``phase``: the per-round median when measured, else of the medians."""
    if not ref:
        return None
    return r.get(f"{phase}_x_loop_median", ref[latency] / r[latency])


def _busy_mark(r: dict, ref: dict | None) -> str:
    """'*' when this row (or the loop row it is compared with) ran while other processes took the CPUs."""
    shares = [x.get("cpu_share_of_other_processes") for x in (r, ref) if x]
    return "*" if any(s is not None and s > BUSY_WARNING for s in shares) else ""


def format_side_by_side(results: dict, batch_sizes: list[int]) -> str:
    """The bench's one table: a title with the backends' labels and the repeats, the rows of ``side_by_side_rows``
    and a note on the columns."""
    rows = side_by_side_rows(results, batch_sizes)
    cols = ["backend", "bs", "median_decode_ms", "first_decode_ms", "first/median", "prefill_ms", "decode_x_loop",
            "prefill_x_loop"]
    if any(r["busy"] for r in rows):
        cols.append("busy")
    labels = "; ".join(f"{n} = {r['label']}" for n, r in results.items())
    repeats = next(iter(results.values()))["results"][batch_sizes[0]].get("repeats", 1)
    note = ("x_loop: loop's latency / this backend's, the median over the interleaved rounds (> 1 is faster than "
            "loop); first_decode: the first step after each prefill")
    if any(r["busy"] for r in rows):
        note += (f"; busy *: other processes used > {100 * BUSY_WARNING:.0f}% of the CPUs during that measurement "
                 f"(or its loop reference)")
    return (f"\n== side by side, medians of {repeats} repeat(s), backends interleaved per round ({labels})\n"
            f"{format_table(rows, cols)}\n{note}")


def agreement(results: dict, batch_sizes: list[int]) -> dict:
    """Greedy token ids of every backend against the first one's, per batch size."""
    names = list(results)
    ref_name = names[0]
    diffs = []
    for bs in batch_sizes:
        ref = results[ref_name]["results"][bs]["tokens"]
        for name in names[1:]:
            toks = results[name]["results"][bs]["tokens"]
            bad = [(i, j) for i, (a, b) in enumerate(zip(ref, toks, strict=True))
                   for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
            if bad:
                i, j = bad[0]
                diffs.append({"backend": name, "bs": bs, "mismatches": len(bad), "first": [i, j]})
    if len(names) < 2:
        line = "token agreement: only one backend ran (nothing to compare)"
    elif not diffs:
        line = f"token agreement: OK ({', '.join(names)} identical greedy ids at batch sizes {batch_sizes})"
    else:
        parts = [f"{d['backend']} bs={d['bs']}: {d['mismatches']} ids differ from {ref_name} "
                 f"(first at request {d['first'][0]}, token {d['first'][1]})" for d in diffs]
        line = "token agreement: MISMATCH " + "; ".join(parts)
    return {"ok": not diffs, "reference": ref_name, "diffs": diffs, "line": line}


def write_json(path: str, report: dict) -> None:
    """A benchmark's report as JSON, as ``compiled-attn bench`` writes its own (indent 1; what JSON cannot hold,
    a dtype or a device, as its ``str``)."""
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
        f.write("\n")


def write_plot(results: dict, batch_sizes: list[int], path: str) -> None:
    """Median (solid) and first (dashed) decode latency per batch size per backend; ImportError without
    matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, res in results.items():
        bss = [bs for bs in batch_sizes if bs in res["results"]]
        med = [res["results"][bs]["median_decode_s"] * 1e3 for bs in bss]
        first = [res["results"][bs]["first_decode_s"] * 1e3 for bs in bss]
        line, = ax.plot(bss, med, marker="o", label=f"{name} median")
        ax.plot(bss, first, marker="x", linestyle="--", color=line.get_color(), label=f"{name} first")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode step latency (ms, log)")
    ax.set_title("decode latency per batch size: median and first step after warm-up")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- command-line checks shared by the bench commands: every flag is checked before any work starts ----

class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag gives one line ``prog: error: ...`` on stderr (no usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def int_at_least(minimum: int):
    """An argparse ``type``: an int >= ``minimum`` (so ``--iters 0`` fails at parse time, not after compiling)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    parse.__name__ = f"int>={minimum}"
    return parse


def check_writable(parser: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    """Fail now, not after the run, when ``path`` cannot be written (missing folder, no permission, a folder)."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path):
        parser.error(f"{flag} {path!r} is a directory, expected a file path")
    if not os.path.isdir(folder):
        parser.error(f"{flag} {path!r}: folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        parser.error(f"{flag} {path!r} is not writable")


def check_device(parser: argparse.ArgumentParser, name: str | None) -> torch.device | None:
    """``--device``: cpu or cuda (with an index), and cuda only where this torch has a CUDA device."""
    if name is None:
        return None
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        parser.error(f"--device must be cpu or cuda (or cuda:N), got {name!r}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {name}: no CUDA device is available (this torch: {torch.__version__})")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        parser.error(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
    return device
