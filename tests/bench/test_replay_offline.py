"""The offline simulation's bookkeeping on hand-made traces, checked against figures computed by hand.

Engines use block size 16 and 1000 KV blocks; times follow Dynamo's polynomial perf model (ms):
prefill(T) = 4.209989e-07 T^2 + 0.01518344 T + 16.50142, decode(u) = -25.74 u^2 + 54.01 u + 5.74 with
u = active blocks / 1000.
"""

import gc
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
from kvmesh_bench.replay.offline import OfflineConfig, run_offline
from kvmesh_bench.replay.report import summarize, weighted_percentile
from kvmesh_bench.replay.workload import build_requests
from kvmesh_bench.trace import TraceRequest

BLOCKS = 1000
ROOT = Path(__file__).resolve().parents[2]


def prefill(t):
    return 4.209989e-07 * t * t + 0.01518344 * t + 16.50142


def decode(active_blocks):
    u = active_blocks / BLOCKS
    return -25.74 * u * u + 54.01 * u + 5.74


def simulate(rows, **kw):
    requests, _ = build_requests(rows)
    config = OfflineConfig(engines=2, block_size=16, num_gpu_blocks=BLOCKS, **kw)
    return run_offline(requests, config)


# A: 100 tokens (6 full blocks + 4), 3 output tokens; B: 200 tokens (12 full + 8), 2 output tokens, other
# content; C: 600 tokens starting with A's 100 (same hash id 1), 1 output token, after A has finished.
ROWS = [
    TraceRequest(0, 100, 3, (1,)),
    TraceRequest(0, 200, 2, (7,)),
    TraceRequest(1000, 600, 1, (1, 2)),
]


def test_round_robin_bookkeeping_matches_the_hand_computation():
    run = simulate(ROWS, router_mode="round_robin")
    assert run.engine.tolist() == [0, 1, 0]  # round robin in engine-id order
    assert not run.errors

    # A: one prefill pass, then two decode passes holding 7 blocks (its 101st and 102nd tokens stay in block 7).
    a_ttft = prefill(100)
    a_e2e = a_ttft + 2 * decode(7)
    # B: prefill, then one decode pass with 13 blocks.
    b_ttft = prefill(200)
    b_e2e = b_ttft + decode(13)
    # C: A's 6 full blocks (96 tokens) are cached on engine 0: 504 tokens left to compute; 1 token = done.
    c_ttft = prefill(600 - 96)
    assert run.ttft_ms.tolist() == pytest.approx([a_ttft, b_ttft, c_ttft], rel=1e-9)
    assert run.e2e_ms.tolist() == pytest.approx([a_e2e, b_e2e, c_ttft], rel=1e-9)
    assert run.cached_tokens.tolist() == [0, 0, 96]

    s = summarize(run)
    assert s.hit_rate == pytest.approx(96 / 900)
    # Token gaps: A's two (7-block decode passes), B's one (13 blocks).
    assert s.itl_p50_ms == pytest.approx(decode(7))
    assert s.itl_mean_ms == pytest.approx((2 * decode(7) + decode(13)) / 3)
    assert s.completed == 3 and s.failed == 0
    span_s = (1000 + c_ttft) / 1000
    assert s.requests_per_s == pytest.approx(3 / span_s)
    assert s.output_tokens_per_s == pytest.approx(6 / span_s)
    # Round robin reads no index, so by default the replay keeps none: no router view.
    assert run.meta["router_hit_rate"] is None and run.meta["best_offered_hit_rate"] is None


def _shared_prefix_rows(n: int, seed: int) -> list[TraceRequest]:
    """``n`` requests on a few conversation prefixes, arriving faster than 2 engines of 1000 blocks serve them."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        root = rng.randrange(4)
        ids = (100 * root, *range(100 * root + 1, 100 * root + 1 + rng.randrange(1, 20)), 10_000 + i)
        rows.append(TraceRequest(20 * i, 512 * len(ids) - rng.randrange(512), rng.randrange(1, 40), ids))
    return rows


def test_a_cache_blind_mode_replays_the_same_whether_or_not_the_index_is_fed():
    # Without router_view the replay neither feeds the index nor books block hashes in the slot tracker.
    rows = _shared_prefix_rows(80, seed=5)  # cache hits, evictions and queueing
    for mode in ("round_robin", "random"):
        lean = simulate(rows, router_mode=mode, seed=3)
        viewed = simulate(rows, router_mode=mode, seed=3, router_view=True)
        assert viewed.meta["router_hit_rate"] > 0 and lean.cached_tokens.sum() > 0
        for figure in ("engine", "first_token_ms", "finish_ms", "cached_tokens", "itl_ms", "itl_weight", "load"):
            assert getattr(lean, figure).tolist() == getattr(viewed, figure).tolist(), (mode, figure)
    # With the index fed, the router saw A's blocks on engine 0 through the KV events when it placed C.
    viewed = simulate(ROWS, router_mode="round_robin", router_view=True)
    assert viewed.meta["router_hit_rate"] == pytest.approx(96 / 900)
    assert viewed.meta["best_offered_hit_rate"] == pytest.approx(96 / 900)


_CYCLE_CHECK = """
import gc, sys
from kvmesh_bench.replay.offline import OfflineConfig, run_offline
from kvmesh_bench.replay.workload import build_requests
from tests.bench.test_replay_offline import _shared_prefix_rows

