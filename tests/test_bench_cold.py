"""``compiled-attn bench-engine``'s cold column (issue #49, item 5): the first request of a batch size, from
submission to its last token, against a steady request of that size, for every backend; so a compile in the first
request's prefill (time to first token) or in any of its decode steps shows. The engines are fakes with controlled
timings (no SGLang engine starts); the timings go through the same ``batch_timings`` as a real batch's arrivals."""
import json

import pytest

from compiled_attn.bench import engine_bench
from compiled_attn.bench.engine_report import COLD_FLAG, cold_note, summarise_one

STEPS = 4  # decode steps per batch: STEPS + 1 tokens per request


def _arrivals(prefill_s: float, decode_s: list[float], bs: int) -> list[list[float]]:
    """Token arrivals (s after submission) of ``bs`` requests that all get each token at once: the first after
    ``prefill_s``, then one per entry of ``decode_s``."""
    t, times = prefill_s, [prefill_s]
    for d in decode_s:
        t += d
        times.append(t)
    return [list(times) for _ in range(bs)]


def test_batch_timings_request_runs_from_submission_to_the_last_token():
    # two requests; the batch's k-th token time is the later one's, and a burst (two tokens at 1.6) is spread
    arrivals = [[1.0, 1.1, 1.2, 1.3], [1.5, 1.6, 1.6, 1.8]]
    t = engine_bench.batch_timings(arrivals, steps=3)
    assert t["prefill_s"] == 1.5
    assert t["first_decode_s"] == pytest.approx(0.05)
    assert t["median_decode_s"] == pytest.approx(0.05)
    assert t["request_s"] == 1.8


def test_summarise_one_is_the_whole_first_request_against_the_median_steady_one():
    steady = [engine_bench.batch_timings(_arrivals(p, [0.1] * STEPS, 2), STEPS) for p in (1.0, 1.2, 1.1)]
    cold = engine_bench.batch_timings(_arrivals(20.0, [0.1] * STEPS, 2), STEPS)
    row = summarise_one(cold, steady)
    assert row["steady_request_s"] == pytest.approx(1.1 + 0.4)
    assert row["cold_request_s"] == pytest.approx(20.4)
    assert row["cold_over_steady"] == pytest.approx(20.4 / 1.5)
    assert row["cold_first_decode_s"] / row["median_decode_s"] == pytest.approx(1.0)  # the old column saw nothing
    note = cold_note("b", 2, row)
    assert note.startswith("# b bs=2: the first request took 20.40 s against 1.50 s steady")
    assert "20.00 s to its first token (1.10 s steady)" in note
    assert cold_note("b", 2, summarise_one(steady[0], steady)) is None


class _FakeEngine:
    """Stands in for ``engine_bench._Engine`` (a worker subprocess with an engine): each backend's first request of
    each batch size (the warm-up batch) takes ``SLOW_FIRST[backend]``'s timings, every later one the steady ones."""

    STEADY = dict(prefill_s=1.25, decode_s=[0.05] * STEPS)
    SLOW_FIRST = {"compiled_attn+compile": dict(prefill_s=28.8, decode_s=[0.05] * STEPS),  # compiles at prefill
                  "compiled_attn": dict(prefill_s=1.25, decode_s=[0.05, 0.05, 6.0, 0.05])}  # at its 3rd decode

    def __init__(self, backend: str, spec: dict):
        self.backend, self.seen = backend, set()

    def ready(self) -> dict:
        return {"ready": True, "start_s": 0.5}

    def run(self, bs: int, seed: int) -> dict:
        first = bs not in self.seen
        self.seen.add(bs)
        timing = self.SLOW_FIRST.get(self.backend, self.STEADY) if first else self.STEADY
        return dict(engine_bench.batch_timings(_arrivals(timing["prefill_s"], timing["decode_s"], bs), STEPS),
                    wall_s=0.0)

    def close(self) -> None:
        pass


def _table_rows(text: str) -> dict[tuple[str, int], list[str]]:
    """The summary table's rows by (backend, bs): the cells after those two."""
    rows = {}
    for line in text.splitlines():
        cells = line.split()
        if len(cells) == 9 and cells[1].isdigit():
            rows[(cells[0], int(cells[1]))] = cells[2:]
    return rows


def test_cold_column_shows_a_slow_first_request_wherever_it_falls(monkeypatch, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 32, "max_position_embeddings": 2048,
                                                      "model_type": "llama"}))
    monkeypatch.setattr(engine_bench, "_Engine", _FakeEngine)
    out = tmp_path / "out.json"
    backends = ["torch_native", "compiled_attn", "compiled_attn+compile"]
    assert engine_bench.main(["--model-path", str(tmp_path), "--backend", ",".join(backends), "--batch-size", "1,8",
                              "--context", "16", "--decode-steps", str(STEPS), "--rounds", "3",
                              "--json", str(out)]) == 0
    text = capsys.readouterr().out
    summary = json.loads(out.read_text())["summary"]
    rows = _table_rows(text)
    assert set(rows) == {(b, bs) for b in backends for bs in (1, 8)}
    for bs in (1, 8):
        steady = 1.25 + 0.05 * STEPS
        for b in backends:
            s = summary[f"{b} bs={bs}"]
            assert s["steady_request_s"] == pytest.approx(steady)
            assert s["first_decode_s"] / s["median_decode_s"] == pytest.approx(1.0)  # the timed rounds are steady
            assert float(rows[(b, bs)][-1]) == pytest.approx(s["cold_over_steady"], abs=0.01)  # the printed column
        # a compile in the first request's prefill (time to first token): cold >> 1, as the 28.8 s
        compiled = summary[f"compiled_attn+compile bs={bs}"]
        assert compiled["cold_over_steady"] == pytest.approx((28.8 + 0.05 * STEPS) / steady)
        assert compiled["cold_over_steady"] > 10
        assert compiled["cold_first_decode_s"] / compiled["median_decode_s"] == pytest.approx(1.0)  # the old column
        # ... and one in a later decode step
        assert summary[f"compiled_attn bs={bs}"]["cold_over_steady"] == pytest.approx((steady + 5.95) / steady)
        assert summary[f"torch_native bs={bs}"]["cold_over_steady"] == pytest.approx(1.0)
    notes = [ln for ln in text.splitlines() if "the first request took" in ln]
    assert len(notes) == 4  # two slow backends x two batch sizes, each above COLD_FLAG
    assert all(summary[f"{n.split()[1]} {n.split()[2].rstrip(':')}"]["cold_over_steady"] > COLD_FLAG for n in notes)
    assert any("compiled_attn+compile bs=1" in n and "28.80 s to its first token (1.25 s steady)" in n for n in notes)
    assert any("compiled_attn bs=8" in n and "6.15 s decoding (200.0 ms steady)" in n for n in notes)
    assert "cold req: the first request of that batch size" in text
