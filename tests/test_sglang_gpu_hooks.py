"""What SGLang 0.5.23's GPU paths read from our backend beyond the attention calls, driven on CPU in SGLang's order:
``max_context_len`` and ``verify_mask`` (the EAGLE worker's tree mask), the overlap plan stream's
``update_verify_buffers_to_fill_after_draft`` (TARGET_VERIFY graphs, against the float64 reference), and prefill
CUDA graphs: the breakable one through SGLang's own ``eager_on_graph`` split of ``RadixAttention`` (the capture made
of plain calls) equal to the eager backend and the float64 reference, the full one refused naming the flag's values.
Skipped where SGLang isn't installed.
"""
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

import compiled_attn.sglang.testing as H

H.ensure_sglang_importable()
pytest.importorskip("sglang")

# imported after importorskip: these import sglang
from reference import reference_attention  # noqa: E402
from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (  # noqa: E402
    breakable_cuda_graph as bcg,
)
from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (  # noqa: E402
    enable_breakable_cuda_graph,
)
from sglang.srt.model_executor.runner_utils.forward_batch import set_forward_batch  # noqa: E402
from sglang.srt.model_executor.runner_utils.prefill_graph import prefill_graph_scope  # noqa: E402
from sglang.srt.runtime_context import get_flags  # noqa: E402
from sglang_compare import SG, pool_copies, run_forward  # noqa: E402
from test_sglang_speculative import (  # noqa: E402 (its batches, float64 reference and graph runner's buffers)
    MAX_BS,
    K,
    _flat_mask,
    _reference,
    _runner_buffers,
    _tree_masks,
    _verify_batch,
    fill_runner_buffers,
)

import compiled_attn.sglang.speculative as S  # noqa: E402
import compiled_attn.sglang.speculative_graphs as SGR  # noqa: E402
from compiled_attn.sglang.backend import CompiledAttnBackend  # noqa: E402


def test_attributes_sglang_reads():
    """``max_context_len``: the req_to_token width (EAGLE allocates ``bs * max_context_len`` cached tokens' worth of
    FULL_MASK, eagle_worker_common.py); ``verify_mask`` None: the worker allocates and fills the tree mask itself."""
    mr = H.make_model_runner(H.GEOMETRIES["gqa"], max_context_len=300)
    backend = CompiledAttnBackend(mr)
    assert backend.max_context_len == mr.req_to_token_pool.req_to_token.shape[1] == 300
    assert isinstance(backend.max_context_len, int)
    assert backend.verify_mask is None and backend.dllm_attention is None
    assert not backend.supports_ragged_verify_graph
    assert not backend.use_captured_forward_metadata_for_breakable_cuda_graph  # breakable: init_forward_metadata
    # eager verify (no graph: cuda_graph_bs None) reads spec_info at its forward: nothing to refill
    assert backend.update_verify_buffers_to_fill_after_draft(SimpleNamespace(draft_token_num=K), None) is None


# ---------------------------------------------------------------------------------- the refill after the draft
# The EAGLE worker's verify step with SGLANG_ENABLE_OVERLAP_PLAN_STREAM=1 (run_eagle_verify): on the plan stream the
# runner's load_batch fills its buffers and calls init_forward_metadata_out_graph on its view; the streams join; then
# update_verify_buffers_to_fill_after_draft(spec_info, runner.bs); then the replay (the recorded in-graph metadata
# and the layers). Driven here without a graph: out_graph, in_graph, the update, the layers.


def _static_batch(buf, bs: int, k: int = K):
    """The runner's capture batch over its static buffers (capture_prepare): what the recorded part reads."""
    return SG.ForwardBatch(forward_mode=SG.ForwardMode.TARGET_VERIFY, batch_size=bs,
                           input_ids=torch.zeros(bs * k, dtype=torch.int64), req_pool_indices=buf.req_pool_indices[:bs],
                           seq_lens=buf.seq_lens[:bs], seq_lens_cpu=buf.seq_lens_cpu[:bs],
                           out_cache_loc=buf.out_cache_loc[: bs * k], seq_lens_sum=int(buf.seq_lens[:bs].sum()),
                           positions=torch.zeros(bs * k, dtype=torch.int64),
                           spec_info=SimpleNamespace(draft_token_num=k, topk=4, custom_mask=buf.custom_mask))


