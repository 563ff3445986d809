"""Ragged tiled extend (compiled_attn.extend) against the float64 reference, both forms, every feature."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import reference_attention
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from compiled_attn.api import extend_attention
from compiled_attn.bench.batches import make_batch
from compiled_attn.compile_policy import compile_step
from compiled_attn.extend import build_extend_tile_index, extend_tiled, extend_tiles, plan_extend_tiles
from compiled_attn.forms import choose_extend_form
from compiled_attn.plan import plan_extend

SHAPES = {  # name: (hq, hkv, dqk, dv)
    "mha": (4, 4, 32, 32),
    "gqa": (8, 2, 32, 32),
    "mqa": (8, 1, 16, 16),
    "mla_normal": (4, 4, 48, 32),  # qk 192 / v 128 in miniature
}
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
FORMS = {"flash": "kernel", "matmul": "matmul"}


def _run(b, form="matmul", *, causal=True, sliding_window=None, is_cross_attn=False, scale=None, logit_cap=None,
         **kw):
    meta = plan_extend(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens, b.ext_lens,
                       causal=causal, sliding_window=sliding_window, encoder_lens=b.encoder_lens,
                       is_cross_attn=is_cross_attn)
    scale = b.q.shape[2] ** -0.5 if scale is None else scale
    return extend_tiled(b.q, b.k_cache, b.v_cache, b.req_to_token, meta, scale, logit_cap, form=FORMS.get(form, form),
                        **kw)


def _ref(b, **kw):
    kw.pop("tile_q", None), kw.pop("tile_k", None), kw.pop("pair_capacity", None)
    return reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                               b.ext_lens, encoder_lens=b.encoder_lens, **kw)


def _check(b, form, dtype=torch.float32, **kw):
    out, ref = _run(b, form, **kw), _ref(b, **kw)
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item() if ref.numel() else 0.0
    assert err <= TOL[dtype], f"max abs error {err}"
    return out


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_shapes_and_dtypes(shape, dtype, form):
    hq, hkv, dqk, dv = SHAPES[shape]
    b = make_batch([9, 40, 1, 23, 70], [4, 17, 0, 0, 30], hq=hq, hkv=hkv, dqk=dqk, dv=dv, dtype=dtype, seed=1)
    _check(b, form, dtype, tile_q=8, tile_k=16)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("window", [0, 1, 7, 100])
def test_sliding_window(window, form):
    b = make_batch([12, 50, 20, 90], [0, 30, 5, 45], hq=4, hkv=2, seed=3)
    _check(b, form, sliding_window=window, tile_q=8, tile_k=8)


@pytest.mark.parametrize("cap", [1.0, 30.0])
def test_logit_cap_matmul_form(cap):
    b = make_batch([12, 50, 20], [0, 30, 5], hq=4, hkv=2, seed=5)
    b.q.mul_(4)  # big logits so the cap matters
    _check(b, "matmul", logit_cap=cap, tile_q=8, tile_k=8)
    _check(b, "matmul", logit_cap=cap, sliding_window=9, tile_q=8, tile_k=8)
    with pytest.raises(ValueError, match=r"form='kernel': ATen's CPU flash kernel cannot serve this call \(a soft-cap"):
        _run(b, "flash", logit_cap=cap)
    # auto: the matmul form, the same numbers as naming it
    torch.testing.assert_close(_run(b, "auto", logit_cap=cap, tile_q=8, tile_k=8),
                               _run(b, "matmul", logit_cap=cap, tile_q=8, tile_k=8), atol=0, rtol=0)


def test_choose_extend_form_names_the_form_and_why():
    """One decision for extend, as for decode: the kernel where it serves the call, else the matmul form, each with
    its reason; a form the call cannot run, or a name extend has no form for, is a ValueError naming it."""
    b = make_batch([12, 5], hq=4, hkv=2)
    choice = choose_extend_form(b.q, b.k_cache, b.v_cache, None)
    assert (choice.form, choice.path) == ("kernel", "flash_tiles") and "serves it" in choice.reason
    named = choose_extend_form(b.q, b.k_cache, b.v_cache, None, "kernel")
    assert named.reason.startswith("ATen's CPU flash kernel given")
    capped = choose_extend_form(b.q, b.k_cache, b.v_cache, 30.0)
    assert (capped.form, capped.path) == ("matmul", "") and "soft-cap" in capped.reason
    wide_v = torch.zeros(*b.v_cache.shape[:2], 2 * b.v_cache.shape[2])
    assert "V's head size" in choose_extend_form(b.q, b.k_cache, wide_v, None).reason
    assert choose_extend_form(b.q, b.k_cache, b.v_cache, None, "matmul").form == "matmul"
    assert choose_extend_form(b.q, b.k_cache, b.v_cache, None, None).form == "kernel"
    for bad in ("triton", "flash", True):
        with pytest.raises(ValueError, match="form must be one of .'auto', 'kernel', 'matmul'. for extend"):
            choose_extend_form(b.q, b.k_cache, b.v_cache, None, bad)
    # the one-call function takes the same names
    args = (b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens, b.ext_lens)
    ref = _ref(b, scale=b.q.shape[2] ** -0.5)
    for form in ("kernel", "matmul"):
        assert (extend_attention(*args, form=form).double() - ref).abs().max() < 1e-4
    with pytest.raises(ValueError, match="form='kernel'"):
        extend_attention(*args, form="kernel", logit_cap=5.0)


def test_matmul_form_needs_the_mask():
    b = make_batch([12, 5], hq=4, hkv=2)
    tiles = _tiles(b, tile_q=8, tile_k=8)
    index = build_extend_tile_index(b.req_to_token, tiles.inputs, causal=True, sliding_window=None,
                                    with_mask=False)
    with pytest.raises(ValueError, match="with_mask"):
        extend_tiles(b.q, b.k_cache, b.v_cache, index, 0.25, form="matmul")


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("with_prefix", [False, True])
def test_encoder_only_non_causal(with_prefix, form):
    b = make_batch([9, 40, 1], [3, 10, 0] if with_prefix else None, hq=4, hkv=2, seed=6)
    _check(b, form, causal=False, tile_q=8, tile_k=8)


@pytest.mark.parametrize("form", list(FORMS))
def test_cross_attention_and_decoder_self_attention(form):
    b = make_batch([4, 6, 3], [1, 2, 0], hq=4, hkv=2, encoder_lens=[5, 0, 17], seed=7)
    out = _check(b, form, is_cross_attn=True, tile_q=4, tile_k=4)
    assert out[3:7].abs().max() == 0  # encoder length 0: zeros, not NaN
    _check(b, form, tile_q=4, tile_k=4)


@pytest.mark.parametrize("form", list(FORMS))
def test_zero_length_requests_and_no_new_tokens(form):
    b = make_batch([5, 0, 3, 8], [2, 0, 0, 8], hq=4, hkv=2)
    _check(b, form, tile_q=4, tile_k=4)
    e = make_batch([5, 7], [5, 7], hq=4, hkv=2)  # an extend with no new tokens
    out = _run(e, form)
    assert out.shape == (0, 4, 16)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 5}, {"causal": False}, {"is_cross_attn": True}])
def test_nan_in_unowned_slots_never_reaches_output(form, kw):
    """Every slot no request owns (slot 0, the padding target, included) holds NaN; no output may change."""
    b = make_batch([13, 40, 1, 29], [5, 0, 0, 20], hq=4, hkv=2, encoder_lens=[3, 9, 0, 4], seed=8)
    owned = torch.zeros(b.k_cache.shape[0], dtype=torch.bool)
    for row, n in zip(b.rows.tolist(), (b.seq_lens + b.encoder_lens).tolist(), strict=False):
        owned[b.req_to_token[row, :n].long()] = True
    clean = _run(b, form, tile_q=8, tile_k=8, **kw)
    b.k_cache[~owned] = float("nan")
    b.v_cache[~owned] = float("inf")
    out = _check(b, form, tile_q=8, tile_k=8, **kw)
    torch.testing.assert_close(out, clean, atol=0, rtol=0)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_batches(data):
    bs = data.draw(st.integers(1, 5))
    ext = data.draw(st.lists(st.integers(0, 40), min_size=bs, max_size=bs))
    pre = data.draw(st.lists(st.integers(0, 60), min_size=bs, max_size=bs))
    window = data.draw(st.sampled_from([None, 0, 3, 17, 64]))
    causal = data.draw(st.booleans()) if window is None else True
    tq, tk = data.draw(st.sampled_from([4, 8, 16])), data.draw(st.sampled_from([4, 8, 16]))
    seed = data.draw(st.integers(0, 1000))
    b = make_batch([a + c for a, c in zip(ext, pre, strict=False)], pre, hq=4, hkv=2, seed=seed)
    for form in FORMS:
        _check(b, form, causal=causal, sliding_window=window, tile_q=tq, tile_k=tk)


@pytest.mark.parametrize("held_bytes", [None, 1])
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 11}, {"causal": False}])
def test_flash_form_spans_merge_and_per_span_gathers(kw, held_bytes, monkeypatch):
    """Small spans: a query tile's keys in several kernel calls merged by log-sum-exp; with ``HELD_BYTES`` 1 every
    span gathers its own keys instead of slicing its request's."""
    import compiled_attn.kernels.cpu.extend_flash as flash

    if held_bytes is not None:
        monkeypatch.setattr(flash, "HELD_BYTES", held_bytes)
    b = make_batch([40, 70, 3, 33], [20, 0, 0, 30], hq=8, hkv=2, seed=12)
    tiles = _tiles(b, tile_q=16, tile_k=8, **kw)
    index = build_extend_tile_index(b.req_to_token, tiles.inputs, causal=tiles.causal,
                                    sliding_window=tiles.sliding_window, with_mask=False)
    for span in (8, 24):
        out = extend_tiles(b.q, b.k_cache, b.v_cache, index, 0.25, form="kernel", span_keys=span)
        assert (out.double() - _ref(b, scale=0.25, **kw)).abs().max() < 1e-4


