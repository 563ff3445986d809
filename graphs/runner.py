"""GraphRunner: warm up, compile and capture a step function per bucket, then replay it.

The step is any pure function of static-shape tensors::

    step_fn(inputs: dict[str, Tensor], persistent: dict[str, Tensor]) -> Tensor | tuple[Tensor, ...]

``inputs`` are one bucket's static buffers (``StaticBuffers.tensors``, batch dim = the bucket size);
``persistent`` are long-lived tensors (KV caches, slot tables) that the caller passes at every call. The step
must not branch on tensor values, call ``.item()`` or allocate by value: that is what lets
``torch.compile(fullgraph=True)`` compile it and a CUDA graph capture it.

Two replay paths, chosen by ``use_cuda_graph``:
* CUDA graph: ``warmup`` runs the step on a side stream, then captures one ``torch.cuda.CUDAGraph`` per
  bucket (all sharing one memory pool, largest bucket first so smaller graphs reuse its memory); ``run``
  copies the real rows into the bucket's buffers and replays.
* Compiled replay (CPU, or CUDA without graphs): ``run`` calls the compiled step on the bucket's static
  buffers, so every call sees the same shapes as warm-up: no recompiles, no per-step input allocation.

Outputs of ``run`` have the bucket's batch size (the caller slices ``[:n]``, or uses ``run_sliced``). On the
CUDA-graph path they are the graph's static outputs: valid until the next ``run`` of any bucket (graphs share
one pool), so copy what must outlive it.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from graphs.cuda_graph import capture_graph, describe_changes, on_stream, signatures, synchronize
from graphs.runner_helpers import (
    Key,
    Outputs,
    StepFn,
    check_outputs,
    describe,
    key_attrs,
    largest_first,
    mark_fixed_dims,
    normalize_device,
    slice_rows,
)
from graphs.static_buffers import StaticBuffers
from profiling import range as prof_range

__all__ = ["EAGER_MARGIN", "GraphRunner", "RunnerStats", "Outputs", "StepFn", "faster_form"]

_log = logging.getLogger(__name__)

#: the eager step must beat the compiled one by this fraction to be chosen (noise must not flip a choice)
EAGER_MARGIN = 0.05


def faster_form(compiled_s: float, eager_s: float, margin: float = EAGER_MARGIN) -> str:
    """"compiled" or "eager": which of two measured step times a bucket replays (compiled unless eager is faster
    by ``margin``)."""
    return "eager" if eager_s < compiled_s * (1 - margin) else "compiled"


@dataclass
class RunnerStats:
    """Counters since construction.

    replays:    runs through a warmed bucket (CUDA-graph replay, a call on the static buffers, or a bucket's eager step
                on the real rows: ``DecodeGraphs``).
    fallbacks:  runs without a bucket (batch beyond the largest bucket, or a key that was not warmed).
    recaptures: times every graph was re-captured because a persistent tensor changed (CUDA graphs only).
    """

    replays: int = 0
    fallbacks: int = 0
    recaptures: int = 0


@dataclass
class _Entry:
    """One warmed bucket: its static buffers and, on the CUDA-graph path, its graph and static outputs."""

    buffers: StaticBuffers
    attrs: dict[str, Any]
    graph: Any = None  # torch.cuda.CUDAGraph (Any: the type exists on CPU builds, but is unusable there)
    outputs: Outputs | None = None
    fn: StepFn | None = None  # the form this bucket replays (the runner's step unless ``eager_fn`` measured faster)


@dataclass
class _Warned:
    """What this runner has already warned about (each warning once per runner)."""

    fallback: bool = False
    replaced: bool = False
    cpu_names: set[str] = field(default_factory=set)


class GraphRunner:
    """Compile/capture ``step_fn`` once per key at start-up (``warmup``), then ``run`` it per step.

    step_fn:      ``(inputs, persistent) -> Tensor | tuple[Tensor, ...]``, pure, static shapes (module doc).
    make_buffers: ``key -> StaticBuffers`` for that bucket, on ``device``; its fill values must be valid inputs
                  (warm-up and capture run the step on all-padding buffers).
    keys:         the buckets (e.g. ``BucketPolicy.keys()``); warmed largest first.
    device:       where buffers live and the step runs.
    use_cuda_graph: capture CUDA graphs (needs a CUDA device); False -> compiled replay on static buffers.
    compile_fn:   applied once to ``step_fn`` (e.g. a torch.compile wrapper); None -> eager.
    fallback_fn:  ``(real_inputs, persistent) -> outputs`` for batches without a bucket; defaults to the
                  compiled-or-eager step on the real, unpadded inputs.
    warmup_iters: step runs per key before capture (>= 1; the first one compiles).
    progress:     show a tqdm bar naming the bucket during ``warmup``.
    recapture_on_change: on the CUDA-graph path, when a persistent tensor was replaced (address, shape, stride,
                  dtype or device), re-capture every graph (True) or raise RuntimeError (False).
    eager_fn:     on the compiled-replay path, the uncompiled step: warm-up times it against the compiled one on
                  each bucket's warm-up batch (``measure_iters`` interleaved runs each, fastest) and the bucket
                  replays the faster (the compiled one unless the eager one is faster by ``EAGER_MARGIN``). On CPU
                  a compiled step is not always the faster one; the choice and both times are in ``warmup``'s
                  timings (``choice``, ``compiled_s``, ``eager_s``).
    """

    EAGER_MARGIN = EAGER_MARGIN  # per runner, so a test can change it

    def __init__(
        self,
        step_fn: StepFn,
        *,
        make_buffers: Callable[[Key], StaticBuffers],
        keys: Sequence[Key],
        device: torch.device | str,
        use_cuda_graph: bool,
        compile_fn: Callable[[StepFn], StepFn] | None = None,
        fallback_fn: StepFn | None = None,
        warmup_iters: int = 2,
        progress: bool = True,
        recapture_on_change: bool = True,
        eager_fn: StepFn | None = None,
        measure_iters: int = 2,
    ) -> None:
        self.device = normalize_device(device)
        if use_cuda_graph and self.device.type != "cuda":
            raise ValueError(f"use_cuda_graph=True needs a CUDA device, got device={self.device}")
        if warmup_iters < 1:
            # Compilation and autotuning must finish before capture: they cannot run inside a graph capture.
            raise ValueError(f"warmup_iters must be >= 1, got {warmup_iters}")
        keys = list(keys)
        if not keys:
            raise ValueError("keys must not be empty")
        if len(set(keys)) != len(keys):
            raise ValueError(f"keys must be unique, got {keys}")
        self.use_cuda_graph = bool(use_cuda_graph)
        self.keys: list[Key] = largest_first(keys)
        self.warmup_iters = warmup_iters
        self.progress = progress
        self.recapture_on_change = recapture_on_change
        self.stats = RunnerStats()
        self._make_buffers = make_buffers
        # compile_fn is applied exactly once: every bucket and the fallback share one compiled function.
        self._fn: StepFn = compile_fn(step_fn) if compile_fn is not None else step_fn
        self._fallback: StepFn = fallback_fn if fallback_fn is not None else self._fn
        self._eager = eager_fn if not self.use_cuda_graph else None  # a captured graph's launch cost is gone anyway
        self.measure_iters = max(1, int(measure_iters))
        self._entries: dict[Key, _Entry] = {}
        self._signatures: dict[str, tuple] | None = None  # None until warmup: run() refuses to start
        self._pool: Any = None
        self._stream: Any = None
        self._warned = _Warned()

    # ---- public state ----

    @property
    def num_captured(self) -> int:
        """How many CUDA graphs are currently captured (0 on the compiled-replay path)."""
        return sum(e.graph is not None for e in self._entries.values())

    @property
    def warmed_keys(self) -> list[Key]:
        """The keys that ``run`` serves from a bucket (largest first)."""
        return [k for k in self.keys if k in self._entries]

    def buffers(self, key: Key) -> StaticBuffers:
        """The static buffers of a warmed key (KeyError otherwise)."""
        return self._entries[key].buffers

    # ---- warm-up ----

    def warmup(self, persistent: Mapping[str, torch.Tensor],
               choices: Mapping[Key, str] | None = None) -> dict[Key, dict[str, float]]:
        """Allocate buffers, run (compiling) and, on CUDA, capture every key, largest first.

        choices: per key, "compiled" or "eager" from an earlier ``choices()`` (a restart): those keys skip the
        compiled-vs-eager measurement (``eager_fn``) and replay the given form.

        Returns per key ``{"compile_s": first run (includes any compile it triggers), "warmup_s": the other
        runs, "capture_s": CUDA-graph capture (CUDA-graph path only)}``. Calling it again re-captures.
        """
        persistent = dict(persistent)
        self._signatures = None  # until every key is warmed: a failed warm-up leaves run() refusing to start
        self._release_graphs()
        if self.use_cuda_graph:
            # One pool for all graphs: they never run concurrently, so they can share memory.
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(device=self.device)
        self._mark_fixed_dims(persistent)
        timings: dict[Key, dict[str, float]] = {}
        bar = tqdm(self.keys, disable=not self.progress, unit="bucket", leave=False)
        for key in bar:
            attrs = key_attrs(key)
            bar.set_description(f"{'capture' if self.use_cuda_graph else 'compile'} {describe(attrs)}")
            timings[key] = self._warm_one(key, attrs, persistent, (choices or {}).get(key))
        bar.close()
        self._signatures = self._signatures_of(persistent)
        return timings

    def _mark_fixed_dims(self, persistent: dict[str, torch.Tensor]) -> None:
        """Every bucket's buffers, allocated up front (a re-warm-up keeps them), then ``mark_fixed_dims`` over them."""
        for key in self.keys:
            if key not in self._entries:
                self._entries[key] = _Entry(self._new_buffers(key), key_attrs(key))
        mark_fixed_dims(persistent, [e.buffers.tensors for e in self._entries.values()])

    def _warm_one(self, key: Key, attrs: dict[str, Any], persistent: dict[str, torch.Tensor],
                  choice: str | None = None) -> dict[str, float]:
        entry = self._entries[key]  # allocated by _mark_fixed_dims
        inputs = entry.buffers.tensors
        times: dict[str, float] = {}
        with prof_range("warmup", **attrs), on_stream(self._stream):
            t0 = time.perf_counter()
            with prof_range("compile", **attrs):
                check_outputs(self._fn(inputs, persistent))
                synchronize(self.device)
            t1 = time.perf_counter()
            for _ in range(self.warmup_iters - 1):
                self._fn(inputs, persistent)
            synchronize(self.device)
            times["compile_s"], times["warmup_s"] = t1 - t0, time.perf_counter() - t1
        entry.fn = self._fn
        if self._eager is not None and self._eager is not self._fn:
            if choice in ("compiled", "eager"):  # measured by an earlier start: warm the chosen form only
                entry.fn = self._eager if choice == "eager" else self._fn
                if choice == "eager":
                    self._eager(inputs, persistent)
                times["choice"] = choice
            else:
                with prof_range("measure", **attrs):
                    times.update(self._choose(entry, persistent))
        if self.use_cuda_graph:
            t0 = time.perf_counter()
            with prof_range("capture", **attrs):
                entry.graph, out = capture_graph(lambda: self._fn(inputs, persistent), self._pool, self._stream)
                entry.outputs = check_outputs(out)
            times["capture_s"] = time.perf_counter() - t0
        return times

    def _choose(self, entry: _Entry, persistent: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Time the compiled and the eager step on this bucket's warm-up batch, round-robin; keep the faster.

        Each form's fastest run is its time: noise on a shared machine only adds, and the eager step's first-call
        costs (in its first run) stay out without a separate untimed call."""
        inputs = entry.buffers.tensors
        samples: dict[str, list[float]] = {"compiled": [], "eager": []}
        for _ in range(self.measure_iters):
            for name, fn in (("compiled", self._fn), ("eager", self._eager)):
                t0 = time.perf_counter()
                fn(inputs, persistent)
                synchronize(self.device)
                samples[name].append(time.perf_counter() - t0)
        compiled_s, eager_s = (min(v) for v in samples.values())
        choice = faster_form(compiled_s, eager_s, self.EAGER_MARGIN)
        entry.fn = self._eager if choice == "eager" else self._fn
        _log.info("bucket %s replays the %s step (compiled %.3f ms, eager %.3f ms)", describe(entry.attrs), choice,
                  compiled_s * 1e3, eager_s * 1e3)
        return {"choice": choice, "compiled_s": compiled_s, "eager_s": eager_s}

    def choices(self) -> dict[Key, str]:
        """Which form each warmed bucket replays: "compiled", "eager" (measured faster) or "captured"."""
        return {k: "captured" if e.graph is not None else "eager" if e.fn is self._eager else "compiled"
                for k, e in self._entries.items()}

    def _new_buffers(self, key: Key) -> StaticBuffers:
        buffers = self._make_buffers(key)
        if not isinstance(buffers, StaticBuffers):
            raise TypeError(f"make_buffers({key!r}) must return StaticBuffers, got {type(buffers).__name__}")
        devices = {t.device for t in buffers.tensors.values()}
        if devices != {self.device}:
            raise ValueError(f"make_buffers({key!r}) allocated on {devices}, the runner's device is {self.device}")
        return buffers

    # ---- run ----

    def run(self, key: Key | None, real_inputs: Mapping[str, torch.Tensor],
            persistent: Mapping[str, torch.Tensor]) -> Outputs:
        """One step. ``key`` None or not warmed -> the fallback on the real inputs (warned once per runner);
        else copy ``real_inputs`` (``n <= bucket`` rows) into the bucket's buffers and replay (CUDA graph) or
        call the compiled step on them. Returns bucket-shaped outputs (fallback: real-shaped)."""
        if self._signatures is None:
            raise RuntimeError("GraphRunner.run() before warmup(persistent) (or after reset())")
        entry = self._entries.get(key) if key is not None else None
        if entry is None:
            return self._run_fallback(key, real_inputs, persistent)
        self._check_persistent(persistent)
        with prof_range("replay", **entry.attrs):
            entry.buffers.copy_in(real_inputs)
            if entry.graph is not None:
                entry.graph.replay()
                out = entry.outputs
            else:
                out = (entry.fn or self._fn)(entry.buffers.tensors, dict(persistent))
        self.stats.replays += 1
        return out

    def run_sliced(self, key: Key | None, real_inputs: Mapping[str, torch.Tensor],
                   persistent: Mapping[str, torch.Tensor]) -> Outputs:
        """``run``, with every output's dim 0 cut to the real batch size (views of the static outputs)."""
        out = self.run(key, real_inputs, persistent)
        return slice_rows(out, self._num_rows(key, real_inputs))

    def _num_rows(self, key: Key | None, real_inputs: Mapping[str, torch.Tensor]) -> int:
        """The real batch size, read through the bucket's buffer specs (the largest bucket's for a fallback)."""
        entry = self._entries.get(key) if key is not None else None
        if entry is None:
            entry = self._entries[self.warmed_keys[0]]
        return entry.buffers.num_rows(real_inputs)

    def _run_fallback(self, key: Key | None, real_inputs: Mapping[str, torch.Tensor],
                      persistent: Mapping[str, torch.Tensor]) -> Outputs:
        n = self._num_rows(key, real_inputs)
        if not self._warned.fallback:
            self._warned.fallback = True
            warnings.warn(
                f"GraphRunner: batch of {n} rows (key={key!r}) has no warmed bucket; the largest bucket is "
                f"{self.warmed_keys[0]!r}. Running the fallback path without a graph (slower; it may compile a "
                f"new shape). Raise the maximum batch size to avoid this. Warned once per runner.",
                stacklevel=3,
            )
        with prof_range("fallback", bs=n):
            out = self._fallback(dict(real_inputs), dict(persistent))
        self.stats.fallbacks += 1
        return out

    # ---- persistent-tensor safety ----

    def _signatures_of(self, persistent: Mapping[str, torch.Tensor]) -> dict[str, tuple]:
        # A captured graph baked the addresses; a compiled function only guards on metadata.
        return signatures(persistent, with_ptr=self.use_cuda_graph)

    def _check_persistent(self, persistent: Mapping[str, torch.Tensor]) -> None:
        """Cheap per-run check (one tuple per tensor) that the graphs' baked tensors are the ones passed."""
        if self._signatures_of(persistent) == self._signatures:
            return
        assert self._signatures is not None
        changes = describe_changes(self._signatures, persistent, with_ptr=self.use_cuda_graph)
        if not self.use_cuda_graph:
            self._warn_cpu_change(changes, persistent)
            return
        what = "; ".join(changes.values())
        if not self.recapture_on_change:
            raise RuntimeError(
                f"{what}: the captured CUDA graphs would read freed or wrong memory. Pass the tensors used at "
                "warmup, or construct the runner with recapture_on_change=True."
            )
        if not self._warned.replaced:
            self._warned.replaced = True
            warnings.warn(
                f"{what}; re-capturing all {len(self._entries)} CUDA graphs (slow: keep persistent tensors alive "
                "and in place). Warned once per runner.",
                stacklevel=3,
            )
        self.stats.recaptures += 1
        self.warmup(persistent)

    def _warn_cpu_change(self, changes: dict[str, str], persistent: Mapping[str, torch.Tensor]) -> None:
        # Nothing is baked on this path, but new metadata fails the compiled function's guards: a recompile.
        # Warned once per tensor name; the new metadata becomes the reference.
        new = [msg for name, msg in changes.items() if name not in self._warned.cpu_names]
        self._warned.cpu_names.update(changes)
        if new:
            warnings.warn(f"{'; '.join(new)}: the compiled step may recompile.", stacklevel=4)
        self._signatures = self._signatures_of(persistent)

    # ---- teardown ----

    def _release_graphs(self) -> None:
        """Drop every graph and its static outputs (buffers stay: their addresses are reused on re-capture)."""
        if any(e.graph is not None for e in self._entries.values()):
            synchronize(self.device)  # no graph may be destroyed while a replay is in flight
        for entry in self._entries.values():
            entry.graph = None
            entry.outputs = None
        self._pool = None

    def reset(self) -> None:
        """Free all graphs, outputs and buffers; ``run`` refuses to start until ``warmup`` is called again."""
        self._release_graphs()
        self._entries.clear()
        self._signatures = None
        self._stream = None
