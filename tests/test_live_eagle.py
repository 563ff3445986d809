"""EAGLE speculative decoding in a live SGLang engine on CPU with ``--attention-backend compiled_attn``: the tokens are
greedy decoding's, and the drafts accepted are exactly the ones a simulation predicts.

One subprocess (as in ``test_live_engine.py``, whose helpers this reuses) starts engines on the tiny Llama one
after the other and generates ``NEW_TOKENS`` greedily for three prompts as one batch in each; every run must give
transformers' greedy tokens (which the tiny Llama's engine without speculation gives exactly,
``test_live_engine``):

- ``eagle-chain`` / ``eagle-tree``: ``--speculative-algorithm EAGLE`` with the seeded random draft head of
  ``make_eagle`` (topk 1, 3 steps, 4 draft tokens; topk 4, 3 steps, 8 draft tokens). Its drafts are random, so
  the accept length stays near 1 (printed);
- ``self-chain`` / ``self-tree``: ``--speculative-algorithm STANDALONE`` with the target itself as the draft model,
  the same settings. SGLang's EAGLE worker runs it (draft extend over our backend, the multi-step draft decode through
  ``spec_kernels_cpu.DraftDecodeSteps``, the tree ops in the ``sgl_kernel`` stand-in, TARGET_VERIFY over the tree
  mask), feeding the draft each position's *next* token (EAGLE's layout), so the draft is the target over the
  sequence without its first token. :func:`simulate` replays that with transformers, and SGLang's per-request
  ``spec_verify_ct`` / ``spec_num_correct_drafts`` must equal it: drafts are accepted (accept length 2-3.2), and
  each one accepted proves the draft's attention, the tree and the verify agree with the target.

CI's default run starts ``eagle-chain`` and ``self-tree`` (a chain and a tree, the EAGLE head and a self-draft whose
acceptance the simulation checks); ``COMPILED_ATTN_LIVE_ALL=1`` adds the other two. The engine tests are marked
``live`` (about 1 min on 2 cores); ``make_eagle``'s layout and ``serve``'s checks for speculative flags on CPU are
plain tests.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
from live_models import greedy_reference, reference_model
from test_live_engine import (
    ENGINE_KW,
    JOB_TIMEOUT_S,
    _child_env,
    _run_group,
    engine_params,
    engine_selected,
)

NEW_TOKENS = 16
CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
ENGINE = dict(ENGINE_KW, attention_backend="compiled_attn", disable_cuda_graph=True, page_size=1)
# run name -> (speculative algorithm, draft: "eagle" head or "self", settings)
RUNS = {
    "eagle-chain": ("EAGLE", "eagle", CHAIN),
    "eagle-tree": ("EAGLE", "eagle", TREE),
    "self-chain": ("STANDALONE", "self", CHAIN),
    "self-tree": ("STANDALONE", "self", TREE),
}
DEFAULT_RUNS = ("eagle-chain", "self-tree")  # CI's default run; COMPILED_ATTN_LIVE_ALL=1: all
META = ("spec_verify_ct", "spec_num_correct_drafts", "spec_accept_length")


def prompts() -> list[list[int]]:
    """A short prompt, a repeated 5-token pattern and a longer one (as ``test_live_ngram``)."""
    base = [4 + (7 * i) % 250 for i in range(60)]
    return [base[:5], [40, 41, 42, 43, 44] * 4, base[10:40]]


# --- subprocess side -----------------------------------------------------------------------------------------


def _worker(spec: dict) -> dict:
    """The engine of each of ``spec["runs"]`` in turn (started, one batch generated, shut down); the results as a
    dict."""
    from compiled_attn.sglang import serve

    sampling = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    out = {}
    for name in spec["runs"]:
        algorithm, draft, settings = RUNS[name]
        kw = dict(settings, speculative_algorithm=algorithm,
                  speculative_draft_model_path=spec["eagle_dir"] if draft == "eagle" else spec["model_dir"])
        t0 = time.perf_counter()
        eng = serve.engine(model_path=spec["model_dir"], **ENGINE, **kw)
        try:
            t1 = time.perf_counter()
            outs = eng.generate(input_ids=prompts(), sampling_params=sampling)
            t2 = time.perf_counter()
        finally:
            eng.shutdown()
        out[name] = dict(start_s=round(t1 - t0, 1), generate_s=round(t2 - t1, 2),
                         reqs=[dict(ids=o["output_ids"], **{k: o["meta_info"].get(k) for k in META}) for o in outs])
    return out


# --- pytest side ---------------------------------------------------------------------------------------------


def simulate(model, prompt: list[int], topk: int, steps: int, num_draft: int, new_tokens: int):
    """(tokens, verify steps, accepted drafts) of SGLang's STANDALONE self-draft, replayed with transformers.

    Each round drafts from the committed sequence without its first token (EAGLE's layout shifts the draft's input
    one position). Candidates as SGLang's draft_forward: the ``topk`` likeliest next tokens, then ``steps - 1``
    times the ``topk`` children of each of the ``topk`` best branches so far (cumulative probability); the
    ``num_draft - 1`` best candidates form the tree. The target then walks it greedily (``verify_tree_greedy``)
    and adds its bonus token.
    """
    import torch

    cache: dict = {}

    def probs(seq):
        if tuple(seq) not in cache:
            with torch.no_grad():
                cache[tuple(seq)] = torch.softmax(model(torch.tensor([seq])).logits[0, -1], -1)
        return cache[tuple(seq)]

    def tree(ctx):
        p, t = torch.topk(probs(ctx), topk)
        cands = branches = [([tok], float(s)) for tok, s in zip(t.tolist(), p, strict=True)]
        for _ in range(1, steps):
            grown = []
            for path, score in branches:
                p, t = torch.topk(probs(ctx + path), topk)
                grown += [(path + [tok], score * float(s)) for tok, s in zip(t.tolist(), p, strict=True)]
            cands = cands + grown
            branches = [grown[i] for i in torch.topk(torch.tensor([s for _, s in grown]), topk).indices.tolist()]
        best = torch.topk(torch.tensor([s for _, s in cands]), num_draft - 1).indices.tolist()
        return {tuple(cands[i][0]) for i in best}

    seq = list(prompt)
    seq.append(int(probs(seq).argmax()))  # the prefill's token
    verify = accepted = 0
    while len(seq) - len(prompt) < new_tokens:
        drafts, path = tree(seq[1:]), []
        while len(path) < steps and tuple(path + [int(probs(seq + path).argmax())]) in drafts:
            path.append(int(probs(seq + path).argmax()))
        seq += path + [int(probs(seq + path).argmax())]
        verify, accepted = verify + 1, accepted + len(path)
    return seq[len(prompt):len(prompt) + new_tokens], verify, accepted


@pytest.fixture(scope="module")
def eagle_runs(tmp_path_factory):
    """The tiny Llama's transformers model, its greedy tokens (``live_models``: made once per session), and the
    subprocess's results (its EAGLE head made)."""
    pytest.importorskip("sglang")
    from compiled_attn.sglang.make_eagle import make_eagle

    model_dir, model = reference_model("tiny-llama", tmp_path_factory)
    tmp = tmp_path_factory.mktemp("eagle")
    spec = dict(model_dir=model_dir, eagle_dir=make_eagle(model_dir, str(tmp / "eagle")), out=str(tmp / "out.json"),
                runs=[name for name in RUNS if engine_selected(name, DEFAULT_RUNS)])
    t0 = time.perf_counter()
    res = _run_group([sys.executable, os.path.abspath(__file__), json.dumps(spec)], JOB_TIMEOUT_S, _child_env())
    assert res.returncode == 0 and os.path.exists(spec["out"]), f"engines failed (rc={res.returncode}):\n" \
                                                                f"{res.stderr[-4000:]}"
    with open(spec["out"]) as f:
        runs = json.load(f)
    greedy = greedy_reference(model, prompts(), NEW_TOKENS)
    print(f"\nlive EAGLE runs ({time.perf_counter() - t0:.0f} s in all):")
    for name, r in runs.items():
        print(f"  {name}: start {r['start_s']} s, generate {r['generate_s']} s, accept length "
              f"{[r2['spec_accept_length'] for r2 in r['reqs']]}")
    return model, greedy, runs


