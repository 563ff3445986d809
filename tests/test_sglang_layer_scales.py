"""Our SGLang backend over a float8 KV pool whose layers carry their own K and V scales (a checkpoint's
``k_scale`` / ``v_scale``), on the decode and ``TARGET_VERIFY`` paths: K/V stored divided by the layer's scales and
read back multiplied, each by its own. Every scale differs from the others, so K's read with V's scale, or one
layer's with another's, is far off the float64 reference over the dequantised pool. (The prefix path's scales:
``test_sglang_kv_formats.py``.) Skipped where SGLang isn't installed."""
from types import SimpleNamespace

import pytest
import torch

import compiled_attn.sglang.testing as H

# On a CPU torch, torchvision (which SGLang imports) needs its op schemas declared before anything imports it.
H.ensure_sglang_importable()
pytest.importorskip("sglang")

from reference import reference_attention, reference_verify  # noqa: E402

from compiled_attn.sglang.backend import CompiledAttnBackend  # noqa: E402
from compiled_attn.verify import chain_mask  # noqa: E402

SG = H.import_sglang()
GEOM = H.GEOMETRIES["gqa"]  # 8 query heads over 2 KV heads, head size 64
#: (k_scale, v_scale) of layers 0 and 1: no two alike
LAYER_SCALES = {0: (0.37, 2.5), 1: (1.7, 0.6)}
#: the largest relative rounding of a stored value (half a unit in the last place: 3 and 2 mantissa bits)
FP8_RTOL = {torch.float8_e4m3fn: 2 ** -4, torch.float8_e5m2: 2 ** -3}
DECODE_LENS = [7, 1, 30, 12, 2, 65]  # cached tokens + the new one, per request
VERIFY_PREFIX, DRAFTS = [5, 0, 40, 17], 4


def scaled_layer(layer_id: int):
    """A ``RadixAttention`` layer with its checkpoint scales, as SGLang's quantised models set them."""
    layer = H.make_layer(GEOM, layer_id)
    k_scale, v_scale = LAYER_SCALES[layer_id]
    layer.k_scale, layer.v_scale = torch.tensor(k_scale), torch.tensor(v_scale)
    layer.k_scale_float, layer.v_scale_float = k_scale, v_scale
    return layer


def verify_batch(mr):
    """A TARGET_VERIFY batch of chains: the prefix K/V in the pool (both layers), DRAFTS new tokens per request;
    seq_lens WITHOUT the draft tokens, as SGLang passes them."""
    b = H.make_extend_batch(mr, [DRAFTS] * len(VERIFY_PREFIX), VERIFY_PREFIX, layer_ids=tuple(LAYER_SCALES))
    bs, lens = len(VERIFY_PREFIX), torch.tensor(VERIFY_PREFIX, dtype=torch.int64)
    spec = SimpleNamespace(draft_token_num=DRAFTS, topk=1, custom_mask=None)  # a chain: the causal mask
    b.forward_batch = SG.ForwardBatch(
        forward_mode=SG.ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=torch.zeros(bs * DRAFTS, dtype=torch.int64),
        req_pool_indices=b.req_pool_indices, seq_lens=lens, out_cache_loc=b.out_cache_loc,
        seq_lens_sum=int(lens.sum()), seq_lens_cpu=lens.clone(), positions=b.positions, spec_info=spec)
    return b


def reference(batch, mode: str, layer_id: int, pool) -> torch.Tensor:
    """float64 attention of the layer's queries over its pool read back times its own K and V scales.
    -> [num_tokens, Hq * Dv]."""
    k_scale, v_scale = LAYER_SCALES[layer_id]
    k_cache = pool.get_key_buffer(layer_id).double() * k_scale  # [slots, Hkv, D]
    v_cache = pool.get_value_buffer(layer_id).double() * v_scale
    q = batch.layers[layer_id].q.view(-1, GEOM.num_heads, GEOM.head_dim)
    if mode == "decode":
        out = reference_attention(q, k_cache, v_cache, batch.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                  batch.extend_prefix_lens, batch.extend_seq_lens, scale=GEOM.sm_scale)
    else:
        prefix = torch.tensor(VERIFY_PREFIX)
        out = reference_verify(q, k_cache, v_cache, batch.req_to_token, batch.req_pool_indices, prefix, DRAFTS,
                               chain_mask(len(VERIFY_PREFIX), DRAFTS), GEOM.sm_scale)
    return out.reshape(q.shape[0], -1)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", ["decode", "verify"])
def test_float8_layer_scales_on_decode_and_verify(mode, kv_dtype):
    """Two layers of one forward, each with its own K and V scales: decode (6 requests, 1 to 65 tokens) or a
    chain verify (4 requests, prefixes 0 to 40, 4 drafts each). Each layer's new K/V are stored divided by its
    scales, and its output [num_tokens, 8 * 64] equals the float64 reference over its pool times its scales."""
    mr = H.make_model_runner(GEOM, dtype=torch.float32, kv_dtype=kv_dtype, num_layers=2, seed=4)
    if mode == "decode":
        batch = H.make_decode_batch(mr, DECODE_LENS, layer_ids=tuple(LAYER_SCALES))
    else:
        batch = verify_batch(mr)
    backend = CompiledAttnBackend(mr)
    pool = mr.token_to_kv_pool
    for lid in LAYER_SCALES:
        ld = batch.layers[lid]
        out, _ = H.run_sglang_layer(backend, scaled_layer(lid), batch.forward_batch, ld.q, ld.k, ld.v,
                                    init_metadata=lid == 0)
        k_scale, v_scale = LAYER_SCALES[lid]
        loc = batch.out_cache_loc
        for stored, given, scale in ((pool.get_key_buffer(lid)[loc], ld.k, k_scale),
                                     (pool.get_value_buffer(lid)[loc], ld.v, v_scale)):
            # float8 rounding only; atol for the values float8 holds as subnormals
            torch.testing.assert_close(stored.double().flatten(1) * scale, given.double(), atol=0.02 * scale,
                                       rtol=FP8_RTOL[kv_dtype])
        torch.testing.assert_close(out.double(), reference(batch, mode, lid, pool), atol=1e-4, rtol=1e-4)
