"""The three decode forms: ATen's CPU flash kernel over chunked gathers (``block_flash``, the CPU eager default),
the fused in-place reads (``decode_fused``, the CPU compiled default; tested eagerly as its twin too) and the matmul
form (what CUDA runs; tested here on CPU as its twin). All against the float64 reference, the chunking against a
plain per-block softmax, and the automatic choice."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import DECODE_FORMS, in_place_op, reference_attention

from compiled_attn import build_decode_index, decode_blocks, plan_decode
from compiled_attn.bench.batches import make_batch
from compiled_attn.block_flash import block_attention, chunk_blocks_for, supports_block_flash
from compiled_attn.compile_policy import compile_step
from compiled_attn.decode import (
    _batched_index,
    _single_request_index,
    decode_blocks_needed,
    total_blocks_needed,
)
from compiled_attn.forms import choose_form
from compiled_attn.metadata import DecodeInputs
from compiled_attn.native_decode import native_available

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
LENS = [5, 70, 1, 130, 0, 64, 65]  # one block, several, exactly one block, a partial block, an empty row


def _batch(hq, hkv, dtype=torch.float32, seed=0):
    """A decode batch over LENS; q has one row per request (the empty row's query attends to nothing)."""
    b = make_batch(LENS, hq=hq, hkv=hkv, dqk=32, dtype=dtype, decode=True, seed=seed)
    q = torch.randn(len(LENS), hq, 32, generator=torch.Generator().manual_seed(seed)).to(dtype)
    q[b.seq_lens > 0] = b.q
    b.q = q
    return b


def _index(b, block_size=16, block_capacity=None):
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, block_size=block_size,
                       block_capacity=block_capacity)
    return build_decode_index(b.req_to_token, meta.inputs)


def _reference(b, scale):
    has = b.seq_lens > 0
    ref = torch.zeros(b.q.shape, dtype=torch.float64)
    ref[has] = reference_attention(b.q[has], b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens,
                              (b.seq_lens - 1).clamp_min(0), has.long(), scale=scale)
    return ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("form", DECODE_FORMS)
def test_every_form_matches_reference(form, heads, dtype):
    hq, hkv = heads
    b = _batch(hq, hkv, dtype, seed=3)
    # spare blocks past the batch's need, as in a captured bucket: they must not leak into any row
    out = decode_blocks(b.q, b.k_cache, b.v_cache, _index(b, block_capacity=40), 0.3, **DECODE_FORMS[form])
    assert out.dtype == dtype and out.shape == (len(LENS), hq, 32)
    err = (out.double() - _reference(b, 0.3)).abs().max().item()
    assert err <= TOL[dtype], f"max abs error {err}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("single_request_chunks", [0, 16])  # 0: one-block segments, merged by log-sum-exp
