"""Helpers the ``bench-ops`` tables share (decode in ``ops_decode.py``, verify in ``ops_verify.py``): a cache's bytes
as float32 words for the one-pass read, compiling as a graph bucket does, what a bucket would replay, and the
K/V copies a call reads in turn so that it reads from memory. Imports no other ``bench-ops`` module."""
from __future__ import annotations

import math

import torch

from graphs.runner import faster_form
from profiling.timers import time_interleaved


def float32_words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as one flat tensor of float32 words, to be summed as a one-pass read (values do
    not matter): ATen's float sum streams at memory speed, while its integer and float8 sums are several times
    slower than a read."""
    flat = t.reshape(-1)
    return flat.view(torch.float32) if flat.dtype != torch.float32 and flat.nbytes % 4 == 0 else flat


def mark_as_bucket(q, k_cache, v_cache, table, block_offsets) -> None:
    """Compile as a ``DecodeGraphs`` / ``VerifyGraphs`` bucket does (``graphs.runner_helpers.mark_fixed_dims``): the
    cache, the table, the block size and q's head dims static, the batch and block counts symbolic."""
    for t in (k_cache, v_cache, table, block_offsets):
        torch._dynamo.mark_static(t)
    for dim in (1, 2):
        torch._dynamo.mark_static(q, dim)


def served_form(compiled, eager, iters: int = 2) -> str:
    """What a bucket of ``DecodeGraphs`` would replay for this op: its warm-up's measurement (``iters``
    interleaved runs of each, the fastest of each) and ``graphs.faster_form``: "compiled" or "eager"."""
    t = time_interleaved({"compiled": compiled, "eager": eager}, warmup=0, iters=iters)
    return faster_form(min(t["compiled"]), min(t["eager"]))


def copies_for(cold_bytes: int, nbytes: int) -> int:
    """How many copies of ``nbytes`` of K/V hold at least ``cold_bytes`` and one more (1 where ``cold_bytes`` is 0:
    every call reads the same copy)."""
    return 1 + math.ceil(cold_bytes / nbytes) if cold_bytes > 0 else 1


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16``, ``float8_e4m3fn`` -> ``fp8_e4m3fn``: a dtype as the tables print it."""
    return str(dtype).replace("torch.", "").replace("float8_", "fp8_")
