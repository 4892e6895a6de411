"""``kvmesh bench mocker-scale``: a small real run, read back from its JSON (the figures its table prints)."""

from __future__ import annotations

import json
from pathlib import Path

from kvmesh_bench import mocker_scale


def test_a_short_run_times_every_pass_and_reports_drift_cpu_and_the_loops_gc_pauses(tmp_path: Path, capsys):
    out = tmp_path / "scale.json"
    argv = ["--engines", "4", "--duration", "1.5", "--warmup", "0.3", "--idle-seconds", "0.3", "--floor-seconds", "0"]
    assert mocker_scale.main([*argv, "--rate", "4", "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["engines"] == 4
    assert result["passes"] > 0 and result["requests"] > 0
    # one pass of the default decode model is ~5.75 ms; each is timed between its delivery points
    assert 5.0 < result["modelled_p50_ms"] < 6.5
    assert 0 <= result["drift_p50_pct"] <= result["drift_p99_pct"]
    assert result["gc_young"] >= 0 and result["gc_young_ms"] >= 0 and result["gc_full"] >= 0
    assert result["idle_cpu_pct"] < 5  # idle engines do not poll
    table = capsys.readouterr().out
    assert "young GC" in table and "drift p99" in table
