"""``kvmesh datagen analyze``: hand-computed statistics, --json, --compare and the CLI's error handling."""

import argparse
import json

import pytest
from kvmesh_bench.datagen.analyze import analyze, compare, format_comparison, prefix_hit_rate
from kvmesh_bench.datagen.cli import main, register
from kvmesh_bench.trace import TraceRequest, write_trace


def req(ts, isl, osl, ids):
    return TraceRequest(ts, isl, osl, tuple(ids))


HAND_MADE = [
    req(0, 1500, 10, [1, 2, 3]),  # 3 misses
    req(0, 1400, 20, [1, 2, 4]),  # 1, 2 hit; 4 misses
    req(1000, 600, 30, [1, 5]),  # 1 hits
    req(3000, 100, 40, [6]),  # miss
]


def test_hit_rate_equals_the_hand_computed_value():
    assert prefix_hit_rate(HAND_MADE) == {"hit_blocks": 3, "blocks": 9, "hit_rate": pytest.approx(3 / 9)}


def test_hit_rate_counts_prefix_paths_not_bare_ids():
    # 2 under 3 is a different prefix than 2 under 1 (a trace that is not a tree still analyzes)
    assert prefix_hit_rate([req(0, 1024, 1, [1, 2]), req(0, 1024, 1, [3, 2])])["hit_rate"] == 0
    # a repeat of the whole prompt hits on every block
    assert prefix_hit_rate([req(0, 1024, 1, [1, 2]), req(0, 1024, 1, [1, 2])])["hit_rate"] == 0.5


def test_analyze_figures_on_a_hand_made_trace():
    report = analyze(HAND_MADE)
    assert report["requests"] == 4
    assert report["isl"]["mean"] == 900 and report["isl"]["min"] == 100 and report["isl"]["max"] == 1500
    assert report["isl"]["p50"] == 1000  # between 600 and 1400
    assert report["osl"]["mean"] == 25
    arrivals = report["arrivals"]
    assert arrivals["span_s"] == 3.0 and arrivals["request_rate_rps"] == 1.0  # 3 gaps over 3 s
    assert arrivals["distinct_timestamps"] == 3
    assert arrivals["inter_arrival_ms"]["mean"] == 1000  # gaps 0, 1000, 2000
    assert arrivals["timestamp_gap_ms"]["mean"] == 1500  # gaps 1000, 2000
    assert arrivals["requests_per_timestamp"]["max"] == 2
    assert report["rows_with_block_count_mismatch"] == 0
    tree = report["prefix_tree"]
    assert tree["core_nodes"] == 2 and tree["core_blocks"] == 2  # 1 and 2 (not merged: 1 also leads to 5)
    assert tree["unique_leaves"] == 4


def test_analyze_reports_a_tree_violation_instead_of_failing():
    report = analyze([req(0, 1024, 1, [1, 2]), req(0, 1024, 1, [3, 2])])
    assert "hash id 2 has 2 parents" in report["prefix_tree"]["error"]


def test_compare_gives_relative_differences():
    base = analyze(HAND_MADE)
    doubled = analyze([req(r.timestamp_ms, r.input_length * 2, r.output_length, r.hash_ids) for r in HAND_MADE])
    rows = {row["metric"]: row for row in compare(doubled, base)}
    assert rows["ISL mean"]["relative_diff"] == pytest.approx(1.0)
    assert rows["OSL mean"]["relative_diff"] == 0
    assert rows["hit rate"]["trace"] == rows["hit rate"]["source"]
    # a source value of 0 (or none: a single timestamp has no rate) gives no relative difference
    burst = analyze([req(0, r.input_length, r.output_length, r.hash_ids) for r in HAND_MADE])
    rows = {row["metric"]: row for row in compare(base, burst)}
    assert burst["arrivals"]["request_rate_rps"] is None
    assert rows["request rate (req/s)"]["relative_diff"] is None
    assert rows["inter-arrival mean (ms)"]["relative_diff"] is None
    # equal figures match, zero included
    same = {row["metric"]: row for row in compare(burst, burst)}["inter-arrival mean (ms)"]
    assert same["source"] == 0 and same["relative_diff"] == 0 and same["within_tolerance"]


