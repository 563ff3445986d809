"""Speculative decoding through our SGLang backend: ``TARGET_VERIFY`` (k draft tokens per request, chain or tree
mask in both of SGLang's mask layouts) and ``DRAFT_EXTEND_V2`` (a plain extend), on hand-built ``ForwardBatch``es
run layer by layer through ``RadixAttention``, against a float64 reference built from the same batch (SGLang's
``torch_native`` backend does not run these modes). Skipped where SGLang isn't installed.
"""
from types import SimpleNamespace

import pytest
import torch

import compiled_attn.sglang.testing as H

H.ensure_sglang_importable()
pytest.importorskip("sglang")

from reference import spy_calls  # noqa: E402

from compiled_attn.bench.ops_verify import random_tree  # noqa: E402
from compiled_attn.sglang.backend import CompiledAttnBackend  # noqa: E402
from compiled_attn.sglang.speculative import mask_layout  # noqa: E402
from compiled_attn.verify import chain_mask  # noqa: E402
from compiled_attn.verify_plan import mask_numel  # noqa: E402

SG = H.import_sglang()
PREFIX = [5, 0, 40, 17]
K = 4


def _tree_masks(bs: int, k: int, seed: int) -> torch.Tensor:
    """[bs, k, k] ancestor-or-self masks of random trees (token 0 the root)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([random_tree(k, g) for _ in range(bs)])


def _flat_mask(masks: torch.Tensor, prefix: list[int], layout: str) -> torch.Tensor:
    """SGLang's flat custom mask: QLEN_ONLY ("draft") [k, k] per request, FULL_MASK [k, prefix + k] per request
    (prefix columns True, as SGLang's tree builder fills them)."""
    if layout == "draft":
        return masks.reshape(-1)
    k = masks.shape[1]
    parts = [torch.cat([torch.ones(k, p, dtype=torch.bool), m], 1).reshape(-1) for p, m in zip(prefix, masks,
                                                                                           strict=True)]
    return torch.cat(parts)


def _verify_batch(mr, prefix, k, spec_info, layer_ids=(0,)):
    """A TARGET_VERIFY batch: the prefix K/V in the pool (every layer), k new tokens per request; seq_lens
    WITHOUT the draft tokens, as SGLang passes them."""
    b = H.make_extend_batch(mr, [k] * len(prefix), prefix, layer_ids=layer_ids)
    bs = len(prefix)
    lens = torch.tensor(prefix, dtype=torch.int64)
    b.forward_batch = SG.ForwardBatch(
        forward_mode=SG.ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=torch.zeros(bs * k, dtype=torch.int64),
        req_pool_indices=b.req_pool_indices, seq_lens=lens, out_cache_loc=b.out_cache_loc,
        seq_lens_sum=int(lens.sum()), seq_lens_cpu=lens.clone(), positions=b.positions, spec_info=spec_info)
    return b


def _reference(batch, masks, layer_id=0, logit_cap=None, sinks=None, window=None):
    """float64, per request: its k queries over its prefix (all visible) and its k draft keys (masks[b]); sinks:
    one more softmax column per head, of value zero."""
    g = batch.geometry
    outs = []
    for i in range(batch.num_real_reqs):
        kk, vv = (t.double().repeat_interleave(g.group_size, 1) for t in H.request_kv(batch, i, layer_id))
        q = H.request_q(batch, i, layer_id).double()
        p = kk.shape[0] - q.shape[0]
        s = torch.einsum("qhd,khd->hqk", q, kk) * g.sm_scale
        if logit_cap is not None:
            s = logit_cap * torch.tanh(s / logit_cap)
        vis = torch.ones(q.shape[0], kk.shape[0], dtype=torch.bool)
        vis[:, p:] = masks[i]
        if window is not None:  # draft token j sits at p + its depth, and sees keys from there - window on
            pos = torch.cat([torch.arange(p), p + masks[i].sum(-1) - 1])
            vis &= pos[None, :] >= pos[p:, None] - window
        s = s.masked_fill(~vis[None], float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None, None].expand(-1, q.shape[0], 1)], -1)
        w = torch.softmax(s, -1)[..., :kk.shape[0]]
        outs.append(torch.einsum("hqk,khd->qhd", w, vv).reshape(q.shape[0], -1))
    return torch.cat(outs)


