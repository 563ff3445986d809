"""A bucketed runner's per-row inputs: their specs (``RowInput``), and the checks a batch's inputs pass before a
replay, where a wrong shape, dtype or device would fail deep inside the step or the buffer copy, and an index into
the persistent tensors (a KV slot) would wrap or fault instead of raising."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["RowInput", "cache_slots", "check_row_specs", "check_row_values", "check_slot_values"]


@dataclass(frozen=True)
class RowInput:
    """A per-row step input: trailing shape (after the batch dim), dtype, and the value padded rows get.

    slots: the input indexes the KV caches (``out_cache_loc``): the runner checks it lies in
        ``[0, num_slots)`` before the replay, where an index would wrap or fault instead of raising. None (the
        default): an integer input is taken for one (checked), unless it says ``slots=False`` (token ids,
        positions); a write outside the caches is never silent by default.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: int | float = 0
    slots: bool | None = None

    def __post_init__(self):
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"RowInput.dtype must be a torch.dtype, got {self.dtype!r}")
        if self.slots is None:  # frozen: set through object
            integer = not (self.dtype.is_floating_point or self.dtype.is_complex or self.dtype == torch.bool)
            object.__setattr__(self, "slots", integer)
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in self.shape):
            raise ValueError(f"RowInput.shape must be non-negative ints, got {self.shape!r}")
        if self.slots and (self.dtype.is_floating_point or self.dtype.is_complex):
            raise TypeError(f"RowInput(slots=True) must have an integer dtype, got {self.dtype}")


def check_row_specs(arg: str, specs: Mapping[str, RowInput], taken: Sequence[str] = (),
                    taken_by: str = "") -> dict[str, RowInput]:
    """``specs`` (the caller's per-row or per-token inputs, named ``arg``) as a dict of ``RowInput``; a name in
    ``taken`` (the step's own inputs, ``taken_by`` in the error) is a ValueError."""
    for name, spec in specs.items():
        if not isinstance(spec, RowInput):
            raise TypeError(f"{arg}[{name!r}] must be a RowInput, got {type(spec).__name__}")
        if name in taken:
            raise ValueError(f"{arg}[{name!r}] clashes with {taken_by} of the same name")
    return dict(specs)


def check_row_values(arg: str, given: Mapping[str, torch.Tensor], specs: Mapping[str, RowInput], rows: int,
                     rows_note: str, device: torch.device, num_slots: int | None) -> None:
    """The per-row inputs of one run against their specs, before a replay (inside one a wrong shape or dtype fails
    deep in the step or the buffer copy): the names, ``[rows, *spec.shape]``, the exact dtype (the fallback runs
    them as they are, and another dtype there is another compile), the device and, with ``num_slots``, the slot
    ranges of ``RowInput(slots=True)`` inputs. ``rows_note`` says where ``rows`` comes from."""
    missing, extra = sorted(set(specs) - set(given)), sorted(set(given) - set(specs))
    if missing or extra:
        raise ValueError(f"{arg}: missing inputs {missing}, unexpected inputs {extra}; expected {sorted(specs)}")
    for name, spec in specs.items():
        t = given[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg}[{name!r}] must be a tensor, got {type(t).__name__}")
        if tuple(t.shape) != (rows, *spec.shape):
            raise ValueError(f"{arg}[{name!r}] has shape {tuple(t.shape)}, expected {(rows, *spec.shape)} "
                             f"({rows_note})")
        if t.dtype != spec.dtype:
            raise ValueError(f"{arg}[{name!r}] has dtype {t.dtype}, expected {spec.dtype}")
        if t.device != device:
            raise ValueError(f"{arg}[{name!r}] is on {t.device}, these graphs run on {device}")
        if spec.slots and num_slots is not None:
            check_slot_values(f"{arg}[{name!r}]", t, num_slots)


def check_slot_values(name: str, loc: torch.Tensor, num_slots: int) -> None:
    """``loc`` (any shape) holds slots in ``[0, num_slots)``; a host read (a sync on CUDA)."""
    if loc.numel() == 0:
        return
    lo, hi = int(loc.min()), int(loc.max())
    if lo < 0 or hi >= num_slots:
        raise ValueError(f"{name} must hold KV slots in [0, {num_slots}), got range [{lo}, {hi}]")


def cache_slots(persistent: Mapping[str, torch.Tensor]) -> int:
    """The slot count of the KV caches: the floating-point persistent tensors, indexed by slot along dim 0 (the
    smallest, should they differ)."""
    sizes = [t.shape[0] for t in persistent.values()
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 1]
    if not sizes:
        raise ValueError("persistent holds no floating-point tensor (KV cache) to check slots against")
    return min(sizes)
