"""Multi-token decode ("verify") for speculative decoding: ``k`` draft tokens per request over its cached prefix.

Request b's ``k`` queries see the whole prefix and, among the draft keys, the chain or SGLang's tree mask. The
prefix is cut into decode's split-KV blocks, each read once for all ``k`` queries (grouped ``[Hkv, k * group, D]``);
the draft keys form one small masked block per request, merged by log-sum-exp. Forms as decode's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import validate
from .api import softmax_scale, v_is_prefix_of_k
from .decode import (
    DecodeIndex,
    SlotMap,
    build_decode_index,
    masked_softmax_parts,
    matmul_partials,
    merge_blocks,
    sinks_by_kv_head,
    translate_slots,
)
from .forms import choose_form, explain
from .kernels.cpu.kernel import bf16_query_scale, native_decode_blocks
from .kernels.triton_form import triton_verify_blocks
from .kv import dequantize, gather_rows, scale_pair
from .plan import DecodeInputs, gather_unit
from .verify_plan import (
    VerifyInputs,
    VerifyMetadata,
    chain_mask,
    draft_mask_from_custom,
    full_mask_numel,
    plan_verify,
    verify_block_size,
    window_start,
)

__all__ = ["VerifyIndex", "VerifyInputs", "VerifyMetadata",
           "build_verify_index", "chain_mask", "draft_mask_from_custom", "full_mask_numel", "plan_verify",
           "verify_attention", "verify_block_size", "verify_blocks", "window_start"]

@dataclass
class VerifyIndex:
    """Per-step index shared by every layer of one window (``build_verify_index``).

    prefix:      the prefix's split-KV blocks (``decode.DecodeIndex`` over ``[lo, prefix_len)``; lo 0 unwindowed)
    draft_slots: [bs_cap, e + k] int64, KV slot of each key of the small masked block: the ``e`` edge keys just
                 below ``lo`` (``k - 1 + unit - 1`` under a window, else none), then the ``k`` draft keys
    draft_mask:  [bs_cap, k, e + k] bool, query ``i`` sees that key
    inputs:      what the index was built from (with a ``slot_map``: over ``prefix.req_to_token``)
    sliding_window: the layer's window it was built for, or None
    """

    prefix: DecodeIndex
    draft_slots: torch.Tensor
    draft_mask: torch.Tensor
    inputs: VerifyInputs | None = None
    sliding_window: int | None = None


def build_verify_index(req_to_token: torch.Tensor, inputs: VerifyInputs, page_size: int = 1, *,
                       host_form: bool = True, sliding_window: int | None = None,
                       slot_map: SlotMap | None = None) -> VerifyIndex:
    """The prefix blocks (``build_decode_index``, ``host_form`` as there) and the masked block's slots; pure tensor
    code. req_to_token: [max_reqs, max_context_len]; inputs: ``plan_verify(...).inputs`` or static buffers.

    sliding_window ``w``: draft token ``i`` (at ``prefix_len + depth_i``) sees keys from ``prefix_len + depth_i - w``
    on. The prefix blocks cover ``[lo, prefix_len)`` (``window_start``), which every token sees; the ``k - 1 + unit
    - 1`` positions below ``lo`` join the masked block under a per-row mask, so the shapes stay static.
    slot_map: every slot translated (``decode.translate_slots``); an edge key no row sees reads the row's first
    draft key, and the Triton form's table holds the translated slots from ``prefix_len - w`` on."""
    rows, prefix, block_ids, block_offsets, mask = inputs
    k = mask.shape[1]
    draft_pos = prefix[:, None] + torch.arange(k, device=prefix.device)  # [bs, k]
    draft_slots = req_to_token[rows[:, None], draft_pos].to(torch.int64)
    lo = torch.zeros_like(prefix)
    if sliding_window is not None:
        unit = gather_unit(page_size, block_offsets.shape[0])
        lo = window_start(prefix, k, sliding_window, unit)
        edge = k - 1 + unit - 1
        edge_pos = lo[:, None] - edge + torch.arange(edge, device=prefix.device)  # [bs, edge], below lo
        draft_slots = torch.cat([req_to_token[rows[:, None], edge_pos.clamp_min(0)].to(torch.int64), draft_slots], 1)
        # one rule for every key of the block: inside the row's window (edge keys: at a real position, >= 0)
        depth = mask.sum(-1) - 1  # [bs, k]: a row sees itself and its ancestors
        key_pos = torch.cat([edge_pos, prefix[:, None] + depth], 1)  # [bs, edge + k]
        seen = torch.cat([(edge_pos >= 0)[:, None, :].expand(-1, k, -1), mask], 2)
        mask = seen & (key_pos[:, None, :] >= (prefix[:, None] + depth - sliding_window)[:, :, None])
    blocks = build_decode_index(req_to_token, DecodeInputs(rows, lo, prefix, block_ids, block_offsets), page_size,
                                host_form=host_form, slot_map=slot_map)
    if slot_map is not None:
        draft_slots = translate_slots(draft_slots, slot_map)
        draft_slots = torch.where(mask.any(1), draft_slots, draft_slots[:, -k:][:, :1])
        width = req_to_token.shape[1] if sliding_window is None else sliding_window + k
        base = torch.zeros_like(prefix) if sliding_window is None else (prefix - sliding_window).clamp_min(0)
        pos = (base[:, None] + torch.arange(width, device=prefix.device)).clamp_max(req_to_token.shape[1] - 1)
        table = translate_slots(req_to_token[rows[:, None], pos].to(torch.int64), slot_map)
        blocks.req_to_token = table.to(torch.int32)
        inputs = inputs._replace(req_rows=torch.arange(rows.shape[0], device=rows.device), prefix_lens=prefix - base)
        blocks.inputs = DecodeInputs(inputs.req_rows, lo - base, prefix - base, block_ids, block_offsets)
    return VerifyIndex(prefix=blocks, draft_slots=draft_slots, draft_mask=mask, inputs=inputs,
                       sliding_window=sliding_window)


