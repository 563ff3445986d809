"""Multi-token verify (``compiled_attn.verify``) against a plain float64 reference: chain and tree masks in both of
SGLang's layouts, GQA, absorbed MLA, soft-cap, pages, float8 caches, both forms, random cases (hypothesis), the
host checks' errors, and ``torch.compile(fullgraph=True)`` without recompiles across batches of one bucket."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import DECODE_FORMS, reference_verify
from torch._dynamo.utils import counters

from compiled_attn.bench.batches import make_batch
from compiled_attn.bench.ops_verify import random_tree
from compiled_attn.compile_policy import compile_step
from compiled_attn.forms import choose_form
from compiled_attn.kernels.cpu.kernel import native_available
from compiled_attn.verify import (
    build_verify_index,
    chain_mask,
    draft_mask_from_custom,
    plan_verify,
    verify_attention,
    verify_block_size,
    verify_blocks,
)


def random_trees(bs, k, g):
    """[bs, k, k] ancestor-or-self masks of random trees (token 0 the root, each parent an earlier token)."""
    return torch.stack([random_tree(k, g) for _ in range(bs)])


def full_layout(masks, prefix):
    """SGLang's FULL_MASK: per request [k, prefix + k] row-major (prefix columns True), concatenated."""
    k = masks.shape[1]
    return torch.cat([torch.cat([torch.ones(k, int(p), dtype=torch.bool), m], 1).reshape(-1)
                      for p, m in zip(prefix, masks, strict=True)])


FORMS = DECODE_FORMS  # the prefix forms of ``verify_blocks``


def _case(prefix, k, *, hq=4, hkv=2, d=16, dv=None, mla=False, seed=0, **kw):
    prefix = torch.tensor(prefix, dtype=torch.int64)
    b = make_batch((prefix + k).tolist(), prefix.tolist(), hq=hq, hkv=hkv, dqk=d, dv=dv, mla=mla, seed=seed, **kw)
    return b, prefix


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("prefix", [[5, 0, 130, 64, 1], [300]], ids=["batch", "single"])
def test_matches_reference(prefix, tree, form):
    k = 4
    b, prefix = _case(prefix, k, hq=8, hkv=2)
    g = torch.Generator().manual_seed(1)
    masks = random_trees(len(prefix), k, g) if tree else chain_mask(len(prefix), k)
    out = verify_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k,
                           masks.reshape(-1) if tree else None, **FORMS[form])
    ref = reference_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks, 16 ** -0.5)
    assert out.shape == ref.shape and out.dtype == b.q.dtype
    assert (out.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("prefix", [0, 300])
def test_single_request_indexed_on_the_host(prefix, form):
    """A batch of one indexed on the host: its prefix table equals the tensor form's, and each form reads it to the
    float64 reference."""
    k = 4
    b, pre = _case([prefix], k, hq=8, hkv=2, seed=5)
    masks = random_trees(1, k, torch.Generator().manual_seed(2))
    meta = plan_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, pre, k, masks.reshape(-1))
    host = build_verify_index(b.req_to_token, meta.inputs)
    tensor_form = build_verify_index(b.req_to_token, meta.inputs, host_form=False)
    assert torch.equal(host.prefix.slots, tensor_form.prefix.slots)
    assert torch.equal(host.prefix.valid, tensor_form.prefix.valid)
    out = verify_blocks(b.q, b.k_cache, b.v_cache, host, 16 ** -0.5, **FORMS[form])
    ref = reference_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, pre, k, masks, 16 ** -0.5)
    assert (out.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("form", list(FORMS))
def test_sinks(form):
    """Attention sinks join every draft query's denominator (prefix and draft parts merged, then the sink)."""
    k = 3
    b, prefix = _case([5, 0, 130], k, hq=8, hkv=2)
    masks = random_trees(3, k, torch.Generator().manual_seed(5))
    sinks = torch.linspace(-2, 3, 8)
    out = verify_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks.reshape(-1),
                           sinks=sinks, **FORMS[form])
    ref = reference_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks, 16 ** -0.5,
                           sinks=sinks)
    assert (out.double() - ref).abs().max() < 1e-5
    plain = reference_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks, 16 ** -0.5)
    assert (ref - plain).abs().max() > 1e-3  # the sinks matter here


