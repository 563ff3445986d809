"""The tiny checkpoints the live test files share, and their transformers models and greedy continuations, made once
per pytest session (this module's caches live as long as the pytest process).

``checkpoint(preset, tmp_path_factory)`` writes ``make_model``'s ``preset`` (seed 0) under the session's temp dir
the first time it is asked for; ``reference_model`` loads it in transformers once per (preset, dtype);
``greedy_reference(model, prompts, n)`` runs transformers' argmax decoding once per model and prompt, keeping the
longest continuation asked for (greedy decoding's first ``n`` tokens do not depend on how many follow, so a shorter
request is a prefix of it). ``tiny_model`` is the three together. Callers must not modify what they get back.

The engines themselves run in subprocesses (``test_live_engine``); only their checkpoint directories cross over.
"""

from __future__ import annotations

import weakref

_DIRS: dict[str, str] = {}
_MODELS: dict[tuple[str, str], object] = {}
_GREEDY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {prompt: longest continuation}
#: presets transformers must run with its eager attention: Gemma 2's SDPA path has no logit soft-capping, gpt-oss's
#: sinks and window are eager-only there
EAGER_ATTENTION = ("tiny-gemma2", "tiny-gpt-oss")


def checkpoint(preset: str, tmp_path_factory) -> str:
    """``preset``'s checkpoint directory, written the first time it is asked for in this session."""
    if preset not in _DIRS:
        from compiled_attn.sglang.make_model import make_model

        _DIRS[preset] = make_model(preset, str(tmp_path_factory.mktemp(preset)))
    return _DIRS[preset]


def load_reference(preset: str, model_dir: str, dtype: str = "float32"):
    """The checkpoint of ``preset`` in ``model_dir`` as a transformers model in ``dtype`` (not cached)."""
    import torch
    from transformers import AutoModelForCausalLM

    kw = dict(attn_implementation="eager") if preset in EAGER_ATTENTION else {}
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), **kw).eval()


def reference_model(preset: str, tmp_path_factory, dtype: str = "float32"):
    """``preset``'s checkpoint and its transformers model in ``dtype``: (dir, model), each made once per session."""
    d = checkpoint(preset, tmp_path_factory)
    if (preset, dtype) not in _MODELS:
        _MODELS[preset, dtype] = load_reference(preset, d, dtype)
    return d, _MODELS[preset, dtype]


def greedy_reference(model, token_prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' argmax continuation of each prompt, exactly ``new_tokens`` tokens, through an end-of-sequence
    token and past it as the engines run with ``ignore_eos`` (``generate``'s ``min_new_tokens`` would mask that
    token instead; a trained model reaches it), each computed once per model and prompt (for the most tokens asked
    so far)."""
    import torch

    done = _GREEDY.setdefault(model, {})
    out = []
    for ids in token_prompts:
        key = tuple(ids)
        if len(done.get(key, ())) < new_tokens:
            x, past, tokens = torch.tensor([ids]), None, []
            with torch.no_grad():
                for _ in range(new_tokens):
                    step = model(x, past_key_values=past, use_cache=True)
                    past, nxt = step.past_key_values, int(step.logits[0, -1].argmax())
                    tokens.append(nxt)
                    x = torch.tensor([[nxt]])
            done[key] = tokens
        out.append(done[key][:new_tokens])
    return out


def tiny_model(preset: str, tmp_path_factory, token_prompts: list[list[int]], new_tokens: int,
               dtype: str = "float32"):
    """(dir, transformers model, greedy continuation of each prompt) of ``preset``, shared across the live files."""
    d, model = reference_model(preset, tmp_path_factory, dtype)
    return d, model, greedy_reference(model, token_prompts, new_tokens)
