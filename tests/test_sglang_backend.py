"""Our SGLang backend (``compiled_attn.sglang.backend``) against SGLang 0.5.23's own ``TorchNativeAttnBackend``.

Each case builds the same batch twice (two model-runner stand-ins from one seed: identical pools, rows, slots and
q/k/v), runs one through ``torch_native`` and one through ours via ``RadixAttention`` layers, and compares the
outputs and the whole KV pools (exactly: both write through the pool's own ``set_kv_buffer``). Also: the plugin
(entry point, registry, CLI choice). The graph hooks: ``test_sglang_graph_hooks.py``. Skipped where SGLang isn't
installed.
"""
import argparse
from importlib.metadata import entry_points

import pytest
import torch

import compiled_attn.sglang.testing as H

# On a CPU torch, torchvision (which SGLang imports) needs its op schemas declared before anything imports it.
H.ensure_sglang_importable()
pytest.importorskip("sglang")

# imported after importorskip: the backend module imports sglang
from sglang_compare import DTYPES, GEOMS, SG, compare_with_torch_native, pool_copies, run_forward, twin_batch  # noqa: E402

from compiled_attn.sglang.backend import CompiledAttnBackend  # noqa: E402
from compiled_attn.sglang.plugin import BACKEND_NAME, create_backend, register  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("mode", ["extend", "prefix", "decode"])
@pytest.mark.parametrize("geom", GEOMS)
def test_matches_torch_native(geom, mode, dtype):
    compare_with_torch_native(geom, mode, dtype)


@pytest.mark.parametrize("mode", ["prefix", "decode"])
@pytest.mark.parametrize("window", [1, 4, 100])
@pytest.mark.parametrize("geom", ["mha", "gqa"])
def test_sliding_window_matches_torch_native(geom, window, mode):
    compare_with_torch_native(geom, mode, windows=(window,), seed=3)


@pytest.mark.parametrize("mode", ["prefix", "decode"])
def test_layers_with_different_windows_share_one_forward(mode):
    """Layers of one forward with different windows: one plan per configuration, each layer right."""
    ref, out = compare_with_torch_native("gqa", mode, windows=(-1, 4, -1, 4), seed=4)
    assert not torch.allclose(ref[0], ref[1])  # the windows really differ


def test_encoder_only_is_not_causal():
    g = H.GEOMETRIES["gqa"]
    outs = []
    for make in (H.make_torch_native_backend, CompiledAttnBackend):
        mr = H.make_model_runner(g, seed=5)
        batch = H.make_extend_batch(mr, [6, 1, 13])
        layer = SG.RadixAttention(g.num_heads, g.head_dim, g.sm_scale, g.num_kv_heads, 0,
                                  attn_type=SG.AttentionType.ENCODER_ONLY)
        outs.append(run_forward(make(mr), batch, [layer])[0])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=0)
    causal = run_forward(CompiledAttnBackend(mr), batch, [H.make_layer(g)])[0]
    assert not torch.allclose(causal, outs[1], atol=1e-3)


