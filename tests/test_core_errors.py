"""Bad input raises a ValueError/TypeError naming the argument (checked in plan, before any compute)."""
import pytest
import torch

from compiled_attn import decode_attention, extend_attention
from compiled_attn.bench.batches import make_batch


@pytest.fixture
def b():
    return make_batch([5, 9], hq=4, hkv=2, decode=True)


def dec(b, **over):
    args = dict(q=b.q, k_cache=b.k_cache, v_cache=b.v_cache, req_to_token=b.req_to_token,
                req_pool_indices=b.rows, seq_lens=b.seq_lens)
    args.update(over)
    return decode_attention(**args)


def ext(b, **over):
    args = dict(q=b.q, k_cache=b.k_cache, v_cache=b.v_cache, req_to_token=b.req_to_token,
                req_pool_indices=b.rows, seq_lens=b.seq_lens, extend_prefix_lens=b.prefix_lens,
                extend_seq_lens=b.ext_lens)
    args.update(over)
    return extend_attention(**args)


@pytest.mark.parametrize("over,exc,words", [
    (lambda b: dict(q=b.q[0]), ValueError, "q must have 3 dimensions"),
    (lambda b: dict(q=b.q.double()), TypeError, "q must have dtype"),
    (lambda b: dict(k_cache=b.k_cache.half()), TypeError, "share one dtype"),
    (lambda b: dict(q=b.q.int()), TypeError, "q must have dtype"),
    (lambda b: dict(k_cache=b.k_cache[..., :8]), ValueError, "k_cache head dim"),
    (lambda b: dict(v_cache=b.v_cache[:5]), ValueError, "v_cache shape"),
    (lambda b: dict(q=torch.randn(2, 3, 16)), ValueError, "multiple of k_cache heads"),
    (lambda b: dict(seq_lens=b.seq_lens.float()), TypeError, "seq_lens must have dtype"),
    (lambda b: dict(seq_lens=b.seq_lens[:1]), ValueError, "seq_lens must have shape [2]"),
    (lambda b: dict(seq_lens=torch.tensor([5, -1])), ValueError, "seq_lens must be >= 0"),
    (lambda b: dict(seq_lens=torch.tensor([5, 10_000])), ValueError, "beyond the req_to_token width"),
    (lambda b: dict(req_pool_indices=torch.tensor([1, 99])), ValueError, "req_pool_indices must lie in"),
    (lambda b: dict(req_to_token=b.req_to_token.float()), TypeError, "req_to_token must have dtype"),
    (lambda b: dict(q=[1, 2]), TypeError, "q must be a torch.Tensor"),
    (lambda b: dict(sliding_window=-5), ValueError, "sliding_window"),
    (lambda b: dict(logit_cap=0.0), ValueError, "logit_cap"),
    (lambda b: dict(is_cross_attn=True), ValueError, "needs encoder_lens"),
    (lambda b: dict(encoder_lens=torch.tensor([10_000, 0])), ValueError, "encoder_lens + seq_lens"),
])
def test_decode_bad_input(b, over, exc, words):
    with pytest.raises(exc, match=pytest.importorskip("re").escape(words)):
        dec(b, **over(b))


def test_extend_bad_lengths():
    b = make_batch([6, 9], [2, 3], hq=4, hkv=2)
    with pytest.raises(ValueError, match=r"extend_prefix_lens \+ extend_seq_lens must equal seq_lens; request 1"):
        ext(b, extend_prefix_lens=torch.tensor([2, 4]))
    with pytest.raises(ValueError, match="q has 9 tokens but sum"):
        ext(b, q=b.q[:9])
    with pytest.raises(ValueError, match="extend_seq_lens must be >= 0"):
        ext(b, extend_seq_lens=torch.tensor([4, -1]), extend_prefix_lens=torch.tensor([2, 10]))


def test_device_mismatch_is_named():
    b = make_batch([5, 9], hq=4, hkv=2, decode=True)
    meta = torch.empty(2, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="seq_lens is on meta"):
        dec(b, seq_lens=meta)


def test_an_index_of_another_batch_is_refused():
    """q with fewer (or more) rows than the batch its index was built for: a ValueError naming both, whatever the
    form (the kernel would read query rows past q's end, the other forms keys of rows q does not have)."""
    from compiled_attn import build_decode_index, decode_blocks, plan_decode
    from compiled_attn.verify import build_verify_index, plan_verify, verify_blocks

    b = make_batch([5, 70, 33], hq=8, hkv=2, dqk=32, decode=True, seed=0)
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens)
    index = build_decode_index(b.req_to_token, meta.inputs)
    for form in (None, "auto", "matmul"):
        with pytest.raises(ValueError, match="q has 2 rows, but the index was built for a batch of 3"):
            decode_blocks(b.q[:2], b.k_cache, b.v_cache, index, 0.1, form=form)
    prefix = torch.tensor([5, 9])
    v = make_batch((prefix + 2).tolist(), prefix.tolist(), hq=4, hkv=2, dqk=16)
    vmeta = plan_verify(v.q, v.k_cache, v.v_cache, v.req_to_token, v.rows, prefix, 2)
    with pytest.raises(ValueError, match="q has 3 rows, but the index was built for a batch of 2 x 2 draft tokens"):
        verify_blocks(v.q[:3], v.k_cache, v.v_cache, build_verify_index(v.req_to_token, vmeta.inputs), 0.25)
