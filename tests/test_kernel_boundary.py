"""The C++ kernel's boundary (``csrc/torch_op.cpp`` and the index checks of ``csrc/block_partials.cpp``): every
index the kernel reads is checked against what it indexes, and each violation is a ValueError naming the argument
and its limit, built here by hand against the op: q's rows and heads, block rows, the block table's counts, slots
of valid positions and of draft keys a token sees, the caches' heads and head sizes, sinks, the draft tensors and
the path. The op is a torch op with a schema (the build's ``ops``), registered per build."""
from __future__ import annotations

import pytest
import torch

from compiled_attn.bench.batches import make_batch
from compiled_attn.decode import build_decode_index
from compiled_attn.kernels.cpu import kernel as cpu_kernel
from compiled_attn.kernels.cpu.kernel import native_available, native_decode_blocks
from compiled_attn.plan import plan_decode
from tests.reference import reference_attention

pytestmark = pytest.mark.skipif(not native_available(), reason="no C++ compiler on this machine")


def _call(hq=4, hkv=2, d=32, lens=(40, 70), page_size=1, block_size=16):
    """A small batch and its index: (batch, index, the merged op's args)."""
    b = make_batch(list(lens), hq=hq, hkv=hkv, dqk=d, decode=True, page_size=page_size, seed=3)
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, block_size=block_size,
                       page_size=page_size)
    index = build_decode_index(b.req_to_token, meta.inputs, page_size, host_form=False)
    merged = dict(q=b.q, block_req=index.block_req, slots=index.slots, valid=index.valid, k_cache=b.k_cache,
                  v_cache=b.v_cache, k_scale=d ** -0.5, v_scale=1.0, logit_cap=0.0, num_rows=len(lens))
    return b, index, merged


def _raises(op, args, match, **changes):
    with pytest.raises(ValueError, match=match):
        op(**{**args, **changes})


def test_the_op_runs_on_good_inputs():
    """The call the bad ones below are built from runs, and gives the float64 reference's decode."""
    b, _, merged = _call()
    out = native_decode_blocks(**merged)
    ref = reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                              b.ext_lens, scale=32 ** -0.5)
    assert out.shape == (2, 4, 32)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_query_rows_and_heads():
    """q must hold num_rows x tokens rows (a write location: the output has q's rows) of a multiple of Hkv heads
    and D = k_cache's head size, in a dtype the kernel reads."""
    _, _, merged = _call()
    q = merged["q"]
    for bad in (q[:1], q[:, :3], q.double()):
        _raises(native_decode_blocks, merged, r"q must be \[num_rows \* tokens = 2, Hq \(a multiple of Hkv=2\), D\]",
                q=bad)
    _raises(native_decode_blocks, merged, r"q must be \[num_rows \* tokens = 3", num_rows=3)
    _raises(native_decode_blocks, merged, r"q must be \[num_rows \* tokens = 4", tokens=2)
    _raises(native_decode_blocks, merged, r"k_cache must be \[num_slots, Hkv, D=16\]", q=q[..., :16].contiguous())
    _raises(native_decode_blocks, merged, r"q must be .* in one of float32, bfloat16, float16, got int32 \(2, 4, 32\)",
            q=q.int())


def test_block_rows_against_q_and_the_batch():
    """A block's row indexes the batch: rows and past them are a bucket's unused blocks (skipped), a negative one is
    refused; checked in the kernel's pass, before anything is read."""
    _, index, merged = _call()
    last = index.block_req.clone()
    last[-1] = -1
    for bad in (last, index.block_req - 1, index.block_req - 2 ** 40):
        _raises(native_decode_blocks, merged, r"block_req holds a row outside \[0, 2\) \(q's rows, or past them for "
                                              r"an unused block\)", block_req=bad)
    want = native_decode_blocks(**merged)
    unused = torch.cat([index.block_req, torch.tensor([2, 10 ** 6])])  # past the batch: unused blocks, skipped
    slots = torch.cat([index.slots, torch.full((2, index.slots.shape[1]), 10 ** 9)])  # outside the cache: never read
    valid = torch.cat([index.valid, torch.ones(2, index.valid.shape[1], dtype=torch.bool)])
    torch.testing.assert_close(native_decode_blocks(**{**merged, "block_req": unused, "slots": slots, "valid": valid}),
                               want, atol=0, rtol=0)
    gone = native_decode_blocks(**{**merged, "block_req": index.block_req + 2})  # every block unused
    assert gone.shape == (2, 4, 32) and (gone == 0).all()