def _cross_attention_run(make, enc_lens=(5, 3), dec_lens=(4, 2)):
    """Encoder-decoder: layer 0 self-attention over [enc, enc + seq), layer 1 cross-attention over [0, enc);
    an extend (writing the encoder K/V at encoder_out_cache_loc), then a decode step."""
    g = H.GEOMETRIES["mha"]
    mr = H.make_model_runner(g, num_layers=2, seed=6)
    gen = torch.Generator().manual_seed(7)

    def rnd(n, d):
        return torch.randn(n, d, generator=gen)

    rows = mr.req_allocator.alloc(len(enc_lens))
    table = mr.req_to_token_pool.req_to_token
    enc_loc, dec_loc = [], []
    for row, e, d in zip(rows.tolist(), enc_lens, dec_lens, strict=False):
        slots = mr.slot_allocator.alloc(e + d).tolist()
        table[row, : e + d] = torch.tensor(slots, dtype=torch.int32)
        enc_loc += slots[:e]
        dec_loc += slots[e:]
    backend = make(mr)
    self_layer = H.make_layer(g, 0)
    cross_layer = SG.RadixAttention(g.num_heads, g.head_dim, g.sm_scale, g.num_kv_heads, 1, is_cross_attention=True)
    enc, dec = torch.tensor(enc_lens), torch.tensor(dec_lens)
    n, ne = int(dec.sum()), int(enc.sum())
    hd, kvd = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    fb = SG.ForwardBatch(
        forward_mode=SG.ForwardMode.EXTEND, batch_size=len(dec_lens), input_ids=torch.zeros(n, dtype=torch.int64),
        req_pool_indices=rows, seq_lens=dec, out_cache_loc=torch.tensor(dec_loc), seq_lens_sum=n,
        seq_lens_cpu=dec.clone(), positions=torch.cat([torch.arange(d) for d in dec_lens]),
        extend_prefix_lens=torch.zeros_like(dec, dtype=torch.int32), extend_seq_lens=dec.to(torch.int32),
        extend_prefix_lens_cpu=[0] * len(dec_lens), extend_seq_lens_cpu=list(dec_lens), extend_num_tokens=n,
        encoder_lens=enc, encoder_lens_cpu=list(enc_lens), encoder_out_cache_loc=torch.tensor(enc_loc))
    outs = [H.run_sglang_layer(backend, self_layer, fb, rnd(n, hd), rnd(n, kvd), rnd(n, kvd))[0],
            H.run_sglang_layer(backend, cross_layer, fb, rnd(n, hd), rnd(ne, kvd), rnd(ne, kvd),
                               init_metadata=False)[0]]
    # decode: one more decoder token per request
    new = mr.slot_allocator.alloc(len(dec_lens))
    for i, (row, e, d) in enumerate(zip(rows.tolist(), enc_lens, dec_lens, strict=False)):
        table[row, e + d] = int(new[i])
    bs = len(dec_lens)
    fb = SG.ForwardBatch(
        forward_mode=SG.ForwardMode.DECODE, batch_size=bs, input_ids=torch.zeros(bs, dtype=torch.int64),
        req_pool_indices=rows, seq_lens=dec + 1, out_cache_loc=new, seq_lens_sum=int(dec.sum()) + bs,
        seq_lens_cpu=dec + 1, positions=dec.clone(), encoder_lens=enc, encoder_lens_cpu=list(enc_lens))
    outs.append(H.run_sglang_layer(backend, self_layer, fb, rnd(bs, hd), rnd(bs, kvd), rnd(bs, kvd))[0])
    outs.append(H.run_sglang_layer(backend, cross_layer, fb, rnd(bs, hd), None, None, init_metadata=False)[0])
    return outs, pool_copies(mr, 2)


def _graph_backend(mr, max_bs=4):
    backend = CompiledAttnBackend(mr)
    backend.init_cpu_graph_state(max_bs, max_bs)
    return backend


@pytest.mark.parametrize("make", [CompiledAttnBackend, _graph_backend], ids=["plain", "graph_metadata"])
def test_cross_attention_matches_torch_native(make):
    (ref, ref_pools), (out, pools) = _cross_attention_run(H.make_torch_native_backend), _cross_attention_run(make)
    for r, o in zip(ref, out, strict=False):
        torch.testing.assert_close(o, r, atol=1e-4, rtol=0)
    for (rk, rv), (k, v) in zip(ref_pools, pools, strict=False):
        assert torch.equal(rk, k) and torch.equal(rv, v)


