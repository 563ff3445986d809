"""KV caches as servers run them (decode): page sizes > 1 (blocks from page starts), float8 caches with per-layer
scales, bf16/fp16 caches read without a float32 copy. Every output is checked against the float64 reference over the
dequantised cache."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_attn import decode_attention
from compiled_attn.bench.batches import make_batch
from compiled_attn.decode import build_decode_index, decode_blocks
from compiled_attn.kv import FP8_DTYPES, compute_dtype
from compiled_attn.plan import plan_decode
from tests.reference import DECODE_FORMS, reference_attention


def _reference(b, *, k_scale=None, v_scale=None, **kw):
    k = b.k_cache.double() * (k_scale or 1.0)
    v = b.v_cache.double() * (v_scale or 1.0)
    return reference_attention(b.q, k, v, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens, b.ext_lens, **kw)


def poison_unread(b, lo, hi, page_size):
    """NaN into every slot outside the requests' ranges ``[lo, hi)``, the unwritten tails of their last pages
    included: a NaN read there would survive the mask."""
    read = torch.zeros(b.k_cache.shape[0], dtype=torch.bool)
    for i, r in enumerate(b.rows.tolist()):
        read[b.req_to_token[r, int(lo[i]):int(hi[i])].long()] = True
    for cache in (b.k_cache, b.v_cache):
        if cache.dtype in FP8_DTYPES:
            cache.view(torch.uint8)[~read] = 0x7F  # NaN in both float8 formats
        else:
            cache[~read] = float("nan")


FORMS = DECODE_FORMS


@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
@pytest.mark.parametrize("block_size", [64, 48, 16])
@pytest.mark.parametrize("form", FORMS)
def test_paged_decode_matches_reference(page_size, block_size, form):
    lens = [1, 17, 64, 200, 300, 129]
    b = make_batch(lens, hq=8, hkv=2, dqk=32, decode=True, page_size=page_size, seed=page_size + block_size)
    poison_unread(b, torch.zeros(len(lens)), b.seq_lens, page_size)
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, block_size=block_size,
                       page_size=page_size)
    index = build_decode_index(b.req_to_token, meta.inputs, page_size)
    out = decode_blocks(b.q, b.k_cache, b.v_cache, index, 32 ** -0.5, **FORMS[form])
    torch.testing.assert_close(out.double(), _reference(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("window", [None, 5, 100])
def test_paged_decode_window_and_single_request(page_size, window):
    """A window's first key is not page-aligned: the first block starts at its page and the positions before the
    window are masked. bs 1 takes the one-call path."""
    for lens in ([300], [70, 300, 3]):
        b = make_batch(lens, hq=4, hkv=1, dqk=16, decode=True, page_size=page_size, seed=len(lens))
        # the request's own tokens before the window stay finite (the reference reads and masks them)
        poison_unread(b, torch.zeros(len(lens)), b.seq_lens, page_size)
        out = decode_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens,
                               sliding_window=window, page_size=page_size)
        torch.testing.assert_close(out.double(), _reference(b, sliding_window=window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [1, 64])
def test_paged_mla_decode(page_size):
    """MLA's latent cache (V a view of K; the matmul form) with pages."""
    b = make_batch([5, 130, 64], hq=4, hkv=1, dqk=72, dv=64, mla=True, decode=True, page_size=page_size)
    out = decode_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, page_size=page_size)
    torch.testing.assert_close(out.double(), _reference(b), atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(page_size=st.sampled_from([2, 8, 16, 32, 128]), block_size=st.sampled_from([8, 24, 64]),
       lens=st.lists(st.integers(1, 260), min_size=1, max_size=5), window=st.one_of(st.none(), st.integers(0, 90)),
       seed=st.integers(0, 10_000))
def test_paged_decode_random_tables(page_size, block_size, lens, window, seed):
    b = make_batch(lens, hq=4, hkv=2, dqk=16, decode=True, page_size=page_size, seed=seed)
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, block_size=block_size,
                       page_size=page_size, sliding_window=window)
    for form in FORMS.values():
        out = decode_blocks(b.q, b.k_cache, b.v_cache, build_decode_index(b.req_to_token, meta.inputs, page_size),
                            16 ** -0.5, **form)
        torch.testing.assert_close(out.double(), _reference(b, sliding_window=window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", FP8_DTYPES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_cache_with_scales(kv_dtype, q_dtype, page_size):
    """K and V scaled separately; the reference reads the same stored float8 values, dequantised in float64.
    Tolerance: float32 queries 1e-4 (the kernel's float32 sums); bf16 queries 2e-2 (bf16 tiles and output)."""
    lens = [33, 250, 1, 128]
    b = make_batch(lens, hq=8, hkv=2, dqk=32, decode=True, page_size=page_size, dtype=q_dtype, kv_dtype=kv_dtype)
    poison_unread(b, torch.zeros(len(lens)), b.seq_lens, page_size)
    ks, vs = 0.37, 2.5
    out = decode_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, page_size=page_size,
                           k_scale=ks, v_scale=vs)
    assert out.dtype == q_dtype
    tol = 1e-4 if q_dtype == torch.float32 else 2e-2
    ref = _reference(b, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out.double(), ref, atol=tol * vs, rtol=tol)
    # the matmul form dequantises in its gather, and computes in float32 whatever the query's dtype
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, page_size=page_size)
    portable = decode_blocks(b.q, b.k_cache, b.v_cache, build_decode_index(b.req_to_token, meta.inputs, page_size),
                             32 ** -0.5, form="matmul", k_scale=ks, v_scale=vs)
    assert portable.dtype == q_dtype
    torch.testing.assert_close(portable.double(), ref, atol=tol * vs, rtol=tol)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("form", DECODE_FORMS)
