"""Speculative verify (``k`` draft tokens per request) against ``k`` decode steps and the per-request loop.

One case: ``bs`` requests at llama-3-8b's attention shape (32/8 heads x 128), cached prefixes mixed 256..2048, ``k``
draft tokens each, as a chain (topk 1) or a random tree, in the model's dtype (query and cache). Timed round-robin
(``time_interleaved``), all compiled where ours:
  * ``verify``:  ``verify_blocks`` over the batch (the prefix read once for all ``k`` queries), index included;
  * ``decode1``: one decode step of the batch (``decode_blocks``, index included): the target is verify <= 1.5x;
  * ``decodek``: ``k`` decode steps (the draft tokens one at a time, as without verify);
  * ``loop``:    per request, SDPA of its ``k`` queries over its ``prefix + k`` keys with the bool mask (the
    efficient per-request form; SGLang's torch_native has no verify, and its extend algorithm pads the queries to
    the whole sequence, ``loop_baseline.loop_extend``, far slower and chain-only);
  * ``verify_eager`` and ``decode1_eager``: ``verify`` and ``decode1`` uncompiled (index included), as SGLang's
    CPU speculation runs its verify (its CPU graph runner does not run speculative decoding) and as a graph bucket
    replays a step measured faster eagerly (at bs 1, where the compiled call's guards cost more than they save);
  * ``verify_cached``: ``verify`` with every slot of its table folded into the first ``FOLD_SLOTS`` (their K/V
    stay in a core's cache): the arithmetic alone. ``cached_x_decode1`` = verify_cached / decode1 is the least
    ``x_decode1`` could be were every read of the K/V overlapped with that arithmetic;
  * ``read``: a one-pass read (``.sum()``) of the K/V bytes the batch's copy holds, the physical bound of a step
    that reads them (``x_read`` = verify / read).
With ``window`` (a sliding-window layer's, as gpt-oss alternates them) each reads each token's window only: draft
token ``i`` at ``prefix + depth_i`` sees keys from there less the window on.

Each timed call can read its K/V from memory (``cold_bytes``: the caches then hold that many bytes of copies of the
batch's K/V, and each call, each decode step of ``decodek`` too, reads the next copy): in a serving step a layer's
K/V comes from memory (the model's weights and every other layer's cache pass between two calls of one layer's
attention), while here every candidate reads the same K/V one after another, and at bs 8 (34 MB at llama's
shape) it fits a large last-level cache, so that whichever candidate follows another finds it there. (Writing a
buffer the size of the cache before each call instead would start every call with Python's and torch's own code
and data out of cache too, which a serving step does not see.)
"""
from __future__ import annotations

import itertools
import math

import torch

from profiling.timers import median, time_interleaved

from ..compile_policy import compile_step
from ..decode import build_decode_index, decode_blocks
from ..plan import plan_decode
from ..verify import build_verify_index, plan_verify, verify_blocks
from .batches import make_batch
from .models import get_attention_shape
from .ops_common import float32_words, mark_as_bucket

COLUMNS = ["op", "bs", "k", "mask", "window", "slots", "dtype", "verify_ms", "decode1_ms", "decodek_ms", "loop_ms",
           "x_decode1", "decodek_x", "loop_x", "verify_eager_ms", "decode1_eager_ms", "eager_x_decode1",
           "verify_cached_ms", "cached_x_decode1", "read_ms", "x_read", "tokens"]
# verify_cached's table: every slot folded into the first FOLD_SLOTS (llama's shape: 1 MB of K/V in float32, half
# that in bf16, inside one core's L2)
FOLD_SLOTS = 128


def random_tree(k: int, g: torch.Generator) -> torch.Tensor:
    """[k, k] bool ancestor-or-self mask of a random tree over the draft tokens (token 0 the root, each later
    token's parent an earlier one): query ``i`` sees draft key ``j`` when ``j`` is on its path to the root."""
    mask = torch.eye(k, dtype=torch.bool)
    for i in range(1, k):
        parent = int(torch.randint(0, i, (1,), generator=g))
        mask[i] |= mask[parent]
    return mask


