"""Generic static-shape graph machinery: bucket policy, static buffers, capture/replay, warm-up.

``graphs`` knows nothing about attention: it compiles and (on CUDA) captures any step function of
static-shape tensors, one graph per bucket, all before the first real step.

* ``BucketPolicy`` / ``DEFAULT_BATCH_SIZES``: which (batch size, kv capacity) shapes get a graph; ``cdiv``.
* ``BufferSpec`` / ``StaticBuffers``: one bucket's inputs, allocated once, refilled in place.
* ``GraphRunner``: ``warmup(persistent)`` then ``run(key, real_inputs, persistent)``; CUDA-graph replay on
  CUDA, compiled replay on static buffers on CPU, an eager/compiled fallback beyond the largest bucket.
* ``BucketedGraphs``: a step's runners over its buckets (warm-up, routing, stats, choices), for a subclass to key.
* ``RowInput`` and the checks of a batch's per-row inputs before a replay (``row_inputs``).

Imports only torch, tqdm and ``profiling``.
"""

from graphs.bucketed import BucketedGraphs
from graphs.buckets import DEFAULT_BATCH_SIZES, BucketPolicy, cdiv, kv_capacities
from graphs.row_inputs import RowInput, cache_slots, check_row_specs, check_row_values, check_slot_values
from graphs.runner import GraphRunner, Outputs, RunnerStats, StepFn
from graphs.static_buffers import BufferSpec, StaticBuffers

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "BucketPolicy",
    "BucketedGraphs",
    "BufferSpec",
    "GraphRunner",
    "Outputs",
    "RowInput",
    "RunnerStats",
    "StaticBuffers",
    "StepFn",
    "cache_slots",
    "cdiv",
    "check_row_specs",
    "check_row_values",
    "check_slot_values",
    "kv_capacities",
]
