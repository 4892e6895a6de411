"""The multi-host mesh (issue 18): every daemon in its own network namespace, a 3-member etcd.

One cluster (``kvmesh_bench.multihost.Cluster``: etcd1-3, router1-2, frontend1-2, worker1-3) is shared
by the whole directory; before each test every partition is healed and every daemon and etcd member
is checked alive (a test that kills one brings it back). The tests need root and network namespaces:
without them they FAIL with one line saying what is missing (CI runs as root; a skip would hide it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tritonclient.grpc as grpcclient
from kvmesh.discovery import instance_prefix, open_discovery
from kvmesh.v1 import discovery_pb2, router_pb2, router_pb2_grpc
from kvmesh_bench.multihost import Cluster, missing_requirements

from tests.multihost.load import MODEL


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here needs etcd, and all share one cluster: under pytest-xdist they run on one worker, in turn
    (``--dist loadgroup``), so the cluster is built once and its link measurements see no sibling cluster."""
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(pytest.mark.etcd)
            item.add_marker(pytest.mark.xdist_group("multihost"))


LEASE_TTL = 5.0  # 2 s lost leases on a loaded 2-core machine with no fault at all (keepalive every T/3)
STANDARD = {"router1", "router2", "frontend1", "frontend2", "worker1", "worker2", "worker3"}


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    problem = missing_requirements()
    if problem:
        pytest.fail(f"tests/multihost: {problem}", pytrace=False)
    with Cluster(tmp_path_factory.mktemp("multihost"), lease_ttl=LEASE_TTL) as mesh:
        mesh.standard()
        for frontend in mesh.frontends:
            wait_engines(frontend.address, 3)
        yield mesh


@pytest.fixture
def mesh(cluster: Cluster) -> Iterator[Cluster]:
    """The shared cluster, healed and whole; healed again after the test, whatever happened."""
    cluster.heal()
    for daemon in [d for d in cluster.daemons if d.name not in STANDARD]:  # a test that ended early
        cluster.remove(daemon)
    for i, member in enumerate(cluster.etcd):
        if not member.alive:
            cluster.restart_etcd_member(i)
    cluster.wait_etcd_healthy(range(len(cluster.etcd)))
    cluster.check()
    try:
        for frontend in cluster.frontends:
            wait_engines(frontend.address, 3)
    except AssertionError as exc:  # say why: the last lines of every worker's and frontend's log
        tails = "\n".join(f"--- {d.name}\n{d.log_text()[-3000:]}" for d in [*cluster.workers, *cluster.frontends])
        raise AssertionError(f"{exc}\n{tails}") from None
    try:
        yield cluster
    finally:
        cluster.heal()


def engines_seen(frontend: str) -> int:
    """How many engines the frontend's discovery view holds for the model (ModelConfig ``engines``)."""
    with grpcclient.InferenceServerClient(frontend) as client:
        try:
            return int(client.get_model_config(MODEL).config.parameters["engines"].string_value or 0)
        except Exception:
            return 0


def wait_engines(frontend: str, count: int, timeout: float = 60.0) -> float:
    """Seconds until ``frontend`` sees exactly ``count`` engines."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if engines_seen(frontend) == count:
            return time.monotonic() - start
        time.sleep(0.1)
    seen = engines_seen(frontend)
    raise AssertionError(f"frontend {frontend} sees {seen} engines, not {count}, after {timeout:g} s")


def fleet(mesh: Cluster) -> list[dict[str, str]]:
    """Every daemon registered in the cluster's etcd: component, id, address, lease (hex), start (by its wall
    clock), read directly (kvmesh's ``kvmesh.v1`` stubs share no proto package with tritonclient, unlike
    ``inference``)."""

    async def read() -> dict[str, bytes]:
        disc = await open_discovery(mesh.etcd_url, ttl=LEASE_TTL)
        try:
            return await disc.get_prefix(instance_prefix(mesh.namespace))
        finally:
            await disc.close()

    rows = []
    for value in asyncio.run(read()).values():
        r = discovery_pb2.InstanceRecord.FromString(value)
        rows.append({"component": f"{r.component}/{r.endpoint}", "id": f"{r.instance_id:x}", "address": r.address,
                     "lease": f"{r.lease_id:x}", "started_unix_ms": str(r.started_unix_ms)})  # fmt: skip
    return rows


def engine_hosts(mesh: Cluster) -> dict[int, str]:
    """engine id -> the name of the host its worker runs on."""
    by_address = {d.address: d.name for d in mesh.workers}
    return {int(r["id"], 16): by_address[r["address"]] for r in fleet(mesh) if r["component"].startswith("worker/")}


def dump_index(router: str) -> dict[str, list[str]]:
    """RouterService.DumpIndex (what ``kvmesh router dump --hashes`` prints): engine id -> its block hashes."""
    with grpc.insecure_channel(router) as channel:
        reply = router_pb2_grpc.RouterServiceStub(channel).DumpIndex(router_pb2.DumpIndexRequest(), timeout=10)
    return {f"{e.engine_id:x}": sorted(f"{h:016x}" for h in e.block_hashes) for e in reply.engines}