def test_fp8_and_half_cache_with_a_soft_cap(kv_dtype, form):
    """The matmul form dequantises in its gather, the kernel in its loads; both with a soft-cap."""
    b = make_batch([40, 129], hq=4, hkv=2, dqk=16, decode=True, kv_dtype=kv_dtype)
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens)
    out = decode_blocks(b.q, b.k_cache, b.v_cache, build_decode_index(b.req_to_token, meta.inputs), 0.25, 30.0,
                        k_scale=0.5, v_scale=None, **DECODE_FORMS[form])
    ref = _reference(b, k_scale=0.5, scale=0.25, logit_cap=30.0)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_cache_reaches_the_kernel_in_its_dtype(dtype):
    """A bf16/fp16 query over a cache of its dtype matches the float64 reference within half-precision tolerance;
    a float32 query over a bf16 cache computes in float32."""
    assert compute_dtype(dtype, dtype) == dtype
    assert compute_dtype(dtype, torch.float8_e4m3fn) == dtype
    assert compute_dtype(torch.float32, dtype) == torch.float32
    assert compute_dtype(dtype, torch.float32) == torch.float32
    b = make_batch([100, 300], hq=8, hkv=2, dqk=64, decode=True, dtype=dtype)
    out = decode_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens)
    torch.testing.assert_close(out.double(), _reference(b), atol=2e-2, rtol=2e-2)
    b32 = make_batch([100, 300], hq=8, hkv=2, dqk=64, decode=True, kv_dtype=dtype)  # float32 q, half cache
    out = decode_attention(b32.q, b32.k_cache, b32.v_cache, b32.req_to_token, b32.rows, b32.seq_lens)
    torch.testing.assert_close(out.double(), _reference(b32), atol=1e-5, rtol=1e-5)


def test_paged_fp8_decode_compiles_once():
    """fullgraph, one bucket, two batches: no recompile with pages and a float8 cache."""
    def step(q, k, v, table, inputs):
        return decode_blocks(q, k, v, build_decode_index(table, inputs, 16), 0.25, k_scale=0.5, v_scale=2.0)

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    for seed, lens in ((0, [30, 100]), (1, [64, 70])):
        b = make_batch(lens, hq=4, hkv=2, dqk=16, decode=True, page_size=16, kv_dtype=torch.float8_e4m3fn,
                       seed=seed, width=256)
        meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, page_size=16,
                           block_capacity=8, batch_capacity=2)
        out = compiled(b.q, b.k_cache, b.v_cache, b.req_to_token, meta.inputs)
        torch.testing.assert_close(out.double(), _reference(b, k_scale=0.5, v_scale=2.0), atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("over,exc,words", [
    (dict(page_size=0), ValueError, "page_size"),
    (dict(k_scale=0.0), ValueError, "k_scale"),
    (dict(v_scale=float("nan")), ValueError, "v_scale"),
    (dict(k_scale=torch.tensor(1.0)), TypeError, "k_scale"),
])
def test_bad_page_size_and_scales(over, exc, words):
    b = make_batch([10, 20], decode=True, page_size=16)
    with pytest.raises(exc, match=words):
        decode_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, **over)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("lens", [[40, 20], [40]], ids=["bs2", "bs1"])
