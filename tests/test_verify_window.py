"""Verify on a sliding-window layer (gpt-oss alternates them): every draft token's window starts at its own
position (``prefix + depth``), chains and trees, against a plain float64 reference written per query token; the
kernel and the matmul form, slots scattered and in runs (read in place), pages, sinks, hypothesis cases, and one compile
per bucket."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_verify import _case, compiles_once_per_bucket, random_trees

from compiled_attn.compile_policy import compile_step
from compiled_attn.verify import build_verify_index, chain_mask, plan_verify, verify_attention, verify_blocks

FORMS = {"auto": {}, "matmul": {"form": "matmul"}}


def reference_window(q, k_cache, v_cache, table, rows, prefix, k, masks, window, scale, sinks=None):
    """float64, query token by query token: token i of request b sits at position p + depth (depth: the draft
    tokens its mask row shows, less one) and sees prefix position t when t >= position - window, and draft token j
    when masks[b, i, j] and j's position >= its own position - window. -> [bs * k, Hq, Dv]."""
    hq, hkv = q.shape[1], k_cache.shape[1]
    out = torch.zeros(q.shape[0], hq, v_cache.shape[2], dtype=torch.float64)
    for b in range(len(prefix)):
        p = int(prefix[b])
        slots = table[int(rows[b]), : p + k].long()
        kk = k_cache[slots].double().repeat_interleave(hq // hkv, 1)
        vv = v_cache[slots].double().repeat_interleave(hq // hkv, 1)
        depth = [int(masks[b, i].sum()) - 1 for i in range(k)]
        key_pos = list(range(p)) + [p + depth[j] for j in range(k)]
        for i in range(k):
            pos = p + depth[i]
            vis = torch.tensor([t >= pos - window for t in key_pos[:p]]
                               + [bool(masks[b, i, j]) and key_pos[p + j] >= pos - window for j in range(k)])
            s = torch.einsum("hd,khd->hk", q[b * k + i].double(), kk) * scale
            s = s.masked_fill(~vis[None], float("-inf"))
            if sinks is not None:
                s = torch.cat([s, sinks.double()[:, None]], -1)
            w = torch.softmax(s, -1)[:, : p + k]
            out[b * k + i] = torch.einsum("hk,khd->hd", w, vv)
    return out


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("window", [0, 2, 7, 64, 1000])
@pytest.mark.parametrize("slots", ["scattered", "engine"])
def test_matches_reference(slots, window, tree, form):
    k = 4
    b, prefix = _case([5, 0, 130, 64, 1, 3], k, hq=8, hkv=2, slot_layout=slots)
    masks = random_trees(len(prefix), k, torch.Generator().manual_seed(1)) if tree else chain_mask(len(prefix), k)
    out = verify_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k,
                           masks.reshape(-1) if tree else None, sliding_window=window, **FORMS[form])
    ref = reference_window(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks, window, 16 ** -0.5)
    assert (out.double() - ref).abs().max() < 1e-5
    single = verify_attention(b.q[2 * k:3 * k], b.k_cache, b.v_cache, b.req_to_token, b.rows[2:3], prefix[2:3], k,
                              masks[2].reshape(-1) if tree else None, sliding_window=window, **FORMS[form])
    assert (single.double() - ref[2 * k:3 * k]).abs().max() < 1e-5  # a batch of one: its own host path


@pytest.mark.parametrize("form", list(FORMS))
def test_pages_and_sinks(form):
    k = 3
    masks = random_trees(3, k, torch.Generator().manual_seed(4))
    b, prefix = _case([13, 100, 40], k, page_size=16)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(5))
    out = verify_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks.reshape(-1),
                           page_size=16, sliding_window=20, sinks=sinks, **FORMS[form])
    ref = reference_window(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks, 20, 16 ** -0.5,
                           sinks)
    assert (out.double() - ref).abs().max() < 1e-5


