"""Keys read in place (``inplace_flash``): runs of consecutive slots as views of the cache, against the float64
reference, and the layouts that take or skip that path."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_attention

import compiled_attn.inplace_flash as inplace_flash
from compiled_attn import build_decode_index, decode_blocks, plan_decode
from compiled_attn.bench.batches import make_batch
from compiled_attn.inplace_flash import MIN_RUN, key_runs


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_key_runs_splits_at_every_gap_and_request_end(data):
    """Runs of consecutive slots, each request's end always a break (a run never spans two requests): the long
    ones listed with their request, every other key kept in order with its request's count; None when the long
    runs hold under half the keys. Against a plain Python walk."""
    pieces = data.draw(st.lists(st.tuples(st.integers(0, 2000), st.integers(1, 300)), max_size=6))
    slots = [s + j for s, n in pieces for j in range(n)]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(slots)), max_size=3)))
    lens = [b - a for a, b in zip([0, *cuts], [*cuts, len(slots)], strict=True)]
    request = [i for i, n in enumerate(lens) for _ in range(n)]
    long, in_long, p = [], set(), 0
    while p < len(slots):
        e = p + 1
        while e < len(slots) and slots[e] == slots[e - 1] + 1 and request[e] == request[p]:
            e += 1
        if e - p >= MIN_RUN:
            long.append((request[p], slots[p], e - p))
            in_long.update(range(p, e))
        p = e
    got = key_runs(torch.tensor(slots, dtype=torch.int64), lens)
    if len(in_long) < 0.5 * len(slots) or len(slots) < MIN_RUN:
        assert got is None
        return
    assert got.runs == long
    rest = [p for p in range(len(slots)) if p not in in_long]
    assert got.rest.tolist() == [slots[p] for p in rest]
    assert got.rest_counts == [sum(1 for p in rest if request[p] == i) for i in range(len(lens))]


def spy_key_runs(monkeypatch):
    """Record each batch (or single request) whose keys are read as runs of slots. The test shapes' caches are far
    under the size from which runs are looked for: that size is lowered to nothing here."""
    monkeypatch.setattr(inplace_flash, "MIN_IN_PLACE_BYTES", 0)
    calls = []
    real = inplace_flash.key_runs

    def spy(*a, **k):
        found = real(*a, **k)
        if found is not None:
            calls.append(found)
        return found

    monkeypatch.setattr(inplace_flash, "key_runs", spy)
    return calls


@pytest.mark.parametrize("window", [None, 200])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rests", ["one_call", "per_request"])
def test_engine_layout_decodes_in_place(monkeypatch, window, with_sinks, dtype, rests):
    """Prompts in runs of consecutive slots and decode steps a batch apart (SGLang's allocator at page size 1):
    each request's long runs are read as views of the cache, the requests' scattered tails gathered into one padded
    kernel call (or, past its size limit, each request's own); requests shorter than a run, an empty range and a
    bucket's padding rows included. Equal to the float64 reference."""
    if rests == "per_request":
        monkeypatch.setattr(inplace_flash, "REST_BYTES", 0)
    calls = spy_key_runs(monkeypatch)
    lens = [700, 90, 30, 300, 1000]
    b = make_batch(lens, hq=8, hkv=2, dqk=32, decode=True, seed=3, slot_layout="engine", dtype=dtype)
    sinks = torch.linspace(-2, 2, 8) if with_sinks else None
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, block_size=64,
                       sliding_window=window, block_capacity=60, batch_capacity=7)
    q = torch.cat([b.q, b.q[:2]])  # two padded rows, as in a graph bucket: row 0, empty range
    out = decode_blocks(q, b.k_cache, b.v_cache, build_decode_index(b.req_to_token, meta.inputs), 0.2,
                        cpu_flash=True, sinks=sinks)
    assert calls, "the in-place path was not taken"
    ref = reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                              b.ext_lens, scale=0.2, sinks=sinks, sliding_window=window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:len(lens)].double(), ref, atol=tol, rtol=tol)
    assert (out[len(lens):] == 0).all()


@pytest.mark.parametrize("length", [40, 130, 1500])
def test_one_request_in_place(monkeypatch, length):
    """A batch of one (the host-built index's ``single`` slots) without the C++ kernel: its decode steps follow its
    prompt, one run in all, read in place from ``MIN_RUN`` slots on."""
    calls = spy_key_runs(monkeypatch)
    b = make_batch([length], hq=4, hkv=2, dqk=16, decode=True, seed=4, slot_layout="engine")
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens)
    out = decode_blocks(b.q, b.k_cache, b.v_cache, build_decode_index(b.req_to_token, meta.inputs), 0.25,
                        native=False)
    ref = reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                              b.ext_lens, scale=0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert bool(calls) == (length >= MIN_RUN)


