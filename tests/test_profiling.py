"""CPU tests for profiling/: ranges (NVTX + record_function), trace summaries, timers, the nsys script.

The nsys fixtures follow the layout of Nsight Systems' ``nsys stats --report nvtx_sum --format csv`` output
(columns "Time (%)","Total Time (ns)","Instances","Avg (ns)","Med (ns)","Min (ns)","Max (ns)","StdDev (ns)",
"Style","Range"; range names prefixed by the NVTX domain, or by ":"); ``nsys_nvtxppsum_old.csv`` follows the
pre-2023 ``nvtxppsum`` report (Average/Minimum/Maximum, no median, a notice line before the header).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import profiling
from profiling import ranges, summary, timers

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture
def pushes(monkeypatch):
    """Count NVTX pushes/pops by replacing the module's push/pop pair."""
    log = {"push": [], "pop": 0}

    def push(message, color):
        log["push"].append(message)

    def pop():
        log["pop"] += 1

    monkeypatch.setattr(ranges, "nvtx_push", push)
    monkeypatch.setattr(ranges, "nvtx_pop", pop)
    return log


def _workload(steps: int = 3, layers: int = 2) -> None:
    """Nested ranges around a tiny CPU computation, like a decode step over layers."""
    x = torch.randn(64, 64)
    for _ in range(steps):
        with profiling.range("decode_step", bs=2):
            for layer in range(layers):
                with profiling.range("attn", layer=layer):
                    x = torch.tanh(x @ x) * 0.5


def _trace(tmp_path: Path, flag: bool, steps: int = 3) -> Path:
    path = tmp_path / f"trace_{int(flag)}.json"
    with profiling.enabled_ranges(flag):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _workload(steps)
    prof.export_chrome_trace(str(path))
    return path


