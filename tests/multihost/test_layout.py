"""Issue 18, requirement 1: every daemon on its own host, reachable only at its host's address."""

from __future__ import annotations

import time

from kvmesh_bench.multihost import Cluster

from tests.multihost.conftest import engine_hosts, fleet
from tests.multihost.load import Load


def test_every_daemon_registers_its_own_host_address_never_loopback(mesh: Cluster) -> None:
    records = fleet(mesh)
    addresses = {r["address"] for r in records}
    assert addresses == {d.address for d in mesh.daemons}, records
    assert not any(a.startswith("127.") for a in addresses)
    assert len({d.host.ns for d in mesh.daemons}) == len(mesh.daemons) == 7
    assert len(mesh.etcd_url.split(",")) == 3


def test_both_frontends_serve_through_every_worker_across_hosts(mesh: Cluster) -> None:
    with Load([f.address for f in mesh.frontends], rate=6.0) as load:
        time.sleep(5)
    assert load.failures() == []
    served = engine_hosts(mesh)
    assert {served[r.engine_id] for r in load.results} == {"worker1", "worker2", "worker3"}
    assert {r.frontend for r in load.results} == {f.address for f in mesh.frontends}
