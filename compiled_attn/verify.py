"""Multi-token decode ("verify") for speculative decoding: ``k`` draft tokens per request over its cached prefix.

Each request has ``k`` new query tokens (``k`` = the draft token count, the same for the whole batch) whose K/V are
already written at positions ``[prefix_len, prefix_len + k)`` of its req_to_token row. Every query sees the whole
prefix ``[0, prefix_len)``; among the ``k`` new keys it sees either the causal chain (topk 1: query ``i`` sees draft
keys ``j <= i``) or what a per-request tree mask allows (SGLang's ``spec_info.custom_mask``).

Why not ``k`` decode steps or an extend: verify is bound by reading the prefix's K/V, so the prefix is cut into
decode's split-KV blocks (``build_decode_index``) and each block is read ONCE for all ``k`` queries of its
request: the queries are grouped ``[Hkv, k * group, D]`` against one K block (GQA's grouping with ``k`` times the
rows). The ``k`` draft keys form one extra tiny "draft block" per request, masked by the chain/tree, and the
prefix blocks and the draft block are merged with the log-sum-exp rule (``decode.merge_blocks``).

Two forms, as decode: on CPU (one head size, no soft-cap) ``verify_flash`` reads each request's prefix in
chunks of ``VERIFY_CHUNK_BYTES`` of K through ATen's CPU flash kernel with the request's queries as they are (no
per-block copies of them, no mask, a running log-sum-exp); elsewhere (CUDA, MLA's 576/512, soft-capped models) a
matmul form over the blocks. The draft block is always a small matmul (``k`` keys). Everything after
``plan_verify`` is pure tensor code with static shapes per (batch capacity, ``k``, block capacity): no ``.item()``.

Custom mask layouts: ``verify_masks``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import validate
from .api import _scale, v_is_prefix_of_k
from .block_flash import _flash_cpu, _gather_kv, slots_attention, supports_block_flash
from .decode import (
    DecodeIndex,
    aligned_kv_lo,
    build_decode_index,
    decode_blocks_needed,
    gather_unit,
    merge_blocks,
    sinks_by_kv_head,
)
from .decode_flash import one_call_fits
from .kv_dtype import compute_dtype, dequantize
from .merge import merge_two
from .metadata import DecodeInputs
from .opaque import opaque_op
from .plan import DEFAULT_BLOCK_SIZE, _capacity, _pad
from .verify_masks import MASK_LAYOUTS, chain_mask, check_custom_mask, draft_mask_from_custom, full_mask_numel

__all__ = ["VerifyIndex", "VerifyInputs", "VerifyMetadata", "build_verify_index", "chain_mask",
           "draft_mask_from_custom", "full_mask_numel", "plan_verify", "verify_attention", "verify_blocks"]

_LOWEST = torch.finfo(torch.float32).min
#: bytes of float32 K per gathered chunk of one request's prefix (``verify_flash``): 512 tokens of llama-3-8b's 8 KV
#: heads; 1, 2 and 4 MiB measured within 10% of each other (2 MiB best) at bs 1..32, k 4..8, one thread
VERIFY_CHUNK_BYTES = 2 << 20


class VerifyInputs(NamedTuple):
    """The per-step tensors of a verify batch (padded rows: row 0, empty prefix, the chain mask).

    req_rows:      [bs_cap] int64, request row in req_to_token
    prefix_lens:   [bs_cap] int64, cached keys ``[0, prefix_len)``; the draft keys follow at ``prefix_len + j``
    block_ids:     [num_blocks] int64 arange, the prefix block capacity
    block_offsets: [block_size] int64 arange
    draft_mask:    [bs_cap, k, k] bool, query ``i`` sees draft key ``j`` (its length in dim 1 is ``k``)
    """

    req_rows: torch.Tensor
    prefix_lens: torch.Tensor
    block_ids: torch.Tensor
    block_offsets: torch.Tensor
    draft_mask: torch.Tensor


@dataclass
class VerifyMetadata:
    """A planned verify batch: its step inputs and what the host knows (``num_real`` rows, ``k`` draft tokens)."""

    inputs: VerifyInputs
    num_real: int
    draft_len: int
    blocks_needed: int
    page_size: int = 1


@dataclass
class VerifyIndex:
    """Per-step index shared by every layer (``build_verify_index``).

    prefix:      the prefix's split-KV blocks (``decode.DecodeIndex`` over ``[0, prefix_len)``)
    draft_slots: [bs_cap, k] int64, KV slot of each draft key
    draft_mask:  [bs_cap, k, k] bool
    """

    prefix: DecodeIndex
    draft_slots: torch.Tensor
    draft_mask: torch.Tensor


def verify_block_size(draft_len: int) -> int:
    """Prefix block length for ``k`` draft tokens: ``64 * k`` within [64, 512]. In the matmul form each block
    carries a copy of its request's ``k * Hq`` query rows and returns as many output rows, a quarter of the K/V
    bytes at k = 8 with 64-token blocks; longer blocks keep that small. (The CPU form reads a request's blocks as
    one run of positions, so there the block length only sizes the index.)"""
    return min(512, max(DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE * draft_len))


def plan_verify(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    draft_len: int,
    custom_mask: torch.Tensor | None = None,
    *,
    mask_layout: str = "draft",
    batch_capacity: int | None = None,
    block_capacity: int | None = None,
    block_size: int | None = None,
    check_slots: bool = True,
    page_size: int = 1,
) -> VerifyMetadata:
    """Validate a verify batch and build its metadata, padded to ``batch_capacity`` rows and ``block_capacity``
    prefix blocks of ``block_size`` tokens (defaults: what the batch needs).

    q: [bs * k, Hq, Dqk], request b's queries at rows ``[b * k, (b + 1) * k)``; k_cache: [S, Hkv, Dqk];
    v_cache: [S, Hkv, Dv]; req_to_token: [max_reqs, max_context_len]; req_pool_indices, prefix_lens: [bs];
    draft_len: k (int >= 1); custom_mask: None (chain) or flat bool/int8/uint8 of exactly the ``mask_layout``'s size
    (``"draft"``: ``bs * k * k``; ``"full"``: ``k * sum(prefix_lens) + bs * k * k``; see the module docstring).
    block_size: prefix block length (default ``verify_block_size(draft_len)``);
    check_slots, page_size: as ``plan_decode`` (the checked range is ``[0, prefix_len + k)``).
    """
    validate.check_qkv(q, k_cache, v_cache)
    validate.check_positive_int("draft_len", draft_len)
    block_size = verify_block_size(draft_len) if block_size is None else block_size
    validate.check_positive_int("block_size", block_size)
    validate.check_positive_int("page_size", page_size)
    device, k = q.device, draft_len
    validate.check_tensor("prefix_lens", prefix_lens, 1, validate.INDEX_DTYPES, device)
    bs = prefix_lens.shape[0]
    if q.shape[0] != bs * k:
        raise ValueError(f"q has {q.shape[0]} tokens but the batch has {bs} requests of draft_len={k} "
                         f"({bs * k} tokens); draft_len must be the same for every request")
    rows = validate.check_table(req_to_token, req_pool_indices, bs, device)
    prefix = validate.check_lengths("prefix_lens", prefix_lens, bs, device)
    validate.check_kv_end(prefix + k, req_to_token.shape[1], "prefix_lens + draft_len")
    if mask_layout not in MASK_LAYOUTS:
        raise ValueError(f"mask_layout must be one of {MASK_LAYOUTS}, got {mask_layout!r}")
    if custom_mask is not None:
        check_custom_mask(custom_mask, prefix, k, mask_layout, device)
    unit = gather_unit(page_size, block_size)
    if check_slots:
        start = aligned_kv_lo(torch.zeros_like(prefix), unit)
        validate.check_slots(req_to_token, rows, start, prefix + k, k_cache.shape[0])
        validate.check_page_layout(req_to_token, rows, start, prefix + k, page_size)
    needed = int(decode_blocks_needed(torch.zeros_like(prefix), prefix, block_size, page_size).sum()) if bs else 0
    bs_cap = _capacity("batch_capacity", batch_capacity, bs)
    nblk = _capacity("block_capacity", block_capacity, needed)
    mask = chain_mask(bs_cap, k, device).clone()
    if custom_mask is not None and bs:
        mask[:bs] = draft_mask_from_custom(custom_mask, prefix.to(device), k, mask_layout)
    inputs = VerifyInputs(
        req_rows=_pad(rows, bs_cap).to(device),
        prefix_lens=_pad(prefix, bs_cap).to(device),
        block_ids=torch.arange(nblk, device=device),
        block_offsets=torch.arange(block_size, device=device),
        draft_mask=mask,
    )
    return VerifyMetadata(inputs, num_real=bs, draft_len=k, blocks_needed=needed, page_size=page_size)


def build_verify_index(req_to_token: torch.Tensor, inputs: VerifyInputs, page_size: int = 1, *,
                       host_form: bool = True) -> VerifyIndex:
    """The prefix blocks (``build_decode_index`` over ``[0, prefix_len)``, ``host_form`` as there) and the draft
    keys' slots; pure tensor code. req_to_token: [max_reqs, max_context_len]; inputs: ``plan_verify(...).inputs``
    or static buffers."""
    rows, prefix, block_ids, block_offsets, mask = inputs
    k = mask.shape[1]
    blocks = build_decode_index(req_to_token, DecodeInputs(rows, torch.zeros_like(prefix), prefix, block_ids,
                                                           block_offsets), page_size, host_form=host_form)
    pos = prefix[:, None] + torch.arange(k, device=prefix.device)  # [bs, k]
    draft_slots = req_to_token[rows[:, None], pos].to(torch.int64)
    return VerifyIndex(prefix=blocks, draft_slots=draft_slots, draft_mask=mask)


def verify_blocks(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index: VerifyIndex,
    scale: float,
    logit_cap: float | None = None,
    *,
    v_shares_k: bool = False,
    cpu_flash: bool | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``k`` queries per request over its prefix blocks and its draft block.

    q: [bs * k, Hq, Dqk] (bs: the index's batch capacity); caches, ``v_shares_k``, ``cpu_flash``, scales, sinks
    ([Hq] attention-sink logits): as ``decode.decode_blocks``. Returns [bs * k, Hq, Dv] in q.dtype; softmax and
    accumulation in float32.
    """
    bs, k = index.draft_mask.shape[:2]
    hq, hkv, dv = q.shape[1], k_cache.shape[1], v_cache.shape[2]
    if not torch.compiler.is_compiling():
        validate.check_positive_number("scale", scale)
    if bs == 0:
        return q.new_zeros(0, hq, dv)
    flash_fits = supports_block_flash(q, k_cache, v_cache, logit_cap)
    cpu_flash = flash_fits if cpu_flash is None else cpu_flash
    if cpu_flash and not flash_fits:
        raise ValueError("cpu_flash=True needs a CPU q, Dqk == Dv and logit_cap=None")
    # [bs*k, Hq, D] -> [bs, Hkv, k * group, D]: a request's k queries share its KV head's blocks
    qg = q.view(bs, k, hkv, hq // hkv, q.shape[2]).transpose(1, 2).reshape(bs, hkv, -1, q.shape[2])
    # a row of qg is draft token i's head g (row i * group + g): its sink is head g's, tiled over the k tokens
    row_sinks = None if sinks is None else sinks_by_kv_head(sinks, hkv, hq).repeat(1, k)  # [Hkv, k * group]
    dm, dl, do = _draft_block(qg, k_cache, v_cache, index, scale, logit_cap, v_shares_k, k_scale, v_scale)
    if cpu_flash:
        o, lse = _prefix_flash(qg, k_cache, v_cache, index.prefix, scale, k_scale, v_scale)
        out = _merge_two(o, lse, do, dm, dl, row_sinks)
    else:
        m, lsum, o = _prefix_matmul(qg, k_cache, v_cache, index.prefix, scale, logit_cap, v_shares_k, k_scale,
                                    v_scale)
        rows = torch.arange(bs, device=q.device)
        out = merge_blocks(torch.cat([m, dm]), torch.cat([lsum, dl]), torch.cat([o, do]),
                           torch.cat([index.prefix.block_req, rows]), bs, row_sinks)  # [bs, Hkv, k*group, Dv]
    return out.view(bs, hkv, k, hq // hkv, dv).transpose(1, 2).reshape(bs * k, hq, dv).to(q.dtype)


def _prefix_flash(qg, k_cache, v_cache, index: DecodeIndex, scale, k_scale, v_scale):
    """The prefixes through ``verify_flash`` -> (o [bs, Hkv, k * group, D] normalised, lse [bs, Hkv, k * group])."""
    hkv, d = qg.shape[1], qg.shape[3]
    scales = (1.0 if k_scale is None else k_scale, 1.0 if v_scale is None else v_scale)
    qg = qg.to(compute_dtype(qg.dtype, k_cache.dtype))
    single = index.single
    if single is not None and single.shape[0] and one_call_fits(single.shape[0], index.block_size, hkv, d) \
            and not torch.compiler.is_compiling():
        # a batch of one indexed on the host: its prefix's slots in one gather and one kernel call, as decode does
        o, lse = slots_attention(qg, k_cache, v_cache, single, scale, *scales)
        return o.float(), lse
    chunk = max(VERIFY_CHUNK_BYTES // (hkv * d * 4) // index.unit, 1) * index.unit
    return verify_flash(qg, k_cache, v_cache, index.runs, index.valid, index.block_req, scale, chunk, index.unit,
                        *scales)


def _merge_two(o, lse, do, dm, dl, sinks=None):
    """A normalised prefix part (o, its log-sum-exp) and the unnormalised draft part (do, max dm, sum dl) ->
    the softmax over both, [bs, Hkv, rows, Dv] float32: elementwise, so inductor fuses it (``merge_blocks``'
    scatter over two "blocks" per request cost more than the kernel at bs 1). No key at all gives zeros.
    sinks: [Hkv, rows] logits joining each row's denominator, or None."""
    m = torch.maximum(lse, dm)
    if sinks is not None:
        m = torch.maximum(m, sinks)
    wp, wd = torch.exp(lse - m), torch.exp(dm - m)
    den = wp + dl * wd
    if sinks is not None:
        den = den + torch.exp(sinks - m)
    den = den.clamp_min(torch.finfo(torch.float32).tiny)
    return (o * wp[..., None] + do * wd[..., None]) / den[..., None]


def _prefix_matmul(qg, k_cache, v_cache, index: DecodeIndex, scale, logit_cap, v_shares_k, k_scale, v_scale):
    """Prefix blocks as batched matmuls, one KV head at a time (as ``decode_blocks``' portable form)
    -> (m, lsum [nblk, Hkv, k * group], o [nblk, Hkv, k * group, Dv] unnormalised)."""
    bs, hkv, _, dqk = qg.shape
    dv = v_cache.shape[2]
    nblk, block_size = index.slots.shape
    flat = index.slots.reshape(-1)
    qb = qg.index_select(0, index.block_req.clamp_max(bs - 1)).float() * scale  # [nblk, Hkv, k * group, D]
    valid = index.valid[:, None, :]
    ms, ls, os_ = [], [], []
    for h in range(hkv):
        kb = dequantize(k_cache[:, h].index_select(0, flat), torch.float32, k_scale).view(nblk, block_size, dqk)
        if v_shares_k and (v_scale or 1.0) == (k_scale or 1.0):  # MLA's latent cache: V is K's first columns
            vb = kb[..., :dv]
        else:
            vb = dequantize(v_cache[:, h].index_select(0, flat), torch.float32, v_scale).view(nblk, block_size, dv)
        s = torch.bmm(qb[:, h], kb.transpose(1, 2))  # [nblk, k * group, block_size]
        m, p = _masked_softmax_parts(s, valid, logit_cap)
        ms.append(m)
        ls.append(p.sum(-1))
        os_.append(torch.bmm(p, vb))
    return torch.stack(ms, 1), torch.stack(ls, 1), torch.stack(os_, 1)


def _masked_softmax_parts(s, valid, logit_cap):
    """Scores -> (row max, exp weights); select, never multiply, so a masked key never reaches the sums."""
    if logit_cap is not None:
        s = logit_cap * torch.tanh(s / logit_cap)
    s = s.masked_fill(~valid, _LOWEST)
    m = s.amax(-1)
    return m, torch.where(valid, torch.exp(s - m[..., None]), 0.0)


def _draft_block(qg, k_cache, v_cache, index: VerifyIndex, scale, logit_cap, v_shares_k, k_scale, v_scale):
    """Each request's ``k`` queries over its ``k`` draft keys under the chain/tree mask (a tiny matmul: ``k``
    keys) -> (m, lsum, o) of shapes [bs, Hkv, k * group(, Dv)], o unnormalised, float32."""
    bs, hkv, rows, dqk = qg.shape
    k, dv = index.draft_mask.shape[1], v_cache.shape[2]
    flat = index.draft_slots.reshape(-1)
    kd = dequantize(k_cache.index_select(0, flat), torch.float32, k_scale).view(bs, k, hkv, dqk).transpose(1, 2)
    if v_shares_k and (v_scale or 1.0) == (k_scale or 1.0):
        vd = kd[..., :dv]
    else:
        vd = dequantize(v_cache.index_select(0, flat), torch.float32, v_scale).view(bs, k, hkv, dv).transpose(1, 2)
    s = torch.matmul(qg.float() * scale, kd.transpose(-1, -2))  # [bs, Hkv, k * group, k]
    # query row (i, g) of the grouped layout takes mask row i
    mask = index.draft_mask[:, None, :, None, :].expand(bs, 1, k, rows // k, k).reshape(bs, 1, rows, k)
    m, p = _masked_softmax_parts(s, mask, logit_cap)
    return m, p.sum(-1), torch.matmul(p, vd)


@opaque_op
def verify_flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, runs: torch.Tensor,
                 valid: torch.Tensor, block_req: torch.Tensor, scale: float, chunk_tokens: int, unit: int = 1,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's queries over its whole prefix, read in chunks of ``chunk_tokens`` positions.

    q: [bs, Hkv, R, D] in the kernel's dtype (a request's ``k * group`` query rows per KV head); k_cache,
    v_cache: [num_slots, Hkv, D]; runs, valid, block_req: a ``DecodeIndex`` over ``[0, prefix_len)``'s
    (``runs``: [nblk, block_size // unit], ``valid``: [nblk, block_size], ``block_req``: [nblk], ``bs`` for unused).
    returns o: [bs, Hkv, R, D] float32, normalised over the prefix (zeros without one), and lse: [bs, Hkv, R]
    float32 (the float32 minimum without a prefix, so the merge gives it no weight).

    Why not ``block_flash.block_attention`` over the blocks: every block then carries a copy of its request's ``k *
    Hq`` query rows and returns as many output rows (a quarter of the K/V bytes at k = 8 with 64-token blocks), and
    the blocks' outputs are concatenated and merged again. A request's blocks are consecutive and, from position 0,
    its valid keys one run of positions; so each chunk is one gather and one unmasked kernel call (the last chunk
    trimmed to the valid length) with the request's queries as they are, merged into a running log-sum-exp.
    Host reads of ``valid``/``block_req`` (CPU tensors in a CPU-only op, as ``decode_flash``), never a sync.
    """
    bs, blocks = q.shape[0], valid.shape
    lens = valid.sum(1).new_zeros(bs + 1).index_add_(0, block_req, valid.sum(1))[:bs].tolist()
    nblocks = torch.bincount(block_req, minlength=bs + 1)[:bs]
    firsts = ((torch.cumsum(nblocks, 0) - nblocks) * blocks[1]).tolist()  # flat position of each request's key 0
    flat = runs.reshape(-1)
    o = q.new_zeros(q.shape, dtype=torch.float32)
    lse = torch.full(q.shape[:3], _LOWEST, dtype=torch.float32, device=q.device)
    for b, (n, start) in enumerate(zip(lens, firsts, strict=True)):
        q_b = q[b:b + 1]
        for c0 in range(0, n, chunk_tokens):
            c1 = min(n, c0 + chunk_tokens)
            r0, r1 = (start + c0) // unit, -(-(start + c1) // unit)  # start and c0 are multiples of unit
            k, v = _gather_kv(k_cache, v_cache, flat[r0:r1], unit, 1, (r1 - r0) * unit, q.dtype, k_scale, v_scale)
            o_c, lse_c = _flash_cpu(q_b, k[:, :, :c1 - c0], v[:, :, :c1 - c0], 0.0, False, scale=scale)
            if c0 == 0:
                o[b], lse[b] = o_c[0], lse_c[0]
                continue
            o[b], lse[b] = merge_two(o[b], lse[b], o_c[0].float(), lse_c[0])
    return o, lse


@torch.library.register_fake(verify_flash)
def _verify_flash_fake(q, k_cache, v_cache, runs, valid, block_req, scale, chunk_tokens, unit=1, k_scale=1.0,
                       v_scale=1.0):
    return q.new_empty(q.shape, dtype=torch.float32), q.new_empty(q.shape[:3], dtype=torch.float32)


def verify_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, draft_len, custom_mask=None,
                     *, mask_layout="draft", scale=None, logit_cap=None, page_size=1, block_size=None,
                     k_scale=None, v_scale=None, cpu_flash=None, sinks=None) -> torch.Tensor:
    """Verify attention in one call: ``plan_verify`` + ``build_verify_index`` + ``verify_blocks``.

    q: [bs * k, Hq, Dqk]; k_cache: [S, Hkv, Dqk]; v_cache: [S, Hkv, Dv] (may be a view of k_cache: MLA);
    req_to_token: [max_reqs, max_context_len]; req_pool_indices, prefix_lens: [bs]; draft_len: k; custom_mask:
    None (chain) or SGLang's flat tree mask in ``mask_layout``. Returns [bs * k, Hq, Dv] in q.dtype.
    """
    validate.check_window_and_cap(None, logit_cap)
    validate.check_scales(k_scale, v_scale)
    meta = plan_verify(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, draft_len, custom_mask,
                       mask_layout=mask_layout, block_size=block_size, page_size=page_size)
    index = build_verify_index(req_to_token, meta.inputs, page_size)
    return verify_blocks(q, k_cache, v_cache, index, _scale(scale, q.shape[2]), logit_cap,
                         v_shares_k=v_is_prefix_of_k(k_cache, v_cache), cpu_flash=cpu_flash, k_scale=k_scale,
                         v_scale=v_scale, sinks=sinks)
