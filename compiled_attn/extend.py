"""Ragged tiled extend (prefill): work follows sum(q_len x visible keys), not bs x max(q_len) x max(kv_len).

``plan_extend_tiles`` (host, once per batch) keeps the (query tile, key tile) pairs the mask leaves non-empty,
padded to a bucket; ``build_extend_tile_index`` (per step) looks up slots and masks; ``extend_tiles`` (per layer)
runs the ``kernel`` or ``matmul`` form (``forms.choose_extend_form``), partials merged by log-sum-exp.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .decode import SlotMap, merge_blocks, sinks_by_kv_head, translate_slots
from .forms import choose_extend_form, explain
from .kernels.cpu.extend_flash import ragged_tile_flash, run_on_threads, span_keys_for
from .kv import dequantize, gather_rows, scale_pair
from .plan import ExtendMetadata, cdiv, fields_of

#: scores + probabilities of one matmul chunk stay near this many bytes (bounds memory, never [bs, L, L])
MATMUL_CHUNK_BYTES = 32 << 20


class ExtendTileInputs(NamedTuple):
    """The per-step tensors of a tiled extend batch, padded to ``pair_capacity`` pairs; all [P] int64 unless said.

    pair_row:    request row in req_to_token
    kv_start:    position (in the req_to_token row) of the pair's first key
    k_count:     keys in the key tile (< TK only for a range's last tile; 0 for padded pairs)
    q_start:     index of the pair's first query in the packed q (``num_tokens`` for padded pairs)
    q_count:     queries in the query tile (0 for padded pairs)
    q_rel:       position of the first query minus position of the first key (causal: key c visible to query a
                 iff ``c <= q_rel + a``; window: iff ``c >= q_rel + a - W``)
    full:        [P] bool, every (query, key) of the pair is visible: no mask needed
    q_ids:       [TQ] arange, k_ids: [TK] arange (tile sizes as shape carriers)
    """

    pair_row: torch.Tensor
    kv_start: torch.Tensor
    k_count: torch.Tensor
    q_start: torch.Tensor
    q_count: torch.Tensor
    q_rel: torch.Tensor
    full: torch.Tensor
    q_ids: torch.Tensor
    k_ids: torch.Tensor

    of = classmethod(fields_of)


#: the [P] fields of ``ExtendTileInputs`` (the other two are the tile-size aranges)
PAIR_FIELDS = ExtendTileInputs._fields[:7]


def pad_pairs(inputs: ExtendTileInputs, capacity: int, num_tokens: int) -> ExtendTileInputs:
    """The pair list padded to ``capacity`` pairs: padded pairs have no query, no key, and ``q_start`` past q."""
    n = inputs.pair_row.shape[0]
    if capacity == n:
        return inputs

    def pad(t: torch.Tensor, fill: int) -> torch.Tensor:
        out = t.new_full((capacity,), fill)
        out[:n] = t
        return out

    return inputs._replace(**{name: pad(getattr(inputs, name), num_tokens if name == "q_start" else 0)
                              for name in PAIR_FIELDS})


@dataclass
class ExtendTilePlan:
    """A planned tiled extend batch: its step inputs and what the host knows about it.

    causal, sliding_window: static per-layer settings
    num_tokens, pairs_needed: packed query count, real pairs (<= P)
    useful_qk, computed_qk: visible (query, key) pairs; (query, key) pairs inside the kept tiles
    """

    inputs: ExtendTileInputs
    causal: bool
    sliding_window: int | None
    num_tokens: int
    pairs_needed: int
    useful_qk: int
    computed_qk: int


def _ragged(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n] int64 counts -> (group, rank), each [sum(counts)]: item i is the rank[i]-th of group group[i]."""
    group = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
    return group, torch.arange(group.shape[0]) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)


def _visible_range(p: torch.Tensor, kv_len: torch.Tensor, causal: bool, window: int | None):
    """Keys ``[lo, hi]`` visible to a query at relative position ``p`` (hi < lo when none). All [n] int64."""
    hi = torch.minimum(p, kv_len - 1) if causal else kv_len - 1
    lo = (p - window).clamp_min(0) if window is not None else torch.zeros_like(p)
    return lo, hi


