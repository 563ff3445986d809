"""``compiled-attn bench-engine``: a live SGLang engine, per attention backend and batch size (CPU or GPU).

    compiled-attn bench-engine [--model tiny-llama | --model-path DIR] [--backend torch_native,compiled_attn,
        compiled_attn+compile] [--batch-size 1,8,32] [--context 1024] [--decode-steps 32] [--rounds 3] [--threads 2]
        [--context-length N] [--max-total-tokens N] [--absorbed-prefill] [--dtype auto|float32|bfloat16|float16]
        [--draft-model-path DIR]

Each backend gets its own ``sglang.Engine`` (``serve.engine``: CPU fix-ups, random-weight model from
``make_model`` unless ``--model-path``), each in a worker subprocess of its own (SGLang keeps one engine per
process), all started first and kept up; the engines then take turns: round r runs batch size 1 on every
backend, then batch size 8 on every backend, ..., the backend order rotating each round, so slow drifts of the
machine hit every backend alike. ``--sleep-on-idle`` is set, so a waiting engine does not spin on the cores.
One warm-up batch per backend and batch size precedes the timed rounds.

A timed batch: ``bs`` requests of ``--context`` random tokens (radix cache flushed first), submitted at once,
greedy, ``--decode-steps`` + 1 new tokens, streamed. With ``T_k`` the time all requests have ``k`` tokens:
prefill = ``T_1`` (from submission; all prompts prefilled and one token sampled), first decode = ``T_2 - T_1``,
median decode = the median of ``T_{k+1} - T_k``, request = ``T_{steps+1}`` (submission to the last token); reported
as the median over rounds. ``cold req`` is the request time of the warm-up batch, the first request of that batch
size since the engine started, and ``cold/steady`` its multiple of the median request (``engine_report.py``): a
backend that compiles or captures on first use shows there wherever it does, in the time to first token or in any
decode step, and a line says which. Tokens that reach the client together (on 2 cores the client is sometimes
descheduled and stream chunks coalesce) share the interval since the previous arrival evenly. This is what a client
sees: it includes the scheduler, sampling, detokenizer and IPC, not only the forward pass.

``compiled_attn+eagle`` (not in the default list): our backend under SGLang's EAGLE speculative decoding (chains of
3 draft tokens), the draft head ``--draft-model-path`` or, for a Llama, ``make_eagle``'s seeded random one (its
drafts are rarely accepted: the row then shows what drafting and verifying cost). A step commits several tokens at
once; spread as above, its median decode is the time per token, and a line per batch size compares tokens/s with
and without speculation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from .engine_report import format_summary, summarise
from .report import int_at_least

BACKENDS = {
    "torch_native": dict(attention_backend="torch_native", disable_cuda_graph=True),
    "compiled_attn": dict(attention_backend="compiled_attn", disable_cuda_graph=True),
    "compiled_attn+compile": dict(attention_backend="compiled_attn", enable_torch_compile=True),
    "compiled_attn+eagle": dict(attention_backend="compiled_attn", disable_cuda_graph=True, page_size=1,
                                speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=1,
                                speculative_num_draft_tokens=4),
}
DEFAULT_BACKENDS = ["torch_native", "compiled_attn", "compiled_attn+compile"]
MARK = "@@engine_bench "  # protocol lines on the worker's stdout (SGLang may print there too)


def _int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return sorted(set(out))


def _backends(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in BACKENDS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {bad or text!r}; choose from {', '.join(BACKENDS)}")
    return list(dict.fromkeys(out))


def parse_args(argv: list[str]) -> argparse.Namespace:
    from ..sglang.make_model import PRESETS

    p = argparse.ArgumentParser(prog="compiled-attn bench-engine", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="tiny-llama", choices=sorted(PRESETS), help="make_model preset")
    src.add_argument("--model-path", help="an existing checkpoint directory instead of --model")
    p.add_argument("--backend", type=_backends, default=DEFAULT_BACKENDS,
                   help=f"comma-separated: {', '.join(BACKENDS)} (default {','.join(DEFAULT_BACKENDS)})")
    p.add_argument("--batch-size", type=_int_list, default=[1, 8, 32], help="comma-separated (default 1,8,32)")
    p.add_argument("--context", type=int_at_least(1), default=1024, help="prompt tokens per request (default 1024)")
    p.add_argument("--decode-steps", type=int_at_least(2), default=32, help="timed decode steps per batch (default 32)")
    p.add_argument("--context-length", type=int_at_least(1), default=None,
                   help="the engine's --context-length (default: --context + --decode-steps + 8); a server runs the "
                        "model's maximum, and SGLang's decode graphs are sized for it")
    p.add_argument("--max-total-tokens", type=int_at_least(1), default=None,
                   help="the KV pool's tokens (default: the largest batch's requests, + 256); a server's pool is "
                        "far larger, and a decode graph's block capacity grows with it")
    p.add_argument("--rounds", type=int_at_least(1), default=3, help="timed rounds (default 3)")
    p.add_argument("--threads", type=int_at_least(1), default=2, help="OMP_NUM_THREADS of every engine (default 2)")
    p.add_argument("--chunked-prefill-size", type=int_at_least(1), default=4096)
    p.add_argument("--absorbed-prefill", action="store_true",
                   help="DeepSeek (MLA) models: every engine prefills through SGLang's absorbed-MLA path, as it does "
                        "a prompt with a cached prefix, not its MHA path, which torch_native cannot run (decode is "
                        "absorbed either way)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the engine's --dtype: weights, activations and KV cache (default auto: the checkpoint's, "
                        "float32 for make_model's presets; CPU servers commonly run bfloat16)")
    p.add_argument("--draft-model-path", help="compiled_attn+eagle's EAGLE draft head (default: make_eagle's random "
                                              "head for the model, a Llama)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int_at_least(1), default=1800, help="seconds an engine may take to start")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    if args.model_path:
        if not os.path.isfile(os.path.join(args.model_path, "config.json")):
            p.error(f"--model-path {args.model_path}: no config.json there")
        max_pos = json.load(open(os.path.join(args.model_path, "config.json"))).get("max_position_embeddings")
    else:
        max_pos = PRESETS[args.model]["max_position_embeddings"]
    if max_pos and args.context + args.decode_steps + 1 > max_pos:
        p.error(f"--context {args.context} + --decode-steps {args.decode_steps} + 1 exceeds the model's "
                f"max_position_embeddings {max_pos}")
    if args.context_length is not None and not (args.context + args.decode_steps + 1 <= args.context_length
                                                <= (max_pos or args.context_length)):
        p.error(f"--context-length {args.context_length} must hold --context + --decode-steps + 1 "
                f"({args.context + args.decode_steps + 1}) and not exceed max_position_embeddings {max_pos}")
    model_type = (json.load(open(os.path.join(args.model_path, "config.json"))).get("model_type") if args.model_path
                  else PRESETS[args.model]["model_type"])
    if "compiled_attn+eagle" in args.backend and not args.draft_model_path and model_type != "llama":
        p.error(f"--backend compiled_attn+eagle: a {model_type} model needs --draft-model-path (make_eagle writes "
                "heads for Llama models only)")
    if args.json:
        d = os.path.dirname(os.path.abspath(args.json))
        if not os.access(d, os.W_OK):
            p.error(f"--json {args.json}: directory {d} is not writable")
    return args


# --- worker (one engine) -------------------------------------------------------------------------------------


def run_scheduler_absorbed_prefill(*args, **kwargs):
    """SGLang's scheduler process with DeepSeek's prefill dispatched to the absorbed MLA forward for the backends
    benchmarked (``--absorbed-prefill``). SGLang picks a DeepSeek layer's forward per batch by the attention
    backend's name; for ``torch_native`` (and ours) it takes the MHA forward over the latent pool for a prefill
    with no cached prefix, which ``torch_native`` cannot run."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        _dispatch_mla_subtype,
    )

    for name in ("torch_native", "compiled_attn"):
        AttentionBackendRegistry.register(name, _dispatch_mla_subtype)
    from sglang.srt.managers.scheduler import run_scheduler_process

    return run_scheduler_process(*args, **kwargs)


