"""The decode forms: the device's kernel (on CPU the C++ kernel, where it is built) and the portable matmul form
(what a device without a kernel runs; tested here on CPU as its twin), against the float64 reference, compiled and
eager, a batch of one indexed on the host, and the choice between them (``forms.choose_form``)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import DECODE_FORMS, in_place_op, reference_attention

from compiled_attn import build_decode_index, decode_blocks, plan_decode
from compiled_attn.bench.batches import make_batch
from compiled_attn.compile_policy import compile_step
from compiled_attn.decode import _batched_index, _single_request_index
from compiled_attn.forms import choose_form
from compiled_attn.kernels.cpu.kernel import native_available
from compiled_attn.plan import DecodeInputs, decode_blocks_needed, total_blocks_needed

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


@pytest.mark.parametrize("form", DECODE_FORMS)
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_batch_of_one_indexed_on_the_host(window, page_size, form):
    """A batch of one, eagerly on CPU: the index is built on the host (``_single_request_index``), its table equal
    to the tensor form's, and each form reads it to the float64 reference (a window: the keys from its start; a
    paged table)."""
    b = make_batch([130], hq=8, hkv=2, dqk=32, decode=True, seed=3, page_size=page_size)
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, block_size=16,
                       sliding_window=window, page_size=page_size, block_capacity=12)
    index = build_decode_index(b.req_to_token, meta.inputs, page_size)
    tensor_form = build_decode_index(b.req_to_token, meta.inputs, page_size, host_form=False)
    assert torch.equal(index.slots, tensor_form.slots) and torch.equal(index.valid, tensor_form.valid)
    out = decode_blocks(b.q, b.k_cache, b.v_cache, index, 0.3, **DECODE_FORMS[form])
    ref = reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.seq_lens - 1,
                              torch.ones(1, dtype=torch.long), scale=0.3, sliding_window=window)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_the_choice():
    """On CPU the C++ kernel where it is built, else the matmul form; a named form runs as named; a named kernel
    that cannot serve the call, or an unknown name, is a ValueError naming ``form``."""
    b = make_batch([9, 3], hq=4, hkv=2, dqk=16, decode=True)
    auto = choose_form("decode", b.q, b.k_cache, b.v_cache, rows_per_kv_head=2)
    assert auto.form == ("kernel" if native_available() else "matmul"), auto
    assert choose_form("decode", b.q, b.k_cache, b.v_cache, rows_per_kv_head=2, form="matmul").form == "matmul"
    with pytest.raises(ValueError, match="form must be one of"):
        decode_blocks(b.q, b.k_cache, b.v_cache, _index(b), 0.3, form="flash")
    odd = make_batch([9, 3], hq=4, hkv=2, dqk=24, decode=True)  # a head size the kernel refuses
    assert choose_form("decode", odd.q, odd.k_cache, odd.v_cache, rows_per_kv_head=2).form == "matmul"
    with pytest.raises(ValueError, match="form='kernel': the C\\+\\+ kernel cannot serve this call"):
        decode_blocks(odd.q, odd.k_cache, odd.v_cache, _index(odd), 0.3, form="kernel")


@pytest.mark.parametrize("form", DECODE_FORMS)
def test_both_forms_compile_fullgraph(form):
    torch._dynamo.reset()

    def step(q, k_cache, v_cache, table, inputs):
        index = build_decode_index(table, inputs)
        return decode_blocks(q, k_cache, v_cache, index, 0.3, **DECODE_FORMS[form])

    fn = compile_step(step)
    for seed in (0, 1):
        b = _batch(8, 2, seed=seed)
        meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, block_size=16)
        out = fn(b.q, b.k_cache, b.v_cache, b.req_to_token, meta.inputs)
        assert (out.double() - _reference(b, 0.3)).abs().max() < 1e-4


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("form", DECODE_FORMS)
def test_compiled_cpu_decode_reads_the_cache_in_place(form, page_size):
    """Under ``torch.compile`` on CPU the default form is the C++ kernel where it is built: the graph calls its op
    (the cache read in place); the matmul form does not. Both match the float64 reference."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    b = make_batch([5, 70, 130], hq=8, hkv=2, dqk=32, decode=True, seed=4, page_size=page_size)
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, block_size=16,
                       page_size=page_size)

    def step(q, k_cache, v_cache, table, inputs):
        return decode_blocks(q, k_cache, v_cache, build_decode_index(table, inputs, page_size), 0.3,
                             **DECODE_FORMS[form])

    out = torch.compile(step, backend=counter, fullgraph=True)(b.q, b.k_cache, b.v_cache, b.req_to_token,
                                                                meta.inputs)
    targets = {n.target for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert (in_place_op() in targets) == (form == "auto" and native_available())
    ref = reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                              b.ext_lens, scale=0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_a_compiled_decode_serves_batches_of_other_block_counts():
    """A bucket's block list sized far past the batch (40 blocks for the 10 or 11 it uses): the compiled decode
    matches the float64 reference, and a batch using another number of blocks reuses the compiled graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    step = torch.compile(lambda q, kc, vc, table, inputs: decode_blocks(
        q, kc, vc, build_decode_index(table, inputs, host_form=False), 0.3), backend=counter, fullgraph=True,
        dynamic=True)
    for lens in ([5, 70, 50], [129, 1, 16]):
        b = make_batch(lens, hq=8, hkv=2, dqk=32, decode=True, seed=4)
        meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, block_size=16,
                           block_capacity=40)
        out = step(b.q, b.k_cache, b.v_cache, b.req_to_token, meta.inputs)
        ref = reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                                  b.ext_lens, scale=0.3)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1


@settings(max_examples=60, deadline=None)
@given(data=st.data(), page_size=st.sampled_from([1, 4, 16, 64]), block_size=st.sampled_from([8, 16, 24]))
def test_single_request_index_equals_the_tensor_form(data, page_size, block_size):
    """A batch of one on CPU builds its index on the host (``_single_request_index``); it must equal the tensor
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
    for name in ("block_req", "slots", "valid"):
        a, b = getattr(host, name), getattr(traced, name)
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