def test_block_counts_and_the_table_shapes():
    """block_req, slots and valid must agree on the number of blocks n, slots and valid on the block size B; each
    named with the limit it breaks."""
    _, index, args = _call()
    n, b = index.valid.shape
    op = native_decode_blocks
    _raises(op, args, r"block_req must be int64 \[n\], got int32", block_req=args["block_req"].int())
    _raises(op, args, r"block_req must be int64 \[n\]", block_req=args["block_req"][None])
    _raises(op, args, rf"valid must be bool \[n={n}, B\], got bool \({n - 1}, {b}\)", valid=args["valid"][:-1])
    _raises(op, args, rf"valid must be bool \[n={n}, B\], got int64", valid=args["valid"].long())
    _raises(op, args, rf"slots must be int64 \[n={n}, B={b}\], got int64 \({n - 1}, {b}\)",
            slots=args["slots"][:-1])
    _raises(op, args, rf"slots must be int64 \[n={n}, B={b}\], got int64 \({n}, {b // 2}\)",
            slots=args["slots"][:, ::2].contiguous())
    _raises(op, args, rf"slots must be int64 \[n={n}, B={b}\], got int32", slots=args["slots"].int())


@pytest.mark.parametrize("hq, page_size", [(4, 1), (4, 16), (32, 16)], ids=["vector", "vector-pages", "wide"])
def test_slots_of_valid_positions_against_the_caches(hq, page_size):
    """A slot past the caches' rows (just past, or far past), or before them, at a valid position: a ValueError
    naming slots and num_slots (the position is never read); the same slot at an invalid position is never read
    and no error. The vector path and (16 rows per KV head) the wide one."""
    b, index, merged = _call(hq=hq, page_size=page_size)
    num_slots = b.k_cache.shape[0]
    assert index.valid[1, 0]
    for slot in (num_slots, num_slots + 3, -1, 2 ** 62 + 1):
        slots = index.slots.clone()
        slots[1, 0] = slot
        _raises(native_decode_blocks, merged, rf"slots names a KV slot outside the cache at a valid position "
                                              rf"\(num_slots {num_slots}\)", slots=slots)
    valid = index.valid.clone()
    valid[1, 0] = False
    slots = index.slots.clone()
    slots[1, 0] = 2 ** 62 + 1
    want = native_decode_blocks(**{**merged, "valid": valid})  # the position's own slot, masked the same
    torch.testing.assert_close(native_decode_blocks(**{**merged, "slots": slots, "valid": valid}), want, atol=0,
                               rtol=0)


def test_caches_heads_head_sizes_and_dtypes():
    """k_cache and v_cache must have Hkv heads each, D = q's head size, Dv a multiple of 16, one dtype the kernel
    reads and each row's last dim contiguous: their rows and heads are indexed by the slots and the KV heads."""
    b, _, merged = _call()
    k, v = b.k_cache, b.v_cache
    op = native_decode_blocks
    _raises(op, merged, r"v_cache must be \[num_slots, Hkv=2, Dv\] in k_cache's float32", v_cache=v[:, :1])
    _raises(op, merged, r"v_cache must be .* got bfloat16", v_cache=v.bfloat16())
    _raises(op, merged, r"v_cache must be .* Dv a multiple of 16", v_cache=v[..., :8])
    _raises(op, merged, r"k_cache must be \[num_slots, Hkv, D=32\] .* got float64", k_cache=k.double(),
            v_cache=v.double())
    _raises(op, merged, r"k_cache must be \[num_slots, Hkv, D=32\] .* its last dim contiguous",
            k_cache=torch.cat([k, k], -1)[..., ::2])
    _raises(op, merged, r"k_cache must be \[num_slots, Hkv, D\], got float32 \(", k_cache=k.flatten(1))
    # a cache with fewer rows than the other: slots are checked against the smaller
    short = v[: int(merged["slots"][0, 0])]
    _raises(native_decode_blocks, merged, rf"num_slots {short.shape[0]}", v_cache=short)


