"""The GPU decode benchmark's report (``gpu_decode``): its table, its disagreements and its summary lines."""
from __future__ import annotations

from profiling.timers import format_table

#: the most a replay's output may differ from the eager step's, by dtype (both accumulate in float32; a half
#: precision output rounds at ~2**-8 of values up to ~1)
AGREE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}


def _ratio(row: dict, num: str, den: str) -> float | None:
    return row[num] / row[den] if row.get(num) is not None and row.get(den) else None


def disagreeing(result: dict) -> list[dict]:
    """The rows whose replay and eager step differ by more than ``AGREE`` allows."""
    return [r for r in result["rows"] if r["max_diff_vs_eager"] > AGREE[r["dtype"]]]


def format_rows(rows: list[dict]) -> str:
    cols = ["geom", "ctx", "bs", "first", "step", "replay", "compiled", "eager", "bound", "GB/s", "replay/bound",
            "compiled/bound", "eager/bound", "first/step"]
    table = []
    for r in rows:
        gbs = r["kv_bytes"] / (r["bound_ms"] * 1e6) if r.get("bound_ms") else None
        table.append([r["geometry"], r["ctx"], r["bs"], r["first_ms"], r["step_ms"], r["replay_ms"],
                      r.get("compiled_ms"), r["eager_ms"], r["bound_ms"], gbs, _ratio(r, "replay_ms", "bound_ms"),
                      _ratio(r, "compiled_ms", "bound_ms"), _ratio(r, "eager_ms", "bound_ms"),
                      _ratio(r, "first_ms", "step_ms")])
    return format_table(table, cols, precision=3)


def report(result: dict) -> str:
    lines = [f"decode step, SGLang's CUDA-graph order ({result['run']['sglang']}), {result['run']['device_name']}, "
             f"{result['run']['dtype']}, {result['run']['layers']} layer(s), ms (median of {result['run']['iters']})"]
    lines += [f"note: {n}" for n in result["notes"]]
    lines.append(format_rows(result["rows"]))
    for r in result["rows"]:
        if "compiled_error" in r:
            lines.append(f"ERROR compiled step ({r['geometry']}, ctx {r['ctx']}, bs {r['bs']}): {r['compiled_error']}")
    worst = max((r["max_diff_vs_eager"] for r in result["rows"]), default=None)
    if worst is not None:
        lines.append(f"largest |replay - eager| over the rows: {worst:.3g}")
    lines += [f"ERROR replay differs from eager ({r['geometry']}, ctx {r['ctx']}, bs {r['bs']}): "
              f"{r['max_diff_vs_eager']:.3g} > {AGREE[r['dtype']]}" for r in disagreeing(result)]
    for c in result["capacity"]:
        lines.append(f"capacity cost ({c['geometry']}, bs 1, {c['ctx']} tokens): graph sized for {c['big_tokens']} "
                     f"tokens ({c['big_blocks']} blocks) {c['big_ms']:.3f} ms vs sized for {c['small_tokens']} "
                     f"({c['small_blocks']} blocks) {c['small_ms']:.3f} ms: {c['ratio']:.2f}x")
    lines += [f"ERROR {e}" for e in result["errors"]]
    return "\n".join(lines)
