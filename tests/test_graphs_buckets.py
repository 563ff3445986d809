"""BucketPolicy and StaticBuffers: lookups, edges, errors, in-place padding (CPU, fast)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphs import DEFAULT_BATCH_SIZES, BucketPolicy, BufferSpec, StaticBuffers, kv_capacities

# ---------------------------------------------------------------------------------------------------------
# BucketPolicy


def test_default_batch_sizes_equal_sglang():
    sglang = [1, 2, 4, 8, 12] + list(range(16, 257, 8))
    assert list(DEFAULT_BATCH_SIZES) == sglang
    assert DEFAULT_BATCH_SIZES[-1] == 256 and len(DEFAULT_BATCH_SIZES) == 36


def test_create_caps_default_list_and_includes_max():
    assert BucketPolicy.create(256, 4096).batch_sizes == DEFAULT_BATCH_SIZES
    assert BucketPolicy.create(16, 4096).batch_sizes == (1, 2, 4, 8, 12, 16)
    assert BucketPolicy.create(10, 4096).batch_sizes == (1, 2, 4, 8, 10)
    assert BucketPolicy.create(1, 4096).batch_sizes == (1,)
    assert BucketPolicy.create(300, 4096).batch_sizes == DEFAULT_BATCH_SIZES + (300,)


def test_create_with_override_list_is_capped_sorted_unique():
    p = BucketPolicy.create(32, 1024, batch_sizes=[16, 4, 4, 64, 1])
    assert p.batch_sizes == (1, 4, 16)
    with pytest.raises(ValueError, match="max_batch_size=2"):
        BucketPolicy.create(2, 1024, batch_sizes=[4, 8])


@pytest.mark.parametrize("bad", [[], [0, 1], [-4], [1.5], [True, 2], "abc", None])
def test_bad_batch_size_lists_raise(bad):
    with pytest.raises(ValueError, match="batch_sizes"):
        BucketPolicy(bad, (256,))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_batch_size=0, max_kv_tokens=256), "max_batch_size"),
        (dict(max_batch_size=8, max_kv_tokens=0), "max_kv_tokens"),
        (dict(max_batch_size=8, max_kv_tokens=256, min_kv_tokens=0), "min_kv_tokens"),
        (dict(max_batch_size=8, max_kv_tokens=256, kv_growth=1.0), "kv_growth"),
        (dict(max_batch_size=8, max_kv_tokens=256, kv_growth=float("inf")), "kv_growth"),
    ],
)
def test_create_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BucketPolicy.create(**kwargs)


def test_kv_capacities_geometric_aligned_and_end_exactly_at_max():
    assert kv_capacities(4096) == (256, 512, 1024, 2048, 4096)
    assert kv_capacities(5000) == (256, 512, 1024, 2048, 4096, 5000)
    assert kv_capacities(100) == (100,)  # min above max: one bucket, the max
    assert kv_capacities(256) == (256,)
    assert kv_capacities(1000, min_kv_tokens=100, growth=1.5) == (128, 192, 256, 384, 512, 768, 1000)


@settings(max_examples=60, deadline=None)
@given(
    max_kv=st.integers(1, 200_000),
    min_kv=st.integers(1, 5000),
    growth=st.floats(1.01, 8.0),
)
def test_kv_capacities_properties(max_kv, min_kv, growth):
    caps = kv_capacities(max_kv, min_kv_tokens=min_kv, growth=growth)
    assert caps[-1] == max_kv
    assert list(caps) == sorted(set(caps))
    assert all(c % 64 == 0 for c in caps[:-1])
    assert all(c < max_kv for c in caps[:-1])


def test_batch_bucket_lookup_and_edges():
    p = BucketPolicy.create(64, 4096)
    assert p.batch_bucket(1) == 1
    assert p.batch_bucket(3) == 4
    assert p.batch_bucket(8) == 8
    assert p.batch_bucket(13) == 16
    assert p.batch_bucket(64) == 64
    assert p.batch_bucket(65) is None
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="bs"):
            p.batch_bucket(bad)


def test_kv_bucket_lookup_edges_and_error_names_argument_and_limit():
    p = BucketPolicy.create(8, 4096)
    assert p.kv_bucket(0) == 256
    assert p.kv_bucket(256) == 256
    assert p.kv_bucket(257) == 512
    assert p.kv_bucket(4096) == 4096
    with pytest.raises(ValueError, match=r"n=4097.*4096"):
        p.kv_bucket(4097)
    with pytest.raises(ValueError, match="n"):
        p.kv_bucket(-1)


def test_key_and_keys_largest_first():
    p = BucketPolicy((1, 4), (64, 128))
    assert p.keys() == ((4, 128), (4, 64), (1, 128), (1, 64))
    assert p.key(3, 100) == (4, 128)
    assert p.key(5, 10) is None
    assert p.max_batch_size == 4 and p.max_kv_tokens == 128


@settings(max_examples=100, deadline=None)
@given(bs=st.integers(1, 400))
def test_batch_bucket_is_smallest_bucket_at_least_bs(bs):
    p = BucketPolicy.create(256, 1024)
    got = p.batch_bucket(bs)
    fits = [b for b in p.batch_sizes if b >= bs]
    assert got == (min(fits) if fits else None)


def test_policy_is_frozen():
    p = BucketPolicy.create(8, 256)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.batch_sizes = (1,)


# ---------------------------------------------------------------------------------------------------------
# StaticBuffers


def _specs(bucket=4, kv=8):
    return {
        "q": BufferSpec((bucket, 3), torch.float32, fill=0.0),
        "seq_lens": BufferSpec((bucket,), torch.int64, fill=1),
        "slots": BufferSpec((bucket, kv), torch.int32, fill=0),
        "head_major": BufferSpec((2, bucket), torch.float32, fill=-1.0, batch_dim=1),
        "scale": BufferSpec((1,), torch.float32, fill=1.0, batch_dim=None),
    }


def _real(n, kv=8):
    return {
        "q": torch.randn(n, 3),
        "seq_lens": torch.arange(1, n + 1, dtype=torch.int32),  # int32 -> int64: a safe cast
        "slots": torch.randint(0, 100, (n, kv), dtype=torch.int32),
        "head_major": torch.randn(2, n),
        "scale": torch.tensor([0.5]),
    }


def test_buffers_allocated_with_fill_and_bucket():
    b = StaticBuffers(_specs(), "cpu")
    assert b.bucket == 4 and b.num_real == 0
    assert torch.equal(b.tensors["seq_lens"], torch.ones(4, dtype=torch.int64))
    assert b.tensors["slots"].dtype == torch.int32
    assert torch.equal(b.tensors["head_major"], torch.full((2, 4), -1.0))


@pytest.mark.parametrize("n", [1, 3, 4])
def test_copy_in_copies_real_rows_and_pads_rest(n):
    b = StaticBuffers(_specs(), "cpu")
    b.copy_in(_real(4))  # dirty every row first: padding must be rewritten, not assumed
    real = _real(n)
    assert b.copy_in(real) == n and b.num_real == n
    t = b.tensors
    assert torch.equal(t["q"][:n], real["q"]) and torch.all(t["q"][n:] == 0)
    assert torch.equal(t["seq_lens"][:n], real["seq_lens"].long()) and torch.all(t["seq_lens"][n:] == 1)
    assert torch.equal(t["slots"][:n], real["slots"]) and torch.all(t["slots"][n:] == 0)
    assert torch.equal(t["head_major"][:, :n], real["head_major"]) and torch.all(t["head_major"][:, n:] == -1)
    assert torch.equal(t["scale"], real["scale"])


def test_copy_in_keeps_addresses():
    b = StaticBuffers(_specs(), "cpu")
    before = {k: v.data_ptr() for k, v in b.tensors.items()}
    objects = dict(b.tensors)
    for n in (4, 1, 3, 2):
        b.copy_in(_real(n))
    assert {k: v.data_ptr() for k, v in b.tensors.items()} == before
    assert all(b.tensors[k] is objects[k] for k in objects)


def test_copy_in_accepts_non_contiguous_source():
    b = StaticBuffers({"x": BufferSpec((4, 3), torch.float32)}, "cpu")
    src = torch.randn(3, 2).t()  # [2, 3], strided
    b.copy_in({"x": src})
    assert torch.equal(b.tensors["x"][:2], src)


def test_copy_in_errors_name_the_buffer_and_expected_shape():
    b = StaticBuffers(_specs(), "cpu")
    real = _real(2)
    with pytest.raises(ValueError, match=r"'q'.*expected \('n<=4', 3\)"):
        b.copy_in({**real, "q": torch.randn(2, 5)})
    with pytest.raises(ValueError, match=r"'q'.*5 rows.*bucket size 4"):
        b.copy_in(_real(5))
    with pytest.raises(ValueError, match=r"missing inputs \['scale'\]"):
        b.copy_in({k: v for k, v in real.items() if k != "scale"})
    with pytest.raises(ValueError, match=r"unexpected inputs \['extra'\]"):
        b.copy_in({**real, "extra": torch.zeros(2)})
    with pytest.raises(ValueError, match="disagree on the batch size"):
        b.copy_in({**real, "seq_lens": torch.ones(3, dtype=torch.int64)})
    with pytest.raises(TypeError, match=r"'slots'.*float32.*int32"):
        b.copy_in({**real, "slots": torch.zeros(2, 8)})
    with pytest.raises(ValueError, match=r"'scale'"):
        b.copy_in({**real, "scale": torch.ones(2)})


def test_failed_copy_in_leaves_buffers_untouched():
    b = StaticBuffers(_specs(), "cpu")
    good = _real(3)
    b.copy_in(good)
    snapshot = {k: v.clone() for k, v in b.tensors.items()}
    with pytest.raises(TypeError):
        b.copy_in({**_real(2), "slots": torch.zeros(2, 8)})
    assert all(torch.equal(b.tensors[k], snapshot[k]) for k in snapshot) and b.num_real == 3


def test_buffer_spec_and_buckets_validated():
    with pytest.raises(ValueError, match="batch_dim"):
        BufferSpec((4,), torch.float32, batch_dim=1)
    with pytest.raises(ValueError, match="disagree on the bucket"):
        StaticBuffers({"a": BufferSpec((4,), torch.float32), "b": BufferSpec((8,), torch.float32)}, "cpu")
    with pytest.raises(ValueError, match="batched"):
        StaticBuffers({"a": BufferSpec((4,), torch.float32, batch_dim=None)}, "cpu")
