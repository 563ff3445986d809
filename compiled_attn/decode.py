"""Decode attention (one query token per request) over the paged KV cache, as split-KV blocks.

Each request's KV range is cut into fixed-size blocks, each computes a partial softmax, and a request's blocks are
merged by log-sum-exp (flash-decoding; docs/design.md). ``forms.choose_form`` picks the form: the C++ kernel on CPU,
Triton on CUDA, else the matmul form below. Pure tensor code: no ``.item()``, no host sync, no value branch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from . import validate
from .compile_policy import opaque_op
from .forms import choose_form, explain
from .kernels.cpu.kernel import bf16_query_scale, native_decode_blocks
from .kernels.triton_form import triton_decode_blocks
from .kv import dequantize, gather_rows, scale_pair
from .plan import DecodeInputs, aligned_kv_lo, cdiv, decode_blocks_needed, gather_unit

__all__ = ["DecodeIndex", "SlotMap", "build_decode_index", "decode_blocks", "matmul_partials", "masked_softmax_parts",
           "merge_blocks", "sinks_by_kv_head", "translate_slots"]


@dataclass
class DecodeIndex:
    """Per-step block table shared by every layer (``build_decode_index``); read only.

    block_req: [num_blocks] int64, the batch row each block belongs to (``num_rows`` for unused blocks)
    slots:     [num_blocks, block_size] int64, KV slot of each block position; where invalid, the block's first
               slot (a slot its own request owns), and 0 in an unused block
    valid:     [num_blocks, block_size] bool, position lies inside its request's range
    req_to_token, inputs: what the index was built from, for the Triton kernel (None in one built by hand)
    """

    block_req: torch.Tensor
    slots: torch.Tensor
    valid: torch.Tensor
    req_to_token: torch.Tensor | None = field(default=None, repr=False, compare=False)
    inputs: DecodeInputs | None = field(default=None, repr=False, compare=False)

    @property
    def block_size(self) -> int:
        return self.slots.shape[1]


class SlotMap(NamedTuple):
    """A slot translation: a layer's caches are indexed by ``table[slot]`` of the slots ``req_to_token`` holds
    (SGLang's hybrid sliding-window pool, ``SWAKVPool.full_to_swa_index_mapping``). num_slots: the caches' rows."""

    table: torch.Tensor
    num_slots: int


def translate_slots(slots: torch.Tensor, slot_map: SlotMap | None) -> torch.Tensor:
    """``slots`` (int64, any shape) through ``slot_map`` (None: as they are). Both lookups are clamped, so no entry
    reads outside the caches (SGLang's table ends with a -1 sentinel)."""
    if slot_map is None:
        return slots
    table, num_slots = slot_map
    return table[slots.clamp(0, table.shape[0] - 1)].to(torch.int64).clamp(0, num_slots - 1)


def build_decode_index(req_to_token: torch.Tensor, inputs: DecodeInputs, page_size: int = 1, *,
                       host_form: bool = True, slot_map: SlotMap | None = None) -> DecodeIndex:
    """Cut each request's KV range ``[kv_lo, kv_hi)`` into blocks and look up their slots.

    req_to_token: [max_reqs, max_context_len] int32; inputs: ``DecodeInputs`` (``plan_decode(...).inputs`` or a
    captured step's static buffers; ``block_ids``' length is the block capacity). page_size: as planned.
    host_form: index an eager batch of one on CPU on the host (``_single_request_index``); False: tensor code.
    slot_map: the slots translated (``translate_slots``); the index's ``req_to_token`` and ``inputs`` are then a
    table of translated slots (the block slots as one row), which the Triton form reads.
    """
    unit = gather_unit(page_size, inputs.block_offsets.shape[0])
    if host_form and inputs.req_rows.shape[0] == 1 and req_to_token.is_cpu and not torch.compiler.is_compiling():
        return _single_request_index(req_to_token, inputs, unit, slot_map)
    return _batched_index(req_to_token, inputs, unit, slot_map)


def _batched_index(req_to_token: torch.Tensor, inputs: DecodeInputs, unit: int,
                   slot_map: SlotMap | None = None) -> DecodeIndex:
    """``build_decode_index`` as pure tensor code (any batch, any device, traceable)."""
    req_rows, kv_lo, kv_hi, block_ids, block_offsets = inputs
    bs = req_rows.shape[0]
    block_size = block_offsets.shape[0]
    blocks_per_req = decode_blocks_needed(kv_lo, kv_hi, block_size, unit)  # [bs] (unit is its own gather unit)
    kv_start = aligned_kv_lo(kv_lo, unit)
    ends = torch.cumsum(blocks_per_req, 0)  # [bs]
    firsts = ends - blocks_per_req
    # block j belongs to the first request whose end exceeds j; blocks past the total map to row `bs`
    block_req = torch.searchsorted(ends, block_ids, right=True)  # [num_blocks] in [0, bs]
    req = block_req.clamp_max(bs - 1)
    used = block_req < bs
    start = kv_start[req] + (block_ids - firsts[req]) * block_size  # [num_blocks]
    pos = start[:, None] + block_offsets[None, :]  # [num_blocks, block_size]
    valid = used[:, None] & (pos < kv_hi[req][:, None])
    if unit > 1:  # the first block starts at a page boundary: positions before kv_lo are masked
        valid &= pos >= kv_lo[req][:, None]
    # A masked position gathers its block's first key, never a slot no request owns (padding or uninitialised
    # memory): a NaN gathered there survives any mask that multiplies or adds. Unused blocks read the padding slot.
    pos = torch.where(valid, pos, torch.where(used, start, 0)[:, None])
    slots = translate_slots(req_to_token[req_rows[req][:, None], pos].to(torch.int64), slot_map)
    slots = torch.where(used[:, None], slots, 0)
    if slot_map is not None:  # a request's positions lie in its blocks in order: the block slots as one table row
        shift, width = firsts * block_size - kv_start, slots.numel()
        inputs = inputs._replace(req_rows=torch.zeros_like(req_rows), kv_lo=(kv_lo + shift).clamp(0, width),
                                 kv_hi=(kv_hi + shift).clamp(0, width))
        req_to_token = slots.reshape(1, -1).to(torch.int32)
    return DecodeIndex(block_req=block_req, slots=slots, valid=valid, req_to_token=req_to_token, inputs=inputs)


def _single_request_index(req_to_token: torch.Tensor, inputs: DecodeInputs, unit: int,
                          slot_map: SlotMap | None = None) -> DecodeIndex:
    """``build_decode_index`` of a batch of one on CPU, eagerly, in numpy; equal field by field to the general form.
    Why: the general form's ~25 torch ops cost as much as a short request's attention at batch 1."""
    req_rows, kv_lo, kv_hi, block_ids, block_offsets = inputs
    block_size, capacity = block_offsets.shape[0], block_ids.shape[0]
    row, lo, hi = req_rows.item(), kv_lo.item(), kv_hi.item()
    table = validate.host_row(req_to_token, row, 0, req_to_token.shape[1])
    if table is None or lo < 0 or hi > table.shape[0]:  # the general form names the error
        return _batched_index(req_to_token, inputs, unit, slot_map)
    start = lo - lo % unit
    nblk = min(cdiv(hi - start, block_size), capacity) if hi > lo else 0
    n = nblk * block_size
    first, end = lo - start, min(hi - start, n)  # the request's keys: positions [first, end) of its blocks
    raw = table[start:start + n]  # shorter than n where the last block runs past the table's width
    if slot_map is not None:
        raw = translate_slots(torch.from_numpy(raw).long(), slot_map).numpy()
    if raw.shape[0] == capacity * block_size:  # every block used, all inside the table
        slots = raw.astype(np.int64)
    else:
        slots = np.zeros(capacity * block_size, dtype=np.int64)  # unused blocks read the padding slot
        slots[:raw.shape[0]] = raw
    # masked positions read their block's first slot (the request's own), as in the general form
    if first > 1 and n:
        slots[1:first] = slots[0]
    if end < n:
        slots[end:n] = slots[n - block_size]
    valid = np.zeros(capacity * block_size, dtype=np.bool_)
    valid[first:end] = True
    slots = slots.reshape(capacity, block_size)
    index = DecodeIndex(block_req=_block_rows(nblk, capacity), slots=torch.from_numpy(slots),
                        valid=torch.from_numpy(valid.reshape(capacity, block_size)), req_to_token=req_to_token,
                        inputs=inputs)
    if slot_map is not None:  # the translated slots as the table (as the general form's)
        index.req_to_token = torch.from_numpy(raw[None].astype(np.int32))
        index.inputs = inputs._replace(req_rows=torch.zeros_like(req_rows), kv_lo=kv_lo - start,
                                       kv_hi=(kv_hi - start).clamp_max(raw.shape[0]))
    return index


@functools.lru_cache(maxsize=256)
def _block_rows(nblk: int, capacity: int) -> torch.Tensor:
    """A batch of one's ``block_req``: ``nblk`` blocks of row 0, the rest row 1 (= bs, unused); kept, as a step's is
    the last step's until the request grows a block. Made outside inference mode, so any later use may read it."""
    with torch.inference_mode(False):
        return (torch.arange(capacity) >= nblk).long()


def decode_blocks(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index: DecodeIndex,
    scale: float,
    logit_cap: float | None = None,
    *,
    v_shares_k: bool = False,
    k_scale: float | None = None,
    v_scale: float | None = None,
    sinks: torch.Tensor | None = None,
    form: str | None = "auto",
) -> torch.Tensor:
    """Attention of one query per request over its KV blocks.

    q: [bs, Hq, Dqk]; k_cache: [num_slots, Hkv, Dqk]; v_cache: [num_slots, Hkv, Dv], in any ``kv.KV_DTYPES``
    (float8: dequantised as ``stored * k_scale`` / ``stored * v_scale``, None meaning 1)
    v_shares_k: V is the first Dv columns of K (MLA's latent cache): gather K once
    sinks: [Hq] attention-sink logits (gpt-oss), each joining its head's softmax denominator with no value
    form: "auto" (or None), "kernel", "triton" or "matmul" (``forms.choose_form``)
    returns [bs, Hq, Dv] in q.dtype; softmax and accumulation in float32; a row with no keys gives zeros.
    """
    bs, hq, dqk = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    if not torch.compiler.is_compiling():  # a Python number: checked once at trace time, free at replay
        validate.check_positive_number("scale", scale)
        if index.inputs is not None:
            validate.check_index_rows(q, index.inputs.req_rows.shape[0])
    if bs == 0:  # an empty batch: nothing to gather (index_select refuses a 0-row source)
        return q.new_zeros(0, hq, dv)
    choice = choose_form("decode", q, k_cache, v_cache, rows_per_kv_head=hq // hkv, form=form)
    explain("decode_blocks", choice, q, k_cache, v_cache, hq // hkv)
    if choice.form == "kernel":  # blocks and merge in one call
        ks, vs = scale_pair(k_scale, v_scale)  # the softmax scale rides on K's (the kernel reads q as it is)
        return native_decode_blocks(q, index.block_req, index.slots, index.valid, k_cache, v_cache, ks * scale, vs,
                                    logit_cap or 0.0, bs, sinks_by_kv_head(sinks, hkv, hq),
                                    bf16_query_scale(q, k_cache, 1.0), path=choice.path)
    if choice.form == "triton":
        return triton_decode_blocks(q, k_cache, v_cache, index, scale, logit_cap, *scale_pair(k_scale, v_scale),
                                    sinks)
    qg = q.view(bs, hkv, hq // hkv, dqk)
    m, lsum, o = matmul_partials(qg, k_cache, v_cache, index, scale, logit_cap, v_shares_k, k_scale, v_scale)
    out = merge_blocks(m, lsum, o, index.block_req, bs, sinks_by_kv_head(sinks, hkv, hq))
    return out.reshape(bs, hq, dv).to(q.dtype)


def matmul_partials(qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: DecodeIndex, scale: float,
                    logit_cap: float | None, v_shares_k: bool, k_scale: float | None, v_scale: float | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The portable form's blocks: each block's partial softmax by gathers and batched matmuls.

    qg: [bs, Hkv, rows, Dqk] queries grouped by KV head (verify: k draft tokens times the group); index: the
    blocks -> m, lsum [nblk, Hkv, rows] and o [nblk, Hkv, rows, Dv] unnormalised, float32."""
    bs, hkv, _, dqk = qg.shape
    dv = v_cache.shape[2]
    nblk, block_size = index.slots.shape
    flat = index.slots.reshape(-1)
    qb = qg.index_select(0, index.block_req.clamp_max(bs - 1)).float() * scale  # [nblk, Hkv, rows, D]
    valid = index.valid[:, None, :]
    ms, ls, os_ = [], [], []
    # One KV head at a time: a contiguous gather the matmuls read directly, small enough for the allocator to
    # recycle (a whole-batch gather is mmap'ed and page-faulted afresh each step).
    for h in range(hkv):
        k = dequantize(gather_rows(k_cache[:, h], flat), torch.float32, k_scale).view(nblk, block_size, dqk)
        if v_shares_k and (v_scale or 1.0) == (k_scale or 1.0):  # one latent cache, one scale
            v = k[..., :dv]
        else:
            v = dequantize(gather_rows(v_cache[:, h], flat), torch.float32, v_scale).view(nblk, block_size, dv)
        m, p = masked_softmax_parts(torch.bmm(qb[:, h], k.transpose(1, 2)), valid, logit_cap)  # [nblk, rows, B]
        ms.append(m)
        ls.append(p.sum(-1))
        os_.append(torch.bmm(p, v))  # [nblk, rows, dv]
    return torch.stack(ms, 1), torch.stack(ls, 1), torch.stack(os_, 1)


def masked_softmax_parts(s: torch.Tensor, valid: torch.Tensor, logit_cap: float | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores s [..., keys] -> (row max, exp weights); masked entries are selected away, never multiplied, so
    nothing gathered there reaches the sums. valid broadcasts against s."""
    if logit_cap is not None:
        s = logit_cap * torch.tanh(s / logit_cap)
    s = s.masked_fill(~valid, torch.finfo(torch.float32).min)
    m = s.amax(-1)
    return m, torch.where(valid, torch.exp(s - m[..., None]), 0.0)


def sinks_by_kv_head(sinks: torch.Tensor | None, hkv: int, hq: int) -> torch.Tensor | None:
    """[Hq] sinks (any float dtype) as the [Hkv, group] float32 the merges read, or None."""
    if sinks is None:
        return None
    if not torch.compiler.is_compiling():
        validate.check_sinks(sinks, hq)
    return sinks.float().reshape(hkv, hq // hkv)


@opaque_op
def merge_blocks(m: torch.Tensor, lsum: torch.Tensor, o: torch.Tensor, block_req: torch.Tensor,
                 num_rows: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Merge per-block partial softmaxes into one output per request (log-sum-exp rule).

    m, lsum: [nblk, Hkv, group] block max and sum of exp; o: [nblk, Hkv, group, Dv] block's unnormalised output;
    block_req: [nblk] request of each block, ``num_rows`` for unused blocks; sinks: [Hkv, group] float32 logits
    that join every row's denominator -> [num_rows, Hkv, group, Dv] float32. An opaque op because inductor turns
    ``index_add`` into an element-wise ``scatter_reduce_``, far slower on CPU.
    """
    rows = num_rows + 1  # the extra row collects unused blocks
    # ATen's fast row-wise index_add needs contiguous operands; half-precision block outputs merge in float32
    m, lsum, o = m.contiguous(), lsum.contiguous(), o.float().contiguous()
    lowest = torch.finfo(torch.float32).min
    m_req = torch.full((rows, *m.shape[1:]), lowest, device=m.device, dtype=m.dtype)
    m_req = m_req.scatter_reduce(0, block_req.view(-1, *[1] * (m.dim() - 1)).expand_as(m), m, reduce="amax")
    if sinks is not None:  # the sink is one more term of the row's max, so no exp() below can overflow
        m_req = torch.maximum(m_req, sinks)
    w = torch.exp(m - m_req.index_select(0, block_req))
    acc = o.new_zeros((rows, *o.shape[1:])).index_add_(0, block_req, (o * w[..., None]).contiguous())
    den = lsum.new_zeros((rows, *lsum.shape[1:])).index_add_(0, block_req, lsum * w)
    if sinks is not None:
        den = den + torch.exp(sinks - m_req)
    return acc[:num_rows] / den[:num_rows, ..., None].clamp_min(torch.finfo(torch.float32).tiny)


@torch.library.register_fake(merge_blocks)
def _merge_blocks_fake(m, lsum, o, block_req, num_rows, sinks=None):
    return o.new_empty((num_rows, *o.shape[1:]), dtype=torch.float32)
