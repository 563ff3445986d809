"""Drive SGLang 0.5.23's attention path on CPU without a model: for tests and benchmarks.

It builds what SGLang's attention path needs (a model-runner stand-in, ``ReqToTokenPool``,
``MHATokenToKVPool`` / ``MLATokenToKVPool``, ``RadixAttention`` layers, hand-made ``ForwardBatch``es) and runs
one layer the way ``ModelRunner`` does, so the same data can be fed to SGLang's own ``TorchNativeAttnBackend``
and to ours. ``runtime`` imports SGLang (after the CPU fix-ups) and states single-rank parallel names,
``geometry`` holds the shapes, model-runner stand-in and layers, ``batches`` the batches and the layer runner,
``swa`` the stand-in over SGLang's hybrid sliding-window pool (``SWAKVPool``).
Importing this package applies the torchvision fix-up (it does not import SGLang).
"""

from ..cpu_fixups import ensure_sglang_importable, ensure_torchvision_importable
from .batches import (
    BatchData,
    LayerData,
    default_tolerance,
    make_decode_batch,
    make_extend_batch,
    read_kv,
    request_kv,
    request_q,
    run_sglang,
    run_sglang_layer,
    write_kv,
)
from .geometry import (
    GEOMETRIES,
    AttnGeometry,
    gqa,
    make_layer,
    make_model_runner,
    make_torch_native_backend,
    mha,
    mla_absorbed,
    mla_normal,
)
from .runtime import PARALLEL_DEFAULTS, SGLANG_VERSION, import_sglang, parallel_scope, sglang_available
from .swa import SwaMemory, make_swa_model_runner

ensure_torchvision_importable()

__all__ = [
    "GEOMETRIES", "PARALLEL_DEFAULTS", "SGLANG_VERSION", "AttnGeometry", "BatchData", "LayerData", "default_tolerance",
    "ensure_sglang_importable", "ensure_torchvision_importable", "gqa", "import_sglang", "make_torch_native_backend",
    "make_decode_batch", "make_extend_batch", "make_layer", "make_model_runner", "mha", "mla_absorbed", "mla_normal",
    "parallel_scope", "read_kv", "request_kv", "request_q", "run_sglang", "run_sglang_layer", "sglang_available",
    "write_kv", "SwaMemory", "make_swa_model_runner",
]
