"""The CPU form of the ragged tiled extend: each query tile's key tiles through ATen's CPU flash kernel.

A query tile's consecutive key tiles run in spans of up to ``span_keys`` keys, one kernel call each, merged by
log-sum-exp into the tile's own output rows; a request's keys are gathered once (up to ``HELD_BYTES``), valid keys
only, so the padding slot is never read. A long enough causal run of tiles runs whole (``_trapezoid``). The loop is
an opaque op that reads its small CPU tensors on the host; only the kernel calls run multi-threaded (the small ops
around them, as parallel regions on a busy machine, stalled on a descheduled thread).
"""
from __future__ import annotations

import contextlib

import torch

from ...compile_policy import opaque_op
from ...kv import compute_dtype, dequantize, gather_rows

_aten_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@contextlib.contextmanager
def run_on_threads(n: int):
    """Run the enclosed ops on ``n`` intra-op threads, then restore the caller's count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)

#: float32 K bytes gathered per kernel call: the kernel is compute-bound here, so long spans (fewer merges) win
SPAN_BYTES = 8 << 20
#: the most float32 K bytes of one request's keys held across its query tiles (V doubles it)
HELD_BYTES = 64 << 20
#: a causal request whose new tokens span at least this many query tiles runs as its prefix and one causal square
CAUSAL_SQUARE_TILES = 4
#: ... or (two tiles or more) at least this many new tokens, where ATen's kernel takes its large query block
CAUSAL_SQUARE_ROWS = 768


def span_keys_for(num_kv_heads: int, head_dim: int) -> int:
    """Keys per gathered span so that its float32 K is about ``SPAN_BYTES``."""
    return max(64, SPAN_BYTES // (num_kv_heads * head_dim * 4))


def tile_flash_refusal(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, logit_cap: float | None) -> str:
    """Why ``ragged_tile_flash`` cannot serve an extend call, or "" where it can. ATen's CPU flash kernel has no
    soft-cap and needs one head size: a narrower V is zero-padded to Dqk and the output sliced back."""
    if q.device.type != "cpu":
        return f"not a CPU call ({q.device.type})"
    if logit_cap is not None:
        return "a soft-cap (ATen's flash kernel has none)"
    if not q.shape[-1] == k_cache.shape[-1] >= v_cache.shape[-1]:
        return "V's head size above K's"
    return ""


def _runs(q_start: list[int], k_count: list[int]) -> list[tuple[int, int]]:
    """The pair list cut into runs ``[i, j)``: the consecutive pairs of one query tile (a bucket's padding, pairs
    with no key, skipped). A run's keys are one contiguous range of positions, valid ones first."""
    runs, i, n = [], 0, len(q_start)
    while i < n:
        if k_count[i] == 0:
            i += 1
            continue
        j = i + 1
        while j < n and q_start[j] == q_start[i] and k_count[j]:
            j += 1
        runs.append((i, j))
        i = j
    return runs


