"""Bucketed extend (prefill) steps: padded to a (token bucket, pair bucket), compiled once, warmed before serving.

A step's ``inputs`` hold the fields of ``ExtendTileInputs`` plus per-token inputs; padded tokens and pairs compute
nothing. The key has both buckets because a batch's pairs do not follow from its token count.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from graphs import (
    BucketedGraphs,
    BufferSpec,
    GraphRunner,
    RowInput,
    RunnerStats,
    StaticBuffers,
    cache_slots,
    cdiv,
    check_row_specs,
    check_row_values,
    kv_capacities,
)

from .. import validate
from ..compile_policy import compile_step
from ..extend import PAIR_FIELDS, ExtendTileInputs, default_tile_q, pad_pairs, plan_extend_tiles
from ..plan import ExtendInputs, ExtendMetadata, normalize_window
from .decode import warmup_width


class ExtendKey(NamedTuple):
    """A bucket: the per-token inputs padded to ``tokens`` rows, the pair list to ``pairs`` pairs."""

    tokens: int
    pairs: int


@dataclass
class ExtendGraphConfig:
    """Bucket ranges and SGLang-style switches of ``ExtendGraphs``.

    Buckets are geometric (``graphs.kv_capacities``, from ``min_*`` by ``*_growth`` to ``max_*``). max_tokens: most
    new tokens of one batch. max_pairs: the largest pair bucket (None: ``pair_bound`` of max_tokens).
    max_context_len (None: max_tokens), max_requests: per request and per batch, to skip buckets no batch reaches.
    tile_q, tile_k: the tiles the plan cuts (tile_q None: ``extend.default_tile_q`` of the device's form).
    """

    max_tokens: int = 8192
    max_pairs: int | None = None
    min_tokens: int = 64
    min_pairs: int = 64
    token_growth: float = 2.0
    pair_growth: float = 2.0
    max_context_len: int | None = None
    max_requests: int = 256
    tile_q: int | None = None
    tile_k: int = 64
    # the switches: see graphs.BucketedGraphs
    enable_torch_compile: bool = True
    disable_cuda_graph: bool = False
    warmup_iters: int | None = None
    progress: bool = True
    # measure_compile's runs of each form: one (decode takes two), as a sample is a whole prefill
    measure_compile: bool = True
    measure_iters: int = 1

    def __post_init__(self):
        for name in ("max_tokens", "min_tokens", "min_pairs", "max_requests", "tile_k", "measure_iters"):
            validate.check_positive_int(f"ExtendGraphConfig.{name}", getattr(self, name))
        for name in ("max_pairs", "max_context_len", "tile_q", "warmup_iters"):
            if getattr(self, name) is not None:
                validate.check_positive_int(f"ExtendGraphConfig.{name}", getattr(self, name))
        for name in ("token_growth", "pair_growth"):
            validate.check_growth(f"ExtendGraphConfig.{name}", getattr(self, name))

    def pair_bound(self, num_tokens: int, tile_q: int) -> int:
        """The most pairs a batch of ``num_tokens`` new tokens can need: its query tiles (fewer than
        ``num_tokens / tile_q`` plus one per request) times the key tiles one query tile can span (a range of at
        most ``max_context_len`` keys, unaligned)."""
        context = self.max_context_len or self.max_tokens
        query_tiles = cdiv(num_tokens, tile_q) + min(num_tokens, self.max_requests)
        return query_tiles * (cdiv(context, self.tile_k) + 1)


def lengths_metadata(ext_lens: Sequence[int], prefix_lens: Sequence[int] | None = None, *, causal: bool = True,
                     sliding_window: int | None = None, device: torch.device | str = "cpu") -> ExtendMetadata:
    """The ``ExtendMetadata`` ``plan.plan_extend`` builds for self-attention requests of these lengths, all on
    request row 0 (for counting pairs and warm-up). ext_lens, prefix_lens: [bs] new and cached tokens per request."""
    ext = torch.tensor(list(ext_lens), dtype=torch.int64)
    prefix = torch.zeros_like(ext) if prefix_lens is None else torch.tensor(list(prefix_lens), dtype=torch.int64)
    if ext.shape != prefix.shape or (ext < 0).any() or (prefix < 0).any():
        raise ValueError(f"ext_lens and prefix_lens must be equally long lists of ints >= 0, got {list(ext_lens)} "
                         f"and {None if prefix_lens is None else list(prefix_lens)}")
    window = normalize_window(sliding_window)
    skip = (prefix - window).clamp_min(0) if window is not None else torch.zeros_like(prefix)  # as plan_extend
    inputs = ExtendInputs(req_rows=torch.zeros_like(ext), kv_lo=skip, kv_len=prefix + ext - skip,
                          q_first=prefix - skip, q_len=ext, q_offsets=torch.cumsum(ext, 0) - ext)
    inputs = ExtendInputs(*(t.to(device) for t in inputs))
    return ExtendMetadata(inputs, causal=causal, sliding_window=window, num_real=int(ext.shape[0]),
                          num_tokens=int(ext.sum()))


class ExtendGraphs(BucketedGraphs):
    """Warm-up and replay of an extend step over ``ExtendKey`` (token bucket, pair bucket) buckets.

    ``warmup(persistent, keys=None)`` warms every reachable bucket, or only ``keys``. ``run`` plans the tiles, picks
    the smallest warmed bucket that holds the batch and replays (without a graph where none does: warned once).
    token_inputs: the step's per-token inputs (``RowInput``; ``slots=True``: KV slots, checked when ``check_slots``).
    causal, sliding_window: the step's static mask settings; a batch planned with others is a ValueError.
    """

    def __init__(self, step_fn: Callable, *, config: ExtendGraphConfig, device: torch.device | str,
                 token_inputs: Mapping[str, RowInput], causal: bool = True, sliding_window: int | None = None,
                 check_slots: bool = True):
        if not isinstance(config, ExtendGraphConfig):
            raise TypeError(f"config must be an ExtendGraphConfig, got {type(config).__name__}")
        if not token_inputs:
            raise ValueError("token_inputs must name at least one per-token input (e.g. the packed q)")
        self.token_inputs = check_row_specs("token_inputs", token_inputs, ExtendTileInputs._fields,
                                            "an ExtendTileInputs field")
        super().__init__(step_fn, config=config, device=device, compile_fn=compile_step)
        self.causal, self.sliding_window = bool(causal), normalize_window(sliding_window)
        self.check_slots = check_slots
        self.tile_q = config.tile_q or default_tile_q("kernel" if self.device.type == "cpu" else "matmul")
        self.tile_k = config.tile_k
        self.token_capacities = kv_capacities(config.max_tokens, min_kv_tokens=config.min_tokens,
                                              growth=config.token_growth)
        max_pairs = config.max_pairs or config.pair_bound(config.max_tokens, self.tile_q)
        self.pair_capacities = kv_capacities(max_pairs, min_kv_tokens=config.min_pairs, growth=config.pair_growth)
        self._warmed: list[ExtendKey] = []  # smallest first: run() takes the first that holds a batch
        self._width = 0  # set by warmup() (warmup_width): the most keys a warm-up request reads

    _step = property(lambda self: self._step_fn, doc="The uncompiled step.")

    @property
    def runner(self) -> GraphRunner | None:
        """The runner of the buckets ``warmup`` warmed (None before it)."""
        return self.runners[0] if self.runners else None

    def keys(self) -> list[ExtendKey]:
        """Every bucket some batch can need, smallest first."""
        return [ExtendKey(t, p) for t in self.token_capacities for p in self.pair_capacities
                if self._reachable(t, p)]

    def _reachable(self, tokens: int, pairs: int) -> bool:
        """Whether a batch of this token bucket (more tokens than the bucket below) can need this pair bucket:
        more pairs than the bucket below can hold (at most ``pair_bound``), and no fewer than its queries' own
        key tiles (a self-attention query sees its own position, so a tile of n queries spans >= n keys)."""
        i, j = self.token_capacities.index(tokens), self.pair_capacities.index(pairs)
        fewer_tokens = self.token_capacities[i - 1] if i else 0
        fewer_pairs = self.pair_capacities[j - 1] if j else 0
        return (fewer_pairs < self.config.pair_bound(tokens, self.tile_q)
                and pairs >= cdiv(fewer_tokens + 1, self.tile_k))

    def bucket(self, num_tokens: int, num_pairs: int) -> ExtendKey | None:
        """The policy's bucket of a batch (smallest token and pair capacities that hold it), or None beyond."""
        i = bisect.bisect_left(self.token_capacities, num_tokens)
        j = bisect.bisect_left(self.pair_capacities, num_pairs)
        if i == len(self.token_capacities) or j == len(self.pair_capacities):
            return None
        return ExtendKey(self.token_capacities[i], self.pair_capacities[j])

    def pairs_for_lengths(self, ext_lens: Sequence[int], prefix_lens: Sequence[int] | None = None) -> int:
        """Pairs a self-attention batch of these lengths needs with this object's tiles and mask."""
        meta = lengths_metadata(ext_lens, prefix_lens, causal=self.causal, sliding_window=self.sliding_window)
        return plan_extend_tiles(meta, tile_q=self.tile_q, tile_k=self.tile_k).pairs_needed

    def key_for_lengths(self, ext_lens: Sequence[int], prefix_lens: Sequence[int] | None = None) -> ExtendKey | None:
        """The bucket a batch of these lengths runs in (for ``warmup(keys=...)``), or None (the fallback)."""
        return self.bucket(int(sum(ext_lens)), self.pairs_for_lengths(ext_lens, prefix_lens))

    def key_for(self, num_tokens: int, num_pairs: int) -> ExtendKey | None:
        """The smallest warmed bucket that holds the batch (by tokens, then pairs), or None (fallback)."""
        return next((k for k in self._warmed if k.tokens >= num_tokens and k.pairs >= num_pairs), None)

    def warmup(self, persistent: Mapping[str, torch.Tensor], choices: Mapping[ExtendKey, str] | None = None,
               keys: Sequence[ExtendKey] | None = None) -> dict:
        """``BucketedGraphs.warmup`` of every reachable bucket, or only ``keys`` (``key_for_lengths`` of the batches a
        caller will run)."""
        self._width = warmup_width(persistent, self.config.max_context_len)
        keys = self.keys() if keys is None else self._check_keys(keys)
        self._build_runners(keys, measure_iters=self.config.measure_iters)
        self._warmed = []
        timings = super().warmup(persistent, choices)
        self._warmed = sorted(self.runner.warmed_keys)
        return timings

    def _check_keys(self, keys: Sequence[ExtendKey]) -> list[ExtendKey]:
        out = []
        for k in keys:
            if not (isinstance(k, tuple) and len(k) == 2 and k[0] in self.token_capacities
                    and k[1] in self.pair_capacities):
                raise ValueError(f"keys: {k!r} is not a bucket (tokens in {list(self.token_capacities)}, pairs in "
                                 f"{list(self.pair_capacities)})")
            out.append(ExtendKey(*k))
        if not out:
            raise ValueError("keys must name at least one bucket (None: every reachable one)")
        return sorted(set(out))

    def _buffer_specs(self, key: ExtendKey) -> dict[str, BufferSpec]:
        tokens, pairs = key
        specs = {name: BufferSpec((pairs,), torch.bool if name == "full" else torch.int64, batch_dim=None)
                 for name in PAIR_FIELDS}
        specs["q_ids"] = BufferSpec((self.tile_q,), torch.int64, batch_dim=None)
        specs["k_ids"] = BufferSpec((self.tile_k,), torch.int64, batch_dim=None)
        for name, spec in self.token_inputs.items():
            specs[name] = BufferSpec((tokens, *spec.shape), spec.dtype, fill=spec.fill)
        return specs

    def _fill_warmup_batch(self, buffers: StaticBuffers, key: ExtendKey) -> None:
        """Warm a bucket on a batch that does close to its full work (requests of one length on request row 0;
        outputs discarded): on an all-padding batch the CPU flash op skips every pair and the warm-up times nothing."""
        length = max(1, min(self._width, key.tokens, self.tile_q))
        per_request = self.pairs_for_lengths([length])
        while per_request > key.pairs and length > 1:
            length //= 2
            per_request = self.pairs_for_lengths([length])
        count = max(1, min(key.tokens // length, key.pairs // per_request))
        meta = lengths_metadata([length] * count, causal=self.causal, sliding_window=self.sliding_window,
                                device=self.device)
        tiles = plan_extend_tiles(meta, tile_q=self.tile_q, tile_k=self.tile_k, pair_capacity=key.pairs)
        for name in ExtendTileInputs._fields:
            buffers.tensors[name].copy_(getattr(tiles.inputs, name))

    def run(self, meta: ExtendMetadata, tokens: Mapping[str, torch.Tensor], persistent: Mapping[str, torch.Tensor]):
        """One extend step over a batch planned by ``plan_extend`` with its per-token inputs ([num_tokens, ...]
        each); outputs cut to ``meta.num_tokens`` rows (on CUDA graphs: views valid until the next run)."""
        if self.runner is None:
            raise RuntimeError("ExtendGraphs.run() before warmup(persistent)")
        if not isinstance(meta, ExtendMetadata):
            raise TypeError(f"meta must be an ExtendMetadata (plan.plan_extend), got {type(meta).__name__}")
        if meta.causal != self.causal or meta.sliding_window != self.sliding_window:
            raise ValueError(f"meta was planned with causal={meta.causal}, sliding_window={meta.sliding_window}; "
                             f"these graphs run causal={self.causal}, sliding_window={self.sliding_window}")
        check_row_values("tokens", tokens, self.token_inputs, meta.num_tokens, "num_tokens of the planned batch first",
                         self.device, cache_slots(persistent) if self.check_slots else None)
        tiles = plan_extend_tiles(meta, tile_q=self.tile_q, tile_k=self.tile_k)
        key = self.key_for(meta.num_tokens, tiles.pairs_needed)
        pairs = tiles.inputs if key is None else pad_pairs(tiles.inputs, key.pairs, meta.num_tokens)
        return self._run(key, {**pairs._asdict(), **tokens}, persistent, meta.num_tokens)

    @property
    def stats(self) -> RunnerStats | None:
        """The runner's counters (None before ``warmup``)."""
        return self.runner.stats if self.runner is not None else None