@pytest.mark.parametrize("length", [0, 1, 130])
def test_single_request_both_ways(monkeypatch, length, single_request_chunks, dtype):
    import compiled_attn.decode_flash as decode_flash

    monkeypatch.setattr(decode_flash, "SINGLE_REQUEST_CHUNKS", single_request_chunks)
    b = make_batch([length] if length else [3], hq=8, hkv=2, dqk=32, dtype=dtype, decode=True, seed=length)
    if not length:  # a query with no key: zeros
        b.seq_lens = torch.zeros(1, dtype=torch.int64)
    # spare blocks after the request's, as in a captured bucket (the single path reads only the valid prefix)
    out = decode_blocks(b.q, b.k_cache, b.v_cache, _index(b, block_capacity=12), 0.3, cpu_flash=True)
    assert out.dtype == dtype
    assert (out.double() - _reference(b, 0.3)).abs().max() < TOL[dtype]


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("page_size", [1, 16])
def test_single_request_reads_its_slots_without_the_block_table(monkeypatch, window, page_size):
    """A batch of one, eagerly on CPU without the C++ kernel (``native=False``): the host-built index hands the
    decode the request's key slots (``DecodeIndex.single``) and builds no block table unless something reads it;
    the output still matches the float64 reference (a window: the keys from its start; a paged table). The kernel
    (the default where it fits) reads the table that index builds, the traced form's, to the same result."""
    b = make_batch([130], hq=8, hkv=2, dqk=32, decode=True, seed=3, page_size=page_size)
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, block_size=16,
                       sliding_window=window, page_size=page_size)
    index = build_decode_index(b.req_to_token, meta.inputs, page_size)
    lo = 0 if window is None else 130 - (window + 1)
    assert torch.equal(index.single, b.req_to_token[b.rows[0], lo:130].long())
    out = decode_blocks(b.q, b.k_cache, b.v_cache, index, 0.3, native=False)
    assert index._table is None  # the decode never read the block table
    ref = reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.seq_lens - 1,
                              torch.ones(1, dtype=torch.long), scale=0.3, sliding_window=window)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # read, the table is the traced form's
    traced = build_decode_index(b.req_to_token, meta.inputs, page_size, host_form=False)
    assert torch.equal(index.slots, traced.slots) and torch.equal(index.valid, traced.valid)
    # the kernel, where it is built, reads the table the host index builds
    choice = choose_form("decode", b.q, b.k_cache, b.v_cache, rows_per_kv_head=4)
    assert choice.form == ("kernel" if native_available() else "flash"), choice
    torch.testing.assert_close(decode_blocks(b.q, b.k_cache, b.v_cache, index, 0.3).double(), ref, atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("path", ["dense", "blocks"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_batch_paths_agree(monkeypatch, path, page_size, with_sinks):
    """A small batch runs padded in one kernel call ("dense"); forcing the split-and-merge path ("blocks") gives
    the same answer, both equal to the float64 reference (sinks as one more softmax column)."""
    import compiled_attn.decode_flash as decode_flash

    if path == "blocks":
        monkeypatch.setattr(decode_flash, "DENSE_BYTES", 0)
    calls = []
    monkeypatch.setattr(decode_flash, "_dense", lambda *a, _f=decode_flash._dense: calls.append(1) or _f(*a))
    lens = [100, 120, 90, 1, 128]
    b = make_batch(lens, hq=8, hkv=2, dqk=32, decode=True, seed=9, page_size=page_size)
    sinks = torch.linspace(-3, 3, 8) if with_sinks else None
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, block_size=32,
                       page_size=page_size, block_capacity=30, batch_capacity=7)
    q = torch.cat([b.q, b.q[:2]])  # two padded rows, as in a graph bucket: row 0, empty range
    out = decode_blocks(q, b.k_cache, b.v_cache, build_decode_index(b.req_to_token, meta.inputs, page_size), 0.3,
                        cpu_flash=True, sinks=sinks)
    assert bool(calls) == (path == "dense")
    ref = reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                              b.ext_lens, scale=0.3, sinks=sinks)
    torch.testing.assert_close(out[:len(lens)].double(), ref, atol=1e-5, rtol=1e-5)
    assert (out[len(lens):] == 0).all()


@pytest.mark.parametrize("chunk_blocks", [1, 3, 1000])
def test_block_flash_chunks_match_plain_block_softmax(chunk_blocks):
    b = _batch(8, 2, seed=5)
    index = _index(b, block_size=16, block_capacity=30)
    nblk, block_size = index.slots.shape
    req = index.block_req.clamp_max(len(LENS) - 1)
    qb = b.q.index_select(0, req).view(nblk, 2, 4, 32).float()
    o, lse = block_attention(qb, b.k_cache, b.v_cache, index.slots, index.valid, 0.3, chunk_blocks)
    # plain float64 per block: scores over the block's valid keys, softmax, weighted V, log-sum-exp
    k = b.k_cache[index.slots].double().permute(0, 2, 1, 3)  # [nblk, Hkv, block_size, D]
    v = b.v_cache[index.slots].double().permute(0, 2, 1, 3)
    s = torch.einsum("nhgd,nhtd->nhgt", qb.double(), k) * 0.3
    s = s.masked_fill(~index.valid[:, None, None, :], float("-inf"))
    has_keys = index.valid.any(1)
    lse_ref = torch.logsumexp(s[has_keys], -1)
    o_ref = torch.einsum("nhgt,nhtd->nhgd", torch.softmax(s[has_keys], -1), v[has_keys])
    assert (o[has_keys].double() - o_ref).abs().max() < 1e-5
    assert (lse[has_keys].double() - lse_ref).abs().max() < 1e-5
    assert (o[~has_keys] == 0).all()  # blocks with no key (a bucket's spare blocks) give zeros, not NaN


def test_chunk_size_keeps_a_gathered_tile_near_one_mib():
    assert chunk_blocks_for(64, 8, 128) == 4  # llama-3-8b: 256 KiB of float32 K per block
    assert chunk_blocks_for(64, 64, 128) == 1  # never 0
    assert chunk_blocks_for(16, 1, 16) == 1024


def test_automatic_choice():
    q, kv = torch.zeros(2, 8, 64), torch.zeros(10, 2, 64)
    assert supports_block_flash(q, kv, kv, None)
    assert not supports_block_flash(q, kv, kv, 30.0)  # soft-cap: the kernel has none
    assert not supports_block_flash(torch.zeros(2, 8, 576), torch.zeros(10, 1, 576), torch.zeros(10, 1, 512), None)
    b = make_batch([9, 3], hq=4, hkv=2, dqk=16, decode=True)
    with pytest.raises(ValueError, match="cpu_flash=True needs .*logit_cap"):
        decode_blocks(b.q, b.k_cache, b.v_cache, _index(b), 0.3, logit_cap=5.0, cpu_flash=True)
    with pytest.raises(ValueError, match="fused=True and cpu_flash=True"):
        decode_blocks(b.q, b.k_cache, b.v_cache, _index(b), 0.3, cpu_flash=True, fused=True)


@pytest.mark.parametrize("cpu_flash", [None, False])
def test_both_forms_compile_fullgraph(cpu_flash):
    torch._dynamo.reset()

    def step(q, k_cache, v_cache, table, inputs):
        index = build_decode_index(table, inputs)
        return decode_blocks(q, k_cache, v_cache, index, 0.3, cpu_flash=cpu_flash)

    fn = compile_step(step)
    for seed in (0, 1):
        b = _batch(8, 2, seed=seed)
        meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, block_size=16)
        out = fn(b.q, b.k_cache, b.v_cache, b.req_to_token, meta.inputs)
        assert (out.double() - _reference(b, 0.3)).abs().max() < 1e-4


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("cpu_flash", [None, True])
def test_compiled_cpu_decode_reads_the_cache_in_place(cpu_flash, page_size):
    """Under ``torch.compile`` on CPU the default form is the fused one: the traced graph reads the cache through
    the stored block table (``index_columns``) and calls no flash op; ``cpu_flash=True`` still asks for the flash
    op. Both match the float64 reference."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    b = make_batch([5, 70, 130], hq=8, hkv=2, dqk=32, decode=True, seed=4, page_size=page_size)
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, block_size=16,
                       page_size=page_size)

    def step(q, k_cache, v_cache, table, inputs):
        return decode_blocks(q, k_cache, v_cache, build_decode_index(table, inputs, page_size), 0.3,
                             cpu_flash=cpu_flash)

    out = torch.compile(step, backend=counter, fullgraph=True)(b.q, b.k_cache, b.v_cache, b.req_to_token,
                                                                meta.inputs)
    targets = {n.target for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    fused = cpu_flash is None
    assert (in_place_op() in targets) == fused
    assert (torch.ops.compiled_attn.decode_flash.default in targets) == (not fused)
    ref = reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                              b.ext_lens, scale=0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_compiled_cpu_decode_computes_the_used_blocks_only():
    """A bucket's block list sized far past the batch (40 blocks for the 10 it uses): the compiled fused decode
    counts the used blocks on the host (``used_blocks``, a data-dependent size) and runs its kernel on those; the
    result is the float64 reference's, and a batch using another number of blocks reuses the compiled graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from compiled_attn.decode_fused import used_blocks

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    step = torch.compile(lambda q, kc, vc, table, inputs: decode_blocks(
        q, kc, vc, build_decode_index(table, inputs, host_form=False), 0.3), backend=counter, fullgraph=True,
        dynamic=True)
    for lens, used in (([5, 70, 50], 10), ([129, 1, 16], 11)):
        b = make_batch(lens, hq=8, hkv=2, dqk=32, decode=True, seed=4)
        meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, block_size=16,
                           block_capacity=40)
        assert used_blocks(build_decode_index(b.req_to_token, meta.inputs).block_req, 3).shape == (used,)
        out = step(b.q, b.k_cache, b.v_cache, b.req_to_token, meta.inputs)
        ref = reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                                  b.ext_lens, scale=0.3)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    targets = {n.target for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    # the C++ kernel skips unused blocks itself; the traced form slices them off by the host-read count
    assert (torch.ops.compiled_attn.used_blocks.default in targets) == (not native_available())
    assert counter.frame_count == 1


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunks_switch_to_threads_when_one_runs_slow(monkeypatch, page_size):
    """A call whose chunk runs far over the fastest one finishes its remaining chunks on Python threads (one
    intra-op thread each, chunks pulled from a counter); forced here with a factor of 0, the output is the same
    as the all-OpenMP call's, and the caller's thread count is restored."""
    import compiled_attn.block_flash as bf

    b = make_batch([300, 40, 129, 250, 77], hq=8, hkv=2, dqk=32, decode=True, seed=4, page_size=page_size)
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, block_size=16,
                       page_size=page_size)
    index = build_decode_index(b.req_to_token, meta.inputs, page_size)
    qb = b.q.index_select(0, index.block_req.clamp_max(4)).view(-1, 2, 4, 32).contiguous()

    def run():
        return bf.block_attention(qb, b.k_cache, b.v_cache, index.runs, index.valid, 0.3, 3, index.unit)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        o_ref, lse_ref = run()
        switched = []
        real = bf._run_on_chunk_threads
        monkeypatch.setattr(bf, "_run_on_chunk_threads", lambda *a: switched.append(a[2]) or real(*a))
        monkeypatch.setattr(bf, "SLOW_CHUNK_FACTOR", 0.0)
        o, lse = run()
        assert switched == [2]  # after the second chunk
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(o, o_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, lse_ref, atol=1e-6, rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), page_size=st.sampled_from([1, 4, 16, 64]), block_size=st.sampled_from([8, 16, 24]))
def test_single_request_index_equals_the_tensor_form(data, page_size, block_size):
    """A batch of one on CPU builds its index on the host (``_single_request_index``); it must equal the traced
    form field by field: windowed ranges (``kv_lo`` > 0, not page-aligned), empty ranges, capacity padding, a range
    ending at the table's last column (its last block runs past the width)."""
    width = data.draw(st.integers(1, 6)) * 32
    hi = data.draw(st.integers(0, width))
    lo = data.draw(st.integers(0, hi))
    table = torch.randint(0, 10_000, (3, width), dtype=torch.int32)
    unit = math.gcd(page_size, block_size)
    needed = int(decode_blocks_needed(torch.tensor([lo]), torch.tensor([hi]), block_size, page_size))
    capacity = needed + data.draw(st.integers(0, 3))
    inputs = DecodeInputs(torch.tensor([data.draw(st.integers(0, 2))]), torch.tensor([lo]), torch.tensor([hi]),
                          torch.arange(capacity), torch.arange(block_size))
    host, traced = _single_request_index(table, inputs, unit), _batched_index(table, inputs, unit)
    assert host.unit == traced.unit
    for name in ("block_req", "slots", "valid", "units"):
        a, b = getattr(host, name), getattr(traced, name)
        if a is None or b is None:
            assert a is b, name
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), name


@settings(max_examples=60, deadline=None)
@given(ranges=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), max_size=6),
       page_size=st.sampled_from([1, 4, 16, 64]), block_size=st.sampled_from([8, 16, 24, 64]))
def test_total_blocks_needed_counts_as_the_tensor_form(ranges, page_size, block_size):
    """The plan's host count of blocks (Python ints) equals the graph code's per-request tensor form, summed:
    empty and inverted ranges, ranges not starting at a page boundary, an empty batch."""
    lo = torch.tensor([a for a, _ in ranges], dtype=torch.int64)
    hi = torch.tensor([b for _, b in ranges], dtype=torch.int64)
    assert total_blocks_needed(lo, hi, block_size, page_size) == int(
        decode_blocks_needed(lo, hi, block_size, page_size).sum())