def test_full_layout_equals_draft_layout():
    b, prefix = _case([7, 0, 33], 3)
    masks = random_trees(3, 3, torch.Generator().manual_seed(2))
    full = full_layout(masks, prefix)
    assert torch.equal(draft_mask_from_custom(full, prefix, 3, "full"), masks)
    outs = [verify_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, 3, m, mask_layout=lay)
            for m, lay in ((masks.reshape(-1), "draft"), (full, "full"), (masks.reshape(-1).to(torch.uint8), "draft"))]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_mla_absorbed_soft_cap_and_bf16():
    k = 3
    masks = random_trees(3, k, torch.Generator().manual_seed(3))
    b, prefix = _case([9, 70, 2], k, hq=4, hkv=1, d=40, dv=32, mla=True)  # V = K's first 32 columns
    out = verify_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks.reshape(-1),
                           logit_cap=3.0)
    ref = reference_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks, 40 ** -0.5, 3.0)
    assert out.shape == (9, 4, 32) and (out.double() - ref).abs().max() < 1e-5
    b, prefix = _case([9, 70, 2], k, hq=4, hkv=2, dtype=torch.bfloat16)
    out = verify_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks.reshape(-1))
    ref = reference_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks, 16 ** -0.5)
    assert out.dtype == torch.bfloat16 and (out.double() - ref).abs().max() < 3e-2


@pytest.mark.parametrize("form", list(FORMS))
def test_pages_and_float8(form):
    k = 4
    masks = random_trees(3, k, torch.Generator().manual_seed(4))
    b, prefix = _case([13, 100, 0], k, page_size=16)
    out = verify_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks.reshape(-1),
                           page_size=16, **FORMS[form])
    ref = reference_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks, 16 ** -0.5)
    assert (out.double() - ref).abs().max() < 1e-5
    b, prefix = _case([13, 100, 0], k, kv_dtype=torch.float8_e4m3fn)
    out = verify_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks.reshape(-1),
                           k_scale=0.5, v_scale=0.5, **FORMS[form])
    ref = reference_verify(b.q, b.k_cache.float(), b.v_cache.float(), b.req_to_token, b.rows, prefix, k, masks,
                           16 ** -0.5, k_scale=0.5, v_scale=0.5)
    assert (out.double() - ref).abs().max() < 1e-4


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_float8_with_distinct_k_and_v_scales(kv_dtype, form):
    """A float8 cache holds K / k_scale and V / v_scale; verify multiplies each back by its own scale. The scales
    differ (0.37, 2.5), so K's read with V's (or V's with K's) is far off the float64 reference.
    q: [3 * 4, 8, 16] float32 (GQA 8/2), a tree of 4 drafts per request over prefixes 13, 100 and 0."""
    k, k_scale, v_scale = 4, 0.37, 2.5
    masks = random_trees(3, k, torch.Generator().manual_seed(9))
    b, prefix = _case([13, 100, 0], k, hq=8, hkv=2, kv_dtype=kv_dtype, seed=3)
    out = verify_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks.reshape(-1),
                           k_scale=k_scale, v_scale=v_scale, **FORMS[form])
    ref = reference_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks, 16 ** -0.5,
                           k_scale=k_scale, v_scale=v_scale)
    err = (out.double() - ref).abs().max().item()
    assert err < 1e-4, f"max abs error {err}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix=st.lists(st.integers(0, 150), min_size=1, max_size=5), k=st.integers(1, 6), tree=st.booleans(),
       heads=st.sampled_from([(1, 1), (4, 2), (6, 3), (8, 1)]), form=st.sampled_from(list(FORMS)),
       seed=st.integers(0, 2**16))
def test_random_cases(prefix, k, tree, heads, form, seed):
    b, prefix_t = _case(prefix, k, hq=heads[0], hkv=heads[1], seed=seed)
    g = torch.Generator().manual_seed(seed)
    masks = random_trees(len(prefix), k, g) if tree else chain_mask(len(prefix), k)
    out = verify_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix_t, k,
                           masks.reshape(-1) if tree else None, **FORMS[form])
    ref = reference_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix_t, k, masks, 16 ** -0.5)
    assert torch.isfinite(out).all() and (out.double() - ref).abs().max() < 1e-4


