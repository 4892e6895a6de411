"""Smoke test of the indexer micro-benchmark script on a tiny hand-made trace (no timing assertions)."""

from __future__ import annotations

import json
import random

from kvmesh_bench.indexer_microbench import SimEngine, main
from kvmesh_router.indexer import KvIndexer


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
    rc = main([*argv, "--concurrency", "4", "--repeat", "1", "--no-memory", "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "events/s" in table and "decide p99" in table
    figures = json.loads(out.read_text())
    assert [r["engines"] for r in figures["results"]] == [2, 5]
    for r in figures["results"]:
        assert r["requests"] == 60 and r["events"] > 0 and r["blocks_removed"] > 0  # the small caches evicted
        assert 0.0 < r["prefix_hit_ratio"] < 1.0


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
