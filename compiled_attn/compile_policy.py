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
"""
from __future__ import annotations

import os
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


def set_cache_dir(path: str | None) -> None:
    """Point inductor's on-disk caches at ``path`` (kept across restarts, so the second start compiles less)."""
    if path:
        os.makedirs(path, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path


def compile_step(fn: Callable, *, dynamic: bool | None = True, mode: str | None = None) -> Callable:
    """``torch.compile(fn, fullgraph=True)`` with this project's settings."""
    configure_dynamo()
    return torch.compile(fn, fullgraph=True, dynamic=dynamic, mode=mode)


def save_artifacts(path: str) -> bool:
    """Save inductor's compiled artifacts of this process to ``path``; False when torch lacks the API."""
    save = getattr(torch.compiler, "save_cache_artifacts", None)
    if save is None:
        return False
    result = save()
    if result is None:
        return False
    data, _info = result
    with open(path, "wb") as f:
        f.write(data)
    return True


def load_artifacts(path: str) -> bool:
    """Load artifacts saved by ``save_artifacts`` (hot-loads the caches); False when absent or unsupported."""
    load = getattr(torch.compiler, "load_cache_artifacts", None)
    if load is None or not os.path.exists(path):
        return False
    with open(path, "rb") as f:
        load(f.read())
    return True