def _send(obj: dict) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _measure(eng, bs: int, context: int, steps: int, seed: int, vocab: int) -> dict:
    import asyncio
    import random

    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab) for _ in range(context)] for _ in range(bs)]
    sampling = {"temperature": 0.0, "max_new_tokens": steps + 1, "ignore_eos": True}
    eng.flush_cache()

    async def one(ids: list[int], t0: float) -> list[float]:
        arrivals: list[float] = []  # arrivals[k-1] = time (s after t0) this request had k tokens
        gen = await eng.async_generate(input_ids=ids, sampling_params=sampling, stream=True)
        async for chunk in gen:
            now = time.perf_counter() - t0
            n = chunk["meta_info"]["completion_tokens"]
            arrivals += [now] * (n - len(arrivals))
        return arrivals

    async def run() -> list[list[float]]:
        t0 = time.perf_counter()
        return await asyncio.gather(*(one(ids, t0) for ids in prompts))

    return batch_timings(eng.loop.run_until_complete(run()), steps)


def batch_timings(arrivals: list[list[float]], steps: int) -> dict:
    """One batch's timings (s) from each request's token arrivals (``arrivals[i][k-1]``: seconds after submission
    when request i had k tokens; ``steps`` + 1 tokens each). With ``T_k`` the time all requests had k tokens
    (bursts spread, ``_spread_bursts``): prefill_s = T_1 (time to first token), first_decode_s = T_2 - T_1,
    median_decode_s = the median of T_{k+1} - T_k, request_s = T_{steps+1} (what the batch's last user waited for
    all its tokens, from submission)."""
    t = _spread_bursts([max(r[k] for r in arrivals) for k in range(steps + 1)])
    decode = [b - a for a, b in zip(t[:-1], t[1:], strict=True)]
    return dict(prefill_s=t[0], first_decode_s=decode[0], median_decode_s=statistics.median(decode), request_s=t[-1])


