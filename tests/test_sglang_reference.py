"""SGLang 0.5.23's TorchNativeAttnBackend, driven by compiled_attn.sglang.testing, against a
plain float64 dense-softmax reference. Proves the harness drives SGLang correctly (pool
layout, scattered slots/rows, prefix, sliding window, MLA 576/512), so our backend can
later be checked against SGLang on the same batches. Skipped where SGLang isn't installed
(requirements-sglang.txt + requirements-sglang-nodeps.txt)."""
import pytest
import torch

import compiled_attn.sglang.testing as H

# On a CPU torch, torchvision (which SGLang imports) needs its op schemas declared before
# anything imports it; then skip cleanly if SGLang is absent.
H.ensure_sglang_importable()
pytest.importorskip("sglang")

GEOMS = ["mha", "gqa", "mla_normal", "mla_absorbed"]
DTYPES = [torch.float32, torch.bfloat16]


def reference(batch: H.BatchData, layer_id: int = 0, sliding_window_size: int = -1) -> torch.Tensor:
    """Per request, dense softmax in float64 over the request's full K/V (prefix + new)."""
    g = batch.geometry
    outs = []
    for i in range(batch.num_real_reqs):
        k, v = (t.double() for t in H.request_kv(batch, i, layer_id))  # [L, Hkv, D], [L, Hkv, Dv]
        q = H.request_q(batch, i, layer_id).double()  # [n, H, D]
        n, length = q.shape[0], k.shape[0]
        prefix = length - n
        qpos = torch.arange(prefix, length)[:, None]
        kpos = torch.arange(length)[None, :]
        mask = kpos <= qpos
        if sliding_window_size is not None and sliding_window_size >= 0:
            mask &= kpos >= qpos - sliding_window_size
        k = k.repeat_interleave(g.group_size, dim=1)
        v = v.repeat_interleave(g.group_size, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) * g.sm_scale
        s = s.masked_fill(~mask, float("-inf"))
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        outs.append(o.reshape(n, g.num_heads * g.v_head_dim))
    return torch.cat(outs)


def _check(out, ref, dtype, num_tokens):
    atol, rtol = H.default_tolerance(dtype)
    assert out.dtype == dtype
    assert out.shape[0] >= num_tokens
    out = out[:num_tokens].double()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