def _annotations(path: Path) -> list[dict]:
    events = json.loads(path.read_text())["traceEvents"]
    return [e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"]


# ---- ranges ----

def test_message_and_phase():
    assert profiling.format_message("decode", {"layer": 3, "bs": 8, "kv_cap": 2048}) == \
        "decode layer=3 bs=8 kv_cap=2048"
    assert profiling.format_message("plan", {}) == "plan"
    assert profiling.phase_of("decode_step bs=2") == "decode"
    assert profiling.phase_of("capture") == "capture"
    assert ranges.color_of("decode_step") == ranges.PHASE_COLORS["decode"]
    assert ranges.color_of("something_else") == ranges.DEFAULT_COLOR


def test_trace_contains_nested_ranges(tmp_path):
    names = [e["name"] for e in _annotations(_trace(tmp_path, True))]
    assert names.count("decode_step bs=2") == 3
    assert names.count("attn layer=0") == 3
    assert names.count("attn layer=1") == 3


def test_disabled_emits_nothing(tmp_path, pushes):
    assert _annotations(_trace(tmp_path, False)) == []
    assert pushes["push"] == [] and pushes["pop"] == 0
    with profiling.enabled_ranges(False):
        assert profiling.range("a", x=1) is profiling.range("b")  # the shared no-op


def test_enabled_push_count(pushes):
    with profiling.enabled_ranges(True):
        _workload(steps=3, layers=2)
    assert len(pushes["push"]) == 3 * (1 + 2)
    assert pushes["pop"] == len(pushes["push"])
    assert pushes["push"][:3] == ["decode_step bs=2", "attn layer=0", "attn layer=1"]


def test_switch_and_restore():
    before = profiling.enabled()
    with profiling.enabled_ranges(True):
        assert profiling.enabled()
        with profiling.enabled_ranges(False):
            assert not profiling.enabled()
        assert profiling.enabled()
    assert profiling.enabled() == before


def test_env_var_default(monkeypatch):
    for value, expected in [("1", True), ("true", True), ("0", False), ("", False)]:
        monkeypatch.setenv(ranges.ENV_VAR, value)
        assert ranges._env_default() is expected


def test_exception_pops_range(pushes):
    with profiling.enabled_ranges(True), pytest.raises(RuntimeError):
        with profiling.range("fallback", reason="x"):
            raise RuntimeError("boom")
    assert pushes["push"] == ["fallback reason=x"] and pushes["pop"] == 1


def test_decorators_check_switch_per_call(pushes):
    @profiling.ranged("plan", bs=4)
    def plan(x):
        return x + 1

    assert plan(1) == 2 and pushes["push"] == []
    with profiling.enabled_ranges(True):
        assert plan(1) == 2

        @profiling.range("warmup")
        def warm():
            return "ok"

        assert warm() == "ok"
    assert warm() == "ok"  # disabled again: no push
    assert pushes["push"] == ["plan bs=4", "warmup"]
    assert plan.__name__ == "plan"


def test_noop_while_compiling(monkeypatch, pushes):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with profiling.enabled_ranges(True):
        with profiling.range("decode", layer=0):
            pass
    assert pushes["push"] == []


def test_real_nvtx_push_pop_runs():
    """The real nvtx calls work without a tool attached (dummy domain) and nest."""
    ranges.nvtx_push("decode layer=0", ranges.PHASE_COLORS["decode"])
    ranges.nvtx_push("attn layer=0", ranges.PHASE_COLORS["attn"])
    ranges.nvtx_pop()
    ranges.nvtx_pop()


# ---- summaries ----

def test_summarize_torch_trace(tmp_path):
    path = _trace(tmp_path, True, steps=4)
    events = _annotations(path)
    stats = {s.name: s for s in summary.summarize_torch_trace(str(path))}
    for name in ("decode_step bs=2", "attn layer=0", "attn layer=1"):
        durs = [e["dur"] / 1e3 for e in events if e["name"] == name]
        assert stats[name].count == 4
        assert stats[name].total_ms == pytest.approx(sum(durs))
    step = stats["decode_step bs=2"]
    assert step.is_step and step.share == pytest.approx(100.0)
    children = stats["attn layer=0"].total_ms + stats["attn layer=1"].total_ms
    assert children <= step.total_ms
    assert sum(s.share for s in stats.values() if s.is_step) == pytest.approx(100.0)

    grouped = {s.name: s for s in summary.summarize_torch_trace(str(path), group_by="name")}
    assert grouped["attn"].count == 8
    assert grouped["attn"].total_ms == pytest.approx(children)


def test_torch_trace_without_steps_uses_span(tmp_path):
    path = _trace(tmp_path, True)
    stats = summary.summarize_torch_trace(str(path), step_prefixes=("prefill_step",))
    assert stats.reference == "the whole trace span"
    assert all(0 < s.share <= 100.0 for s in stats)


def test_summarize_nsys_csv():
    stats = summary.summarize_nsys_csv(str(FIXTURES / "nsys_nvtx_sum.csv"))
    by = {s.name: s for s in stats}
    assert set(by) == {"decode_step bs=8", "replay bs=8", "capture bs=8", "attn layer=0 bs=8", "attn layer=1 bs=8"}
    step = by["decode_step bs=8"]
    assert (step.count, step.total_ms, step.median_ms) == (10, pytest.approx(50.0), pytest.approx(4.9))
    assert step.share == pytest.approx(100.0) and step.is_step and step.median_exact
    assert by["replay bs=8"].share == pytest.approx(80.0)
    assert by["attn layer=0 bs=8"].median_ms == pytest.approx(0.48)
    assert stats.reference_ms == pytest.approx(50.0)
    assert stats[0].name == "decode_step bs=8"

    grouped = {s.name: s for s in summary.summarize_nsys_csv(str(FIXTURES / "nsys_nvtx_sum.csv"), group_by="name")}
    assert grouped["attn"].count == 20 and grouped["attn"].total_ms == pytest.approx(11.0)
    assert grouped["attn"].share == pytest.approx(22.0) and not grouped["attn"].median_exact


def test_summarize_old_nsys_layout():
    stats = {s.name: s for s in summary.summarize_nsys_csv(str(FIXTURES / "nsys_nvtxppsum_old.csv"))}
    assert stats["decode_step bs=4"].total_ms == pytest.approx(25.0)
    assert stats["attn layer=0 bs=4"].share == pytest.approx(60.0)
    assert stats["attn layer=0 bs=4"].median_ms == pytest.approx(1.5)  # mean stands in for the median


def test_bad_csv_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.csv"
    bad.write_text("SKIPPED: report.nsys-rep does not contain NV Tools Extension (NVTX) data.\n")
    with pytest.raises(ValueError, match="nvtx_sum header"):
        summary.summarize_nsys_csv(str(bad))


def test_cli(tmp_path, capsys):
    assert summary.main([str(FIXTURES / "nsys_nvtx_sum.csv"), "--group-by", "name"]) == 0
    out = capsys.readouterr().out
    assert "decode_step" in out and "share %" in out and "Nested ranges" in out
    assert summary.main([str(_trace(tmp_path, True))]) == 0
    assert "attn layer=0" in capsys.readouterr().out
    assert summary.main([str(tmp_path / "missing.json")]) == 2
    assert summary.main([str(tmp_path / "trace.txt")]) == 2


# ---- timers ----

def test_last_level_cache_bytes(monkeypatch):
    """The largest cache sysfs lists for cpu0 (a positive size), or the default where sysfs cannot be read."""
    from profiling import host

    assert host.last_level_cache_bytes() > 0

    def unreadable(path):
        raise OSError(path)

    monkeypatch.setattr(host.os, "listdir", unreadable)
    assert host.last_level_cache_bytes(default=123) == 123


@pytest.mark.parametrize("n", [3, 4, 5, 6])
def test_balanced_orders_put_every_candidate_after_every_other_equally_often(n):
    """``time_interleaved``'s round orders (a Williams design): each a permutation, and over all of them each
    ordered pair (i right before j, i != j) occurs the same number of times; one order of two, each after the
    other."""
    from collections import Counter

    orders = timers.balanced_orders(n)
    assert all(sorted(o) == list(range(n)) for o in orders)
    pairs = Counter((o[i - 1], o[i]) for o in orders for i in range(1, n))
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1
    assert timers.balanced_orders(2) == [[0, 1]] and timers.balanced_orders(1) == [[0]]


def test_timers_and_tables():
    calls = []
    secs = timers.time_fn(lambda: calls.append(1), warmup=2, iters=5, sync=lambda: None)
    assert len(secs) == 5 and len(calls) == 7 and all(s >= 0 for s in secs)
    assert timers.median([3.0, 1.0, 2.0]) == 2.0
    order = []
    both = timers.time_interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, warmup=1,
                                   iters=3)
    assert order == ["a", "b"] * 4 and {k: len(v) for k, v in both.items()} == {"a": 3, "b": 3}
    with pytest.raises(ValueError, match="iters >= 1"):
        timers.time_interleaved({"a": lambda: None}, warmup=0, iters=0)
    # more than two: each round calls every candidate once, and no candidate always follows the same one
    order.clear()
    four = {n: functools.partial(order.append, n) for n in "abcd"}
    timers.time_interleaved(four, warmup=0, iters=4)
    rounds = [order[i:i + 4] for i in range(0, 16, 4)]
    assert all(sorted(r) == list("abcd") for r in rounds)
    assert {r[r.index("b") - 1] for r in rounds if r.index("b")} == {"a", "c", "d"}
    # a budget smaller than one round still gives 3 rounds; a large one gives iters
    slow = timers.time_interleaved({"a": lambda: time.sleep(0.01)}, warmup=1, iters=50, budget_s=0.001)
    assert len(slow["a"]) == 3
    assert len(timers.time_interleaved({"a": lambda: None}, warmup=1, iters=5, budget_s=10.0)["a"]) == 5
    with pytest.raises(ValueError):
        timers.median([])
    table = timers.LatencyTable("backend", [1, 8], unit="us")
    table.add("eager", 1, 12e-6)
    table.add("compiled_graph", 8, 3.5e-6)
    lines = table.format().splitlines()
    assert lines[0].split() == ["backend", "(us)", "1", "8"]
    assert lines[2].split() == ["eager", "12.00", "-"]
    assert len({len(line) for line in lines[:2]}) == 1
    text = timers.format_table([{"a": "x", "b": 1.0}], ["a", "b"], precision=1)
    assert text.splitlines()[-1].split() == ["x", "1.0"]


