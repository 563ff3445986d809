"""Decode attention (one query token per request) over the paged KV cache, as split-KV blocks.

Why blocks: padding every request to the batch's longest context made a batched decode slower than the
per-request loop at mixed lengths. Here each request's KV range is cut into fixed-size blocks and the batch is
the flat list of all blocks, so the work follows the sum of the lengths (each request rounded up to one block),
and a captured graph's cost follows its block-capacity bucket, not the table width. Each block computes a partial
softmax (its max, its sum, its weighted V); the blocks of one request are merged with the log-sum-exp rule
(flash-decoding). GQA never expands K/V: queries are grouped as ``[Hkv, group, D]`` against one K block.

Three forms compute the blocks. On CPU the fused form reads K/V in place through the block table, with no gathered
copy, over the used blocks only: by the C++ kernel (``native_decode``, head sizes that are multiples of 16, MLA's
576/512 latent included; it skips a bucket's unused blocks and merges the rest in the same call), eagerly and
compiled, or else, under ``torch.compile`` with one head size and separate K and V caches, as code that inductor traces
(``decode_fused.fused_block_partials``, after ``decode_fused.used_blocks`` counts the used blocks on the host: a
data-dependent size to the compile). On CPU eagerly without that kernel (one head size, no soft-cap), the opaque
op ``decode_flash`` runs the blocks through ATen's CPU flash kernel (``decode_flash.py``: one request as one
sequence, its slots in one gather where the host indexed it, a small batch padded into one call, else L2-sized
chunks of blocks gathered by ``block_flash.block_attention``), reading ``valid`` on the host to skip a bucket's
padding.
Elsewhere (CUDA, where inductor turns it into fused kernels; without the kernel, MLA's 576/512 and soft-capped
models eagerly) the matmul form below runs.

All functions here are pure tensor code: no ``.item()``, no host sync, no value-dependent Python branch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from graphs import cdiv

from . import validate
from .block_flash import chunk_blocks_for
from .decode_flash import decode_flash, decode_flash_eager, single_request_flash
from .decode_fused import grouped_queries, used_block_partials
from .forms import choose_form, explain
from .inplace_flash import index_in_place
from .kernels.triton_form import triton_decode_blocks
from .kv_dtype import compute_dtype, dequantize, gather_rows, scale_pair
from .merge import apply_sinks, merge_partials
from .metadata import DecodeInputs
from .native_decode import bf16_query_scale, native_decode_blocks
from .opaque import opaque_op


@dataclass
class DecodeIndex:
    """Per-step block table shared by every layer (built once per step by ``build_decode_index``).

    block_req: [num_blocks] int64, the batch row each block belongs to (``num_rows`` for unused blocks)
    slots:     [num_blocks, block_size] int64, KV slot of each block position; where invalid, the block's first
               slot (a slot its own request owns), and 0 in an unused block
    valid:     [num_blocks, block_size] bool, position lies inside its request's range
    unit:      positions per gathered run: ``gcd(page_size, block_size)`` (1 for a token-granular cache)
    units:     [num_blocks, block_size // unit] int64, run index (``slot // unit``) of each run's first slot
    single:    [n] int64 or None: a batch of one's key slots in position order, set by the host-built index
               (``_single_request_index``); the CPU eager decode reads them in one gather
    key_runs:  the eager CPU forms' split of these keys into runs of slots (``inplace_flash.index_in_place``):
               empty until a layer first asks, then ``(KeyRuns or None,)``, kept for the step's other layers
    req_to_token, inputs: what the index was built from: the Triton kernel reads each request's range from them
               instead of the block table (None in an index built by hand)
    """

    block_req: torch.Tensor
    slots: torch.Tensor
    valid: torch.Tensor
    unit: int = 1
    units: torch.Tensor | None = None
    single: torch.Tensor | None = None
    key_runs: tuple = field(default=(), repr=False, compare=False)
    req_to_token: torch.Tensor | None = field(default=None, repr=False, compare=False)
    inputs: DecodeInputs | None = field(default=None, repr=False, compare=False)

    @property
    def runs(self) -> torch.Tensor:
        """What a gather of ``unit``-slot runs indexes: ``units``, or ``slots`` when ``unit`` is 1."""
        return self.slots if self.units is None else self.units

    @property
    def block_size(self) -> int:
        return self.slots.shape[1]


def gather_unit(page_size: int, block_size: int) -> int:
    """Positions per gathered run of consecutive slots: ``gcd(page_size, block_size)`` (1 without pages)."""
    a, b = int(page_size), int(block_size)
    while b:  # Euclid by hand: dynamo cannot trace math.gcd on a shape
        a, b = b, a % b
    return a


def aligned_kv_lo(kv_lo: torch.Tensor, unit: int) -> torch.Tensor:
    """Where a request's first block starts: ``kv_lo`` rounded down to a multiple of the gather ``unit`` (each run
    of ``unit`` positions then lies in one page); the fewer than ``unit`` positions before ``kv_lo`` are masked."""
    return kv_lo if unit == 1 else kv_lo - kv_lo % unit


def decode_blocks_needed(kv_lo: torch.Tensor, kv_hi: torch.Tensor, block_size: int, page_size: int = 1
                         ) -> torch.Tensor:
    """[bs] blocks each request's range ``[kv_lo, kv_hi)`` takes (its first block starting at a run boundary)."""
    start = aligned_kv_lo(kv_lo, gather_unit(page_size, block_size))
    return cdiv((kv_hi - start).clamp_min(0), block_size) * (kv_hi > kv_lo)


