"""``compiled-attn soak`` end to end with a small step count: arrivals and finishes across bucket edges, poisoned
reused slots, float64 checks, no recompiles or fallbacks after warm-up, flat RSS."""
import json

import pytest

from compiled_attn.bench import cli, soak


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-mha", "tiny-mla"])
def test_soak_small_run_is_clean(tmp_path, model, capsys):
    out = tmp_path / "soak.json"
    rc = cli.main(["soak", "--steps", "300", "--model", model, "--seed", "3", "--check-every", "3",
                   "--settle-steps", "100", "--max-context", "64", "--json", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    result = json.loads(out.read_text())
    assert result["steps"] == 300 and result["checked"] == 100
    assert result["mismatches"] == 0 and result["recompiles"] == 0 and result["fallbacks"] == 0
    assert result["max_error"] <= soak.TOL
    assert "mismatches 0" in printed.out and "recompiles after warm-up 0" in printed.out


def test_soak_failures_are_reported():
    base = {"mismatches": 0, "recompiles": 0, "fallbacks": 0, "rss_growth": 0.0}
    assert soak.failures(base, 0.02) == []
    bad = soak.failures(dict(base, mismatches=2, recompiles=1, rss_growth=0.05), 0.02)
    assert bad[:2] == ["2 mismatches", "1 recompiles"] and "RSS grew 5.0%" in bad[2]
