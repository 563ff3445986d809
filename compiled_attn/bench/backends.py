"""The attention backends the engine runs a model with: ``loop``, ``eager``, ``compiled``.

* ``loop``: SGLang ``torch_native``'s algorithm, one SDPA call per request per layer (``loop_baseline``; our
  re-implementation, labelled so: SGLang's own backend needs a model runner, a server config and its pools, more
  machinery than a benchmark baseline should carry when SGLang is importable at all).
* ``eager``: ours, uncompiled: ``plan`` once per step (host), ``decode_blocks`` / ``extend_tiles`` per layer.
* ``compiled``: the whole decode step (embedding to logits and argmax) as one step function, compiled and run
  through ``DecodeGraphs`` (CUDA graphs per bucket on CUDA, compiled replay on static buffers on CPU), and the
  prefill (embedding to the last layer's hidden states) through ``ExtendGraphs`` per (token, pair) bucket; both
  warmed before the first request (see ``CompiledBackend``).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters

from graphs import cdiv
from profiling import range as prange

from ..decode import build_decode_index, decode_blocks
from ..extend import (
    ExtendTileInputs,
    build_extend_tile_index,
    default_tile_q,
    extend_tiles,
    tile_index,
)
from ..forms import choose_extend_form
from ..plan import DecodeInputs, plan_decode, plan_extend
from ..runners.decode import DecodeGraphs, GraphConfig, RowInput
from ..runners.extend import ExtendGraphConfig, ExtendGraphs
from .loop_baseline import loop_decode, loop_extend
from .models import AttnFn, DecoderBase
from .pools import PAD_SLOT

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

    def prefill_bucket_of(self, prompt_lens: list[int]) -> str:
        return "eager"

    def prefill(self, model: DecoderBase, persistent: dict[str, torch.Tensor], batch: ExtendBatch,
                tokens: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor,
                logits_idx: torch.Tensor) -> torch.Tensor:
        """The prefill of ``batch``: tokens, positions, out_loc: [num_tokens] int64 (out_loc: the new tokens'
        slots); logits_idx: [bs] each request's last token -> logits [bs, vocab] float32."""
        attn = self.extend_attn(model, persistent, persistent["req_to_token"], batch)
        return model.extend(tokens, positions, out_loc, persistent, attn, logits_idx, batch.kv_slots)

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
            form = choose_extend_form(q, k_cache, v_cache, None).form
            index = tile_index(req_to_token, meta, form)

        def attn(layer, q, k_cache, v_cache, scale, v_shares_k=False):
            with prange("attn", layer=layer):
                return extend_tiles(q, k_cache, v_cache, index, scale, form=form)
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


def make_extend_step(model: DecoderBase, form: str):
    """The compiled prefill step: ``step(inputs, persistent) -> hidden [num_tokens, hidden]``, the last layer's
    hidden states. The lm_head runs outside on each request's last row: the step's shapes then follow the token
    bucket alone, not the request count.

    inputs: the pair list of ``ExtendGraphs`` (``ExtendTileInputs``) plus ``tokens``, ``positions``, ``out_loc``
    ([num_tokens] int64); persistent: ``req_to_token`` and the model's caches. form: "kernel" or "matmul"
    (``forms.choose_extend_form``; the kernel's index needs no mask). Batches without a cached prefix: the MLA
    model decompresses exactly the new tokens' slots (``out_loc``; padded tokens decompress the padding slot, which
    no request reads).
    """

    def step(inputs, persistent):
        index = build_extend_tile_index(persistent["req_to_token"], ExtendTileInputs.of(inputs), causal=True,
                                        sliding_window=None, with_mask=form != "kernel")

        def attn(layer, q, k_cache, v_cache, scale, v_shares_k=False):
            return extend_tiles(q, k_cache, v_cache, index, scale, form=form)

        loc = inputs["out_loc"]
        return model.hidden(inputs["tokens"], inputs["positions"], loc, persistent, attn, "extend", kv_slots=loc)

    return step