def total_blocks_needed(kv_lo: torch.Tensor, kv_hi: torch.Tensor, block_size: int, page_size: int = 1) -> int:
    """``decode_blocks_needed(...).sum()`` as a Python int, counted over the ranges read once on the host: a plan's
    and a graph check's count without the ~9 small tensor ops of the tensor form (tens of us at batch 1)."""
    unit = gather_unit(page_size, block_size)
    return sum(cdiv(hi - (lo - lo % unit), block_size)
               for lo, hi in zip(kv_lo.tolist(), kv_hi.tolist(), strict=True) if hi > lo)


class SlotMap(NamedTuple):
    """A slot translation: the caches a layer reads are indexed by ``table[slot]`` of the slots ``req_to_token``
    holds (SGLang's hybrid sliding-window pool: ``SWAKVPool.full_to_swa_index_mapping``, a full-pool slot to its
    slot in the window layers' own pool). num_slots: the rows of the caches read through it."""

    table: torch.Tensor
    num_slots: int


def translate_slots(slots: torch.Tensor, slot_map: SlotMap | None) -> torch.Tensor:
    """``slots`` (int64, any shape) through ``slot_map`` (None: as they are): pure tensor code. The slot is clamped
    into the table and the translation into ``[0, num_slots)``, so no entry reads outside the caches (SGLang's
    table ends with a -1 sentinel, and holds 0, the padding slot, for tokens freed from the window)."""
    if slot_map is None:
        return slots
    table, num_slots = slot_map
    return table[slots.clamp(0, table.shape[0] - 1)].to(torch.int64).clamp(0, num_slots - 1)