def test_index_reads_only_the_window():
    """The prefix blocks start where the deepest draft token's window does: 2 blocks of 64 for a 300-token prefix
    under a 100-token window, not 5; the k - 1 positions below that start are the edge keys."""
    k = 4
    b, prefix = _case([300], k)
    meta = plan_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, block_size=64,
                       sliding_window=100)
    index = build_verify_index(b.req_to_token, meta.inputs, sliding_window=100)
    assert meta.blocks_needed == 2  # [203, 300) from block 3 of 64
    assert index.draft_slots.shape == (1, 2 * k - 1) and index.draft_mask.shape == (1, k, 2 * k - 1)
    assert index.draft_slots[0, : k - 1].tolist() == b.req_to_token[int(b.rows[0]), 200:203].tolist()
    # token i (position 300 + i) sees the edge position 200 + e when 200 + e >= 300 + i - 100
    edge = index.draft_mask[0, :, : k - 1]
    assert edge.tolist() == [[e >= i for e in range(k - 1)] for i in range(k)]
    # pages of 16: the blocks start at the next page boundary, 208; the 18 positions 190..207 are edge keys
    b, prefix = _case([300], k, page_size=16)
    meta = plan_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, block_size=64, page_size=16,
                       sliding_window=100)
    index = build_verify_index(b.req_to_token, meta.inputs, page_size=16, sliding_window=100)
    assert index.draft_slots.shape == (1, 18 + k)
    assert index.draft_slots[0, :18].tolist() == b.req_to_token[int(b.rows[0]), 190:208].tolist()
    assert index.draft_mask[0, :, :18].tolist() == [[190 + e >= 200 + i for e in range(18)] for i in range(k)]


def test_window_errors():
    b, prefix = _case([30], 2)
    with pytest.raises(ValueError, match="sliding_window must be a non-negative int"):
        plan_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, 2, sliding_window=-1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix=st.lists(st.integers(0, 150), min_size=1, max_size=4), k=st.integers(1, 6), tree=st.booleans(),
       window=st.integers(0, 160), form=st.sampled_from(list(FORMS)), seed=st.integers(0, 2**16))
def test_random_cases(prefix, k, tree, window, form, seed):
    b, prefix_t = _case(prefix, k, hq=4, hkv=2, seed=seed)
    masks = random_trees(len(prefix), k, torch.Generator().manual_seed(seed)) if tree else chain_mask(len(prefix), k)
    out = verify_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix_t, k,
                           masks.reshape(-1) if tree else None, sliding_window=window, **FORMS[form])
    ref = reference_window(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix_t, k, masks, window,
                           16 ** -0.5)
    assert torch.isfinite(out).all() and (out.double() - ref).abs().max() < 1e-4


def window_step(q, k_cache, v_cache, table, inputs, form: str):
    return verify_blocks(q, k_cache, v_cache, build_verify_index(table, inputs, host_form=False, sliding_window=50),
                         0.25, **FORMS[form])


@pytest.mark.parametrize("form", list(FORMS))
def test_compiles_once_per_bucket(form):
    """fullgraph=True: batches of other sizes, prefixes and trees in one bucket reuse the windowed graph."""
    compiles_once_per_bucket(window_step, form, lambda q, b, prefix, k, masks: reference_window(
        q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks, 50, 0.25))


def test_bench_verify_case_with_a_window():
    """``bench-ops --ops verify --window``: the row checks the windowed verify against its own masked loop."""
    from compiled_attn.bench.ops_verify import bench_verify_case

    row = bench_verify_case(2, 3, True, 1, name="tiny-mha", window=40)
    assert row["window"] == 40 and row["verify_ms"] > 0 and row["loop_x"] > 0


@pytest.mark.cuda
def test_cuda_matches_reference_and_compiles_once():
    """The CUDA twin of the tests above: the matmul form on the GPU, eagerly and compiled (fullgraph), trees."""
    torch._dynamo.reset()
    k, dev = 4, "cuda"
    b, prefix = _case([5, 0, 130, 64], k, seed=3)
    masks = random_trees(4, k, torch.Generator().manual_seed(8))
    ref = reference_window(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k, masks, 50, 0.25)
    meta = plan_verify(b.q.to(dev), b.k_cache.to(dev), b.v_cache.to(dev), b.req_to_token.to(dev), b.rows.to(dev),
                       prefix.to(dev), k, masks.reshape(-1).to(dev), sliding_window=50)
    args = (b.q.to(dev), b.k_cache.to(dev), b.v_cache.to(dev), b.req_to_token.to(dev), meta.inputs, "matmul")
    assert (window_step(*args).double().cpu() - ref).abs().max() < 1e-4
    fn = compile_step(window_step, dynamic=False)
    assert (fn(*args).double().cpu() - ref).abs().max() < 1e-4