def _layers_forward(backend, buf, layers, fb, bs: int):
    with H.parallel_scope(), SG.forward_context(SG.ForwardContext(attn_backend=backend), forward_batch=fb):
        return [backend.forward(*(t[: bs * K] for t in buf.qkv[layer.layer_id]), layer, fb) for layer in layers]


def _capture(backend, buf, layers, bs: int):
    """A capture of ``bs`` rows on buffers reset to padding: out_graph (in_capture), then in_graph and the layers."""
    buf.seq_lens.fill_(backend.get_cuda_graph_seq_len_fill_value())
    buf.seq_lens_cpu.copy_(buf.seq_lens)
    buf.req_pool_indices.zero_()
    buf.out_cache_loc.zero_()
    fb = _static_batch(buf, bs)
    backend.init_forward_metadata_out_graph(fb, in_capture=True)
    backend.init_forward_metadata_in_graph(fb)
    _layers_forward(backend, buf, layers, fb, bs)


def _verify_step(backend, buf, layers, batch, spec, *, refill: bool, draft_done=None):
    """One verify step through the graph of the smallest captured size that fits (4 here): buffers, out_graph on
    the runner's view (the mask as the plan stream reads it), ``draft_done()`` (the draft finishing after that, if
    given), in_graph, the refill when ``refill``, the layers. Returns the real rows' outputs per layer."""
    n = batch.num_real_reqs
    bs = MAX_BS
    view = fill_runner_buffers(backend, buf, batch, spec, bs)
    static = _static_batch(buf, bs)
    backend.init_forward_metadata_out_graph(view)
    if draft_done is not None:
        draft_done()
    backend.init_forward_metadata_in_graph(static)
    if refill:
        backend.update_verify_buffers_to_fill_after_draft(spec, bs)
    return [o[: n * K] for o in _layers_forward(backend, buf, layers, static, bs)]


def _graphs_setup(monkeypatch, layout: str, window=None, seed: int = 31):
    """A backend with TARGET_VERIFY graphs of 4 and 2 rows captured, its runner's buffers and two layers (layer 0
    with ``window``), on a model runner of 2 layers."""
    monkeypatch.setattr(SGR, "mask_layout", lambda device: layout)
    monkeypatch.setattr(S, "mask_layout", lambda device: layout)
    g = H.GEOMETRIES["gqa"]
    mr = H.make_model_runner(g, num_layers=2, seed=seed)
    backend = CompiledAttnBackend(mr)
    backend.init_cuda_graph_state(MAX_BS, MAX_BS * K)
    layers = [H.make_layer(g, 0, window), H.make_layer(g, 1)]
    buf = _runner_buffers(backend, g, (0, 1))
    for bs in (4, 2):  # largest first, as SGLang
        _capture(backend, buf, layers, bs)
    return mr, backend, layers, buf