def _verify_step(q, k_cache, v_cache, table, inputs, scale, window=None):
    return verify_blocks(q, k_cache, v_cache, build_verify_index(table, inputs, sliding_window=window), scale)


def _decode_step(q, k_cache, v_cache, table, inputs, scale):
    return decode_blocks(q, k_cache, v_cache, build_decode_index(table, inputs), scale)


def _loop(q, k_cache, v_cache, table, rows, prefix, k, mask, scale, window=None):
    """Per request: gather its ``prefix + k`` keys, one SDPA of its ``k`` queries with the [k, prefix + k] mask."""
    hq, hkv = q.shape[1], k_cache.shape[1]
    out = []
    for b, (row, p) in enumerate(zip(rows.tolist(), prefix.tolist(), strict=True)):
        slots = table[row, : p + k].long()
        kk, vv = k_cache[slots].transpose(0, 1)[None], v_cache[slots].transpose(0, 1)[None]
        m = torch.ones(k, p + k, dtype=torch.bool)
        m[:, p:] = mask[b]
        if window is not None:  # token i sits at p + its depth (the draft keys its row sees, less one)
            pos = torch.cat([torch.arange(p), p + mask[b].sum(-1) - 1])
            m &= pos[None, :] >= pos[p:, None] - window
        qq = q[b * k:(b + 1) * k].transpose(0, 1)[None]
        out.append(torch.nn.functional.scaled_dot_product_attention(
            qq, kk, vv, attn_mask=m, scale=scale, enable_gqa=hq != hkv)[0].transpose(0, 1))
    return torch.cat(out)