def _check_pool_written(mr, batch, layer_id=0):
    """The forward stored the new tokens' K/V at out_cache_loc (the pool's own layout)."""
    g = batch.geometry
    n = batch.num_real_tokens
    k_pool, v_pool = H.read_kv(mr, layer_id, batch.out_cache_loc[:n])
    ld = batch.layers[layer_id]
    torch.testing.assert_close(k_pool, ld.k[:n].view(n, g.num_kv_heads, g.head_dim), atol=0, rtol=0)
    torch.testing.assert_close(v_pool, ld.v[:n].view(n, g.num_kv_heads, g.v_head_dim), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_prefix", [False, True], ids=["noprefix", "prefix"])
@pytest.mark.parametrize("geom", GEOMS)
def test_extend_matches_reference(geom, with_prefix, dtype):
    g = H.GEOMETRIES[geom]
    mr = H.make_model_runner(g, dtype=dtype, seed=1)
    extend_lens = [5, 1, 17, 9]
    prefix_lens = [3, 11, 0, 24] if with_prefix else None
    batch = H.make_extend_batch(mr, extend_lens, prefix_lens)
    # The builder scatters rows/slots: nothing lands on the padding row/slot, order is shuffled.
    assert (batch.req_pool_indices > 0).all() and (batch.out_cache_loc > 0).all()
    assert not torch.equal(batch.out_cache_loc, batch.out_cache_loc.sort().values)
    out, pool = H.run_sglang(mr, batch)
    assert pool is mr.token_to_kv_pool
    assert out.shape == (sum(extend_lens), g.num_heads * g.v_head_dim)
    _check(out, reference(batch), dtype, sum(extend_lens))
    _check_pool_written(mr, batch)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("geom", GEOMS)
def test_decode_matches_reference(geom, dtype):
    g = H.GEOMETRIES[geom]
    mr = H.make_model_runner(g, dtype=dtype, seed=2)
    seq_lens = [7, 1, 30, 12, 2]
    batch = H.make_decode_batch(mr, seq_lens)
    out, _ = H.run_sglang(mr, batch)
    assert out.shape == (len(seq_lens), g.num_heads * g.v_head_dim)
    _check(out, reference(batch), dtype, len(seq_lens))
    _check_pool_written(mr, batch)


@pytest.mark.parametrize("mode", ["extend", "decode"])
@pytest.mark.parametrize("window", [1, 4, 100])
@pytest.mark.parametrize("geom", ["mha", "gqa"])
def test_sliding_window(geom, window, mode):
    g = H.GEOMETRIES[geom]
    mr = H.make_model_runner(g, seed=3)
    if mode == "extend":
        batch = H.make_extend_batch(mr, [6, 13, 2], [9, 0, 20])
    else:
        batch = H.make_decode_batch(mr, [3, 19, 8])
    out, _ = H.run_sglang(mr, batch, sliding_window_size=window)
    ref = reference(batch, sliding_window_size=window)
    _check(out, ref, torch.float32, batch.num_real_tokens)
    if window < 20:  # the window really cuts something off
        assert not torch.allclose(ref, reference(batch), atol=1e-3)


def test_sliding_window_zero_means_none():
    # RadixAttention keeps `sliding_window_size or -1`: 0 is "no window", not "self only".
    assert H.make_layer(H.GEOMETRIES["mha"], 0, 0).sliding_window_size == -1
    assert H.make_layer(H.GEOMETRIES["mha"], 0, None).sliding_window_size == -1


def test_decode_graph_padding_rows():
    """Graph-style padded rows (row 0, slot 0, seq_len fill 1) run and leave real rows exact."""
    g = H.GEOMETRIES["gqa"]
    mr = H.make_model_runner(g, seed=4)
    batch = H.make_decode_batch(mr, [5, 9, 3], pad_to_bs=8)
    assert batch.forward_batch.batch_size == 8
    assert (batch.req_pool_indices[3:] == 0).all() and (batch.out_cache_loc[3:] == 0).all()
    out, _ = H.run_sglang(mr, batch)
    assert out.shape[0] == 8
    _check(out, reference(batch), torch.float32, 3)


def test_two_layers_one_forward():
    """Two layers in one forward: metadata once, each layer reads its own pool buffers."""
    g = H.GEOMETRIES["mla_absorbed"]
    mr = H.make_model_runner(g, num_layers=2, seed=5)
    batch = H.make_extend_batch(mr, [4, 7], [5, 2], layer_ids=(0, 1))
    backend = H.make_torch_native_backend(mr)
    for lid in (0, 1):
        layer = H.make_layer(g, lid)
        ld = batch.layers[lid]
        out, _ = H.run_sglang_layer(backend, layer, batch.forward_batch, ld.q, ld.k, ld.v,
                                    init_metadata=(lid == 0))
        _check(out, reference(batch, lid), torch.float32, batch.num_real_tokens)
        _check_pool_written(mr, batch, lid)


def test_extend_then_decode_continues_from_pool():
    """A decode after an extend reads the K/V that the extend wrote (same rows, next slot)."""
    g = H.GEOMETRIES["mha"]
    mr = H.make_model_runner(g, seed=6)
    ext = H.make_extend_batch(mr, [6, 3])
    backend = H.make_torch_native_backend(mr)
    layer = H.make_layer(g)
    H.run_sglang(mr, ext, backend=backend)
    # decode one token per request on the same rows
    slots = mr.slot_allocator.alloc(2)
    seq_lens = ext.seq_lens + 1
    for i, row in enumerate(ext.req_pool_indices.tolist()):
        mr.req_to_token_pool.req_to_token[row, seq_lens[i] - 1] = int(slots[i])
    sg = H.import_sglang()
    fb = sg.ForwardBatch(
        forward_mode=sg.ForwardMode.DECODE, batch_size=2, input_ids=torch.zeros(2, dtype=torch.int64),
        req_pool_indices=ext.req_pool_indices, seq_lens=seq_lens, out_cache_loc=slots,
        seq_lens_sum=int(seq_lens.sum()), seq_lens_cpu=seq_lens.clone(), positions=seq_lens - 1,
    )
    q = torch.randn(2, g.num_heads * g.head_dim)
    k = torch.randn(2, g.num_kv_heads * g.head_dim)
    v = torch.randn(2, g.num_kv_heads * g.v_head_dim)
    out, _ = H.run_sglang_layer(backend, layer, fb, q, k, v)
    for i in range(2):
        kk, vv = H.request_kv(ext, i)
        kk = torch.cat([kk, k[i].view(1, g.num_kv_heads, g.head_dim)]).double()
        vv = torch.cat([vv, v[i].view(1, g.num_kv_heads, g.v_head_dim)]).double()
        qq = q[i].view(g.num_heads, g.head_dim).double()
        p = (torch.einsum("hd,khd->hk", qq, kk) * g.sm_scale).softmax(-1)
        ref = torch.einsum("hk,khd->hd", p, vv).reshape(-1)
        torch.testing.assert_close(out[i].double(), ref, atol=2e-5, rtol=2e-5)


def test_sglang_surface():
    """The 0.5.23 names our plugin relies on exist where we expect them."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, ServerArgs, add_attention_backend_choices

    assert "torch_native" in ATTENTION_BACKENDS and "torch_native" in ATTENTION_BACKEND_CHOICES
    assert callable(register_attention_backend) and callable(load_plugins) and ServerArgs
    assert add_attention_backend_choices.__self__ is ATTENTION_BACKEND_CHOICES
    for hook in ("init_forward_metadata", "init_forward_metadata_out_graph",
                 "init_forward_metadata_in_graph", "init_cuda_graph_state",
                 "get_cuda_graph_seq_len_fill_value", "forward_extend", "forward_decode"):
        assert hasattr(AttentionBackend, hook), hook
    # CPU-graph hooks are duck-typed: not on the ABC, and torch_native lacks them.
    assert not hasattr(AttentionBackend, "init_cpu_graph_state")
    assert not hasattr(H.import_sglang().TorchNativeAttnBackend, "get_cpu_graph_seq_len_fill_value")
