"""Our SGLang backend's graph hooks: padded buckets and static metadata equal the plain path (CUDA and CPU graph
runners' hooks, pages, windows), the CPU-graph capture hook, the graph capacity check, and what SGLang's runners
compile (``forward_decode`` in one graph, no recompiles; the index built inside ``CPUGraphRunner``'s compiled
forward). Skipped where SGLang isn't installed.
"""
import math
from types import SimpleNamespace

import pytest
import torch

import compiled_attn.sglang.testing as H

# On a CPU torch, torchvision (which SGLang imports) needs its op schemas declared before anything imports it.
H.ensure_sglang_importable()
pytest.importorskip("sglang")

# imported after importorskip: the backend module imports sglang
from sglang_compare import SG, run_forward  # noqa: E402

from compiled_attn.sglang.backend import GRAPH_KV_TOKENS_ENV, CompiledAttnBackend  # noqa: E402


def _view(fb):
    """What SGLang's decode graph runner hands init_forward_metadata_out_graph at replay (build_replay_fb_view)."""
    return SimpleNamespace(batch_size=fb.batch_size, forward_mode=fb.forward_mode, req_pool_indices=fb.req_pool_indices,
                           seq_lens=fb.seq_lens, seq_lens_cpu=fb.seq_lens_cpu, seq_lens_sum=fb.seq_lens_sum,
                           encoder_lens=None, out_cache_loc=fb.out_cache_loc, positions=fb.positions)


def _graph_vs_plain(geom, hook, windows=(-1,), lens=(5, 9, 3, 70), max_bs=8, page_size=1):
    """Real rows of a batch padded to max_bs through the graph metadata == the unpadded batch, plain path."""
    g = H.GEOMETRIES[geom]
    layers = [H.make_layer(g, i, w) for i, w in enumerate(windows)]
    ids = tuple(range(len(windows)))
    plain_mr = H.make_model_runner(g, num_layers=len(ids), seed=11, page_size=page_size)
    plain = run_forward(CompiledAttnBackend(plain_mr), H.make_decode_batch(plain_mr, list(lens), layer_ids=ids), layers)
    mr = H.make_model_runner(g, num_layers=len(ids), seed=11, page_size=page_size)
    backend = CompiledAttnBackend(mr)
    backend.init_cuda_graph_state(max_bs, max_bs)
    fill = backend.get_cuda_graph_seq_len_fill_value()
    assert fill == backend.get_cpu_graph_seq_len_fill_value() == 1
    batch = H.make_decode_batch(mr, list(lens), layer_ids=ids, pad_to_bs=max_bs, seq_len_fill_value=fill)
    fb = batch.forward_batch
    with H.parallel_scope():
        if hook == "cuda":
            backend.init_forward_metadata_out_graph(_view(fb), in_capture=False)
            backend.init_forward_metadata_in_graph(fb)
        else:  # CPUGraphRunner replays through init_forward_metadata on its static batch
            backend.init_forward_metadata(fb)
    assert backend.forward_metadata.static
    graphed = []
    for layer in layers:
        ld = batch.layers[layer.layer_id]
        graphed.append(H.run_sglang_layer(backend, layer, fb, ld.q, ld.k, ld.v, init_metadata=False)[0])
    n = len(lens)
    for p, o in zip(plain, graphed, strict=False):
        assert o.shape[0] == max_bs and torch.isfinite(o).all()
        torch.testing.assert_close(o[:n], p, atol=1e-5, rtol=0)
    return backend, mr


@pytest.mark.parametrize("hook", ["cuda", "cpu"])
@pytest.mark.parametrize("geom", ["gqa", "mla_absorbed"])
def test_graph_metadata_matches_plain_path(geom, hook):
    _graph_vs_plain(geom, hook)


@pytest.mark.parametrize("hook", ["cuda", "cpu"])
def test_graph_metadata_with_pages_and_windows(hook):
    """Page size 16 and a window whose start is not page-aligned (its first block starts at its run)."""
    _graph_vs_plain("gqa", hook, windows=(-1, 20), lens=(5, 90, 33, 70), page_size=16)


def test_graph_learns_layer_configurations():
    backend, _ = _graph_vs_plain("mha", "cuda", windows=(-1, 4))
    assert list(backend.decode_keys) == [(None, False), (4, False)]  # the next capture builds both up front


def test_cpu_graph_capture_hook():
    """CPUGraphRunner's capture: static buffers holding only padding rows (row 0, seq_len fill value)."""
    g = H.GEOMETRIES["gqa"]
    mr = H.make_model_runner(g)
    backend = CompiledAttnBackend(mr)
    bs = 4
    backend.init_cpu_graph_state(bs, bs)
    rows, lens = torch.zeros(bs, dtype=torch.int64), torch.full((bs,), backend.get_cpu_graph_seq_len_fill_value())
    loc = torch.zeros(bs, dtype=torch.int64)
    backend.init_forward_metadata_capture_cpu_graph(bs, bs, rows, lens, loc, None, SG.ForwardMode.DECODE, None)
    fb = SG.ForwardBatch(forward_mode=SG.ForwardMode.DECODE, batch_size=bs, input_ids=loc.clone(),
                         req_pool_indices=rows, seq_lens=lens, out_cache_loc=loc, seq_lens_sum=bs, positions=loc)
    q = torch.randn(bs, g.num_heads * g.head_dim)
    kv = torch.randn(bs, g.num_kv_heads * g.head_dim)
    out, _ = H.run_sglang_layer(backend, H.make_layer(g), fb, q, kv, kv, init_metadata=False)
    assert out.shape == (bs, g.num_heads * g.v_head_dim) and torch.isfinite(out).all()