@pytest.mark.live
@pytest.mark.parametrize("name", engine_params(RUNS, DEFAULT_RUNS))
def test_tokens_equal_greedy_decoding(eagle_runs, name):
    _, greedy, runs = eagle_runs
    assert [r["ids"] for r in runs[name]["reqs"]] == greedy, name
    for r in runs[name]["reqs"]:  # speculation ran: each verify step commits at least one token
        assert 0 < r["spec_verify_ct"] <= NEW_TOKENS and r["spec_accept_length"] >= 1


@pytest.mark.live
@pytest.mark.parametrize("name", engine_params(["self-chain", "self-tree"], DEFAULT_RUNS))
def test_self_draft_accepts_what_the_simulation_predicts(eagle_runs, name):
    model, _, runs = eagle_runs
    settings = RUNS[name][2]
    for prompt, r in zip(prompts(), runs[name]["reqs"], strict=True):
        tokens, verify, accepted = simulate(model, prompt, settings["speculative_eagle_topk"],
                                            settings["speculative_num_steps"],
                                            settings["speculative_num_draft_tokens"], NEW_TOKENS)
        assert tokens == r["ids"]
        assert (r["spec_verify_ct"], r["spec_num_correct_drafts"]) == (verify, accepted), (name, prompt)
    assert sum(r["spec_num_correct_drafts"] for r in runs[name]["reqs"]) > 0


