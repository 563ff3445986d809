"""Scale-out in a live SGLang engine on CPU with ``--attention-backend compiled_attn``, against ``transformers``.

Tensor parallel 2 (tiny Llama with GQA 4/2, tiny DeepSeek-V2 with MLA + MoE; eager and ``enable_torch_compile``)
and DeepSeek's usual layout, ``--tp-size 2 --dp-size 2 --enable-dp-attention`` (eager: SGLang 0.5.23's CPU graph
runner cannot run DP attention, so ``serve`` refuses ``--enable-torch-compile`` with it, ``test_scaleout.py``).
Each engine runs in a subprocess (``test_live_engine``'s helpers) started by ``serve.engine`` with no
``SGLANG_CPU_OMP_THREADS_BIND``, so ``serve`` splits this machine's CPUs between the 2 ranks; the ranks all-reduce
through SGLang's gloo group. Per engine: 3 prompts at once (with DP attention the controller sends them to both
attention-DP ranks), then the first alone (with DP attention one rank idles through the MoE's collectives; with
``enable_torch_compile`` its decodes replay the bs=1 graph). Tokens must equal transformers' greedy ones (DeepSeek:
up to near-ties, ``test_live_engine.TIE_TOL``); the variable must be what ``serve.split_cpus`` gives, and each
scheduler process pinned to its entry.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from live_models import tiny_model
from test_live_engine import (
    ENGINE_KW,
    JOB_TIMEOUT_S,
    PARALLEL,
    _child_env,
    _run_group,
    assert_greedy,
    engine_params,
    engine_selected,
    write_live_timings,
)

pytestmark = pytest.mark.live

NEW_TOKENS = 8
TP2 = dict(attention_backend="compiled_attn", tp_size=2)
EAGER = dict(disable_cuda_graph=True)
COMPILE = dict(enable_torch_compile=True)
DP_ATTENTION = dict(TP2, dp_size=2, enable_dp_attention=True)
# name -> (preset, engine kwargs); the longest first (the pool starts them in this order)
ENGINES = {
    "deepseek-tp2-compile": ("tiny-deepseek-v2", dict(TP2, **COMPILE)),
    "llama-tp2-compile": ("tiny-llama", dict(TP2, **COMPILE)),
    "deepseek-tp2-dp2-attention-eager": ("tiny-deepseek-v2", dict(DP_ATTENTION, **EAGER)),
    "deepseek-tp2-eager": ("tiny-deepseek-v2", dict(TP2, **EAGER)),
    "llama-tp2-eager": ("tiny-llama", dict(TP2, **EAGER)),
}
SINGLE = 0  # the prompt run again alone
#: the engines CI's default run starts (about 2 min on 2 cores together): DeepSeek's DP-attention layout (the
#: processes the fix-ups had missed) and tensor parallel Llama; COMPILED_ATTN_LIVE_ALL=1 adds the other three (about
#: 4 min more: two compiled engines)
DEFAULT_ENGINES = ("deepseek-tp2-dp2-attention-eager", "llama-tp2-eager")


def prompts() -> list[list[int]]:
    """Short, medium, and one longer than the DP-attention prefill chunk (SGLang halves 64 to 32 there)."""
    base = [4 + (7 * i) % 250 for i in range(60)]
    return [base[:5], base[30:42], base[10:50]]


# --- subprocess side -----------------------------------------------------------------------------------------


def _schedulers() -> list[tuple[str, list[int]]]:
    """(process title, CPUs it may run on) of this process's SGLang schedulers."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            title = " ".join(p.cmdline())
            if "scheduler" in title:
                out.append((title, sorted(os.sched_getaffinity(p.pid))))
        except (psutil.Error, OSError):
            pass
    return sorted(out)