@pytest.mark.parametrize(("layout", "window"), [("draft", None), ("full", None), ("full", 6)])
def test_refill_after_draft_in_eagle_order(monkeypatch, layout, window):
    """A tree batch padded 3 -> 4: with the mask final when the plan stream reads it, the refill changes nothing
    (outputs equal those without it and the float64 reference); with the draft writing its mask (the tensor the step
    carries) after the plan stream read a stale one, only the refilled step equals the reference."""
    mr, backend, layers, buf = _graphs_setup(monkeypatch, layout, window)
    prefix = [5, 0, 40]
    masks = _tree_masks(len(prefix), K, 8)
    spec = SimpleNamespace(draft_token_num=K, topk=4, custom_mask=_flat_mask(masks, prefix, layout))
    batch = _verify_batch(mr, prefix, K, spec, layer_ids=(0, 1))
    refs = [_reference(batch, masks, lid, window=window if lid == 0 else None) for lid in (0, 1)]
    plain = _verify_step(backend, buf, layers, batch, spec, refill=False)
    refilled = _verify_step(backend, buf, layers, batch, spec, refill=True)
    for out, again, ref in zip(plain, refilled, refs, strict=True):
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=0)
        torch.testing.assert_close(again, out, atol=0, rtol=0)

    final = spec.custom_mask.clone()
    stale = _flat_mask(_tree_masks(len(prefix), K, 9), prefix, layout)

    def draft_done():
        spec.custom_mask.copy_(final)

    for refill in (True, False):
        spec.custom_mask.copy_(stale)
        outs = _verify_step(backend, buf, layers, batch, spec, refill=refill, draft_done=draft_done)
        close = [torch.allclose(o.double(), r, atol=1e-4, rtol=0) for o, r in zip(outs, refs, strict=True)]
        assert all(close) if refill else not any(close)


def test_refill_no_ops_and_errors(monkeypatch):
    """A chain (no mask) and eager verify (cuda_graph_bs None) leave the buffers alone; a refill for another graph
    size than the last out_graph's, or for a draft count never captured, is an error naming it."""
    _, backend, _, _ = _graphs_setup(monkeypatch, "draft")
    state = backend.graph.verify[K]
    before = state.draft_mask.clone()
    tree = SimpleNamespace(draft_token_num=K, topk=4, custom_mask=torch.zeros(2 * K * K, dtype=torch.bool))
    backend.update_verify_buffers_to_fill_after_draft(tree, None)
    backend.update_verify_buffers_to_fill_after_draft(SimpleNamespace(draft_token_num=K, topk=1, custom_mask=None), 2)
    assert torch.equal(state.draft_mask, before)
    with pytest.raises(RuntimeError, match=r"cuda_graph_bs=4\).*the last one was for bs=2"):
        backend.update_verify_buffers_to_fill_after_draft(tree, 4)
    with pytest.raises(RuntimeError, match="draft_token_num=3"):
        backend.update_verify_buffers_to_fill_after_draft(SimpleNamespace(draft_token_num=3, topk=4), 2)


# ---------------------------------------------------------------------------------- prefill CUDA graphs
# SGLang's breakable prefill graph (prefill_cuda_graph_runner.py with runner_backend/breakable_cuda_graph_backend.py):
# capture: capture_prepare's dummy batch over the static buffers, init_forward_metadata on it, the body twice eagerly,
# then once under BreakableCUDAGraphCapture, where RadixAttention's _eager_attention (eager_on_graph) ends a
# segment, runs once and records a closure over its arguments (q/k/v and its output buffer: graph addresses). Replay
# (load_batch): the step's tokens into the static buffers, a view batch over them (its own request metadata,
# out_cache_loc the static slot, global_num_token_non_padded_cpu the real tokens), init_forward_metadata on the step's
# batch, then the segments and the recorded closures in turn, under the view as the current forward batch. Here the
# capture is SGLang's own eager_on_graph wrapper with a stand-in capture whose segments are plain calls (and the
# layers' q/k/v the static buffers a segment would write).

BUCKET = 64  # the captured token count (one request of 64 tokens at capture)


def _prefill_buffers(g, layer_ids, tokens: int = BUCKET):
    """The runner's static token buffers (out_cache_loc, positions, input_ids) and each layer's q/k/v, as the segment
    before that attention layer leaves them."""
    def z():
        return torch.zeros(tokens, dtype=torch.int64)

    return SimpleNamespace(loc=z(), positions=z(), input_ids=z(), qkv={
        lid: (torch.zeros(tokens, g.num_heads * g.head_dim), torch.zeros(tokens, g.num_kv_heads * g.head_dim),
              torch.zeros(tokens, g.num_kv_heads * g.v_head_dim)) for lid in layer_ids})