requests, _ = build_requests(_shared_prefix_rows(80, seed=5))
config = OfflineConfig(engines=2, block_size=16, num_gpu_blocks=1000, router_mode=sys.argv[1])
run_offline(requests, config)  # warm-up: first-use imports and caches make cycles of their own
gc.collect()
gc.disable()
run = run_offline(requests, config)
assert run.cached_tokens.sum() > 0
print(gc.collect())
"""


def test_a_replay_leaves_no_cyclic_garbage_and_restores_the_collector():
    # run_offline pauses the cyclic GC while it runs; that loses nothing only while everything it drops is
    # freed by reference counting (here with cache hits, evictions and queueing, in every routing mode).
    # Counted in a fresh interpreter: this one's other tests and threads leave cyclic garbage of their own.
    for mode in ("kv", "round_robin", "random", "power_of_two"):
        done = subprocess.run(
            [sys.executable, "-c", _CYCLE_CHECK, mode], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["0"], (mode, done.stdout)
    gc.disable()
    try:
        simulate(ROWS)
        assert not gc.isenabled()  # a caller's disabled collector stays disabled
    finally:
        gc.enable()
    simulate(ROWS)
    assert gc.isenabled()


def test_kv_routing_follows_the_cached_prefix():
    for policy in ("dynamo", "affinity"):
        run = simulate(ROWS, router_mode="kv", cost_policy=policy)
        assert run.engine[2] == run.engine[0], policy
        assert run.cached_tokens[2] == 96


def test_a_request_arriving_during_a_pass_waits_for_the_next_one():
    # B arrives 5 ms into A's 1000-token prefill on the only engine that round robin gives it.
    rows = [TraceRequest(0, 1000, 1, (1, 3)), TraceRequest(5, 100, 1, (2,))]
    requests, _ = build_requests(rows)
    run = run_offline(requests, OfflineConfig(engines=1, block_size=16, num_gpu_blocks=BLOCKS))
    a_end = prefill(1000)
    assert run.first_token_ms[0] == pytest.approx(a_end)
    assert run.first_token_ms[1] == pytest.approx(a_end + prefill(100))
    assert run.ttft_ms[1] == pytest.approx(a_end + prefill(100) - 5)


def test_quiet_decode_passes_are_skipped_without_changing_the_timing():
    rows = [TraceRequest(0, 40, 50, (1,))]  # 50 tokens: most passes are quiet
    run = simulate(rows, router_mode="round_robin")
    # 40 tokens -> 3 blocks; output tokens 2..50 come from 49 decode passes; blocks grow at 48, 64, 80.
    gaps = []
    tokens = 41  # known after the first token
    for _ in range(49):
        blocks = math.ceil(tokens / 16)  # the pass computes position tokens-1, needing this many blocks
        gaps.append(decode(blocks))
        tokens += 1
    assert run.e2e_ms[0] == pytest.approx(prefill(40) + sum(gaps), rel=1e-9)
    assert run.meta["skipped_quiet_passes"] > 30
    assert run.itl_weight.sum() == 49


def test_weighted_percentile():
    import numpy as np

    v, w = np.array([3.0, 1.0, 2.0]), np.array([1.0, 1.0, 8.0])
    assert weighted_percentile(v, w, 50) == 2.0
    assert weighted_percentile(v, w, 5) == 1.0
    assert weighted_percentile(v, w, 99) == 3.0
    assert math.isnan(weighted_percentile(np.array([]), np.array([]), 50))


def test_the_memoized_prompt_hasher_equals_block_hashes():
    from kvmesh.hashing import block_hashes
    from kvmesh_bench.replay.offline import _PromptHasher
    from kvmesh_bench.replay.workload import TokenMapper

    mapper = TokenMapper(block_tokens=32, vocab_size=100, seed=3)
    for bs in (8, 32, 12):  # 12 does not divide the trace block: no memo, same result
        hasher = _PromptHasher(mapper, bs)
        for ids, length in (((1, 2, 3), 96), ((1, 2, 4), 90), ((1, 2), 64), ((1, 2, 3, 5), 100), ((7,), 5)):
            tokens = mapper.tokens(ids, length)
            assert hasher(ids, tokens) == block_hashes(tokens, bs)
