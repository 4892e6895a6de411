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
