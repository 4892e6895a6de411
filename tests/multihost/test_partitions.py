"""Issue 18, requirement 3: partitions between hosts (nftables drop rules), under a stock-tritonclient load.

Each test states the expected behaviour first, then measures it: failed client requests (the goal is
0 whenever a path from the client to a healthy engine remains), convergence once healed, and that no
request is served by an engine its frontend had dropped. The figures are printed (``-s``) and written
up in docs/reliability.md. Lease TTL 5 s (``LEASE_TTL``), 4 requests/s over both frontends.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvmesh_bench.multihost import Cluster

from tests.multihost.conftest import LEASE_TTL, dump_index, engine_hosts, engines_seen, fleet, wait_engines
from tests.multihost.load import Load, Result

RATE = 4.0


def _under_load(mesh: Cluster, fault: Callable[[], None], seconds: float, heal: bool = True) -> list[Result]:
    """2 s of load, ``fault()``, ``seconds`` more of load, heal, 2 s more; every request's result."""
    with Load([f.address for f in mesh.frontends], rate=RATE) as load:
        time.sleep(2)
        fault()
        time.sleep(seconds)
        if heal:
            mesh.heal()
        time.sleep(2)
    return load.results


def _report(name: str, results: list[Result], **extra: object) -> None:
    failed = [r for r in results if r.status != "ok"]
    first = f"; first: {failed[0].status}" if failed else ""
    print(
        f"\n[{name}] requests {len(results)}, failed {len(failed)}{first}; "
        + ", ".join(f"{k} {v}" for k, v in extra.items())
    )


def _wait_converged(routers: list[str], timeout: float = 30.0) -> dict[str, list[str]]:
    """Both replicas' index dumps, once identical (bounded wait, polling); the last pair if never."""
    deadline = time.monotonic() + timeout
    while True:
        dumps = [dump_index(r) for r in routers]
        if all(d == dumps[0] for d in dumps) or time.monotonic() > deadline:
            return dumps[0] if all(d == dumps[0] for d in dumps) else {"diverged": [str(d) for d in dumps]}
        time.sleep(0.5)


def test_worker_cut_off_from_one_router_replica(mesh: Cluster) -> None:
    """Expected: worker1 stays in discovery (etcd reaches it) and every frontend reaches it, so requests
    that router1 sends to worker1 are served; router1's index of worker1 only goes stale (no KV events
    arrive), which costs cache hits, not requests. Once healed, router1's subscription resumes from its
    cursor and both replicas' indexes are identical. 0 failed requests."""
    results = _under_load(mesh, lambda: mesh.partition("worker1", "router1"), 6)
    _report("worker1 | router1", results)
    assert [r.status for r in results if r.status != "ok"] == []
    dumps = _wait_converged([r.address for r in mesh.routers])
    assert "diverged" not in dumps, dumps


def test_frontend_cut_off_from_one_router_replica(mesh: Cluster) -> None:
    """Expected: frontend1's Session to router1 stalls (no RST: packets are dropped). Queries waiting on it
    are re-sent to router2 once the frontend notices, and new ones go to router2 only; after heal the
    frontend opens a Session to router1 again. 0 failed requests (a path frontend1 -> router2 -> engine
    remains); the cost is the latency of the queries caught on the stalled Session."""
    results = _under_load(mesh, lambda: mesh.partition("frontend1", "router1"), 8)
    caught = [r.ended - r.started for r in results if r.frontend == mesh.frontends[0].address]
    _report("frontend1 | router1", results, slowest_frontend1_request_s=round(max(caught), 2))
    assert [r.status for r in results if r.status != "ok"] == []


def test_worker_cut_off_from_etcd_only(mesh: Cluster) -> None:
    """Expected: worker1 cannot renew its lease; T after its last keepalive etcd expires it and its records
    vanish, so frontends and routers drop its engine (authoritative, since etcd is up for them). Requests
    in flight on it finish (it is healthy and reachable); new ones go to worker2/3; none that starts after
    the frontend dropped it and before the heal is served by it. It keeps serving and retrying; once healed
    its keeper re-registers it under the same instance id and it takes traffic again. 0 failed requests."""
    hosts = engine_hosts(mesh)
    w1_engines = {e for e, h in hosts.items() if h == "worker1"}
    dropped_at: list[float] = []

    def fault() -> None:
        mesh.partition("worker1", mesh.etcd_names)

    with Load([f.address for f in mesh.frontends], rate=RATE) as load:
        time.sleep(2)
        fault()
        start = time.monotonic()
        while time.monotonic() - start < 3 * LEASE_TTL and not dropped_at:
            if not dropped_at and all(engines_seen(f.address) == 2 for f in mesh.frontends):
                dropped_at.append(time.monotonic())
            time.sleep(0.1)
        why_not = ""  # for the failure message: whose view is wrong, etcd's or a frontend's
        if not dropped_at:
            workers = sorted(r["address"] for r in fleet(mesh) if r["component"].startswith("worker"))
            why_not = (
                f"etcd holds workers at {workers}; engines seen: {[engines_seen(f.address) for f in mesh.frontends]}"
            )
        time.sleep(3)  # requests keep coming while the worker is out of discovery
        # The end of the window: once healed, the worker re-registers and a frontend that has seen it come
        # back may route to it while the other one still waits for the watch event.
        healed_at = time.monotonic()
        mesh.heal()
        for f in mesh.frontends:
            wait_engines(f.address, 3, timeout=30)
        back_at = time.monotonic()
        # until it has served a request that started after both frontends saw it back (each request picks
        # one of three workers: a fixed few seconds of load leave it none now and then)
        while time.monotonic() - back_at < 30 and not any(
            r.engine_id in w1_engines and r.started > back_at for r in load.finished()
        ):
            time.sleep(0.2)
    results = load.results
    assert dropped_at, f"the frontends never dropped the partitioned worker's engine ({why_not})"
    served_after_drop = [r for r in results if r.engine_id in w1_engines and dropped_at[0] < r.started < healed_at]
    served_while_coming_back = [r for r in results if r.engine_id in w1_engines and healed_at < r.started < back_at]
    _report("worker1 | etcd", results, dropped_after_s=round(dropped_at[0] - start, 1),
            served_by_dropped_engine=len(served_after_drop), back_after_heal_s=round(back_at - healed_at, 2),
            served_by_it_before_both_frontends_saw_it_back=len(served_while_coming_back))  # fmt: skip
    assert [r.status for r in results if r.status != "ok"] == []
    assert served_after_drop == []
    assert mesh.workers[0].address in {r["address"] for r in fleet(mesh)}  # re-registered
    assert any(r.engine_id in w1_engines and r.started > back_at for r in results)  # and serving again


