"""The run functions compile with fullgraph=True, and new lengths in the same bucket shapes do not recompile."""
import torch
from reference import reference_attention
from torch._dynamo.utils import counters

from compiled_attn import (
    build_decode_index,
    build_extend_tile_index,
    decode_blocks,
    extend_tiles,
    plan_decode,
    plan_extend,
    plan_extend_tiles,
)
from compiled_attn.bench.batches import make_batch
from compiled_attn.compile_policy import compile_step


def decode_step(q, k_cache, v_cache, table, inputs):
    index = build_decode_index(table, inputs)
    return decode_blocks(q, k_cache, v_cache, index, 0.25)


def extend_step(q, k_cache, v_cache, table, inputs):
    index = build_extend_tile_index(table, inputs, causal=True, sliding_window=None, with_mask=False)
    return extend_tiles(q, k_cache, v_cache, index, 0.25, form="kernel")


def _graphs():
    return counters["stats"]["unique_graphs"]


def test_decode_compiles_once_for_new_lengths():
    torch._dynamo.reset()
    fn = compile_step(decode_step, dynamic=False)
    b = make_batch([5, 70, 1, 130], hq=4, hkv=2, dqk=16, decode=True, width=200)
    results = []
    for lens in ([5, 70, 1, 130], [64, 3, 100, 0], [130, 130, 2, 7]):
        seq = torch.tensor(lens)
        meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, seq, batch_capacity=8,
                           block_capacity=8)
        q = torch.zeros(8, 4, 16)
        q[:4] = b.q
        out = fn(q, b.k_cache, b.v_cache, b.req_to_token, meta.inputs)
        ref = reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, seq, (seq - 1).clamp_min(0),
                                  torch.ones(4, dtype=torch.long), scale=0.25)
        ref[seq == 0] = 0
        assert (out[:4].double() - ref).abs().max() < 1e-4
        results.append(_graphs())
    assert results[1] == results[0] and results[2] == results[0], "new lengths recompiled"


def _extend_meta(b, seq, prefix):
    meta = plan_extend(b.q[: int((seq - prefix).sum())], b.k_cache, b.v_cache, b.req_to_token, b.rows, seq,
                       prefix, seq - prefix, batch_capacity=4)
    return plan_extend_tiles(meta, tile_q=16, tile_k=16, pair_capacity=32).inputs


def test_extend_compiles_once_for_new_lengths():
    torch._dynamo.reset()
    fn = compile_step(extend_step, dynamic=False)
    b = make_batch([40, 20, 9], [10, 0, 2], hq=4, hkv=2, dqk=16, width=64)
    counts = []
    # same token count (the packed q's shape), different split between requests and prefixes
    for seq, prefix in (([40, 20, 9], [10, 0, 2]), ([30, 30, 12], [0, 8, 7]), ([64, 1, 22], [30, 0, 0])):
        seq, prefix = torch.tensor(seq), torch.tensor(prefix)
        q = b.q[: int((seq - prefix).sum())]
        out = fn(q, b.k_cache, b.v_cache, b.req_to_token, _extend_meta(b, seq, prefix))
        ref = reference_attention(q, b.k_cache, b.v_cache, b.req_to_token, b.rows, seq, prefix, seq - prefix,
                                  scale=0.25)
        assert (out.double() - ref).abs().max() < 1e-4
        counts.append(_graphs())
    assert counts[0] == counts[1] == counts[2], "new lengths recompiled"


def test_a_float_argument_does_not_restart_the_trace():
    """A step's floats (softmax scale) reach the opaque CPU op as Python numbers; traced as symbols, dynamo
    restarted the whole trace to specialize them (a second compile attempt, ~4 s of a 4-layer step)."""
    from compiled_attn import build_decode_index, decode_blocks

    def step(q, k, v, table, inputs, scale):
        return decode_blocks(q, k, v, build_decode_index(table, inputs), scale)

    torch._dynamo.reset()
    torch._dynamo.utils.compilation_time_metrics.clear()
    b = make_batch([30, 70], hq=4, hkv=2, dqk=16, decode=True, seed=11)
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens)
    out = compile_step(step)(b.q, b.k_cache, b.v_cache, b.req_to_token, meta.inputs, 0.25)
    ref = reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.seq_lens - 1,
                              torch.ones(2, dtype=torch.long), scale=0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    attempts = [k for k in torch._dynamo.utils.compilation_time_metrics if k.startswith("compile_attempt_")]
    assert attempts == ["compile_attempt_0"]
