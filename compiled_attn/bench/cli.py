"""``compiled-attn``: one entry point, subcommands delegate to their modules.

    compiled-attn bench ...            per-bucket prefill/decode latency, backends side by side (bench.py)
    compiled-attn bench-ops ...        one attention op: loop vs eager vs compiled (ops.py; --against sglang, --json)
    compiled-attn bench-step ...       N-layer decode step: warm-up, first/median step, warm restart (bench_step.py)
    compiled-attn bench-sglang ...     our SGLang backend vs SGLang's torch_native on the same ForwardBatches
    compiled-attn serve ...            SGLang's server with --attention-backend compiled_attn (CPU fix-ups applied)
    compiled-attn make-model ...       seeded random-weight HF checkpoint + word-level tokenizer (no download)
    compiled-attn bench-engine ...     live sglang.Engine per backend and batch size: prefill, decode, cold request
    compiled-attn profile ...          an nsys session around ``bench`` (profiling/nsys_session.sh)
    compiled-attn soak ...             random arrivals/finishes through DecodeGraphs, checked against float64
    compiled-attn profile-summary F    time per range from a torch.profiler trace or an nsys CSV
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

import profiling

COMMANDS = {
    "bench": "compiled_attn.bench.latency",
    "bench-ops": "compiled_attn.bench.ops",
    "bench-step": "compiled_attn.bench.step",
    "bench-sglang": "compiled_attn.bench.sglang_layer",
    "soak": "compiled_attn.bench.soak",
    "serve": "compiled_attn.sglang.serve",
    "make-model": "compiled_attn.sglang.make_model",
    "bench-engine": "compiled_attn.bench.engine_bench",
    "profile-summary": "profiling.summary",
}


def _profile(argv: list[str]) -> int:
    script = os.path.join(os.path.dirname(profiling.__file__), "nsys_session.sh")
    return subprocess.call(["bash", script, *argv])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "profile":
        return _profile(rest)
    if command not in COMMANDS:
        print(f"compiled-attn: unknown command {command!r}; choose from "
              f"{', '.join([*COMMANDS, 'profile'])}", file=sys.stderr)
        return 2
    return int(importlib.import_module(COMMANDS[command]).main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