def test_range_overhead_ns_shape():
    result = timers.range_overhead_ns(n=200, repeats=1)
    assert set(result) == {"off", "on", "loop"} and all(v > 0 for v in result.values())


# ---- nsys script ----

def test_nsys_script_without_nsys(tmp_path):
    bash = shutil.which("bash")
    assert bash is not None
    bin_dir = tmp_path / "bin"  # PATH holds only bash: certainly no nsys
    bin_dir.mkdir()
    os.symlink(bash, bin_dir / "bash")
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    proc = subprocess.run([bash, str(ROOT / "profiling" / "nsys_session.sh"), "--bs", "8"],
                          env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 3
    assert "nsys not found on PATH" in proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stdout == ""
    assert os.access(ROOT / "profiling" / "nsys_session.sh", os.X_OK)


def _thp_available() -> bool:
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def test_use_huge_pages_sets_the_allocator_switch_and_keeps_a_given_one(monkeypatch):
    from profiling.host import THP_ENV, use_huge_pages

    monkeypatch.setenv(THP_ENV, "0")
    assert use_huge_pages() is False and os.environ[THP_ENV] == "0"  # the user's choice wins
    monkeypatch.delenv(THP_ENV)
    assert use_huge_pages() is _thp_available()
    assert (os.environ.get(THP_ENV) == "1") is _thp_available()


@pytest.mark.skipif(not _thp_available(), reason="transparent huge pages are off on this machine")
def test_huge_pages_back_large_buffers_of_a_fresh_process():
    """PyTorch reads the switch at a process's first allocation: set before any tensor, a 64 MiB buffer is (at
    least partly) on 2 MiB pages; without it none is, where the kernel gives them only to madvised memory."""
    code = ("import sys; from profiling.host import huge_pages_in_use, use_huge_pages\n"
            "on = sys.argv[1] == 'on' and use_huge_pages()\n"
            "import torch; x = torch.ones(16 << 20); print(int(on), huge_pages_in_use())")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = {mode: subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, cwd=ROOT,
                                env=env, check=True).stdout.split() for mode in ("on", "off")}
    assert out["on"][0] == "1" and int(out["on"][1]) >= 2 << 20
    madvise_only = "[madvise]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    assert out["off"][0] == "0" and (out["off"][1] == "0" or not madvise_only)
