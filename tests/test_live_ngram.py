"""N-gram speculative decoding (``--speculative-algorithm NGRAM``, no draft model) in a live SGLang engine on CPU
with ``--attention-backend compiled_attn``: greedy tokens equal ``transformers.generate``, and drafts are accepted.

Per model (tiny Llama; tiny Gemma 2, whose sliding-window layer verifies each draft token over its own window; tiny
Llama with 4 query heads per KV head, whose verify has 16 query rows per KV head: the C++ kernel's wide path), one
engine (``serve.engine``, in a subprocess as in ``test_live_engine.py``, whose helpers this reuses; the three start
at once, ``PARALLEL`` at a time) generates greedily for three prompts (one a repeated pattern) three times: as a
batch, as the same batch again (the n-gram corpus now holds the first round's continuations, so most drafts match),
then the first prompt alone. SGLang's n-gram worker drafts a tree of ``DRAFTS`` tokens per request from its C++
corpus (JIT-built on first use: needs g++ and ninja), our backend's ``TARGET_VERIFY`` runs the target over them with
the tree mask, and SGLang's greedy tree walk (``verify_tree_greedy_cpu``, from the ``sgl_kernel`` stand-in) accepts
the matching ones.

What proves speculation happened: SGLang's per-request ``meta_info`` (``spec_verify_ct``: verify steps,
``spec_num_correct_drafts``: accepted drafts), and a count of our backend's ``TARGET_VERIFY`` forwards, taken in
the scheduler process (the engine's scheduler target is :func:`run_scheduler_counting_verify`, which wraps
``backend.forward_target_verify`` and appends a line per forward to ``$COMPILED_ATTN_TEST_VERIFY_LOG``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from live_models import checkpoint, tiny_model
from test_live_engine import (
    ENGINE_KW,
    JOB_TIMEOUT_S,
    PARALLEL,
    _child_env,
    _run_group,
    assert_greedy,
)

pytestmark = pytest.mark.live

NEW_TOKENS = 24
DRAFTS = 4  # --speculative-num-draft-tokens: tokens per verify tree (root included)
ENGINE = dict(ENGINE_KW, attention_backend="compiled_attn", disable_cuda_graph=True, page_size=1,
              speculative_algorithm="NGRAM", speculative_num_draft_tokens=DRAFTS,
              speculative_ngram_max_trie_depth=8)  # max BFS breadth stays SGLang's 10: the drafts are trees
VERIFY_LOG = "COMPILED_ATTN_TEST_VERIFY_LOG"
ROUNDS = ((0, 1, 2), (0, 1, 2), (0,))  # prompt indices generated together, round after round


def prompts() -> list[list[int]]:
    """A short prompt, a repeated 5-token pattern (the corpus drafts its continuation), and a longer one."""
    base = [4 + (7 * i) % 250 for i in range(60)]
    return [base[:5], [40, 41, 42, 43, 44] * 4, base[10:40]]


# --- subprocess side -----------------------------------------------------------------------------------------


def run_scheduler_counting_verify(*args, **kwargs):
    """SGLang's scheduler process, with our backend's TARGET_VERIFY forwards logged (one line per forward)."""
    from compiled_attn.sglang import backend

    verify = backend.forward_target_verify

    def counted(backend_, q3, k_cache, v_cache, layer, forward_batch, *rest, **kw):
        if layer.layer_id == 0:  # once per forward, not per layer
            with open(os.environ[VERIFY_LOG], "a") as f:
                f.write(f"{forward_batch.batch_size}\n")
        return verify(backend_, q3, k_cache, v_cache, layer, forward_batch, *rest, **kw)

    backend.forward_target_verify = counted  # forward_extend looks the name up at call time
    from sglang.srt.managers.scheduler import run_scheduler_process

    return run_scheduler_process(*args, **kwargs)


def _worker(spec: dict) -> dict:
    """Start the engine (scheduler target above), run ``ROUNDS``, shut down; the result as a dict."""
    from compiled_attn.sglang import cpu_fixups, serve

    os.environ[VERIFY_LOG] = spec["verify_log"]  # inherited by the scheduler
    t0 = time.perf_counter()
    eng = serve.engine(model_path=spec["model_dir"], **ENGINE,
                       scheduler_target=cpu_fixups.ChildTarget("test_live_ngram", "run_scheduler_counting_verify"))
    start_s = time.perf_counter() - t0
    sampling = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    rounds = []
    try:
        t1 = time.perf_counter()
        for idx in ROUNDS:
            outs = eng.generate(input_ids=[prompts()[i] for i in idx], sampling_params=sampling)
            rounds.append([dict(ids=o["output_ids"], **{k: o["meta_info"].get(k) for k in
                                ("spec_verify_ct", "spec_num_correct_drafts", "spec_accept_length")})
                           for o in outs])
        gen_s = time.perf_counter() - t1
    finally:
        eng.shutdown()
    return dict(start_s=round(start_s, 1), generate_s=round(gen_s, 2), rounds=rounds)


# --- pytest side ---------------------------------------------------------------------------------------------


# Llama; Gemma 2, whose first layer is a sliding-window one: verify over a window; Llama with 4 query heads per KV
# head: verify's 16 query rows per KV head take the C++ kernel's wide path
PRESETS = ("tiny-llama", "tiny-gemma2", "tiny-llama-g4")


@pytest.fixture(scope="module")
def ngram_jobs(tmp_path_factory):
    """Each preset's checkpoint (``live_models``: written once per session) and its engine run, all started at
    once, ``PARALLEL`` at a time: {preset: (dir, future of :func:`_ngram_job`'s result)}."""
    pytest.importorskip("sglang")
    pool = ThreadPoolExecutor(max_workers=PARALLEL)
    jobs = {}
    for preset in PRESETS:
        d = checkpoint(preset, tmp_path_factory)
        jobs[preset] = (d, pool.submit(_ngram_job, d, tmp_path_factory.mktemp("ngram")))
    yield jobs
    pool.shutdown(wait=True)


@pytest.fixture(scope="module", params=PRESETS)
def reference(request, ngram_jobs, tmp_path_factory):
    """A tiny checkpoint, its transformers model and transformers' greedy continuation of each prompt (``live_models``:
    made once per session): (preset, dir, model, tokens)."""
    return (request.param, *tiny_model(request.param, tmp_path_factory, prompts(), NEW_TOKENS))


@pytest.fixture(scope="module")
def ngram_run(reference, ngram_jobs):
    """The preset's engine run (subprocess) and its count of TARGET_VERIFY forwards."""
    return ngram_jobs[reference[0]][1].result()


def _ngram_job(model_dir: str, tmp) -> dict:
    """One engine run in a subprocess (:func:`_worker`), with its TARGET_VERIFY forwards' batch sizes."""
    spec = dict(model_dir=model_dir, out=str(tmp / "result.json"), verify_log=str(tmp / "verify.log"))
    t0 = time.perf_counter()
    res = _run_group([sys.executable, os.path.abspath(__file__), json.dumps(spec)], JOB_TIMEOUT_S, _child_env())
    wall = round(time.perf_counter() - t0, 1)
    assert res.returncode == 0 and os.path.exists(spec["out"]), (
        f"engine failed (rc={res.returncode}):\n{res.stderr[-4000:]}")
    with open(spec["out"]) as f:
        out = dict(json.load(f), wall_s=wall)
    log = tmp / "verify.log"  # one line per forward (its batch size); absent if none ran
    out["verify_forwards"] = [int(bs) for bs in log.read_text().split()] if log.exists() else []
    return out


def test_ngram_tokens_equal_transformers(reference, ngram_run):
    """Llama: identical tokens. Gemma 2: identical or greedy up to near-ties (``test_live_engine.TIE_TOL``: SGLang's
    Gemma 2 differs slightly from transformers'; a window ignored would miss by far more)."""
    preset, _, model, expected = reference
    for r, idx in enumerate(ROUNDS):
        for i, res in zip(idx, ngram_run["rounds"][r], strict=True):
            assert_greedy(preset, model, prompts()[i], res["ids"], expected[i], f"{preset} round {r}, prompt {i}")


def test_ngram_drafts_accepted_and_verified_by_our_backend(ngram_run):
    rounds = ngram_run["rounds"]
    forwards = ngram_run["verify_forwards"]
    # every decode step of an NGRAM request is a verify step, each one of our TARGET_VERIFY forwards
    assert len(forwards) >= sum(max(res["spec_verify_ct"] for res in rnd) for rnd in rounds) > 0, ngram_run
    accepted = [res["spec_num_correct_drafts"] for rnd in rounds for res in rnd]
    assert sum(accepted[3:]) > 0, ngram_run  # the repeated rounds draft from the first round's continuations
    # with drafts accepted, a request needs fewer verify steps than tokens
    assert min(res["spec_verify_ct"] for res in rounds[1]) < NEW_TOKENS, ngram_run


if __name__ == "__main__":  # worker: python tests/test_live_ngram.py '<json spec>'
    spec = json.loads(sys.argv[1])
    result = _worker(spec)
    with open(spec["out"], "w") as f:
        json.dump(result, f)
    os._exit(0)  # SGLang may leave non-daemon threads behind after shutdown: don't wait for them
