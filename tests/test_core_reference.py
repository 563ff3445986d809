"""decode_attention / extend_attention against the float64 reference, feature by feature."""
import pytest
import torch
from reference import reference_attention

from compiled_attn import decode_attention, extend_attention
from compiled_attn.bench.batches import make_batch

SHAPES = {  # name: (hq, hkv, dqk, dv, mla)
    "mha": (4, 4, 32, 32, False),
    "gqa": (8, 2, 32, 32, False),
    "mqa": (8, 1, 16, 16, False),
    "mla_normal": (4, 4, 48, 32, False),  # qk 192 / v 128 in miniature
    "mla_absorbed": (8, 1, 576, 512, True),  # the real latent width, V a view of the latent cache
}
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def _check(out, ref, dtype):
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item() if ref.numel() else 0.0
    # bf16/fp16 inputs are rounded before use, so compare against a reference on the same rounded inputs
    assert err <= TOL[dtype], f"max abs error {err}"


def _decode(b, **kw):
    return decode_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens,
                            encoder_lens=b.encoder_lens, **kw)


def _extend(b, **kw):
    return extend_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                            b.ext_lens, encoder_lens=b.encoder_lens, **kw)


def _ref(b, **kw):
    return reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                               b.ext_lens, encoder_lens=b.encoder_lens, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_decode_shapes_and_dtypes(shape, dtype):
    hq, hkv, dqk, dv, mla = SHAPES[shape]
    b = make_batch([5, 70, 1, 130, 33], hq=hq, hkv=hkv, dqk=dqk, dv=dv, mla=mla, dtype=dtype, decode=True)
    if mla:
        assert b.v_cache.data_ptr() == b.k_cache.data_ptr()  # a view, never a copy
    _check(_decode(b), _ref(b), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("with_prefix", [False, True])
def test_extend_shapes_and_dtypes(shape, dtype, with_prefix):
    hq, hkv, dqk, dv, mla = SHAPES[shape]
    seq = [9, 40, 1, 23]
    prefix = [4, 17, 0, 22] if with_prefix else None
    b = make_batch(seq, prefix, hq=hq, hkv=hkv, dqk=dqk, dv=dv, mla=mla, dtype=dtype, seed=1)
    _check(_extend(b), _ref(b), dtype)


@pytest.mark.parametrize("window", [0, 1, 7, 100])
def test_sliding_window(window):
    b = make_batch([3, 50, 20], hq=4, hkv=2, decode=True, seed=2)
    _check(_decode(b, sliding_window=window), _ref(b, sliding_window=window), torch.float32)
    b = make_batch([12, 50, 20], [0, 30, 5], hq=4, hkv=2, seed=3)
    _check(_extend(b, sliding_window=window), _ref(b, sliding_window=window), torch.float32)


def test_sglang_no_window_spelling():
    b = make_batch([3, 50], hq=4, hkv=2, decode=True)
    _check(_decode(b, sliding_window=-1), _ref(b), torch.float32)


@pytest.mark.parametrize("cap", [1.0, 30.0])
def test_logit_cap(cap):
    b = make_batch([3, 50, 20], hq=4, hkv=2, decode=True, seed=4)
    b.q.mul_(4)  # big logits so the cap matters
    _check(_decode(b, logit_cap=cap), _ref(b, logit_cap=cap), torch.float32)
    b = make_batch([12, 50, 20], [0, 30, 5], hq=4, hkv=2, seed=5)
    b.q.mul_(4)
    _check(_extend(b, logit_cap=cap, sliding_window=9), _ref(b, logit_cap=cap, sliding_window=9), torch.float32)


def test_scale():
    b = make_batch([3, 50], hq=4, hkv=2, decode=True)
    _check(_decode(b, scale=0.3), _ref(b, scale=0.3), torch.float32)


@pytest.mark.parametrize("with_prefix", [False, True])
def test_encoder_only_non_causal(with_prefix):
    b = make_batch([9, 40, 1], [3, 10, 0] if with_prefix else None, hq=4, hkv=2, seed=6)
    _check(_extend(b, causal=False), _ref(b, causal=False), torch.float32)


def test_cross_attention_and_decoder_self_attention():
    enc = [5, 0, 17]
    b = make_batch([4, 6, 3], [1, 2, 0], hq=4, hkv=2, encoder_lens=enc, seed=7)
    _check(_extend(b, is_cross_attn=True), _ref(b, is_cross_attn=True), torch.float32)
    _check(_extend(b), _ref(b), torch.float32)
    d = make_batch([4, 6, 3], hq=4, hkv=2, encoder_lens=enc, decode=True, seed=8)
    out = _decode(d, is_cross_attn=True)
    _check(out, _ref(d, is_cross_attn=True), torch.float32)
    assert out[1].abs().max() == 0  # encoder length 0: zeros, not NaN
    _check(_decode(d), _ref(d), torch.float32)


def test_length_zero_rows_give_zeros():
    b = make_batch([0, 7, 0], hq=4, hkv=2, decode=True)
    # a decode row with seq_len 0 has a query but no key
    q = torch.randn(3, 4, 16)
    out = decode_attention(q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens)
    assert torch.isfinite(out).all() and out[0].abs().max() == 0 and out[2].abs().max() == 0
    e = make_batch([5, 0, 3], [2, 0, 0], hq=4, hkv=2)
    _check(_extend(e), _ref(e), torch.float32)


def test_output_feeds_back_in_request_order():
    """Requests whose rows and slots are out of order still get their own outputs (no cross-talk)."""
    b = make_batch([30, 2, 17, 64], hq=4, hkv=2, decode=True, seed=9)
    out = _decode(b)
    for i in range(4):
        single = decode_attention(b.q[i:i + 1], b.k_cache, b.v_cache, b.req_to_token, b.rows[i:i + 1],
                                  b.seq_lens[i:i + 1])
        torch.testing.assert_close(out[i:i + 1], single, atol=1e-5, rtol=1e-5)