def test_errors():
    k = 3
    b, prefix = _case([4, 9], k)
    args = (b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix)
    with pytest.raises(ValueError, match="custom_mask has 17 elements.*bs \\* k \\* k = 18"):
        plan_verify(*args, k, torch.ones(17, dtype=torch.bool))
    with pytest.raises(ValueError, match="custom_mask has 18 elements.*= 57"):
        plan_verify(*args, k, torch.ones(18, dtype=torch.bool), mask_layout="full")
    with pytest.raises(TypeError, match="custom_mask must have dtype"):
        plan_verify(*args, k, torch.ones(18))
    with pytest.raises(ValueError, match="custom_mask must have 1 dimensions"):
        plan_verify(*args, k, torch.ones(2, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="q has 6 tokens but the batch has 2 requests of draft_len=2"):
        plan_verify(*args, 2)  # the draft count disagrees with the batch
    with pytest.raises(ValueError, match="draft_len must be an int >= 1"):
        plan_verify(*args, 0)
    with pytest.raises(TypeError, match="draft_len"):
        plan_verify(*args, True)
    with pytest.raises(ValueError, match="mask_layout must be one of"):
        plan_verify(*args, k, torch.ones(18, dtype=torch.bool), mask_layout="qlen")
    with pytest.raises(ValueError, match="req_pool_indices must have shape \\[1\\] \\(the batch size\\)"):
        plan_verify(b.q[:3], b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix[:1], k)
    with pytest.raises(ValueError, match="prefix_lens \\+ draft_len reach position"):
        plan_verify(*args[:5], prefix + b.req_to_token.shape[1], k)
    with pytest.raises(ValueError, match="block_capacity=1 is smaller"):
        plan_verify(*args, k, block_capacity=1, block_size=4)


def verify_step(q, k_cache, v_cache, table, inputs, form: str):
    return verify_blocks(q, k_cache, v_cache, build_verify_index(table, inputs), 0.25, **FORMS[form])


def compiles_once_per_bucket(step, form, reference):
    """``step`` compiled (fullgraph=True) over batches of other sizes, prefixes and trees in one bucket (batch
    capacity 4, block capacity 12), each against ``reference(q, b, prefix, k, masks)``; asserts one graph."""
    torch._dynamo.reset()
    fn = compile_step(step, dynamic=False)
    k, cap = 4, 4
    b, _ = _case([150, 150, 150, 150], k, seed=5)
    g = torch.Generator().manual_seed(6)
    graphs = []
    for prefix in ([5, 70, 1, 130], [64, 0, 100], [130]):
        bs = len(prefix)
        prefix = torch.tensor(prefix)
        masks = random_trees(bs, k, g)
        q = torch.zeros(cap * k, 4, 16)
        q[: bs * k] = b.q[: bs * k]
        meta = plan_verify(q[: bs * k], b.k_cache, b.v_cache, b.req_to_token, b.rows[:bs], prefix, k,
                           masks.reshape(-1), batch_capacity=cap, block_capacity=12, block_size=64)
        out = fn(q, b.k_cache, b.v_cache, b.req_to_token, meta.inputs, form)
        assert (out[: bs * k].double() - reference(q[: bs * k], b, prefix, k, masks)).abs().max() < 1e-5
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1] == graphs[2], f"recompiled within one bucket: {graphs}"


@pytest.mark.parametrize("form", list(FORMS))
def test_compiles_once_per_bucket(form):
    compiles_once_per_bucket(verify_step, form, lambda q, b, prefix, k, masks: reference_verify(
        q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks, 0.25))


def _compiled_verify_ops(b, prefix, k, masks, scale):
    """The compiled verify's output and the ops its graph calls (``fullgraph``, dynamo's eager backend)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    meta = plan_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks.reshape(-1))
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    step = torch.compile(lambda *a: verify_blocks(*a[:3], build_verify_index(a[3], a[4]), scale), backend=counter,
                         fullgraph=True)
    out = step(b.q, b.k_cache, b.v_cache, b.req_to_token, meta.inputs)
    return out, {n.target for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}


def _assert_graph_runs(choice, targets):
    """The compiled graph calls the kernel's op exactly where ``choice`` names the kernel."""
    assert (torch.ops.compiled_attn.native_decode_blocks.default in targets) == (choice.form == "kernel"), choice


@pytest.mark.parametrize("k, dtype", [(4, torch.float32), (5, torch.float32), (9, torch.float32), (16, torch.float32),
                                      (4, torch.bfloat16)])