@pytest.mark.parametrize("page_size, taken", [(16, False), (64, False), (128, True), (256, True)])
def test_pages_of_a_run_or_more_are_read_in_place(monkeypatch, page_size, taken):
    """Random pages: a page of ``MIN_RUN`` slots or more is a run by itself; smaller pages are gathered."""
    calls = spy_key_runs(monkeypatch)
    lens = [400, 150, 999]
    b = make_batch(lens, hq=8, hkv=2, dqk=32, decode=True, seed=5, page_size=page_size)
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, page_size=page_size)
    out = decode_blocks(b.q, b.k_cache, b.v_cache, build_decode_index(b.req_to_token, meta.inputs, page_size), 0.2,
                        cpu_flash=True)
    assert bool(calls) == taken
    ref = reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                              b.ext_lens, scale=0.2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["scattered", "float8", "kv_scale", "fp32_query_bf16_cache"])
def test_what_is_not_read_in_place(monkeypatch, case):
    """Scattered slots (the share in long runs under one half), and caches the kernel cannot read as they are (a
    dtype other than the query's, a dequantisation scale) take the gathering paths, with the same answer."""
    calls = spy_key_runs(monkeypatch)
    kv = {"float8": torch.float8_e4m3fn, "fp32_query_bf16_cache": torch.bfloat16}.get(case)
    b = make_batch([500, 300], hq=4, hkv=2, dqk=16, decode=True, seed=6, kv_dtype=kv,
                   slot_layout="scattered" if case == "scattered" else "engine")
    scale = 0.5 if case in ("float8", "kv_scale") else None
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens)
    out = decode_blocks(b.q, b.k_cache, b.v_cache, build_decode_index(b.req_to_token, meta.inputs), 0.25,
                        cpu_flash=True, k_scale=scale, v_scale=scale)
    assert not calls
    k, v = (c.double() * (scale or 1.0) for c in (b.k_cache, b.v_cache))
    ref = reference_attention(b.q, k, v, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens, b.ext_lens, scale=0.25)
    tol = 1e-5 if kv is None else 3e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("prefix", [[700, 5, 130, 0, 900], [300]], ids=["batch", "single"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_verify_reads_prefixes_in_place(monkeypatch, prefix, tree):
    """Speculative verify over prompts in runs of slots: each request's prefix read in place by the flash form
    (a batch, and a batch of one through its host slots), equal to the float64 reference."""
    from test_verify import random_trees, reference_verify

    from compiled_attn.verify import chain_mask, verify_attention

    calls = spy_key_runs(monkeypatch)
    k = 4
    prefix = torch.tensor(prefix, dtype=torch.int64)
    b = make_batch((prefix + k).tolist(), prefix.tolist(), hq=8, hkv=2, dqk=16, seed=7, slot_layout="engine")
    masks = random_trees(len(prefix), k, torch.Generator().manual_seed(2)) if tree else chain_mask(len(prefix), k)
    out = verify_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k,
                           masks.reshape(-1) if tree else None, cpu_flash=True)
    assert calls, "no prefix was read in place"
    ref = reference_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks, 16 ** -0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_rows_merge_as_one_at_a_time():
    """``merge_normalised_rows`` (every partial of a batch in one pass) equals merging each row's partials alone;
    a row with none gets zeros and the float32 minimum."""
    from compiled_attn.merge import merge_normalised, merge_normalised_rows

    g = torch.Generator().manual_seed(3)
    rows = torch.tensor([2, 0, 2, 2, 0, 3])
    o, lse = torch.randn(6, 2, 3, 4, generator=g), torch.randn(6, 2, 3, generator=g) * 5
    got_o, got_lse = merge_normalised_rows(o, lse, rows, 5)
    for r in range(5):
        mine = (rows == r).nonzero().squeeze(1).tolist()
        if not mine:
            assert (got_o[r] == 0).all() and (got_lse[r] == torch.finfo(torch.float32).min).all()
            continue
        want_o, want_lse = merge_normalised([(o[i:i + 1], lse[i:i + 1]) for i in mine])
        torch.testing.assert_close(got_o[r:r + 1], want_o, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got_lse[r:r + 1], want_lse, atol=1e-6, rtol=1e-6)


def test_small_caches_are_gathered(monkeypatch):
    """Under ``MIN_IN_PLACE_BYTES`` of K the runs are not looked for (a tiny model's batch: its gather costs less)."""
    calls = spy_key_runs(monkeypatch)
    monkeypatch.setattr(inplace_flash, "MIN_IN_PLACE_BYTES", 1 << 20)
    b = make_batch([700, 300], hq=4, hkv=2, dqk=16, decode=True, seed=8, slot_layout="engine")  # 128 KiB of K
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens)
    decode_blocks(b.q, b.k_cache, b.v_cache, build_decode_index(b.req_to_token, meta.inputs), 0.25, cpu_flash=True)
    assert not calls


def test_runs_are_found_once_per_step(monkeypatch):
    """Eagerly, a step's layers share its index: the runs are found on the first layer and kept on the index."""
    calls = spy_key_runs(monkeypatch)
    b = make_batch([700, 300], hq=4, hkv=2, dqk=16, decode=True, seed=9, slot_layout="engine")
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens)
    index = build_decode_index(b.req_to_token, meta.inputs)
    outs = [decode_blocks(b.q, b.k_cache, b.v_cache, index, 0.25, cpu_flash=True) for _layer in range(3)]
    assert len(calls) == 1 and index.key_runs == (calls[0],)
    assert all(torch.equal(o, outs[0]) for o in outs)
