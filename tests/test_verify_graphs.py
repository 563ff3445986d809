"""VerifyGraphs on CPU: per-(batch bucket, draft length, KV bucket) compiled replay equals a float64 reference for
chain and tree masks (and a step with a full and a sliding-window layer); padding rows never leak; no new dynamo
graphs after warm-up across batches and draft lengths; fallback beyond the largest bucket; bad input named. (The
CUDA-graph twin at the end runs on a GPU machine.)"""
import dataclasses
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from compiled_attn.bench.batches import assign_requests
from compiled_attn.bench.ops_verify import random_tree
from compiled_attn.runners.decode import GraphConfig, RowInput
from compiled_attn.runners.verify import VerifyGraphs, VerifyKey
from compiled_attn.verify import VerifyInputs, build_verify_index, plan_verify, verify_blocks

HQ, HKV, D = 4, 2, 16
SCALE = D ** -0.5
NUM_SLOTS, WIDTH = 700, 160
BUCKETS, DRAFT_LENS = [2, 4], (2, 4)


def verify_step(inputs, persistent):
    """Write the draft tokens' K/V at their slots, then verify: one layer of a target model's verify forward."""
    loc = inputs["out_cache_loc"].flatten()
    persistent["k"].index_copy_(0, loc, inputs["k_new"].flatten(0, 1))
    persistent["v"].index_copy_(0, loc, inputs["v_new"].flatten(0, 1))
    index = build_verify_index(persistent["req_to_token"], VerifyInputs.of(inputs))
    return verify_blocks(inputs["q"].flatten(0, 1), persistent["k"], persistent["v"], index, SCALE)


TOKEN_INPUTS = {"q": RowInput((HQ, D), torch.float32), "k_new": RowInput((HKV, D), torch.float32),
                "v_new": RowInput((HKV, D), torch.float32), "out_cache_loc": RowInput((), torch.int64, slots=True)}


def _graphs(device="cpu", buckets=BUCKETS, draft_lens=DRAFT_LENS, max_kv=256, compile=True, measure=False):
    config = GraphConfig(max_batch_size=max(buckets), cuda_graph_bs=buckets, max_kv_tokens=max_kv, min_kv_tokens=128,
                         enable_torch_compile=compile, measure_compile=measure, progress=False)
    return VerifyGraphs(verify_step, config=config, draft_lens=draft_lens, device=device, token_inputs=TOKEN_INPUTS)


def _persistent(device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"k": torch.randn(NUM_SLOTS, HKV, D, generator=g).to(device),
            "v": torch.randn(NUM_SLOTS, HKV, D, generator=g).to(device),
            "req_to_token": torch.zeros(12, WIDTH, dtype=torch.int32, device=device)}


def _batch(graphs, persistent, prefix, k, tree, gen):
    """A verify batch on fresh rows of the table: the plan, the per-token inputs and the [bs, k, k] masks."""
    bs, table = len(prefix), persistent["req_to_token"]
    rows = assign_requests(table, NUM_SLOTS, [p + k for p in prefix], gen)
    prefix = torch.tensor(prefix, dtype=torch.int64)
    masks = (torch.stack([random_tree(k, gen) for _ in range(bs)]) if tree
             else torch.ones(k, k, dtype=torch.bool).tril().expand(bs, k, k))
    dev = table.device
    tokens = {"q": torch.randn(bs * k, HQ, D, generator=gen).to(dev),
              "k_new": torch.randn(bs * k, HKV, D, generator=gen).to(dev),
              "v_new": torch.randn(bs * k, HKV, D, generator=gen).to(dev),
              "out_cache_loc": table[rows[:, None], prefix.to(dev)[:, None] + torch.arange(k, device=dev)]
              .reshape(-1).long()}
    meta = graphs.plan(tokens["q"], persistent["k"], persistent["v"], table, rows, prefix.to(dev), k,
                       masks.reshape(-1).to(dev) if tree else None)
    return meta, tokens, masks, rows.cpu(), prefix


