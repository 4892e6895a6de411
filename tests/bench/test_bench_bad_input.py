"""A user's mistake on a bench command line is one line and exit 2, before any work: never a traceback.

Each bench command loads a trace and writes JSON; a trace it cannot read, a number out of range or an
output path that cannot be a file is reported as such.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from kvmesh_bench import indexer_microbench, planner_bench, router_bench
from kvmesh_bench.argtypes import output_file, positive_floats
from kvmesh_bench.replay import disagg_sweep

Main = Callable[[Sequence[str] | None], int]
COMMANDS: dict[str, tuple[Main, Callable[[Path], list[str]]]] = {
    "router": (router_bench.main, lambda trace: ["--trace", str(trace), "--grpc-engines", "0"]),
    "indexer": (indexer_microbench.main, lambda trace: ["--trace", str(trace)]),
    "disagg-sweep": (disagg_sweep.main, lambda trace: [str(trace)]),
    "planner-sim": (planner_bench.main, lambda trace: [str(trace)]),
}


def outcome(main: Main, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    return code, capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "cannot read trace: No such file or directory"),
        ('{"timestamp": 0, "input_length": \n', ":1: invalid JSON"),
        ('{"timestamp": 0}\n', ":1:"),
    ],
)
def test_a_trace_that_cannot_be_read_is_one_line_and_exit_2(
    tmp_path: Path, command: str, content: str | None, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    if content is not None:
        trace.write_text(content)
    main, argv = COMMANDS[command]
    code, line = outcome(main, argv(trace), capsys)
    assert code == 2 and f"error: {trace}" in line and says in line, line


@pytest.mark.parametrize(
    ("command", "extra", "says"),
    [
        ("router", ["--max-requests", "-1"], "--max-requests: must be non-negative"),
        ("indexer", ["--max-requests", "0"], "--max-requests: must be at least 1"),
        ("disagg-sweep", ["--loads", "abc"], "--loads: expected comma-separated numbers"),
        ("indexer", ["--json", "."], "--json: '.' is a directory, not a file to write"),
        ("planner-sim", ["--modes", "sla:oracle"], "--modes: unknown planner run 'sla:oracle'"),
        ("planner-sim", ["--ttft-ms", "-1"], "--ttft-ms: must be a positive number"),
    ],
)
def test_a_bad_argument_is_refused_before_the_trace_is_read(
    tmp_path: Path, command: str, extra: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    main, argv = COMMANDS[command]
    code, line = outcome(main, [*argv(tmp_path / "never-read.jsonl"), *extra], capsys)
    assert code == 2 and says in line, line


def test_an_output_file_may_need_new_folders_but_not_be_a_folder_or_under_a_file(tmp_path: Path) -> None:
    assert output_file(str(tmp_path / "new" / "deeper" / "out.json")) == tmp_path / "new" / "deeper" / "out.json"
    (tmp_path / "file").write_text("")
    for bad in (str(tmp_path), str(tmp_path / "file" / "out.json"), ""):
        with pytest.raises(argparse.ArgumentTypeError):
            output_file(bad)


def test_comma_separated_positive_numbers() -> None:
    assert positive_floats("1,2.5, 8") == [1.0, 2.5, 8.0]
    for bad in ("", "0,1", "1,inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_floats(bad)
