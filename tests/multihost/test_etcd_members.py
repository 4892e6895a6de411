"""Issue 18, requirement 4: one etcd member of three killed under load.

Expected: the two remaining members keep a quorum and elect a new leader within about a second
(``--election-timeout 500``). Every daemon's etcd client knows all three endpoints
(``--discovery etcd://a:p,b:p,c:p``) and moves to a live one: watches on their stream's failure, lease
keepalives on the first beat without an answer (``kvmesh.discovery.etcd``), well within the lease TTL.
So no lease is lost or re-granted, no record vanishes, and no client request fails.
"""

from __future__ import annotations

import re
import time

from kvmesh_bench.multihost import Cluster

from tests.multihost.conftest import LEASE_TTL, fleet
from tests.multihost.load import Load


def _leases(mesh: Cluster) -> dict[str, str]:
    return {r["address"]: r["lease"] for r in fleet(mesh)}


def test_kill_9_of_the_leader_every_daemon_uses_fails_no_request_and_no_lease(mesh: Cluster) -> None:
    mesh.move_etcd_leader(0)  # member 0 is the URL's first endpoint: every daemon connected to it
    before = _leases(mesh)
    offsets = {d.name: len(d.log_text()) for d in mesh.daemons}
    with Load([f.address for f in mesh.frontends], rate=4.0) as load:
        time.sleep(2)
        mesh.kill_etcd_member(0)
        time.sleep(2 * LEASE_TTL)
    new_leader = mesh.etcd_leader()
    lost = [f"{d.kind} on {d.name}: {line}" for d in mesh.daemons
            for line in d.log_text()[offsets[d.name]:].splitlines() if re.search(r"lease \w+ lost", line)]  # fmt: skip
    print(f"\n[etcd leader kill -9] requests {len(load.results)}, failed {len(load.failures())}, "
          f"leases lost {len(lost)}, new leader etcd{(new_leader or -1) + 1}")  # fmt: skip
    assert load.failures() == []
    assert len(load.results) >= 30
    assert new_leader in (1, 2)
    assert lost == []
    assert _leases(mesh) == before  # same daemons, same leases: nobody re-registered
