"""``cpu_compile.compile_decode_once``: one ``torch.compile`` of the model for every size SGLang's CPU graph runner
captures, its batch dimension dynamic, instead of a whole-model compile per size.

Driven through SGLang's own ``cpu_graph_runner.patch_model`` (the name its runner calls per captured size) on a
small model whose forward reads what a decode forward reads (token ids, positions, the batch's ``seq_lens``,
``req_pool_indices`` and ``out_cache_loc``), compiled by inductor as the runner compiles: the sizes captured
largest first, then served in another order. Outputs are checked against a float64 reference. Skipped where
SGLang isn't installed.
"""
from types import SimpleNamespace

import pytest
import torch

import compiled_attn.sglang.testing as H
from compiled_attn.sglang import cpu_compile, cpu_fixups

H.ensure_sglang_importable()
pytest.importorskip("sglang")

from sglang.srt.model_executor import cpu_graph_runner  # noqa: E402

CAPTURED = [8, 4, 2, 1]  # the runner's order: largest first
SERVED = [3, 1, 8, 5, 2, 7]
TP_GROUP = SimpleNamespace(ca_comm=None)


class TinyDecoder(torch.nn.Module):
    """Embedding, a linear layer and a per-request term: -> [num_tokens, vocab]."""

    def __init__(self, vocab: int = 32, hidden: int = 16):
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.embed = torch.nn.Parameter(torch.randn(vocab, hidden, generator=gen))
        self.proj = torch.nn.Parameter(torch.randn(hidden, vocab, generator=gen))

    def forward(self, input_ids, positions, forward_batch):
        x = self.embed[input_ids] + positions[:, None].to(self.embed.dtype)
        x = x + (forward_batch.seq_lens + forward_batch.req_pool_indices + forward_batch.out_cache_loc)[:, None]
        return torch.tanh(x) @ self.proj


def reference(model: TinyDecoder, input_ids, positions, fb) -> torch.Tensor:
    e, p = model.embed.detach().double(), model.proj.detach().double()
    extra = (fb.seq_lens + fb.req_pool_indices + fb.out_cache_loc).double()
    return torch.tanh(e[input_ids] + positions[:, None].double() + extra[:, None]) @ p


def decode_inputs(bs: int, gen: torch.Generator):
    ids = torch.randint(0, 32, (bs,), generator=gen)
    fb = SimpleNamespace(seq_lens=torch.randint(1, 50, (bs,), generator=gen),
                         req_pool_indices=torch.randint(0, 8, (bs,), generator=gen),
                         out_cache_loc=torch.randint(0, 99, (bs,), generator=gen))
    return ids, fb.seq_lens - 1, fb


def graphs_for_captured_and_served(monkeypatch, fixup: bool) -> int:
    """Graphs compiled while capturing ``CAPTURED`` and serving ``SERVED`` (each size through the forward its
    captured bucket was handed, as the runner replays), every output checked against float64."""
    monkeypatch.setattr(cpu_graph_runner, "patch_model", cpu_graph_runner.patch_model)
    if fixup:
        assert cpu_compile.compile_decode_once()
        assert not cpu_compile.compile_decode_once()  # applied once
    model = TinyDecoder()
    torch._dynamo.reset()
    before = cpu_compile.graphs_compiled()
    gen = torch.Generator().manual_seed(0)
    forwards = {}
    for bs in CAPTURED:
        with cpu_graph_runner.patch_model(model, True, bs, TP_GROUP) as forward:
            forwards[bs] = forward
            ids, pos, fb = decode_inputs(bs, gen)
            torch.testing.assert_close(forward(ids, pos, fb).double(), reference(model, ids, pos, fb),
                                       rtol=1e-5, atol=1e-4)
    for bs in SERVED:
        ids, pos, fb = decode_inputs(bs, gen)
        bucket = min(b for b in CAPTURED if b >= bs)
        out = forwards[bucket](ids, pos, fb)
        torch.testing.assert_close(out.double(), reference(model, ids, pos, fb), rtol=1e-5, atol=1e-4)
    return cpu_compile.graphs_compiled() - before


def test_sglang_compiles_the_model_per_size_without_the_fixup(monkeypatch):
    # one per captured size, and more for the served sizes no bucket was compiled for (the runner pads them)
    assert graphs_for_captured_and_served(monkeypatch, fixup=False) >= len(CAPTURED)


def test_one_batch_dynamic_graph_serves_every_size_from_two(monkeypatch):
    # one graph for sizes 2..8 (captured or not), one for a batch of one (dynamo specialises a size of 1)
    assert graphs_for_captured_and_served(monkeypatch, fixup=True) == 2


def test_fixup_is_listed_for_the_live_engine():
    assert "compile_decode_once" in [name for name, *_ in cpu_fixups.FIXUPS]
