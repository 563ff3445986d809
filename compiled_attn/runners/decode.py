"""Bucketed decode steps: compile once, capture a CUDA graph per bucket, warm everything before serving.

A step is any ``step_fn(inputs, persistent)``: ``inputs`` the fields of ``DecodeInputs`` plus per-row inputs,
``persistent`` the KV caches and ``req_to_token``. The key is the batch bucket *and* a KV-block-capacity bucket, so
a step's work follows the batch's real lengths. The switches mean what they mean in SGLang.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from graphs import BucketedGraphs, BucketPolicy, BufferSpec, RowInput, StaticBuffers, cache_slots, cdiv, check_row_specs

from .. import validate
from ..compile_policy import compile_step
from ..plan import DecodeInputs, DecodeMetadata, total_blocks_needed

#: the per-row fields of ``DecodeInputs`` (req_rows, kv_lo, kv_hi; the other two are unbatched aranges)
ROW_FIELDS = DecodeInputs._fields[:3]
#: rows of a compiled bucket's buffers at least (``DecodeGraphs._buffer_specs``)
MIN_COMPILED_ROWS = 2


@dataclass
class GraphConfig:
    """SGLang-style switches plus the bucket ranges.

    max_batch_size: largest batch bucket (SGLang's cuda_graph_max_bs); cuda_graph_bs overrides the list.
    max_kv_tokens: most KV tokens one decode batch reads in total (sum over requests, rounded per block).
    """

    max_batch_size: int = 32
    max_kv_tokens: int = 8192
    max_context_len: int | None = None  # per request; when set, buckets no batch of that size can reach are skipped
    enable_torch_compile: bool = True
    torch_compile_max_bs: int = 32
    cuda_graph_bs: Sequence[int] | None = None
    disable_cuda_graph: bool = False
    block_size: int = 64
    min_kv_tokens: int = 256
    kv_growth: float = 2.0
    # these three, enable_torch_compile and disable_cuda_graph: see graphs.BucketedGraphs
    warmup_iters: int | None = None
    progress: bool = True
    measure_compile: bool = True

    def __post_init__(self):
        for name in ("max_batch_size", "max_kv_tokens", "torch_compile_max_bs", "block_size", "min_kv_tokens"):
            validate.check_positive_int(f"GraphConfig.{name}", getattr(self, name))
        for name in ("max_context_len", "warmup_iters"):
            if getattr(self, name) is not None:
                validate.check_positive_int(f"GraphConfig.{name}", getattr(self, name))
        validate.check_growth("GraphConfig.kv_growth", self.kv_growth)
        if self.cuda_graph_bs is not None:
            if isinstance(self.cuda_graph_bs, (str, bytes)) or not isinstance(self.cuda_graph_bs, Sequence) \
                    or not self.cuda_graph_bs:
                raise ValueError(f"GraphConfig.cuda_graph_bs must be a non-empty list of ints >= 1, "
                                 f"got {self.cuda_graph_bs!r}")
            for b in self.cuda_graph_bs:
                validate.check_positive_int("GraphConfig.cuda_graph_bs entry", b)

    def policy(self) -> BucketPolicy:
        return BucketPolicy.create(self.max_batch_size, self.max_kv_tokens, batch_sizes=self.cuda_graph_bs,
                                   min_kv_tokens=max(self.min_kv_tokens, self.block_size),
                                   kv_growth=self.kv_growth)


def check_config(config: GraphConfig) -> BucketPolicy:
    """A bucketed runner's ``config`` checked, and its bucket policy (every KV capacity whole blocks)."""
    if not isinstance(config, GraphConfig):
        raise TypeError(f"config must be a GraphConfig, got {type(config).__name__}")
    policy = config.policy()
    for kv in policy.kv_capacities:
        if kv % config.block_size:
            raise ValueError(f"kv capacity {kv} is not a multiple of block_size={config.block_size}")
    return policy


def warmup_width(persistent: Mapping[str, torch.Tensor], max_context_len: int | None) -> int:
    """The most keys one request of a warm-up batch reads: the width of ``persistent["req_to_token"]``, bounded by
    ``max_context_len`` when set. ValueError when the table is missing or not 2-D with a column or more."""
    table = persistent.get("req_to_token")
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[1] < 1:
        raise ValueError(f"persistent must hold 'req_to_token' ([max_reqs, max_context_len] int tensor), the "
                         f"table every step indexes; got {type(table).__name__ if table is not None else 'none'}"
                         f" (keys: {sorted(persistent)})")
    return min(int(table.shape[1]), max_context_len or int(table.shape[1]))


def reachable_keys(config: GraphConfig, policy: BucketPolicy) -> list[tuple[int, int]]:
    """The policy's ``(bs, kv)`` keys some batch can need (each row reads <= max_context_len tokens, in blocks)."""
    if config.max_context_len is None:
        return list(policy.keys())
    row = cdiv(config.max_context_len, config.block_size) * config.block_size
    below = dict(zip(policy.kv_capacities, (0, *policy.kv_capacities[:-1]), strict=True))  # KV bucket -> one below
    return [(bs, kv) for bs, kv in policy.keys() if below[kv] < bs * row]


class DecodeGraphs(BucketedGraphs):
    """Warm-up and replay of a decode step over (batch bucket, KV-token bucket) keys.

    ``run`` takes the real batch's ``DecodeMetadata`` (planned without padding) and per-row inputs, copies them into
    the smallest bucket that holds them and replays (without a graph beyond the largest: warned once).
    check_slots: before each replay, check the slot inputs (``RowInput(slots=True)``), the req_to_token entries
        read (unless ``meta.slots_checked``) and that ``blocks_needed`` covers the ranges (a host read).
    """

    def __init__(self, step_fn: Callable, *, config: GraphConfig, device: torch.device | str,
                 row_inputs: Mapping[str, RowInput], check_slots: bool = True):
        self.policy = check_config(config)
        self.row_inputs = check_row_specs("row_inputs", row_inputs)
        self.check_slots = check_slots
        super().__init__(step_fn, config=config, device=device, compile_fn=compile_step)
        self._width = 0  # set by warmup() (warmup_width): the most keys a warm-up request reads
        # the input dicts of compiled one-row buckets (held with a padding row: ``_buffer_specs``), by id
        self._padded_one_row: set[int] = set()
        self._eager_keys: set[tuple[int, int]] = set()  # buckets that replay the eager step (set by warmup)
        self._build_runners(reachable_keys(config, self.policy), config.torch_compile_max_bs)

    def _eager_step(self, inputs: dict[str, torch.Tensor], persistent: dict[str, torch.Tensor]):
        """The uncompiled step, a one-row bucket's padding row dropped (so it runs the batch-of-one path)."""
        if id(inputs) in self._padded_one_row:
            batched = (*ROW_FIELDS, *self.row_inputs)
            inputs = {name: t[:1] if name in batched else t for name, t in inputs.items()}
        return self._step_fn(inputs, persistent)

    def _buffer_specs(self, key: tuple[int, int]) -> dict[str, BufferSpec]:
        bs, kv_tokens = key
        # A compiled step never sees a batch of one row: dynamo specializes a size of 1, so a one-row bucket would
        # compile a second graph to save one cheap padding row.
        compiles = self._compiled is not None and bs <= self.config.torch_compile_max_bs
        rows = max(bs, MIN_COMPILED_ROWS) if compiles else bs
        specs = {name: BufferSpec((rows,), torch.int64, fill=0) for name in ROW_FIELDS}
        specs["block_ids"] = BufferSpec((kv_tokens // self.config.block_size,), torch.int64, batch_dim=None)
        specs["block_offsets"] = BufferSpec((self.config.block_size,), torch.int64, batch_dim=None)
        for name, spec in self.row_inputs.items():
            specs[name] = BufferSpec((rows, *spec.shape), spec.dtype, fill=spec.fill)
        return specs

    def _make_buffers(self, key: tuple[int, int]) -> StaticBuffers:
        buffers = super()._make_buffers(key)
        if buffers.bucket != key[0]:
            self._padded_one_row.add(id(buffers.tensors))
        return buffers

    def _fill_warmup_batch(self, buffers: StaticBuffers, key: tuple[int, int]) -> None:
        """CPU: warm a bucket on a batch that does its full work, every row reading request row 0 over an equal
        share of the bucket's blocks (outputs discarded): on an all-padding batch the kernel skips all work."""
        if self.device.type != "cpu":
            return
        bs, kv_tokens = key
        block = self.config.block_size
        buffers.tensors["kv_hi"][:bs].fill_(min(max(kv_tokens // bs // block, 1) * block, self._width))
        buffers.tensors["block_ids"].copy_(torch.arange(kv_tokens // block))
        buffers.tensors["block_offsets"].copy_(torch.arange(block))

    def warmup(self, persistent: Mapping[str, torch.Tensor],
               choices: Mapping[tuple[int, int], str] | None = None) -> dict:
        """``BucketedGraphs.warmup``, keyed by ``(bs, kv_tokens)``."""
        self._width = warmup_width(persistent, self.config.max_context_len)
        timings = super().warmup(persistent, choices)
        self._eager_keys = {k for k, c in self.choices().items() if c == "eager"}
        return timings

    def key_for(self, meta: DecodeMetadata) -> tuple[int, int] | None:
        """The smallest warmed bucket that holds this batch, or None (fallback)."""
        bs = self.policy.batch_bucket(meta.num_real)
        tokens = meta.blocks_needed * self.config.block_size
        if bs is None or tokens > self.policy.max_kv_tokens:
            return None
        return bs, self.policy.kv_bucket(tokens)

    def inputs_for(self, meta: DecodeMetadata, rows: Mapping[str, torch.Tensor], key) -> dict[str, torch.Tensor]:
        n, planned = meta.num_real, meta.inputs
        blocks = key[1] // self.config.block_size if key is not None else planned.block_ids.shape[0]
        inputs = {name: getattr(planned, name)[:n] for name in ROW_FIELDS}
        inputs["block_ids"] = torch.arange(blocks, device=self.device)
        inputs["block_offsets"] = planned.block_offsets
        inputs.update(rows)
        return inputs

    def run(self, meta: DecodeMetadata, rows: Mapping[str, torch.Tensor], persistent: Mapping[str, torch.Tensor]):
        """One decode step; outputs sliced to the real batch (on CUDA graphs: views valid until the next run)."""
        if meta.block_size != self.config.block_size:
            raise ValueError(f"metadata block_size {meta.block_size} != config block_size "
                             f"{self.config.block_size}")
        if self.check_slots:
            self._check_slots(meta, rows, persistent)
        key = self.key_for(meta)
        inputs = self.inputs_for(meta, rows, key)
        if key in self._eager_keys:
            # the bucket replays the eager step (measured faster at warm-up): run it on the real rows, uncopied
            runner = self._runner_of[key]
            runner.buffers(key).check(inputs)
            runner.stats.replays += 1  # served by its bucket, as a replay is
            return self._step_fn(inputs, persistent)
        return self._run(key, inputs, persistent, meta.num_real)

    def _check_slots(self, meta: DecodeMetadata, rows: Mapping[str, torch.Tensor],
                     persistent: Mapping[str, torch.Tensor]) -> None:
        """The one slot-range rule of ``plan_decode``, applied before a replay (module doc of ``validate``)."""
        num_slots = cache_slots(persistent)
        n, planned = meta.num_real, meta.inputs
        lo, hi = planned.kv_lo[:n].cpu(), planned.kv_hi[:n].cpu()  # read once (a sync on CUDA), used twice
        needed = total_blocks_needed(lo, hi, meta.block_size, meta.page_size)
        if meta.blocks_needed < needed:
            raise ValueError(f"metadata blocks_needed {meta.blocks_needed} is below the {needed} blocks its ranges "
                             "take (kv_lo, kv_hi): plan it with plan_decode, or count them with total_blocks_needed")
        for name, spec in self.row_inputs.items():
            if spec.slots and name in rows:
                validate.check_slot_values(name, rows[name][: meta.num_real], num_slots)
        if not meta.slots_checked:
            validate.check_slots(persistent["req_to_token"], planned.req_rows[:n].cpu(), lo, hi, num_slots)