def build_decode_index(req_to_token: torch.Tensor, inputs: DecodeInputs, page_size: int = 1, *,
                       host_form: bool = True, slot_map: SlotMap | None = None) -> DecodeIndex:
    """Cut each request's KV range ``[kv_lo, kv_hi)`` into blocks and look up their slots.

    req_to_token: [max_reqs, max_context_len] int32; inputs: ``DecodeInputs`` (``plan_decode(...).inputs``, or a
    captured step's static buffers): the length of ``block_ids`` is the block capacity, of ``block_offsets`` the
    block size. page_size: the cache's page size (as planned: ``plan_decode(page_size=...)``); with it > 1,
    ``units`` names runs of ``gcd(page_size, block_size)`` consecutive slots and blocks start at run boundaries.
    host_form: a batch of one on CPU, called eagerly, is indexed on the host (``_single_request_index``); False
    keeps the pure tensor form (metadata a graph records, or that compiled code receives as an input).
    slot_map: the index's slots translated (``translate_slots``); ``req_to_token`` and ``inputs`` of the index are
    then those of a table of translated slots (the block slots as one row), which the Triton form reads.
    """
    req_rows, kv_lo, kv_hi, block_ids, block_offsets = inputs
    bs = req_rows.shape[0]
    block_size = block_offsets.shape[0]
    unit = gather_unit(page_size, block_size)
    if host_form and bs == 1 and req_to_token.device.type == "cpu" and not torch.compiler.is_compiling():
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
    if unit > 1:  # the first block starts at a run boundary: positions before kv_lo are masked
        valid &= pos >= kv_lo[req][:, None]
    # A masked position gathers its block's first key (inside the request's range for a used block), never a slot
    # no request owns: SGLang writes padded rows' K/V to slot 0 and a fresh pool is uninitialised memory, and a
    # NaN gathered there survives any mask that multiplies or adds (0 * NaN, -inf + NaN). The kernels then only
    # ever see finite keys they mask out; an unused block (its row is discarded) reads the padding slot.
    pos = torch.where(valid, pos, torch.where(used, start, 0)[:, None])
    slots = translate_slots(req_to_token[req_rows[req][:, None], pos].to(torch.int64), slot_map)
    slots = torch.where(used[:, None], slots, 0)
    # a run's first position is valid, or is its block's start (same run as the block's first valid position), so
    # its slot names the run; runs wholly past the end name the block's first run (read, then zeroed)
    units = slots[:, ::unit] // unit if unit > 1 else None
    if slot_map is not None:  # a request's positions lie in its blocks in order: the block slots as one table row
        shift, width = firsts * block_size - kv_start, slots.numel()
        inputs = inputs._replace(req_rows=torch.zeros_like(req_rows), kv_lo=(kv_lo + shift).clamp(0, width),
                                 kv_hi=(kv_hi + shift).clamp(0, width))
        req_to_token = slots.reshape(1, -1).to(torch.int32)
    return DecodeIndex(block_req=block_req, slots=slots, valid=valid, unit=unit, units=units,
                       req_to_token=req_to_token, inputs=inputs)


def _single_request_index(req_to_token: torch.Tensor, inputs: DecodeInputs, unit: int,
                          slot_map: SlotMap | None = None) -> DecodeIndex:
    """``build_decode_index`` of a batch of one on CPU, eagerly: the request's range read on the host (a CPU tensor:
    no sync) and its key slots as one slice of its table row (``single``); the block table, equal to the general
    form's, is built from that slice only if something reads it. Why: at batch 1 and a short context the general
    form's ~25 small ops cost as much as the attention itself, and the CPU decode of a short request needs only
    ``single``. Traced code (``torch.compile``) and CUDA keep the general form."""
    req_rows, kv_lo, kv_hi, block_ids, block_offsets = inputs
    block_size, capacity = block_offsets.shape[0], block_ids.shape[0]
    row, lo, hi = req_rows.item(), kv_lo.item(), kv_hi.item()
    start = lo - lo % unit
    nblk = min(cdiv(hi - start, block_size), capacity) if hi > lo else 0
    raw = translate_slots(req_to_token[row, start:start + nblk * block_size].to(torch.int64), slot_map)
    # the request's keys in order (a view; hi <= the table's width): only when no block was cut by the capacity
    single = raw[lo - start:hi - start] if nblk * block_size >= hi - start else None
    index = _SingleRequestIndex(raw, lo - start, hi - start, nblk, capacity, block_size, unit, single)
    index.req_to_token, index.inputs = req_to_token, inputs
    if slot_map is not None:  # the translated slots as the table (as the general form's)
        index.req_to_token = raw[None].to(torch.int32)
        index.inputs = inputs._replace(req_rows=torch.zeros_like(req_rows), kv_lo=kv_lo - start,
                                       kv_hi=(kv_hi - start).clamp_max(raw.shape[0]))
    return index


