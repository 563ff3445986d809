"""``plan``: host-side, once per batch. Validates inputs and builds bucket-padded metadata for ``run``.

Follows SGLang's argument meanings: ``seq_lens`` counts a request's tokens including the new ones,
``extend_prefix_lens`` the cached ones, ``encoder_lens`` the encoder tokens stored before the decoder's
(cross-attention reads ``[0, encoder_len)``, decoder self-attention ``[encoder_len, encoder_len + seq_len)``).
A decode plan does its host arithmetic on Python ints (the ``[bs]`` inputs read once) and makes its step tensors in
one host-to-device copy: a batch of one plans in a few small tensor ops.
"""
from __future__ import annotations

import functools

import torch

from . import validate
from .kv_blocks import gather_unit, total_blocks_needed
from .metadata import DecodeInputs, DecodeMetadata, ExtendInputs, ExtendMetadata

__all__ = ["DEFAULT_BLOCK_SIZE", "decode_kv_bounds", "decode_kv_range", "normalize_window", "plan_decode",
           "plan_extend"]

DEFAULT_BLOCK_SIZE = 64


def normalize_window(sliding_window):
    """SGLang spells "no window" as -1 (``RadixAttention.sliding_window_size``); ours is None."""
    return None if sliding_window is None or sliding_window == -1 else sliding_window


def _pad(t: torch.Tensor, n: int, fill: int = 0) -> torch.Tensor:
    if n == t.shape[0]:  # no padding rows (every eager plan): a copy, never the caller's tensor
        return t.to(torch.int64, copy=True)
    out = torch.full((n,), fill, dtype=torch.int64)
    out[: t.shape[0]] = t
    return out


def _int64_rows(columns: list[list[int]], n: int, device: torch.device) -> list[torch.Tensor]:
    """Columns of Python ints, each padded with zeros to ``n`` entries -> one [n] int64 tensor on ``device`` each:
    the rows of one tensor, made by one host-to-device copy (where a tensor each costs three times the ops)."""
    padded = columns if len(columns[0]) == n else [c + [0] * (n - len(c)) for c in columns]
    return list(torch.tensor(padded, dtype=torch.int64, device=device).unbind())


@functools.lru_cache(maxsize=512)
def _arange(n: int, device: torch.device) -> torch.Tensor:
    """``torch.arange(n, device=device)``, made once per length: the plans' ``block_ids`` and ``block_offsets`` are
    such constants, read and never written, and a fresh one is a tensor op per step (a few us at batch 1). Made
    outside inference mode (SGLang plans inside it), so a later use outside it, compiled included, may read it."""
    with torch.inference_mode(False):
        return torch.arange(n, device=device)


def _capacity(name: str, given: int | None, needed: int, minimum: int = 1) -> int:
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
    """The key positions ``[lo, hi)`` each decode request reads; pure tensor code (host or graph-recorded).

    seq_lens, encoder_lens: [bs] int64 (zeros for decoder-only) -> lo, hi: [bs] int64. Cross-attention reads the
    encoder tokens ``[0, encoder_len)``; self-attention reads ``[encoder_len, encoder_len + seq_len)``, from
    ``seq_len - 1 - sliding_window`` on when windowed (the one query sits at ``seq_len - 1``).
    """
    if is_cross_attn:
        return torch.zeros_like(encoder_lens), encoder_lens
    lo = encoder_lens
    if sliding_window is not None:
        lo = encoder_lens + (seq_lens - 1 - sliding_window).clamp_min(0)
    return lo, encoder_lens + seq_lens