def reference(persistent, tokens, rows, prefix, k, masks, window=None):
    """float64, request by request, on the caches as the step leaves them (draft K/V written at their slots): the
    request's k queries over positions [0, prefix + k) of its row, the prefix all visible, draft key j visible to
    query i where masks[b, i, j]; with ``window`` w, draft token i sits at prefix + its depth (its mask row's
    count less one) and sees only keys from that position less w on. -> [bs * k, Hq, D]"""
    kc, vc = persistent["k"].cpu().double().clone(), persistent["v"].cpu().double().clone()
    loc = tokens["out_cache_loc"].cpu()
    kc[loc], vc[loc] = tokens["k_new"].cpu().double(), tokens["v_new"].cpu().double()
    table, q = persistent["req_to_token"].cpu(), tokens["q"].cpu().double()
    out = []
    for b in range(len(prefix)):
        p = int(prefix[b])
        slots = table[int(rows[b]), : p + k].long()
        kk, vv = kc[slots].repeat_interleave(HQ // HKV, 1), vc[slots].repeat_interleave(HQ // HKV, 1)
        s = torch.einsum("qhd,khd->hqk", q[b * k:(b + 1) * k], kk) * SCALE
        visible = torch.ones(k, p + k, dtype=torch.bool)
        visible[:, p:] = masks[b]
        if window is not None:
            pos = torch.cat([torch.arange(p), p + masks[b].sum(-1) - 1])  # each key's position
            visible &= pos[None, :] >= (p + masks[b].sum(-1) - 1)[:, None] - window
        w = torch.softmax(s.masked_fill(~visible[None], float("-inf")), -1)
        out.append(torch.einsum("hqk,khd->qhd", w, vv))
    return torch.cat(out)


def _check(graphs, persistent, prefix, k, tree, seed, atol=1e-5):
    gen = torch.Generator().manual_seed(seed)
    meta, tokens, masks, rows, prefix = _batch(graphs, persistent, prefix, k, tree, gen)
    ref = reference(persistent, tokens, rows, prefix, k, masks)
    out = graphs.run(meta, tokens, persistent)
    assert out.shape == (len(prefix) * k, HQ, D) and torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().double(), ref, atol=atol, rtol=0)
    loc = tokens["out_cache_loc"]
    assert torch.equal(persistent["k"][loc], tokens["k_new"]) and torch.equal(persistent["v"][loc], tokens["v_new"])
    return meta, tokens, out


@pytest.fixture(scope="module")
def warmed():
    torch._dynamo.reset()
    graphs, persistent = _graphs(), _persistent()
    before = counters["stats"]["unique_graphs"]
    timings = graphs.warmup(persistent)
    return graphs, persistent, timings, counters["stats"]["unique_graphs"] - before


def test_warmup_covers_every_key(warmed):
    graphs, _, timings, compiled = warmed
    assert set(timings) == {VerifyKey(bs, k, kv) for bs in BUCKETS for k in DRAFT_LENS for kv in (128, 256)}
    assert set(graphs.choices().values()) == {"compiled"}
    assert 1 <= compiled <= len(timings)  # dynamic sizes: fewer graphs than buckets (size-1 dims aside)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("k", DRAFT_LENS)
@pytest.mark.parametrize("prefix", [[37], [5, 0, 100], [64, 1, 63, 9], [150, 40]], ids=["bs1", "bs3", "bs4", "bs2"])
def test_replay_matches_reference(warmed, prefix, k, tree):
    graphs, persistent, _, _ = warmed
    meta, _, _ = _check(graphs, persistent, prefix, k, tree, seed=len(prefix) * 10 + k)
    assert graphs.key_for(meta).bs == (2 if len(prefix) <= 2 else 4)


WINDOW = 20


def full_and_window_step(inputs, persistent):
    """Two layers of a model that alternates full and sliding-window attention (gpt-oss): the batch is planned
    once, over the whole prefixes; the window layer builds its own index from the same inputs."""
    loc = inputs["out_cache_loc"].flatten()
    persistent["k"].index_copy_(0, loc, inputs["k_new"].flatten(0, 1))
    persistent["v"].index_copy_(0, loc, inputs["v_new"].flatten(0, 1))
    q, planned = inputs["q"].flatten(0, 1), VerifyInputs.of(inputs)
    full = build_verify_index(persistent["req_to_token"], planned)
    windowed = build_verify_index(persistent["req_to_token"], planned, sliding_window=WINDOW)
    return tuple(verify_blocks(q, persistent["k"], persistent["v"], index, SCALE) for index in (full, windowed))