def test_serve_lets_the_eagle_worker_through_on_cpu(capsys):
    """On a CPU-only machine ``serve`` runs NGRAM and the EAGLE worker's algorithms, eagerly with page size 1, and
    refuses the others (and compile / pages with any of them) in one line naming the flag."""
    from compiled_attn.sglang import serve

    for algorithm in ("EAGLE", "eagle3", "NEXTN", "STANDALONE", "NGRAM"):
        serve.check_args(speculative_algorithm=algorithm, page_size=1, cpu=True)
    with pytest.raises(serve.UnsupportedArgument, match="^--speculative-algorithm DFLASH: .*CUDA kernels"):
        serve.check_args(speculative_algorithm="DFLASH", cpu=True)
    with pytest.raises(serve.UnsupportedArgument, match="^--enable-torch-compile: .*EAGLE .*eagerly"):
        serve.check_args(speculative_algorithm="EAGLE", enable_torch_compile=True, cpu=True)
    with pytest.raises(serve.UnsupportedArgument, match="^--page-size 16: .*EAGLE3 .*--page-size 1"):
        serve.check_args(speculative_algorithm="EAGLE3", page_size=16, cpu=True)
    serve.check_args(speculative_algorithm="DFLASH", enable_torch_compile=True, page_size=16, cpu=False)  # GPU
    if serve.cpu_fixups.cpu_only():
        assert serve.main(["--model-path", "unused", "--speculative-algorithm", "UNO"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--speculative-algorithm UNO" in err[0], err


def test_make_eagle_writes_sglangs_eagle_layout(tmp_path, capsys):
    """``make_eagle``: the target's Llama config with one layer, architecture ``LlamaForCausalLMEagle``; ``fc`` over
    ``[embedding, hidden]``, one decoder layer without ``input_layernorm``, the target's embedding; seeded."""
    from safetensors.torch import load_file

    from compiled_attn.sglang.make_eagle import main, make_eagle
    from compiled_attn.sglang.make_model import make_model

    target = make_model("tiny-llama", str(tmp_path / "llama"))
    assert main(["--target", target, str(tmp_path / "a")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "a")
    make_eagle(target, str(tmp_path / "b"))
    make_eagle(target, str(tmp_path / "c"), seed=1)
    with open(tmp_path / "a" / "config.json") as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"] and cfg["num_hidden_layers"] == 1
    a, b, c = (load_file(str(tmp_path / d / "model.safetensors")) for d in "abc")
    h = cfg["hidden_size"]
    assert a["fc.weight"].shape == (h, 2 * h) and a["fc.bias"].shape == (h,)
    assert "layers.0.input_layernorm.weight" not in a and "layers.0.post_attention_layernorm.weight" in a
    assert not any(k.startswith(("model.", "lm_head")) for k in a)  # SGLang adds the prefix; the head is shared
    assert (a["embed_tokens.weight"] == load_file(f"{target}/model.safetensors")["model.embed_tokens.weight"]).all()
    assert all((a[k] == b[k]).all() for k in a) and not (a["fc.weight"] == c["fc.weight"]).all()
    assert os.path.exists(tmp_path / "a" / "tokenizer.json")
    with pytest.raises(ValueError, match="Llama"):
        make_eagle(make_model("tiny-gemma2", str(tmp_path / "gemma")), str(tmp_path / "x"))


if __name__ == "__main__":  # worker: python tests/test_live_eagle.py '<json spec>'
    spec = json.loads(sys.argv[1])
    result = _worker(spec)
    with open(spec["out"], "w") as f:
        json.dump(result, f)
    os._exit(0)  # SGLang may leave non-daemon threads behind after shutdown: don't wait for them