@contextmanager
def _prefill_scope(backend, fb, raw_num_tokens=None):
    """What the runner's _prefill_forward_context and the backend's replay_session publish around the body."""
    with (enable_breakable_cuda_graph(), prefill_graph_scope(full_graph=False, raw_num_tokens=raw_num_tokens),
          set_forward_batch(fb), SG.forward_context(SG.ForwardContext(attn_backend=backend), forward_batch=fb),
          H.parallel_scope()):
        yield


def _body(layers, buf, fb):
    """The captured transformer body, attention only: each layer on its static q/k/v."""
    return [layer(*buf.qkv[layer.layer_id], fb) for layer in layers]


def _capture_prefill(backend, layers, buf, tokens: int = BUCKET):
    """capture_one_shape for the breakable backend; returns the recorded eager closures and the outputs (the
    buffers the next segment reads)."""
    fb = SG.ForwardBatch(
        forward_mode=SG.ForwardMode.EXTEND, batch_size=1, input_ids=buf.input_ids[:tokens],
        req_pool_indices=torch.arange(1), seq_lens=torch.tensor([tokens]), seq_lens_cpu=torch.tensor([tokens]),
        out_cache_loc=buf.loc[:tokens], seq_lens_sum=tokens, positions=buf.positions[:tokens],
        extend_num_tokens=tokens, extend_seq_lens=torch.tensor([tokens], dtype=torch.int32),
        extend_prefix_lens=torch.zeros(1, dtype=torch.int32), extend_start_loc=torch.zeros(1, dtype=torch.int32),
        extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[tokens], global_num_token_non_padded_cpu=tokens)
    backend.init_forward_metadata(fb)
    capture = SimpleNamespace(_end_current_segment=lambda: None, _begin_new_segment=lambda: None, _barrier_fn=None,
                              cuda_graph=SimpleNamespace(_break_fns=[]))
    flags = get_flags().dp
    flags.capturing_prefill_graph = True  # as _capture sets it around the warmups and captures
    try:
        for _ in range(2):  # the warmups
            with _prefill_scope(backend, fb):
                _body(layers, buf, fb)
        token = bcg._current_capture_var.set(capture)
        try:
            with _prefill_scope(backend, fb):
                outs = _body(layers, buf, fb)
        finally:
            bcg._current_capture_var.reset(token)
    finally:
        flags.capturing_prefill_graph = False
    assert len(capture.cuda_graph._break_fns) == len(layers)  # one eager break per attention layer
    assert not any(o.any() for o in outs)  # the capture's runs return zeros (backend.py's docstring)
    return capture.cuda_graph._break_fns, outs


def _replay_prefill(backend, breaks, outs, buf, batch, gen, tokens: int = BUCKET):
    """load_batch + _prepare_forward_metadata_for_replay + the replay; returns the outputs' real and padded rows."""
    fb, n = batch.forward_batch, batch.num_real_tokens
    buf.loc.zero_()[:n] = fb.out_cache_loc
    buf.positions.zero_()[:n] = fb.positions
    for lid, dsts in buf.qkv.items():
        ld = batch.layers[lid]
        for dst, src in zip(dsts, (ld.q, ld.k, ld.v), strict=True):
            dst.copy_(torch.randn(dst.shape, generator=gen))  # padded tokens: whatever the segment computed
            dst[:n] = src
    view = SG.ForwardBatch(
        forward_mode=SG.ForwardMode.EXTEND, batch_size=fb.batch_size, input_ids=buf.input_ids[:tokens],
        req_pool_indices=fb.req_pool_indices, seq_lens=fb.seq_lens, seq_lens_cpu=fb.seq_lens_cpu,
        out_cache_loc=buf.loc[:tokens], seq_lens_sum=fb.seq_lens_sum, positions=buf.positions[:tokens],
        extend_num_tokens=fb.extend_num_tokens, extend_seq_lens=fb.extend_seq_lens,
        extend_prefix_lens=fb.extend_prefix_lens, extend_start_loc=fb.extend_start_loc,
        extend_prefix_lens_cpu=fb.extend_prefix_lens_cpu, extend_seq_lens_cpu=fb.extend_seq_lens_cpu,
        global_num_token_non_padded_cpu=n)
    with H.parallel_scope():
        backend.init_forward_metadata(fb)  # the step's batch, not the view
    with _prefill_scope(backend, view, raw_num_tokens=n):
        for replay in breaks:  # each segment (plain calls: their q/k/v are in the buffers already), then its break
            replay()
    return [o[:n].clone() for o in outs], [o[n:] for o in outs]