def _reference(q, k, v, scale, cap=None, window=None, prefix=0):
    """One request, float64: q [n, H, D], k [L, Hkv, D], v [L, Hkv, Dv] -> [n, H * Dv]."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    qpos = torch.arange(prefix, prefix + q.shape[0])[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos >= qpos - window
    o = torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v)
    return o.reshape(q.shape[0], -1)


@pytest.mark.parametrize("mode", ["prefix", "decode"])
def test_logit_cap(mode):
    """RadixAttention.logit_cap (tanh soft-cap, as Gemma-2/Grok use it); torch_native ignores it."""
    g = H.GEOMETRIES["gqa"]
    mr = H.make_model_runner(g, seed=8)
    batch = twin_batch(mr, mode)
    layer = SG.RadixAttention(g.num_heads, g.head_dim, g.sm_scale * 40, g.num_kv_heads, 0, logit_cap=5.0)
    out = run_forward(CompiledAttnBackend(mr), batch, [layer])[0]
    ref = []
    for i in range(batch.num_real_reqs):
        k, v = H.request_kv(batch, i)
        q = H.request_q(batch, i)
        ref.append(_reference(q, k, v, layer.scaling, cap=5.0, prefix=k.shape[0] - q.shape[0]))
    torch.testing.assert_close(out.double(), torch.cat(ref), atol=1e-4, rtol=0)


def test_mla_normal_over_latent_pool_uses_given_kv():
    """DeepSeek's MHA prefill (192/128) on the MLA latent pool, save_kv_cache=False: attends over the batch's own
    K/V and leaves the pool alone (torch_native would read the 576-wide latent cache)."""
    g = H.GEOMETRIES["mla_absorbed"]
    mr = H.make_model_runner(g, seed=9)
    lens = [5, 1, 17, 9]
    batch = H.make_extend_batch(mr, lens)
    heads, dqk, dv = g.num_heads, 192, 128
    layer = SG.RadixAttention(heads, dqk, dqk**-0.5, heads, 0, v_head_dim=dv)
    n = sum(lens)
    gen = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(n, heads * d, generator=gen) for d in (dqk, dqk, dv))
    before = pool_copies(mr)
    out, _ = H.run_sglang_layer(CompiledAttnBackend(mr), layer, batch.forward_batch, q, k, v, save_kv_cache=False)
    assert all(torch.equal(a, b) for a, b in zip(before[0], pool_copies(mr)[0], strict=False))
    ref, start = [], 0
    for m in lens:
        sl = slice(start, start + m)
        ref.append(_reference(q[sl].view(m, heads, dqk), k[sl].view(m, heads, dqk), v[sl].view(m, heads, dv),
                              dqk**-0.5))
        start += m
    torch.testing.assert_close(out.double(), torch.cat(ref), atol=1e-4, rtol=0)


def test_idle_and_unsupported_modes():
    g = H.GEOMETRIES["mha"]
    mr = H.make_model_runner(g)
    backend = CompiledAttnBackend(mr)
    assert backend.support_triton() is False
    fb = SG.ForwardBatch(forward_mode=SG.ForwardMode.IDLE, batch_size=0, input_ids=torch.zeros(0, dtype=torch.int64),
                         req_pool_indices=torch.zeros(0, dtype=torch.int64), seq_lens=torch.zeros(0, dtype=torch.int64),
                         out_cache_loc=torch.zeros(0, dtype=torch.int64), seq_lens_sum=0)
    backend.init_forward_metadata(fb)
    q = torch.zeros(0, g.num_heads * g.head_dim)
    assert backend.forward(q, None, None, H.make_layer(g), fb).shape == (0, g.num_heads * g.v_head_dim)
    fb.forward_mode = SG.ForwardMode.DLLM_EXTEND  # TARGET_VERIFY / DRAFT_EXTEND_V2: test_sglang_speculative.py
    with pytest.raises(NotImplementedError, match="dLLM"):
        backend.init_forward_metadata(fb)


# ---------------------------------------------------------------------------------------------- plugin


def test_plugin_loads_through_sglang(monkeypatch):
    import sglang.srt.plugins as plugins
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    assert any(ep.value == "compiled_attn.sglang.plugin:register" for ep in entry_points(group="sglang.srt.plugins"))
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.delitem(ATTENTION_BACKENDS, BACKEND_NAME, raising=False)
    saved = list(ATTENTION_BACKEND_CHOICES)
    ATTENTION_BACKEND_CHOICES[:] = [c for c in saved if c != BACKEND_NAME]
    try:
        plugins.load_plugins()
        assert ATTENTION_BACKENDS[BACKEND_NAME] is create_backend
        register()  # idempotent
        register()
        assert ATTENTION_BACKEND_CHOICES.count(BACKEND_NAME) == 1
    finally:
        ATTENTION_BACKEND_CHOICES[:] = saved + [BACKEND_NAME] * (BACKEND_NAME not in saved)
    backend = ATTENTION_BACKENDS[BACKEND_NAME](H.make_model_runner(H.GEOMETRIES["mha"]))
    assert isinstance(backend, CompiledAttnBackend) and isinstance(backend, SG.AttentionBackend)


def test_cli_accepts_backend():
    from sglang.srt.server_args import ServerArgs

    register()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "x", "--attention-backend", BACKEND_NAME, "--enable-torch-compile"])
    assert args.attention_backend == BACKEND_NAME and args.enable_torch_compile
