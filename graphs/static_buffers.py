"""Static input buffers of one bucket: allocated once, refilled in place every step.

A CUDA graph bakes the addresses of its inputs, so the inputs of a bucket live in buffers that are never
reallocated; ``copy_in`` writes the real rows and fills the padded rows in place. On CPU the same buffers keep
the compiled function's input shapes (hence its guards) fixed and avoid reallocating step inputs.

    specs = {
        "q":        BufferSpec((8, 4, 64), torch.float32, fill=0.0),
        "seq_lens": BufferSpec((8,), torch.int64, fill=1),      # padded rows: 1 token, cheap and finite
    }
    bufs = StaticBuffers(specs, device="cuda")
    bufs.copy_in({"q": q_real, "seq_lens": seq_lens_real})   # q_real: [5, 4, 64] -> rows 5..7 padded
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["BufferSpec", "StaticBuffers"]


@dataclass(frozen=True)
class BufferSpec:
    """One static buffer.

    shape:     full buffer shape, with the batch dim given as the bucket size (e.g. ``(bucket, H, D)``).
    dtype:     buffer dtype; real inputs are cast to it on copy (only exact casts: the same dtype or a wider integer).
    fill:      the value padded rows ``[n:bucket)`` get (e.g. a dummy slot index, ``seq_lens`` of 1).
    batch_dim: which dim is the batch; None for an unbatched buffer (copied whole, never padded).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: int | float | bool = 0
    batch_dim: int | None = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if any(s < 0 for s in self.shape):
            raise ValueError(f"BufferSpec.shape must be non-negative, got {self.shape}")
        if self.batch_dim is not None and not 0 <= self.batch_dim < len(self.shape):
            raise ValueError(f"BufferSpec.batch_dim={self.batch_dim} is out of range for shape {self.shape}")

    @property
    def bucket(self) -> int | None:
        """The batch size this buffer is padded to (None when unbatched)."""
        return None if self.batch_dim is None else self.shape[self.batch_dim]


def _bucket_of(specs: Mapping[str, BufferSpec]) -> int:
    """The common batch size of all batched specs (ValueError if they disagree or none is batched)."""
    sizes = {name: s.bucket for name, s in specs.items() if s.bucket is not None}
    if not sizes:
        raise ValueError("StaticBuffers needs at least one batched BufferSpec (batch_dim not None)")
    if len(set(sizes.values())) != 1:
        raise ValueError(f"batched buffers disagree on the bucket (batch dim size): {sizes}")
    return next(iter(sizes.values()))


def _exact_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    """Same dtype, or an integer into a wider integer. A narrowing cast (int64 slots into int32) would wrap large
    values, and another float dtype means the step was warmed for another precision: both are refused rather than
    cast silently."""
    if src == dst:
        return True
    integral = not (src.is_floating_point or src.is_complex or dst.is_floating_point or dst.is_complex)
    return integral and src != torch.bool and torch.promote_types(src, dst) == dst


