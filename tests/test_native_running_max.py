"""The tile path's running softmax across a work item's blocks (the C++ kernel's merged form): once a row has a
running max, a block is taken in one pass against it and done again with its own max only where its scores pass
that max by a margin. Scores that jump far above everything before them in a late block, that jump by less than
the margin, and that fall after an early peak, each against a float64 softmax written out here."""
from __future__ import annotations

import pytest
import torch

from compiled_attn.bench.batches import make_batch
from compiled_attn.decode import build_decode_index
from compiled_attn.kernels.cpu import kernel as cpu_kernel
from compiled_attn.kernels.cpu.kernel import native_available, native_decode_blocks
from compiled_attn.plan import plan_decode

pytestmark = pytest.mark.skipif(not (native_available() and cpu_kernel.native_tiles_available()),
                                reason="no AMX tile path in this kernel build (no AMX on the CPU, COMPILED_ATTN_ISA "
                                       "below amx, or the OS refuses the tile registers)")

# request r: (length, {position: the score there, in the exp's units})
SPIKES = [
    (600, {420: 100.0, 421: 99.0}),  # far above the running max (e^100 would overflow float32) in a late block
    (600, {300: 4.0, 500: 4.5}),  # above it, by less than the margin
    (600, {3: 25.0}),  # the peak in the first block, lower scores after it
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("page_size", [1, 16])
def test_scores_that_jump_in_a_late_block_match_float64(threads, page_size):
    """Every query row of a KV head is the same bf16 vector u (so a key along u scores the same for all of them):
    keys at the spiked positions are set to score exactly as SPIKES says, the rest score near 0. Blocks of 32
    positions, so a request's item folds several blocks (one thread: items of up to 16)."""
    hq, hkv, d, scale = 32, 2, 64, 0.125
    lens = [n for n, _ in SPIKES]
    b = make_batch(lens, hq=hq, hkv=hkv, dqk=d, decode=True, page_size=page_size, seed=5, kv_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    u = torch.randn(len(lens), hkv, d, generator=g).bfloat16().float()
    q = u.repeat_interleave(hq // hkv, 1).bfloat16()  # [bs, Hq, D]
    k = b.k_cache.float()
    for r, (_, spikes) in enumerate(SPIKES):
        slots = b.req_to_token[b.rows[r], :lens[r]].long()
        k[slots] *= 0.05  # the other scores near 0
        for pos, score in spikes.items():
            # score = scale * u . key: key = u * score / (scale |u|^2), exact in bf16 up to its rounding
            k[slots[pos]] = u[r] * (score / (scale * (u[r] * u[r]).sum(-1, keepdim=True)))
    b.k_cache = k.bfloat16()
    meta = plan_decode(q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, block_size=32,
                       page_size=page_size)
    index = build_decode_index(b.req_to_token, meta.inputs, page_size, host_form=False)
    n = int((index.block_req < len(lens)).sum())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = native_decode_blocks(q, index.block_req[:n], index.slots[:n], index.valid[:n], b.k_cache,
                                   b.v_cache, scale, 1.0, 0.0, len(lens), None, 1.0)
    finally:
        torch.set_num_threads(before)
    assert out.isfinite().all()
    for r, length in enumerate(lens):
        slots = b.req_to_token[b.rows[r], :length].long()
        s = torch.einsum("hd,nhd->hn", u[r].double(), b.k_cache[slots].double()) * scale  # [Hkv, n]
        for pos, score in SPIKES[r][1].items():
            assert abs(s[0, pos].item() - score) < 0.01 * score + 0.05  # the spikes are where they should be
        p = torch.softmax(s, -1)
        want = torch.einsum("hn,nhd->hd", p, b.v_cache[slots].double())  # [Hkv, Dv], every row of a head alike
        got = out[r].double().view(hkv, hq // hkv, -1)
        torch.testing.assert_close(got, want[:, None].expand_as(got), atol=4e-3, rtol=4e-3)
