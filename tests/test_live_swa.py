"""A live SGLang engine on CPU serving a tiny gpt-oss with ``--attention-backend compiled_attn`` over SGLang's hybrid
sliding-window memory (``SWAKVPool``, gpt-oss's default: its window layer's K/V in a pool of their own, freed below
each request's window), against ``transformers.generate``.

The checkpoint is ``make_model``'s ``tiny-gpt-oss`` (layer 0 over a 16-token window, layer 1 full, attention sinks
in both, a biased MoE, YaRN rope); its prompts are ``test_live_engine``'s (5 at once, the longest, 100 tokens,
prefilled in two chunks, two sharing a 24-token prefix; then two alone: one reusing the radix cache, the longest),
so the window binds and SGLang frees window-pool tokens while requests run (after a long prompt's first chunk).
Engines: eager; ``--enable-torch-compile`` (its bs=1 decodes run the CPU graph runner's compiled forward); n-gram
speculative decoding (its steps ``TARGET_VERIFY`` forwards over the window pool). Each runs in a subprocess
(``test_live_engine``'s reasons and helpers), with a scheduler target (:func:`run_scheduler_recording_pool`) that
records, in the scheduler process, the KV pool our backend was built on and, per decode or verify batch, how many
of its positions the window pool had freed (mapping entry 0) and how many sit at window-pool slots other than their
full-pool ones: the test asserts the engine served an ``SWAKVPool``, decoded past freed tokens (at batch size 1
too) and read K/V the translation moved. Tokens must equal transformers' (near-ties within ``TIE_TOL`` allowed).

SGLang 0.5.23 admits gpt-oss only with the attention backends it lists (``arg_groups/model_hook.py``); the plugin
admits ``compiled_attn`` there (``plugin.admit_in_model_checks``), so the engine starts as ``serve`` starts it.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
from live_models import tiny_model
from test_live_engine import (
    ENGINE_KW,
    JOB_TIMEOUT_S,
    NEW_TOKENS,
    PARALLEL,
    _child_env,
    _greedy_within_ties,
    _run_group,
    generate_then_shut_down,
    prompts,
)

pytestmark = pytest.mark.live

PRESET = "tiny-gpt-oss"
POOL_LOG = "COMPILED_ATTN_TEST_POOL_LOG"
TIE_TOL = 1e-3  # the compiled bs=1 decode may sum in another order than the eager one: near-ties only
SINGLES = (3, 4)  # run again alone: 3 reuses the cached shared prefix; 4 (100 tokens) decodes at bs=1 past freed ones
ENGINES = {
    "gpt-oss-eager": dict(disable_cuda_graph=True),
    "gpt-oss-compile": dict(enable_torch_compile=True),  # cuda_graph_bs_decode=[1] (ENGINE_KW)
    # n-gram drafts (no draft model, as test_live_ngram): TARGET_VERIFY over the window pool, eager, page size 1
    "gpt-oss-ngram": dict(disable_cuda_graph=True, page_size=1, speculative_algorithm="NGRAM",
                          speculative_num_draft_tokens=4, speculative_ngram_max_trie_depth=8),
}


# --- subprocess side -----------------------------------------------------------------------------------------


def run_scheduler_recording_pool(*args, **kwargs):
    """SGLang's scheduler process, recording (one JSON line each, to ``$COMPILED_ATTN_TEST_POOL_LOG``) the pool our
    backend is built on and, per decode batch, the positions of its requests the window pool had freed and those
    whose window-pool slot differs from their full-pool slot. The window pool's free list is shuffled first (seeded,
    as a long-running server's frees leave it): a fresh server hands out both pools' slots in the same order, so an
    untranslated read would find the right K/V until the two orders part."""
    import torch

    from compiled_attn.sglang.backend import CompiledAttnBackend

    init, metadata = CompiledAttnBackend.__init__, CompiledAttnBackend.init_forward_metadata

    def log(**entry):
        with open(os.environ[POOL_LOG], "a") as f:
            f.write(json.dumps(entry) + "\n")

    def recording_init(self, model_runner, *a, **kw):
        init(self, model_runner, *a, **kw)
        log(pool=type(self.token_to_kv_pool).__name__, window_pool=self.swa is not None)
        window = getattr(getattr(model_runner, "token_to_kv_pool_allocator", None), "swa_attn_allocator", None)
        if window is not None:
            free = window.free_pages
            window.free_pages = free[torch.randperm(free.numel(), generator=torch.Generator().manual_seed(0))]

    def recording_metadata(self, forward_batch):
        metadata(self, forward_batch)
        mode = forward_batch.forward_mode
        if self.swa is not None and (mode.is_decode() or mode.is_target_verify()):  # eager, before compiled code
            mapping, table = self.swa.slot_map.table, self.req_to_token
            full = torch.cat([table[row, :n].long() for row, n in zip(forward_batch.req_pool_indices.tolist(),
                                                                      forward_batch.seq_lens.tolist(), strict=True)])
            window = mapping[full]
            log(freed=int((window == 0).sum()), moved=int(((window != full) & (window > 0)).sum()),
                bs=len(forward_batch.seq_lens), verify=bool(mode.is_target_verify()))

    CompiledAttnBackend.__init__ = recording_init
    CompiledAttnBackend.init_forward_metadata = recording_metadata
    from sglang.srt.managers.scheduler import run_scheduler_process

    return run_scheduler_process(*args, **kwargs)


def _worker(spec: dict) -> dict:
    """Start one engine (hybrid SWA memory: SGLang's default for gpt-oss), run the prompts, shut down."""
    from compiled_attn.sglang import cpu_fixups, serve

    cpu_fixups.apply()  # before SGLang is imported
    os.environ[POOL_LOG] = spec["pool_log"]  # inherited by the scheduler
    t0 = time.perf_counter()
    eng = serve.engine(model_path=spec["model_dir"], **ENGINE_KW, attention_backend="compiled_attn", dtype="float32",
                       scheduler_target=cpu_fixups.ChildTarget("test_live_swa", "run_scheduler_recording_pool"),
                       **spec["kwargs"])
    result = generate_then_shut_down(eng, prompts(), SINGLES, NEW_TOKENS, time.perf_counter() - t0)
    result.pop("single_outputs")
    return result


# --- pytest side ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The checkpoint, its transformers model (eager attention: sinks and the window) and its greedy tokens
    (``live_models``: made once per session)."""
    return tiny_model(PRESET, tmp_path_factory, prompts(), NEW_TOKENS)


@pytest.fixture(scope="module")
def runs(reference, tmp_path_factory):
    """Both engines, two at a time (as ``test_live_engine``'s jobs): {name: result, with its pool log}."""
    from concurrent.futures import ThreadPoolExecutor

    pytest.importorskip("sglang")

    def job(name):
        tmp = tmp_path_factory.mktemp(name)
        spec = dict(model_dir=reference[0], kwargs=ENGINES[name], out=str(tmp / "result.json"),
                    pool_log=str(tmp / "pool.log"))
        t0 = time.perf_counter()
        res = _run_group([sys.executable, os.path.abspath(__file__), json.dumps(spec)], JOB_TIMEOUT_S, _child_env())
        wall = round(time.perf_counter() - t0, 1)
        if res.returncode != 0 or not os.path.exists(spec["out"]):
            return dict(ok=False, wall_s=wall, rc=res.returncode, stderr=res.stderr[-4000:])
        with open(spec["out"]) as f:
            out = dict(json.load(f), ok=True, wall_s=wall)
        log = tmp / "pool.log"
        out["log"] = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        return out

    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        return dict(zip(ENGINES, pool.map(job, ENGINES), strict=True))


@pytest.mark.parametrize("name", list(ENGINES))
def test_gpt_oss_over_the_window_pool_matches_transformers(name, reference, runs):
    _, model, expected = reference
    res = runs[name]
    assert res["ok"], f"{name}: engine failed (rc={res.get('rc')}):\n{res.get('stderr')}"
    pools = [e for e in res["log"] if "pool" in e]
    assert pools and all(e == {"pool": "SWAKVPool", "window_pool": True} for e in pools), pools
    # decodes read past tokens the pool had freed, alone too (the compiled engine: its graph's bs=1 forward), and
    # their window layer's K/V at slots other than the full pool's
    steps = [e for e in res["log"] if "freed" in e]
    assert any(e["freed"] > 0 and e["bs"] == 1 for e in steps) and all(e["moved"] > 0 for e in steps), steps
    # the n-gram engine's steps verify drafts (TARGET_VERIFY), the others' decode
    assert all(e["verify"] == ("speculative_algorithm" in ENGINES[name]) for e in steps), steps
    batch = prompts()
    for i, tokens in list(enumerate(res["batch"])) + list(zip(SINGLES, res["singles"], strict=True)):
        assert len(tokens) == NEW_TOKENS
        if tokens != expected[i]:
            assert _greedy_within_ties(model, batch[i], tokens, TIE_TOL), (
                f"{name}: prompt {i} ({len(batch[i])} tokens): got {tokens}, transformers {expected[i]}")


if __name__ == "__main__":  # worker: python tests/test_live_swa.py '<json spec>'
    spec = json.loads(sys.argv[1])
    result = _worker(spec)
    with open(spec["out"], "w") as f:
        json.dump(result, f)
    os._exit(0)  # SGLang may leave non-daemon threads behind after shutdown: don't wait for them
