"""BucketedGraphs, the frame of the decode/extend/verify runners, with the toy step of ``graph_toys`` (CPU, no
compile: a counting stand-in plays the compiled step, so these tests run in a blink)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from graph_toys import KEYS, NUM_SLOTS, POLICY, D, make_buffers_on, real_batch, toy_step

from graphs import BucketedGraphs, GraphRunner


@dataclass
class Config:
    """The ``Switches`` fields a subclass's config carries."""

    enable_torch_compile: bool = True
    disable_cuda_graph: bool = False
    warmup_iters: int | None = None
    progress: bool = False
    measure_compile: bool = False


class Counting:
    """Stands in for ``torch.compile(step)``: the same outputs, calls counted."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, inputs, persistent):
        self.calls += 1
        return self.fn(inputs, persistent)


class ToyGraphs(BucketedGraphs):
    """The toy step over ``POLICY``'s (bs, kv) keys; buckets of more than ``compile_max_rows`` rows run eager."""

    def __init__(self, config=None, compile_max_rows=4, keys=KEYS):
        self.compiled_with: list[Counting] = []
        super().__init__(toy_step, config=config or Config(), device="cpu", compile_fn=self._compile)
        self.filled: list[tuple[int, int]] = []
        self._build_runners(keys, compile_max_rows)

    def _compile(self, fn):
        self.compiled_with.append(Counting(fn))
        return self.compiled_with[-1]

    def _buffer_specs(self, key):
        return make_buffers_on("cpu")(key).specs

    def _fill_warmup_batch(self, buffers, key):
        self.filled.append(key)

    def run(self, real, persistent):
        n, kv = real["q"].shape[0], real["slots"].shape[1]
        key = POLICY.key(n, kv) if n <= POLICY.max_batch_size else None
        return self._run(key, real, persistent, n)


@pytest.fixture
def persistent():
    return {"cache": torch.randn(NUM_SLOTS, D, generator=torch.Generator().manual_seed(0))}


def test_keys_split_at_compile_max_rows_and_the_step_compiles_once():
    graphs = ToyGraphs()
    small, large = graphs.runners
    assert {k[0] for k in small.keys} == {1, 2, 4} and {k[0] for k in large.keys} == {8, 16}
    assert len(graphs.compiled_with) == 1
    compiled = graphs.compiled_with[0]
    assert small._fn is compiled and large._fn is toy_step  # larger buckets replay the eager step
    assert small._fallback is compiled and large._fallback is compiled  # beyond every bucket: the compiled step
    assert all(graphs._runner_of[k] is r for r in graphs.runners for k in r.keys)
    assert [len(ToyGraphs(compile_max_rows=None).runners), len(ToyGraphs(compile_max_rows=0).runners)] == [1, 1]


def test_switches_reach_the_runners():
    off = ToyGraphs(Config(enable_torch_compile=False, measure_compile=True, warmup_iters=3))
    assert off.compiled_with == [] and all(r._fn is toy_step and r._eager is None for r in off.runners)
    assert all(r.warmup_iters == 3 and not r.use_cuda_graph for r in off.runners)
    on = ToyGraphs(Config(measure_compile=True))
    assert on.runners[0]._eager == on._eager_step and on.runners[1]._eager is None  # only compiled buckets measure
    assert all(r.warmup_iters == 1 for r in on.runners)  # no graphs to capture: the compiling run is enough


def test_warmup_fills_every_bucket_and_reports_every_key(persistent):
    graphs = ToyGraphs()
    timings = graphs.warmup(persistent)
    assert set(timings) == set(POLICY.keys()) and sorted(graphs.filled) == sorted(POLICY.keys())
    assert graphs.choices() == dict.fromkeys(POLICY.keys(), "compiled")
    assert [s.replays for s in graphs.stats] == [0, 0]


def test_run_routes_to_the_key_runner_slices_rows_and_falls_back(persistent):
    graphs = ToyGraphs()
    graphs.warmup(persistent)
    gen = torch.Generator().manual_seed(1)
    for n in (3, 13):  # a compiled bucket, an eager one
        real = real_batch(n, 20, gen=gen)
        out, lse = graphs.run(real, persistent)
        want_out, want_lse = toy_step(real, persistent)
        assert out.shape == (n, D) and lse.shape == (n,)
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(lse, want_lse)
    with pytest.warns(UserWarning, match="no warmed bucket"):
        out, _ = graphs.run(real_batch(20, 20, gen=gen), persistent)
    assert out.shape == (20, D)
    assert [(s.replays, s.fallbacks) for s in graphs.stats] == [(1, 1), (1, 0)]


def test_eager_form_follows_the_step_and_measured_choices_are_reported(persistent, monkeypatch):
    monkeypatch.setattr(GraphRunner, "EAGER_MARGIN", -10.0)  # every measured bucket picks the eager step
    graphs = ToyGraphs(Config(measure_compile=True), keys=[(2, 16), (8, 16)])
    seen = []

    def recording(inputs, pers):
        seen.append(inputs["q"].shape[0])
        return toy_step(inputs, pers)

    graphs._step_fn = recording
    graphs.warmup(persistent)
    assert graphs.choices()[(2, 16)] == "eager" and set(graphs.choices()) == {(2, 16), (8, 16)}
    assert seen and set(seen) == {2}  # the measured bucket timed the eager form through _step_fn
