"""The one place that calls ``torch.compile``: settings chosen by measurement, recompile limit, caches.

- ``fullgraph=True``: a graph break would hide host work inside a step we mean to capture.
- ``dynamic=True``: one compile serves every bucket (dynamo adds one more for size-1 dims), and each bucket is
  then captured or replayed at its static shape. A static compile costs seconds *per bucket* and its kernels ran
  no faster (docs/performance.md), so per-bucket static compiles would turn a 30-bucket warm-up into minutes.
  ``dynamic=False`` stays available for experiments.
- Floats and ints are specialized (``specialize_float``, ``specialize_int``): they are constants of a model
  (softmax scale, page size); a symbolic float cost a restarted trace, a symbolic int slower kernels.
- The recompile limit is raised deliberately: the default of 8 per function would make the ninth bucket raise
  ``FailOnRecompileLimitHit`` under ``fullgraph=True``.

Opaque ops (``opaque_op``): what ``torch.library.custom_op`` gives (the compiled graph calls the
function as one node; a fake registered beside it gives its output shapes) without its per-call Python layers.

Why: a ``custom_op`` call passes through an autograd wrapper, a redispatch and an output-aliasing check in Python,
30-40 us per call on this project's CPUs, as much as a short request's whole decode kernel, once per layer per
step. These ops are inference-only (no backward), so they are registered straight on the dispatcher as
``CompositeExplicitAutograd`` kernels: a call goes from the dispatcher to the Python function. The output must
still not alias an input (the compiled graph assumes it), as for ``custom_op``: every op here returns new tensors.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

DEFAULT_RECOMPILE_LIMIT = 256


def allow_data_dependent_sizes() -> None:
    """Keep ops whose output size follows tensor data (an index built inside a compiled forward) inside the graph.
    ``fullgraph=True`` traces them anyway; a ``torch.compile`` without it (SGLang's CPU graph runner) otherwise
    breaks the graph there on every attention layer, and dynamo runs the broken frames (the layer's loop included)
    eagerly, so a compiled step of a small model took twice its eager time."""
    torch._dynamo.config.capture_dynamic_output_shape_ops = True


def configure_dynamo(recompile_limit: int = DEFAULT_RECOMPILE_LIMIT) -> None:
    """Allow one compiled graph per bucket (and per layer configuration) without hitting dynamo's limit."""
    allow_data_dependent_sizes()
    cfg = torch._dynamo.config
    # duck sizing equates dims that merely happen to be equal at the first compile (a batch of 4 and 4 heads),
    # and the first batch of another size then recompiles; buckets make such coincidences common
    fx_config = getattr(torch.fx.experimental, "_config", None)
    if fx_config is not None and hasattr(fx_config, "use_duck_shape"):
        fx_config.use_duck_shape = False
    # the floats a step reads are constants (softmax scale, KV scales): traced as symbols, one handed to an opaque
    # op cannot be made a tensor, and dynamo restarts the whole trace to specialize it (a second tracing pass:
    # ~4 s of a 4-layer decode step's 9 s compile, on every start, warm restarts included)
    cfg.specialize_float = True
    # so are the ints a step reads (page size, block size, head counts): dynamic=True otherwise traces every int
    # argument, attribute and closure cell as a symbol, and a symbolic page size made each K/V index of the fused
    # decode kernel a symbolic division (5x slower). Sizes still come from tensor shapes, symbolic as before.
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