def _spread_bursts(t: list[float]) -> list[float]:
    """Tokens that reached the client together (a busy client coalesces stream chunks) share the interval since
    the previous arrival evenly: ``[0, 5, 5, 5]`` -> ``[0, 5/3, 10/3, 5]``. ``t[0]`` (prefill) is kept."""
    out = list(t)
    i = 1
    while i < len(t):
        j = i
        while j + 1 < len(t) and t[j + 1] == t[i]:
            j += 1
        start, n = t[i - 1], j - i + 1
        for m in range(i, j + 1):
            out[m] = start + (t[i] - start) * (m - i + 1) / n
        i = j + 1
    return out


def _worker(spec: dict) -> int:
    os.environ["OMP_NUM_THREADS"] = str(spec["threads"])
    import torch

    torch.set_num_threads(spec["threads"])
    from ..sglang import cpu_fixups, serve

    max_bs = max(spec["batch_sizes"])
    with open(os.path.join(spec["model_dir"], "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    kw = dict(BACKENDS[spec["backend"]])
    if kw.get("enable_torch_compile"):
        kw["cuda_graph_bs_decode"] = spec["batch_sizes"]
    t0 = time.perf_counter()
    per_request = spec["context"] + spec["steps"] + 8
    if kw.get("speculative_algorithm"):
        kw["speculative_draft_model_path"] = spec["draft_dir"]
    if spec["absorbed_prefill"]:
        kw["scheduler_target"] = cpu_fixups.ChildTarget(__spec__.name, "run_scheduler_absorbed_prefill")
    eng = serve.engine(model_path=spec["model_dir"], context_length=spec["context_length"] or per_request,
                       max_total_tokens=spec["max_total_tokens"] or max_bs * per_request + 256,
                       max_running_requests=max_bs, chunked_prefill_size=spec["chunked_prefill_size"],
                       dtype=spec["dtype"], sleep_on_idle=True, skip_server_warmup=True, log_level="error", **kw)
    _send(dict(ready=True, start_s=time.perf_counter() - t0))
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("quit"):
                break
            t1 = time.perf_counter()
            res = _measure(eng, cmd["bs"], spec["context"], spec["steps"], cmd["seed"], vocab)
            _send(dict(res, wall_s=time.perf_counter() - t1))
    finally:
        eng.shutdown()
    return 0


# --- driver --------------------------------------------------------------------------------------------------


class _Engine:
    """One worker subprocess holding one engine; ``run(bs, seed)`` is one timed batch."""

    def __init__(self, backend: str, spec: dict):
        self.backend = backend
        env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
        self.proc = subprocess.Popen([sys.executable, "-m", __spec__.name, "--worker",
                                      json.dumps(dict(spec, backend=backend))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True)

    def _recv(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError(f"{self.backend}: engine worker exited (rc={self.proc.wait()}); see its stderr above")

    def ready(self) -> dict:
        return self._recv()

    def run(self, bs: int, seed: int) -> dict:
        self.proc.stdin.write(json.dumps(dict(bs=bs, seed=seed)) + "\n")
        self.proc.stdin.flush()
        return self._recv()

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps(dict(quit=True)) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            import signal

            os.killpg(self.proc.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.worker:
        return _worker(json.loads(args.worker))
    model_dir = args.model_path
    if not model_dir:
        from ..sglang.make_model import make_model

        model_dir = make_model(args.model, os.path.join(tempfile.mkdtemp(prefix="bench_engine_"), args.model),
                               seed=args.seed)
    spec = dict(model_dir=model_dir, context=args.context, steps=args.decode_steps, threads=args.threads,
                batch_sizes=args.batch_size, chunked_prefill_size=args.chunked_prefill_size,
                context_length=args.context_length, max_total_tokens=args.max_total_tokens,
                absorbed_prefill=args.absorbed_prefill, dtype=args.dtype, draft_dir=args.draft_model_path)
    if "compiled_attn+eagle" in args.backend and not spec["draft_dir"]:
        from ..sglang.make_eagle import make_eagle

        spec["draft_dir"] = make_eagle(model_dir, tempfile.mkdtemp(prefix="bench_engine_eagle_"), seed=args.seed)
    print(f"# model {args.model_path or args.model}, dtype {args.dtype}, context {args.context}, "
          f"{args.decode_steps} decode steps, "
          f"OMP_NUM_THREADS={args.threads}, {args.rounds} rounds, backends interleaved"
          + (", absorbed MLA prefill" if args.absorbed_prefill else ""), flush=True)
    engines: list[_Engine] = []
    results: dict = {"config": {k: v for k, v in vars(args).items() if k != "worker"},
                     "start_s": {}, "warmup": {}, "runs": {}}
    try:
        for b in args.backend:  # one at a time: start-up (compile) doesn't compete with another's
            eng = _Engine(b, spec)
            engines.append(eng)
            results["start_s"][b] = round(eng.ready()["start_s"], 1)
            print(f"# {b}: engine up in {results['start_s'][b]} s", flush=True)
        for bs in args.batch_size:  # warm-up: each batch size's first request after start-up, reported apart
            for eng in engines:
                results["warmup"][f"{eng.backend} bs={bs}"] = eng.run(bs, seed=args.seed + 10_000 + bs)
        for r in range(args.rounds):
            for bs in args.batch_size:
                order = engines[r % len(engines):] + engines[:r % len(engines)]
                for eng in order:
                    res = eng.run(bs, seed=args.seed + 1000 * r + bs)
                    results["runs"].setdefault(f"{eng.backend} bs={bs}", []).append(res)
    finally:
        for eng in engines:
            eng.close()
    summary = summarise(results, args.backend, args.batch_size)
    print(format_summary(summary, args.backend, args.batch_size))
    results["summary"] = summary
    for bs in args.batch_size if "compiled_attn+eagle" in args.backend else ():
        rate = {b: 1 / summary[f"{b} bs={bs}"]["median_decode_s"] for b in args.backend}
        others = ", ".join(f"{rate[b]:.0f} with {b}" for b in args.backend if b != "compiled_attn+eagle")
        print(f"# bs={bs}: {rate['compiled_attn+eagle']:.0f} tokens/s per request with EAGLE"
              + (f" ({others})" if others else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