def _tree_spec(seed: int):
    """Random trees over the K draft tokens of every request, and the spec_info SGLang hands a tree verify (its
    custom mask in the layout SGLang uses on this device)."""
    masks = _tree_masks(len(PREFIX), K, seed)
    flat = _flat_mask(masks, PREFIX, mask_layout(torch.device("cpu")))
    return masks, SimpleNamespace(draft_token_num=K, topk=4, custom_mask=flat)


def _run_layers(backend, batch, layers):
    outs = []
    for n, layer in enumerate(layers):
        ld = batch.layers[layer.layer_id]
        outs.append(H.run_sglang_layer(backend, layer, batch.forward_batch, ld.q, ld.k, ld.v, init_metadata=n == 0)[0])
    return outs


@pytest.mark.parametrize("geom", ["mha", "gqa", "mla_absorbed"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_target_verify_matches_reference(geom, tree):
    g = H.GEOMETRIES[geom]
    mr = H.make_model_runner(g, num_layers=2, seed=11)
    masks = _tree_masks(len(PREFIX), K, 3) if tree else chain_mask(len(PREFIX), K)
    # the layout SGLang's draft stage would send this backend (QLEN_ONLY where SGLang runs on CPU)
    layout = mask_layout(torch.device("cpu"))
    spec = SimpleNamespace(draft_token_num=K, topk=2 if tree else 1, custom_mask=_flat_mask(masks, PREFIX, layout))
    batch = _verify_batch(mr, PREFIX, K, spec, layer_ids=(0, 1))
    backend = CompiledAttnBackend(mr)
    outs = _run_layers(backend, batch, [H.make_layer(g, 0), H.make_layer(g, 1)])
    for lid, out in enumerate(outs):  # two layers of one forward share the index, each over its own cache
        assert out.shape == (len(PREFIX) * K, g.num_heads * g.v_head_dim)
        torch.testing.assert_close(out.double(), _reference(batch, masks, lid), atol=1e-4, rtol=0)
    # the draft tokens' K/V went to out_cache_loc, as every backend writes them
    k_new, _ = H.read_kv(mr, 0, batch.out_cache_loc)
    torch.testing.assert_close(k_new.reshape(k_new.shape[0], -1), batch.layers[0].k)


@pytest.mark.parametrize("layout", ["draft", "full"])
def test_mask_layouts(monkeypatch, layout):
    """QLEN_ONLY ([k, k] per request) and FULL_MASK ([k, prefix + k] per request; its prefix columns are not
    read), each in a pre-allocated buffer longer than the batch needs, as SGLang's VerifyMask hands it."""
    import compiled_attn.sglang.speculative as S
    g = H.GEOMETRIES["gqa"]
    mr = H.make_model_runner(g, seed=12)
    masks = _tree_masks(len(PREFIX), K, 4)
    flat = _flat_mask(masks, PREFIX, layout)
    spec = SimpleNamespace(draft_token_num=K, tree_topk=-1, custom_mask=torch.cat([flat, torch.ones(50, dtype=bool)]))
    batch = _verify_batch(mr, PREFIX, K, spec)
    monkeypatch.setattr(S, "mask_layout", lambda device: layout)
    out = _run_layers(CompiledAttnBackend(mr), batch, [H.make_layer(g)])[0]
    torch.testing.assert_close(out.double(), _reference(batch, masks), atol=1e-4, rtol=0)


def test_mask_layout_follows_sglang():
    from sglang.srt.speculative.eagle_utils import TreeMaskMode, default_tree_mask_mode
    want = "draft" if default_tree_mask_mode() == TreeMaskMode.QLEN_ONLY else "full"
    assert mask_layout(torch.device("cpu")) == want


def test_target_verify_soft_cap_and_bf16(monkeypatch):
    """A soft-capped layer (float32), and a bf16 model: 16 query rows per KV head (4 drafts x 4 query heads per KV
    head, head size 64), whose prefix and draft block the C++ kernel computes in its merged op (on its AMX tile path
    where the CPU has one), checked by a spy; both against the float64 reference."""
    import compiled_attn.verify as verify_mod
    from compiled_attn.kernels.cpu.kernel import native_available

    calls = spy_calls(monkeypatch, verify_mod, "native_decode_blocks")
    g = H.GEOMETRIES["gqa"]
    mr = H.make_model_runner(g, seed=13)
    masks, spec = _tree_spec(5)
    batch = _verify_batch(mr, PREFIX, K, spec)
    layer = SG.RadixAttention(g.num_heads, g.head_dim, g.sm_scale, g.num_kv_heads, 0, logit_cap=5.0)
    out = _run_layers(CompiledAttnBackend(mr), batch, [layer])[0]
    torch.testing.assert_close(out.double(), _reference(batch, masks, logit_cap=5.0), atol=1e-4, rtol=0)
    mr = H.make_model_runner(g, seed=14, dtype=torch.bfloat16)
    batch = _verify_batch(mr, PREFIX, K, spec)
    calls.clear()
    out = _run_layers(CompiledAttnBackend(mr), batch, [H.make_layer(g)])[0]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _reference(batch, masks), atol=3e-2, rtol=0)
    if native_available():  # the queries as the model holds them (token-major bf16 [bs * K, Hq, D], K tokens per
        # row), unscaled (the scale rides on K's) and marked bf16 (q_bf16_scale 1: tiles may run), with the draft
        # block's slots and mask
        q, rows = calls[-1][0], calls[-1][9]
        assert q.dtype == torch.bfloat16 and q.shape == (rows * K, g.num_heads, g.head_dim) and calls[-1][14] == K
        assert calls[-1][6] == pytest.approx(g.sm_scale) and calls[-1][11] == 1.0
        assert calls[-1][12].shape[1] == K and calls[-1][13].shape[1:] == (K, K)


def test_target_verify_errors():
    g = H.GEOMETRIES["mha"]
    mr = H.make_model_runner(g, seed=15)
    batch = _verify_batch(mr, PREFIX, K, SimpleNamespace(draft_token_num=K, topk=2,
                                                         custom_mask=torch.ones(7, dtype=torch.bool)))
    backend = CompiledAttnBackend(mr)
    with pytest.raises(ValueError, match="custom_mask has 7 elements"):
        _run_layers(backend, batch, [H.make_layer(g)])
    batch.forward_batch.spec_info = None
    with pytest.raises(ValueError, match="spec_info"):
        _run_layers(backend, batch, [H.make_layer(g)])
    batch.forward_batch.spec_info = SimpleNamespace(draft_token_num=3, topk=1, custom_mask=None)
    with pytest.raises(ValueError, match="draft_len"):  # 16 tokens are not 4 requests of 3
        _run_layers(backend, batch, [H.make_layer(g)])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("window", [2, 8, 100])
def test_target_verify_on_sliding_window_layers(window, tree, page_size):
    """A windowed layer (gpt-oss alternates them): each draft token sees the window from its own position (prefix
    + its depth in the tree); a full-attention layer of the same forward sees the whole prefix."""
    g = H.GEOMETRIES["gqa"]
    mr = H.make_model_runner(g, seed=18, num_layers=2, page_size=page_size)
    if tree:
        masks, spec = _tree_spec(7)
    else:
        masks, spec = chain_mask(len(PREFIX), K), SimpleNamespace(draft_token_num=K, topk=1, custom_mask=None)
    batch = _verify_batch(mr, PREFIX, K, spec, layer_ids=(0, 1))
    layers = [H.make_layer(g, 0, window), H.make_layer(g, 1)]
    out = _run_layers(CompiledAttnBackend(mr), batch, layers)
    torch.testing.assert_close(out[0].double(), _reference(batch, masks, window=window), atol=1e-4, rtol=0)
    torch.testing.assert_close(out[1].double(), _reference(batch, masks, layer_id=1), atol=1e-4, rtol=0)


def test_target_verify_with_sinks():
    """gpt-oss's attention sinks reach verify through RadixAttention's ``sinks=``."""
    g = H.GEOMETRIES["gqa"]
    mr = H.make_model_runner(g, seed=17)
    masks, spec = _tree_spec(6)
    batch = _verify_batch(mr, PREFIX, K, spec)
    ld, sinks = batch.layers[0], torch.linspace(-2, 2, g.num_heads)
    out, _ = H.run_sglang_layer(CompiledAttnBackend(mr), H.make_layer(g), batch.forward_batch, ld.q, ld.k, ld.v,
                                sinks=sinks)
    torch.testing.assert_close(out.double(), _reference(batch, masks, sinks=sinks), atol=1e-4, rtol=0)


def test_draft_extend_v2_is_a_plain_extend():
    """DRAFT_EXTEND_V2: extend_prefix_lens / extend_seq_lens set, seq_lens including the new tokens, causal."""
    g = H.GEOMETRIES["gqa"]
    mr = H.make_model_runner(g, seed=16)
    batch = H.make_extend_batch(mr, [K] * len(PREFIX), PREFIX)
    batch.forward_batch.forward_mode = SG.ForwardMode.DRAFT_EXTEND_V2
    batch.forward_batch.spec_info = SimpleNamespace(num_tokens_per_req=K, draft_token_num=K)
    out = _run_layers(CompiledAttnBackend(mr), batch, [H.make_layer(g)])[0]
    chain = chain_mask(len(PREFIX), K)
    torch.testing.assert_close(out.double(), _reference(batch, chain), atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------- TARGET_VERIFY graph hooks
# SGLang's CPU graph runner refuses speculative decoding, so the hooks are driven here the way its CUDA graph runner
# drives them (decode_cuda_graph_runner.py): static input buffers of max_bs rows (max_bs * k tokens), a capture per
# batch size (out-of-graph hook, then the recorded part: in-graph hook and the layers), and replays that refill the
# buffers (padding: request row 0, the seq_len fill value, slot 0) and call the out-of-graph hook on a view. The
# recorded part is compiled with fullgraph=True (a host read or a graph break fails it); its "replay" is a call of
# the compiled function on the same buffers, which must not recompile.

MAX_BS = 4


def _runner_buffers(backend, g, layer_ids, max_bs=MAX_BS, k=K):
    """The runner's static inputs (runner_utils/buffers.py): rows, seq_lens (+ CPU mirror), out_cache_loc, the
    all-True custom mask get_spec_info hands the capture, and per layer the q/k/v a model would feed."""
    fill = backend.get_cuda_graph_seq_len_fill_value()
    n = max_bs * k
    return SimpleNamespace(
        req_pool_indices=torch.zeros(max_bs, dtype=torch.int64), seq_lens=torch.full((max_bs,), fill),
        seq_lens_cpu=torch.full((max_bs,), fill), out_cache_loc=torch.zeros(n, dtype=torch.int64),
        custom_mask=torch.ones((max_bs * fill + n) * k, dtype=torch.bool),
        qkv={lid: (torch.zeros(n, g.num_heads * g.head_dim), torch.zeros(n, g.num_kv_heads, g.head_dim),
                   torch.zeros(n, g.num_kv_heads, g.v_head_dim)) for lid in layer_ids})


def _capture(backend, buf, layers, bs, compiles, k=K, compile=True):
    """One graph of ``bs`` rows: the out-of-graph hook on the capture batch, then the recorded part compiled. As
    SGLang's capture, on buffers reset to padding (seq_lens to the fill value, the index buffers to 0)."""
    buf.seq_lens.fill_(backend.get_cuda_graph_seq_len_fill_value())
    buf.seq_lens_cpu.copy_(buf.seq_lens)
    buf.req_pool_indices.zero_()
    buf.out_cache_loc.zero_()
    fb = SG.ForwardBatch(forward_mode=SG.ForwardMode.TARGET_VERIFY, batch_size=bs,
                         input_ids=torch.zeros(bs * k, dtype=torch.int64), req_pool_indices=buf.req_pool_indices[:bs],
                         seq_lens=buf.seq_lens[:bs], seq_lens_cpu=buf.seq_lens_cpu[:bs],
                         out_cache_loc=buf.out_cache_loc[: bs * k], seq_lens_sum=int(buf.seq_lens[:bs].sum()),
                         positions=torch.zeros(bs * k, dtype=torch.int64),
                         spec_info=SimpleNamespace(draft_token_num=k, topk=4, custom_mask=buf.custom_mask))

    def recorded():
        backend.init_forward_metadata_in_graph(fb)
        return [backend.forward(*(t[: bs * k] for t in buf.qkv[layer.layer_id]), layer, fb) for layer in layers]

    def count(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    # compile=False: the Python runs as it does inside a CUDA graph capture (an exception propagates as it is)
    step = torch.compile(recorded, fullgraph=True, dynamic=False, backend=count) if compile else recorded
    with H.parallel_scope(), SG.forward_context(SG.ForwardContext(attn_backend=backend), forward_batch=fb):
        backend.init_forward_metadata_out_graph(fb, in_capture=True)
        step()
    return step


def fill_runner_buffers(backend, buf, batch, spec, bs):
    """The graph runner's load_batch: the batch's rows into the static buffers, the tail padded (``bs`` rows in
    all); returns the runner's view the out-of-graph hook reads (live spec_info, num_padding)."""
    n, fb = batch.num_real_reqs, batch.forward_batch
    buf.req_pool_indices.zero_()[:n] = fb.req_pool_indices
    buf.seq_lens.fill_(backend.get_cuda_graph_seq_len_fill_value())[:n] = fb.seq_lens
    buf.seq_lens_cpu.copy_(buf.seq_lens)
    buf.out_cache_loc.zero_()[: n * K] = fb.out_cache_loc
    for lid, (q, k, v) in buf.qkv.items():
        ld = batch.layers[lid]
        for dst, src in ((q, ld.q), (k, ld.k), (v, ld.v)):
            dst.zero_()[: n * K] = src.view(n * K, *dst.shape[1:])
    return SimpleNamespace(batch_size=bs, forward_mode=SG.ForwardMode.TARGET_VERIFY, num_padding=bs - n,
                           req_pool_indices=buf.req_pool_indices[:bs], seq_lens=buf.seq_lens[:bs],
                           seq_lens_cpu=buf.seq_lens_cpu[:bs], out_cache_loc=fb.out_cache_loc, spec_info=spec)


def _replay(backend, buf, graphs, batch, spec, g):
    """Copy the batch into the static buffers, pad it to the smallest captured size, run the out-of-graph hook on
    the runner's view (live spec_info, num_padding) and replay. Returns the real rows' outputs per layer."""
    n, fb = batch.num_real_reqs, batch.forward_batch
    bs = min(b for b in graphs if b >= n)
    view = fill_runner_buffers(backend, buf, batch, spec, bs)
    with H.parallel_scope(), SG.forward_context(SG.ForwardContext(attn_backend=backend), forward_batch=fb):
        backend.init_forward_metadata_out_graph(view)
        outs = graphs[bs]()
    assert all(o.shape[0] == bs * K and torch.isfinite(o).all() for o in outs)
    return [o[: n * K] for o in outs]


@pytest.mark.parametrize(("geom", "layout", "page_size", "window"), [
    ("gqa", "draft", 1, None), ("gqa", "full", 1, None), ("gqa", "draft", 16, None), ("mla_absorbed", "full", 1, None),
    ("gqa", "draft", 1, 6), ("gqa", "full", 16, 30)])
def test_target_verify_graph_capture_and_replay(monkeypatch, geom, layout, page_size, window):
    """Graphs of 2 and 4 rows on one set of static buffers; three batches (a tree padded 3 -> 4, a chain of 2, a
    tree of 4) replayed through them equal the float64 reference and the eager TARGET_VERIFY path; no recompile.
    With ``window``, layer 0 is a sliding-window layer (its index recorded in the graph too)."""
    import compiled_attn.sglang.speculative as S
    import compiled_attn.sglang.speculative_graphs as SGR
    monkeypatch.setattr(SGR, "mask_layout", lambda device: layout)
    monkeypatch.setattr(S, "mask_layout", lambda device: layout)
    torch._dynamo.reset()  # every capture here compiles the same code: its own cache entries, under the limit
    g = H.GEOMETRIES[geom]
    mr = H.make_model_runner(g, num_layers=2, seed=21, page_size=page_size)
    backend = CompiledAttnBackend(mr)
    backend.init_cuda_graph_state(MAX_BS, MAX_BS * K)
    layers = [H.make_layer(g, 0, window), H.make_layer(g, 1)]
    buf, compiles = _runner_buffers(backend, g, (0, 1)), []
    graphs = {bs: _capture(backend, buf, layers, bs, compiles) for bs in (4, 2)}  # largest first, as SGLang
    assert len(compiles) == 2
    for prefix, tree, seed in (([5, 0, 40], True, 1), ([17, 60], False, 2), ([33, 2, 9, 70], True, 3)):
        masks = _tree_masks(len(prefix), K, seed) if tree else chain_mask(len(prefix), K)
        spec = SimpleNamespace(draft_token_num=K, topk=4 if tree else 1,
                               custom_mask=_flat_mask(masks, prefix, layout) if tree else None)
        batch = _verify_batch(mr, prefix, K, spec, layer_ids=(0, 1))
        outs = _replay(backend, buf, graphs, batch, spec, g)
        eager = _run_layers(CompiledAttnBackend(mr), batch, layers)
        for lid, (out, ref) in enumerate(zip(outs, eager, strict=True)):
            torch.testing.assert_close(out.double(), _reference(batch, masks, lid, window=window if lid == 0 else None),
                                       atol=1e-4, rtol=0)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert len(compiles) == 2, "a replay recompiled the recorded part"


def test_target_verify_graph_errors(monkeypatch):
    """Host checks before a replay: a batch beyond the captured KV capacity, a draft count never captured, a mask
    of the wrong size."""
    monkeypatch.setenv("COMPILED_ATTN_GRAPH_KV_TOKENS", "64")
    torch._dynamo.reset()
    g = H.GEOMETRIES["gqa"]
    mr = H.make_model_runner(g, seed=22, max_context_len=1024)
    backend = CompiledAttnBackend(mr)
    backend.init_cuda_graph_state(2, 2 * K)
    buf, compiles = _runner_buffers(backend, g, (0,), max_bs=2), []
    graphs = {2: _capture(backend, buf, [H.make_layer(g)], 2, compiles)}
    cap = backend.graph.verify[K]
    assert cap.draft_mask.shape == (2, K, K) and cap.block_size == 128  # verify_block_size(K) on CPU
    spec = SimpleNamespace(draft_token_num=K, topk=1, custom_mask=None)
    batch = _verify_batch(mr, [600, 700], K, spec)  # 11 blocks of 128; 64 KV tokens: 1 block + 1 per row
    with pytest.raises(ValueError, match=r"TARGET_VERIFY batch \(bs=2, 1300 cached tokens\).*COMPILED_ATTN_GRAPH_KV"):
        _replay(backend, buf, graphs, batch, spec, g)
    batch = _verify_batch(mr, [3, 9], K, spec)
    with pytest.raises(RuntimeError, match="no TARGET_VERIFY graph was captured with draft_token_num=2"):
        _replay(backend, buf, graphs, batch, SimpleNamespace(draft_token_num=2, topk=1, custom_mask=None), g)
    short = mask_numel(torch.tensor([3, 9]), K, mask_layout(torch.device("cpu"))) - 1
    bad = SimpleNamespace(draft_token_num=K, topk=4, custom_mask=torch.ones(short, dtype=torch.bool))
    with pytest.raises(ValueError, match=f"custom_mask has {short} elements"):
        _replay(backend, buf, graphs, batch, bad, g)
