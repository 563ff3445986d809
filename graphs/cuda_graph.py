"""CUDA-graph mechanics used by ``GraphRunner``: side-stream warm-up, capture into a shared pool, sync, and
the signatures of the persistent tensors a graph baked in.

Kept apart from the runner's bookkeeping so the few lines that touch ``torch.cuda`` are in one place; on a
CPU device the stream helpers are no-ops (``stream`` is None).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["capture_graph", "describe_changes", "on_stream", "signatures", "synchronize", "tensor_signature"]


@contextlib.contextmanager
def on_stream(stream: Any) -> Iterator[None]:
    """Run the block on ``stream`` (a ``torch.cuda.Stream``), ordered after and before the current stream.

    Warm-up before capture runs on the capture's side stream, as PyTorch's CUDA-graph docs and SGLang's
    cuda_graph_runner do: lazy initialisation (cuBLAS workspaces, autotuning, compiled kernels' first launch)
    then happens on the stream the capture will use. ``stream=None``: the block runs unchanged (CPU path).
    """
    if stream is None:
        yield
        return
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        current.wait_stream(stream)  # later work on the current stream sees the block's results


def capture_graph(fn: Callable[[], Any], pool: Any, stream: Any) -> tuple[Any, Any]:
    """Capture ``fn()`` into a new ``torch.cuda.CUDAGraph`` using memory ``pool`` on ``stream``.

    Returns ``(graph, outputs)``: ``outputs`` are the static tensors the graph writes on every replay; they
    live in the pool, so keep a reference for as long as the graph is replayed. ``fn`` must already have run
    (compiled, autotuned) outside capture.
    """
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        outputs = fn()
    torch.cuda.synchronize(stream.device)
    return graph, outputs


def synchronize(device: torch.device) -> None:
    """Wait for ``device`` (CUDA only): timings then measure the work, not the launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- persistent-tensor signatures ----

_FIELDS = ("data_ptr", "shape", "stride", "dtype", "device")


def tensor_signature(t: torch.Tensor, *, with_ptr: bool) -> tuple:
    """What a captured graph (``with_ptr``: address + metadata) or a compiled function's guards (metadata only)
    depend on. Address and shape together: a smaller tensor allocated at a freed tensor's address must not
    pass. On the per-run path, so kept to a few attribute reads (~0.5 us per tensor on CPU)."""
    if with_ptr:
        return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
    return (t.shape, t.stride(), t.dtype, t.device)


def signatures(tensors: Mapping[str, torch.Tensor], *, with_ptr: bool) -> dict[str, tuple]:
    """name -> ``tensor_signature``; TypeError naming any value that is not a tensor."""
    try:
        return {name: tensor_signature(t, with_ptr=with_ptr) for name, t in tensors.items()}
    except AttributeError:
        bad = {n: type(t).__name__ for n, t in tensors.items() if not isinstance(t, torch.Tensor)}
        raise TypeError(f"persistent values must be tensors, got {bad}") from None


def describe_changes(recorded: Mapping[str, tuple], tensors: Mapping[str, torch.Tensor], *,
                     with_ptr: bool) -> dict[str, str]:
    """name -> what differs between ``tensors`` and the ``recorded`` signatures (missing, new, or which fields
    changed, e.g. ``persistent tensor 'cache' was replaced (shape (64, 8) -> (128, 8))``); empty: nothing."""
    changes = {n: f"persistent tensor {n!r} is missing" for n in recorded if n not in tensors}
    changes |= {n: f"persistent tensor {n!r} is new" for n in tensors if n not in recorded}
    fields = _FIELDS if with_ptr else _FIELDS[1:]
    for name, old in recorded.items():
        if name not in tensors:
            continue
        new = tensor_signature(tensors[name], with_ptr=with_ptr)
        diff = [f"{f} {_show(a)} -> {_show(b)}" for f, a, b in zip(fields, old, new, strict=False) if a != b]
        if diff:
            changes[name] = f"persistent tensor {name!r} was replaced ({', '.join(diff)})"
    return changes


def _show(value: Any) -> Any:
    """``(64, 8)`` rather than ``torch.Size([64, 8])`` in messages."""
    return tuple(value) if isinstance(value, torch.Size) else value