class CompiledBackend(EagerBackend):
    """Decode through ``DecodeGraphs``, prefill through ``ExtendGraphs``, both warmed in ``setup``.

    prefill_lens: the prompt lengths of every batch the run will prefill; only their buckets are warmed (a prefill
    bucket's warm-up runs the whole prefill several times: compile, then the compiled-vs-eager measurement).
    None: every reachable bucket. A batch with a cached prefix runs as ``eager`` does; one that no warmed bucket
    holds runs the prefill step on its own shapes, without a graph (``ExtendGraphs`` warns once).
    """

    name = "compiled"
    label = "compiled (ours, torch.compile + bucketed replay)"

    def __init__(self, config: GraphConfig, extend_config: ExtendGraphConfig | None = None,
                 prefill_lens: Sequence[Sequence[int]] | None = None):
        super().__init__(config.block_size)
        self.config = config
        self.extend_config = extend_config
        self.prefill_lens = [list(lens) for lens in prefill_lens] if prefill_lens is not None else None
        self.graphs: DecodeGraphs | None = None
        self.extend_graphs: ExtendGraphs | None = None

    def setup(self, model, persistent, device, max_context) -> dict:
        rows = {"tokens": RowInput((), torch.int64, 0, slots=False), "positions": RowInput((), torch.int64, 0,
                                                                                            slots=False),
                "out_loc": RowInput((), torch.int64, PAD_SLOT)}
        self.graphs = DecodeGraphs(make_decode_step(model), config=self.config, device=device, row_inputs=rows)
        t0 = time.perf_counter()
        timings = self.graphs.warmup(persistent)
        total = time.perf_counter() - t0
        info = {"warmup_s": total, "buckets": len(timings),
                "compile_s": max((t.get("compile_s", 0.0) for t in timings.values()), default=0.0),
                "keys": [list(k) for k in timings]}
        info.update(self._setup_prefill(model, persistent, device, max_context, rows))
        self._graphs_after_warmup = counters["stats"]["unique_graphs"]
        return info

    def _setup_prefill(self, model, persistent, device, max_context, rows) -> dict:
        hq, dqk, k_cache, v_cache = model.extend_attn_spec(persistent)
        form = choose_extend_form(_q_like(1, hq, dqk, k_cache), k_cache, v_cache, None).form
        c = self.config
        config = self.extend_config or ExtendGraphConfig(
            max_tokens=c.max_batch_size * max_context, max_context_len=max_context, max_requests=c.max_batch_size,
            tile_q=default_tile_q(form), enable_torch_compile=c.enable_torch_compile,
            disable_cuda_graph=c.disable_cuda_graph, progress=c.progress, measure_compile=c.measure_compile)
        self.extend_graphs = ExtendGraphs(make_extend_step(model, form), config=config, device=device,
                                          token_inputs={**rows, "out_loc": RowInput((), torch.int64, PAD_SLOT,
                                                                                    slots=True)})
        keys = None
        if self.prefill_lens is not None:
            keys = sorted({k for lens in self.prefill_lens if (k := self.extend_graphs.key_for_lengths(lens))})
        t0 = time.perf_counter()
        timings = self.extend_graphs.warmup(persistent, keys=keys or None)
        return {"prefill_warmup_s": time.perf_counter() - t0,
                "prefill_buckets": {f"{k.tokens}x{k.pairs}": t for k, t in timings.items()}}

    def warmup_report(self, setup: dict) -> str:
        """What ``setup`` warmed and how long it took, one line per phase (the bench prints it)."""
        p = self.graphs.policy
        lines = [f"[compiled] decode warm-up before the first request: {setup['warmup_s']:.1f} s for "
                 f"{setup['buckets']} buckets (batch {list(p.batch_sizes)} x kv tokens {list(p.kv_capacities)}; "
                 f"largest first compile {setup['compile_s']:.1f} s)"]
        per = []
        for name, t in setup["prefill_buckets"].items():
            timed = f": compiled {t['compiled_s'] * 1e3:.0f} ms, eager {t['eager_s'] * 1e3:.0f} ms" \
                if "eager_s" in t else ""
            per.append(f"{name} -> {t.get('choice', 'compiled')}{timed}")
        first = max((t["compile_s"] for t in setup["prefill_buckets"].values()), default=0.0)
        lines.append(f"[compiled] prefill warm-up: {setup['prefill_warmup_s']:.1f} s for "
                     f"{len(per)} buckets (tokens x pairs; first run incl. compile {first:.1f} s): {'; '.join(per)}")
        return "\n".join(lines)

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

    def prefill_bucket_of(self, prompt_lens: list[int]) -> str:
        g = self.extend_graphs
        key = g.key_for(sum(prompt_lens), g.pairs_for_lengths(prompt_lens))
        return "fallback" if key is None else f"{key.tokens}x{key.pairs}"

    def prefill(self, model, persistent, batch: ExtendBatch, tokens, positions, out_loc, logits_idx):
        if bool((batch.prefix_lens != 0).any()):  # the step decompresses only out_loc (make_extend_step)
            return super().prefill(model, persistent, batch, tokens, positions, out_loc, logits_idx)
        hq, dqk, k_cache, v_cache = model.extend_attn_spec(persistent)
        with prange("plan", phase="extend", bs=int(batch.rows.shape[0])):
            meta = plan_extend(_q_like(int(tokens.shape[0]), hq, dqk, k_cache), k_cache, v_cache,
                               persistent["req_to_token"], batch.rows, batch.seq_lens, batch.prefix_lens,
                               batch.ext_lens)
        hidden = self.extend_graphs.run(meta, {"tokens": tokens, "positions": positions, "out_loc": out_loc},
                                        persistent)
        return model.logits(hidden.index_select(0, logits_idx))

    def decode(self, model, persistent, batch: DecodeBatch):
        hq, dqk, k_cache, v_cache = model.decode_attn_spec(persistent)
        bs = int(batch.rows.shape[0])
        with prange("plan", phase="decode", bs=bs):
            meta = plan_decode(_q_like(bs, hq, dqk, k_cache), k_cache, v_cache, persistent["req_to_token"],
                               batch.rows, batch.seq_lens, block_size=self.config.block_size)
        rows = {"tokens": batch.tokens, "positions": batch.positions, "out_loc": batch.out_loc}
        return self.graphs.run(meta, rows, persistent)


def make_backend(name: str, config: GraphConfig | None = None, *, extend_config: ExtendGraphConfig | None = None,
                 prefill_lens: Sequence[Sequence[int]] | None = None):
    """``extend_config`` / ``prefill_lens``: the compiled backend's prefill buckets (``CompiledBackend``)."""
    if name == "loop":
        return LoopBackend()
    if name == "eager":
        return EagerBackend(config.block_size if config else 64)
    if name == "compiled":
        return CompiledBackend(config or GraphConfig(), extend_config, prefill_lens)
    raise ValueError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
