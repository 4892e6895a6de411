"""Issue 14 item 6, as a spec: a dead multi-engine worker costs no client a failure.

Real daemons: 2 workers x N engines, a router, a frontend; a KServe gRPC client streams 8 requests/s
of 64 tokens at real-time mocker speed, and one worker is killed with SIGKILL mid-load. The frontend
excludes every engine at the dead address on the stream's failure (one migration per request in
flight), the router on its refused KV-event stream, so nothing fails and nothing leaks.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.etcd, pytest.mark.e2e]


@pytest.mark.parametrize("engines", [2, 4])
def test_killing_a_worker_under_load_fails_no_request(chaos, engines):
    report = chaos(f"worker-kill-{engines}", duration=10.0, rate=8.0, speedup=1.0, tokens=64, lease_ttl=10.0)
    assert report.requests >= 60
    assert report.failures == {}, report.table()
    assert report.background_failures == {}, report.table()
    assert (report.leaked_blocks, report.leaked_bookings) == (0, 0), report.table()
    # one migration per request that was on the dead worker, not one per engine there
    assert report.migrations <= report.requests * 0.25, report.table()
