"""Helpers of the SGLang backend (``backend.py``): the decode graphs' block capacity and static buffers, and the
host-side reading of a layer's and a batch's settings."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from graphs import cdiv

from ..decode import gather_unit
from ..plan import normalize_window

#: the environment variable that bounds the KV tokens a captured graph computes over (``backend.py``'s docstring)
GRAPH_KV_TOKENS_ENV = "COMPILED_ATTN_GRAPH_KV_TOKENS"


def graph_block_capacity(bs: int, *, max_context_len: int, kv_tokens: int, block_size: int,
                         page_size: int = 1) -> int:
    """KV blocks a decode graph of ``bs`` rows computes over (see the module docstring). With pages a request's
    first block may start up to ``gather_unit - 1`` positions early (a window's start rounded down to its run):
    one more block per row at most."""
    unit = gather_unit(page_size, block_size)
    per_row = 1 if unit == 1 else 2
    return max(1, min(bs * cdiv(max_context_len + unit - 1, block_size), cdiv(kv_tokens, block_size) + per_row * bs))


def graph_batch_size(forward_batch, max_bs: int) -> int:
    """The batch size of a graph's batch (``forward_batch`` may be SGLang's runner view), refused past the graph
    buffers' ``max_bs``."""
    bs = getattr(forward_batch, "batch_size", None) or forward_batch.seq_lens.shape[0]
    if bs > max_bs:
        raise ValueError(f"compiled_attn: batch size {bs} exceeds the graph buffers' max_bs={max_bs}")
    return bs


def check_graph_blocks(batch: Callable[[], str], needed: int, capacity: int, block_size: int, kv_tokens: int
                       ) -> None:
    """A batch needing more KV blocks than the captured graph of its size computes over is refused (a replay would
    drop the rest): the message names the batch (``batch()``: what it is and holds; called only for the message,
    so a step that fits pays no host reads for it) and the setting to raise."""
    if needed > capacity:
        raise ValueError(
            f"compiled_attn: this {batch()} needs {needed} KV blocks of {block_size}, more than the {capacity} a graph "
            f"of this batch size was captured with (requests sharing a cached prefix count it once each). Raise "
            f"{GRAPH_KV_TOKENS_ENV} (now {kv_tokens} tokens) or lower --cuda-graph-max-bs")


def layer_window(layer) -> int | None:
    return normalize_window(getattr(layer, "sliding_window_size", -1))


def layer_logit_cap(layer) -> float | None:
    cap = getattr(layer, "logit_cap", 0.0) or 0.0
    if cap <= 0:
        return None
    method = getattr(layer, "logit_capping_method", "tanh")
    if method != "tanh":
        raise NotImplementedError(f"compiled_attn: logit_capping_method={method!r} is not supported (only 'tanh')")
    return float(cap)


@dataclass
class GraphState:
    """Static buffers shared by every captured batch size (allocated by ``init_cuda_graph_state``)."""

    max_bs: int
    kv_tokens: int
    req_rows: torch.Tensor  # [max_bs] int64
    kv_lo: torch.Tensor  # [max_bs] int64
    kv_hi: torch.Tensor  # [max_bs] int64
    block_ids: torch.Tensor  # [capacity(max_bs)] int64 arange; a graph of bs rows reads [:capacity(bs)]
    block_offsets: torch.Tensor  # [block_size] int64 arange
    # TARGET_VERIFY graphs' buffers per draft token count k (``speculative_graphs.VerifyGraphState``), made at capture
    verify: dict = field(default_factory=dict)


def capturing_prefill_graph() -> bool:
    """True while SGLang's prefill graph runner captures: ``prefill_cuda_graph_runner.py``'s ``_capture`` sets
    ``get_flags().dp.capturing_prefill_graph`` around its warmups and captures, all on ``capture_prepare``'s dummy
    batches. False where SGLang's runtime is not importable."""
    try:
        from sglang.srt.runtime_context import get_flags
        return bool(get_flags().dp.capturing_prefill_graph)
    except (ImportError, AttributeError, RuntimeError):
        return False


def host_int64(cpu_copy, tensor) -> torch.Tensor:
    t = cpu_copy if cpu_copy is not None else tensor
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t)
    return t.detach().to("cpu", torch.int64)


def check_mode(mode) -> None:
    name = getattr(mode, "name", str(mode))
    if name == "DLLM_EXTEND":  # TARGET_VERIFY and DRAFT_EXTEND_V2 (speculative decoding): speculative.py
        raise NotImplementedError(f"compiled_attn: forward mode {name} (dLLM) is not supported yet")


def check_kwargs(kwargs) -> None:
    extra = sorted(name for name, value in kwargs.items() if value is not None)
    if extra:
        raise NotImplementedError(f"compiled_attn: attention arguments {extra} are not supported")
