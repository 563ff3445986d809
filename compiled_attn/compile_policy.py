"""The one place that calls ``torch.compile`` (``fullgraph=True``: a graph break would hide host work inside a
captured step; ``dynamic=True``: one compile serves every bucket), its recompile limit, and opaque ops.

Opaque ops (``opaque_op``): what ``torch.library.custom_op`` gives (one graph node, a fake for shapes) without its
per-call Python layers, which cost as much as a short decode kernel. Inference-only, registered as
``CompositeExplicitAutograd`` kernels; the output must not alias an input (every op here returns new tensors).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

DEFAULT_RECOMPILE_LIMIT = 256


def allow_data_dependent_sizes() -> None:
    """Keep ops whose output size follows tensor data inside the graph: a ``torch.compile`` without
    ``fullgraph=True`` (SGLang's CPU graph runner) otherwise breaks the graph on every attention layer."""
    torch._dynamo.config.capture_dynamic_output_shape_ops = True


def configure_dynamo(recompile_limit: int = DEFAULT_RECOMPILE_LIMIT) -> None:
    """Allow one compiled graph per bucket (and per layer configuration) without hitting dynamo's limit (default 8:
    the ninth bucket would fail under ``fullgraph=True``)."""
    allow_data_dependent_sizes()
    cfg = torch._dynamo.config
    # duck sizing equates dims that merely happen to be equal at the first compile (a batch of 4 and 4 heads),
    # and the first batch of another size then recompiles; buckets make such coincidences common
    fx_config = getattr(torch.fx.experimental, "_config", None)
    if fx_config is not None and hasattr(fx_config, "use_duck_shape"):
        fx_config.use_duck_shape = False
    # the floats a step reads are model constants (softmax scale, KV scales): a symbolic one handed to an opaque op
    # makes dynamo restart the whole trace to specialize it
    cfg.specialize_float = True
    # so are its ints (page size, block size): a symbolic page size made each K/V index a symbolic division (slow).
    # Sizes still come from tensor shapes, symbolic as before.
    cfg.specialize_int = True
    for name in ("recompile_limit", "cache_size_limit"):  # renamed in torch 2.7; keep both for torch >= 2.6
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), recompile_limit))
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, recompile_limit * 4)
    elif hasattr(cfg, "accumulated_cache_size_limit"):
        cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, recompile_limit * 4)


def compile_step(fn: Callable, *, dynamic: bool | None = True, mode: str | None = None) -> Callable:
    """``torch.compile(fn, fullgraph=True)`` with this project's settings."""
    configure_dynamo()
    return torch.compile(fn, fullgraph=True, dynamic=dynamic, mode=mode)


NAMESPACE = "compiled_attn"
# the registration handle: the ops live as long as it does (a fragment: other modules may add ops to the namespace)
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


def opaque_op(fn: Callable) -> torch._ops.OpOverload:
    """Register ``fn`` (annotated like a ``custom_op`` function) as ``torch.ops.compiled_attn.<fn name>`` and return
    that op; register its fake with ``torch.library.register_fake(op)``."""
    name = fn.__name__
    _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=()))
    _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
    return getattr(getattr(torch.ops, NAMESPACE), name).default
