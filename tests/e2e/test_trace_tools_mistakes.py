"""Trace tools refuse mistakes in one line with exit 2 instead of running something else (issue 16.8).

The CLIs run in-process through their ``main`` (the same code the ``kvmesh`` console script runs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvmesh_bench.datagen.cli import main as datagen_main
from kvmesh_bench.replay.cli import main as replay_main
from kvmesh_bench.replay.compare import main as compare_main
from kvmesh_bench.trace import TraceError, load_trace
from kvmesh_cli.main import main as kvmesh_main

ROW = {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    rows = [{**ROW, "timestamp": i * 10, "hash_ids": [1, 2 + i]} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _refused(capsys: pytest.CaptureFixture[str], code: int, needle: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and needle in err[0], err


@pytest.mark.parametrize(
    ("mode", "needle"),
    [
        ("kv:affinity+backlog_wieght=0.1", "cost policy 'affinity' has no knob 'backlog_wieght' (its knobs: "),
        ("kv:dynamo+backlog_weight=0.1", "cost policy 'dynamo' takes no knobs, got 'backlog_weight'"),
    ],
)
def test_unknown_policy_knobs_are_refused(trace: Path, capsys: pytest.CaptureFixture[str], mode: str, needle: str):
    _refused(capsys, replay_main([str(trace), "--offline", "--router-mode", mode]), needle)


def test_a_known_knob_still_runs(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mode = "kv:affinity+backlog_weight=0.1"
    assert replay_main([str(trace), "--offline", "--engines", "2", "--router-mode", mode]) == 0
    assert "kv:affinity+backlog_weight=0.1" in capsys.readouterr().out


@pytest.mark.parametrize(("model", "needle"), [("foo", "--perf-model foo: unknown perf model 'foo'"),
                                               ("missing.npz", "--perf-model missing.npz: ")])  # fmt: skip
def test_bad_perf_model_is_one_line(trace: Path, capsys: pytest.CaptureFixture[str], model: str, needle: str):
    _refused(capsys, replay_main([str(trace), "--offline", "--perf-model", model]), needle)


def test_seeds_zero_names_the_real_problem(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(capsys, compare_main([str(trace), "--offline", "--seeds", "0"]), "--seeds must be >= 1, got 0")


def test_a_line_cut_short_is_reported_at_its_column(tmp_path: Path) -> None:
    path = tmp_path / "cut.jsonl"
    cut = '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1, 2,'
    path.write_text(json.dumps(ROW) + "\n" + cut + "\n")
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(info.value) == f"{path}:2: invalid JSON: Expecting value (column {len(cut) + 1})"


def test_block_sizes_have_distinct_names(trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bench: --engine-block-size (engine KV block) and --trace-block-size (tokens per hash id)."""
    args = [str(trace), "--offline", "--engines", "2", "--engine-block-size", "16", "--trace-block-size", "300"]
    assert replay_main(args) == 0
    capsys.readouterr()
    out = tmp_path / "missing" / "dir" / "synth.jsonl"  # -o creates its folders, as --json does
    code = kvmesh_main(["datagen", "synthesize", str(trace), "-o", str(out), "--trace-block-size", "300"])
    assert code == 0, capsys.readouterr().err
    assert len(load_trace(out)) == 8
    report = tmp_path / "other" / "a.json"
    assert datagen_main(["datagen", "analyze", str(trace), "--trace-block-size", "300", "--json", str(report)]) == 0
    assert json.loads(report.read_text())