@opaque_op
def ragged_tile_flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                      q_start: torch.Tensor, q_count: torch.Tensor, k_count: torch.Tensor, full: torch.Tensor,
                      q_rel: torch.Tensor, scale: float, span_keys: int, causal: bool, window: int,
                      k_scale: float = 1.0, v_scale: float = 1.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Ragged extend attention over the plan's (query tile, key tile) pairs, on CPU.

    q: [num_tokens, Hq, D]; k_cache: [num_slots, Hkv, D]; v_cache: [num_slots, Hkv, Dv], Dv <= D, any
    ``kv.KV_DTYPES`` (dequantised with k_scale/v_scale; the kernel computes in ``kv.compute_dtype``)
    slots: [P, TK] int64, a pair's key slots, valid ones first; q_start, q_count, k_count, q_rel: [P] int64;
    full: [P] bool (``extend.ExtendTileInputs``); causal, window: the mask of spans not full (window -1: none)
    sinks: [Hkv, group] float32 attention-sink logits joining every query's softmax denominator, or None
    returns [num_tokens, Hkv, group, Dv] float32 (zeros for a query that sees no key).
    """
    kernel_threads = torch.get_num_threads()
    q = q.contiguous()  # the ATen kernel reads q through its strides unchecked: a strided head dim gave garbage

    def flash(*args, **kwargs):  # the kernel calls get the caller's threads; the small ops around them get one
        with run_on_threads(kernel_threads):
            return _aten_flash_cpu(*args, **kwargs)

    with run_on_threads(1):
        return _ragged_tile_flash(flash, q, k_cache, v_cache, slots, q_start, q_count, k_count, full, q_rel, scale,
                                  span_keys, causal, window, k_scale, v_scale, sinks)


def _ragged_tile_flash(flash, q, k_cache, v_cache, slots, q_start, q_count, k_count, full, q_rel, scale, span_keys,
                       causal, window, k_scale, v_scale, sinks):
    t, hq, d = q.shape
    dtype = compute_dtype(q.dtype, k_cache.dtype)
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    group = hq // hkv
    # empty, not zeros (a large zero fill is page-faulted every call); rows no tile writes are zeroed at the end
    out = q.new_empty((t, hkv, group, dv), dtype=torch.float32)
    written = torch.zeros(t, dtype=torch.bool)
    qs, qc, kc, fl, rel = q_start.tolist(), q_count.tolist(), k_count.tolist(), full.tolist(), q_rel.tolist()
    tk = slots.shape[1]
    flat_slots = slots.reshape(-1)

    def gather(idx):
        k = dequantize(gather_rows(k_cache, idx), dtype, k_scale)
        v = dequantize(gather_rows(v_cache, idx), dtype, v_scale)
        if dv < d:  # zero columns: the kernel's output gains d - dv columns of zeros, sliced off at the end
            v = torch.nn.functional.pad(v, (0, d - dv))
        n = idx.shape[0]
        return k.view(1, n, hkv, d).transpose(1, 2), v.view(1, n, hkv, d).transpose(1, 2)

    runs = _runs(qs, kc)
    n_keys = [sum(kc[i:j]) for i, j in runs]
    first_slot = slots[:, 0].tolist()
    max_held = HELD_BYTES // (hkv * d * 4)
    held = (None, None, None)  # (slots, k, v) of the last gather
    r = -1
    while r + 1 < len(runs):
        r += 1
        i, j = runs[r]
        n_q, n_k = qc[i], n_keys[r]
        i_keys, square = i, None
        if causal and window < 0 and n_k >= rel[i] + n_q:
            # a causal tile that sees every key up to its last query: with the request's next tiles it may form a
            # causal square or a trapezoid (a prefix of rel[i] keys, then the square), run whole (``_trapezoid``)
            last = _causal_square_end(runs, r, qs, qc, rel, n_keys, first_slot, max_held)
            if last > r or rel[i] == 0:
                square = rel[i]  # the keys before the square
                a = runs[last][0]
                r, j, i_keys = last, runs[last][1], a
                n_q = qs[a] + qc[a] - qs[i]
                n_k = square + n_q  # the visible keys: the first ones of the last tile's range
        # key tiles are contiguous and only a range's last is partial
        keys = flat_slots[i_keys * tk:i_keys * tk + n_k]
        if n_k > max_held:
            held = (None, None, None)
        elif held[0] is None or held[0].shape[0] < n_k or not torch.equal(held[0][:n_k], keys):
            s_ = r  # the longest run from here on that starts at the same key
            while s_ + 1 < len(runs) and first_slot[runs[s_ + 1][0]] == first_slot[i]:
                s_ += 1
            best = max(range(r, s_ + 1), key=lambda x: n_keys[x])
            big = flat_slots[runs[best][0] * tk:runs[best][0] * tk + n_keys[best]]
            if n_keys[best] > max_held or not torch.equal(big[:n_k], keys):
                big = keys
            held = (big, *gather(big))
        q_tile = q[qs[i]:qs[i] + n_q].to(dtype)
        if square is not None:
            k, v = (held[1][:, :, :n_k], held[2][:, :, :n_k]) if held[0] is not None else gather(keys)
            rows = out[qs[i]:qs[i] + n_q].permute(1, 2, 0, 3)  # [Hkv, group, n_q, Dv]: the merge writes here
            o, lse = _trapezoid(flash, q_tile, k, v, square, scale, None if sinks is not None else rows)
            if sinks is not None:
                rows.copy_(apply_sinks(o[..., :dv], lse, sinks[..., None]))
            written[qs[i]:qs[i] + n_q] = True
            continue
        folded = _fold(q_tile, hkv)
        acc = None
        a = i
        while a < j:  # spans of consecutive pairs, at most span_keys keys (at least one pair)
            b, n = a + 1, kc[a]
            while b < j and n + kc[b] <= span_keys:
                n, b = n + kc[b], b + 1
            lo = (a - i) * tk
            if held[0] is None:
                k, v = gather(keys[lo:lo + n])
            else:
                k, v = held[1][:, :, lo:lo + n], held[2][:, :, lo:lo + n]
            if all(fl[a:b]):
                acc = _accumulate(acc, *flash(folded, k, v, 0.0, False, scale=scale))
            else:
                vis = _visible(rel[a], n_q, n, causal, window).repeat(group, 1)
                bias = torch.where(vis, 0.0, float("-inf")).to(dtype)[None, None]
                o, lse = flash(folded, k, v, 0.0, False, attn_mask=bias, scale=scale)
                # the kernel gives a row with every key masked lse 0 (o 0); it must weigh nothing in a merge
                acc = _accumulate(acc, o, torch.where(vis.any(1), lse, float("-inf")))
            a = b
        o = apply_sinks(acc[0][0].view(hkv, group, n_q, d)[..., :dv], acc[1][0].view(hkv, group, n_q),
                        None if sinks is None else sinks[..., None])
        out[qs[i]:qs[i] + n_q] = o.permute(2, 0, 1, 3)
        written[qs[i]:qs[i] + n_q] = True
    if not bool(written.all()):
        out[~written] = 0.0
    return out


def _fold(q_tile: torch.Tensor, hkv: int) -> torch.Tensor:
    """[n_q, Hq, D] -> [1, Hkv, group * n_q, D]: the group's heads go into the query-sequence dimension, so one K/V
    head serves group * n_q rows."""
    n_q, hq, d = q_tile.shape
    return q_tile.view(n_q, hkv, hq // hkv, d).permute(1, 2, 0, 3).reshape(1, hkv, hq // hkv * n_q, d)


def _trapezoid(flash, q_tile, k, v, prefix: int, scale: float, out: torch.Tensor | None = None):
    """``n_q`` queries over ``prefix + n_q`` keys, query ``a`` seeing keys ``[0, prefix + a]``: the prefix as one
    unmasked call, the last ``n_q`` keys as the kernel's own causal square (it skips the masked half), merged by
    log-sum-exp. The heads stay unfolded: the rows already fill the kernel's large query block.
    q_tile: [n_q, Hq, D]; k, v: [1, Hkv, prefix + n_q, D] -> o [Hkv, group, n_q, D] float32, lse [Hkv, group, n_q];
    or, given ``out`` ([Hkv, group, n_q, Dv], float32, any strides), o written there and (None, None) returned."""
    n_q, hq, d = q_tile.shape
    hkv = k.shape[1]
    qv = q_tile.permute(1, 0, 2)[None]
    o, lse = flash(qv, k[:, :, prefix:], v[:, :, prefix:], 0.0, True, scale=scale)
    o, lse = o[0].float().view(hkv, hq // hkv, n_q, d), lse[0].view(hkv, hq // hkv, n_q)
    if not prefix:
        if out is None:
            return o, lse
        out.copy_(o[..., :out.shape[-1]])
        return None, None
    o_p, lse_p = flash(qv, k[:, :, :prefix], v[:, :, :prefix], 0.0, False, scale=scale)
    o_p, lse_p = o_p[0].float().view(hkv, hq // hkv, n_q, d), lse_p[0].view(hkv, hq // hkv, n_q)
    if out is None:
        return merge_two(o_p, lse_p, o, lse)
    dv = out.shape[-1]
    merge_two(o_p[..., :dv], lse_p, o[..., :dv], lse, out=out)
    return None, None


def _causal_square_end(runs, r, qs, qc, rel, n_keys, first_slot, max_held) -> int:
    """The last run of the causal square (or trapezoid) that starts at run ``r``: the following runs whose query
    tiles continue it (next queries, same first key, keys up to their last query); ``r`` where it is too short."""
    i = runs[r][0]
    last = r
    while last + 1 < len(runs):
        a = runs[last + 1][0]
        offset = rel[i] + qs[a] - qs[i]
        if (qs[a] != qs[runs[last][0]] + qc[runs[last][0]] or first_slot[a] != first_slot[i] or rel[a] != offset
                or n_keys[last + 1] < offset + qc[a] or offset + qc[a] > max_held):
            break
        last += 1
    # a short square stays tiled: its folded GQA tiles beat one causal call with the heads unfolded
    rows = qs[runs[last][0]] + qc[runs[last][0]] - qs[i]
    return last if last - r + 1 >= CAUSAL_SQUARE_TILES or (last > r and rows >= CAUSAL_SQUARE_ROWS) else r


def _visible(first: int, n_q: int, n_k: int, causal: bool, window: int) -> torch.Tensor:
    """[n_q, n_k] bool: key c visible to query a, whose position relative to the span's first key is first + a."""
    qpos = torch.arange(first, first + n_q)[:, None]
    keys = torch.arange(n_k)[None, :]
    vis = torch.ones(n_q, n_k, dtype=torch.bool)
    if causal:
        vis &= keys <= qpos
    if window >= 0:
        vis &= keys >= qpos - window
    return vis