def test_windowed_spans_with_fully_visible_pairs():
    """Windowed extend in small pieces: window 20, query and key tiles of 8, spans of 8 or 16 keys (a kernel call
    each). A (query tile, key tile) pair whose every key is inside every query's window runs unmasked, the others
    masked. Prefix 163: query tile 163..170 sees all of key tile 152..159. Prefix 150: query tile 150..157 sees key
    tile 136..143 but key 136, one short of its last query's window (157 - 20 = 137). q: [99, 8, 16] (GQA 8/2)."""
    window = 20
    b = make_batch([190, 192, 30], [150, 163, 0], hq=8, hkv=2, seed=13)
    tiles = _tiles(b, sliding_window=window, tile_q=8, tile_k=8)
    i = tiles.inputs
    last_query = i.q_rel + i.q_count - 1  # the tile's last query, relative to the pair's first key
    one_key_short = (last_query == window + 1) & (i.k_count - 1 <= i.q_rel)
    assert i.full.any() and one_key_short.any()  # the case this test is for is in the batch
    index = build_extend_tile_index(b.req_to_token, i, causal=True, sliding_window=window, with_mask=False)
    ref = _ref(b, scale=0.25, sliding_window=window)
    for span in (8, 16):
        out = extend_tiles(b.q, b.k_cache, b.v_cache, index, 0.25, form="kernel", span_keys=span)
        err = (out.double() - ref).abs().max().item()
        assert err < 1e-4, f"spans of {span} keys: max abs error {err}"


