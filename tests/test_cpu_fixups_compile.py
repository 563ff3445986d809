"""``cpu_fixups.plain_layer_boundary_records``: SGLang's per-layer ``msgspec`` records swapped for plain classes.

Under ``--enable-torch-compile`` SGLang's CPU graph runner compiles the whole model without ``fullgraph``; every
decoder layer builds a ``Contribution`` (its residual stream) and an ``ExitDecision``, ``msgspec.Struct`` classes
dynamo cannot construct, so each was a graph break (TORCH_LOGS=graph_breaks in a live engine). Checked here on
SGLang's own classes: the swapped classes behave as the originals (fields, defaults, methods) and compile with
``fullgraph=True`` where the originals break the graph. The live compiled engine (tests/test_live_engine.py)
checks the tokens with the swap in place. Skipped where SGLang isn't installed.
"""
from types import SimpleNamespace

import pytest
import torch

import compiled_attn.sglang.testing as H
from compiled_attn.sglang import cpu_fixups

H.ensure_sglang_importable()
pytest.importorskip("sglang")

from sglang.srt.layers.layer_boundary import exit as boundary_exit  # noqa: E402
from sglang.srt.layers.layer_boundary.residual import stream  # noqa: E402

PLAIN_UPDATE = SimpleNamespace(bind=None)  # a residual update with nothing to bind, as a plain add has


@pytest.fixture
def originals(monkeypatch):
    """SGLang's two classes; the fix-up is applied and they are restored afterwards (this process runs SGLang's
    harness too)."""
    before = stream.Contribution, boundary_exit.ExitDecision
    monkeypatch.setattr(stream, "Contribution", before[0])
    monkeypatch.setattr(boundary_exit, "ExitDecision", before[1])
    assert cpu_fixups.plain_layer_boundary_records()
    assert stream.Contribution is not before[0] and boundary_exit.ExitDecision is not before[1]
    return before


def test_plain_records_keep_fields_defaults_and_methods(originals):
    x = torch.arange(4.0)
    for cls in (originals[0], stream.Contribution):
        c = cls(x, PLAIN_UPDATE)
        assert (c.value is x, c.update is PLAIN_UPDATE, c.owed) == (True, True, None)  # owed's default kept
        assert c.for_boundary() is x and c.complete() is x
        c.release()
        assert (c.value, c.owed, c.update) == (None, None, None)
        with pytest.raises(TypeError):
            cls()  # value and update have no default
    assert stream.Contribution.__name__ == "Contribution" and stream.Contribution.__module__ == stream.__name__
    for cls in (originals[1], boundary_exit.ExitDecision):
        d = cls(True, False, complete=len)
        assert (d.defer_moe_finalize, d.sum_in_reduce_scatter, d.complete) == (True, False, len)


def _record_and_prepare(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """What a decoder layer's boundary does with its output: record it, read it back, write the new residual."""
    s = stream.ResidualStream(residual)
    out = s.record(x * 2, PLAIN_UPDATE)
    hidden, res = s.input(out)
    decision = boundary_exit.ExitDecision(False, False, None)
    s.write(hidden + res)
    return s.residual + float(decision.defer_moe_finalize)


def test_sglang_records_break_the_graph_without_the_fixup():
    torch._dynamo.reset()
    compiled = torch.compile(_record_and_prepare, fullgraph=True, backend="eager")
    with pytest.raises(torch._dynamo.exc.Unsupported):
        compiled(torch.ones(3), torch.ones(3))


def test_swapped_records_compile_as_one_graph(originals):
    torch._dynamo.reset()
    x, residual = torch.randn(3), torch.randn(3)
    compiled = torch.compile(_record_and_prepare, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, residual), 2 * x + residual, rtol=0, atol=0)


def test_fixup_is_listed_for_the_live_engine():
    names = [name for name, *_ in cpu_fixups.FIXUPS]
    assert "plain_layer_boundary_records" in names


# --- cpu_fixups.eager_cpu_moe_loop --------------------------------------------------------------------------------

def _moe_case(num_tokens: int, gen: torch.Generator):
    """A MoE layer of 4 experts (hidden 8, intermediate 6), top-2 routing: SGLang's CPU ``moe_forward_native``
    inputs, with every token sent to its own random pair of experts so that each call has new counts per expert."""
    layer = SimpleNamespace(num_experts=4, w13_weight=torch.randn(4, 12, 8, generator=gen),
                            w2_weight=torch.randn(4, 8, 6, generator=gen))
    x = torch.randn(num_tokens, 8, generator=gen)
    topk_ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(num_tokens)]).to(torch.int32)
    topk_weights = torch.rand(num_tokens, 2, generator=gen)
    config = SimpleNamespace(apply_router_weight_on_input=False, activation="silu", gemm1_alpha=None)
    return layer, x, (topk_weights, topk_ids, None), config


def _moe_reference(layer, x, topk_output) -> torch.Tensor:
    """float64, token by token: sum over the chosen experts of weight * W2 (silu(W1 x) * W3 x)."""
    weights, ids, _ = topk_output
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].double(), ids[t].tolist(), strict=True):
            w13, w2 = layer.w13_weight[e].double(), layer.w2_weight[e].double()
            gate, up = (w13 @ x[t].double()).chunk(2)
            out[t] += w * (w2 @ (torch.nn.functional.silu(gate) * up))
    return out


def _compiled_moe_frames(monkeypatch, fixup: bool) -> int:
    """Frames dynamo compiles for 6 MoE calls of 8 tokens with different expert counts, compiled as SGLang's CPU
    graph runner compiles its model (``dynamic=False``, not fullgraph); each output checked against float64."""
    from sglang.srt.layers.moe import fused_moe_native

    monkeypatch.setattr(fused_moe_native, "moe_forward_native", fused_moe_native.moe_forward_native)
    if fixup:
        assert cpu_fixups.eager_cpu_moe_loop()
        assert not cpu_fixups.eager_cpu_moe_loop()  # applied once

    def forward(layer, x, topk_output, config):
        return fused_moe_native.moe_forward_native(layer, x * 1.0, topk_output, config) + 0.0

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(forward, backend=counter, dynamic=False)
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        layer, x, topk_output, config = _moe_case(8, gen)
        out = compiled(layer, x, topk_output, config)
        torch.testing.assert_close(out.double(), _moe_reference(layer, x, topk_output), rtol=1e-5, atol=1e-4)
    return counter.frame_count


def test_cpu_moe_loop_recompiles_per_expert_count_without_the_fixup(monkeypatch):
    assert _compiled_moe_frames(monkeypatch, fixup=False) > 6  # new counts per expert: frames compiled per call


def test_eager_cpu_moe_loop_compiles_the_caller_once(monkeypatch):
    # the caller's two graphs (before and after the MoE), compiled once; the loop runs eagerly
    assert _compiled_moe_frames(monkeypatch, fixup=True) == 2


def test_moe_fixup_is_listed_for_the_live_engine():
    assert "eager_cpu_moe_loop" in [name for name, *_ in cpu_fixups.FIXUPS]
