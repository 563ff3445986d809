"""The reference models' dense projections: ``F.linear``, routed to oneDNN for float32 on CPU.

Why: every backend runs the same projections, so their cost dilutes the attention difference the benchmark is
about, and on the CI's AMD CPUs ATen's float32 ``linear`` (MKL) runs these projections several times slower
than oneDNN (docs/measuring.md). Serving stacks pack their CPU weights for oneDNN too (SGLang's CPU path
does). bfloat16/float16 ``linear`` already reaches oneDNN, and CUDA uses cuBLAS, so only CPU float32 is rerouted.

The oneDNN call sits in an opaque op (``compiled_attn.compile_policy``) because inductor lowers
``mkldnn._linear_pointwise`` only for weights it packed itself (under freezing); as an opaque op the compiled step
calls the same kernel the eager backends do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...compile_policy import opaque_op

# a property of this torch build, read once: dynamo will not trace the query inside a compiled step
_ONEDNN = torch.backends.mkldnn.is_available()


@opaque_op
def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [n, in] float32 CPU; weight: [out, in] -> [n, out] (``x @ weight.T``)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")


@torch.library.register_fake(onednn_linear)
def _onednn_linear_fake(x, weight):
    return x.new_empty((x.shape[0], weight.shape[0]))


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` without bias. x: [..., in]; weight: [out, in] -> [..., out]."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and _ONEDNN:
        return onednn_linear(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)
