"""Issue 14 item 9, as a spec: a router replica that dies costs no request, and one that joins gets work.

Real daemons: a worker, two router replicas, a frontend; KServe gRPC streams at 6 requests/s. One
replica is killed with SIGKILL (queries waiting on it fail over), then a new one joins: the frontend
spreads Sessions over every live replica, so the newcomer decides requests from then on.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.etcd, pytest.mark.e2e]


def test_a_killed_replica_fails_nothing_and_a_joining_one_gets_decisions(chaos):
    report = chaos("router-kill", duration=12.0, rate=6.0, lease_ttl=2.0)
    assert report.failures == {}, report.table()
    assert report.background_failures == {}, report.table()
    assert (report.leaked_blocks, report.leaked_bookings) == (0, 0), report.table()
    assert report.notes["decisions of the joined router"] > 0, report.table()