def test_router_replicas_cut_off_from_each_other_then_healed(mesh: Cluster) -> None:
    """Expected: replica sync between router1 and router2 stalls; each keeps routing on its own bookings
    and the peer's last known ones until the link is declared broken (then they are dropped, as with a
    dead peer). Both still receive every worker's KV events, so once healed (link re-synced by snapshot)
    and the load has stopped, their index dumps are identical. 0 failed requests."""
    results = _under_load(mesh, lambda: mesh.partition("router1", "router2"), 6)
    dumps = _wait_converged([r.address for r in mesh.routers])
    _report("router1 | router2", results, engines_in_dump=len(dumps), converged="diverged" not in dumps)
    assert [r.status for r in results if r.status != "ok"] == []
    assert "diverged" not in dumps, dumps
    assert len(dumps) == 3


def test_etcd_minority_member_isolated_from_its_peers(mesh: Cluster) -> None:
    """Expected: etcd1 (the first endpoint, the one every daemon uses) loses its peers but stays reachable:
    it has no leader, so keepalives and reads through it fail and every daemon moves to etcd2/etcd3, which
    keep the quorum. Watches too: a member without a leader receives no new revision, so a watch left on
    it would silently miss every change; a worker killed meanwhile must still leave every frontend's view
    once etcd2/etcd3 expire its lease (T). No other lease lost, 0 failed requests (the killed worker's
    requests migrate); once healed etcd1 catches up."""
    before = {r["address"]: r["lease"] for r in fleet(mesh)}
    victim = mesh.daemon("worker3")
    with Load([f.address for f in mesh.frontends], rate=RATE) as load:
        time.sleep(2)
        mesh.isolate_etcd_member(0, clients=False)
        time.sleep(1)
        victim.kill()
        killed = time.monotonic()
        seen = {f.address: wait_engines(f.address, 2, timeout=4 * LEASE_TTL) for f in mesh.frontends}
        dropped_after = time.monotonic() - killed
        mesh.heal()
        time.sleep(2)
    results = load.results
    victim.restart()
    mesh.wait_serving(victim)
    _report("etcd1 | etcd2+etcd3", results, killed_worker_dropped_after_s=round(dropped_after, 1))
    assert [r.status for r in results if r.status != "ok"] == []
    assert len(seen) == 2
    after = {r["address"]: r["lease"] for r in fleet(mesh)}
    assert {a: lease for a, lease in after.items() if a != victim.address} == {
        a: lease for a, lease in before.items() if a != victim.address
    }


def test_etcd_minority_member_black_holed(mesh: Cluster) -> None:
    """Expected: as above, but etcd1 answers nobody (cut from every host): calls to it time out instead of
    failing, so failover takes a call timeout (keepalives: min(connect timeout, T/3)) but stays well
    within the lease TTL. No lease lost, 0 failed requests."""
    before = {r["address"]: r["lease"] for r in fleet(mesh)}
    results = _under_load(mesh, lambda: mesh.isolate_etcd_member(0), 1.5 * LEASE_TTL)
    _report("etcd1 black-holed", results)
    assert [r.status for r in results if r.status != "ok"] == []
    assert {r["address"]: r["lease"] for r in fleet(mesh)} == before


def test_etcd_majority_lost_for_30_s(mesh: Cluster) -> None:
    """Expected: etcd2 and etcd3 are cut from everything; etcd1 alone has no quorum, so no keepalive, read
    or write succeeds for 30 s (6 TTLs). Serving never depends on discovery: every daemon keeps serving
    on the membership it last saw, 0 failed requests. Once healed a leader is elected; every daemon is
    registered again (lease kept, or re-granted under the same instance id) without a restart."""
    ids_before = {r["id"] for r in fleet(mesh)}

    def fault() -> None:
        mesh.isolate_etcd_member(1)
        mesh.isolate_etcd_member(2)

    results = _under_load(mesh, fault, 30.0)
    mesh.wait_etcd_healthy(range(3))
    deadline = time.monotonic() + 30
    while {r["id"] for r in fleet(mesh)} != ids_before and time.monotonic() < deadline:
        time.sleep(0.5)
    _report("etcd majority lost 30 s", results)
    assert [r.status for r in results if r.status != "ok"] == []
    assert {r["id"] for r in fleet(mesh)} == ids_before