def verify_blocks(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index: VerifyIndex,
    scale: float,
    logit_cap: float | None = None,
    *,
    v_shares_k: bool = False,
    k_scale: float | None = None,
    v_scale: float | None = None,
    sinks: torch.Tensor | None = None,
    form: str | None = "auto",
) -> torch.Tensor:
    """Attention of ``k`` queries per request over its prefix blocks and its draft block.

    q: [bs * k, Hq, Dqk] (bs: the index's batch capacity); caches, ``v_shares_k``, scales, sinks and ``form``: as
    ``decode.decode_blocks``'. Returns [bs * k, Hq, Dv] in q.dtype; softmax and accumulation in float32.
    """
    bs, k = index.draft_mask.shape[:2]
    hq, hkv, dv = q.shape[1], k_cache.shape[1], v_cache.shape[2]
    if not torch.compiler.is_compiling():
        validate.check_positive_number("scale", scale)
        validate.check_index_rows(q, bs, k)
    if bs == 0:
        return q.new_zeros(0, hq, dv)
    rows = k * hq // hkv
    choice = choose_form("verify", q, k_cache, v_cache, rows_per_kv_head=rows, form=form)
    explain("verify_blocks", choice, q, k_cache, v_cache, rows)
    if choice.form == "triton":  # prefix and draft keys in one kernel
        return triton_verify_blocks(q, k_cache, v_cache, index, scale, logit_cap, *scale_pair(k_scale, v_scale),
                                    sinks)
    # a request's k queries share its KV head's blocks: grouped [bs, Hkv, k * group, D], row i * group + g draft
    # token i's head g, whose sink is head g's, tiled over the k tokens
    row_sinks = None if sinks is None else sinks_by_kv_head(sinks, hkv, hq).repeat(1, k)  # [Hkv, k * group]
    if choice.form == "kernel":  # the prefix blocks and the draft block, merged, in one call of the kernel
        p = index.prefix
        ks, vs = scale_pair(k_scale, v_scale)  # the softmax scale rides on K's
        return native_decode_blocks(q, p.block_req, p.slots, p.valid, k_cache, v_cache, ks * scale, vs,
                                    logit_cap or 0.0, bs, row_sinks, bf16_query_scale(q, k_cache, 1.0),
                                    index.draft_slots, index.draft_mask, k, path=choice.path)
    qg = q.view(bs, k, hkv, hq // hkv, q.shape[2]).transpose(1, 2).reshape(bs, hkv, -1, q.shape[2])
    dm, dl, do = _draft_block(qg, k_cache, v_cache, index, scale, logit_cap, v_shares_k, k_scale, v_scale)
    m, lsum, o = matmul_partials(qg, k_cache, v_cache, index.prefix, scale, logit_cap, v_shares_k, k_scale, v_scale)
    rows = torch.arange(bs, device=q.device)
    out = merge_blocks(torch.cat([m, dm]), torch.cat([lsum, dl]), torch.cat([o, do]),
                       torch.cat([index.prefix.block_req, rows]), bs, row_sinks)  # [bs, Hkv, k*group, Dv]
    return out.view(bs, hkv, k, hq // hkv, dv).transpose(1, 2).reshape(bs * k, hq, dv).to(q.dtype)


def _draft_block(qg, k_cache, v_cache, index: VerifyIndex, scale, logit_cap, v_shares_k, k_scale, v_scale):
    """Each request's ``k`` queries over its masked block (a window's edge keys, then the draft keys) -> (m, lsum, o)
    of shapes [bs, Hkv, k * group(, Dv)], o unnormalised, float32."""
    bs, hkv, rows, dqk = qg.shape
    k, nk, dv = index.draft_mask.shape[1], index.draft_mask.shape[2], v_cache.shape[2]
    slots = index.draft_slots

    def gather(cache, d):  # -> [bs, Hkv, nk, d]
        return gather_rows(cache, slots.reshape(-1)).view(bs, nk, hkv, d).transpose(1, 2)

    kd = dequantize(gather(k_cache, dqk), torch.float32, k_scale)
    if v_shares_k and (v_scale or 1.0) == (k_scale or 1.0):
        vd = kd[..., :dv]
    else:
        vd = dequantize(gather(v_cache, dv), torch.float32, v_scale)
    s = torch.matmul(qg.float() * scale, kd.transpose(-1, -2))  # [bs, Hkv, k * group, nk]
    # query row (i, g) of the grouped layout takes mask row i
    mask = index.draft_mask[:, None, :, None, :].expand(bs, 1, k, rows // k, nk).reshape(bs, 1, rows, nk)
    m, p = masked_softmax_parts(s, mask, logit_cap)
    return m, p.sum(-1), torch.matmul(p, vd)


def verify_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, draft_len, custom_mask=None,
                     *, mask_layout="draft", scale=None, logit_cap=None, page_size=1, block_size=None,
                     k_scale=None, v_scale=None, sinks=None, sliding_window=None, form="auto") -> torch.Tensor:
    """Verify attention in one call: ``plan_verify`` + ``build_verify_index`` + ``verify_blocks``.

    Arguments as ``plan_verify``'s and ``api.decode_attention``'s (sliding_window: each draft token's window as a
    decode query's, from its own position). Returns [bs * k, Hq, Dv] in q.dtype.
    """
    validate.check_window_and_cap(sliding_window, logit_cap)
    validate.check_scales(k_scale, v_scale)
    meta = plan_verify(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, draft_len, custom_mask,
                       mask_layout=mask_layout, block_size=block_size, page_size=page_size,
                       sliding_window=sliding_window)
    index = build_verify_index(req_to_token, meta.inputs, page_size, sliding_window=sliding_window)
    return verify_blocks(q, k_cache, v_cache, index, softmax_scale(scale, q.shape[2]), logit_cap,
                         v_shares_k=v_is_prefix_of_k(k_cache, v_cache), k_scale=k_scale, v_scale=v_scale,
                         sinks=sinks, form=form)
