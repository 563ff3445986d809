"""SGLang plugin entry point: makes ``--attention-backend compiled_attn`` available.

SGLang (>= 0.5.23) calls every function registered under the entry-point group ``sglang.srt.plugins`` early in
each of its processes (``sglang.srt.plugins.load_plugins()``); ours is ``register`` (see ``pyproject.toml``).
It only registers a factory and a CLI choice; the backend module (which imports SGLang's attention classes) is
imported when SGLang creates the backend.
"""
from __future__ import annotations

BACKEND_NAME = "compiled_attn"


def create_backend(model_runner):
    """The factory SGLang calls with its ``ModelRunner`` (it reads ``device``, ``req_to_token_pool``,
    ``token_to_kv_pool``)."""
    from .backend import CompiledAttnBackend

    return CompiledAttnBackend(model_runner)


def register() -> None:
    """Register the backend under ``compiled_attn`` and add it to ``--attention-backend``'s choices.

    Idempotent: safe to call more than once per process (SGLang loads plugins in several processes, and a
    process may load them more than once).
    """
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import add_attention_backend_choices

    if ATTENTION_BACKENDS.get(BACKEND_NAME) is not create_backend:
        register_attention_backend(BACKEND_NAME)(create_backend)
    # add_attention_backend_choices is ATTENTION_BACKEND_CHOICES.extend: add the name once
    choices = getattr(add_attention_backend_choices, "__self__", None)
    if choices is None or BACKEND_NAME not in choices:
        add_attention_backend_choices([BACKEND_NAME])
    admit_in_model_checks()


def admit_in_model_checks() -> None:
    """SGLang 0.5.23 admits some models only with the attention backends it lists (``arg_groups/model_hook.py``:
    gpt-oss and Gemma 4 assert one of triton, intel_amx, ..., the backends with sliding windows and sinks): this
    backend serves both, so within those checks alone it reads as ``triton`` (listed for both). Idempotent."""
    try:
        import sglang.srt.arg_groups.model_hook as hook
    except ImportError:  # another SGLang layout: nothing to admit
        return
    listed = hook.attention_backends_of
    if getattr(listed, "_compiled_attn_admits", False):
        return

    def attention_backends_of(*args, **kwargs):
        return tuple("triton" if b == BACKEND_NAME else b for b in listed(*args, **kwargs))

    attention_backends_of._compiled_attn_admits = True
    hook.attention_backends_of = attention_backends_of  # model_hook looks the name up per check
