"""``plan``: host-side, once per batch. Validates inputs and builds bucket-padded metadata for ``run``.

Argument meanings are SGLang's: ``seq_lens`` counts a request's tokens including the new ones, ``extend_prefix_lens``
the cached ones, ``encoder_lens`` the encoder tokens stored before the decoder's (cross-attention reads
``[0, encoder_len)``, decoder self-attention ``[encoder_len, encoder_len + seq_len)``).
"""
from __future__ import annotations

import functools
import itertools
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import validate

__all__ = ["DEFAULT_BLOCK_SIZE", "DecodeInputs", "DecodeMetadata", "ExtendInputs", "ExtendMetadata", "aligned_kv_lo",
           "cdiv", "check_capacity", "decode_blocks_needed", "decode_kv_bounds", "decode_kv_range", "fields_of",
           "gather_unit", "int64_rows", "normalize_window", "plan_decode", "plan_extend", "total_blocks_needed"]

DEFAULT_BLOCK_SIZE = 64


def fields_of(cls, tensors: Mapping[str, torch.Tensor]):
    """The NamedTuple ``cls`` of step inputs, its fields picked by name from a mapping that may hold more."""
    return cls(*(tensors[name] for name in cls._fields))


class DecodeInputs(NamedTuple):
    """The per-step tensors of a decode batch (padded rows: row 0, empty range).

    req_rows:      [bs_cap] int64, request row in req_to_token
    kv_lo, kv_hi:  [bs_cap] int64, the key positions ``[kv_lo, kv_hi)`` each request reads
    block_ids:     [num_blocks] int64 arange, the block capacity of this bucket
    block_offsets: [block_size] int64 arange
    """

    req_rows: torch.Tensor
    kv_lo: torch.Tensor
    kv_hi: torch.Tensor
    block_ids: torch.Tensor
    block_offsets: torch.Tensor

    of = classmethod(fields_of)


class ExtendInputs(NamedTuple):
    """The per-step tensors of an extend batch. Key ``j`` of request ``b`` is position ``kv_lo[b] + j`` of its
    req_to_token row; query ``i`` sits at ``q_first[b] + i`` in the same coordinates (causal: ``j <= q_first + i``).

    req_rows:      [bs_cap] int64
    kv_lo:         [bs_cap] int64, first key position read (encoder offset, sliding-window start)
    kv_len:        [bs_cap] int64, keys read
    q_first:       [bs_cap] int64, first query's position relative to kv_lo
    q_len:         [bs_cap] int64, new tokens (queries) of the request
    q_offsets:     [bs_cap] int64, where the request's queries start in the packed q
    """

    req_rows: torch.Tensor
    kv_lo: torch.Tensor
    kv_len: torch.Tensor
    q_first: torch.Tensor
    q_len: torch.Tensor
    q_offsets: torch.Tensor


@dataclass
class DecodeMetadata:
    """A planned decode batch: its step inputs (padded to ``bs_cap`` rows) and what the host knows about it.

    num_real:      real batch size (rows past it are padding)
    blocks_needed: blocks the real batch uses (<= num_blocks)
    slots_checked: plan checked that every req_to_token entry the batch reads is a slot (``check_slots``)
    page_size:     the cache's page size the blocks were planned for (pass it to ``build_decode_index``)
    """

    inputs: DecodeInputs
    num_real: int
    blocks_needed: int
    slots_checked: bool = False
    page_size: int = 1

    @property
    def block_size(self) -> int:
        return self.inputs.block_offsets.shape[0]


@dataclass
class ExtendMetadata:
    """A planned extend batch: its step inputs, the per-layer static settings, and host counts.

    causal, sliding_window: static settings (one compiled graph per value)
    num_real, num_tokens: real batch size and packed query count
    """

    inputs: ExtendInputs
    causal: bool
    sliding_window: int | None
    num_real: int
    num_tokens: int


def cdiv(n, d):
    """Ceiling division of a non-negative int or integer tensor ``n`` by a positive ``d``."""
    return (n + d - 1) // d


def gather_unit(page_size: int, block_size: int) -> int:
    """Where a request's blocks may start: at multiples of ``gcd(page_size, block_size)`` (1 without pages), so
    that each block reads whole pages of the cache, runs of consecutive slots."""
    a, b = int(page_size), int(block_size)
    if a == 1:  # a token-granular cache, the common case
        return 1
    while b:  # Euclid by hand: dynamo cannot trace math.gcd on a shape
        a, b = b, a % b
    return a


def aligned_kv_lo(kv_lo, unit: int):
    """Where a request's first block starts: ``kv_lo`` (an int or an int64 tensor) rounded down to a multiple of the
    ``unit`` (``gather_unit``), a page's start; the positions before ``kv_lo`` are masked."""
    return kv_lo if unit == 1 else kv_lo - kv_lo % unit


