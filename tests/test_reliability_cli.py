"""Issue #12, command line: every flag of bench, bench-ops, bench-step, soak and profile-summary is checked before
any work starts; a bad one is one line ``prog: error: ...`` and exit status 2 (never a traceback, never after a
long run)."""
import json
import time

import pytest
import torch

from compiled_attn.bench import cli
from profiling import summary


def _refused(argv, capsys, words):
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert time.perf_counter() - start < 5  # refused before compiling anything
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"compiled-attn {argv[0]}: error:" in err, err
    assert words in err, err


@pytest.mark.parametrize("argv,words", [
    (["bench-ops", "--iters", "0"], "--iters: must be >= 1"),
    (["bench-ops", "--batch-size", "0"], "--batch-size: must be >= 1"),
    (["bench-ops", "--iters", "x"], "expected an int >= 1"),
    (["bench-step", "--iters", "0"], "--iters: must be >= 1"),
    (["bench-step", "--cuda-graph-bs", "0"], "--cuda-graph-bs: must be >= 1"),
    (["bench-step", "--layers", "-1"], "--layers: must be >= 1"),
    (["bench-step", "--device", "bogus"], "--device must be cpu or cuda"),
    (["bench-step", "--json", "/nonexistent/x.json"], "folder '/nonexistent' does not exist"),
    (["bench-step", "--artifacts", "/nonexistent/a.bin"], "--artifacts"),
    (["bench", "--cuda-graph-bs", "0"], "--cuda-graph-bs values must be >= 1"),
    (["bench", "--device", "bogus"], "--device must be cpu or cuda"),
    (["bench", "--json", "/nonexistent/x.json"], "folder '/nonexistent' does not exist"),
    (["bench", "--json", "/"], "is a directory"),
    (["soak", "--steps", "0"], "--steps: must be >= 1"),
    (["soak", "--check-every", "0"], "--check-every: must be >= 1"),
    (["soak", "--model", "gpt"], "invalid choice"),
    (["soak", "--json", "/nonexistent/x.json"], "does not exist"),
    (["soak", "--max-seconds", "nan"], "--max-seconds must be a finite number > 0"),
])
def test_bad_flag_is_one_line_before_any_work(argv, words, capsys):
    _refused(argv, capsys, words)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only build")
@pytest.mark.parametrize("command", ["bench", "bench-step"])
def test_cuda_device_on_cpu_build(command, capsys):
    _refused([command, "--device", "cuda"], capsys, "no CUDA device is available")


@pytest.mark.parametrize("content,words", [
    ([1, 2], "event 0 is a int"),
    ({"traceEvents": {"a": 1}}, "expected an object with a 'traceEvents' list"),
    ({"traceEvents": [{"ph": "X", "ts": "abc", "dur": 1, "name": "x"}]}, "non-numeric 'ts'"),
    ({"traceEvents": [{"ph": "X", "ts": 1, "dur": None, "name": "x"}]}, "non-numeric 'dur'"),
])
def test_profile_summary_bad_trace_is_one_line(tmp_path, capsys, content, words):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(content))
    assert summary.main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("profile-summary: error:") and words in err, err


def test_profile_summary_bad_match_regex(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(SystemExit) as exc:
        summary.main([str(path), "--match", "("])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a valid regular expression" in err, err
    with pytest.raises(ValueError, match="--match"):
        summary.summarize_torch_trace(str(path), match="[")
