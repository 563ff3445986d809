"""A live SGLang engine on CPU with ``--attention-backend compiled_attn``, against ``transformers.generate``.

Three tiny random-weight checkpoints (``make_model``: Llama with GQA, DeepSeek-V2 with MLA + MoE, Gemma 2 with a
16-token sliding-window layer and soft-capped logits) and their greedy continuations in ``transformers`` come from
``live_models`` (written and computed once per pytest session, shared by the live test files). Each engine
configuration then runs in its own subprocess (this file run as a script, ``_worker``): ``serve.engine`` (a
``sglang.Engine`` with the CPU fix-ups in every process) generates greedily for 5 prompts at once (different lengths,
two sharing a 24-token prefix, one longer than ``chunked_prefill_size``), then two of them alone (one reuses the
radix-cached prefix; with ``enable_torch_compile`` these bs=1 decodes run the compiled graph, as
``cuda_graph_bs_decode=[1]``), and the token ids are compared with transformers'.

Why subprocesses: SGLang's scheduler answers a fatal error with SIGQUIT to its parent, whose handler kills its
whole process tree, so an in-process engine that crashes would take pytest with it; and a live engine needs
``SGLANG_USE_CPU_ENGINE=1`` + the ``sgl_kernel`` stand-in (``cpu_fixups.apply``), which the layer-level harness
tests in this same pytest process exclude (they run SGLang's generic path). The subprocesses run two at a time
(``COMPILED_ATTN_LIVE_JOBS``, default 2, one OpenMP thread each), started by the module-scoped ``jobs`` fixture
for the tests selected, so each engine starts once.

CI's default run starts ``DEFAULT_ENGINES`` (``COMPILED_ATTN_LIVE_ALL=1``: every one of ``ENGINES``; the other live
test files follow the same switch). Also: one HTTP round trip through ``serve.main`` (``python -m
compiled_attn.sglang.serve``) on 127.0.0.1, an over-long prompt answered with HTTP 400 while the server keeps
answering, ``page_size=16``, and flags our backend can't serve refused at start-up with a message naming the flag.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from live_models import tiny_model

pytestmark = pytest.mark.live

NEW_TOKENS = 16
CHUNK = 64  # chunked_prefill_size: the longest prompt (100 tokens) is prefilled in two chunks
CONTEXT = 256
# DeepSeek and Gemma 2: where our token differs from transformers', it must still be a greedy choice up to a
# near-tie, i.e. (teacher-forced on our tokens, in transformers) its logit is within TIE_TOL of the best logit at
# that step. DeepSeek: fp32 sums in a different order (MLA absorbed vs transformers' expanded attention, MoE) flip
# exact near-ties. Gemma 2: SGLang's model itself differs from transformers' by up to ~2e-3 in these logits (its
# torch_native backend gives our tokens on the short prompts, where the window does not bind), and its compiled
# model at batch size 1 from its eager one by up to ~6e-3 (our compiled decode there equals our eager one to 1e-6);
# a backend ignoring the 16-token window would miss by 0.1-0.9 on the longer prompts. Llama with 4 query heads
# per KV head (head size 32, ``test_live_ngram``): on one prompt transformers' top two logits lie 0.006 apart and
# SGLang's engine takes the other one without speculation, with our kernel and with it off (its model's sums
# differ from transformers' there). Llama must match exactly.
TIE_TOL = {"tiny-deepseek-v2": 1e-3, "tiny-gemma2": 1e-2, "tiny-llama-g4": 1e-2}
JOB_TIMEOUT_S = 400
PARALLEL = int(os.environ.get("COMPILED_ATTN_LIVE_JOBS", "2"))

# Engine settings chosen to start fast on 2 cores: a small KV pool, one graph batch size.
ENGINE_KW = dict(
    context_length=CONTEXT,
    max_total_tokens=4096,
    chunked_prefill_size=CHUNK,
    max_running_requests=8,
    cuda_graph_bs_decode=[1],  # CPUGraphRunner (torch.compile) compiles one graph per batch size listed
    skip_server_warmup=True,
    log_level="error",
)
EAGER = dict(attention_backend="compiled_attn", disable_cuda_graph=True)
# name -> (preset, engine kwargs). The longest first: the pool starts them in this order.
ENGINES = {
    "deepseek-compiled_attn-compile": ("tiny-deepseek-v2", dict(attention_backend="compiled_attn",
                                                                enable_torch_compile=True)),
    "llama-compiled_attn-compile": ("tiny-llama", dict(attention_backend="compiled_attn", enable_torch_compile=True)),
    "llama-compiled_attn-eager": ("tiny-llama", EAGER),
    "deepseek-compiled_attn-eager": ("tiny-deepseek-v2", EAGER),
    # torch_native fails on DeepSeek's MHA prefill over the MLA latent pool (SGLang's limitation): Llama only
    "llama-torch_native": ("tiny-llama", dict(attention_backend="torch_native", disable_cuda_graph=True)),
    "llama-compiled_attn-page16": ("tiny-llama", dict(EAGER, page_size=16)),
    # Gemma 2: a sliding-window layer, soft-capped logits
    "gemma2-compiled_attn-eager": ("tiny-gemma2", EAGER),
    "gemma2-compiled_attn-compile": ("tiny-gemma2", dict(attention_backend="compiled_attn", enable_torch_compile=True)),
}
SINGLES = (3, 0)  # prompts run again alone after the batch (3 reuses the cached shared prefix)
#: the engines CI's default run starts; COMPILED_ATTN_LIVE_ALL=1 adds the others. Each one left out is served by
#: these too: a compiled engine runs its batches of 5 and its prefills eagerly (its graph is captured at batch size
#: 1 only), the page-16 engine and the HTTP server run the eager batch of one (Llama; DeepSeek's in
#: test_live_scaleout's DP-attention engine, gpt-oss's window pool in test_live_swa), and torch_native is SGLang's
#: own backend, a check of this harness rather than of ours. The compiled Llama runs in test_live_compile (several
#: captured sizes, pages of 1 and 16) and test_live_smollm2 (a real Llama, eager and compiled).
DEFAULT_ENGINES = ("deepseek-compiled_attn-compile", "gemma2-compiled_attn-compile", "llama-compiled_attn-page16")
ALL_ENGINES = os.environ.get("COMPILED_ATTN_LIVE_ALL", "0") not in ("", "0")


def engine_selected(name: str, default) -> bool:
    """Whether this run starts engine ``name``: those in ``default`` always, the others with
    ``COMPILED_ATTN_LIVE_ALL=1``."""
    return ALL_ENGINES or name in default


def engine_params(names, default) -> list:
    """pytest params of engine ``names``: those ``engine_selected`` leaves out are skipped."""
    left_out = pytest.mark.skip(reason="COMPILED_ATTN_LIVE_ALL=1 runs this engine too (CI's default run keeps its "
                                       "time)")
    return [pytest.param(name, marks=() if engine_selected(name, default) else left_out) for name in names]


def prompts() -> list[list[int]]:
    """Prompt token ids: short, medium, two sharing a 24-token prefix, and one longer than a prefill chunk."""
    base = [4 + (7 * i) % 250 for i in range(120)]
    shared = base[:24]
    return [
        base[:5],
        base[30:42],
        shared + [200, 201, 202],
        shared + [150, 151, 152, 153, 154, 155],
        base[:100],
    ]


# --- subprocess side -----------------------------------------------------------------------------------------


def _worker(spec: dict) -> dict:
    """Start one engine, run the prompts (batch, then ``SINGLES`` alone), shut down; the result as a dict."""
    from compiled_attn.sglang import serve

    t0 = time.perf_counter()
    eng = serve.engine(model_path=spec["model_dir"], **ENGINE_KW, **spec["kwargs"])
    result = generate_then_shut_down(eng, prompts(), SINGLES, NEW_TOKENS, time.perf_counter() - t0)
    singles = result.pop("single_outputs")
    return dict(result, cached_tokens=[o["meta_info"].get("cached_tokens") for o in singles])


def generate_then_shut_down(eng, batch: list[list[int]], singles: tuple, new_tokens: int, start_s: float) -> dict:
    """Greedy ``new_tokens`` for ``batch`` at once, then for each of ``singles`` (indices) alone; the engine shut down
    either way. -> start_s, generate_s, batch (token lists), singles (token lists), single_outputs (as returned)."""
    sampling = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    try:
        t1 = time.perf_counter()
        outs = eng.generate(input_ids=batch, sampling_params=sampling)
        single_outputs = [eng.generate(input_ids=[batch[i]], sampling_params=sampling)[0] for i in singles]
        gen_s = time.perf_counter() - t1
    finally:
        eng.shutdown()
    return dict(start_s=round(start_s, 1), generate_s=round(gen_s, 2), batch=[o["output_ids"] for o in outs],
                singles=[o["output_ids"] for o in single_outputs], single_outputs=single_outputs)


# --- pytest side ---------------------------------------------------------------------------------------------


def _run_group(cmd: list[str], timeout: float, env: dict) -> subprocess.CompletedProcess:
    """``cmd`` in its own session; on timeout the whole group (SGLang's children included) is killed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[killed after {timeout} s]"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _child_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("COMPILED_ATTN_LIVE_THREADS", "1"))
    env.pop("SGLANG_USE_CPU_ENGINE", None)  # the child's cpu_fixups.apply() decides
    return env


def _engine_job(model_dir: str, kwargs: dict, tmp: str) -> dict:
    out = os.path.join(tmp, "result.json")
    spec = dict(model_dir=model_dir, kwargs=kwargs, out=out)
    t0 = time.perf_counter()
    res = _run_group([sys.executable, os.path.abspath(__file__), json.dumps(spec)], JOB_TIMEOUT_S, _child_env())
    wall = round(time.perf_counter() - t0, 1)
    if res.returncode == 0 and os.path.exists(out):
        with open(out) as f:
            return dict(json.load(f), ok=True, wall_s=wall)
    return dict(ok=False, wall_s=wall, rc=res.returncode, stderr=res.stderr[-4000:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http_job(model_dir: str, tmp: str) -> dict:
    """``serve.main`` as a command on a free port: /generate, an over-long prompt, /generate again."""
    import requests

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "compiled_attn.sglang.serve", "--model-path", model_dir, "--host", "127.0.0.1",
           "--port", str(port), "--context-length", str(CONTEXT), "--max-total-tokens", "4096",
           "--chunked-prefill-size", str(CHUNK), "--skip-server-warmup", "--log-level", "error"]
    log = open(os.path.join(tmp, "server.log"), "w+")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_env(), start_new_session=True)
    res: dict = {}
    body = {"input_ids": prompts()[2],
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.perf_counter() - t0 > JOB_TIMEOUT_S:
                raise TimeoutError(f"server not ready after {JOB_TIMEOUT_S} s")
            time.sleep(0.5)
        res["start_s"] = round(time.perf_counter() - t0, 1)
        r = requests.post(url + "/generate", json=body, timeout=120)
        res["first"] = (r.status_code, r.json().get("output_ids") if r.ok else r.text[:300])
        too_long = requests.post(url + "/generate", json={"input_ids": list(range(4, 254)) * 2,
                                                           "sampling_params": {"max_new_tokens": 4}}, timeout=120)
        res["too_long"] = (too_long.status_code, too_long.text[:300])
        r = requests.post(url + "/generate", json=body, timeout=120)
        res["after"] = (r.status_code, r.json().get("output_ids") if r.ok else r.text[:300])
        res["ok"] = True
    except Exception as e:  # reported by the test, with the server's log
        res.update(ok=False, error=f"{type(e).__name__}: {e}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        log.seek(0)
        res["log"] = log.read()[-3000:]
        log.close()
    return res


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny checkpoints, their transformers models and greedy references (``live_models``, shared by the live
    files): {preset: (dir, model, tokens)}."""
    return {preset: tiny_model(preset, tmp_path_factory, prompts(), NEW_TOKENS)
            for preset in ("tiny-llama", "tiny-deepseek-v2", "tiny-gemma2")}


@pytest.fixture(scope="module")
def jobs(request, models, tmp_path_factory):
    """Starts every engine (and the HTTP server) that the selected tests need, ``PARALLEL`` at a time."""
    pytest.importorskip("sglang")
    wanted = set()
    for item in request.session.items:
        if item.module is request.module:
            cs = getattr(item, "callspec", None)
            name = cs.params.get("name") if cs else item.originalname
            if name not in ENGINES or engine_selected(name, DEFAULT_ENGINES):
                wanted.add(name)
    pool = ThreadPoolExecutor(max_workers=PARALLEL)
    futures: dict[str, Future] = {}
    if "test_http_round_trip" in wanted:  # the server waits on its own; start it first
        futures["http"] = pool.submit(_http_job, models["tiny-llama"][0], str(tmp_path_factory.mktemp("http")))
    for name, (preset, kwargs) in ENGINES.items():
        if name in wanted:
            futures[name] = pool.submit(_engine_job, models[preset][0], kwargs, str(tmp_path_factory.mktemp(name)))
    yield futures
    pool.shutdown(wait=True)
    write_live_timings(futures)


def write_live_timings(futures: dict) -> None:
    """Each finished job's timings, as JSON to ``$COMPILED_ATTN_LIVE_TIMINGS`` where it is set."""
    if os.environ.get("COMPILED_ATTN_LIVE_TIMINGS"):
        with open(os.environ["COMPILED_ATTN_LIVE_TIMINGS"], "w") as f:
            json.dump({k: {t: v.result().get(t) for t in ("wall_s", "start_s", "generate_s")}
                       for k, v in futures.items()}, f, indent=1)


def _greedy_within_ties(model, prompt: list[int], got: list[int], tol: float) -> bool:
    """True if ``got`` is, in transformers, a greedy continuation of ``prompt`` up to near-ties (within ``tol``)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + got])).logits[0, len(prompt) - 1:-1]
    gap = logits.max(dim=-1).values - logits.gather(1, torch.tensor(got)[:, None])[:, 0]
    return bool((gap <= tol).all())


def assert_greedy(preset: str, model, prompt: list[int], got: list[int], expected: list[int], what: str) -> None:
    """``got`` equals transformers' ``expected``, or (presets in ``TIE_TOL``) is greedy in transformers up to
    near-ties."""
    if got == expected:
        return
    assert preset in TIE_TOL and _greedy_within_ties(model, prompt, got, TIE_TOL[preset]), (
        f"{what} ({len(prompt)} tokens): got {got}, transformers {expected}")


@pytest.mark.parametrize("name", engine_params(ENGINES, DEFAULT_ENGINES))
def test_engine_matches_transformers(name, models, jobs):
    preset, _ = ENGINES[name]
    _, model, expected = models[preset]
    res = jobs[name].result()
    assert res["ok"], f"{name}: engine failed (rc={res.get('rc')}):\n{res.get('stderr')}"
    batch = prompts()
    got = list(enumerate(res["batch"])) + list(zip(SINGLES, res["singles"], strict=True))
    for i, tokens in got:
        assert len(tokens) == NEW_TOKENS
        assert_greedy(preset, model, batch[i], tokens, expected[i], f"{name}: prompt {i}")
    # the shared prefix (24 tokens, plus what the batch run cached of the same prompt) came from the radix cache,
    # in whole pages
    page = ENGINES[name][1].get("page_size", 1)
    assert res["cached_tokens"][0] >= 24 // page * page > 0, res["cached_tokens"]


def test_http_round_trip(models, jobs):
    expected = models["tiny-llama"][2][2]
    res = jobs["http"].result()
    assert res["ok"], f"{res.get('error')}\nserver log:\n{res.get('log')}"
    assert res["first"] == (200, expected), res
    status, text = res["too_long"]
    assert 400 <= status < 500 and "context length" in text, res["too_long"]
    assert res["after"] == (200, expected), "server stopped answering after the over-long prompt"


@pytest.mark.parametrize("argv, flag", [
    (["--kv-cache-dtype", "fp4_e2m1"], "--kv-cache-dtype"),
    (["--kv-cache-dtype=int8"], "--kv-cache-dtype"),
    (["--speculative-algorithm", "DFLASH"], "--speculative-algorithm"),
    (["--page-size", "0"], "--page-size"),
])
def test_serve_refuses_unsupported_flags(argv, flag, capsys):
    from compiled_attn.sglang import serve

    assert serve.main(["--model-path", "unused", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0] and "compiled_attn" in err[0], err
    with pytest.raises(serve.UnsupportedArgument, match=flag):
        kwargs = {flag[2:].replace("-", "_"): argv[-1].split("=")[-1]}
        serve.engine(model_path="unused", **kwargs)


def test_serve_leaves_other_backends_alone():
    from compiled_attn.sglang import serve

    serve.check_args(attention_backend="triton", kv_cache_dtype="fp8_e4m3")  # not ours: SGLang decides


def test_serve_refuses_speculative_decoding_only_where_sglang_cannot_draft(capsys):
    """The backend verifies drafts (TARGET_VERIFY, graphs included); on a CPU-only machine SGLang drafts only with
    NGRAM (no draft model; its ops in the sgl_kernel stand-in), eagerly and with page size 1
    (tests/test_live_ngram.py runs it)."""
    from compiled_attn.sglang import serve

    serve.check_args(speculative_algorithm="EAGLE", cpu=False)
    serve.check_args(speculative_algorithm="NGRAM", enable_torch_compile=True, page_size=16, cpu=False)
    serve.check_args(speculative_algorithm="NGRAM", cpu=True)
    serve.check_args(speculative_algorithm="NGRAM", page_size=1, enable_torch_compile=False, cpu=True)
    serve.check_args(speculative_algorithm="EAGLE", page_size=1, cpu=True)  # tests/test_live_eagle.py runs it
    with pytest.raises(serve.UnsupportedArgument, match="--speculative-algorithm DFLASH.*CUDA kernels"):
        serve.check_args(speculative_algorithm="DFLASH", cpu=True)
    with pytest.raises(serve.UnsupportedArgument, match="^--enable-torch-compile: .*speculative"):
        serve.check_args(speculative_algorithm="NGRAM", enable_torch_compile=True, cpu=True)
    with pytest.raises(serve.UnsupportedArgument, match="^--page-size 16: .*NGRAM.*--page-size 1"):
        serve.check_args(speculative_algorithm="NGRAM", page_size=16, cpu=True)
    if serve.cpu_fixups.cpu_only():  # the command line reaches the same checks (main() asks this machine)
        assert serve.main(["--model-path", "unused", "--speculative-algorithm", "NGRAM", "--enable-torch-compile"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--enable-torch-compile" in err[0], err


if __name__ == "__main__":  # worker: python tests/test_live_engine.py '<json spec>'
    spec = json.loads(sys.argv[1])
    result = _worker(spec)
    with open(spec["out"], "w") as f:
        json.dump(result, f)
    # SGLang may leave non-daemon threads behind after shutdown: don't wait for them
    os._exit(0)
