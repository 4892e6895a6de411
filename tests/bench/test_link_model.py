"""The capped link's model: a token bucket lets a burst through at once, then charges every byte at the rate,
first come first served; a request's delay grows with its size and with the requests queued before it, and
``kvmesh bench multihost-replay`` judges the capped link's row against offline shifted by those delays."""

import numpy as np
import pytest
from kvmesh_bench import link_conditions, multihost_replay
from kvmesh_bench.link_model import MSS, SEGMENT_OVERHEAD, TokenBucket, capped_link_delays, wire_bytes
from kvmesh_bench.replay.report import summarize
from kvmesh_bench.replay.workload import ReplayRequest, TokenMapper

RATE = 1_000_000  # bytes/s: 1000 bytes per ms


def test_a_message_within_the_burst_leaves_at_once():
    link = TokenBucket(RATE, burst_bytes=4000)
    assert link.send(5.0, 3000) == 5.0
    assert link.send(5.0, 1000) == 5.0  # the bucket had exactly 1000 left
    assert link.peak_backlog_bytes <= 0


def test_a_message_beyond_the_burst_pays_the_rest_at_the_rate():
    link = TokenBucket(RATE, burst_bytes=1000)
    assert link.send(0.0, 3000) == pytest.approx(2.0)  # 1000 from the bucket, 2000 at 1000 bytes/ms
    assert link.peak_backlog_bytes == pytest.approx(2000)


def test_messages_queue_behind_each_other_first_come_first_served():
    link = TokenBucket(RATE, burst_bytes=0)
    assert link.send(0.0, 2000) == pytest.approx(2.0)
    assert link.send(0.5, 2000) == pytest.approx(4.0)  # waits for the first, then pays its own
    assert link.peak_backlog_bytes == pytest.approx(1500 + 2000)  # what was left of the first, and itself


def test_an_idle_link_refills_its_bucket_but_never_beyond_the_burst():
    link = TokenBucket(RATE, burst_bytes=1000)
    assert link.send(0.0, 1000) == 0.0  # empties the bucket
    assert link.send(0.5, 1000) == pytest.approx(1.0)  # 500 refilled, 500 more at the rate
    assert link.send(100.0, 1000) == 100.0  # a long idle refills it, to 1000 only:
    assert link.send(100.0, 500) == pytest.approx(100.5)


def test_wire_bytes_add_grpc_framing_and_headers_per_segment():
    framing = wire_bytes(0) - SEGMENT_OVERHEAD
    assert framing > 0  # gRPC's length prefix and an HTTP/2 frame header
    one_segment = MSS - framing
    assert wire_bytes(one_segment) == MSS + SEGMENT_OVERHEAD
    assert wire_bytes(one_segment + 1) == MSS + 1 + 2 * SEGMENT_OVERHEAD


def _requests(*arrivals_and_lengths: tuple[float, int]) -> list[ReplayRequest]:
    return [
        ReplayRequest(i, f"r{i}", arrival, length, 8, tuple(range(100 * i, 100 * i + 64)))
        for i, (arrival, length) in enumerate(arrivals_and_lengths)
    ]


def _delays(requests: list[ReplayRequest], rate_mbit: float = 20.0, burst: int = 0) -> list[float]:
    mapper = TokenMapper(block_tokens=512, seed=0)
    return capped_link_delays(
        requests, mapper, rate_mbit=rate_mbit, burst_bytes=burst, block_size=16
    ).to_worker_ms.tolist()


def test_a_lone_request_pays_its_three_messages_at_the_rate():
    (alone,) = _delays(_requests((0.0, 8192)))
    # In: 8192 int32 ids (32 KiB). Out: 512 block hashes (~9-10 bytes each as varints), then 8192 ids as
    # varints (1-2 bytes each below the mapper's 2048-token vocabulary). With headers, ~55 KB in all.
    assert 50_000 / 2500 < alone < 65_000 / 2500  # 20 Mbit/s = 2500 bytes/ms
    (half_rate,) = _delays(_requests((0.0, 8192)), rate_mbit=10.0)
    assert half_rate == pytest.approx(2 * alone)
    (with_burst,) = _delays(_requests((0.0, 8192)), burst=32 * 1024)
    assert alone - 2 * 32 * 1024 / 2500 <= with_burst < alone  # a full bucket each way pays for up to 32 KiB
    assert _delays(_requests((0.0, 8192)), burst=1 << 20) == [0.0]  # and for all of it, when big enough


def test_requests_sent_together_queue_and_a_later_one_does_not_wait_for_them():
    (alone,) = _delays(_requests((0.0, 8192)))
    burst = _delays(_requests((0.0, 8192), (0.0, 8192), (0.0, 8192), (10_000.0, 8192)))
    assert burst[0] < burst[1] < burst[2]  # each waits behind the ones sent before it
    assert burst[2] > 2 * alone
    assert burst[3] == pytest.approx(alone, rel=0.01)  # the link had drained long before it


def test_multihost_replay_judges_the_cap_against_offline_with_each_request_delayed_by_the_link(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVMESH_LINK_BACKEND", "fallback")  # tbf's burst, and no namespace probe
    # Four rounds of three 8k-token prompts sent together, one round every 5 s: the three engines are
    # free for each round, so every request's TTFT offline is the same prefill, while on the capped link
    # the three prompts queue behind each other.
    requests = _requests(*[(5000.0 * k, 8192) for k in range(4) for _ in range(3)])
    offline = summarize(multihost_replay._offline(requests, seed=0))
    capped = multihost_replay._offline_through_cap(requests, seed=0, live_seed=1, rate_mbit=20.0)
    unbounded = multihost_replay._offline_through_cap(requests, seed=0, live_seed=1, rate_mbit=1e7)
    burst = link_conditions.rate_burst_bytes(20.0)
    link = capped_link_delays(requests, TokenMapper(seed=1), rate_mbit=20.0, burst_bytes=burst, block_size=16)
    delays = link.to_worker_ms
    assert capped.completed == offline.completed == len(requests)
    assert offline.ttft_p50_ms == pytest.approx(offline.ttft_p99_ms, abs=0.5)  # idle engines: one prefill time
    # TTFT is still counted from the client's send: offline's plus the link's delay, request by request.
    assert capped.ttft_p50_ms == pytest.approx(offline.ttft_p50_ms + float(np.median(delays)), abs=0.5)
    assert capped.ttft_p99_ms == pytest.approx(offline.ttft_p50_ms + float(np.percentile(delays, 99)), abs=0.5)
    assert np.median(delays) > 10  # the second prompt of a round waits for the first
    assert unbounded.ttft_p50_ms == pytest.approx(offline.ttft_p50_ms, abs=0.5)  # a link with room costs nothing
