"""Our SGLang backend over KV caches as servers run them: SGLang's paged pools (``--page-size``), float8 pools
(``--kv-cache-dtype fp8_*``, with and without the layer's scales), and attention sinks through ``RadixAttention``;
against ``TorchNativeAttnBackend`` on twin batches where it has the feature, else the float64 reference. Skipped
where SGLang isn't installed."""
import pytest
import torch

import compiled_attn.sglang.testing as H

# On a CPU torch, torchvision (which SGLang imports) needs its op schemas declared before anything imports it.
H.ensure_sglang_importable()
pytest.importorskip("sglang")

from sglang_compare import GEOMS, compare_with_torch_native, twin_batch  # noqa: E402

from compiled_attn.sglang.backend import CompiledAttnBackend  # noqa: E402


@pytest.mark.parametrize("mode", ["prefix", "decode"])
@pytest.mark.parametrize("geom", GEOMS)
def test_paged_pool_matches_torch_native(geom, mode):
    """SGLang's --page-size 16: whole pages per request, gathered as runs of slots."""
    compare_with_torch_native(geom, mode, page_size=16)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("mode", ["prefix", "decode"])
@pytest.mark.parametrize("geom", ["gqa", "mla_absorbed"])
def test_fp8_pool_matches_torch_native(geom, mode, kv_dtype):
    """--kv-cache-dtype fp8_e4m3 / fp8_e5m2 (no scales in the checkpoint: torch_native casts the stored values,
    ours dequantises with scale 1), bf16 model."""
    compare_with_torch_native(geom, mode, torch.bfloat16, kv_dtype=kv_dtype, page_size=16 if mode == "decode" else 1)


def test_fp8_pool_with_layer_scales():
    """A layer with k_scale/v_scale: K/V are stored divided by them and read back multiplied; the output matches
    the float64 reference over the dequantised pool."""
    g = H.GEOMETRIES["gqa"]
    mr = H.make_model_runner(g, dtype=torch.float32, kv_dtype=torch.float8_e4m3fn, seed=4)
    batch = twin_batch(mr, "prefix")
    layer = H.make_layer(g, 0)
    layer.k_scale, layer.v_scale = torch.tensor(0.25), torch.tensor(2.0)
    layer.k_scale_float, layer.v_scale_float = 0.25, 2.0
    ld = batch.layers[0]
    out, pool = H.run_sglang_layer(CompiledAttnBackend(mr), layer, batch.forward_batch, ld.q, ld.k, ld.v)
    n = batch.num_real_tokens
    stored_k = pool.get_key_buffer(0)[batch.out_cache_loc[:n]].double() * 0.25
    torch.testing.assert_close(stored_k, ld.k[:n].double().view_as(stored_k), atol=0.5, rtol=0.07)
    ref = []
    for i in range(batch.num_real_reqs):
        start, cnt = int(batch.extend_seq_lens[:i].sum()), int(batch.extend_seq_lens[i])
        slots = batch.req_to_token[int(batch.req_pool_indices[i]), :int(batch.seq_lens[i])].long()
        k = pool.get_key_buffer(0)[slots].double() * 0.25
        v = pool.get_value_buffer(0)[slots].double() * 2.0
        q = ld.q[start:start + cnt].view(cnt, g.num_heads, g.head_dim).double()
        k, v = k.repeat_interleave(g.group_size, 1), v.repeat_interleave(g.group_size, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) * g.sm_scale
        qpos = torch.arange(k.shape[0] - cnt, k.shape[0])[:, None]
        s = s.masked_fill(torch.arange(k.shape[0])[None] > qpos, float("-inf"))
        ref.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(cnt, -1))
    torch.testing.assert_close(out[:n].double(), torch.cat(ref), atol=1e-4, rtol=1e-4)


def test_unsupported_kv_dtype_fails_at_construction():
    g = H.GEOMETRIES["gqa"]
    mr = H.make_model_runner(g)
    mr.token_to_kv_pool.dtype = torch.int8
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        CompiledAttnBackend(mr)


@pytest.mark.parametrize("mode", ["prefix", "decode"])
def test_attention_sinks_through_radix_attention(mode):
    """gpt-oss passes ``sinks=`` through RadixAttention; the output equals the float64 reference with the sink as
    one more softmax column of value zero (torch_native has no sinks)."""
    g = H.GEOMETRIES["gqa"]
    mr = H.make_model_runner(g, seed=7)
    batch = twin_batch(mr, mode)
    layer = H.make_layer(g, 0)
    sinks = torch.randn(g.num_heads, generator=torch.Generator().manual_seed(0)) * 3
    ld = batch.layers[0]
    out, _ = H.run_sglang_layer(CompiledAttnBackend(mr), layer, batch.forward_batch, ld.q, ld.k, ld.v, sinks=sinks)
    ref = []
    for i in range(batch.num_real_reqs):
        k, v = (t.double() for t in H.request_kv(batch, i))
        q = H.request_q(batch, i).double()
        k, v = k.repeat_interleave(g.group_size, 1), v.repeat_interleave(g.group_size, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) * g.sm_scale
        qpos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
        s = s.masked_fill(torch.arange(k.shape[0])[None] > qpos, float("-inf"))
        s = torch.cat([s, sinks.double()[:, None, None].expand(-1, q.shape[0], 1)], -1)
        ref.append(torch.einsum("hqk,khd->qhd", s.softmax(-1)[..., :-1], v).reshape(q.shape[0], -1))
    torch.testing.assert_close(out[:batch.num_real_tokens].double(), torch.cat(ref), atol=1e-5, rtol=1e-5)