def plan_extend_tiles(meta: ExtendMetadata, *, tile_q: int = 64, tile_k: int = 64,
                      pair_capacity: int | None = None) -> ExtendTilePlan:
    """Host-side pair list of an extend batch planned by ``plan.plan_extend``; padded requests have no tiles.
    ``pair_capacity``: the bucket (default: the pairs needed, at least 1); ``ValueError`` when the batch needs more.
    """
    i = meta.inputs
    with run_on_threads(1):  # tiny tensors: as parallel regions they stalled on a descheduled thread
        return _plan_extend_tiles(i.req_rows, i.kv_lo, i.kv_len, i.q_first, i.q_len, i.q_offsets, meta.num_tokens,
                                  meta.causal, meta.sliding_window, tile_q, tile_k, pair_capacity)


def _plan_extend_tiles(req_rows, kv_lo, kv_len, q_first, q_len, q_offsets, num_tokens, causal, sliding_window,
                       tile_q, tile_k, pair_capacity) -> ExtendTilePlan:
    dev = req_rows.device
    req_rows, kv_lo, kv_len, q_first, q_len, q_offsets = (
        t.detach().to("cpu", torch.int64) for t in (req_rows, kv_lo, kv_len, q_first, q_len, q_offsets))
    window = sliding_window  # plan_extend normalised it (SGLang's -1 is None there)
    tile_req, tile_idx = _ragged(cdiv(q_len, tile_q))  # query tiles, flat over the batch
    i0 = tile_idx * tile_q
    qc = torch.minimum(q_len[tile_req] - i0, torch.tensor(tile_q))
    pmin = q_first[tile_req] + i0
    pmax = pmin + qc - 1
    length = kv_len[tile_req]
    # the keys any query of the tile sees form one range: [lo of the first query, hi of the last]
    lo, _ = _visible_range(pmin, length, causal, window)
    _, hi = _visible_range(pmax, length, causal, window)
    u_lo, u_hi = lo // tile_k, hi // tile_k
    pair_tile, pair_idx = _ragged(torch.where(hi >= lo, u_hi - u_lo + 1, 0))
    u = u_lo[pair_tile] + pair_idx
    req = tile_req[pair_tile]
    k0 = u * tile_k
    kc = torch.minimum(kv_len[req] - k0, torch.tensor(tile_k))
    p_lo, p_hi = pmin[pair_tile], pmax[pair_tile]
    full = torch.ones_like(k0, dtype=torch.bool)
    if causal:  # the tile's last key is visible to its first query
        full &= k0 + kc - 1 <= p_lo
    if window is not None:  # the tile's first key is inside its last query's window
        full &= k0 >= p_hi - window
    needed = int(pair_tile.shape[0])
    cap = max(needed, 1) if pair_capacity is None else pair_capacity
    if cap < needed:
        raise ValueError(f"pair_capacity={cap} is smaller than this batch needs ({needed})")
    # useful work: every real query's visible keys
    q_req, q_idx = _ragged(q_len)
    p = q_first[q_req] + q_idx
    vlo, vhi = _visible_range(p, kv_len[q_req], causal, window)

    inputs = ExtendTileInputs(
        pair_row=req_rows[req], kv_start=kv_lo[req] + k0, k_count=kc, q_start=q_offsets[req] + i0[pair_tile],
        q_count=qc[pair_tile], q_rel=p_lo - k0, full=full, q_ids=torch.arange(tile_q), k_ids=torch.arange(tile_k))
    inputs = ExtendTileInputs(*(t.to(dev) for t in pad_pairs(inputs, cap, num_tokens)))
    return ExtendTilePlan(
        inputs, causal=causal, sliding_window=window, num_tokens=num_tokens, pairs_needed=needed,
        useful_qk=int((vhi - vlo + 1).clamp_min(0).sum()), computed_qk=int((qc[pair_tile] * kc).sum()))


@dataclass
class ExtendTileIndex:
    """Per-step pair tables shared by every layer (``build_extend_tile_index``); P pairs, TQ x TK tiles.

    slots:   [P, TK] int64, KV slot of each key (slot 0 where invalid); k_valid: [P, TK] bool
    q_rows:  [P, TQ] int64, packed query row of each tile row (-1 where invalid)
    mask:    [P, TQ, TK] bool, query row sees key (False for invalid rows and keys); None for the CPU form
    q_start, q_count, k_count, q_rel: [P] int64; full: [P] bool (from the plan, for the CPU form)
    causal, sliding_window: the static settings the index was built for
    """

    slots: torch.Tensor
    k_valid: torch.Tensor
    q_rows: torch.Tensor
    mask: torch.Tensor | None
    q_start: torch.Tensor
    q_count: torch.Tensor
    k_count: torch.Tensor
    full: torch.Tensor
    q_rel: torch.Tensor
    causal: bool
    sliding_window: int | None


