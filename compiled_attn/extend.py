"""Extend (prefill) attention: requests padded to ``[q_cap, kv_cap]``, one batched call with a boolean mask.

One batched SDPA call replaces the per-request loop's calls. SDPA's fused CPU kernel needs
``Dqk == Dv``, so a smaller V (MLA 192/128, 576/512) is zero-padded to ``Dqk`` and the output sliced back: the
extra columns cost less than falling to the math path, which repeats K/V per head group. Soft-capped logits
(``logit_cap``) have no SDPA form and use an explicit float32 softmax, chunked over queries to bound memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import validate
from .metadata import ExtendInputs


@dataclass
class ExtendIndex:
    """Per-step gather/scatter tables shared by every layer (built by ``build_extend_index``).

    q_gather: [bs, q_cap] int64, packed query row of each padded query (0 where padding)
    slots:    [bs, kv_cap] int64, KV slot of each padded key (slot 0 where padding)
    mask:     [bs, 1, q_cap, kv_cap] bool, key visible to query; every row has at least one True
    has_keys: [bs, q_cap, 1] float32, 0 for queries that see no real key (their output must be zeros)
    out_gather: [num_tokens] int64, padded position ``b * q_cap + i`` of each packed query
    """

    q_gather: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor
    has_keys: torch.Tensor
    out_gather: torch.Tensor


def build_extend_index(req_to_token: torch.Tensor, inputs: ExtendInputs, *, causal: bool,
                       sliding_window: int | None) -> ExtendIndex:
    """Pure tensor code. req_to_token: [max_reqs, max_context_len] int32; inputs: ``plan_extend(...).inputs``."""
    req_rows, kv_lo, kv_len, q_first, q_len, q_offsets, q_ids, kv_ids, token_ids = inputs
    q_cap = q_ids.shape[0]
    q_valid = q_ids[None, :] < q_len[:, None]  # [bs, q_cap]
    q_gather = torch.where(q_valid, q_offsets[:, None] + q_ids[None, :], 0)
    kv_valid = kv_ids[None, :] < kv_len[:, None]  # [bs, kv_cap]
    has_kv = kv_len > 0
    # a padding key gathers the request's first key, a slot it owns, never slot 0 or another unowned slot: a NaN
    # there (SGLang's padding writes, a fresh pool) survives the mask (-inf + NaN, 0 * NaN). A request with no key
    # at all reads the padding slot; its rows are zeroed by selection in extend_padded
    first = torch.where(has_kv, kv_lo, 0)[:, None]
    pos = torch.where(kv_valid, kv_lo[:, None] + kv_ids[None, :], first)
    slots = torch.where(has_kv[:, None], req_to_token[req_rows[:, None], pos].to(torch.int64), 0)
    qpos = (q_first[:, None] + q_ids[None, :])[:, :, None]  # [bs, q_cap, 1]
    kpos = kv_ids[None, None, :]
    mask = kv_valid[:, None, :].expand(-1, q_cap, -1)
    if causal:
        mask = mask & (kpos <= qpos)
    if sliding_window is not None:
        mask = mask & (kpos >= qpos - sliding_window)
    has_keys = mask.any(-1, keepdim=True)
    # rows with no visible key see key 0 so the softmax stays finite; has_keys zeroes them afterwards
    mask = mask | (~has_keys & (kpos == 0))
    # packed token t belongs to the last request whose offset is <= t
    req_of_token = torch.searchsorted(q_offsets, token_ids, right=True) - 1
    out_gather = req_of_token * q_cap + (token_ids - q_offsets[req_of_token])
    return ExtendIndex(q_gather, slots, mask[:, None], (has_keys & q_valid[:, :, None]).float(), out_gather)


def _softmax_attend(q, k, v, mask, scale, logit_cap, q_chunk: int = 256):
    """Explicit attention with soft-capped logits, float32 softmax, GQA without expanding K/V.

    q: [bs, Hq, Lq, D]; k: [bs, Hkv, Lk, D]; v: [bs, Hkv, Lk, Dv]; mask: [bs, 1, Lq, Lk] -> [bs, Hq, Lq, Dv]
    """
    bs, hq, lq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    kt = k.float().transpose(-1, -2)[:, :, None]  # [bs, Hkv, 1, D, Lk]
    vf = v.float()[:, :, None]
    outs = []
    for start in range(0, lq, q_chunk):  # static chunks: bounds the [.., Lq, Lk] score memory
        qc = q[:, :, start:start + q_chunk].float().reshape(bs, hkv, group, -1, d)
        s = torch.matmul(qc * scale, kt)
        s = logit_cap * torch.tanh(s / logit_cap)
        s = s.masked_fill(~mask[:, :, None, start:start + q_chunk], float("-inf"))
        outs.append(torch.matmul(torch.softmax(s, dim=-1), vf).reshape(bs, hq, -1, v.shape[-1]))
    return torch.cat(outs, dim=2)


def extend_padded(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index: ExtendIndex,
    scale: float,
    logit_cap: float | None = None,
) -> torch.Tensor:
    """q: [num_tokens, Hq, Dqk]; k_cache: [S, Hkv, Dqk]; v_cache: [S, Hkv, Dv] -> [num_tokens, Hq, Dv] in q.dtype."""
    hq, dqk = q.shape[1], q.shape[2]
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    if not torch.compiler.is_compiling():  # a Python number: checked at trace time, free at replay
        validate.check_positive_number("scale", scale)
    bs, q_cap = index.q_gather.shape
    kv_cap = index.slots.shape[1]
    flat = index.slots.reshape(-1)
    qp = q.index_select(0, index.q_gather.reshape(-1)).view(bs, q_cap, hq, dqk).transpose(1, 2)
    k = k_cache.index_select(0, flat).view(bs, kv_cap, hkv, dqk).transpose(1, 2)
    v = v_cache.index_select(0, flat).view(bs, kv_cap, hkv, dv).transpose(1, 2)
    if logit_cap is not None:
        o = _softmax_attend(qp, k, v, index.mask, scale, logit_cap)
    else:
        width = max(dqk, dv)
        if dqk < width:  # zero columns leave q.k unchanged
            qp, k = F.pad(qp, (0, width - dqk)), F.pad(k, (0, width - dqk))
        if dv < width:
            v = F.pad(v, (0, width - dv))
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=index.mask, scale=scale,
                                           enable_gqa=True)[..., :dv]  # a no-op when Hq == Hkv; a bool, never a
        # symbolic one from dynamic shapes, which SDPA rejects
    # select, not multiply: a query with no key attended over the padding slot, whose content may be NaN
    o = torch.where(index.has_keys[..., None] > 0, o.transpose(1, 2), 0.0)  # [bs, q_cap, Hq, Dv]
    return o.reshape(bs * q_cap, hq, dv).index_select(0, index.out_gather).to(q.dtype)
