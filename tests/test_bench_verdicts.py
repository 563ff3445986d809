"""``compiled-attn bench``'s default output (issue #49, item 6): one side-by-side table and one verdict line per batch
size (per-step lines only under ``--verbose``), and the verdicts: called on the median of interleaved per-round
ratios and a distribution-free interval of it, "too noisy" only where that interval straddles 1.0 beyond the
same-speed band, and said once."""
import json
import math
import re

import pytest

from compiled_attn.bench import latency as bench
from compiled_attn.bench.verdict import SAME_WITHIN, format_verdicts, judge, median_interval, verdict_phrase

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--model", "tiny-llama", "--batch-size", "1", "2", "--input-len", "8", "--output-len", "4",
        "--cuda-graph-bs", "1", "2", "--no-enable-torch-compile", "--quiet", "--no-malloc-tuning"]


# ---- the interval and the call ----

@pytest.mark.parametrize("n, k", [(3, 1), (5, 1), (6, 1), (9, 2), (21, 6), (60, 22)])
def test_median_interval_is_the_widest_order_statistics_reaching_95_percent(n, k):
    ratios = [float(i) for i in range(n, 0, -1)]  # unsorted on purpose
    lo, hi, cover = median_interval(ratios)
    assert (lo, hi) == (float(k), float(n + 1 - k))
    exact = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n
    assert cover == pytest.approx(exact)
    if n >= 6:  # the next narrower interval would fall below 95%
        assert cover >= 0.95 and 1 - 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n < 0.95
    else:  # no interval reaches 95%: min..max
        assert cover == pytest.approx(1 - 2.0 ** (1 - n))


def test_judge_faster_slower_same_noisy_and_too_few():
    assert judge([1.2, 1.3, 1.25])["call"] == "faster"
    assert judge([1.2, 1.3, 1.25])["every_round"] is True  # 3 rounds: min..max, every round must agree
    assert judge([0.7, 0.8, 0.75, 0.72, 0.79, 0.74])["call"] == "slower"
    same = judge([0.98, 1.01, 1.03, 0.99])
    assert same["call"] == "same" and same["why"] is None
    noisy = judge([0.8, 1.3, 1.1])
    assert noisy["call"] == "too noisy" and noisy["why"] == "rounds 0.80..1.30 straddle 1"
    wide = judge([0.6, 0.8, 0.9, 1.1, 1.2, 1.4, 1.5, 1.7, 0.7])
    assert wide["call"] == "too noisy" and wide["why"].startswith("96% interval 0.70..1.50 straddles 1")
    few = judge([2.0, 2.1])
    assert few["call"] == "not judged" and "too few" in few["why"]
    assert judge([1.0 + SAME_WITHIN / 2] * 3)["call"] == "faster"  # every round above 1: a clear, small gain


def test_one_slow_round_among_many_does_not_make_a_clear_call_noisy():
    """The rule before this one called a comparison too noisy when any round fell on the other side of 1.0 or the
    rounds spanned more than 1.5x: more rounds made that likelier. The median's interval narrows instead."""
    ratios = [1.2] * 10 + [1.25] * 9 + [0.7, 2.4]  # two outlying rounds of 21 (a neighbour's burst)
    call = judge(ratios)
    assert call["call"] == "faster" and call["every_round"] is False
    assert call["interval_lo"] == 1.2 and call["ratio_median"] == 1.2


def test_format_verdicts_one_line_per_batch_size_and_each_noisy_call_once():
    comps = []
    for bs, rs in ((1, [0.8, 1.3, 1.1]), (8, [1.4, 1.5, 1.45])):
        for phase in ("decode", "prefill"):
            comps.append({"bs": bs, "backend": "compiled", "against": "loop", "phase": phase, **judge(rs)})
    text = format_verdicts(comps, [1, 8], busy={1: 0.5, 8: 0.0})
    lines = text.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["verdict bs 1", "verdict bs 8"]
    assert text.count("too noisy") == 2 and lines[0].count("too noisy") == 2  # bs 1's decode and prefill
    assert lines[0].endswith("measured while other processes used 50% of the CPUs")
    assert "decode (3 rounds) compiled 1.45x loop (faster in all 3 rounds)" in lines[1]
    assert verdict_phrase(comps[0]) == "compiled 1.10x loop (too noisy: rounds 0.80..1.30 straddle 1)"
    assert format_verdicts([], [4]).startswith("verdict bs 4: nothing to compare")  # one backend ran


# ---- the command's default output ----

def _verdict_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("verdict bs ")]


def test_default_output_is_one_table_and_one_verdict_per_batch_size(tmp_path, capsys):
    path = tmp_path / "out.json"
    assert bench.main([*TINY, "--json", str(path)]) == 0
    text = capsys.readouterr().out
    report = json.loads(path.read_text())
    # one table: its title once, its header once, a row per backend and batch size
    assert text.count("== side by side") == 1 and text.count("median_decode_ms") == 1
    rows = [ln.split() for ln in text.splitlines() if re.match(r"(loop|eager|compiled) +\d+ ", ln)]
    assert sorted((r[0], int(r[1])) for r in rows) == sorted((b, bs) for b in ("loop", "eager", "compiled")
                                                              for bs in (1, 2))
    # one verdict per batch size, each with every comparison of both phases, from the JSON's comparisons
    verdicts = _verdict_lines(text)
    assert [ln.split(":")[0] for ln in verdicts] == ["verdict bs 1", "verdict bs 2"]
    comps = report["comparisons"]
    assert len(comps) == 2 * 2 * 3  # batch sizes x phases x (compiled/loop, eager/loop, compiled/eager)
    for c in comps:
        line = verdicts[[1, 2].index(c["bs"])]
        assert line.count(verdict_phrase(c)) == 1, (verdict_phrase(c), line)
        assert c["rounds"] == 3 * (3 if c["phase"] == "decode" else 1)  # 3 repeats by default
        assert c["call"] != "not judged"
    # "too noisy" said once per comparison that is, in its verdict, never elsewhere
    assert text.count("too noisy") == sum(c["call"] == "too noisy" for c in comps)
    assert "1 round only" not in text and "round(s) only" not in text
    # the per-step reports, spreads and per-round tables are --verbose only
    for verbose_only in ("Prefill. latency", "Decode 0. (first)", "== spread over", "per-round ratio"):
        assert verbose_only not in text
    assert "token agreement: OK" in text and text.rstrip().splitlines()[-1].startswith("wall time:")


def test_verbose_adds_the_per_step_reports_and_the_spread(capsys):
    assert bench.main([*TINY, "--batch-size", "2", "--repeats", "1", "--verbose"]) == 0
    text = capsys.readouterr().out
    assert text.count("Decode 0. (first)") == 3  # one report per backend
    assert "== spread over 1 repeat(s)" in text and "per-round ratio" in text and "coverage" in text
    assert text.count("== side by side") == 1 and len(_verdict_lines(text)) == 1
    # one prefill round: not judged, and said once per comparison; not called too noisy
    assert "too noisy" not in _verdict_lines(text)[0].split("; prefill")[1]
    assert _verdict_lines(text)[0].count("not judged: 1 round(s) only") == 3