def build_extend_tile_index(req_to_token: torch.Tensor, inputs: ExtendTileInputs, *, causal: bool,
                            sliding_window: int | None, with_mask: bool = True,
                            slot_map: SlotMap | None = None) -> ExtendTileIndex:
    """Pure tensor code. req_to_token: [max_reqs, max_context_len] int32; inputs: ``plan_extend_tiles(...).inputs``.
    with_mask: build the [P, TQ, TK] mask the matmul form needs (the kernel form does without).
    slot_map: the key slots translated (``decode.translate_slots``).
    """
    pair_row, kv_start, k_count, q_start, q_count, q_rel, full, q_ids, k_ids = inputs
    k_valid = k_ids[None, :] < k_count[:, None]  # [P, TK]
    pos = torch.where(k_valid, kv_start[:, None] + k_ids[None, :], 0)
    slots = translate_slots(req_to_token[pair_row[:, None], pos].to(torch.int64), slot_map)
    slots = torch.where(k_valid, slots, 0)
    q_valid = q_ids[None, :] < q_count[:, None]  # [P, TQ]
    q_rows = torch.where(q_valid, q_start[:, None] + q_ids[None, :], -1)
    mask = None
    if with_mask:
        qpos = (q_rel[:, None] + q_ids[None, :])[:, :, None]  # [P, TQ, 1], key tile coordinates
        mask = q_valid[:, :, None] & k_valid[:, None, :]  # compared against qpos, never a [P, TQ, TK] int64
        if causal:
            mask = mask & (k_ids <= qpos)
        if sliding_window is not None:
            mask = mask & (k_ids >= qpos - sliding_window)
    return ExtendTileIndex(slots, k_valid, q_rows, mask, q_start, q_count, k_count, full, q_rel, causal,
                           sliding_window)


