"""Opaque inference ops for ``torch.compile``: what ``torch.library.custom_op`` gives (the compiled graph calls the
function as one node; a fake registered beside it gives its output shapes) without its per-call Python layers.

Why: a ``custom_op`` call passes through an autograd wrapper, a redispatch and an output-aliasing check in Python,
30-40 us per call on this project's CPUs, as much as a short request's whole decode kernel, once per layer per
step. These ops are inference-only (no backward), so they are registered straight on the dispatcher as
``CompositeExplicitAutograd`` kernels: a call goes from the dispatcher to the Python function. The output must
still not alias an input (the compiled graph assumes it), as for ``custom_op``: every op here returns new tensors.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

NAMESPACE = "compiled_attn"
# the registration handle: the ops live as long as it does (a fragment: other modules may add ops to the namespace)
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


def opaque_op(fn: Callable) -> torch._ops.OpOverload:
    """Register ``fn`` (annotated like a ``custom_op`` function) as ``torch.ops.compiled_attn.<fn name>`` and return
    that op; register its fake with ``torch.library.register_fake(op)``."""
    name = fn.__name__
    _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=()))
    _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
    return getattr(getattr(torch.ops, NAMESPACE), name).default