def test_register_adds_datagen_to_an_umbrella_cli(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, HAND_MADE)
    parser = argparse.ArgumentParser(prog="kvmesh")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["datagen", "analyze", str(trace)])
    assert args.func(args) == 0
    assert "prefix hit rate         33.33%" in capsys.readouterr().out


def test_cli_analyze_json_and_compare(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, HAND_MADE)
    figures = tmp_path / "figures.json"
    assert main(["datagen", "analyze", str(trace), "--json", str(figures)]) == 0
    data = json.loads(figures.read_text())
    assert data["cache"]["hit_rate"] == pytest.approx(1 / 3)
    assert data["isl"]["p99"] == pytest.approx(1497.0)

    other = tmp_path / "other.jsonl"
    write_trace(other, HAND_MADE[:3])
    out_json = tmp_path / "cmp.json"
    capsys.readouterr()
    assert main(["datagen", "analyze", str(other), "--compare", str(trace), "--json", str(out_json)]) == 0
    table = capsys.readouterr().out
    assert "ISL mean" in table and "rel. diff" in table and "hit rate" in table
    comparison = json.loads(out_json.read_text())["comparison"]
    requests = next(row for row in comparison if row["metric"] == "requests")
    assert requests == {
        "metric": "requests",
        "trace": 3,
        "source": 4,
        "relative_diff": -0.25,
        "within_tolerance": False,  # 25 % off, above the 10 % a synthesized trace is held to
    }


