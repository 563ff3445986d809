"""One ``torch.compile`` of the model for every batch size SGLang's CPU graph runner captures.

SGLang 0.5.23's ``CPUGraphRunner`` wraps the model in a fresh ``torch.compile(model.forward, dynamic=False)`` for
each captured batch size (``cpu_graph_runner.patch_model``): start-up is one whole-model compile per size, and the
CPU default (``--torch-compile-max-bs 32``) captures several. :func:`compile_decode_once` replaces that context
manager with one that hands every size the same compiled forward, whose batch dimension is marked dynamic: the
largest size (captured first) compiles a graph that serves every size from 2 up, and batch size 1 compiles once
more (dynamo specialises a dimension of size 1). Each captured size prints one line when it is ready.
"""
from __future__ import annotations

import sys
import time
import weakref
from contextlib import contextmanager

import torch

# the ForwardBatch tensors a decode graph reads whose first dimension is the batch (or its tokens: one per request)
BATCH_TENSORS = ("req_pool_indices", "seq_lens", "out_cache_loc")


def graphs_compiled() -> int:
    """The graphs ``torch.compile`` has made in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def mark_batch_dynamic(input_ids: torch.Tensor, positions: torch.Tensor, forward_batch) -> None:
    """Marks the batch dimension of a decode forward's inputs dynamic (``input_ids``, ``positions``: [num_tokens];
    ``BATCH_TENSORS`` of ``forward_batch``: [bs]). A batch of one is left static: dynamo would specialise it anyway,
    and marking it would make it refuse to."""
    for t in (input_ids, positions, *(getattr(forward_batch, n, None) for n in BATCH_TENSORS)):
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] > 1:
            torch._dynamo.mark_dynamic(t, 0)


def batch_dynamic_forward(model, cache: weakref.WeakKeyDictionary):
    """``model.forward`` compiled once per model (kept in ``cache``), its batch dimension marked dynamic at each
    call (marking only tags the tensors: a call that hits a compiled graph pays a few attribute writes)."""
    compiled = cache.get(model)
    if compiled is None:
        compiled = cache[model] = torch.compile(torch.no_grad()(model.forward), dynamic=None)

    def forward(input_ids, positions, forward_batch, *args, **kwargs):
        mark_batch_dynamic(input_ids, positions, forward_batch)
        return compiled(input_ids, positions, forward_batch, *args, **kwargs)

    return forward


def compile_decode_once() -> bool:
    """The fix-up (``cpu_fixups.FIXUPS``): ``cpu_graph_runner.patch_model`` hands out one compiled forward per model
    (``batch_dynamic_forward``) and prints a line per captured size; False if already applied."""
    from sglang.srt.model_executor import cpu_graph_runner

    original = cpu_graph_runner.patch_model
    if getattr(original, "compiled_attn", False):
        return False
    cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @contextmanager
    def patch_model(model, enable_compile, num_tokens, tp_group):
        if not enable_compile:
            with original(model, enable_compile, num_tokens, tp_group) as forward:
                yield forward
            return
        t0, before = time.perf_counter(), graphs_compiled()
        yield batch_dynamic_forward(model, cache)
        # the runner captures inside this context: one line per size, as a log shows it (tqdm's bar does not)
        print(f"compiled_attn: decode graph for {num_tokens} tokens ready in {time.perf_counter() - t0:.1f} s "
              f"({graphs_compiled() - before} graph(s) compiled for it)", file=sys.stderr, flush=True)

    patch_model.compiled_attn = True
    cpu_graph_runner.patch_model = patch_model
    return True