def _accumulate(acc, o, lse):
    o = o.float()  # a half-precision kernel's spans are merged in float32
    return (o, lse) if acc is None else merge_two(acc[0], acc[1], o, lse)


@torch.library.register_fake(ragged_tile_flash)
def _ragged_tile_flash_fake(q, k_cache, v_cache, slots, q_start, q_count, k_count, full, q_rel, scale, span_keys,
                            causal, window, k_scale=1.0, v_scale=1.0, sinks=None):
    hkv = k_cache.shape[1]
    return q.new_empty((q.shape[0], hkv, q.shape[1] // hkv, v_cache.shape[2]), dtype=torch.float32)


def apply_sinks(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """A normalised output ``o: [..., Dv]`` with its rows' log-sum-exp ``lse: [...]`` after the sinks (broadcast
    against ``lse``) join the denominator: ``o * e^lse / (e^lse + e^sink) = o * sigmoid(lse - sink)``, float32."""
    o = o.float()
    if sinks is None:
        return o
    return o * torch.sigmoid(lse - sinks)[..., None]


def merge_two(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor,
              out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Two normalised partial softmaxes of the same rows -> one (log-sum-exp rule); a row with no key on either
    side has lse -inf and stays zero. o: [..., L, D]; lse: [..., L]; ``out``: where the merged o is written (any
    strides), else a new tensor. One pass over the outputs (``lerp``), the weights computed on the small lse."""
    m = torch.maximum(lse_a, lse_b).clamp_min(torch.finfo(torch.float32).min)  # finite: no inf - inf
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    den = w_a + w_b
    o = torch.lerp(o_a, o_b, (w_b / den.clamp_min(torch.finfo(torch.float32).tiny))[..., None], out=out)
    return o, m + torch.log(den)
