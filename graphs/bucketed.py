"""BucketedGraphs: a step compiled once, warmed per bucket and replayed per batch through ``GraphRunner``s.

A subclass builds its runners (``_build_runners(keys)``), says what a bucket's buffers hold (``_buffer_specs``) and
the batch it warms on (``_fill_warmup_batch``), and turns a batch into a key and step inputs for ``_run``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from graphs.runner import GraphRunner, RunnerStats
from graphs.runner_helpers import Key, Outputs, StepFn, slice_rows
from graphs.static_buffers import BufferSpec, StaticBuffers

__all__ = ["BucketedGraphs"]


class BucketedGraphs:
    """Warm-up and replay of ``step_fn`` (``GraphRunner``'s step) over bucket keys, one runner per group of keys.

    config: SGLang-style switches, read by field: ``enable_torch_compile`` (apply ``compile_fn`` once to the step),
        ``disable_cuda_graph`` (on CUDA, replay on static buffers instead of capturing), ``warmup_iters`` (runs per
        bucket before capture; None: 2 with CUDA graphs, one on the side stream before capture, else 1: the first
        run compiles and a second only lengthens start-up), ``progress`` (a bar during warm-up), ``measure_compile``
        (without CUDA graphs, time the compiled and eager step per bucket and replay the faster).
    """

    def __init__(self, step_fn: StepFn, *, config: Any, device: torch.device | str,
                 compile_fn: Callable[[StepFn], StepFn]):
        self.config = config
        self.device = torch.device(device)
        self.use_cuda_graph = self.device.type == "cuda" and not config.disable_cuda_graph
        self._step_fn = step_fn
        self._compiled: StepFn | None = compile_fn(step_fn) if config.enable_torch_compile else None
        self.runners: list[GraphRunner] = []
        self._runner_of: dict[Key, GraphRunner] = {}

    def _build_runners(self, keys: Sequence[Key], compile_max_rows: int | None = None, measure_iters: int = 2):
        """The runners of ``keys``: those of up to ``compile_max_rows`` rows (``key[0]``; None: all) replay the
        compiled step (or the eager one, measured faster), larger ones the eager step (still captured on CUDA); a
        batch beyond every bucket runs the compiled (or eager) step on its own shapes, without a graph."""
        small = [k for k in keys if compile_max_rows is None or k[0] <= compile_max_rows]
        large = [k for k in keys if compile_max_rows is not None and k[0] > compile_max_rows]
        self.runners = [
            GraphRunner(fn or self._step_fn, make_buffers=self._make_buffers, keys=group, device=self.device,
                        use_cuda_graph=self.use_cuda_graph, fallback_fn=self._compiled or self._step_fn,
                        warmup_iters=self.config.warmup_iters or (2 if self.use_cuda_graph else 1),
                        progress=self.config.progress, measure_iters=measure_iters,
                        eager_fn=self._eager_step if fn is not None and self.config.measure_compile else None)
            for group, fn in ((small, self._compiled), (large, None)) if group]
        self._runner_of = {k: r for r in self.runners for k in r.keys}

    def _eager_step(self, inputs: dict[str, torch.Tensor], persistent: dict[str, torch.Tensor]) -> Outputs:
        """The step's eager form, timed against the compiled one (a method: it follows ``_step_fn``)."""
        return self._step_fn(inputs, persistent)

    def _buffer_specs(self, key: Key) -> dict[str, BufferSpec]:
        """The static buffers of bucket ``key``, the batch dim sized to the bucket."""
        raise NotImplementedError

    def _fill_warmup_batch(self, buffers: StaticBuffers, key: Key) -> None:
        """Write the batch a bucket warms on into its new buffers (default: their padding). Each real run
        overwrites every row, padding rows included."""

    def _make_buffers(self, key: Key) -> StaticBuffers:
        buffers = StaticBuffers(self._buffer_specs(key), self.device)
        self._fill_warmup_batch(buffers, key)
        return buffers

    def warmup(self, persistent: Mapping[str, torch.Tensor], choices: Mapping[Key, str] | None = None) -> dict:
        """Compile (CUDA: capture) every key; returns per key ``{"compile_s", ...}`` (``GraphRunner.warmup``).
        ``choices``: an earlier start's ``choices()`` (a restart skips the compiled-vs-eager measurement)."""
        return {k: t for runner in self.runners for k, t in runner.warmup(persistent, choices).items()}

    def _run(self, key: Key | None, inputs: Mapping[str, torch.Tensor], persistent: Mapping[str, torch.Tensor],
             rows: int) -> Outputs:
        """One step of a real batch in bucket ``key`` (None or not warmed: the fallback, warned once); outputs cut
        to ``rows`` along dim 0 (on CUDA graphs: views valid until the next run)."""
        runner = self._runner_of.get(key, self.runners[0])
        return slice_rows(runner.run(key, inputs, persistent), rows)

    @property
    def stats(self) -> list[RunnerStats]:
        return [r.stats for r in self.runners]

    def choices(self) -> dict[Key, str]:
        """Per warmed bucket: "compiled", "eager" (measured faster at warm-up) or "captured" (CUDA graph)."""
        return {k: c for r in self.runners for k, c in r.choices().items()}
