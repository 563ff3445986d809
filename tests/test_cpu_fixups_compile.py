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
