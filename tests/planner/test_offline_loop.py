"""The offline loop end to end on a small trace: datagen with a rate profile, then the planner in the replay."""

from __future__ import annotations

import json

import numpy as np
import pytest
from kvmesh_bench.datagen.rate_profile import RateProfile

from tests.support.daemons import run_cli


def write_source(path) -> None:
    """A small Mooncake trace: a shared 2-block system prompt, then unique blocks; ISL ~1-4k, OSL ~50-300."""
    from kvmesh_bench.trace import write_trace

    rng = np.random.default_rng(0)
    rows, next_id = [], 2
    for i in range(400):
        blocks = int(rng.integers(1, 7))
        ids = [0, 1, *range(next_id, next_id + blocks)]
        next_id += blocks
        rows.append(
            {"timestamp": i * 100, "input_length": len(ids) * 512 - 100, "output_length": int(rng.integers(50, 300)),
             "hash_ids": ids}
        )  # fmt: skip
    write_trace(path, rows)


def test_rate_profiles_parse_and_shape_the_arrivals():
    ramp = RateProfile.parse("ramp:1:9:100")
    assert ramp.duration_s == 200 and float(ramp.rate(100)) == 9
    t = ramp.arrivals(100000, seed=1)
    assert abs(t.size - 1000) < 100  # integral of the triangle: (1 + 9) / 2 * 200
    counts, _ = np.histogram(t, bins=[0, 50, 100, 150, 200])
    assert counts[1] > counts[0] and counts[2] > counts[3]
    assert RateProfile.parse("spike:1:10:20:30:100").rate(35) == 10
    assert RateProfile.parse("diurnal:1:3:100:100").rate(50) == pytest.approx(3)
    with pytest.raises(ValueError, match="rate-profile"):
        RateProfile.parse("ramp:1:2")


@pytest.mark.timeout(300)
def test_planner_offline_scales_with_the_load_and_reports_the_figures(tmp_path):
    source = tmp_path / "source.jsonl"
    write_source(source)
    trace = tmp_path / "ramp.jsonl"
    out = run_cli(
        "kvmesh", "datagen", "synthesize", str(source), "-o", str(trace), "--num-requests", "5000",
        "--max-isl", "8192", "--rate-profile", "ramp:0.5:12:60", timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = tmp_path / "sim.json"
    out = run_cli(
        "kvmesh", "bench", "planner-sim", str(trace), "--modes", "sla:kalman,load:latency", "--statics", "1,3",
        "--interval", "5", "--engine-startup-s", "5", "--scale-down-cooldown", "10", "--json", str(report),
        timeout=280,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "planner sla:kalman" in out.stdout and "static 3" in out.stdout
    data = json.loads(report.read_text())
    runs = {r["label"]: r for r in data["runs"]}
    assert set(runs) == {"planner sla:kalman", "planner load:latency", "static 1", "static 3"}
    sla = runs["planner sla:kalman"]
    assert sla["failed"] == 0 and sla["scaling_events"] >= 2
    sizes = [asked for _, _, asked in data["timelines"]["planner sla:kalman"]]
    peak = max(sizes)
    assert peak > 1 and sizes[-1] < peak  # grew with the ramp, shrank after it
    assert runs["static 3"]["engine_seconds"] > sla["engine_seconds"]
    assert all(line.startswith("t=") and "decision" in line for line in data["decisions"]["planner sla:kalman"])
    assert (tmp_path / "sim.png").exists()


@pytest.mark.timeout(300)
def test_planner_offline_scales_prefill_and_decode_pools_deterministically(tmp_path):
    """The disaggregated loop: the planner's pools follow the ramp, and a rerun gives the same figures."""
    source = tmp_path / "source.jsonl"
    write_source(source)
    trace = tmp_path / "ramp.jsonl"
    out = run_cli(
        "kvmesh", "datagen", "synthesize", str(source), "-o", str(trace), "--num-requests", "5000",
        "--max-isl", "8192", "--rate-profile", "ramp:0.5:12:60", timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    reports = []
    for name in ("a.json", "b.json"):
        report = tmp_path / name
        out = run_cli(
            "kvmesh", "bench", "planner-sim", str(trace), "--pools", "prefill,decode", "--modes", "sla:kalman",
            "--statics", "1x1,1x3", "--interval", "5", "--engine-startup-s", "5", "--scale-down-cooldown", "10",
            "--max-num-seqs", "16", "--json", str(report), timeout=280,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        reports.append(json.loads(report.read_text()))
    first, second = reports
    assert "prefill-s" in out.stdout and "static 1P+3D" in out.stdout
    runs = {r["label"]: r for r in first["runs"]}
    assert set(runs) == {"planner sla:kalman", "static 1P+1D", "static 1P+3D"}
    sla = runs["planner sla:kalman"]
    assert sla["failed"] == 0 and sla["scaling_events"] >= 2
    assert sum(sla["pool_engine_seconds"].values()) == pytest.approx(sla["engine_seconds"])
    pools = first["pool_timelines"]["planner sla:kalman"]
    decode = [asked for _, _, asked in pools["decode"]]
    assert max(decode) > 1 and decode[-1] < max(decode)  # the decode pool grew with the ramp and shrank after
    assert all(asked >= 1 for _, _, asked in pools["prefill"])  # within its minimum throughout
    static1, static3 = runs["static 1P+1D"], runs["static 1P+3D"]
    assert static3["pool_engine_seconds"]["decode"] == pytest.approx(3 * static3["pool_engine_seconds"]["prefill"])
    assert static3["sla_attainment"] > static1["sla_attainment"]
    # Same trace, same seed: the same decisions at the same times and the same figures.
    assert first["decisions"] == second["decisions"]
    assert first["runs"] == [dict(r, cpu_s=a["cpu_s"]) for r, a in zip(second["runs"], first["runs"], strict=True)]
