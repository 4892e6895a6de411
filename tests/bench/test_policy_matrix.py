"""``kvmesh bench policy-matrix``: every trace x load judged candidate vs reference, table and JSON."""

import json

from kvmesh_bench.replay import policy_matrix
from kvmesh_bench.replay.report import Summary
from kvmesh_bench.trace import TraceRequest, write_trace


def small_trace(path, n=16):
    rows = [TraceRequest(500 * (i // 4), 300 + 150 * (i % 5), 6, (0, i % 3, 100 + i)) for i in range(n)]
    write_trace(path, rows)
    return path


def test_the_matrix_has_one_cell_per_trace_and_load_with_a_verdict(tmp_path, capsys):
    a = small_trace(tmp_path / "a.jsonl")
    b = small_trace(tmp_path / "b.jsonl", n=10)
    out = tmp_path / "m.json"
    argv = [str(a), str(b), "--loads", "1,4", "--seeds", "2", "--max-requests", "16", "--json", str(out)]
    assert policy_matrix.main(argv) == 0
    table = capsys.readouterr().out
    assert "kv / kv:dynamo" in table and "cells" in table and "not significantly worse" in table
    data = json.loads(out.read_text())
    cells = data["cells"]
    assert [(c["trace"], c["load"]) for c in cells] == [("a", 1.0), ("a", 4.0), ("b", 1.0), ("b", 4.0)]
    for cell in cells:
        assert set(cell["ratios"]) == {"ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "hit_rate"}
        assert cell["holds"] == (not cell["worse_on"])
        assert set(cell["significantly_worse_on"]) <= set(cell["worse_on"])
        assert set(cell["p_worse"]) == set(cell["ratios"])
    # 2 traces x 2 loads x 2 modes, each with its 2 seeds
    assert len(data["trials"]) == 8 and all(len(t["runs"]) == 2 for t in data["trials"])
    # The same command gives the same figures (every replay is deterministic for its seed), jobs or not.
    again = tmp_path / "again.json"
    assert policy_matrix.main([*argv[:-1], str(again), "--jobs", "2"]) == 0
    assert json.loads(again.read_text())["cells"] == cells


def test_a_cell_holds_only_when_no_figure_is_worse():
    def summary(p50, p99, itl, hit):
        return Summary("x", "offline", 1, 1, 0, p50, p50, p99, p50, itl, itl, itl, 1, 1, 1, 1, hit, "", 1)

    ref = summary(100, 1000, 10, 0.2)
    assert policy_matrix.cell_verdict(summary(90, 1000, 10, 0.2), ref, 0.0)["holds"]
    verdict = policy_matrix.cell_verdict(summary(90, 1010, 10, 0.19), ref, 0.0)
    assert verdict["worse_on"] == ["TTFT p99", "hit"]
    assert policy_matrix.cell_verdict(summary(90, 1010, 10, 0.2), ref, 0.02)["holds"]


def test_a_lost_figure_is_significant_only_when_the_seeds_are_worse_beyond_their_own_scatter():
    """Seeds move a tail figure: a median worse by 2 % may be a draw. A lost figure counts as significantly
    worse only when the candidate's seeds sit above the reference's (one-sided Mann-Whitney, p < 0.05)."""

    def summary(p99, hit=0.2):
        return Summary("x", "offline", 1, 1, 0, 100, 100, p99, 100, 10, 10, 10, 1, 1, 1, 1, hit, "", 1)

    reference = [summary(v) for v in (1000, 1010, 1020, 1030, 1040)]
    interleaved = [summary(v) for v in (1005, 1015, 1025, 1035, 1045)]  # median 1025 against 1020
    above = [summary(v) for v in (1050, 1060, 1070, 1080, 1090)]  # every seed above every reference seed
    for runs, significant in ((interleaved, False), (above, True)):
        p_worse = policy_matrix.worse_p_values(runs, reference)
        verdict = policy_matrix.cell_verdict(runs[2], reference[2], 0.0, p_worse=p_worse)
        assert verdict["worse_on"] == ["TTFT p99"] and not verdict["holds"]
        assert (verdict["significantly_worse_on"] == ["TTFT p99"]) is significant
        assert p_worse["ttft_p50_ms"] == 1.0  # the same value on every seed: nothing to test
    assert policy_matrix.worse_p_values(above, reference)["ttft_p99_ms"] < 0.01
    # The hit rate is worse when lower: a candidate whose every seed hits less is significantly worse there.
    lower_hits = [summary(1000, h) for h in (0.15, 0.16, 0.17, 0.18, 0.19)]
    hits_reference = [summary(1000, h) for h in (0.20, 0.21, 0.22, 0.23, 0.24)]
    assert policy_matrix.worse_p_values(lower_hits, hits_reference)["hit_rate"] < 0.01
    assert policy_matrix.worse_p_values(hits_reference, lower_hits)["hit_rate"] > 0.99


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    trace = small_trace(tmp_path / "a.jsonl")
    assert policy_matrix.main([str(trace), "--candidate", "kv:nope"]) == 2
    assert "unknown cost policy" in capsys.readouterr().err
    assert policy_matrix.main([str(trace), "--candidate", "kv:dynamo"]) == 2
    assert policy_matrix.main([str(tmp_path / "missing.jsonl")]) == 2