def test_compiled_cpu_verify_runs_the_chosen_form(k, dtype):
    """Under ``torch.compile`` on CPU the graph runs what ``forms.choose_form`` names for it: the C++ kernel where it
    is built, at any number of query rows per KV head (k = 9: 18 rows, on a vector path; k = 16: 32 rows, a
    multiple of 16, on the wide or tile path), else the matmul form. All match the float64 reference."""
    b, prefix = _case([5, 0, 130], k, dtype=dtype)
    masks = random_trees(3, k, torch.Generator().manual_seed(8))
    out, targets = _compiled_verify_ops(b, prefix, k, masks, 0.25)
    choice = choose_form("verify", b.q, b.k_cache, b.v_cache, rows_per_kv_head=k * 2)
    _assert_graph_runs(choice, targets)
    assert choice.form == ("kernel" if native_available() else "matmul"), choice
    if native_available() and k == 16:
        assert choice.path in ("tile", "wide"), choice
    ref = reference_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks, 0.25)
    assert (out.double() - ref).abs().max() < (1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_bf16_verify_with_many_rows_runs_the_chosen_form(tree):
    """A bf16 query and cache, head size 64, k = 4 at 4 query heads per KV head: 16 query rows per KV head, a
    multiple of 16: the kernel serves them where it is built (its tile path with AMX, its wide path without),
    compiled and eagerly, else the matmul form. The compiled graph calls the op of the form ``choose_form`` names,
    and both match the float64 reference at bf16 tolerance."""
    k = 4
    b, prefix = _case([5, 0, 130, 300], k, hq=8, hkv=2, d=64, dtype=torch.bfloat16)
    masks = random_trees(4, k, torch.Generator().manual_seed(3)) if tree else chain_mask(4, k)
    ref = reference_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks, 0.125)
    out, targets = _compiled_verify_ops(b, prefix, k, masks, 0.125)
    choice = choose_form("verify", b.q, b.k_cache, b.v_cache, rows_per_kv_head=16)
    _assert_graph_runs(choice, targets)
    assert choice.form == ("kernel" if native_available() else "matmul")
    assert choice.path in (("tile", "wide") if native_available() else ("",))
    meta = plan_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks.reshape(-1))
    eager = verify_blocks(b.q, b.k_cache, b.v_cache, build_verify_index(b.req_to_token, meta.inputs), 0.125)
    for o in (out, eager):
        assert (o.double() - ref).abs().max() < 3e-2


def test_cpu_verify_blocks_are_at_most_128_tokens_and_several_fold_into_one_row():
    """On CPU the default prefix block stops at ``CPU_MAX_VERIFY_BLOCK`` = 128 tokens (the kernel's per-thread
    scratch of one block; blocks for every thread in a small batch), the matmul form's (CUDA) goes on to 512; at k =
    8 a 700-token prefix then takes six blocks, which the compiled step (the kernel's tile path where the CPU has
    one) folds into one softmax per row, as the float64 reference computes it."""
    assert [verify_block_size(k, "cpu") for k in (1, 2, 4, 8)] == [64, 128, 128, 128]
    assert [verify_block_size(k, "cuda") for k in (2, 8)] == [128, 512]
    k = 8
    b, prefix = _case([700, 3], k, hq=8, hkv=2, d=64, dtype=torch.bfloat16)
    masks = chain_mask(2, k)
    meta = plan_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k)
    assert meta.inputs.block_offsets.shape[0] == 128
    step = compile_step(lambda *a: verify_blocks(*a[:3], build_verify_index(a[3], a[4]), 0.125))
    out = step(b.q, b.k_cache, b.v_cache, b.req_to_token, meta.inputs)
    ref = reference_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks, 0.125)
    assert (out.double() - ref).abs().max() < 3e-2


def test_an_unknown_form_is_an_error():
    b, prefix = _case([5, 9], 2)
    with pytest.raises(ValueError, match="form must be one of"):
        verify_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, 2, form="flash")


@pytest.mark.parametrize("cold_bytes", [0, 1 << 20], ids=["warm", "cold"])
def test_bench_verify_case_row(cold_bytes):
    """The benchmark helper (``bench/ops_verify.py``) at a tiny shape: one row with every column, finite times,
    every call reading the same K/V, and each the next of copies of it (verify checked against the loop on them,
    and over the folded table of ``verify_cached``); no recompile for a copy or the folded table."""
    from compiled_attn.bench.ops_verify import COLUMNS, bench_verify_case

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    row = bench_verify_case(2, 3, True, 1, name="tiny-mha", cold_bytes=cold_bytes)
    assert sum(torch._dynamo.utils.counters["recompiles"].values()) == 0
    assert set(COLUMNS) <= set(row) and row["mask"] == "tree" and row["k"] == 3
    assert all(row[c] > 0 for c in COLUMNS if c.endswith(("_ms", "_x", "x_decode1", "x_read")))
    assert {"verify_cached_ms", "cached_x_decode1", "read_ms", "x_read"} <= set(COLUMNS)