def test_table_in_another_layout_is_read_as_it_stands(form, lens):
    """Every form reads each position's own slot, so a table that breaks SGLang's page layout (a position moved to
    another slot, or token-granular slots under page_size=16) gives attention over the keys it names, equal to
    the float64 reference reading the same table; a batch of one takes the host form."""
    b = make_batch(lens, decode=True, page_size=16, seed=3)
    r = int(b.rows[0])
    b.req_to_token[r, 17] = b.req_to_token[r, 33]  # position 17 reads position 33's key (inside the range)
    b.req_to_token[r, 32] = b.req_to_token[r, 5]  # a page's first position moved too
    out = decode_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, page_size=16,
                           **FORMS[form])
    torch.testing.assert_close(out.double(), _reference(b), atol=1e-5, rtol=1e-5)
    b = make_batch(lens, decode=True, seed=4)  # token-granular slots
    out = decode_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, page_size=16,
                           **FORMS[form])
    torch.testing.assert_close(out.double(), _reference(b), atol=1e-5, rtol=1e-5)


def test_unsupported_cache_dtype():
    b = make_batch([10], decode=True)
    with pytest.raises(TypeError, match="k_cache must have dtype"):
        decode_attention(b.q, b.k_cache.to(torch.int8), b.v_cache.to(torch.int8), b.req_to_token, b.rows,
                         b.seq_lens)


# ---------------------------------------------------------------- extend over the same cache formats

@pytest.mark.parametrize("kv_dtype,q_dtype,tol", [
    (torch.float8_e4m3fn, torch.float32, 1e-4),
    (torch.float8_e5m2, torch.bfloat16, 2e-2),
    (torch.bfloat16, torch.bfloat16, 2e-2),
    (torch.float16, torch.float16, 5e-3),
    (torch.bfloat16, torch.float32, 1e-5),
])
@pytest.mark.parametrize("form", ["kernel", "matmul"])
def test_extend_cache_dtypes(kv_dtype, q_dtype, tol, form):
    """Prefix + new tokens over a float8 / half cache (the new tokens' K/V already stored in the cache's dtype)."""
    from compiled_attn.extend import extend_tiled
    from compiled_attn.plan import plan_extend

    b = make_batch([90, 300, 7], [40, 200, 0], hq=8, hkv=2, dqk=32, dtype=q_dtype, kv_dtype=kv_dtype, page_size=16)
    ks, vs = (0.5, 3.0) if kv_dtype in FP8_DTYPES else (None, None)
    meta = plan_extend(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens, b.ext_lens,
                       page_size=16)
    out = extend_tiled(b.q, b.k_cache, b.v_cache, b.req_to_token, meta, 32 ** -0.5, form=form,
                       k_scale=ks, v_scale=vs)
    assert out.dtype == q_dtype
    ref = _reference(b, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out.double(), ref, atol=tol * (vs or 1.0), rtol=tol)


def test_extend_reads_a_table_in_another_layout():
    """Extend reads each position's slot: a prefix position moved off SGLang's page layout is read where it
    points, as the float64 reference reads it."""
    from compiled_attn import extend_attention

    b = make_batch([40, 20], [10, 0], page_size=16, seed=5)
    b.req_to_token[int(b.rows[0]), 3] = b.req_to_token[int(b.rows[0]), 7]
    out = extend_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens, b.ext_lens,
                           page_size=16)
    torch.testing.assert_close(out.double(), _reference(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [*FP8_DTYPES, torch.bfloat16])
def test_write_kv_stores_scaled_values(kv_dtype):
    from compiled_attn.kv import write_kv

    cache = torch.zeros(8, 2, 4, dtype=kv_dtype)
    new = torch.randn(2, 2, 4)
    write_kv(cache, torch.tensor([1, 5]), new, 0.5)
    torch.testing.assert_close(cache[[1, 5]].double() * 0.5, new.double(), atol=0.1, rtol=0.07)
    assert not cache[[0, 2, 3, 4, 6, 7]].float().any()
