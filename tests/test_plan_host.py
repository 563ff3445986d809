"""The decode plan's host arithmetic (Python ints) and the host-built index of a batch of one equal their tensor forms:
the key ranges, the step inputs, the block counts, the index through a slot translation."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_attn.decode import SlotMap, _batched_index, _single_request_index
from compiled_attn.plan import DecodeInputs, decode_blocks_needed, decode_kv_bounds, decode_kv_range, plan_decode

WINDOWS = st.one_of(st.none(), st.integers(0, 40))


@settings(max_examples=80, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 30)), max_size=6), window=WINDOWS,
       cross=st.booleans())
def test_decode_kv_bounds_equal_the_tensor_form(lens, window, cross):
    """``decode_kv_bounds`` (lists, the plan's) equals ``decode_kv_range`` (tensors, the graphs'): windows, encoder
    offsets, cross-attention, an empty batch."""
    seq = [n for n, _ in lens]
    enc = [e for _, e in lens]
    lo, hi = decode_kv_bounds(seq, enc, None if cross else window, cross)
    t_lo, t_hi = decode_kv_range(torch.tensor(seq, dtype=torch.int64), torch.tensor(enc, dtype=torch.int64),
                                 None if cross else window, cross)
    assert lo == t_lo.tolist() and hi == t_hi.tolist()


@settings(max_examples=60, deadline=None)
@given(data=st.data(), page_size=st.sampled_from([1, 4, 16]), block_size=st.sampled_from([8, 16]), window=WINDOWS)
def test_plan_decode_inputs_equal_the_tensor_form(data, page_size, block_size, window):
    """``plan_decode``'s step inputs and block count, made from Python ints, equal the tensor arithmetic over the
    same batch, padded to the capacities asked for (padded rows: row 0, an empty range)."""
    bs = data.draw(st.integers(1, 4))
    lens = data.draw(st.lists(st.integers(0, 60), min_size=bs, max_size=bs))
    width = 64
    table = torch.arange(8 * width, dtype=torch.int32).view(8, width)  # row r: page-aligned consecutive slots
    rows = torch.tensor(data.draw(st.lists(st.integers(0, 7), min_size=bs, max_size=bs)))
    seq = torch.tensor(lens)
    q, kc = torch.zeros(bs, 2, 8), torch.zeros(8 * width, 1, 8)
    extra_rows, extra_blocks = data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2))
    lo, hi = decode_kv_range(seq, torch.zeros_like(seq), window, False)
    needed = int(decode_blocks_needed(lo, hi, block_size, page_size).sum())
    meta = plan_decode(q, kc, kc, table, rows, seq, sliding_window=window, block_size=block_size, page_size=page_size,
                       batch_capacity=bs + extra_rows, block_capacity=max(needed, 1) + extra_blocks)
    pad = torch.zeros(extra_rows, dtype=torch.int64)
    inputs = meta.inputs
    assert meta.blocks_needed == needed and meta.num_real == bs
    for got, want in ((inputs.req_rows, rows), (inputs.kv_lo, lo), (inputs.kv_hi, hi)):
        assert got.dtype == torch.int64 and torch.equal(got, torch.cat([want, pad]))
    assert torch.equal(inputs.block_ids, torch.arange(max(needed, 1) + extra_blocks))
    assert torch.equal(inputs.block_offsets, torch.arange(block_size))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), page_size=st.sampled_from([1, 4, 6, 16]), block_size=st.sampled_from([8, 12, 16]))
def test_single_request_index_through_a_slot_map_equals_the_tensor_form(data, page_size, block_size):
    """A batch of one indexed on the host through a slot translation (a hybrid sliding-window pool's window layer)
    has the tensor form's blocks: the translated slots, the masked positions' block-first slots, ``valid``."""
    width = data.draw(st.integers(1, 4)) * 32
    hi = data.draw(st.integers(0, width))
    lo = data.draw(st.integers(0, hi))
    table = torch.randint(0, 500, (2, width), dtype=torch.int32)
    slot_map = SlotMap(torch.randint(0, 64, (501,), dtype=torch.int32), 48)
    unit = math.gcd(page_size, block_size)
    needed = int(decode_blocks_needed(torch.tensor([lo]), torch.tensor([hi]), block_size, page_size))
    inputs = DecodeInputs(torch.tensor([1]), torch.tensor([lo]), torch.tensor([hi]),
                          torch.arange(needed + data.draw(st.integers(0, 2))), torch.arange(block_size))
    host = _single_request_index(table, inputs, unit, slot_map)
    traced = _batched_index(table, inputs, unit, slot_map)
    for name in ("block_req", "slots", "valid"):
        a, b = getattr(host, name), getattr(traced, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("page_size, block_size", [(6, 12), (3, 9), (16, 64)])
def test_single_request_index_of_any_unit(page_size, block_size):
    """The host index equals the tensor form for block starts at multiples of a unit that is not a power of two
    (6, 3) and of one that is (16), the range starting inside a page, over pages in random order."""
    unit = math.gcd(page_size, block_size)
    width = 8 * block_size
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(page_size))
    table = torch.stack([torch.zeros(width, dtype=torch.int32),
                         (perm[torch.arange(width) // unit] * unit + torch.arange(width) % unit).int()])
    lo, hi = unit + 1, width - 2
    needed = int(decode_blocks_needed(torch.tensor([lo]), torch.tensor([hi]), block_size, page_size))
    inputs = DecodeInputs(torch.tensor([1]), torch.tensor([lo]), torch.tensor([hi]), torch.arange(needed),
                          torch.arange(block_size))
    host, traced = _single_request_index(table, inputs, unit), _batched_index(table, inputs, unit)
    for name in ("block_req", "slots", "valid"):
        assert torch.equal(getattr(host, name), getattr(traced, name)), name
    assert not host.valid.view(-1)[:lo % unit].any() and host.valid.view(-1)[lo % unit]  # the block starts at unit


def _plan_or_error(*args, **kwargs):
    try:
        meta = plan_decode(*args, **kwargs)
    except (TypeError, ValueError) as e:
        return type(e), str(e)
    return (meta.num_real, meta.blocks_needed, meta.slots_checked, meta.page_size,
            [(t.dtype, t.tolist()) for t in meta.inputs])


@settings(max_examples=150, deadline=None)
@given(data=st.data(), page_size=st.sampled_from([1, 4, 16]), block_size=st.sampled_from([8, 16]))
def test_plan_of_one_request_equals_the_general_plan(data, page_size, block_size):
    """``plan_decode`` of one decoder-only request on the host (``_plan_one_request``, the checks in their passing
    form) returns what the general form returns, and where an input is bad leaves it to the general form, which
    raises the same error: rows and lengths out of range, entries that are not slots (or are, off the page layout),
    windows (-1 and bad ones), capacities, int32 inputs, a transposed table."""
    import compiled_attn.plan as plan_module

    width, num_slots = 64, 8 * 64
    table = torch.arange(8 * width, dtype=data.draw(st.sampled_from([torch.int32, torch.int64]))).view(8, width)
    if data.draw(st.booleans()):
        table = table.t().contiguous().t()
    if data.draw(st.booleans()):  # an entry that is not a slot, or one off the page layout
        table[data.draw(st.integers(0, 7)), data.draw(st.integers(0, width - 1))] = data.draw(
            st.sampled_from([-1, num_slots, 5]))
    rows = torch.tensor([data.draw(st.integers(-1, 8))], dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))
    lens = torch.tensor([data.draw(st.integers(-1, width + 1))])
    kwargs = dict(block_size=block_size, page_size=page_size,
                  sliding_window=data.draw(st.sampled_from([None, -1, 0, 3, 40, True, 2.5, -2])),
                  batch_capacity=data.draw(st.sampled_from([None, 0, 1, 3])),
                  block_capacity=data.draw(st.sampled_from([None, 0, 2, 9])),
                  check_slots=data.draw(st.booleans()))
    args = (torch.zeros(1, 2, 8), torch.zeros(num_slots, 1, 8), torch.zeros(num_slots, 1, 8), table, rows, lens)
    fast = _plan_or_error(*args, **kwargs)
    one_request = plan_module._plan_one_request
    plan_module._plan_one_request = lambda *a: None  # the general form only
    try:
        general = _plan_or_error(*args, **kwargs)
    finally:
        plan_module._plan_one_request = one_request
    assert fast == general