def test_graph_capacity(monkeypatch):
    """A batch beyond the captured KV capacity: a clear error before a graph replay; eager fallback otherwise."""
    monkeypatch.setenv(GRAPH_KV_TOKENS_ENV, "64")
    g = H.GEOMETRIES["mha"]
    mr = H.make_model_runner(g, seed=12)
    backend = CompiledAttnBackend(mr)
    backend.init_cuda_graph_state(8, 8)
    bs_cap = backend.graph_block_capacity(8)
    assert bs_cap == min(8 * math.ceil(256 / 64), 1 + 8)
    batch = H.make_decode_batch(mr, [200, 150, 100], pad_to_bs=8)  # 4 + 3 + 2 + 5 padded blocks > 9
    # the message names the batch (its size; its KV tokens, a padding row's one included) and the setting to raise
    msg = rf"decode batch \(bs=8, 455 KV tokens\) needs 14 KV blocks of 64, more than the 9 .*{GRAPH_KV_TOKENS_ENV}"
    with pytest.raises(ValueError, match=msg):
        backend.init_forward_metadata_out_graph(_view(batch.forward_batch))
    with pytest.warns(UserWarning, match="exact-size"):
        out = run_forward(backend, batch, [H.make_layer(g)])[0]
    assert not backend.forward_metadata.static
    ref_mr = H.make_model_runner(g, seed=12)
    ref_batch = H.make_decode_batch(ref_mr, [200, 150, 100], pad_to_bs=8)
    ref = run_forward(H.make_torch_native_backend(ref_mr), ref_batch, [H.make_layer(g)])
    torch.testing.assert_close(out, ref[0], atol=1e-4, rtol=0)
    monkeypatch.setenv(GRAPH_KV_TOKENS_ENV, "lots")
    with pytest.raises(ValueError, match=GRAPH_KV_TOKENS_ENV):
        backend.init_cuda_graph_state(8, 8)


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "as_cpu_graph_runner"])
@pytest.mark.parametrize("geom", ["gqa", "mla_absorbed"])
@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=False)  # dynamo's default, as that runner starts
def test_forward_decode_compiles_as_one_graph_without_recompiles(geom, fullgraph):
    """What SGLang's graph runners compile: forward_decode (pool write included) after the in-graph metadata, in one
    graph; a second batch of the same size must not recompile. CPUGraphRunner compiles without ``fullgraph`` (a
    break there does not fail, it splits the step and runs its pieces eagerly), from dynamo's default settings:
    its ``init_cpu_graph_state`` hook must set what the compiled decode's data-dependent block count needs."""
    g = H.GEOMETRIES[geom]
    mr = H.make_model_runner(g, seed=13)
    backend = CompiledAttnBackend(mr)
    backend.init_cpu_graph_state(8, 8)
    layer = H.make_layer(g)
    compiles = []

    def count(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(lambda q, k, v, fb: backend.forward_decode(q, k, v, layer, fb), fullgraph=fullgraph,
                         dynamic=False, backend=count)
    for lens in ([7, 1, 30], [90, 4, 12, 33, 2]):
        batch = H.make_decode_batch(mr, lens, pad_to_bs=8)
        fb = batch.forward_batch
        k = batch.k.view(8, g.num_kv_heads, g.head_dim)
        v = batch.v.view(8, g.num_kv_heads, g.v_head_dim)
        with H.parallel_scope():
            backend.init_forward_metadata_out_graph(_view(fb))
            backend.init_forward_metadata_in_graph(fb)
            with SG.forward_context(SG.ForwardContext(attn_backend=backend), forward_batch=fb):
                out = step(batch.q, k, v, fb)
                ref = backend.forward_decode(batch.q, k, v, layer, fb)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    assert len(compiles) == 1


@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=False)
def test_cpu_graph_runner_builds_the_index_inside_its_compiled_forward():
    """CPUGraphRunner calls ``init_forward_metadata`` eagerly before each compiled forward: the backend then only
    fills the static buffers, and the first attention layer builds the block index inside the compiled code (no
    ~25 eager small ops per step); the next layer reads it. Compiled as that runner compiles (no ``fullgraph``):
    two graphs (the layer that builds it, the layer that reads it), none more for a second batch of the same size,
    outputs equal to the eager backend's."""
    g = H.GEOMETRIES["gqa"]
    mr = H.make_model_runner(g, seed=14, num_layers=2)
    backend = CompiledAttnBackend(mr)
    backend.init_cpu_graph_state(8, 8)
    layers = [H.make_layer(g, i) for i in range(2)]
    compiles = []

    def count(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(lambda q, k, v, layer, fb: backend.forward_decode(q, k, v, layer, fb), dynamic=False,
                         backend=count)
    for lens in ([7, 1, 30], [90, 4, 12, 33, 2]):
        batch = H.make_decode_batch(mr, lens, pad_to_bs=8, layer_ids=(0, 1))
        fb = batch.forward_batch
        with H.parallel_scope():
            backend.init_forward_metadata(fb)
            assert backend.forward_metadata.static and not backend.forward_metadata.decode
            outs = []
            with SG.forward_context(SG.ForwardContext(attn_backend=backend), forward_batch=fb):
                for layer in layers:
                    ld = batch.layers[layer.layer_id]
                    k = ld.k.view(8, g.num_kv_heads, g.head_dim)
                    v = ld.v.view(8, g.num_kv_heads, g.v_head_dim)
                    outs.append(step(ld.q, k, v, layer, fb))
            assert list(backend.forward_metadata.decode) == [(None, False)]
            plain = CompiledAttnBackend(mr)  # eager, exact-size metadata: the reference
            plain.init_forward_metadata(fb)
            with SG.forward_context(SG.ForwardContext(attn_backend=plain), forward_batch=fb):
                for layer, out in zip(layers, outs, strict=True):
                    ld = batch.layers[layer.layer_id]
                    ref = plain.forward_decode(ld.q, ld.k.view(8, g.num_kv_heads, g.head_dim),
                                               ld.v.view(8, g.num_kv_heads, g.v_head_dim), layer, fb,
                                               save_kv_cache=False)
                    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert len(compiles) == 2


@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=False)
def test_cpu_graph_capture_then_serving_compiles_nothing_more():
    """SGLang's CPUGraphRunner capture, as it runs per batch size: the capture hook, one eager model forward, then
    two compiled forwards, all on one metadata object; each later step calls ``init_forward_metadata`` (fresh
    metadata) and the compiled forward. The "model" here is two attention layers in one compiled function. The
    first real decode of the size must reuse the capture's graph: a forward traced with the indices that the eager
    run left in the metadata would guard on them and compile again at every size's first request. The backend's
    ``compiles_after_start_up`` counts what compiles while serving, and must see nothing."""
    g = H.GEOMETRIES["gqa"]
    mr = H.make_model_runner(g, seed=15, num_layers=2)
    backend = CompiledAttnBackend(mr)
    bs = 8
    backend.init_cpu_graph_state(bs, bs)
    layers = [H.make_layer(g, i) for i in range(2)]
    compiles = []

    def count(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    def model_forward(batch, fb):
        outs = []
        for layer in layers:
            ld = batch.layers[layer.layer_id]
            outs.append(backend.forward_decode(ld.q, ld.k.view(bs, g.num_kv_heads, g.head_dim),
                                               ld.v.view(bs, g.num_kv_heads, g.v_head_dim), layer, fb))
        return outs

    torch._dynamo.reset()
    compiled = torch.compile(model_forward, dynamic=False, backend=count)
    capture = H.make_decode_batch(mr, [1] * bs, layer_ids=(0, 1))
    cfb = capture.forward_batch
    with H.parallel_scope(), SG.forward_context(SG.ForwardContext(attn_backend=backend), forward_batch=cfb):
        backend.init_forward_metadata_capture_cpu_graph(bs, bs, cfb.req_pool_indices, cfb.seq_lens,
                                                        cfb.out_cache_loc, None, cfb.forward_mode, None)
        model_forward(capture, cfb)
        for _ in range(2):
            compiled(capture, cfb)
    captured = len(compiles)
    for lens in ([7, 1, 30], [90, 4, 12, 33, 2]):
        batch = H.make_decode_batch(mr, lens, pad_to_bs=bs, layer_ids=(0, 1))
        fb = batch.forward_batch
        with H.parallel_scope():
            backend.init_forward_metadata(fb)
            with SG.forward_context(SG.ForwardContext(attn_backend=backend), forward_batch=fb):
                outs = compiled(batch, fb)
            plain = CompiledAttnBackend(mr)  # eager, exact-size metadata: the reference
            plain.init_forward_metadata(fb)
            with SG.forward_context(SG.ForwardContext(attn_backend=plain), forward_batch=fb):
                for layer, out in zip(layers, outs, strict=True):
                    ld = batch.layers[layer.layer_id]
                    ref = plain.forward_decode(ld.q, ld.k.view(bs, g.num_kv_heads, g.head_dim),
                                               ld.v.view(bs, g.num_kv_heads, g.v_head_dim), layer, fb,
                                               save_kv_cache=False)
                    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    backend.init_forward_metadata(fb)  # the watch counts at the next forward's start
    assert len(compiles) == captured, f"{len(compiles) - captured} compile(s) after the capture"
    assert backend.compiles_after_start_up.count == 0