class _SingleRequestIndex(DecodeIndex):
    """A host-built ``DecodeIndex`` of one request (``_single_request_index``): ``single`` at once, ``block_req``,
    ``slots``, ``valid`` and ``units`` on first read (then kept)."""

    def __init__(self, raw: torch.Tensor, first: int, end: int, nblk: int, capacity: int, block_size: int,
                 unit: int, single: torch.Tensor | None):
        # raw: the table row's slots from the first block's start; [first, end): the request's keys in it
        self._raw, self._span, self._shape = raw, (first, end), (nblk, capacity, block_size)
        self.unit, self.single, self._table, self.key_runs = unit, single, None, ()
        self.req_to_token, self.inputs = None, None

    @property
    def block_size(self) -> int:
        return self._shape[2]

    def _built(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self._table is None:
            (first, end), (nblk, capacity, block_size), unit = self._span, self._shape, self.unit
            n = nblk * block_size
            raw = self._raw
            if raw.shape[0] < n:  # the last block runs past the table's width: those positions are masked anyway
                raw = torch.cat([raw, raw.new_zeros(n - raw.shape[0])])
            raw = raw.view(nblk, block_size)
            offsets = torch.arange(n).view(nblk, block_size)
            valid = (offsets < end) & (offsets >= first)
            # masked positions read their block's first slot, as in the general form
            slots = torch.where(valid, raw, raw[:, :1])
            block_req = torch.zeros(capacity, dtype=torch.int64)
            if nblk < capacity:  # unused blocks: row 1 (= bs), slot 0, nothing valid
                block_req[nblk:] = 1
                slots = torch.cat([slots, slots.new_zeros(capacity - nblk, block_size)])
                valid = torch.cat([valid, valid.new_zeros(capacity - nblk, block_size)])
            self._table = (block_req, slots, valid, slots[:, ::unit] // unit if unit > 1 else None)
        return self._table

    block_req = property(lambda self: self._built()[0])
    slots = property(lambda self: self._built()[1])
    valid = property(lambda self: self._built()[2])
    units = property(lambda self: self._built()[3])


def decode_blocks(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index: DecodeIndex,
    scale: float,
    logit_cap: float | None = None,
    *,
    v_shares_k: bool = False,
    cpu_flash: bool | None = None,
    fused: bool | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    sinks: torch.Tensor | None = None,
    native: bool | None = None,
    form: str | None = None,
) -> torch.Tensor:
    """Attention of one query per request over its KV blocks.

    q: [bs, Hq, Dqk]; k_cache: [num_slots, Hkv, Dqk]; v_cache: [num_slots, Hkv, Dv], in any ``kv_dtype.KV_DTYPES``
    (float8 included: dequantised in the gather as ``stored * k_scale`` / ``stored * v_scale``, None meaning 1)
    v_shares_k: V is the first Dv columns of K (MLA's latent cache): gather K once and take V as its view
    sinks: [Hq] attention sinks (gpt-oss): a learned logit per head that joins each row's softmax denominator
        (``exp(sink)`` beside the keys' ``exp(score)``) with no value, so a row can attend to "nothing"
    cpu_flash: per-block attention through ATen's CPU flash kernel (``decode_flash``) rather than the matmul form;
        None picks it wherever it applies (CPU, one head size, no soft-cap) unless the fused form is picked.
    fused: the blocks read K/V in place (``decode_fused``; any head sizes, soft-cap, V read from ``v_cache`` even
        when it shares K's rows); None picks it on a CPU where the C++ kernel serves the call (MLA's latent too),
        or while compiling for one head size and V a cache of its own (the traced form reads MLA's latent twice,
        measured no faster than the matmul form). Its traced form eagerly is correct but materialises a copy of all
        K and V.
    native: the fused form's kernel: the C++ one (``native_decode``; None: wherever it fits, which also makes the
        fused form the CPU's eager default for a batch of more than one) or False for the traced form (on CUDA:
        False is the matmul form rather than the Triton kernel).
    form: one of ``forms.FORMS`` to run that form, instead of the three overrides above (``forms.choose_form``
        decides, and says why: ``COMPILED_ATTN_EXPLAIN=1``).
    The choices follow shapes, dtypes, the device and whether the code is being compiled, never tensor values.
    returns [bs, Hq, Dv] in q.dtype; softmax and accumulation in float32 (a bf16/fp16 query over a cache of its
    dtype or float8 hands the CPU flash kernel half-precision tiles, which it accumulates in float32); a row with
    no keys gives zeros.
    """
    bs, hq, dqk = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    if not torch.compiler.is_compiling():  # a Python number: checked once at trace time, free at replay
        validate.check_positive_number("scale", scale)
        if index.inputs is not None:
            validate.check_index_rows(q, index.inputs.req_rows.shape[0])
    if bs == 0:  # an empty batch: nothing to gather (index_select refuses a 0-row source)
        return q.new_zeros(0, hq, dv)
    choice = choose_form("decode", q, k_cache, v_cache, rows_per_kv_head=hq // hkv, v_shares_k=v_shares_k,
                         logit_cap=logit_cap, form=form, fused=fused, cpu_flash=cpu_flash, native=native)
    explain("decode_blocks", choice, q, k_cache, v_cache, hq // hkv)
    # a batch of one indexed on the host too (the kernel splits its KV heads between the threads, faster than
    # its one gather and flash call at any length): the kernel reads the table that index builds from its slots
    if choice.form == "kernel":  # blocks and merge in one kernel call, a bucket's unused blocks skipped inside it
        ks, vs = scale_pair(k_scale, v_scale)  # the softmax scale rides on K's (the kernel reads q as it is)
        return native_decode_blocks(q, index.block_req, index.runs, index.valid, index.unit, k_cache, v_cache,
                                    ks * scale, vs, logit_cap or 0.0, bs, sinks_by_kv_head(sinks, hkv, hq),
                                    bf16_query_scale(q, k_cache, 1.0), path=choice.path)
    if choice.form == "triton":  # the kernel reads each request's range and skips the blocks past it
        return triton_decode_blocks(q, k_cache, v_cache, index, scale, logit_cap, *scale_pair(k_scale, v_scale),
                                    sinks)
    if choice.form == "traced":
        block_req, m, lsum, o = used_block_partials(q, index, hkv, scale, k_cache, v_cache, logit_cap, k_scale,
                                                    v_scale)
        out = merge_blocks(m, lsum, o, block_req, bs, sinks_by_kv_head(sinks, hkv, hq))
        return out.reshape(bs, hq, dv).to(q.dtype)
    if choice.form == "flash":
        return _decode_flash(q, k_cache, v_cache, index, scale, k_scale, v_scale, sinks_by_kv_head(sinks, hkv, hq))
    nblk, block_size = index.slots.shape
    flat = index.slots.reshape(-1)
    qb = grouped_queries(q, index.block_req, hkv) * scale
    valid = index.valid[:, None, :]
    ms, ls, os_ = [], [], []
    # One KV head at a time: each gather is a contiguous [blocks, block_size, D] tile set that the batched
    # matmuls read directly, and is 1/Hkv of the batch's K, small enough for the allocator to recycle
    # (a whole-batch gather over 32 MB is mmap'ed and page-faulted afresh each step).
    for h in range(hkv):
        k = dequantize(gather_rows(k_cache[:, h], flat), torch.float32, k_scale).view(nblk, block_size, dqk)
        if v_shares_k and (v_scale or 1.0) == (k_scale or 1.0):  # one latent cache, one scale
            v = k[..., :dv]
        else:
            v = dequantize(gather_rows(v_cache[:, h], flat), torch.float32, v_scale).view(nblk, block_size, dv)
        s = torch.bmm(qb[:, h], k.transpose(1, 2))  # [nblk, group, block_size]
        if logit_cap is not None:
            s = logit_cap * torch.tanh(s / logit_cap)
        # select, never multiply: a masked score or weight is replaced, so nothing gathered there reaches the sums
        s = s.masked_fill(~valid, torch.finfo(torch.float32).min)
        m = s.amax(-1)
        p = torch.where(valid, torch.exp(s - m[..., None]), 0.0)
        ms.append(m)
        ls.append(p.sum(-1))
        os_.append(torch.bmm(p, v))  # [nblk, group, dv]
    m, lsum, o = torch.stack(ms, 1), torch.stack(ls, 1), torch.stack(os_, 1)  # [nblk, hkv, group(, dv)]
    out = merge_blocks(m, lsum, o, index.block_req, bs, sinks_by_kv_head(sinks, hkv, hq))
    return out.reshape(bs, hq, dv).to(q.dtype)


def sinks_by_kv_head(sinks: torch.Tensor | None, hkv: int, hq: int) -> torch.Tensor | None:
    """[Hq] sinks (any float dtype) as the [Hkv, group] float32 the merges read, or None."""
    if sinks is None:
        return None
    if not torch.compiler.is_compiling():
        validate.check_sinks(sinks, hq)
    return sinks.float().reshape(hkv, hq // hkv)


def _decode_flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: DecodeIndex,
                  scale: float, k_scale: float | None, v_scale: float | None,
                  sinks: torch.Tensor | None) -> torch.Tensor:
    """``decode_blocks`` through the one CPU op ``decode_flash`` (its docstring: which path runs when)."""
    bs, hq, d = q.shape
    block_size = index.block_size
    hkv = k_cache.shape[1]
    qg = q.reshape(bs, hkv, hq // hkv, d).to(compute_dtype(q.dtype, k_cache.dtype))  # the kernels' queries
    chunk_blocks = chunk_blocks_for(block_size, hkv, d)
    compiling = torch.compiler.is_compiling()
    scales = scale_pair(k_scale, v_scale)
    if not compiling:  # keys in long runs of slots read in place, the runs found once per step (inplace_flash)
        found = index_in_place(qg, k_cache, v_cache, index, scale, chunk_blocks * block_size, *scales)
        if found is not None:
            return apply_sinks(*found, sinks).reshape(bs, hq, d).to(q.dtype)
    if index.single is not None and not compiling:  # a batch of one, its keys' slots known on the host
        o = single_request_flash(qg, k_cache, v_cache, index.single, scale, block_size, *scales, sinks)
        if o is not None:
            return o.reshape(bs, hq, d).to(q.dtype)
    # eager: the op's body directly (the op's dispatch cost is a short request's kernel call)
    run = decode_flash if compiling else decode_flash_eager
    o = run(qg, k_cache, v_cache, index.runs, index.valid, index.block_req, scale, chunk_blocks, index.unit, *scales,
            sinks)
    return o.reshape(bs, hq, d).to(q.dtype)


@opaque_op
def merge_blocks(m: torch.Tensor, lsum: torch.Tensor, o: torch.Tensor, block_req: torch.Tensor,
                 num_rows: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Merge per-block partial softmaxes into one output per request (log-sum-exp rule).

    m, lsum: [nblk, Hkv, group] block max and sum of exp; o: [nblk, Hkv, group, Dv] block's unnormalised output;
    block_req: [nblk] request of each block, ``num_rows`` for unused blocks; sinks: [Hkv, group] float32 logits
    that join every row's denominator (``decode_blocks``' ``sinks``) -> [num_rows, Hkv, group, Dv] float32.

    An opaque op on purpose: inside ``torch.compile`` inductor turns ``index_add`` into an element-wise
    ``scatter_reduce_`` that is far slower on CPU than ATen's row-wise ``index_add``; as an opaque op the
    compiled step calls the fast ATen kernels (and a CUDA graph records them like any other kernel).
    """
    return merge_partials(m, lsum, o, block_req, num_rows, sinks)


@torch.library.register_fake(merge_blocks)
def _merge_blocks_fake(m, lsum, o, block_req, num_rows, sinks=None):
    return o.new_empty((num_rows, *o.shape[1:]), dtype=torch.float32)
