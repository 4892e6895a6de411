"""The offline P/D replay on the real cores: every request completes, transfers only what decode lacks,
conditional disaggregation takes effect, a slower link costs TTFT, and the run is deterministic."""

from __future__ import annotations

import numpy as np
from kvmesh_bench.replay.disagg import DisaggConfig, run_offline_disagg
from kvmesh_bench.replay.offline import OfflineConfig
from kvmesh_bench.replay.workload import ReplayRequest, TokenMapper


def _requests(n: int = 60) -> list[ReplayRequest]:
    # Conversations: request i extends the hash ids of request i-3 (a shared, growing prefix).
    out = []
    for i in range(n):
        prefix = tuple(range(1000 * (i % 3), 1000 * (i % 3) + 4 + i // 3))
        out.append(ReplayRequest(i, f"r{i}", i * 40.0, len(prefix) * 64, 16, prefix))
    return out


def _run(disagg: DisaggConfig):
    config = OfflineConfig(engines=disagg.prefill_engines + disagg.decode_engines, num_gpu_blocks=4096)
    return run_offline_disagg(_requests(), config, disagg, TokenMapper())


def test_every_request_completes_and_only_missing_blocks_move():
    run = _run(DisaggConfig(1, 2, 100.0))
    assert not run.errors and np.isfinite(run.finish_ms).all()
    meta = run.meta["disagg"]
    assert meta["remote_prefill_fraction"] == 1.0
    assert 0 < meta["transferred_blocks"] < meta["pull_everything_blocks"]  # decode engines reuse prefixes


def test_min_tokens_keeps_prefill_local_and_the_replay_is_deterministic():
    local = _run(DisaggConfig(1, 2, 100.0, min_tokens=1 << 20))
    assert local.meta["disagg"]["remote_prefill_fraction"] == 0.0 and local.meta["disagg"]["transferred_blocks"] == 0
    a, b = _run(DisaggConfig(2, 1, 25.0)), _run(DisaggConfig(2, 1, 25.0))
    assert np.array_equal(a.first_token_ms, b.first_token_ms) and np.array_equal(a.finish_ms, b.finish_ms)


def test_a_slower_link_never_makes_ttft_faster():
    fast, slow = _run(DisaggConfig(1, 2, 400.0)), _run(DisaggConfig(1, 2, 1.0))
    assert np.nanmedian(slow.ttft_ms) > np.nanmedian(fast.ttft_ms)


def test_the_sweep_cli_compares_aggregated_n_with_every_split_of_n(tmp_path):
    """``kvmesh bench disagg-sweep``: one aggregated row per load, then every P+D split of N per bandwidth."""
    import json

    from tests.support.daemons import run_cli

    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": i * 200, "input_length": 1024, "output_length": 8, "hash_ids": [i % 4, 10 + i]}
            for i in range(12)]  # fmt: skip
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "sweep.json"
    done = run_cli("kvmesh", "bench", "disagg-sweep", str(trace), "--engines", "3", "--loads", "1,4",
                   "--gbps", "25,400", "--json", str(out), timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    fleets = [(r["load"], r["fleet"], r["gbps"], r["done"]) for r in json.loads(out.read_text())["rows"]]
    for load in (1.0, 4.0):
        assert (load, "3 agg", "-", 12) in fleets
        for gbps in ("25", "400"):
            assert {(load, f, gbps, 12) for f in ("1P2D", "2P1D")} <= set(fleets)
    assert len(fleets) == 2 * (1 + 2 * 2)
    assert out.with_suffix(".png").stat().st_size > 0