def test_window_layer_replays_from_the_same_plan():
    """A full and a window layer in one bucketed step: both equal their float64 references (the window one over each
    draft token's own window), over chains and trees, prefixes shorter and longer than the window; no new graph
    after warm-up."""
    torch._dynamo.reset()
    config = GraphConfig(max_batch_size=4, cuda_graph_bs=[2, 4], max_kv_tokens=256, min_kv_tokens=128,
                         progress=False)
    graphs = VerifyGraphs(full_and_window_step, config=config, draft_lens=(4,), device="cpu",
                          token_inputs=TOKEN_INPUTS)
    persistent = _persistent(seed=11)
    graphs.warmup(persistent)
    before = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i, (prefix, tree) in enumerate([([150, 3], False), ([64, 0, 19, 120], True), ([21], True),
                                            ([100, 40, 7], False)]):
            gen = torch.Generator().manual_seed(40 + i)
            meta, tokens, masks, rows, prefix_t = _batch(graphs, persistent, prefix, 4, tree, gen)
            full_ref = reference(persistent, tokens, rows, prefix_t, 4, masks)
            window_ref = reference(persistent, tokens, rows, prefix_t, 4, masks, window=WINDOW)
            out = graphs.run(meta, tokens, persistent)
            torch.testing.assert_close(out[0].double(), full_ref, atol=1e-5, rtol=0)
            torch.testing.assert_close(out[1].double(), window_ref, atol=1e-5, rtol=0)
            if max(prefix) > WINDOW + 4:  # the window changes the answer
                assert not torch.allclose(full_ref, window_ref, atol=1e-3)
    assert counters["stats"]["unique_graphs"] == before
    assert sum(s.fallbacks for s in graphs.stats) == 0 and sum(s.replays for s in graphs.stats) == 4


def test_padding_rows_do_not_leak(warmed):
    """A batch of 3 in the bucket of 4: whatever the padding row's buffers hold before the run, the real rows'
    outputs are the same (copy_in refills every padding row)."""
    graphs, persistent, _, _ = warmed
    meta, tokens, first = _check(graphs, persistent, [30, 7, 90], 4, True, seed=7)
    first = first.clone()
    buffers = graphs.runners[0].buffers(graphs.key_for(meta))
    for name in ("q", "k_new", "v_new"):
        buffers.tensors[name][3:].fill_(1e6)
    buffers.tensors["prefix_lens"][3:].fill_(100)
    again = graphs.run(meta, tokens, persistent)
    torch.testing.assert_close(again, first, atol=0, rtol=0)


def test_no_recompiles_after_warmup(warmed):
    """Random batches over every batch size, both draft lengths, chains and trees, both KV buckets: no new graph."""
    graphs, persistent, _, _ = warmed
    gen = torch.Generator().manual_seed(123)
    before = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(24):
            bs, k = int(torch.randint(1, 5, (1,), generator=gen)), DRAFT_LENS[i % 2]
            prefix = torch.randint(0, 60, (bs,), generator=gen).tolist()
            _check(graphs, persistent, prefix, k, tree=bool(i % 3), seed=1000 + i)
    assert counters["stats"]["unique_graphs"] == before
    assert sum(s.fallbacks for s in graphs.stats) == 0


def test_measured_choice():
    """With measure_compile, each bucket replays whichever of the compiled and the eager step measured faster."""
    graphs, persistent = _graphs(buckets=[2], draft_lens=(2,), max_kv=128, measure=True), _persistent(seed=3)
    timings = graphs.warmup(persistent)
    assert set(graphs.choices().values()) <= {"compiled", "eager"}
    assert all(t["choice"] in ("compiled", "eager") and t["eager_s"] > 0 for t in timings.values())
    _check(graphs, persistent, [20, 3], 2, True, seed=4)


