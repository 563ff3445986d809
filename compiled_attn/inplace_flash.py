"""Keys that lie in place: runs of consecutive KV slots read by ATen's CPU flash kernel as views of the cache.

Why: the eager CPU flash forms gather K/V into tiles before the kernel reads them, and at decode that copy costs
about as much as the kernel itself. SGLang's allocator hands a prompt's tokens out as one run of consecutive slots
(a fresh pool's free list is in order, and a page is a run by definition), so most of a request's keys usually
lie in a few long runs. A run of at least ``MIN_RUN`` slots is one kernel call on ``cache[s:s + n]``, no copy; the
rest of the request's keys (the decode steps' scattered slots, a fragmented pool's short runs) are gathered as
before; the pieces are merged by their log-sum-exp. Each piece covers exactly the keys it reads, so no mask and no
slot outside the request's range is ever touched.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .block_flash import _flash_cpu, _gather_kv, slots_attention
from .merge import merge_normalised, merge_normalised_rows

#: runs of at least this many consecutive slots are read in place. Per key, a kernel call on a run of 64 slots cost
#: 1.7x (float32) and 2.9x (bf16) one on a run of 1024, and for bf16 more than gathering those keys; from 128 on
#: a run in place beat the gathering forms in both dtypes (llama-3-8b heads, 4 query rows per KV head, 2 threads)
MIN_RUN = 128
#: the in-place form is taken when at least this share of a batch's keys lies in such runs
MIN_IN_PLACE_SHARE = 0.5
#: the in-place form is looked for from this many bytes of K on: finding the runs costs a few dozen small ops (tens
#: of us), about what gathering 1 MiB costs (a tiny model's batch of one at 1k tokens gathers 128 KiB)
MIN_IN_PLACE_BYTES = 1 << 20
#: the requests' keys outside long runs (decode steps' scattered slots) go through one padded kernel call when that
#: computes at most this multiple of them and their float32 K fits ``REST_BYTES``; else each request's in chunks
REST_PAD_WASTE = 1.5
REST_BYTES = 4 << 20


def reads_in_place(q_dtype: torch.dtype, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float,
                   v_scale: float, keys: int) -> bool:
    """Whether to look for runs: the kernel can read the caches as they are (the query's dtype, no dequantisation
    scale, each slot's ``[Hkv, D]`` rows contiguous, as a view ``cache[s:e]`` must give them) and the batch's K
    (``keys`` slots at most) is worth not copying: at least ``MIN_IN_PLACE_BYTES``."""
    return (keys * k_cache.shape[1] * k_cache.shape[2] * k_cache.element_size() >= MIN_IN_PLACE_BYTES
            and k_scale == 1.0 and v_scale == 1.0
            and all(c.dtype == q_dtype and c.stride(2) == 1 and c.stride(1) == c.shape[2] and c.device.type == "cpu"
                    for c in (k_cache, v_cache)))


@dataclass
class KeyRuns:
    """A batch's keys split for ``requests_in_place``: the long runs, read in place, and the rest, gathered.

    runs: (request, first slot, length) of every run of at least ``MIN_RUN`` consecutive slots
    rest: [m] int64 host, the other keys' slots, request by request, each in position order
    rest_counts: how many of ``rest`` each request has
    """

    runs: list[tuple[int, int, int]]
    rest: torch.Tensor
    rest_counts: list[int]


def key_runs(slots: torch.Tensor, lens: list[int]) -> KeyRuns | None:
    """Split ``slots`` ([n] host int64: the batch's keys end to end, request ``i`` holding ``lens[i]`` of them in
    position order) into runs of consecutive slots (a request's end always ending one); None when under
    ``MIN_IN_PLACE_SHARE`` of the keys lie in runs of ``MIN_RUN`` or more. Tensor ops over the batch and lists of
    the long runs only: a scattered layout (a run per key) costs a few ops, not a Python step per key."""
    n = slots.shape[0]
    if n < MIN_RUN:
        return None
    if len(lens) == 1:  # a batch of one: decoding alone, its keys are often one run (three ops to tell)
        first = int(slots[0])
        if int(slots[-1]) - first == n - 1 and torch.equal(slots, torch.arange(first, first + n)):
            return KeyRuns([(0, first, n)], slots[:0], [0])
    brk = torch.ones(n, dtype=torch.bool)
    torch.ne(slots[1:], slots[:-1] + 1, out=brk[1:])
    # quick refusal (scattered slots): keys in long runs need at least that many, less a key per run, consecutive
    if n - int(brk.sum()) < MIN_IN_PLACE_SHARE * n - n / MIN_RUN:
        return None
    count = torch.tensor(lens, dtype=torch.int64)
    ends = torch.cumsum(count, 0)
    brk[ends[:-1][ends[:-1] < n]] = True
    starts = brk.nonzero().squeeze(1)
    lengths = torch.diff(starts, append=starts.new_tensor([n]))
    long = lengths >= MIN_RUN
    if int(lengths[long].sum()) < MIN_IN_PLACE_SHARE * n:
        return None
    request = torch.repeat_interleave(torch.arange(len(lens)), count)  # [n] each key's request
    rest = ~torch.repeat_interleave(long, lengths)
    firsts = starts[long]
    runs = list(zip(request[firsts].tolist(), slots[firsts].tolist(), lengths[long].tolist(), strict=True))
    return KeyRuns(runs, slots[rest], torch.bincount(request[rest], minlength=len(lens)).tolist())


def position_slots(runs: torch.Tensor, unit: int, shape: torch.Size) -> torch.Tensor:
    """The slot of every block position, ``shape`` = a block table's ``valid`` ``[nblk, block_size]``, from ``runs``
    (slots, or with ``unit`` > 1 the index of each run of ``unit`` consecutive slots)."""
    if unit == 1:
        return runs
    return (runs[:, :, None] * unit + torch.arange(unit, device=runs.device)).reshape(shape)


def requests_in_place(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, runs: torch.Tensor,
                      valid: torch.Tensor, block_req: torch.Tensor, scale: float, chunk_tokens: int, unit: int,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A batch's queries over its block table (decode's or verify's ``DecodeIndex`` tensors: ``runs`` [nblk,
    block_size // unit], ``valid`` [nblk, block_size], ``block_req`` [nblk], a request's valid positions one range
    of its consecutive blocks) with the long runs read in place (``attend_runs``), where ``reads_in_place`` and at
    least ``MIN_IN_PLACE_SHARE`` of the keys lie in long runs; None otherwise. What the CPU ops run when called
    from compiled code; eager callers use ``index_in_place`` (the runs found once per step)."""
    if not reads_in_place(q.dtype, k_cache, v_cache, k_scale, v_scale, valid.numel()):
        return None
    found = _table_key_runs(runs, valid, block_req, q.shape[0], unit)
    return None if found is None else attend_runs(q, k_cache, v_cache, found, scale, chunk_tokens)


def index_in_place(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index, scale: float,
                   chunk_tokens: int, k_scale: float = 1.0, v_scale: float = 1.0
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``requests_in_place`` over a ``decode.DecodeIndex`` (a batch of one through its host ``single`` slots), its
    runs found on the first layer that asks and kept on the index: every layer of a step reads the same slots (an
    index is one step's; its tensors do not change once built)."""
    keys = index.single.shape[0] if index.single is not None else index.valid.numel()
    if not reads_in_place(q.dtype, k_cache, v_cache, k_scale, v_scale, keys):
        return None
    if not index.key_runs:
        index.key_runs = (key_runs(index.single, [keys]) if index.single is not None
                          else _table_key_runs(index.runs, index.valid, index.block_req, q.shape[0], index.unit),)
    found = index.key_runs[0]
    return None if found is None else attend_runs(q, k_cache, v_cache, found, scale, chunk_tokens)


def _table_key_runs(runs: torch.Tensor, valid: torch.Tensor, block_req: torch.Tensor, bs: int, unit: int
                    ) -> KeyRuns | None:
    slots = position_slots(runs, unit, valid.shape).reshape(-1)[valid.reshape(-1)]  # each request's keys, in turn
    per_block = valid.sum(1)
    return key_runs(slots, per_block.new_zeros(bs + 1).index_add_(0, block_req, per_block)[:bs].tolist())


def attend_runs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: KeyRuns, scale: float,
                chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each long run as one kernel call on views of the caches, all requests' other keys in one padded call (or in
    chunks per request), every partial merged in one pass. q: [bs, Hkv, R, D] in the caches' dtype -> o [bs, Hkv,
    R, D] float32 normalised (zeros for a request with no key), lse [bs, Hkv, R] (the float32 minimum there)."""
    q = q.contiguous()  # the kernel reads q through its strides unchecked
    outs, lses, rows = [], [], []
    for request, first, n in keys.runs:
        k = k_cache[first:first + n].unsqueeze(0).transpose(1, 2)  # [1, Hkv, n, D], the strides of a gathered tile
        v = v_cache[first:first + n].unsqueeze(0).transpose(1, 2)
        o, lse = _flash_cpu(q[request:request + 1], k, v, 0.0, False, scale=scale)[:2]
        outs.append(o)
        lses.append(lse)
        rows.append(request)
    if keys.rest.shape[0]:
        o, lse, rest_rows = _rests_attention(q, k_cache, v_cache, keys.rest, keys.rest_counts, scale, chunk_tokens)
        outs.append(o)
        lses.append(lse)
        rows += rest_rows
    if rows == list(range(q.shape[0])):  # one partial per request, in order: nothing to merge
        return torch.cat(outs).float(), torch.cat(lses)
    return merge_normalised_rows(torch.cat(outs), torch.cat(lses), torch.tensor(rows), q.shape[0])


def _rests_attention(q, k_cache, v_cache, rest: torch.Tensor, counts: list[int], scale: float, chunk_tokens: int
                     ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The keys outside long runs (``rest``, ``counts[i]`` of them request ``i``'s): one gather and one kernel call
    for all, each request padded to the longest with its own last key masked out, when that computes at most
    ``REST_PAD_WASTE``x the keys and fits ``REST_BYTES``; else each request's in chunks of ``chunk_tokens``.
    -> (o, lse) with a partial per request that has such keys, and those requests."""
    rows = [i for i, c in enumerate(counts) if c]
    lens = [counts[i] for i in rows]
    width, hkv, d = max(lens), k_cache.shape[1], k_cache.shape[2]
    n = torch.tensor(lens)
    starts = torch.cumsum(n, 0) - n
    if len(rows) * width > REST_PAD_WASTE * sum(lens) or len(rows) * width * hkv * d * 4 > REST_BYTES:
        parts = []
        for i, a, c in zip(rows, starts.tolist(), lens, strict=True):
            mine = rest[a:a + c]
            chunks = [slots_attention(q[i:i + 1], k_cache, v_cache, mine[b:b + chunk_tokens], scale)
                      for b in range(0, c, chunk_tokens)]
            parts.append(merge_normalised(chunks))
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), rows
    # a padding position repeats the request's last key (finite data it owns), masked out below
    pos = starts[:, None] + torch.minimum(torch.arange(width)[None, :], (n - 1)[:, None])
    k, v = _gather_kv(k_cache, v_cache, rest[pos].reshape(-1), 1, len(rows), width, q.dtype, 1.0, 1.0)
    bias = None
    if min(lens) < width:
        keep = torch.arange(width)[None, :] < n[:, None]
        bias = torch.where(keep, 0.0, float("-inf")).to(q.dtype)[:, None, None, :]
    o, lse = _flash_cpu(q[rows], k, v, 0.0, False, attn_mask=bias, scale=scale)[:2]
    return o, lse, rows
