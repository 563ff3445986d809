"""The C++ kernel's merged op (``native_decode.native_decode_blocks``: the blocks, verify's draft keys and each row's
merge in one call) against float64 computations written out here: unused blocks of a bucket, rows with no block,
sinks and a soft-cap, the draft keys under a per-token mask, and the work split between threads (a row's items, or
where they are few its KV heads) on the vector, wide and tile paths with 1, 2 and 3 threads."""
from __future__ import annotations

import pytest
import torch

from compiled_attn.kernels.cpu.kernel import native_available, native_decode_blocks
from tests.reference import scaled_queries
from tests.test_native_decode import _batch

pytestmark = pytest.mark.skipif(not native_available(), reason="no C++ compiler on this machine")


@pytest.mark.parametrize("with_sinks", [False, True])
def test_merged_decode_skips_unused_blocks_and_matches_float64(with_sinks):
    """``native_decode_blocks`` (blocks and merge in one call) over a bucket's index with unused blocks and a row
    that has none: the unused blocks are never computed (their slots point past the cache: a read would be refused),
    a row with no block gives zeros (or, with sinks, still zeros: a sink has no value), and every row equals the
    float64 softmax over its keys, with the sinks in its denominator."""
    b, index = _batch([40, 130, 3], hq=8, hkv=2, d=64, page_size=1, block_size=16)
    rows = 4  # one more row than requests: it owns no block
    qs = scaled_queries(torch.cat([b.q, b.q[:1]]), 2, 0.125)
    n = int((index.block_req < 3).sum())
    block_req = torch.cat([index.block_req[:n], torch.full((5,), rows)])  # five unused blocks, as a bucket pads
    block_slots = torch.cat([index.slots[:n], torch.full((5, index.slots.shape[1]), 10 ** 9)])  # never read
    valid = torch.cat([index.valid[:n], torch.ones(5, index.valid.shape[1], dtype=torch.bool)])
    sinks = torch.randn(2, 4) if with_sinks else None
    out = native_decode_blocks(qs.flatten(1, 2), block_req, block_slots, valid, b.k_cache, b.v_cache, 1.0, 1.0, 0.0,
                               rows, sinks).unflatten(1, (2, -1))  # q token-major, one token per row: [rows, Hq, D]
    assert (out[3] == 0).all()
    for r, length in enumerate([40, 130, 3]):
        slots = b.req_to_token[b.rows[r], :length].long()
        q = qs[r].double()  # [Hkv, G, D]
        s = torch.einsum("hgd,nhd->hgn", q, b.k_cache[slots].double())
        if with_sinks:
            s = torch.cat([s, sinks.double()[..., None]], -1)
        p = torch.softmax(s, -1)[..., :length]
        want = torch.einsum("hgn,nhd->hgd", p, b.v_cache[slots].double())
        torch.testing.assert_close(out[r].double(), want, atol=1e-5, rtol=1e-5)


