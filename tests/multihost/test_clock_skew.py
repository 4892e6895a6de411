"""Issue 18, requirement 5: hosts whose clocks disagree.

Expected: nothing that decides liveness or expiry compares clocks of two hosts. Leases are etcd's
(TTLs counted by the etcd leader on its own clock; the keeper measures its proof on its own monotonic
clock, ``kvmesh.discovery.lease``). Bookings travel between router replicas with their *age*
(``ActiveBooking.age_ms``), never a timestamp, and each replica expires them on its own monotonic clock
(``--booking-ttl``). KV holds expire on a local timer. The wall-clock fields on the wire
(``started_unix_ms``, ``end_unix_s``, ``hold_expires_unix_ms``, planner ``unix_ms``) are for display
and logs only. So a worker, a router replica and a frontend whose wall clocks are 7 s off (libfaketime)
and whose monotonic clocks are a day apart (a time namespace) keep their leases, serve, and every
booking, theirs and their peers', is counted while its request runs and freed after.
"""

from __future__ import annotations

import re
import time

import pytest
from kvmesh_bench.multihost import Cluster

from tests.multihost.conftest import LEASE_TTL, fleet, wait_engines
from tests.multihost.load import Load

DAY = 86_400


@pytest.mark.timeout(240)  # 3 more daemons to start on a busy 2-core machine
def test_skewed_wall_and_monotonic_clocks_keep_leases_and_bookings(mesh: Cluster) -> None:
    spawned = time.time()
    skewed = [
        mesh.worker("worker-skew", clock_offset="+7s", monotonic_offset=DAY, speedup=1.0, wait=False),
        mesh.router("router-skew", clock_offset="-7s", monotonic_offset=2 * DAY, wait=False),
        mesh.frontend("frontend-skew", clock_offset="+7s", monotonic_offset=DAY, wait=False),
    ]
    try:
        for daemon in skewed:
            mesh.wait_serving(daemon)
        for frontend in mesh.frontends:
            wait_engines(frontend.address, 4)
        records = fleet(mesh)
        leases = {r["address"]: r["lease"] for r in records}
        assert {d.address for d in skewed} <= set(leases)
        # The skew is real: each skewed daemon stamped its record with its own wall clock, 7 s off.
        started = {r["address"]: int(r["started_unix_ms"]) / 1000 for r in records}
        worker_skew, router_skew, frontend_skew = (started[d.address] for d in skewed)
        assert min(worker_skew, frontend_skew) > spawned + 5 and router_skew < time.time() - 5, started
        peak: dict[str, float] = {}
        with Load([f.address for f in mesh.frontends], rate=4.0, tokens=96) as load:
            until = time.monotonic() + 3 * LEASE_TTL
            while time.monotonic() < until:
                for router in mesh.routers:
                    peers = mesh.metric(router, "kvmesh_router_active_bookings", {"origin": "peer"})
                    peak[router.name] = max(peak.get(router.name, 0.0), peers)
                time.sleep(0.2)
        served = {r.engine_id for r in load.results}
        print(f"\n[clock skew] requests {len(load.results)}, failed {len(load.failures())}, peak peer bookings {peak}")
        assert load.failures() == []
        skewed_engines = {int(r["id"], 16) for r in fleet(mesh) if r["address"] == skewed[0].address}
        assert served & skewed_engines, "the skewed worker served nothing"
        # every replica counted its peers' bookings while requests ran: none expired on arrival
        assert all(peak.get(r.name, 0) > 0 for r in mesh.routers), peak
        # and freed them all afterwards: none lives on because its clock looked younger
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and mesh.metric_sum("router", "kvmesh_router_active_bookings") > 0:
            time.sleep(0.2)
        assert mesh.metric_sum("router", "kvmesh_router_active_bookings") == 0
        assert {r["address"]: r["lease"] for r in fleet(mesh)} == leases  # no lease lost, none re-granted
        lost = [line for d in skewed for line in d.log_text().splitlines() if re.search(r"lease \w+ lost", line)]
        assert lost == []
    finally:
        for daemon in skewed:
            mesh.remove(daemon)
