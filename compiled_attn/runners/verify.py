"""Bucketed verify steps (speculative decoding's ``k`` draft tokens per request): the twin of ``runners.decode``.

A step's ``inputs`` hold the fields of ``VerifyInputs`` plus per-token inputs as ``[bs, k, *shape]`` (request-major,
as SGLang packs them); it returns ``[bs * k, ...]``. Keys are ``VerifyKey(batch bucket, k, KV-token bucket)``; only
the configured ``draft_lens`` run, so nothing compiles after warm-up. Plan with ``VerifyGraphs.plan``.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch

from graphs import BucketedGraphs, BufferSpec, RowInput, StaticBuffers, cache_slots, check_row_specs, check_row_values

from ..compile_policy import compile_step
from ..verify import VerifyInputs, VerifyMetadata, plan_verify
from ..verify_plan import prefix_blocks_needed
from .decode import GraphConfig, check_config, reachable_keys, warmup_width

#: the per-request fields of ``VerifyInputs`` (block_ids and block_offsets are unbatched aranges)
ROW_FIELDS = ("req_rows", "prefix_lens", "draft_mask")


class VerifyKey(NamedTuple):
    """A bucket: ``bs`` request rows of ``k`` draft tokens each over ``kv_tokens`` prefix tokens of blocks."""

    bs: int
    k: int
    kv_tokens: int


def _check_draft_lens(draft_lens) -> tuple[int, ...]:
    if isinstance(draft_lens, (str, bytes)) or not isinstance(draft_lens, Sequence) or not draft_lens:
        raise ValueError(f"draft_lens must be a non-empty list of ints >= 1 (the draft token counts to warm), "
                         f"got {draft_lens!r}")
    for k in draft_lens:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"draft_lens must hold ints >= 1, got {k!r} in {list(draft_lens)!r}")
    return tuple(sorted(set(draft_lens)))


class VerifyGraphs(BucketedGraphs):
    """Warm-up and replay of a verify step over ``VerifyKey`` (batch bucket, draft length, KV-token bucket) keys;
    ``run`` as ``DecodeGraphs.run``, its per-token inputs ``[num_real * k, *shape]`` each.

    draft_lens:   the draft token counts ``k`` to warm; another ``k`` is a ValueError.
    token_inputs: the step's per-token inputs (``RowInput``; ``slots=True``: KV slots, checked when ``check_slots``).
    check_slots: check the slot inputs lie in ``[0, num_slots)`` before a replay (``plan_verify`` checks the table).
    """

    def __init__(self, step_fn: Callable, *, config: GraphConfig, draft_lens: Sequence[int],
                 device: torch.device | str, token_inputs: Mapping[str, RowInput], check_slots: bool = True):
        self.policy = check_config(config)
        self.token_inputs = check_row_specs("token_inputs", token_inputs, VerifyInputs._fields,
                                            "the VerifyInputs field")
        self.draft_lens = _check_draft_lens(draft_lens)
        self.check_slots = check_slots
        super().__init__(step_fn, config=config, device=device, compile_fn=compile_step)
        self._width = 0  # set by warmup() (warmup_width): the most keys a warm-up request reads
        keys = [VerifyKey(bs, k, kv) for bs, kv in reachable_keys(config, self.policy) for k in self.draft_lens]
        self._build_runners(keys, config.torch_compile_max_bs)

    def _buffer_specs(self, key: VerifyKey) -> dict[str, BufferSpec]:
        bs, k, kv_tokens = key
        block = self.config.block_size
        specs = {"req_rows": BufferSpec((bs,), torch.int64, fill=0),
                 "prefix_lens": BufferSpec((bs,), torch.int64, fill=0),
                 # padded rows: row 0, no prefix, every draft key visible (finite output, dropped)
                 "draft_mask": BufferSpec((bs, k, k), torch.bool, fill=True),
                 "block_ids": BufferSpec((kv_tokens // block,), torch.int64, batch_dim=None),
                 "block_offsets": BufferSpec((block,), torch.int64, batch_dim=None)}
        for name, spec in self.token_inputs.items():
            specs[name] = BufferSpec((bs, k, *spec.shape), spec.dtype, fill=spec.fill)
        return specs

    def _fill_warmup_batch(self, buffers: StaticBuffers, key: VerifyKey) -> None:
        """The bucket's block aranges; on CPU also a batch that fills its blocks, every row reading request row 0
        (outputs discarded): on empty prefixes the CPU kernel reads nothing and the warm-up times nothing."""
        bs, k, kv_tokens = key
        block = self.config.block_size
        nblk = kv_tokens // block
        buffers.tensors["block_ids"].copy_(torch.arange(nblk))
        buffers.tensors["block_offsets"].copy_(torch.arange(block))
        if self.device.type != "cpu":
            return
        blocks = torch.full((bs,), nblk // bs, dtype=torch.int64)
        blocks[: nblk % bs] += 1  # the bucket's blocks shared out, a row at most one more than another
        buffers.tensors["prefix_lens"].copy_((blocks * block).clamp(0, max(self._width - k, 0)))

    def warmup(self, persistent: Mapping[str, torch.Tensor],
               choices: Mapping[VerifyKey, str] | None = None) -> dict:
        """``BucketedGraphs.warmup``, keyed by ``VerifyKey``."""
        self._width = warmup_width(persistent, self.config.max_context_len)
        return super().warmup(persistent, choices)

    def plan(self, q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, draft_len, custom_mask=None,
             **kwargs) -> VerifyMetadata:
        """``plan_verify`` with this object's block size (keyword arguments as ``plan_verify``'s)."""
        return plan_verify(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, draft_len, custom_mask,
                           block_size=self.config.block_size, **kwargs)

    def key_for(self, meta: VerifyMetadata) -> VerifyKey | None:
        """The smallest warmed bucket of the batch's ``k`` that holds it, or None (fallback)."""
        bs = self.policy.batch_bucket(meta.num_real)
        tokens = meta.blocks_needed * self.config.block_size
        if bs is None or tokens > self.policy.max_kv_tokens:
            return None
        return VerifyKey(bs, meta.draft_len, self.policy.kv_bucket(tokens))

    def inputs_for(self, meta: VerifyMetadata, tokens: Mapping[str, torch.Tensor],
                   key: VerifyKey | None) -> dict[str, torch.Tensor]:
        """The real batch's step inputs: its rows, the bucket's block arange, per-token inputs as [n, k, ...]."""
        n, k, planned = meta.num_real, meta.draft_len, meta.inputs
        inputs = {name: getattr(planned, name)[:n] for name in ROW_FIELDS}
        blocks = key.kv_tokens // self.config.block_size if key is not None else planned.block_ids.shape[0]
        inputs["block_ids"] = torch.arange(blocks, device=self.device)
        inputs["block_offsets"] = planned.block_offsets
        inputs.update({name: t.view(n, k, *t.shape[1:]) for name, t in tokens.items()})
        return inputs

    def run(self, meta: VerifyMetadata, tokens: Mapping[str, torch.Tensor], persistent: Mapping[str, torch.Tensor]):
        """One verify step; outputs cut to the real batch's ``num_real * k`` token rows (on CUDA graphs: views valid
        until the next run)."""
        self._check(meta, tokens, persistent)
        key = self.key_for(meta)
        return self._run(key, self.inputs_for(meta, tokens, key), persistent, meta.num_real * meta.draft_len)

    def _check(self, meta: VerifyMetadata, tokens: Mapping[str, torch.Tensor],
               persistent: Mapping[str, torch.Tensor]) -> None:
        """Host checks before a replay: inside one, a wrong shape or dtype would fail deep in the step or copy."""
        if not isinstance(meta, VerifyMetadata):
            raise TypeError(f"meta must be a VerifyMetadata (plan_verify), got {type(meta).__name__}")
        k = meta.draft_len
        if meta.num_real < 1:
            raise ValueError(f"meta.num_real must be >= 1 (an empty batch has nothing to verify), got {meta.num_real}")
        if k not in self.draft_lens:
            raise ValueError(f"draft_len={k} is not among the configured draft_lens {list(self.draft_lens)}")
        block = meta.inputs.block_offsets.shape[0]
        if block != self.config.block_size:
            raise ValueError(f"meta was planned with block_size={block}; these graphs use block_size="
                             f"{self.config.block_size} (plan with VerifyGraphs.plan)")
        for name in ROW_FIELDS:
            t = getattr(meta.inputs, name)
            if t.device != self.device:
                raise ValueError(f"meta.inputs.{name} is on {t.device}, these graphs run on {self.device}")
        needed = prefix_blocks_needed(meta.inputs.prefix_lens[: meta.num_real].cpu(), k, block, meta.page_size,
                                      meta.sliding_window)
        if meta.blocks_needed < needed:  # a bucket picked by it would drop the keys of the blocks past it
            raise ValueError(f"meta.blocks_needed {meta.blocks_needed} is below the {needed} prefix blocks its "
                             "prefix_lens take: plan it with VerifyGraphs.plan or plan_verify")
        n = meta.num_real * k
        check_row_values("tokens", tokens, self.token_inputs, n, f"num_real * draft_len = {meta.num_real} * {k} "
                         "tokens first", self.device, cache_slots(persistent) if self.check_slots else None)