def _check_draft_merge(lens, *, hq, hkv, block_size, page_size, bf16, tokens=4, nd=6, seed=1):
    """The merged op over ``lens`` (and one more row with no block that sees no draft key) with ``nd`` draft keys a
    row, ``tokens`` query tokens a row (q token-major, bf16 as it is where ``bf16``: the tile path where it serves
    ``tokens * hq // hkv`` rows per KV head), no cap and no sink, then a soft-cap and sinks: against float64."""
    d, group = 64, hq // hkv
    b, index = _batch(lens, hq=tokens * group * hkv, hkv=hkv, d=d, page_size=page_size, block_size=block_size,
                      kv_dtype=torch.bfloat16)
    q = torch.cat([b.q, b.q[:1]])
    if bf16:
        q = q.bfloat16()
    rows, G = len(lens) + 1, tokens * group  # the last row owns no block and sees no draft key
    qs = scaled_queries(q, hkv, 0.125)  # [rows, hkv, G, d]: row (h, t * group + g) is token t's head h * group + g
    g = torch.Generator().manual_seed(seed)
    n = int((index.block_req < len(lens)).sum())
    block_req = torch.cat([index.block_req[:n], torch.full((3,), rows)])
    block_slots = torch.cat([index.slots[:n], torch.full((3, index.slots.shape[1]), 10 ** 9)])  # never read
    valid = torch.cat([index.valid[:n], torch.ones(3, index.valid.shape[1], dtype=torch.bool)])
    written = torch.cat([b.req_to_token[b.rows[r], :ln].long() for r, ln in enumerate(lens)])  # others hold NaN
    slots = written[torch.randint(0, written.shape[0], (rows, nd), generator=g)]
    shows = torch.rand(rows, tokens, nd, generator=g) < 0.6
    shows[-1] = False
    sinks = torch.randn(hkv, G, generator=g)
    for cap, sink in ((0.0, None), (4.0, sinks)):
        q_tokens = ((qs / 0.125).view(rows, hkv, tokens, group, d).transpose(1, 2).reshape(rows * tokens, hq, d)
                    .to(q.dtype))
        out = native_decode_blocks(q_tokens, block_req, block_slots, valid, b.k_cache, b.v_cache, 0.125, 1.0, cap,
                                   rows, sink, 1.0 if bf16 else 0.0, slots, shows, tokens)
        assert out.dtype == q.dtype and out.shape == (rows * tokens, hq, d)
        out = out.view(rows, tokens, hkv, group, d).transpose(1, 2).reshape(rows, hkv, G, d)  # as qs's rows
        assert (out[-1] == 0).all()
        for r, length in enumerate(lens):
            keys = torch.cat([b.req_to_token[b.rows[r], :length].long(), slots[r]])
            s = torch.einsum("hgd,nhd->hgn", qs[r].double(), b.k_cache[keys].double())
            if cap:
                s = cap * torch.tanh(s / cap)
            seen = torch.cat([torch.ones(tokens, length, dtype=torch.bool), shows[r]], 1)  # [tokens, keys]
            s = s.masked_fill(~seen.repeat_interleave(group, 0)[None], -torch.inf)
            if sink is not None:
                s = torch.cat([s, sink.double()[..., None]], -1)
            p = torch.softmax(s, -1)[..., :keys.shape[0]]
            want = torch.einsum("hgn,nhd->hgd", p, b.v_cache[keys].double())
            tol = 4e-3 if bf16 else 1e-5
            torch.testing.assert_close(out[r].double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("bf16", [False, True], ids=["vector", "tiles"])
def test_draft_keys_join_each_rows_merge(bf16, page_size):
    """Verify's draft block in the merged op: each row's blocks and its draft keys (``draft_slots``), of which each
    query token sees those ``draft_mask`` shows it (query row i of a KV head is token i // (G // tokens)), merged
    into one softmax, against float64 with sinks and a soft-cap; a row with no block and no key it sees gives
    zeros, a bucket's unused blocks are skipped. With a bf16 query and 16 rows per KV head its blocks take the tile
    path where there is one (the draft keys are float32 arithmetic on every path). The op reads q token-major as
    verify holds it (a row's 4 tokens x 8 heads; bf16 as it is, the softmax scale in k_scale) and writes its output
    so, in q's dtype (bf16 rounded as torch rounds)."""
    _check_draft_merge([40, 130, 3], hq=8, hkv=2, block_size=32, page_size=page_size, bf16=bf16)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("lens, block_size", [([40], 64), ([100], 64), ([30, 300], 32)],
                         ids=["one-block", "one-row", "mixed"])
@pytest.mark.parametrize("hq, bf16", [(8, False), (16, False), (16, True)], ids=["vector", "wide", "tiles"])
def test_work_split_between_threads(hq, bf16, lens, block_size, threads):
    """How the kernel shares a call between threads does not change its result: one block or one short row (each
    item split into groups of KV heads: with 2 threads each thread takes its groups of every item and merges their
    rows, with 3 the groups are claimed in turn), and a short row beside a long one (whole items, claimed in turn),
    on the vector path (8 query rows per KV head, float32 query), the wide path (16 rows, float32 query) and the
    tile path (16 rows, bf16 query, where there is one), against float64."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_draft_merge(lens, hq=hq, hkv=4, block_size=block_size, page_size=1, bf16=bf16, seed=threads)
    finally:
        torch.set_num_threads(before)