class StaticBuffers:
    """The static inputs of one bucket, on one device.

    tensors:  name -> buffer (fixed addresses for the lifetime of this object).
    bucket:   the padded batch size.
    num_real: the real batch size of the last ``copy_in`` (0 before the first).
    """

    def __init__(self, specs: Mapping[str, BufferSpec], device: torch.device | str) -> None:
        if not specs:
            raise ValueError("StaticBuffers needs at least one BufferSpec")
        self.specs: dict[str, BufferSpec] = dict(specs)
        self.device = torch.device(device)
        self.bucket: int = _bucket_of(self.specs)
        self.num_real: int = 0
        self.tensors: dict[str, torch.Tensor] = {
            name: torch.full(s.shape, s.fill, dtype=s.dtype, device=self.device) for name, s in self.specs.items()
        }

    def __repr__(self) -> str:
        return f"StaticBuffers(bucket={self.bucket}, device={self.device}, names={list(self.specs)})"

    def num_rows(self, real: Mapping[str, torch.Tensor]) -> int:
        """The real batch size of ``real``: the batch-dim size shared by its batched inputs (ValueError if they
        disagree). Does not check that it fits the bucket (``copy_in`` does)."""
        rows = {
            name: t.shape[self.specs[name].batch_dim]
            for name, t in real.items()
            if name in self.specs and self.specs[name].batch_dim is not None and t.dim() > self.specs[name].batch_dim
        }
        if len(set(rows.values())) > 1:
            raise ValueError(f"real inputs disagree on the batch size: {rows}")
        return next(iter(rows.values()), 0)

    def copy_in(self, real: Mapping[str, torch.Tensor]) -> int:
        """Copy ``real[name]`` (``n`` rows along the batch dim, ``n <= bucket``, same other dims) into rows
        ``[0:n)`` of each buffer and fill rows ``[n:bucket)`` with the spec's fill value, in place.

        ``real`` must name exactly the buffers. ValueError (name, expected shape) for a missing/extra name, a
        wrong shape or ``n > bucket``; TypeError for a dtype that does not cast safely to the buffer's.
        Returns ``n`` (also stored as ``num_real``).
        """
        n = self.check(real)
        for name, src in real.items():
            self._write(name, src, n)
        self.num_real = n
        return n

    def check(self, real: Mapping[str, torch.Tensor]) -> int:
        """``copy_in``'s checks without the copy (for a caller that runs a step on ``real`` itself); returns ``n``."""
        self._check_names(real)
        n = self.num_rows(real)
        for name, src in real.items():
            self._check_one(name, src, n)
        return n

    def _check_names(self, real: Mapping[str, torch.Tensor]) -> None:
        missing = sorted(set(self.specs) - set(real))
        extra = sorted(set(real) - set(self.specs))
        if missing or extra:
            # A missing input would silently replay stale rows from the previous step.
            raise ValueError(f"copy_in: missing inputs {missing}, unexpected inputs {extra}; "
                             f"expected {list(self.specs)}")

    def _expected_shape(self, name: str, n: int) -> tuple:
        spec = self.specs[name]
        if spec.batch_dim is None:
            return spec.shape
        shape: list = list(spec.shape)
        shape[spec.batch_dim] = n
        return tuple(shape)

    def _check_one(self, name: str, src: torch.Tensor, n: int) -> None:
        spec = self.specs[name]
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"copy_in: input {name!r} must be a tensor, got {type(src).__name__}")
        if n > self.bucket:
            raise ValueError(f"copy_in: input {name!r} has {n} rows, more than the bucket size {self.bucket}")
        expected = self._expected_shape(name, n)
        if tuple(src.shape) != expected:
            shown = list(spec.shape)
            if spec.batch_dim is not None:
                shown[spec.batch_dim] = f"n<={self.bucket}"
            raise ValueError(
                f"copy_in: input {name!r} has shape {tuple(src.shape)}, expected {tuple(shown)} "
                f"(here {expected}) to fit buffer {spec.shape}"
            )
        if not _exact_cast(src.dtype, spec.dtype):
            raise TypeError(f"copy_in: input {name!r} has dtype {src.dtype}, which does not cast exactly to "
                            f"{spec.dtype} (only the same dtype or a wider integer is copied in)")

    def _write(self, name: str, src: torch.Tensor, n: int) -> None:
        spec, buf = self.specs[name], self.tensors[name]
        # non_blocking only when writing to CUDA: host->device from pinned memory then overlaps, while pageable
        # host->device and device->device copies stay stream-ordered either way. Never non_blocking into host
        # memory (a device->host copy would return before the data lands).
        non_blocking = buf.is_cuda
        if spec.batch_dim is None:
            buf.copy_(src, non_blocking=non_blocking)
            return
        d = spec.batch_dim
        buf.narrow(d, 0, n).copy_(src, non_blocking=non_blocking)
        if n < self.bucket:
            buf.narrow(d, n, self.bucket - n).fill_(spec.fill)