def decode_kv_bounds(seq_lens: list[int], encoder_lens: list[int], sliding_window: int | None,
                     is_cross_attn: bool) -> tuple[list[int], list[int]]:
    """``decode_kv_range`` on Python ints (the plan's host arithmetic): [bs] lists -> lo, hi: [bs] lists."""
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
    KV blocks of ``block_size`` tokens (defaults: exactly what the batch needs).

    check_slots: check that every req_to_token entry the batch reads is a slot of k_cache (``[0, num_slots)``)
        and, with ``page_size`` > 1, that the table keeps the page layout; a host read of the used table rows, a
        sync when the table is on CUDA. Turn it off only where the caller guarantees the table (a serving loop
        that fills it from its own allocator).
    page_size: the cache's page size (SGLang's ``--page-size``): a request's positions ``[k * page_size,
        (k + 1) * page_size)`` are consecutive slots starting at a multiple of ``page_size``. With it > 1 K/V are
        gathered in runs of ``gcd(page_size, block_size)`` consecutive slots (blocks start at run boundaries).

    q: [bs, Hq, Dqk]; k_cache: [S, Hkv, Dqk]; v_cache: [S, Hkv, Dv]; req_to_token: [max_reqs, max_context_len];
    req_pool_indices, seq_lens (and encoder_lens): [bs]
    """
    validate.check_qkv(q, k_cache, v_cache)
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
    if check_slots:  # from the first block's start, a run boundary: the few positions it reads before lo too
        unit = gather_unit(page_size, block_size)
        start = lo if unit == 1 else [x - x % unit for x in lo]
        validate.check_slots(req_to_token, rows, start, hi, k_cache.shape[0])
        validate.check_page_layout(req_to_token, rows, start, hi, page_size)
    needed = total_blocks_needed(lo, hi, block_size, page_size)
    bs_cap = _capacity("batch_capacity", batch_capacity, bs)
    nblk = _capacity("block_capacity", block_capacity, needed)
    req_rows, kv_lo, kv_hi = _int64_rows([rows, lo, hi], bs_cap, device)
    inputs = DecodeInputs(req_rows, kv_lo, kv_hi, _arange(nblk, device), _arange(block_size, device))
    return DecodeMetadata(inputs, num_real=bs, blocks_needed=needed, slots_checked=check_slots, page_size=page_size)


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
    """Validate an extend (prefill) batch and build its metadata (per-request ranges, padded to ``batch_capacity``
    rows; ``extend.plan_extend_tiles`` cuts it into tiles).

    q: [num_tokens, Hq, Dqk] packed in request order; request i's queries are positions
    ``[extend_prefix_lens[i], seq_lens[i])`` of its self-attention range.
    check_slots, page_size: as in ``plan_decode`` (the tiles gather token by token: extend is bound by compute,
    not by the gather, so a page size only adds the layout check).
    """
    validate.check_qkv(q, k_cache, v_cache)
    validate.check_positive_int("page_size", page_size)
    device = q.device
    validate.check_tensor("seq_lens", seq_lens, 1, validate.INDEX_DTYPES, device)
    bs = seq_lens.shape[0]
    rows = validate.check_table(req_to_token, req_pool_indices, bs, device)
    lens = validate.check_lengths("seq_lens", seq_lens, bs, device)
    prefix = validate.check_lengths("extend_prefix_lens", extend_prefix_lens, bs, device)
    ext = validate.check_lengths("extend_seq_lens", extend_seq_lens, bs, device)
    enc = torch.tensor(_encoder_values(encoder_lens, is_cross_attn, bs, device), dtype=torch.int64)
    sliding_window = normalize_window(sliding_window)
    validate.check_window_and_cap(sliding_window, None)
    if not torch.equal(prefix + ext, lens):
        bad = int(torch.nonzero(prefix + ext != lens)[0, 0])
        raise ValueError(f"extend_prefix_lens + extend_seq_lens must equal seq_lens; request {bad}: "
                         f"{int(prefix[bad])} + {int(ext[bad])} != {int(lens[bad])}")
    num_tokens = int(ext.sum())
    if q.shape[0] != num_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens but sum(extend_seq_lens) is {num_tokens}")
    if is_cross_attn:
        if sliding_window is not None:
            raise ValueError("sliding_window applies to self-attention; it must be None with is_cross_attn=True")
        causal = False
        lo, kv_len, q_first = torch.zeros_like(enc), enc, torch.zeros_like(enc)
        validate.check_kv_end(enc, req_to_token.shape[1], "encoder_lens")
    else:
        validate.check_kv_end(enc + lens, req_to_token.shape[1],
                              "encoder_lens + seq_lens" if encoder_lens is not None else "seq_lens")
        skip = torch.zeros_like(prefix)
        if sliding_window is not None:  # keys before the first query's window are never read
            skip = (prefix - sliding_window).clamp_min(0)
        lo, kv_len, q_first = enc + skip, lens - skip, prefix - skip
    if check_slots:
        validate.check_slots(req_to_token, rows, lo, lo + kv_len, k_cache.shape[0])
        validate.check_page_layout(req_to_token, rows, lo, lo + kv_len, page_size)
    bs_cap = _capacity("batch_capacity", batch_capacity, bs)
    offsets = torch.cumsum(ext, 0) - ext
    inputs = ExtendInputs(
        req_rows=_pad(rows, bs_cap).to(device),
        kv_lo=_pad(lo, bs_cap).to(device),
        kv_len=_pad(kv_len, bs_cap).to(device),
        q_first=_pad(q_first, bs_cap).to(device),
        q_len=_pad(ext, bs_cap).to(device),
        q_offsets=_pad(offsets, bs_cap, fill=num_tokens).to(device),
    )
    return ExtendMetadata(inputs, causal=causal, sliding_window=sliding_window, num_real=bs, num_tokens=num_tokens)
