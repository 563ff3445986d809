"""Attention sinks (gpt-oss): one learned logit per query head joins each row's softmax denominator. Decode and
extend, every form, against the float64 reference with the sink as an extra softmax column of value zero."""
from __future__ import annotations

import pytest
import torch

from compiled_attn import decode_attention, extend_attention
from compiled_attn.bench.batches import make_batch
from compiled_attn.decode import build_decode_index, decode_blocks
from compiled_attn.extend import extend_tiled
from compiled_attn.plan import plan_decode, plan_extend
from tests.reference import DECODE_FORMS, reference_attention


def _ref(b, **kw):
    return reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                               b.ext_lens, **kw)


def _sinks(hq, seed=0):
    # large and small logits: a sink that dominates some rows and barely matters in others
    return torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 4


@pytest.mark.parametrize("lens", [[300], [5, 130, 64, 1], [4000]])
@pytest.mark.parametrize("form", DECODE_FORMS)
def test_decode_sinks(lens, form):
    """bs 1 (a host-built index) and split blocks, the sinks in the merge; the kernel and the matmul form."""
    b = make_batch(lens, hq=8, hkv=2, dqk=32, decode=True)
    sinks = _sinks(8)
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens)
    out = decode_blocks(b.q, b.k_cache, b.v_cache, build_decode_index(b.req_to_token, meta.inputs), 32 ** -0.5,
                        sinks=sinks, **DECODE_FORMS[form])
    ref = _ref(b, sinks=sinks)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ref, _ref(b), atol=1e-3)  # the sinks change the answer


def test_decode_sinks_bf16_and_window():
    b = make_batch([50, 200], hq=8, hkv=2, dqk=32, decode=True, dtype=torch.bfloat16)
    sinks = _sinks(8, 1).to(torch.bfloat16)
    out = decode_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, sliding_window=16,
                           sinks=sinks)
    torch.testing.assert_close(out.double(), _ref(b, sinks=sinks, sliding_window=16), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tile_q", [None, 32])
@pytest.mark.parametrize("prefix", [[0, 0], [40, 7]])
@pytest.mark.parametrize("form", ["kernel", "matmul"])
def test_extend_sinks(prefix, form, tile_q):
    """No prefix: the first tiles take the kernel's own causal path; with a prefix: folded spans merged; with 32-row
    tiles the long request is one causal square (after its prefix: a trapezoid, the sinks applied to its merge)."""
    b = make_batch([300, 70], prefix, hq=8, hkv=2, dqk=32)
    sinks = _sinks(8, 2)
    meta = plan_extend(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens, b.ext_lens)
    out = extend_tiled(b.q, b.k_cache, b.v_cache, b.req_to_token, meta, 32 ** -0.5, form=form,
                       sinks=sinks, tile_q=tile_q)
    torch.testing.assert_close(out.double(), _ref(b, sinks=sinks), atol=1e-5, rtol=1e-5)


def test_extend_sinks_public_api_with_window():
    b = make_batch([90, 33], [10, 0], hq=4, hkv=4, dqk=16)
    sinks = _sinks(4, 3)
    out = extend_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                           b.ext_lens, sliding_window=8, sinks=sinks)
    torch.testing.assert_close(out.double(), _ref(b, sinks=sinks, sliding_window=8), atol=1e-5, rtol=1e-5)


def test_decode_sinks_compile_fullgraph():
    b = make_batch([30, 100], hq=8, hkv=2, dqk=32, decode=True)
    sinks = _sinks(8)
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens)

    def step(q, k, v, table, inputs, sinks):
        return decode_blocks(q, k, v, build_decode_index(table, inputs), 32 ** -0.5, sinks=sinks)

    out = torch.compile(step, fullgraph=True)(b.q, b.k_cache, b.v_cache, b.req_to_token, meta.inputs, sinks)
    torch.testing.assert_close(out.double(), _ref(b, sinks=sinks), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sinks,exc", [(torch.zeros(3), ValueError), (torch.zeros(8, 1), ValueError),
                                       (torch.zeros(8, dtype=torch.int64), TypeError)])
def test_bad_sinks(sinks, exc):
    b = make_batch([10, 20], hq=8, hkv=2, dqk=16, decode=True)
    with pytest.raises(exc, match="sinks"):
        decode_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, sinks=sinks)