def _worker(spec: dict) -> dict:
    """Start one engine, run the prompts (together, then ``SINGLE`` alone), shut down; the result as a dict."""
    from compiled_attn.sglang import serve

    t0 = time.perf_counter()
    eng = serve.engine(model_path=spec["model_dir"], **ENGINE_KW, **spec["kwargs"])
    start_s = time.perf_counter() - t0
    sampling = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    try:
        schedulers = _schedulers()
        t1 = time.perf_counter()
        outs = eng.generate(input_ids=prompts(), sampling_params=sampling)
        single = eng.generate(input_ids=[prompts()[SINGLE]], sampling_params=sampling)[0]
        gen_s = time.perf_counter() - t1
    finally:
        eng.shutdown()
    return dict(start_s=round(start_s, 1), generate_s=round(gen_s, 2), batch=[o["output_ids"] for o in outs],
                single=single["output_ids"], binding=os.environ.get(serve.OMP_BIND_ENV), schedulers=schedulers)


# --- pytest side ---------------------------------------------------------------------------------------------


def _engine_job(model_dir: str, kwargs: dict, tmp: str) -> dict:
    out = os.path.join(tmp, "result.json")
    spec = dict(model_dir=model_dir, kwargs=kwargs, out=out)
    env = _child_env()
    env.pop("SGLANG_CPU_OMP_THREADS_BIND", None)  # serve's default binding is under test
    t0 = time.perf_counter()
    res = _run_group([sys.executable, os.path.abspath(__file__), json.dumps(spec)], JOB_TIMEOUT_S, env)
    wall = round(time.perf_counter() - t0, 1)
    if res.returncode == 0 and os.path.exists(out):
        with open(out) as f:
            return dict(json.load(f), ok=True, wall_s=wall)
    return dict(ok=False, wall_s=wall, rc=res.returncode, stderr=res.stderr[-4000:])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{preset: (dir, transformers model, greedy tokens per prompt)} (``live_models``: made once per session)."""
    return {preset: tiny_model(preset, tmp_path_factory, prompts(), NEW_TOKENS)
            for preset in ("tiny-llama", "tiny-deepseek-v2")}


@pytest.fixture(scope="module")
def jobs(request, models, tmp_path_factory):
    """Starts the engines the selected tests need, ``PARALLEL`` at a time (``COMPILED_ATTN_LIVE_JOBS``)."""
    pytest.importorskip("sglang")
    wanted = {item.callspec.params["name"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")
              and engine_selected(item.callspec.params["name"], DEFAULT_ENGINES)}
    pool = ThreadPoolExecutor(max_workers=PARALLEL)
    futures: dict[str, Future] = {}
    for name, (preset, kwargs) in ENGINES.items():
        if name in wanted:
            futures[name] = pool.submit(_engine_job, models[preset][0], kwargs, str(tmp_path_factory.mktemp(name)))
    yield futures
    pool.shutdown(wait=True)
    write_live_timings(futures)


@pytest.mark.parametrize("name", engine_params(ENGINES, DEFAULT_ENGINES))
def test_scaleout_matches_transformers(name, models, jobs):
    from compiled_attn.sglang import serve

    preset, _ = ENGINES[name]
    _, model, expected = models[preset]
    res = jobs[name].result()
    assert res["ok"], f"{name}: engine failed (rc={res.get('rc')}):\n{res.get('stderr')}"
    batch = prompts()
    for i, tokens in [*enumerate(res["batch"]), (SINGLE, res["single"])]:
        assert len(tokens) == NEW_TOKENS
        assert_greedy(preset, model, batch[i], tokens, expected[i], f"{name}: prompt {i}")
    # serve's binding, one entry per rank, and each scheduler pinned to its own
    binding = serve.split_cpus(2)
    assert res["binding"] == binding, res["binding"]
    pinned = [cpus for _, cpus in res["schedulers"]]
    assert sorted(pinned) == sorted(sorted(serve.cpu_fixups.parse_cpu_list(e)) for e in binding.split("|")), res


if __name__ == "__main__":  # worker: python tests/test_live_scaleout.py '<json spec>'
    spec = json.loads(sys.argv[1])
    result = _worker(spec)
    with open(spec["out"], "w") as f:
        json.dump(result, f)
    os._exit(0)  # SGLang may leave non-daemon threads behind after shutdown: don't wait for them