def decode_blocks_needed(kv_lo: torch.Tensor, kv_hi: torch.Tensor, block_size: int, page_size: int = 1
                         ) -> torch.Tensor:
    """kv_lo, kv_hi: [bs] int64 -> [bs] int64, the blocks each request's range ``[kv_lo, kv_hi)`` takes."""
    start = aligned_kv_lo(kv_lo, gather_unit(page_size, block_size))
    return cdiv((kv_hi - start).clamp_min(0), block_size) * (kv_hi > kv_lo)


def total_blocks_needed(kv_lo: Sequence[int] | torch.Tensor, kv_hi: Sequence[int] | torch.Tensor, block_size: int,
                        page_size: int = 1) -> int:
    """``decode_blocks_needed(...).sum()`` as a Python int, over [bs] host tensors (read once) or lists of ints."""
    unit = gather_unit(page_size, block_size)
    if isinstance(kv_lo, torch.Tensor):
        kv_lo, kv_hi = kv_lo.tolist(), kv_hi.tolist()
    return sum([_range_blocks(lo, hi, unit, block_size) for lo, hi in zip(kv_lo, kv_hi, strict=True)])


def _range_blocks(lo: int, hi: int, unit: int, block_size: int) -> int:
    """``decode_blocks_needed`` of one range ``[lo, hi)`` of Python ints."""
    return cdiv(hi - lo + lo % unit, block_size) if hi > lo else 0


def normalize_window(sliding_window):
    """SGLang spells "no window" as -1 (``RadixAttention.sliding_window_size``); ours is None."""
    return None if sliding_window is None or sliding_window == -1 else sliding_window


def int64_rows(columns: list[list[int]], n: int, device: torch.device) -> list[torch.Tensor]:
    """Columns of Python ints, each padded with zeros to ``n`` entries -> one [n] int64 tensor on ``device`` each:
    on the host each over a buffer of its own (``torch.frombuffer``, cheaper than ``torch.tensor``), elsewhere the
    rows of one tensor made by one host-to-device copy."""
    padded = [c if len(c) == n else c + [0] * (n - len(c)) for c in columns]
    if n > 0 and device.type == "cpu":
        return [torch.frombuffer(array("q", c), dtype=torch.int64) for c in padded]
    return list(torch.tensor(padded, dtype=torch.int64, device=device).unbind())


@functools.lru_cache(maxsize=512)
def _arange(n: int, device: torch.device) -> torch.Tensor:
    """``torch.arange(n, device=device)``, made once per length (``block_ids``, ``block_offsets``: read, never
    written). Made outside inference mode (SGLang plans inside it), so a later use outside it may read it."""
    with torch.inference_mode(False):
        return torch.arange(n, device=device)


def check_capacity(name: str, given: int | None, needed: int, minimum: int = 1) -> int:
    if given is None:
        return max(needed, minimum)
    if given < needed:
        raise ValueError(f"{name}={given} is smaller than this batch needs ({needed})")
    return given


def _encoder_values(encoder_lens, is_cross_attn: bool, bs: int, device: torch.device) -> list[int]:
    """[bs] encoder lengths as Python ints (zeros for decoder-only)."""
    if encoder_lens is None:
        if is_cross_attn:
            raise ValueError("is_cross_attn=True needs encoder_lens")
        return [0] * bs
    return validate.length_values("encoder_lens", encoder_lens, bs, device)


