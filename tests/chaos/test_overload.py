"""Issue 14 item 8, as a spec: with default flags an overloaded mesh rejects instead of queueing, before any work.

Real daemons, default limits, engines with ``--max-num-seqs 8``: a burst far beyond capacity gets
RESOURCE_EXHAUSTED for what does not fit, the requests admitted start in bounded time, and nothing leaks.
What does not fit is refused at the frontend's gRPC entry (its per-model in-flight bound, derived from
the engines' running + waiting slots on their cards), so a refused request never costs a routing
decision or an engine round trip: the router's decisions equal the requests the frontend admitted.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.etcd, pytest.mark.e2e]


def test_a_burst_beyond_capacity_is_shed_not_queued(chaos):
    report = chaos("overload", burst=300, concurrency=150, speedup=1.0, tokens=48)
    assert set(report.failures) == {"RESOURCE_EXHAUSTED"}, report.table()
    assert report.ok >= 2 * 2 * 8, report.table()  # at least one full batch per engine served
    assert report.failures["RESOURCE_EXHAUSTED"] >= 100, report.table()
    assert (report.leaked_blocks, report.leaked_bookings) == (0, 0), report.table()


def test_a_refused_request_reaches_no_router_nor_engine(chaos):
    report = chaos("overload", burst=300, concurrency=150, speedup=1.0, tokens=48)
    assert report.refused_at_entry >= 100, report.table()
    # Every decision belongs to an admitted request (background stream included): nothing refused at the
    # entry was routed, and only a routed request reaches an engine.
    assert report.router_decisions == report.admitted, report.table()
    assert report.admitted + report.refused_at_entry >= report.requests, report.table()
