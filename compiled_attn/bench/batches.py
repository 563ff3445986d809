"""Random paged batches for the benchmarks and the tests: scattered, out-of-order slots and request rows, as a
long-running server's free lists look; slot 0 and row 0 (the padding targets) are never handed out."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def assign_requests(req_to_token: torch.Tensor, num_slots: int, lens: list[int],
                    generator: torch.Generator) -> torch.Tensor:
    """Give ``len(lens)`` requests random rows of ``req_to_token`` (row 0 excluded; the rows are cleared) and
    ``lens[i]`` random distinct slots in ``[1, num_slots)`` each, written in position order. Returns the rows,
    [bs] int64 on the table's device."""
    bs = len(lens)
    rows = torch.randperm(req_to_token.shape[0] - 1, generator=generator)[:bs] + 1
    slots = torch.randperm(num_slots - 1, generator=generator)[: sum(lens)] + 1
    rows = rows.to(req_to_token.device)
    req_to_token[rows] = 0
    used = 0
    for r, n in zip(rows.tolist(), lens, strict=False):
        req_to_token[r, :n] = slots[used:used + n].to(torch.int32).to(req_to_token.device)
        used += n
    return rows


def assign_paged_requests(req_to_token: torch.Tensor, num_slots: int, lens: list[int], page_size: int,
                          generator: torch.Generator) -> torch.Tensor:
    """As ``assign_requests``, in SGLang's paged layout: each request gets ``ceil(len / page_size)`` random distinct
    pages of ``page_size`` consecutive slots (page 0, holding the padding slot 0, is never handed out); position
    ``p`` sits at slot ``page * page_size + p % page_size``. Returns the rows."""
    bs = len(lens)
    rows = torch.randperm(req_to_token.shape[0] - 1, generator=generator)[:bs] + 1
    pages_per_req = [-(-n // page_size) for n in lens]
    pages = torch.randperm(num_slots // page_size - 1, generator=generator)[: sum(pages_per_req)] + 1
    rows = rows.to(req_to_token.device)
    req_to_token[rows] = 0
    used = 0
    for r, n, k in zip(rows.tolist(), lens, pages_per_req, strict=False):
        slots = (pages[used:used + k, None] * page_size + torch.arange(page_size)).reshape(-1)[:n]
        req_to_token[r, :n] = slots.to(torch.int32).to(req_to_token.device)
        used += k
    return rows


#: ``make_batch``'s ``slot_layout`` values
SLOT_LAYOUTS = ("scattered", "engine")
#: the engine layout's decode steps: a request's last tokens, one slot per request per step
ENGINE_DECODE_TAIL = 32


def assign_engine_requests(req_to_token: torch.Tensor, lens: list[int], tail: int,
                           generator: torch.Generator) -> torch.Tensor:
    """As ``assign_requests``, laid out as a fresh SGLang pool (page size 1) hands slots out: the batch's prompts
    (each request's first ``lens[i] - tail`` tokens) in one prefill allocation, so each prompt is one run of
    consecutive slots (requests in random order), then ``tail`` decode steps each taking one slot per request in
    batch order, so a request's last ``tail`` tokens lie a batch apart. Slot 0 is never handed out. Returns the
    rows."""
    bs = len(lens)
    rows = torch.randperm(req_to_token.shape[0] - 1, generator=generator)[:bs] + 1
    tails = [min(tail, n) for n in lens]
    table = torch.zeros(bs, req_to_token.shape[1], dtype=torch.int64)
    nxt = 1
    for i in torch.randperm(bs, generator=generator).tolist():
        p = lens[i] - tails[i]
        table[i, :p] = torch.arange(nxt, nxt + p)
        nxt += p
    for step in range(max(tails, default=0)):
        for i in range(bs):
            if step < tails[i]:
                table[i, lens[i] - tails[i] + step] = nxt
                nxt += 1
    rows = rows.to(req_to_token.device)
    req_to_token[rows] = table.to(req_to_token.dtype).to(req_to_token.device)
    return rows


@dataclass
class PagedBatch:
    """q: [num_tokens, Hq, Dqk]; k_cache: [num_slots, Hkv, Dqk]; v_cache: [num_slots, Hkv, Dv] (a view of k_cache
    for MLA); req_to_token: [bs + 4, width] int32; rows, seq_lens, prefix_lens, ext_lens (and encoder_lens):
    [bs] int64."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    req_to_token: torch.Tensor
    rows: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    ext_lens: torch.Tensor
    encoder_lens: torch.Tensor | None


def make_batch(seq_lens, prefix_lens=None, *, hq=4, hkv=2, dqk=16, dv=None, mla=False, dtype=torch.float32,
               encoder_lens=None, width=None, seed=0, decode=False, page_size=1, kv_dtype=None,
               slot_layout="scattered") -> PagedBatch:
    """Build caches holding each request's tokens at random slots and random rows (with ``page_size`` > 1: random
    pages, ``assign_paged_requests``; with ``slot_layout="engine"``, page size 1: prompts in runs of consecutive
    slots and the last ``ENGINE_DECODE_TAIL`` tokens a batch apart, ``assign_engine_requests``). ``kv_dtype``: the
    caches' dtype (default ``dtype``, the query's).

    With ``mla`` the V cache is a view of the first ``dv`` columns of the K (latent) cache. With ``decode`` each
    request has one query (its last position). ``encoder_lens`` tokens are stored before each decoder's tokens.
    """
    g = torch.Generator().manual_seed(seed)
    bs = len(seq_lens)
    seq = torch.tensor(seq_lens, dtype=torch.int64)
    prefix = (seq - 1).clamp_min(0) if decode else torch.tensor(prefix_lens or [0] * bs, dtype=torch.int64)
    ext = seq - prefix
    enc = (torch.tensor(encoder_lens, dtype=torch.int64) if encoder_lens is not None
           else torch.zeros(bs, dtype=torch.int64))
    total = enc + seq
    width = width or int(total.max()) + 3 if bs else 4
    kv_dtype = kv_dtype or dtype
    if page_size > 1:
        width = -(-width // page_size) * page_size
        num_slots = (sum(-(-int(n) // page_size) for n in total) + 3) * page_size
    else:
        num_slots = int(total.sum()) + 7
    dv = dv or dqk
    k_cache = torch.randn(num_slots, hkv, dqk, generator=g).to(kv_dtype)
    v_cache = k_cache[..., :dv] if mla else torch.randn(num_slots, hkv, dv, generator=g).to(kv_dtype)
    table = torch.zeros(bs + 4, width, dtype=torch.int32)
    if slot_layout not in SLOT_LAYOUTS:
        raise ValueError(f"slot_layout must be one of {SLOT_LAYOUTS}, got {slot_layout!r}")
    if slot_layout == "engine":
        if page_size > 1:
            raise ValueError("slot_layout='engine' lays out a page size of 1; pages are runs already")
        rows = assign_engine_requests(table, total.tolist(), ENGINE_DECODE_TAIL, g)
    elif page_size > 1:
        rows = assign_paged_requests(table, num_slots, total.tolist(), page_size, g)
    else:
        rows = assign_requests(table, num_slots, total.tolist(), g)
    q = torch.randn(int(ext.sum()), hq, dqk, generator=g).to(dtype)
    return PagedBatch(q, k_cache, v_cache, table, rows, seq, prefix, ext,
                      enc if encoder_lens is not None else None)