def extend_tiles(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: ExtendTileIndex,
                 scale: float, logit_cap: float | None = None, *, form: str | None = "auto",
                 span_keys: int | None = None, k_scale: float | None = None,
                 v_scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [num_tokens, Hq, Dqk]; k_cache: [S, Hkv, Dqk]; v_cache: [S, Hkv, Dv] -> [num_tokens, Hq, Dv] in q.dtype.

    Caches, scales and sinks as in ``decode.decode_blocks``. form: "auto" (or None), "kernel" or "matmul"
    (``forms.choose_extend_form``). span_keys: keys per kernel call (default about ``extend_flash.SPAN_BYTES`` of K).
    """
    t, hq, _ = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    if t == 0:  # nothing to gather from an empty q
        return q.new_zeros(0, hq, dv)
    sinks = sinks_by_kv_head(sinks, hkv, hq)
    choice = choose_extend_form(q, k_cache, v_cache, logit_cap, form)
    explain("extend_tiles", choice, q, k_cache, v_cache, hq // hkv)
    if choice.form == "kernel":
        span_keys = span_keys_for(hkv, q.shape[2]) if span_keys is None else span_keys
        out = ragged_tile_flash(q, k_cache, v_cache, index.slots, index.q_start, index.q_count, index.k_count,
                                index.full, index.q_rel, scale, span_keys, index.causal,
                                -1 if index.sliding_window is None else index.sliding_window,
                                *scale_pair(k_scale, v_scale), sinks)
        return out.view(t, hq, dv).to(q.dtype)
    if index.mask is None:
        raise ValueError("the matmul form needs an index built with with_mask=True")
    return _extend_matmul(q, k_cache, v_cache, index, scale, logit_cap, k_scale, v_scale, sinks)


def _extend_matmul(q, k_cache, v_cache, index: ExtendTileIndex, scale: float, logit_cap: float | None,
                   k_scale: float | None = None, v_scale: float | None = None, sinks: torch.Tensor | None = None):
    """The matmul form: static chunks of pairs, float32 softmax per pair, merge by log-sum-exp over tokens."""
    t, hq, dqk = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    group = hq // hkv
    p_cap, tk = index.slots.shape
    tq = index.q_rows.shape[1]
    chunk = max(1, MATMUL_CHUNK_BYTES // (hq * tq * tk * 8))
    lowest = torch.finfo(torch.float32).min
    ms, ls, os_ = [], [], []
    for s0 in range(0, p_cap, chunk):  # static bounds: the pair capacity is a shape
        rows = index.q_rows[s0:s0 + chunk]
        c = rows.shape[0]
        qg = q.index_select(0, rows.clamp_min(0).reshape(-1)).view(c, tq, hkv, group, dqk)
        qg = qg.permute(0, 2, 3, 1, 4).reshape(c, hkv, group * tq, dqk).float() * scale
        kv_ok = index.k_valid[s0:s0 + chunk].reshape(-1, 1, 1)
        flat = index.slots[s0:s0 + chunk].reshape(-1)
        # select, never multiply: a zeroed row stays finite whatever the padding slot holds
        k = torch.where(kv_ok, dequantize(gather_rows(k_cache, flat), torch.float32, k_scale), 0.0)
        v = torch.where(kv_ok, dequantize(gather_rows(v_cache, flat), torch.float32, v_scale), 0.0)
        k, v = k.view(c, tk, hkv, dqk), v.view(c, tk, hkv, dv)
        s = torch.matmul(qg, k.permute(0, 2, 3, 1))  # [c, Hkv, group * TQ, TK]
        if logit_cap is not None:
            s = logit_cap * torch.tanh(s / logit_cap)
        vis = index.mask[s0:s0 + chunk][:, None, None]  # [c, 1, 1, TQ, TK]
        s = torch.where(vis, s.view(c, hkv, group, tq, tk), lowest)
        m = s.amax(-1)  # [c, Hkv, group, TQ]; lowest for a row with no key here
        p = torch.where(vis, torch.exp(s - m[..., None]), 0.0)
        o = torch.matmul(p.view(c, hkv, group * tq, tk), v.transpose(1, 2))  # [c, Hkv, group * TQ, Dv]
        ms.append(m.permute(0, 3, 1, 2))
        ls.append(p.sum(-1).permute(0, 3, 1, 2))
        os_.append(o.view(c, hkv, group, tq, dv).permute(0, 3, 1, 2, 4))
    m = torch.cat(ms).reshape(p_cap * tq, hkv, group)
    l_ = torch.cat(ls).reshape(p_cap * tq, hkv, group)
    o = torch.cat(os_).reshape(p_cap * tq, hkv, group, dv)
    target = torch.where(index.q_rows >= 0, index.q_rows, t).reshape(-1)  # invalid rows -> the discard row
    return merge_blocks(m, l_, o, target, t, sinks).reshape(t, hq, dv).to(q.dtype)


def default_tile_q(form: str) -> int:
    """Query tile rows per form: the kernel 256 (reaches ATen's large query block; its causal diagonal skips the
    masked half), the matmul form 64 (it computes every (query, key) of a kept tile, masked ones included)."""
    return 256 if form == "kernel" else 64


def extend_tiled(q, k_cache, v_cache, req_to_token, meta: ExtendMetadata, scale: float,
                 logit_cap: float | None = None, *, tile_q: int | None = None, tile_k: int = 64,
                 pair_capacity: int | None = None, form: str | None = "auto", k_scale: float | None = None,
                 v_scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plan the tiles, build the index and run one layer (``api.extend_attention``). -> [num_tokens, Hq, Dv]."""
    form = choose_extend_form(q, k_cache, v_cache, logit_cap, form).form
    index = tile_index(req_to_token, meta, form, tile_q=tile_q, tile_k=tile_k, pair_capacity=pair_capacity)
    return extend_tiles(q, k_cache, v_cache, index, scale, logit_cap, form=form, k_scale=k_scale, v_scale=v_scale,
                        sinks=sinks)


def tile_index(req_to_token: torch.Tensor, meta: ExtendMetadata, form: str, *, tile_q: int | None = None,
               tile_k: int = 64, pair_capacity: int | None = None, slot_map: SlotMap | None = None) -> ExtendTileIndex:
    """Eager, once per step: plan the tiles and build the index the layers share, for ``form`` ("kernel" or
    "matmul"; ``tile_q`` defaults to ``default_tile_q(form)``); slot_map: as ``build_extend_tile_index``'s."""
    tiles = plan_extend_tiles(meta, tile_q=tile_q or default_tile_q(form), tile_k=tile_k,
                              pair_capacity=pair_capacity)
    return build_extend_tile_index(req_to_token, tiles.inputs, causal=tiles.causal,
                                   sliding_window=tiles.sliding_window, with_mask=form != "kernel",
                                   slot_map=slot_map)