def bench_verify_case(bs: int, k: int, tree: bool, iters: int, *, seed: int = 0, name: str = "mha",
                      slot_layout: str = "scattered", dtype: torch.dtype = torch.float32,
                      window: int | None = None, cold_bytes: int = 0) -> dict:
    """One table row (``COLUMNS``): medians in ms and the ratios ``x_decode1`` = verify / one decode step,
    ``decodek_x`` = k decode steps / verify, ``loop_x`` = loop / verify (after checking verify, compiled and
    eager, against the loop), ``eager_x_decode1`` = the two uncompiled, ``cached_x_decode1`` = verify over K/V in
    cache / one decode step, ``x_read`` = verify / the one-pass read of the K/V.
    cold_bytes: > 0 keeps at least that many bytes of copies of the batch's K/V (and one more), each call reading
    the next (from memory when it exceeds the last-level cache); 0: one copy, read by every call."""
    shape = get_attention_shape(name)
    g = torch.Generator().manual_seed(seed + bs)  # the same prefixes for every k and mask at one batch size
    prefix = torch.randint(256, 2049, (bs,), generator=g)
    b = make_batch((prefix + k).tolist(), prefix.tolist(), hq=shape.hq, hkv=shape.hkv, dqk=shape.dqk, dv=shape.dv,
                   seed=seed, slot_layout=slot_layout, dtype=dtype)
    q, kc, vc, table, rows = b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows
    # copy c of the K/V at slots + c * S of caches that many times longer, read through its own table
    copies = 1 + math.ceil(cold_bytes / (kc.nbytes + vc.nbytes)) if cold_bytes > 0 else 1
    num_slots = kc.shape[0]
    kc, vc = (c.view(torch.uint8).repeat(copies, 1, 1).view(c.dtype) for c in (kc, vc))
    tables = [table + c * num_slots for c in range(copies)]
    for t in tables[1:]:
        torch._dynamo.mark_static(t)  # as mark_as_bucket marks the first (below): no recompile for a copy
    table, turn = tables[0], itertools.count()
    cached_table = table % FOLD_SLOTS  # runs of slots stay runs (but at the folds): the same paths as table's
    torch._dynamo.mark_static(cached_table)
    # the K/V bytes of each copy (its slots: the batch's tokens and a few more) for the one-pass read
    copy_words = [tuple(float32_words(c[i * num_slots:(i + 1) * num_slots]) for c in (kc, vc))
                  for i in range(copies)]

    def next_copy():
        return next(turn) % copies

    def next_table():
        return tables[next_copy()]

    scale = shape.dqk ** -0.5
    mask = (torch.stack([random_tree(k, g) for _ in range(bs)]) if tree
            else torch.ones(k, k, dtype=torch.bool).tril().expand(bs, k, k))
    meta = plan_verify(q, kc, vc, table, rows, prefix, k, mask.reshape(-1) if tree else None, sliding_window=window)
    verify = compile_step(_verify_step)
    decode = compile_step(_decode_step)
    q1 = q.view(bs, k, shape.hq, shape.dqk)
    # decode step j: the j-th draft token over the prefix and the j drafts before it (a chain's decode)
    steps = [(q1[:, j].contiguous(), plan_decode(q1[:, j], kc, vc, table, rows, prefix + j + 1,
                                                 sliding_window=window).inputs) for j in range(k)]
    for qj, inputs in [(q, meta.inputs), *steps]:
        mark_as_bucket(qj, kc, vc, table, inputs.block_offsets)

    def run_verify():
        return verify(q, kc, vc, next_table(), meta.inputs, scale, window)

    def run_decode1():
        return decode(steps[0][0], kc, vc, next_table(), steps[0][1], scale)

    def run_decodek():
        return [decode(qj, kc, vc, next_table(), inputs, scale) for qj, inputs in steps]

    def run_loop():
        return _loop(q, kc, vc, next_table(), rows, prefix, k, mask, scale, window)

    def run_verify_eager():
        return _verify_step(q, kc, vc, next_table(), meta.inputs, scale, window)

    def run_decode1_eager():
        return _decode_step(steps[0][0], kc, vc, next_table(), steps[0][1], scale)

    def run_verify_cached():
        return verify(q, kc, vc, cached_table, meta.inputs, scale, window)

    def run_read():
        k_words, v_words = copy_words[next_copy()]
        return k_words.sum() + v_words.sum()

    tol = 2e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(run_verify().float(), run_loop().float(), atol=tol, rtol=tol)
    torch.testing.assert_close(run_verify_eager().float(), run_loop().float(), atol=tol, rtol=tol)
    folded_loop = _loop(q, kc, vc, cached_table, rows, prefix, k, mask, scale, window)
    torch.testing.assert_close(run_verify_cached().float(), folded_loop.float(), atol=tol, rtol=tol)
    times = time_interleaved({"verify": run_verify, "decode1": run_decode1, "decodek": run_decodek,
                              "loop": run_loop, "verify_eager": run_verify_eager,
                              "decode1_eager": run_decode1_eager, "verify_cached": run_verify_cached,
                              "read": run_read}, warmup=2, iters=iters)
    t = {n: median(v) for n, v in times.items()}
    return {"op": f"{name} verify", "bs": bs, "k": k, "mask": "tree" if tree else "chain",
            "window": "-" if window is None else window, "slots": slot_layout,
            "dtype": str(dtype).replace("torch.", ""),
            "verify_ms": t["verify"] * 1e3, "decode1_ms": t["decode1"] * 1e3, "decodek_ms": t["decodek"] * 1e3,
            "loop_ms": t["loop"] * 1e3, "x_decode1": t["verify"] / t["decode1"],
            "decodek_x": t["decodek"] / t["verify"], "loop_x": t["loop"] / t["verify"],
            "verify_eager_ms": t["verify_eager"] * 1e3, "decode1_eager_ms": t["decode1_eager"] * 1e3,
            "eager_x_decode1": t["verify_eager"] / t["decode1_eager"],
            "verify_cached_ms": t["verify_cached"] * 1e3, "cached_x_decode1": t["verify_cached"] / t["decode1"],
            "read_ms": t["read"] * 1e3, "x_read": t["verify"] / t["read"], "tokens": int(prefix.sum()) + bs * k}
