"""Issue #16, the measuring side: ``--contend`` spinners (started, running, always reaped), ``compiled-attn bench``
interleaving backends per round with ``--repeats`` and reporting spreads, ``bench-ops --sweep-len`` with its
physical-bound column, the noise verdict, and the new flags refused in one line."""
import json
import multiprocessing as mp
import os
import time

import pytest
import torch

from compiled_attn.bench import cli, sweep
from compiled_attn.bench import latency as bench
from compiled_attn.bench import ops as bench_ops
from compiled_attn.bench.contend import contend, describe
from compiled_attn.bench.engine import Engine
from profiling.timers import round_ratios, spread

pytestmark = pytest.mark.usefixtures("one_thread")


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# ---- contend ----

@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads CPU time from /proc")
def test_contend_starts_n_spinning_processes_and_reaps_them():
    with contend(2) as procs:
        pids = [p.pid for p in procs]
        assert len(set(pids)) == 2 and all(p.is_alive() for p in procs)
        before = [_cpu_ticks(pid) for pid in pids]
        time.sleep(0.5)
        assert all(_cpu_ticks(pid) > b for pid, b in zip(pids, before, strict=True))  # really spinning
    assert not any(p.is_alive() for p in procs)
    assert all(_gone(pid) for pid in pids)  # joined: not even a zombie is left
    assert not [c for c in mp.active_children() if c.pid in pids]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_contend_stops_spinners_when_the_body_raises(error):
    with pytest.raises(error):
        with contend(2) as procs:
            pids = [p.pid for p in procs]
            assert all(p.is_alive() for p in procs)
            raise error("stop")
    assert all(_gone(pid) for pid in pids)


def test_contend_zero_and_negative():
    with contend(0) as procs:
        assert procs == []
    with pytest.raises(ValueError):
        with contend(-1):
            pass
    assert describe(2).startswith("contention: 2 spinning processes")
    assert describe(0).startswith("contention: none")


# ---- timing helpers ----

def test_round_ratios_and_spread():
    assert round_ratios([2.0, 3.0], [1.0, 2.0]) == [2.0, 1.5]
    assert spread([3.0, 1.0, 2.0]) == (1.0, 2.0, 3.0)
    with pytest.raises(ValueError):
        round_ratios([1.0], [1.0, 2.0])


# ---- compiled-attn bench: interleaved rounds ----

def test_bench_interleaves_backends_and_reports_spread(tmp_path, capsys, monkeypatch):
    calls = []
    admit, decode = Engine.admit, Engine.decode

    def logged_admit(self, *a, **k):
        calls.append(("prefill", self.backend.label.split()[0]))
        return admit(self, *a, **k)

    def logged_decode(self, steps, **k):
        calls.append(("decode", self.backend.label.split()[0]))
        return decode(self, steps, **k)

    monkeypatch.setattr(Engine, "admit", logged_admit)
    monkeypatch.setattr(Engine, "decode", logged_decode)
    path = tmp_path / "out.json"
    rc = bench.main(["--model", "tiny-llama", "--batch-size", "1", "3", "--input-len", "12", "--output-len", "4",
                     "--cuda-graph-bs", "1", "4", "--no-enable-torch-compile", "--repeats", "3", "--contend", "1",
                     "--json", str(path), "--quiet", "--no-malloc-tuning", "--verbose"])
    assert rc == 0
    out = json.loads(path.read_text())
    names = {"loop", "eager", "compiled"}
    # 2 batch sizes x 3 repeats x (1 prefill + 3 decode steps) rounds, each round one call of every backend
    assert len(calls) == 2 * 3 * 4 * 3
    for i in range(0, len(calls), 3):
        kinds = {c[0] for c in calls[i:i + 3]}
        assert len(kinds) == 1 and {c[1] for c in calls[i:i + 3]} == names, calls[i:i + 3]
    assert calls[0][1] != calls[3][1]  # who goes first rotates
    for res in out["backends"].values():
        for r in res["results"].values():
            assert r["repeats"] == 3 and len(r["prefill_latencies_s"]) == 3
            assert [len(rep) for rep in r["decode_latencies_by_repeat_s"]] == [3, 3, 3]
            assert len(r["decode_latencies_s"]) == 3 and r["first_decode_s"] == r["decode_latencies_s"][0]
            assert r["prefill_min_s"] <= r["prefill_latency_s"] <= r["prefill_max_s"]
            assert r["decode_min_s"] <= r["median_decode_s"] <= r["decode_max_s"]
            for phase in ("prefill", "decode"):
                assert r[f"{phase}_x_loop_min"] <= r[f"{phase}_x_loop_median"] <= r[f"{phase}_x_loop_max"]
            assert r["tokens_same_across_repeats"] is True
    assert out["token_agreement"]["ok"] is True
    # eager vs loop, compiled vs loop, compiled vs eager; x 2 phases x 2 batch sizes
    assert len(out["comparisons"]) == 12
    for c in out["comparisons"]:
        assert c["ratio_min"] <= c["interval_lo"] <= c["ratio_median"] <= c["interval_hi"] <= c["ratio_max"]
        assert c["rounds"] == (3 if c["phase"] == "prefill" else 9)
        # the call follows the median's interval (verdict.judge); only a noisy call carries a reason
        expected = ("faster" if c["interval_lo"] > 1 else "slower" if c["interval_hi"] < 1
                    else "same" if 1 / 1.05 <= c["interval_lo"] and c["interval_hi"] <= 1.05 else "too noisy")
        assert c["call"] == expected and (c["noisy"] is None) == (c["call"] != "too noisy")
    text = capsys.readouterr().out
    assert "== spread over 3 repeat(s)" in text and "decode_min" in text and "x_max" in text  # --verbose
    assert "median_decode_ms" in text and "decode_x_loop" in text  # the existing side-by-side columns stay
    assert "contention: 1 spinning process" in text and "token agreement: OK" in text
    verdicts = {int(ln.split(":")[0].split()[-1]): ln for ln in text.splitlines() if ln.startswith("verdict bs ")}
    assert sorted(verdicts) == [1, 3]
    assert text.count("too noisy") == sum(c["call"] == "too noisy" for c in out["comparisons"])
    for c in out["comparisons"]:
        if c["noisy"]:  # said once, with why, in its batch size's verdict line
            phrase = f"{c['backend']} {c['ratio_median']:.2f}x {c['against']} (too noisy: {c['noisy']})"
            assert verdicts[c["bs"]].count(phrase) == 1