@pytest.mark.parametrize("page_size", [1, 16])
def test_breakable_prefill_graph_matches_eager_and_reference(page_size):
    """Two batches (prefixes cached, a sliding-window layer) replayed through one graph of 64 tokens captured on a
    dummy batch (its request row holds no pages): the real tokens' outputs equal the eager backend's and the float64
    reference, the padded tokens' are zero, and the KV pool holds what the eager backend writes (the capture wrote
    nothing)."""
    g = H.GEOMETRIES["gqa"]
    windows = (-1, 8)
    layers = [H.make_layer(g, i, w) for i, w in enumerate(windows)]
    mr = H.make_model_runner(g, num_layers=2, seed=41, page_size=page_size)
    backend = CompiledAttnBackend(mr)
    buf = _prefill_buffers(g, (0, 1))
    twin_mr = H.make_model_runner(g, num_layers=2, seed=41, page_size=page_size)  # the eager backend's, same batches
    twin_backend = CompiledAttnBackend(twin_mr)
    breaks, outs = _capture_prefill(backend, layers, buf)
    gen = torch.Generator().manual_seed(0)
    pool = mr.token_to_kv_pool
    for extend, prefix in (([5, 17, 9], [3, 0, 24]), ([40, 7], [0, 11])):
        batch = H.make_extend_batch(mr, extend, prefix, layer_ids=(0, 1))
        eager = run_forward(twin_backend, H.make_extend_batch(twin_mr, extend, prefix, layer_ids=(0, 1)), layers)
        real, padded = _replay_prefill(backend, breaks, outs, buf, batch, gen)
        for layer, out, pad, ref in zip(layers, real, padded, eager, strict=True):
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
            assert not pad.any()
            window = layer.sliding_window_size if layer.sliding_window_size >= 0 else None
            expect = reference_attention(
                batch.layers[layer.layer_id].q.view(-1, g.num_heads, g.head_dim),
                pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id), batch.req_to_token,
                batch.req_pool_indices, batch.seq_lens, batch.extend_prefix_lens, batch.extend_seq_lens,
                scale=g.sm_scale, sliding_window=window)
            torch.testing.assert_close(out.double().view_as(expect), expect, atol=1e-4, rtol=0)
    for (k, v), (tk, tv) in zip(pool_copies(mr, 2), pool_copies(twin_mr, 2), strict=True):
        assert torch.equal(k, tk) and torch.equal(v, tv)


def test_full_prefill_graph_is_refused():
    """The full prefill graph's capture (capture_one_shape) and replay call init_forward_metadata_out_graph on an
    extend batch: one error naming --cuda-graph-backend-prefill and the values that work."""
    g = H.GEOMETRIES["gqa"]
    mr = H.make_model_runner(g, seed=42)
    backend = CompiledAttnBackend(mr)
    fb = H.make_extend_batch(mr, [5, 9]).forward_batch
    msg = r"--cuda-graph-backend-prefill full\) is not supported.*breakable.*--cuda-graph-backend-prefill disabled"
    for in_capture in (True, False):
        with pytest.raises(NotImplementedError, match=msg):
            backend.init_forward_metadata_out_graph(fb, in_capture=in_capture)
