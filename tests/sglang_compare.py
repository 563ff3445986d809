"""What the SGLang backend tests share: the twin-batch comparison of our backend with SGLang's own
``TorchNativeAttnBackend`` (identical pools, rows, slots and q/k/v from one seed; outputs compared, whole KV pools
compared exactly). Imported by the test modules after they have skipped where SGLang is missing."""
import torch

import compiled_attn.sglang.testing as H
from compiled_attn.sglang.backend import CompiledAttnBackend

GEOMS = ["mha", "gqa", "mla_normal", "mla_absorbed"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ATOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}
SG = H.import_sglang()


def twin_batch(mr, mode, layer_ids=(0,), pad_to_bs=None):
    if mode == "decode":
        return H.make_decode_batch(mr, [7, 1, 30, 12, 2, 65], layer_ids=layer_ids, pad_to_bs=pad_to_bs)
    prefix = [3, 11, 0, 24] if mode == "prefix" else None
    return H.make_extend_batch(mr, [5, 1, 17, 9], prefix, layer_ids=layer_ids)


def pool_copies(mr, num_layers=1):
    pool = mr.token_to_kv_pool
    return [(pool.get_key_buffer(i).clone(), pool.get_value_buffer(i).clone()) for i in range(num_layers)]


def run_forward(backend, batch, layers):
    """One forward: metadata once, then each layer on its own q/k/v. Returns the outputs per layer."""
    outs = []
    for n, layer in enumerate(layers):
        ld = batch.layers[layer.layer_id]
        out, _ = H.run_sglang_layer(backend, layer, batch.forward_batch, ld.q, ld.k, ld.v, init_metadata=(n == 0))
        outs.append(out)
    return outs


def compare_with_torch_native(geom, mode, dtype=torch.float32, windows=(-1,), seed=1, **mr_kwargs):
    """torch_native vs ours on twin batches: layer i gets sliding window windows[i]."""
    g = H.GEOMETRIES[geom]
    results = []
    for make in (H.make_torch_native_backend, CompiledAttnBackend):
        mr = H.make_model_runner(g, dtype=dtype, num_layers=len(windows), seed=seed, **mr_kwargs)
        batch = twin_batch(mr, mode, layer_ids=tuple(range(len(windows))))
        layers = [H.make_layer(g, i, w) for i, w in enumerate(windows)]
        results.append((run_forward(make(mr), batch, layers), pool_copies(mr, len(windows)), batch))
    (ref, ref_pools, batch), (out, pools, _) = results
    for r, o in zip(ref, out, strict=False):
        assert o.shape == r.shape == (batch.forward_batch.input_ids.shape[0], g.num_heads * g.v_head_dim)
        assert o.dtype == dtype
        torch.testing.assert_close(o, r, atol=ATOL[dtype], rtol=0)
    for (rk, rv), (k, v) in zip(ref_pools, pools, strict=False):
        assert torch.equal(rk, k) and torch.equal(rv, v)
    return ref, out