def decode_kv_range(seq_lens: torch.Tensor, encoder_lens: torch.Tensor, sliding_window: int | None,
                    is_cross_attn: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The key positions ``[lo, hi)`` each decode request reads; pure tensor code.

    seq_lens, encoder_lens: [bs] int64 (zeros for decoder-only) -> lo, hi: [bs] int64; windowed, self-attention
    starts at ``seq_len - 1 - sliding_window`` (the query sits at ``seq_len - 1``).
    """
    if is_cross_attn:
        return torch.zeros_like(encoder_lens), encoder_lens
    lo = encoder_lens
    if sliding_window is not None:
        lo = encoder_lens + (seq_lens - 1 - sliding_window).clamp_min(0)
    return lo, encoder_lens + seq_lens


def decode_kv_bounds(seq_lens: list[int], encoder_lens: list[int], sliding_window: int | None,
                     is_cross_attn: bool) -> tuple[list[int], list[int]]:
    """``decode_kv_range`` on Python ints: [bs] lists -> lo, hi: [bs] lists."""
    if is_cross_attn:
        return [0] * len(encoder_lens), encoder_lens
    hi = [e + n for n, e in zip(seq_lens, encoder_lens, strict=True)]
    if sliding_window is None:
        return encoder_lens, hi
    return [e + max(n - 1 - sliding_window, 0) for n, e in zip(seq_lens, encoder_lens, strict=True)], hi


def plan_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sliding_window: int | None = None,
    encoder_lens: torch.Tensor | None = None,
    is_cross_attn: bool = False,
    batch_capacity: int | None = None,
    block_capacity: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    check_slots: bool = True,
    page_size: int = 1,
) -> DecodeMetadata:
    """Validate a decode batch and build its metadata, padded to ``batch_capacity`` rows and ``block_capacity``
    KV blocks of ``block_size`` tokens (defaults: what the batch needs).

    q: [bs, Hq, Dqk]; k_cache: [S, Hkv, Dqk]; v_cache: [S, Hkv, Dv]; req_to_token: [max_reqs, max_context_len];
    req_pool_indices, seq_lens (and encoder_lens): [bs]
    check_slots: check that every req_to_token entry read is a slot of k_cache (a host read; a sync on CUDA). Turn
        it off only where the caller guarantees the table.
    page_size: SGLang's ``--page-size``; blocks start at page boundaries (``gather_unit``). Every form reads each
        position's own slot, so any table layout is read as it stands.
    """
    validate.check_qkv(q, k_cache, v_cache)
    if q.shape[0] == 1 and encoder_lens is None and not is_cross_attn:
        meta = _plan_one_request(q, k_cache, req_to_token, req_pool_indices, seq_lens, sliding_window, block_size,
                                 page_size, batch_capacity, block_capacity, check_slots)
        if meta is not None:
            return meta
    validate.check_positive_int("block_size", block_size)
    validate.check_positive_int("page_size", page_size)
    bs, device = q.shape[0], q.device
    rows = validate.table_rows(req_to_token, req_pool_indices, bs, device)
    lens = validate.length_values("seq_lens", seq_lens, bs, device)
    enc = _encoder_values(encoder_lens, is_cross_attn, bs, device)
    sliding_window = normalize_window(sliding_window)
    validate.check_window_and_cap(sliding_window, None)
    if is_cross_attn and sliding_window is not None:
        raise ValueError("sliding_window applies to self-attention; it must be None with is_cross_attn=True")
    lo, hi = decode_kv_bounds(lens, enc, sliding_window, is_cross_attn)
    validate.check_kv_end(hi, req_to_token.shape[1], "encoder_lens" if is_cross_attn else
                          "encoder_lens + seq_lens" if encoder_lens is not None else "seq_lens")
    if check_slots:  # from the first block's start: the few positions it reads before lo too
        unit = gather_unit(page_size, block_size)
        start = lo if unit == 1 else [x - x % unit for x in lo]
        validate.check_slots(req_to_token, rows, start, hi, k_cache.shape[0])
    needed = total_blocks_needed(lo, hi, block_size, page_size)
    bs_cap = check_capacity("batch_capacity", batch_capacity, bs)
    nblk = check_capacity("block_capacity", block_capacity, needed)
    req_rows, kv_lo, kv_hi = int64_rows([rows, lo, hi], bs_cap, device)
    inputs = DecodeInputs(req_rows, kv_lo, kv_hi, _arange(nblk, device), _arange(block_size, device))
    return DecodeMetadata(inputs, num_real=bs, blocks_needed=needed, slots_checked=check_slots, page_size=page_size)


def _host_index(t, ndim: int) -> bool:
    """``validate.check_tensor(name, t, ndim, INDEX_DTYPES, q.device)`` would pass, q being on the CPU."""
    return isinstance(t, torch.Tensor) and t.is_cpu and t.dim() == ndim and t.dtype in validate.INDEX_DTYPES


def _plan_one_request(q, k_cache, req_to_token, req_pool_indices, seq_lens, sliding_window, block_size: int,
                      page_size: int, batch_capacity, block_capacity, check_slots: bool) -> DecodeMetadata | None:
    """``plan_decode`` of one decoder-only request on the host (q checked), the same checks in their passing form:
    None where any would fail, or an input is unusual, for the general form to run (and name the error). Why: at
    batch 1 the general form's helpers and lists cost more than its tensor ops."""
    if not (q.is_cpu and _host_index(req_to_token, 2) and _host_index(req_pool_indices, 1)
            and _host_index(seq_lens, 1) and req_pool_indices.shape[0] == 1 and seq_lens.shape[0] == 1):
        return None
    if type(block_size) is not int or type(page_size) is not int or block_size < 1 or page_size < 1:
        return None
    window = None if sliding_window is None or sliding_window == -1 else sliding_window  # normalize_window
    if window is not None and (type(window) is not int or window < 0):
        return None
    (row,), (n,) = req_pool_indices.tolist(), seq_lens.tolist()
    max_reqs, width = req_to_token.shape
    if not (0 <= row < max_reqs and 0 <= n <= width):
        return None
    lo = 0 if window is None else max(n - 1 - window, 0)  # decode_kv_bounds
    unit = gather_unit(page_size, block_size)
    start = aligned_kv_lo(lo, unit)
    if check_slots and n > start:  # validate.check_slots
        slots = validate.host_row(req_to_token, row, start, n)
        if slots is None or not validate.slots_fit(slots, k_cache.shape[0]):
            return None
    needed = _range_blocks(lo, n, unit, block_size)
    bs_cap = 1 if batch_capacity is None else check_capacity("batch_capacity", batch_capacity, 1)
    nblk = max(needed, 1) if block_capacity is None else check_capacity("block_capacity", block_capacity, needed)
    req_rows, kv_lo, kv_hi = int64_rows([[row], [lo], [n]], bs_cap, q.device)
    inputs = DecodeInputs(req_rows, kv_lo, kv_hi, _arange(nblk, q.device), _arange(block_size, q.device))
    return DecodeMetadata(inputs, num_real=1, blocks_needed=needed, slots_checked=check_slots, page_size=page_size)


def plan_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    encoder_lens: torch.Tensor | None = None,
    is_cross_attn: bool = False,
    batch_capacity: int | None = None,
    check_slots: bool = True,
    page_size: int = 1,
) -> ExtendMetadata:
    """Validate an extend (prefill) batch and build its metadata, padded to ``batch_capacity`` rows.

    q: [num_tokens, Hq, Dqk] packed in request order, request i's queries at ``[extend_prefix_lens[i], seq_lens[i])``;
    check_slots, page_size: as in ``plan_decode`` (extend reads each position's slot: the page size is only checked).
    """
    validate.check_qkv(q, k_cache, v_cache)
    validate.check_positive_int("page_size", page_size)
    device = q.device
    validate.check_tensor("seq_lens", seq_lens, 1, validate.INDEX_DTYPES, device)
    bs = seq_lens.shape[0]
    rows = validate.table_rows(req_to_token, req_pool_indices, bs, device)
    lens = validate.length_values("seq_lens", seq_lens, bs, device)
    prefix = validate.length_values("extend_prefix_lens", extend_prefix_lens, bs, device)
    ext = validate.length_values("extend_seq_lens", extend_seq_lens, bs, device)
    enc = _encoder_values(encoder_lens, is_cross_attn, bs, device)
    sliding_window = normalize_window(sliding_window)
    validate.check_window_and_cap(sliding_window, None)
    bad = next((i for i in range(bs) if prefix[i] + ext[i] != lens[i]), None)
    if bad is not None:
        raise ValueError(f"extend_prefix_lens + extend_seq_lens must equal seq_lens; request {bad}: "
                         f"{prefix[bad]} + {ext[bad]} != {lens[bad]}")
    num_tokens = sum(ext)
    if q.shape[0] != num_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens but sum(extend_seq_lens) is {num_tokens}")
    if is_cross_attn:
        if sliding_window is not None:
            raise ValueError("sliding_window applies to self-attention; it must be None with is_cross_attn=True")
        causal = False
        lo, kv_len, q_first = [0] * bs, enc, [0] * bs
        validate.check_kv_end(enc, req_to_token.shape[1], "encoder_lens")
    else:
        validate.check_kv_end([e + n for e, n in zip(enc, lens, strict=True)], req_to_token.shape[1],
                              "encoder_lens + seq_lens" if encoder_lens is not None else "seq_lens")
        # keys before the first query's window are never read
        skip = [0 if sliding_window is None else max(p - sliding_window, 0) for p in prefix]
        lo = [e + s for e, s in zip(enc, skip, strict=True)]
        kv_len = [n - s for n, s in zip(lens, skip, strict=True)]
        q_first = [p - s for p, s in zip(prefix, skip, strict=True)]
    if check_slots:
        hi = [a + n for a, n in zip(lo, kv_len, strict=True)]
        validate.check_slots(req_to_token, rows, lo, hi, k_cache.shape[0])
    bs_cap = check_capacity("batch_capacity", batch_capacity, bs)
    offsets = [*itertools.accumulate(ext[:-1], initial=0)][:bs] + [num_tokens] * (bs_cap - bs)  # padding: past q
    inputs = ExtendInputs(*int64_rows([rows, lo, kv_len, q_first, ext, offsets], bs_cap, device))
    return ExtendMetadata(inputs, causal=causal, sliding_window=sliding_window, num_real=bs, num_tokens=num_tokens)