def test_beyond_largest_bucket_falls_back_once():
    graphs, persistent = _graphs(buckets=[2], draft_lens=(2,), max_kv=128, compile=False), _persistent(seed=1)
    graphs.warmup(persistent)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _check(graphs, persistent, [4, 9, 30], 2, True, seed=5)  # 3 rows > 2
        _check(graphs, persistent, [100, 90], 2, False, seed=6)  # 4 blocks > the 128-token bucket
    assert sum("bucket" in str(w.message) for w in caught) == 1
    assert graphs.stats[0].fallbacks == 2
    _check(graphs, persistent, [10, 3], 2, False, seed=8)
    assert graphs.stats[0].replays == 1


def test_errors():
    graphs, persistent = _graphs(buckets=[2], draft_lens=(2,), max_kv=128, compile=False), _persistent(seed=2)
    graphs.warmup(persistent)
    gen = torch.Generator().manual_seed(9)
    meta, tokens, *_ = _batch(graphs, persistent, [5, 6], 3, False, gen)
    with pytest.raises(ValueError, match=r"draft_len=3 is not among the configured draft_lens \[2\]"):
        graphs.run(meta, tokens, persistent)
    meta, tokens, *_ = _batch(graphs, persistent, [5, 6], 2, False, gen)
    with pytest.raises(ValueError, match=r"tokens\['q'\] has dtype torch.float64, expected torch.float32"):
        graphs.run(meta, dict(tokens, q=tokens["q"].double()), persistent)
    with pytest.raises(ValueError, match=r"tokens\['out_cache_loc'\] has dtype torch.int32"):
        graphs.run(meta, dict(tokens, out_cache_loc=tokens["out_cache_loc"].int()), persistent)
    with pytest.raises(ValueError, match=r"tokens\['q'\] has shape \(3, 4, 16\), expected \(4, 4, 16\)"):
        graphs.run(meta, dict(tokens, q=tokens["q"][:3]), persistent)
    with pytest.raises(ValueError, match=r"missing inputs \['v_new'\]"):
        graphs.run(meta, {n: t for n, t in tokens.items() if n != "v_new"}, persistent)
    with pytest.raises(ValueError, match=r"tokens\['out_cache_loc'\].*\[0, 700\)"):
        graphs.run(meta, dict(tokens, out_cache_loc=tokens["out_cache_loc"] + NUM_SLOTS), persistent)
    other = plan_verify(tokens["q"], persistent["k"], persistent["v"], persistent["req_to_token"],
                        meta.inputs.req_rows, meta.inputs.prefix_lens, 2, block_size=32)
    with pytest.raises(ValueError, match="block_size=32; these graphs use block_size=64"):
        graphs.run(other, tokens, persistent)
    # a hand-built plan whose block count is short would pick a bucket that drops the last blocks' keys
    needed = meta.blocks_needed
    assert needed >= 2
    with pytest.raises(ValueError, match=rf"meta.blocks_needed 1 is below the {needed} prefix blocks"):
        graphs.run(dataclasses.replace(meta, blocks_needed=1), tokens, persistent)
    with pytest.raises(ValueError, match="draft_lens must hold ints >= 1"):
        _graphs(draft_lens=(2, 0), compile=False)
    with pytest.raises(ValueError, match="draft_lens must be a non-empty list"):
        _graphs(draft_lens=(), compile=False)
    with pytest.raises(ValueError, match="clashes with the VerifyInputs field"):
        VerifyGraphs(verify_step, config=GraphConfig(), draft_lens=(2,), device="cpu",
                     token_inputs={"draft_mask": RowInput((), torch.bool)})


@pytest.mark.cuda
def test_cuda_graph_replay_matches_reference_without_recompiles():
    graphs, persistent = _graphs(device="cuda", buckets=[1, 4]), _persistent(device="cuda")
    graphs.warmup(persistent)
    assert set(graphs.choices().values()) == {"captured"}
    before = counters["stats"]["unique_graphs"]
    for i, (prefix, k, tree) in enumerate([([5, 0, 100], 2, True), ([64, 1, 63, 9], 4, True), ([37], 4, False),
                                           ([120, 7], 2, False)]):
        _check(graphs, persistent, prefix, k, tree, seed=i, atol=1e-4)
    for t in (persistent["k"], persistent["v"]):  # new cache contents between replays are read, not baked in
        t.mul_(-1.5)
    _check(graphs, persistent, [30, 7, 90], 4, True, seed=9, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == before
    assert sum(s.fallbacks for s in graphs.stats) == 0