def test_sinks_and_the_draft_keys():
    """sinks must hold Hkv x G logits; draft_slots [>= num_rows, nd] int64 and draft_mask [>= num_rows, tokens
    dividing G, nd] go together; a draft key some token sees whose slot lies outside the caches is refused (one no
    token sees is never read)."""
    b, _, merged = _call(hq=8)  # G = 4
    slots = b.k_cache.shape[0]
    _raises(native_decode_blocks, merged, r"sinks must hold Hkv x G = 8 logits, got float32 \(3,\)",
            sinks=torch.zeros(3))
    draft_slots = torch.tensor([[3, slots + 7], [5, 6]])
    shows = torch.tensor([[[True, False]], [[True, True]]])
    draft = dict(merged, draft_slots=draft_slots, draft_mask=shows)
    native_decode_blocks(**draft)
    _raises(native_decode_blocks, draft, rf"draft_slots names a KV slot outside the cache that a draft token sees "
                                         rf"\(num_slots {slots}\)", draft_mask=torch.ones_like(shows))
    negative = draft_slots.clone()
    negative[1, 0] = -2
    _raises(native_decode_blocks, draft, "draft_slots names a KV slot outside", draft_slots=negative)
    _raises(native_decode_blocks, draft, r"draft_slots must be int64 \[>= num_rows=2, nd\], got int64 \(1, 2\)",
            draft_slots=draft_slots[:1])
    _raises(native_decode_blocks, draft, r"draft_slots must be int64", draft_slots=draft_slots.int())
    _raises(native_decode_blocks, draft, r"draft_mask must be \[>= num_rows=2, tokens dividing G=4, nd=2\], got "
                                         r"bool \(2, 3, 2\)", draft_mask=shows.expand(2, 3, 2))
    _raises(native_decode_blocks, draft, r"draft_mask must be .*nd=2\]", draft_mask=shows[..., :1])
    _raises(native_decode_blocks, draft, "draft_slots and draft_mask go together", draft_mask=None)


def test_paths_by_name_and_by_number():
    """An unknown path name is a ValueError naming path (the opaque op), a number outside the kernel's paths one
    from the build's op, and a path this build or shape does not run one naming it and kernel_path."""
    _, _, merged = _call()
    _raises(native_decode_blocks, merged, r"path must be one of", path="fast")
    ops = cpu_kernel.library().ops
    args = list(merged.values())
    with pytest.raises(ValueError, match=r"path must be a KernelPath number in \[0, 4\), got 7"):
        ops.decode_blocks(*args, None, 0.0, None, None, 1, 7)
    _raises(native_decode_blocks, merged, r"path 'wide' does not serve this call \(cache float32, 2 query rows per KV "
                                          r"head, head sizes 32/32.*see kernel_path", path="wide")


def test_the_ops_are_torch_ops_with_the_python_ops_arguments():
    """Each build's op is registered with a schema (in a namespace of the build's own) whose arguments are the
    Python op's (the path by its number): torch checks their types before the C++ checks the rest."""
    ops = cpu_kernel.library().ops
    cxx = ops.decode_blocks
    assert [a.name for a in cxx._schema.arguments] == [a.name for a in native_decode_blocks._schema.arguments]
    assert cxx._schema.name.startswith("compiled_attn_block_partials_")
    with pytest.raises(RuntimeError, match="Expected a value of type 'int' for argument 'path'"):
        ops.decode_blocks(*list(_call()[2].values()), None, 0.0, None, None, 1, "vector")
