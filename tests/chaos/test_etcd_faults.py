"""Issue 14 item 1, as a spec: discovery being unreachable is not an outage of the mesh.

Real etcd, real daemons (2 workers x 2 engines, a router, a frontend), a stock KServe gRPC client
streaming 4 requests/s: stopping etcd (SIGTERM) or freezing it (SIGSTOP) for 4xTTL fails no request,
and leaks nothing: every daemon keeps serving on the membership it last saw.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.etcd, pytest.mark.e2e]


@pytest.mark.parametrize("scenario", ["etcd-outage", "etcd-frozen"])
def test_etcd_down_for_four_ttls_fails_no_request(chaos, scenario):
    report = chaos(scenario, lease_ttl=2.0, outage=8.0, duration=8.0, rate=4.0, speedup=4.0)
    assert report.requests >= 50
    assert report.failures == {}, report.table()
    assert report.background_failures == {}, report.table()
    assert (report.leaked_blocks, report.leaked_bookings) == (0, 0), report.table()
