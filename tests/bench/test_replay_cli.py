"""``kvmesh bench replay`` / ``compare`` from the command line: outputs, bad input and exit codes."""

import json

from kvmesh_bench.replay import cli, compare
from kvmesh_bench.trace import TraceRequest, write_trace

from tests.support.etcd import free_port


def small_trace(tmp_path, n=12):
    rows = [TraceRequest(1000 * (i // 3), 300 + 100 * (i % 4), 4, (0, i % 5, 100 + i)) for i in range(n)]
    path = tmp_path / "trace.jsonl"
    write_trace(path, rows)
    return path


def test_offline_replay_prints_the_figures_and_writes_json_and_plots(tmp_path, capsys):
    trace = small_trace(tmp_path)
    out = tmp_path / "out" / "run.json"
    rc = cli.main([str(trace), "--offline", "--engines", "2", "--num-gpu-blocks", "512", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    for column in ("TTFT p50", "TTFT p99", "ITL p50", "E2E p50", "req/s", "out tok/s", "hit rate"):
        assert column in text
    data = json.loads(out.read_text())
    assert data["summary"]["completed"] == 12
    assert 0 < data["summary"]["hit_rate"] < 1
    assert len(data["per_engine"]) == 2
    assert (tmp_path / "out" / "run.png").stat().st_size > 10_000


def test_compare_prints_each_mode_and_its_ratio_to_round_robin(tmp_path, capsys):
    trace = small_trace(tmp_path)
    out = tmp_path / "cmp.json"
    rc = compare.main(
        [str(trace), "--offline", "--engines", "2", "--modes", "kv:dynamo,kv:affinity,round_robin", "--json", str(out)]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "kv:dynamo" in text and "kv:affinity" in text and "/ round_robin" in text
    data = json.loads(out.read_text())
    assert data["baseline"] == "round_robin"
    assert set(data["modes"]) == {"kv:dynamo", "kv:affinity", "round_robin"}
    assert (tmp_path / "cmp_ttft.png").exists()


def test_a_malformed_line_names_its_line_and_exits_2(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
        '{"timestamp": 1, "input_length": -3, "output_length": 2, "hash_ids": [1]}\n'
    )
    assert cli.main([str(path), "--offline"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "bad.jsonl:2:" in err and "input_length" in err


def test_an_empty_trace_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    assert compare.main([str(path), "--offline"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "empty" in err


def test_an_unreachable_frontend_is_one_line_and_exit_2(tmp_path, capsys):
    trace = small_trace(tmp_path)
    port = free_port()  # nothing listens there
    rc = cli.main([str(trace), "--frontend", f"127.0.0.1:{port}", "--connect-timeout", "0.5", "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"127.0.0.1:{port}" in err


def test_bad_modes_and_missing_target_are_rejected(tmp_path, capsys):
    trace = small_trace(tmp_path)
    assert cli.main([str(trace), "--offline", "--router-mode", "fastest"]) == 2
    assert cli.main([str(trace), "--offline", "--router-mode", "kv:nope"]) == 2
    assert cli.main([str(trace), "--offline", "--router-mode", "round_robin:dynamo"]) == 2
    assert cli.main([str(trace)]) == 2  # neither --offline nor --frontend
    assert cli.main([str(trace), "--frontend", "127.0.0.1:1", "--router-mode", "kv:affinity"]) == 2
    errs = capsys.readouterr().err.strip().splitlines()
    assert len(errs) == 5 and all(line.startswith("kvmesh bench replay: error: ") for line in errs)


def test_parse_mode():
    assert cli.parse_mode("kv").label == "kv"
    spec = cli.parse_mode("kv:affinity+backlog_weight=0.05")
    assert (spec.mode, spec.policy, spec.params) == ("kv", "affinity", {"backlog_weight": 0.05})
    assert cli.parse_mode("round_robin").label == "round_robin"


def test_dynamo_baseline_is_skipped_with_a_note_when_dynamo_is_absent(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVMESH_DYNAMO_PYTHON", raising=False)
    trace = small_trace(tmp_path)
    assert cli.main([str(trace), "--offline", "--baseline", "dynamo"]) == 0
    assert "Dynamo baseline skipped" in capsys.readouterr().out
    missing = str(tmp_path / "no-such-python")
    assert cli.main([str(trace), "--offline", "--baseline", "dynamo", "--dynamo-python", missing]) == 0
    assert "cannot import dynamo.replay" in capsys.readouterr().out


def test_dynamo_baseline_needs_offline(tmp_path, capsys):
    assert cli.main([str(small_trace(tmp_path)), "--baseline", "dynamo"]) == 2
    assert "--offline" in capsys.readouterr().err
