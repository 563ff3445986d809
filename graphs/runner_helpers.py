"""Small helpers of ``GraphRunner``: bucket keys as profiling attributes, warm-up order, step outputs."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch

Outputs = torch.Tensor | tuple[torch.Tensor, ...]
StepFn = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], Outputs]
Key = Hashable


def key_attrs(key: Key) -> dict[str, Any]:
    """Profiling/progress attributes of a key: a NamedTuple -> its fields; ``(bs, kv)`` -> bs, kv; an int -> bs;
    anything else -> key."""
    if isinstance(key, tuple) and hasattr(key, "_asdict"):  # a key that names its fields (e.g. tokens, pairs)
        return dict(key._asdict())
    if isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, int) for k in key):
        return {"bs": key[0], "kv": key[1]}
    if isinstance(key, int):
        return {"bs": key}
    return {"key": key}


def describe(attrs: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in attrs.items())


def largest_first(keys: Sequence[Key]) -> list[Key]:
    """Keys sorted largest first when they are comparable (ints, tuples of ints), else in the given order."""
    try:
        return sorted(keys, reverse=True)
    except TypeError:
        return list(keys)


def check_outputs(out: Any) -> Outputs:
    """A step returns a tensor or a tuple of tensors (a list is accepted and turned into a tuple)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
        return tuple(out)
    raise TypeError(f"step_fn must return a Tensor or a tuple of Tensors, got {type(out).__name__}")


def slice_rows(out: Outputs, n: int) -> Outputs:
    """Every output's dim 0 cut to the real batch size ``n`` (views, no copy)."""
    if isinstance(out, torch.Tensor):
        return out[:n]
    return tuple(t[:n] for t in out)


def normalize_device(device: torch.device | str) -> torch.device:
    """``"cuda"`` -> ``cuda:<current>`` so it compares equal to a tensor's ``.device``."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def mark_fixed_dims(persistent: Mapping[str, torch.Tensor], buffers: list[Mapping[str, torch.Tensor]]) -> None:
    """Tell dynamo which sizes never change, so one dynamic compile traces them as numbers: every dim of the
    persistent tensors (a replaced one is re-captured or refused anyway) and each buffer dim that is the same in
    every bucket's buffers (head counts, head sizes; the batch and capacity dims stay symbolic).

    Why: each symbolic size goes through sympy in every traced op; a 4-layer decode step traced in 2.4 s
    (fake-tensor propagation 2.0 s) with them all symbolic and in 1.1 s (0.7 s) without the fixed ones, on every
    start, warm restarts included. buffers: one ``{name: tensor}`` per bucket."""
    for t in persistent.values():
        if isinstance(t, torch.Tensor):
            torch._dynamo.mark_static(t)
    per_name: dict[str, list[torch.Tensor]] = {}
    for tensors in buffers:
        for name, t in tensors.items():
            per_name.setdefault(name, []).append(t)
    for tensors in per_name.values():
        for dim in range(tensors[0].dim()):
            if len({t.shape[dim] if t.dim() > dim else None for t in tensors}) == 1:
                for t in tensors:
                    torch._dynamo.mark_static(t, dim)