# ---- compiled-attn bench-ops --sweep-len ----

def test_sweep_len_rows_agree_with_loop_and_have_the_bound(capsys):
    # bench_case asserts eager and compiled agree with the loop (2e-2) before timing each length
    assert bench_ops.main(["--sweep-len", "64", "200", "--iters", "1", "--contend", "1",
                           "--no-malloc-tuning"]) == 0
    text = capsys.readouterr().out
    assert "compiled_us/1k" in text and "read_us/1k" in text and "contention: 1 spinning process" in text
    assert "served_x" in text
    assert "mla decode" not in text  # --sweep-len alone runs the sweep only
    lines = [ln.split() for ln in text.splitlines()]
    rows = {int(ln[0]): ln for ln in lines if ln and ln[0] in ("64", "200")}
    assert set(rows) == {64, 200}
    for length, cells in rows.items():
        loop_ms, read_ms, loop_per_1k = float(cells[1]), float(cells[4]), float(cells[5])
        assert read_ms > 0
        # loop_ms is printed to 0.01 ms: its rounding (up to 0.005 ms) bounds the agreement at short lengths
        assert loop_per_1k == pytest.approx(loop_ms * 1e3 * 1e3 / length, rel=0.02, abs=0.005e6 / length + 0.02)


def test_sweep_step_detection():
    rows = [{"len": n, "loop_us/1k": 10.0, "eager_us/1k": 10.0, "compiled_us/1k": c}
            for n, c in ((2048, 10.0), (4096, 9.0), (4160, 20.0))]
    assert [(n, a, b, round(r, 2)) for n, a, b, r in sweep.steps(rows)] == [("compiled", 4096, 4160, 2.22)]


def test_sweep_step_is_re_measured_before_it_is_blamed_on_the_code(monkeypatch):
    # the re-measure of 4096 and 4160 is smooth: the step is reported as noise; a step that stays is confirmed
    def smooth(n, **_):
        return {"len": n, "loop_us/1k": 10.0, "eager_us/1k": 10.0, "compiled_us/1k": 10.0}

    monkeypatch.setattr(sweep, "sweep_row", smooth)
    (line,) = sweep._recheck([("compiled", 4096, 4160, 2.22)], iters=1, dtype=torch.float32)
    assert "rises 2.22x from 4096 to 4160" in line and "not reproduced" in line
    monkeypatch.setattr(sweep, "sweep_row", lambda n, **_: {**smooth(n), "compiled_us/1k": 30.0 if n > 4096 else 10})
    (line,) = sweep._recheck([("compiled", 4096, 4160, 2.22)], iters=1, dtype=torch.float32)
    assert "confirmed on re-measure (3.00x)" in line


def test_bench_case_lens_override_and_bound():
    row = bench_ops.bench_case("tiny-mha", 2, "custom", iters=1, dtype=torch.float32, lens=[5, 70], bound=True)
    assert row["tokens"] == 75 and row["read_ms"] > 0
    with pytest.raises(ValueError):
        bench_ops.bench_case("tiny-mha", 2, "custom", iters=1, dtype=torch.float32, lens=[5])


# ---- bad flags ----

@pytest.mark.parametrize("argv,words", [
    (["bench-ops", "--contend", "-1"], "--contend: must be >= 0"),
    (["bench-ops", "--sweep-len", "0"], "--sweep-len: must be >= 1"),
    (["bench", "--repeats", "0"], "--repeats: must be >= 1"),
    (["bench", "--contend", "-1"], "--contend: must be >= 0"),
    (["bench", "--repeats", "x"], "--repeats: expected an int >= 1"),
])
def test_bad_timing_flags_are_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


def test_served_form_follows_the_warm_up_measurement():
    """bench-ops' "served" column: what a DecodeGraphs bucket replays, from the same rule (graphs.faster_form)."""
    import time

    from compiled_attn.bench.ops import served_form
    from graphs.runner import EAGER_MARGIN, faster_form

    def slow():
        time.sleep(0.01)

    def fast():
        pass

    assert served_form(compiled=slow, eager=fast) == "eager"
    assert served_form(compiled=fast, eager=slow) == "compiled"
    # within the margin the compiled step is kept: noise must not flip a bucket to eager
    assert faster_form(1.0, 1.0 - EAGER_MARGIN / 2) == "compiled"
    assert faster_form(1.0, 1.0 - 2 * EAGER_MARGIN) == "eager"
