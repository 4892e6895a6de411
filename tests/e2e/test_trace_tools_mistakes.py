"""Trace tools refuse mistakes in one line with exit 2 instead of running something else (issue 16.8).

The CLIs run in-process through their ``main`` (the same code the ``kvmesh`` console script runs).
"""

from __future__ import annotations

import json
from collections.abc import Callable
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


def _exit_code(main: Callable[[list[str]], int], argv: list[str]) -> int:
    """``main``'s exit code, whether it returns it or its argument parser exits with it."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.mark.parametrize(
    ("mode", "needle"),
    [
        ("kv:affinity+backlog_wieght=0.1", "cost policy 'affinity' has no knob 'backlog_wieght' (its knobs: "),
        ("kv:dynamo+backlog_weight=0.1", "cost policy 'dynamo' takes no knobs, got 'backlog_weight'"),
    ],
)
def test_unknown_policy_knobs_are_refused(trace: Path, capsys: pytest.CaptureFixture[str], mode: str, needle: str):
    _refused(capsys, replay_main([str(trace), "--offline", "--router-mode", mode]), needle)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--router-mode", "kv:affinity+decode_weight=-1"], "policy parameter decode_weight must be in [0, 1e+06]"),
        (["--router-mode", "kv:affinity+near_tie=nan"], "policy parameter near_tie must be in [0, 1e+06]"),
        (["--overlap-weight", "2e6"], "--overlap-weight: overlap_score_weight must be in [0, 1e+06]"),
        (["--vocab-size", "3000000000"], "--vocab-size 3000000000: at most 2147483648"),
        (["--duration", "1"], "--duration bounds a live replay"),
    ],
)
def test_values_the_router_or_the_simulation_would_refuse_are_refused_before_the_run(
    trace: Path, capsys: pytest.CaptureFixture[str], flags: list[str], needle: str
) -> None:
    _refused(capsys, _exit_code(replay_main, [str(trace), "--offline", *flags]), needle)


def test_an_output_the_run_could_not_write_is_refused_before_it(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "out.png").mkdir()  # where the plot beside --json out.json would go
    code = replay_main([str(trace), "--offline", "--json", str(tmp_path / "out.json")])
    _refused(capsys, code, "the plot beside --json: ")
    assert not (tmp_path / "out.json").exists()


def test_prompts_cut_by_too_few_hash_ids_are_said(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """600 tokens in 2 hash ids need blocks of 300: at 16 tokens a block the prompts are 32 tokens."""
    assert replay_main([str(trace), "--offline", "--engines", "2", "--trace-block-size", "16", "--no-plot"]) == 0
    err = capsys.readouterr().err
    assert "note: 8 of 8 rows have fewer hash_ids than input_length needs at --trace-block-size 16" in err


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


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        # Tracebacks from inside the simulation, once (cost.py, numpy's default_rng, the engine config):
        (["--overlap-weight", "nan"], "argument --overlap-weight: must be a finite number, 0 or more, got nan"),
        (["--temperature", "-1"], "argument --temperature: must be a finite number, 0 or more, got -1"),
        (["--seed", "-1"], "argument --seed: must be non-negative, got -1"),
        (["--vocab-size", "1"], "--vocab-size 1: eos_token_id=2 outside vocabulary [0, 1)"),
        # A P/D fleet of one pool ran labelled "-1P2D" or "0P-2D" and failed every request; P/D flags
        # without a P/D fleet were silently ignored.
        (["--prefill-engines", "3"], "a P/D fleet needs both --prefill-engines and --decode-engines"),
        (["--kv-transfer-gbps", "1"], "--kv-transfer-gbps apply to a P/D fleet: give --prefill-engines and"),
        # Refused at once, not after the run (the results lost to a traceback), nor written under a name
        # matplotlib made up.
        (["--json", "/proc/x.json"], "argument --json: cannot write /proc/x.json"),
        (["--plot", "plot-without-suffix"], "argument --plot: 'plot-without-suffix': a PNG file's name ends in .png"),
    ],
)
def test_replay_flags_that_cannot_work_are_one_line(
    trace: Path, capsys: pytest.CaptureFixture[str], flags: list[str], needle: str
) -> None:
    _refused(capsys, _exit_code(replay_main, [str(trace), "--offline", "--engines", "2", *flags]), needle)


def test_a_figure_of_nothing_is_null_in_the_json(trace: Path, tmp_path: Path, capsys) -> None:
    """Every request failed (2 KV blocks hold none): per-engine percentiles of nothing were NaN, which is
    no JSON; a strict parser refused the file."""
    out = tmp_path / "r.json"
    args = [str(trace), "--offline", "--engines", "2", "--num-gpu-blocks", "2", "--json", str(out), "--no-plot"]
    assert replay_main(args) == 0
    figures = json.loads(out.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert any(engine["ttft_p50_ms"] is None for engine in figures["per_engine"])


def test_compare_with_no_plot_writes_no_png(trace: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "c.json"
    args = [str(trace), "--offline", "--engines", "2", "--modes", "kv,round_robin", "--json", str(out), "--no-plot"]
    assert compare_main(args) == 0
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize(
    ("profile", "needle"),
    [
        ("ramp:0:0:10", "its rates are all 0: no request would arrive"),  # an empty trace, every tool refused
        ("points:0=nan,10=1", "needs increasing finite times and finite non-negative rates"),
        ("points:0=inf,10=1", "needs increasing finite times"),  # every timestamp became 0
        ("ramp:1:5:1e9", "at most 604800 s (a week) of arrivals"),  # 298 GiB of arrival grid
    ],
)
def test_a_rate_profile_that_cannot_work_is_one_line(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], profile: str, needle: str
) -> None:
    code = kvmesh_main(
        ["datagen", "synthesize", str(trace), "-o", str(tmp_path / "s.jsonl"), "--rate-profile", profile]
    )
    _refused(capsys, code, needle)


def test_a_speedup_ratio_with_a_rate_profile_is_refused_not_ignored(trace: Path, tmp_path: Path, capsys) -> None:
    args = ["datagen", "synthesize", str(trace), "-o", str(tmp_path / "s.jsonl"), "--rate-profile", "ramp:1:5:10"]
    _refused(capsys, kvmesh_main([*args, "--speedup-ratio", "100"]), "--speedup-ratio and --rate-profile do not go")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["bench", "planner-sim", "{trace}", "--interval", "0"],
            "argument --interval: must be a positive number",
        ),  # hung
        (["bench", "planner-sim", "{trace}", "--min-engines", "5", "--max-engines", "2"], "--min-engines must not"),
        (
            ["bench", "policy-matrix", "{trace}", "--tolerance", "nan"],
            "argument --tolerance: must be a finite",
        ),  # all held
        (["bench", "indexer", "--trace", "{trace}", "--block-size", "0"], "argument --block-size: must be at least 1"),
    ],
)
def test_bench_numbers_that_cannot_work_are_one_line(
    trace: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    _refused(capsys, _exit_code(kvmesh_main, [a.format(trace=trace) for a in argv]), needle)


def test_an_unknown_flag_without_a_command_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    """It read "the following arguments are required: command", as if the flag were fine."""
    _refused(capsys, _exit_code(kvmesh_main, ["--bogus"]), "kvmesh: error: unrecognized arguments: --bogus")
