"""Smoke test of the indexer micro-benchmark script on a tiny hand-made trace (no timing assertions)."""

from __future__ import annotations

import json
import random

from kvmesh_bench.indexer_microbench import Result, SimEngine, format_baseline, main
from kvmesh_router.indexer import KvIndexer
from kvmesh_router.policies import DEFAULT_COST_POLICY


def _tiny_trace(path, rows=60, seed=0):
    rng = random.Random(seed)
    prefixes = [[0, 1, 2], [0, 3], [4, 5, 6, 7]]
    next_id = 100
    with open(path, "w") as f:
        for i in range(rows):
            ids = list(rng.choice(prefixes)) + list(range(next_id, next_id + rng.randrange(1, 5)))
            next_id += 10
            row = {"timestamp": i * 100, "input_length": len(ids) * 16, "output_length": 8, "hash_ids": ids}
            f.write(json.dumps(row) + "\n")


def test_microbench_runs_and_writes_json(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    _tiny_trace(trace)
    out = tmp_path / "figures.json"
    argv = ["--trace", str(trace), "--engines", "2,5", "--block-size", "16", "--engine-capacity-blocks", "12"]
    rc = main([*argv, "--concurrency", "4", "--repeat", "1", "--no-memory", "--busy-thresholds", "off",
               "--json", str(out)])  # fmt: skip
    assert rc == 0
    table = capsys.readouterr().out
    assert "events/s" in table and "decide p99" in table
    figures = json.loads(out.read_text())
    assert [r["engines"] for r in figures["results"]] == [2, 5]
    for r in figures["results"]:
        assert r["requests"] == 60 and r["rejected"] == 0
        assert r["events"] > 0 and r["blocks_removed"] > 0  # the small caches evicted
        assert 0.0 < r["prefix_hit_ratio"] < 1.0


def test_microbench_decides_with_the_daemons_busy_thresholds_and_cost_policy_by_default(tmp_path, capsys):
    """With the router daemon's defaults, engines of 10 blocks are soon over 95 % KV booked: as the daemon
    would, the bench rejects the requests every engine is busy for, and counts them."""
    trace = tmp_path / "trace.jsonl"
    _tiny_trace(trace)
    out = tmp_path / "figures.json"
    argv = ["--trace", str(trace), "--engines", "2", "--block-size", "16", "--engine-capacity-blocks", "10"]
    assert main([*argv, "--concurrency", "4", "--repeat", "1", "--no-memory", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["config"]["cost_policy"] == DEFAULT_COST_POLICY
    (r,) = figures["results"]
    assert r["rejected"] > 0 and r["requests"] + r["rejected"] == 60
    assert "rejected" in capsys.readouterr().out


def test_microbench_rejects_bad_fleet_sizes(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    _tiny_trace(trace, rows=3)
    assert main(["--trace", str(trace), "--engines", "x"]) == 2
    assert main(["--trace", str(trace), "--engines", "0"]) == 2


def test_simulated_engine_events_keep_the_index_in_sync_with_its_cache():
    engine = SimEngine(capacity=6)
    index = KvIndexer(max_entries=None)
    rng = random.Random(3)
    chains = [[1, 2, 3], [1, 2, 4, 5], [9, 8], [1, 7, 7 * 13]]
    for _ in range(50):
        for ev in engine.serve(rng.choice(chains)):
            assert index.apply(1, ev) is None
        assert index.canonical().get(1, frozenset()) == frozenset(engine.cache)


def test_the_dynamo_comparison_shows_the_ratios_and_what_dynamos_thread_hand_off_costs():
    """Dynamo's binding crosses threads on every call, so its rates depend on the host's wake-up cost:
    the report prints, beside the ratios, the context switches per call and the kernel's share of its CPU."""
    ours = Result(engines=1000, requests=4000, policy="kv", events=3406, blocks_stored=73526, blocks_removed=0,
                  events_per_s=100_000.0, find_matches_per_s=200_000.0, find_p50_us=1.7, find_p99_us=21.0,
                  indexer_ops_per_s=150_000.0, decide_p50_us=460.0, decide_p99_us=550.0, decide_raw_p99_us=600.0,
                  decide_max_us=900.0, index_entries=73526, index_blocks=73526, bytes_per_entry=0.0,
                  prefix_hit_ratio=0.28, decision_quality=1.0, rejected=0)  # fmt: skip
    dynamo = {"events_per_s": 25_000.0, "find_matches_per_s": 26_000.0, "find_p50_us": 48.0, "find_p99_us": 55.0,
              "events_refused": 0, "kernel_cpu_share": 0.61, "context_switches_per_call": 2.0}  # fmt: skip
    report = format_baseline([(ours, dynamo)])
    row = next(line for line in report.splitlines() if line.lstrip().startswith("1000"))
    assert " 4.00x" in row and " 7.69x" in row
    assert "1000: 2.0 switches, 61% kernel" in report
