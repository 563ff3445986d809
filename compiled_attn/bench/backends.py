"""The attention backends the engine runs a model with: ``loop``, ``eager``, ``compiled``.

* ``loop``: SGLang ``torch_native``'s algorithm, one SDPA call per request per layer (``loop_baseline``; our
  re-implementation, labelled so: SGLang's own backend needs a model runner, a server config and its pools, more
  machinery than a benchmark baseline should carry when SGLang is importable at all).
* ``eager``: ours, uncompiled: ``plan`` once per step (host), ``decode_blocks`` / ``extend_tiles`` per layer.
* ``compiled``: the whole decode step (embedding to logits and argmax) as one step function, compiled and run
  through ``DecodeGraphs`` (CUDA graphs per bucket on CUDA, compiled replay on static buffers on CPU), warmed
  before the first request. Extend runs uncompiled, as in ``eager`` (see ``CompiledBackend``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters

from graphs import cdiv
from profiling import range as prange

from ..decode import build_decode_index, decode_blocks
from ..decode_graphs import DecodeGraphs, GraphConfig, RowInput
from ..extend import extend_tiles, supports_tile_flash, tile_index
from ..kv_pool import PAD_SLOT
from ..metadata import DecodeInputs
from ..plan import plan_decode, plan_extend
from .loop_baseline import loop_decode, loop_extend
from .models import AttnFn, DecoderBase

BACKENDS = ("loop", "eager", "compiled")


@dataclass
class ExtendBatch:
    """A prefill batch (device tensors). rows, seq_lens, prefix_lens, ext_lens: [bs] int64; kv_slots: [m] int64,
    every slot the batch reads (prefix and new tokens, request order)."""

    rows: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    ext_lens: torch.Tensor
    kv_slots: torch.Tensor


@dataclass
class DecodeBatch:
    """One decode step (device tensors, [bs] int64): rows, seq_lens (including the new token), tokens (inputs),
    positions (= seq_lens - 1), out_loc (the new token's slot); seq_lens_host: the same lengths as a list."""

    rows: torch.Tensor
    seq_lens: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    out_loc: torch.Tensor
    seq_lens_host: list[int]


def _q_like(n: int, hq: int, dqk: int, like: torch.Tensor) -> torch.Tensor:
    """A stand-in q for ``plan`` (it reads only shape, dtype, device): an expanded scalar, no memory."""
    return torch.empty((), dtype=like.dtype, device=like.device).expand(n, hq, dqk)


class LoopBackend:
    name = "loop"
    label = "loop (ours, SGLang torch_native algorithm)"

    def setup(self, model: DecoderBase, persistent: dict[str, torch.Tensor], device: torch.device,
              max_context: int) -> dict:
        return {}

    def bucket_of(self, seq_lens_host: list[int]) -> str:
        return "eager"

    def extend_attn(self, model, caches, req_to_token, batch: ExtendBatch) -> AttnFn:
        def attn(layer, q, k_cache, v_cache, scale, v_shares_k=False):
            with prange("attn", layer=layer):
                return loop_extend(q, k_cache, v_cache, req_to_token, batch.rows, batch.seq_lens,
                                   batch.prefix_lens, batch.ext_lens, scale=scale)
        return attn

    def decode_attn(self, model, caches, req_to_token, batch: DecodeBatch) -> AttnFn:
        def attn(layer, q, k_cache, v_cache, scale, v_shares_k=False):
            with prange("attn", layer=layer):
                return loop_decode(q, k_cache, v_cache, req_to_token, batch.rows, batch.seq_lens, scale=scale)
        return attn

    def decode(self, model: DecoderBase, persistent: dict[str, torch.Tensor], batch: DecodeBatch):
        """-> (logits [bs, vocab] float32, next tokens [bs] int64)."""
        attn = self.decode_attn(model, persistent, persistent["req_to_token"], batch)
        logits = model.decode(batch.tokens, batch.positions, batch.out_loc, persistent, attn)
        return logits, logits.argmax(-1)


class EagerBackend(LoopBackend):
    name = "eager"
    label = "eager (ours, uncompiled)"

    def __init__(self, block_size: int = 64):
        self.block_size = block_size

    def extend_attn(self, model, caches, req_to_token, batch: ExtendBatch) -> AttnFn:
        hq, dqk, k_cache, v_cache = model.extend_attn_spec(caches)
        bs = int(batch.rows.shape[0])
        with prange("plan", phase="extend", bs=bs):
            q = _q_like(int(batch.ext_lens.sum()), hq, dqk, k_cache)
            meta = plan_extend(q, k_cache, v_cache, req_to_token, batch.rows, batch.seq_lens, batch.prefix_lens,
                               batch.ext_lens)
            flash = supports_tile_flash(q, k_cache, v_cache, None)
            index = tile_index(req_to_token, meta, flash)

        def attn(layer, q, k_cache, v_cache, scale, v_shares_k=False):
            with prange("attn", layer=layer):
                return extend_tiles(q, k_cache, v_cache, index, scale, cpu_flash=flash)
        return attn

    def decode_attn(self, model, caches, req_to_token, batch: DecodeBatch) -> AttnFn:
        hq, dqk, k_cache, v_cache = model.decode_attn_spec(caches)
        bs = int(batch.rows.shape[0])
        with prange("plan", phase="decode", bs=bs):
            meta = plan_decode(_q_like(bs, hq, dqk, k_cache), k_cache, v_cache, req_to_token, batch.rows,
                               batch.seq_lens, block_size=self.block_size)
            index = build_decode_index(req_to_token, meta.inputs)

        def attn(layer, q, k_cache, v_cache, scale, v_shares_k=False):
            with prange("attn", layer=layer):
                return decode_blocks(q, k_cache, v_cache, index, scale, v_shares_k=v_shares_k)
        return attn


def make_decode_step(model: DecoderBase):
    """The compiled decode step: ``step(inputs, persistent) -> (logits [bs, vocab], next_tokens [bs])``.

    inputs: the decode metadata of ``DecodeGraphs`` plus ``tokens``, ``positions``, ``out_loc`` ([bs] int64);
    persistent: ``req_to_token`` and the model's caches. Embedding to argmax in one function, so one compiled
    graph (one CUDA graph per bucket) covers the whole step.
    """

    def step(inputs, persistent):
        index = build_decode_index(persistent["req_to_token"], DecodeInputs.of(inputs))

        def attn(layer, q, k_cache, v_cache, scale, v_shares_k=False):
            return decode_blocks(q, k_cache, v_cache, index, scale, v_shares_k=v_shares_k)

        logits = model.decode(inputs["tokens"], inputs["positions"], inputs["out_loc"], persistent, attn)
        return logits, logits.argmax(-1)

    return step


class CompiledBackend(EagerBackend):
    """Decode through ``DecodeGraphs``; extend uncompiled (as ``eager``).

    Why extend stays uncompiled: the whole prefill under ``torch.compile`` ran no faster (the time is the
    projections' GEMMs and one SDPA per layer, external kernels either way), and each new prompt shape cost a compile
    (token counts differ per prompt). On CUDA SGLang also
    runs extend outside graphs. The warm-up compiles (and on CUDA captures) every decode bucket.
    """

    name = "compiled"
    label = "compiled (ours, torch.compile + bucketed replay)"

    def __init__(self, config: GraphConfig):
        super().__init__(config.block_size)
        self.config = config
        self.graphs: DecodeGraphs | None = None

    def setup(self, model, persistent, device, max_context) -> dict:
        rows = {"tokens": RowInput((), torch.int64, 0), "positions": RowInput((), torch.int64, 0),
                "out_loc": RowInput((), torch.int64, PAD_SLOT)}
        self.graphs = DecodeGraphs(make_decode_step(model), config=self.config, device=device, row_inputs=rows)
        t0 = time.perf_counter()
        timings = self.graphs.warmup(persistent)
        total = time.perf_counter() - t0
        self._graphs_after_warmup = counters["stats"]["unique_graphs"]
        return {"warmup_s": total, "buckets": len(timings),
                "compile_s": max((t.get("compile_s", 0.0) for t in timings.values()), default=0.0),
                "keys": [list(k) for k in timings]}

    def compiles_since_warmup(self) -> int:
        """Graphs dynamo compiled (in this process) since the warm-up ended; 0 is what warm-up promises."""
        return counters["stats"]["unique_graphs"] - self._graphs_after_warmup

    def bucket_of(self, seq_lens_host: list[int]) -> str:
        policy, block = self.graphs.policy, self.config.block_size
        tokens = sum(cdiv(n, block) for n in seq_lens_host) * block
        bs = policy.batch_bucket(len(seq_lens_host))
        if bs is None or tokens > policy.max_kv_tokens:
            return "fallback"
        return f"{bs}x{policy.kv_bucket(tokens)}"

    def decode(self, model, persistent, batch: DecodeBatch):
        hq, dqk, k_cache, v_cache = model.decode_attn_spec(persistent)
        bs = int(batch.rows.shape[0])
        with prange("plan", phase="decode", bs=bs):
            meta = plan_decode(_q_like(bs, hq, dqk, k_cache), k_cache, v_cache, persistent["req_to_token"],
                               batch.rows, batch.seq_lens, block_size=self.config.block_size)
        rows = {"tokens": batch.tokens, "positions": batch.positions, "out_loc": batch.out_loc}
        return self.graphs.run(meta, rows, persistent)


def make_backend(name: str, config: GraphConfig | None = None):
    if name == "loop":
        return LoopBackend()
    if name == "eager":
        return EagerBackend(config.block_size if config else 64)
    if name == "compiled":
        return CompiledBackend(config or GraphConfig())
    raise ValueError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