def test_cli_empty_trace_is_one_line_and_exit_2(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["datagen", "analyze", str(empty)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err == f"kvmesh datagen analyze: error: {empty}: the trace is empty (no requests)\n"


def test_a_figure_with_no_sample_is_na_not_zero(tmp_path, capsys):
    """One request has no inter-arrival gap: its statistics are n/a (JSON null), not a measured 0 ms."""
    one = tmp_path / "one.jsonl"
    write_trace(one, [req(0, 100, 5, [1])])
    out = tmp_path / "one.json"
    assert main(["datagen", "analyze", str(one), "--block-size", "100", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    gaps = next(line for line in text.splitlines() if "inter-arrival" in line)
    assert gaps.split()[2:] == ["mean", "n/a", "p50", "n/a", "p90", "n/a", "p99", "n/a", "min", "n/a", "max", "n/a"]
    arrivals = json.loads(out.read_text())["arrivals"]
    assert arrivals["inter_arrival_ms"] == {"count": 0, **dict.fromkeys(["mean", "p50", "p90", "p99", "min", "max"])}


def test_cli_malformed_line_names_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n{"timestamp": 0}\n')
    assert main(["datagen", "analyze", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvmesh datagen analyze: error: {bad}:2: missing fields 'input_length'")
    assert err.count("\n") == 1


def test_cli_missing_file_exit_2(tmp_path, capsys):
    assert main(["datagen", "analyze", str(tmp_path / "nope.jsonl")]) == 2
    assert "cannot read trace" in capsys.readouterr().err


def test_compare_reports_quantiles_rank_correlations_and_the_replayed_load(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, HAND_MADE)
    out_json = tmp_path / "cmp.json"
    assert main(["datagen", "analyze", str(trace), "--compare", str(trace), "--json", str(out_json)]) == 0
    table = capsys.readouterr().out
    rows = {row["metric"]: row for row in json.loads(out_json.read_text())["comparison"]}
    for metric in ("ISL p90", "OSL p90", "ISL-OSL rank corr.", "ISL-shared-prefix corr."):
        assert metric in rows and metric in table
    # Both traces replayed offline: round robin and the default policy, arrivals x1 and x6.
    for mode in ("round_robin", "kv"):
        for load in ("x1", "x6"):
            for figure in ("TTFT p50 (ms)", "TTFT p99 (ms)", "hit rate"):
                row = rows[f"replay {mode} {load} {figure}"]
                assert row["trace"] == row["source"] and row["trace"] is not None  # the same trace, deterministic
    capsys.readouterr()
    assert main(["datagen", "analyze", str(trace), "--compare", str(trace), "--replay-requests", "0"]) == 0
    assert "replay" not in capsys.readouterr().out


def test_replay_shuffles_give_the_source_range_under_reordering_within_a_timestamp(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, HAND_MADE)
    out_json = tmp_path / "cmp.json"
    argv = [
        "datagen",
        "analyze",
        str(trace),
        "--compare",
        str(trace),
        "--replay-shuffles",
        "2",
        "--json",
        str(out_json),
    ]
    assert main(argv) == 0
    assert "source, reordered within stamps" in capsys.readouterr().out
    data = json.loads(out_json.read_text())
    rows = {row["metric"]: row for row in data["comparison"]}
    row = rows["replay round_robin x6 TTFT p99 (ms)"]
    orders = [data["source"]["replay"], *data["source"]["replay_reordered"]]
    assert len(orders) == 3
    samples = sorted(replays["round_robin x6"]["ttft_p99_ms"] for replays in orders)
    assert row["source"] == samples[1]  # the median of the source's three orders
    assert row["source_range"] == [samples[0], samples[2]]


def test_several_traces_are_compared_by_their_medians_with_their_range(tmp_path, capsys):
    """Synthesized copies differ seed to seed: their median is what is held to the source, and their spread
    is shown beside it."""
    source = tmp_path / "source.jsonl"
    write_trace(source, HAND_MADE)
    copies = []
    for scale in (0.8, 1.0, 1.5):  # ISL mean of the copies: 0.8x, 1x and 1.5x the source's
        path = tmp_path / f"copy{scale}.jsonl"
        write_trace(
            path, [req(r.timestamp_ms, int(r.input_length * scale), r.output_length, r.hash_ids) for r in HAND_MADE]
        )
        copies.append(str(path))
    out_json = tmp_path / "cmp.json"
    argv = ["datagen", "analyze", *copies, "--compare", str(source), "--replay-requests", "0", "--json", str(out_json)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "traces, min - max" in table and "3 traces" in table
    data = json.loads(out_json.read_text())
    assert len(data["traces"]) == 3
    isl = next(row for row in data["comparison"] if row["metric"] == "ISL mean")
    assert isl["trace"] == isl["source"] == 900.0  # the 1x copy is the median
    assert isl["relative_diff"] == 0 and isl["within_tolerance"]
    assert isl["trace_range"] == [720.0, 1350.0]


def test_several_traces_without_compare_are_analyzed_one_after_the_other(tmp_path, capsys):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_trace(first, HAND_MADE)
    write_trace(second, HAND_MADE[:2])
    assert main(["datagen", "analyze", str(first), str(second)]) == 0
    out = capsys.readouterr().out
    assert f"{first}: 4 requests" in out and f"{second}: 2 requests" in out


def test_replayed_figures_say_whether_the_traces_differ_beyond_the_sources_reordering_noise(capsys):
    """A replayed figure can move by more than the 10 % tolerance from one order of the same requests to the
    next. With several traces and several source orders, each replay row also carries a Mann-Whitney p-value:
    small when every trace replays apart from every source order, 1 when the two samples interleave evenly."""

    def report(p99: float) -> dict[str, object]:
        return {"replay": {"round_robin x6": {"ttft_p50_ms": 100.0, "ttft_p99_ms": p99, "hit_rate": 0.07}}}

    source = {**report(9000.0), "replay_reordered": [report(v)["replay"] for v in (7000.0, 8000.0, 10000.0, 11000.0)]}
    apart = {row["metric"]: row for row in compare([report(v) for v in (20000, 21000, 22000, 23000, 24000)], source)}
    p99 = apart["replay round_robin x6 TTFT p99 (ms)"]
    assert p99["p_value"] < 0.05 and not p99["within_tolerance"]
    assert apart["replay round_robin x6 hit rate"]["p_value"] == 1.0  # the same value on both sides

    mixed = compare([report(v) for v in (6500, 8500, 9000, 9500, 11500)], source)
    p99 = next(row for row in mixed if row["metric"] == "replay round_robin x6 TTFT p99 (ms)")
    assert p99["p_value"] == 1.0 and p99["within_tolerance"]
    table = format_comparison(mixed, "5 traces", "source")
    assert "Mann-Whitney" in table
    assert table.splitlines()[-2].split()[-1] == "1.00"  # the p99 row's p column
    assert "p_value" not in compare(report(9000.0), source)[-1]  # one trace: no sample to test
