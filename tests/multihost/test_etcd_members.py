"""Issue 18, requirement 4: one etcd member of three killed under load.

Expected: the two remaining members keep a quorum (a new leader within about a second if the dead
one led). Every daemon's etcd client knows all three endpoints (``--discovery etcd://a:p,b:p,c:p``)
and fails over to a live one; its keepalives reach the new endpoint well within the lease TTL, so
no lease is lost or re-granted, no record vanishes, and no client request fails.
"""

from __future__ import annotations

import re
import time

from kvmesh_bench.multihost import Cluster

from tests.multihost.conftest import LEASE_TTL, fleet
from tests.multihost.load import Load


def _leases(mesh: Cluster) -> dict[str, str]:
    return {r["address"]: r["lease"] for r in fleet(mesh)}


def _lost_leases(mesh: Cluster, offsets: dict[str, int]) -> list[str]:
    return [f"{d.kind} on {d.name}: {line}" for d in mesh.daemons
            for line in d.log_text()[offsets[d.name]:].splitlines() if re.search(r"lease \w+ lost", line)]  # fmt: skip


def test_kill_9_of_the_etcd_member_in_use_fails_no_request_and_no_lease(mesh: Cluster) -> None:
    before = _leases(mesh)
    offsets = {d.name: len(d.log_text()) for d in mesh.daemons}
    with Load([f.address for f in mesh.frontends], rate=4.0) as load:
        time.sleep(2)
        mesh.kill_etcd_member(0)  # the first endpoint of the URL: the one every daemon connected to
        time.sleep(4 * LEASE_TTL)
    assert load.failures() == []
    assert len(load.results) >= 30
    assert _lost_leases(mesh, offsets) == []
    assert _leases(mesh) == before  # same daemons, same leases: nobody re-registered


def test_kill_9_of_the_etcd_leader_fails_no_request_and_no_lease(mesh: Cluster) -> None:
    leader = mesh.etcd_leader()
    assert leader is not None
    before = _leases(mesh)
    offsets = {d.name: len(d.log_text()) for d in mesh.daemons}
    with Load([f.address for f in mesh.frontends], rate=4.0) as load:
        time.sleep(2)
        mesh.kill_etcd_member(leader)
        time.sleep(4 * LEASE_TTL)
    assert load.failures() == []
    assert _lost_leases(mesh, offsets) == []
    assert _leases(mesh) == before
