"""Property tests over random shapes, lengths (0 and 1 included) and slot layouts (>= 300 examples in all)."""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import reference_attention

from compiled_attn import decode_attention, extend_attention
from compiled_attn.bench.batches import make_batch

SETTINGS = settings(max_examples=160, deadline=None, suppress_health_check=[HealthCheck.too_slow])
heads = st.sampled_from([(1, 1), (2, 2), (4, 2), (6, 3), (8, 1)])
dims = st.sampled_from([(8, 8), (16, 16), (24, 16), (16, 24), (40, 32)])


@SETTINGS
@given(heads=heads, dims=dims, lens=st.lists(st.integers(0, 150), min_size=1, max_size=6),
       window=st.one_of(st.none(), st.integers(0, 40)), cap=st.one_of(st.none(), st.floats(0.5, 50.0)),
       seed=st.integers(0, 2**16))
def test_decode_property(heads, dims, lens, window, cap, seed):
    (hq, hkv), (dqk, dv) = heads, dims
    b = make_batch(lens, hq=hq, hkv=hkv, dqk=dqk, dv=dv, decode=True, seed=seed)
    # decode gives every row a query, also rows of length 0 (their output is zeros)
    q = torch.randn(len(lens), hq, dqk, generator=torch.Generator().manual_seed(seed))
    out = decode_attention(q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, sliding_window=window,
                           logit_cap=cap)
    ref = reference_attention(q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens,
                              (b.seq_lens - 1).clamp_min(0), torch.ones(len(lens), dtype=torch.long),
                              sliding_window=window, logit_cap=cap)
    ref[b.seq_lens == 0] = 0
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() <= 1e-4


@SETTINGS
@given(heads=heads, dims=dims, reqs=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 40)), min_size=1,
                                              max_size=5),
       causal=st.booleans(), window=st.one_of(st.none(), st.integers(0, 30)),
       cap=st.one_of(st.none(), st.floats(0.5, 50.0)), seed=st.integers(0, 2**16))
def test_extend_property(heads, dims, reqs, causal, window, cap, seed):
    (hq, hkv), (dqk, dv) = heads, dims
    prefix = [p for p, _ in reqs]
    seq = [p + n for p, n in reqs]
    b = make_batch(seq, prefix, hq=hq, hkv=hkv, dqk=dqk, dv=dv, seed=seed)
    kw = dict(causal=causal, sliding_window=window, logit_cap=cap)
    out = extend_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                           b.ext_lens, **kw)
    ref = reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                              b.ext_lens, **kw)
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    if out.numel():
        assert (out.double() - ref).abs().max() <= 1e-4