def _tiles(b, causal=True, sliding_window=None, **kw):
    meta = plan_extend(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens, b.ext_lens,
                       causal=causal, sliding_window=sliding_window)
    return plan_extend_tiles(meta, **kw)


def test_computed_pairs_close_to_useful_at_tile_64():
    g = torch.Generator().manual_seed(0)
    new = torch.randint(32, 1025, (16,), generator=g)
    pre = torch.randint(0, 1025, (16,), generator=g) * (torch.rand(16, generator=g) < 0.5)
    b = make_batch((new + pre).tolist(), pre.tolist(), hq=1, hkv=1, dqk=4)
    t = _tiles(b, tile_q=64, tile_k=64)
    assert t.useful_qk == int(sum(n * p + n * (n + 1) // 2 for n, p in zip(new.tolist(), pre.tolist(), strict=False)))
    assert t.computed_qk <= 1.15 * t.useful_qk, (t.computed_qk, t.useful_qk)


@pytest.mark.parametrize("form", list(FORMS))
def test_padded_pairs_do_nothing(form):
    b = make_batch([30, 9], [10, 0], hq=4, hkv=2, seed=11)
    exact = _run(b, form, tile_q=8, tile_k=8)
    needed = _tiles(b, tile_q=8, tile_k=8).pairs_needed
    torch.testing.assert_close(_run(b, form, tile_q=8, tile_k=8, pair_capacity=needed + 37), exact, atol=0, rtol=0)
    with pytest.raises(ValueError, match="pair_capacity"):
        _run(b, form, tile_q=8, tile_k=8, pair_capacity=needed - 1)


def test_plan_pairs_of_a_small_request():
    b = make_batch([10], [4], hq=1, hkv=1, dqk=4)
    t = _tiles(b, tile_q=4, tile_k=4)
    # queries at positions 4..9 (two tiles: 4..7, 8..9) over keys 0..9 (tiles 0-3, 4-7, 8-9)
    assert t.pairs_needed == 5 and t.inputs.k_count.tolist() == [4, 4, 4, 4, 2]
    assert t.inputs.full.tolist() == [1, 0, 1, 1, 0]


def _step(q, k_cache, v_cache, table, inputs, form):
    index = build_extend_tile_index(table, inputs, causal=True, sliding_window=None, with_mask=form != "kernel")
    return extend_tiles(q, k_cache, v_cache, index, 0.25, form=form)


@pytest.mark.parametrize("form", list(FORMS))
def test_compiles_fullgraph_once_per_pair_bucket(form):
    """Inductor for the CPU flash form (as served); the matmul form (whose inductor compile takes a while on
    CPU) through a counting backend, which still traces with fullgraph=True and counts every (re)compile."""
    torch._dynamo.reset()
    if form == "flash":
        fn = compile_step(_step)
    else:
        backend = CompileCounter()
        fn = torch.compile(_step, backend=backend, fullgraph=True, dynamic=True)
    graphs = []
    # two batches with different lengths and token counts, one pair bucket
    for seq, prefix in (([40, 20, 9], [10, 0, 2]), ([31, 64, 12, 5], [0, 30, 7, 0])):
        b = make_batch(seq, prefix, hq=4, hkv=2, width=80, seed=len(seq))
        tiles = _tiles(b, tile_q=8, tile_k=8, pair_capacity=64)
        out = fn(b.q, b.k_cache, b.v_cache, b.req_to_token, tiles.inputs, FORMS[form])
        assert (out.double() - _ref(b, scale=0.25)).abs().max() < 1e-4
        graphs.append(counters["stats"]["unique_graphs"] if form == "flash" else backend.frame_count)
    assert graphs[0] >= 1 and graphs[0] == graphs[1], "a new batch in the same pair bucket recompiled"


@pytest.mark.parametrize("form", list(FORMS))
def test_strided_query_equals_contiguous(form):
    """The CPU flash kernel reads q through its strides unchecked: a query whose head dim is not contiguous must
    give the same output as its contiguous copy."""
    b = make_batch([70, 40], [10, 0], hq=8, hkv=2, dqk=64, seed=3)
    strided = b.q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous()
    meta = plan_extend(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens, b.ext_lens)
    out = [extend_tiled(q, b.k_cache, b.v_cache, b.req_to_token, meta, 0.125, form=FORMS[form])
           for q in (b.q, strided)]
    torch.testing.assert_close(out[1], out[0], atol=2e-4, rtol=1e-4)


def test_long_request_without_prefix_is_one_causal_call(monkeypatch):
    """A request with no prefix spanning >= CAUSAL_SQUARE_TILES query tiles runs as one causal kernel call (its
    tiles continue one causal square); a short one stays tiled. Both equal the float64 reference."""
    import compiled_attn.kernels.cpu.extend_flash as extend_flash
    from compiled_attn.plan import plan_extend

    calls = []
    real = extend_flash._aten_flash_cpu

    def counting(q, k, v, dropout, causal, **kwargs):
        calls.append((q.shape[1], q.shape[2], k.shape[2], causal))
        return real(q, k, v, dropout, causal, **kwargs)

    monkeypatch.setattr(extend_flash, "_aten_flash_cpu", counting)
    b = make_batch([1100, 300], [0, 0], hq=8, hkv=2, dqk=32)
    meta = plan_extend(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens, b.ext_lens)
    out = extend_tiled(b.q, b.k_cache, b.v_cache, b.req_to_token, meta, 32 ** -0.5, form="kernel", tile_q=256)
    assert calls[0] == (8, 1100, 1100, True)  # heads unfolded: q [1, Hq, 1100, D] over all 1100 keys
    assert [c[3] for c in calls[1:]] == [True, False]  # the 300-token request: a causal tile, then a folded one
    ref = reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                              b.ext_lens)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def spy_trapezoids(monkeypatch) -> list[tuple[int, int]]:
    """Record each ``extend_flash._trapezoid`` call as (new tokens, prefix) while it still runs."""
    import compiled_attn.kernels.cpu.extend_flash as extend_flash

    calls = []
    real = extend_flash._trapezoid

    def counting(run, q_tile, k, v, prefix, scale, out=None):
        calls.append((q_tile.shape[0], prefix))
        return real(run, q_tile, k, v, prefix, scale, out)

    monkeypatch.setattr(extend_flash, "_trapezoid", counting)
    return calls


def test_causal_square_from_its_rows(monkeypatch):
    """Fewer than CAUSAL_SQUARE_TILES query tiles but CAUSAL_SQUARE_ROWS new tokens or more (the kernel's large query
    block): one causal call, with or without a prefix; fewer rows stay tiled. Equal to the float64 reference."""
    import compiled_attn.kernels.cpu.extend_flash as extend_flash
    from compiled_attn.plan import plan_extend

    calls = spy_trapezoids(monkeypatch)
    rows = extend_flash.CAUSAL_SQUARE_ROWS
    b = make_batch([rows, rows - 10, rows + 40], [0, 0, 40], hq=4, hkv=2, dqk=16)
    meta = plan_extend(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens, b.ext_lens)
    out = extend_tiled(b.q, b.k_cache, b.v_cache, b.req_to_token, meta, 0.25, form="kernel", tile_q=rows // 3)
    # rows - 10 new tokens (three tiles) stay tiled: only their first tile is a (one-tile) causal call
    assert sorted(calls) == [(rows // 3, 0), (rows, 0), (rows, 40)]
    ref = reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                              b.ext_lens)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["gqa", "mla_normal"])
def test_prefix_trapezoid_is_one_causal_call_plus_one_prefix_call(monkeypatch, shape, dtype):
    """A causal request whose new tokens span several query tiles runs as its prefix (one unmasked call) and its
    causal square (the kernel's own causal case), merged: prefixes and tile edges that do not line up with the key
    tiles included. Equal to the float64 reference."""
    calls = spy_trapezoids(monkeypatch)
    hq, hkv, dqk, dv = SHAPES[shape]
    b = make_batch([70, 45, 45, 33], [30, 0, 13, 13], hq=hq, hkv=hkv, dqk=dqk, dv=dv, dtype=dtype, seed=4)
    _check(b, "flash", dtype, tile_q=8, tile_k=16)
    assert sorted(calls) == [(32, 13), (40, 30), (45, 0)]  # 20 new tokens over 13: three tiles, tiled
