"""MLA's absorbed decode and verify through the C++ kernel: 576-wide queries and keys, V the latent's first 512
columns (``v_shares_k``), 16 query heads over one latent head. A bf16 query takes the kernel's tile path, a float32
one its wide path, and a float8 latent either. The compiled step's graph calls the kernel's op, and the result
matches a float64 reference over the dequantised latent."""
from __future__ import annotations

import pytest
import torch
from reference import in_place_op, reference_attention
from torch._dynamo.testing import CompileCounterWithBackend

from compiled_attn.bench.batches import make_batch
from compiled_attn.decode import build_decode_index, decode_blocks
from compiled_attn.kernels.cpu.kernel import native_available
from compiled_attn.plan import plan_decode
from compiled_attn.verify import build_verify_index, plan_verify, verify_blocks

LENS = [5, 70, 300]
SCALE = 576 ** -0.5
CASES = {  # query dtype, latent dtype, its scale, tolerance
    "fp32": (torch.float32, torch.float32, None, 1e-4),
    "bf16": (torch.bfloat16, torch.bfloat16, None, 3e-2),
    "bf16-e4m3": (torch.bfloat16, torch.float8_e4m3fn, 0.5, 3e-2),
}


def _compiled_with_ops(fn, *args):
    """fn compiled (fullgraph, eager backend) and run on args -> (output, the call targets of its graphs)."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    out = torch.compile(fn, backend=counter, fullgraph=True)(*args)
    return out, {n.target for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}


def _latent(b, kv_scale):
    """The batch's K and V caches in float64, dequantised (V a view of K's first 512 columns, as the kernel reads)."""
    k = b.k_cache.double() * (kv_scale or 1.0)
    return k, k[..., :512]


@pytest.mark.parametrize("case", list(CASES))
def test_mla_decode_reads_the_latent_through_the_kernel(case):
    dtype, kv_dtype, kv_scale, tol = CASES[case]
    b = make_batch(LENS, hq=16, hkv=1, dqk=576, dv=512, mla=True, dtype=dtype, kv_dtype=kv_dtype, decode=True, seed=3)
    assert b.v_cache.data_ptr() == b.k_cache.data_ptr()  # one latent cache
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens)

    def step(q, k_cache, v_cache, table, inputs):
        return decode_blocks(q, k_cache, v_cache, build_decode_index(table, inputs), SCALE, v_shares_k=True,
                             k_scale=kv_scale, v_scale=kv_scale)

    out, ops = _compiled_with_ops(step, b.q, b.k_cache, b.v_cache, b.req_to_token, meta.inputs)
    assert (in_place_op() in ops) == native_available()
    k, v = _latent(b, kv_scale)
    ref = reference_attention(b.q, k, v, b.req_to_token, b.rows, b.seq_lens, b.seq_lens - 1,
                              torch.ones_like(b.seq_lens), scale=SCALE)
    assert out.dtype == dtype and out.shape == (3, 16, 512)
    assert (out.double() - ref).abs().max() < tol


@pytest.mark.parametrize("case", ["fp32", "bf16"])
def test_mla_verify_reads_the_latent_through_the_kernel(case):
    """k = 2 draft tokens as a chain (32 query rows on the latent head): the prefix and the draft keys in one
    kernel call, against the reference's causal extend of the same two tokens."""
    dtype, kv_dtype, kv_scale, tol = CASES[case]
    k = 2
    prefix = torch.tensor(LENS)
    b = make_batch((prefix + k).tolist(), prefix.tolist(), hq=16, hkv=1, dqk=576, dv=512, mla=True, dtype=dtype,
                   seed=4)
    meta = plan_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, prefix, k)

    def step(q, k_cache, v_cache, table, inputs):
        return verify_blocks(q, k_cache, v_cache, build_verify_index(table, inputs), SCALE, v_shares_k=True)

    out, ops = _compiled_with_ops(step, b.q, b.k_cache, b.v_cache, b.req_to_token, meta.inputs)
    assert (in_place_op() in ops) == native_available()
    k_lat, v_lat = _latent(b, kv_scale)
    ref = reference_attention(b.q, k_lat, v_lat, b.req_to_token, b.rows, prefix + k, prefix,
                              torch.full_like(prefix, k), scale=SCALE)
    assert out.dtype == dtype and out.shape == (3 * k, 16, 512)
    assert (out.double() - ref).abs().max() < tol
