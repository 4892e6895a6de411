"""Event loss end to end: a fault-injecting proxy between the router and a real worker drops KV events
or cuts the subscriptions; the router detects the gap (or the break), recovers, and its index equals
the workers' truth again. The gap / recovery / resubscribe counters move accordingly.

The worker registers in namespace ``hidden``; the proxy republishes its engines into ``rt`` with the
proxy's address, where the router runs (see ``tests/support/kv_fault_proxy.py``).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from kvmesh.discovery import instance_prefix, open_discovery
from kvmesh_router.indexer import KvIndexer
from kvmesh_router.ingest import Ingest

from tests.router.test_router_e2e_harness import ROUTED, Mesh, prompt, wait_until
from tests.support.kv_fault_proxy import KvFaultProxy

pytestmark = pytest.mark.e2e


@pytest.fixture
def faulty(tmp_path):
    """(mesh, worker, proxy, router) with the router reaching the worker only through the proxy."""

    def build(*worker_flags: str):
        mesh = Mesh(tmp_path)
        cleanup.append(mesh.close)
        worker = mesh.worker(*worker_flags, engines=2, namespace="hidden")
        proxy = KvFaultProxy(worker.address).start()
        cleanup.append(proxy.close)
        proxy.republish(mesh.url, "hidden", mesh.namespace)
        router = mesh.router()
        return mesh, worker, proxy, router

    cleanup: list = []
    yield build
    for close in reversed(cleanup):
        close()


def traffic(worker, letters: str, count: int, engine_index: int = 0) -> None:
    """``count`` prompts on one engine, each a new branch (one Stored event each, at least)."""
    engine = worker.engine_ids[engine_index]
    for i in range(count):
        worker.generate(engine, prompt("A", letters[i % len(letters)], chr(ord("K") + i)))


def converged(router, worker) -> bool:
    return router.index() == worker.truth()


def test_dropped_events_are_recovered_from_the_workers_replay_buffer(faulty):
    _, worker, proxy, router = faulty()
    traffic(worker, "BC", 2)
    wait_until(lambda: converged(router, worker), 10, "initial convergence")
    engine = worker.engine_ids[0]
    proxy.drop_events(3, engine)
    traffic(worker, "DEFG", 6)  # the first 3 events vanish; the 4th reveals the gap
    assert proxy.pending_drops == 0 and len(proxy.dropped) == 3
    wait_until(lambda: converged(router, worker), 10, "index == workers' truth after the gap")
    metrics = router.metrics()
    assert metrics["kvmesh_router_kv_gaps_total"] >= 1
    assert metrics["kvmesh_router_kv_recoveries_total{method=replay}"] >= 1
    assert metrics["kvmesh_router_kv_recoveries_total{method=snapshot}"] == 0
    assert metrics["kvmesh_router_kv_recovery_seconds_count"] >= 1
    assert "KV event gap" in router.daemon.log_text()


def test_events_gone_from_the_replay_buffer_are_recovered_by_snapshot(faulty):
    _, worker, proxy, router = faulty("--event-buffer-size", "2")
    traffic(worker, "BC", 2)
    wait_until(lambda: converged(router, worker), 10, "initial convergence")
    proxy.drop_events(3, worker.engine_ids[1])
    traffic(worker, "DEFGH", 5, engine_index=1)  # by the time the gap shows, ids have left the buffer
    wait_until(lambda: converged(router, worker), 10, "index == workers' truth after the gap")
    metrics = router.metrics()
    assert metrics["kvmesh_router_kv_gaps_total"] >= 1
    assert metrics["kvmesh_router_kv_recoveries_total{method=snapshot}"] >= 1


def test_cut_subscriptions_resume_from_the_cursor(faulty):
    _, worker, proxy, router = faulty()
    traffic(worker, "BC", 2)
    wait_until(lambda: converged(router, worker), 10, "initial convergence")
    assert proxy.cut_subscriptions() == 2  # one stream per engine
    traffic(worker, "DEF", 3)  # produced while the router reconnects (with backoff)
    traffic(worker, "GH", 2, engine_index=1)
    wait_until(lambda: converged(router, worker), 10, "index == workers' truth after the cut")
    metrics = router.metrics()
    assert metrics["kvmesh_router_kv_resubscribes_total"] >= 2
    assert metrics["kvmesh_router_kv_gaps_total"] == 0  # resumed exactly where it stopped


def test_a_cut_with_nothing_missed_leaves_idle_engines_routable(faulty):
    """A break takes the worker's engines out of routing until their streams answer again. Resuming with
    nothing to replay, the worker still answers at once (an empty batch): an idle engine, which produces no
    event while nothing is routed to it, would otherwise stay out of routing for as long as it lives."""
    _, worker, proxy, router = faulty()
    traffic(worker, "BC", 2)
    wait_until(lambda: converged(router, worker), 10, "initial convergence")
    assert proxy.cut_subscriptions() == 2
    wait_until(lambda: "is reachable again" in router.daemon.log_text(), 10, "the engines back in routing")
    assert "is unreachable" in router.daemon.log_text()  # they were out in between
    assert router.metrics()["kvmesh_router_kv_gaps_total"] == 0
    session = router.session()
    try:
        for i in range(4):  # nothing happened on the worker since the cut, and every query is routed
            decision = session.route(f"after-cut-{i}", prompt("Z", chr(ord("K") + i)))
            assert decision.outcome == ROUTED and decision.engine_id in worker.engine_ids, decision
    finally:
        session.close()


async def test_a_recovery_buffer_overflow_on_an_engines_first_stream_restores_from_a_snapshot(tmp_path):
    """An engine's first stream starts with a snapshot. A gap on it whose recovery cannot answer while
    the buffer overflows resets the cursor: the feed must leave that stream and restore, since reading on
    it dropped every later event as stale and the engine's index entries froze. (An in-process ingest
    with a 4-event buffer, through the fault proxy to a real worker.)"""
    mesh = Mesh(tmp_path)
    proxy = ingest = None
    try:
        worker = mesh.worker(engines=1)
        engine = worker.engine_ids[0]
        proxy = KvFaultProxy(worker.address).start()
        channel = grpc.aio.insecure_channel(proxy.address)
        index = KvIndexer(max_entries=None)
        ingest = Ingest(index, lambda _address: channel, max_buffer=4, max_backoff_s=0.2)
        ingest.add(engine, proxy.address)
        assert await ingest.wait_restored([engine], 10) == []
        proxy.drop_events(1, engine)  # a gap ...
        proxy.hold_subscriptions()  # ... whose recovery stream gets no answer
        await asyncio.to_thread(traffic, worker, "BCDEFGH", 8)  # 7 events buffered behind the gap: > 4
        assert ingest.stats.gaps >= 1
        proxy.hold_subscriptions(False)
        truth = await asyncio.to_thread(worker.truth)
        async with asyncio.timeout(10):
            while dict(index.canonical()) != truth:
                await asyncio.sleep(0.05)
        assert ingest.stats.restores == 2  # the first one, then a fresh subscription's snapshot
        await channel.close()
    finally:
        if ingest is not None:
            await ingest.close()
        if proxy is not None:
            proxy.close()
        mesh.close()


def test_engine_removed_from_discovery_leaves_the_index_and_the_load(tmp_path):
    mesh = Mesh(tmp_path)
    try:
        keep = mesh.worker(engines=1)
        gone = mesh.worker(engines=1)
        router = mesh.router()
        session = router.session()
        gone_engine = gone.engine_ids[0]
        session.run(gone, "r1", prompt("A", "B"), pinned=gone_engine)
        assert session.route("r2", prompt("A", "C"), pinned=gone_engine).outcome == 1  # stays booked
        wait_until(lambda: router.index().get(gone_engine), 5, "the engine's blocks indexed")
        gone.close()  # SIGTERM: its records vanish with its lease
        wait_until(lambda: gone_engine not in router.index(), 5, "engine dropped from the index")
        assert set(router.load()) == {keep.engine_ids[0]}
        assert router.metrics()["kvmesh_router_active_bookings{origin=local}"] == 0
        assert session.route("r3", prompt("A", "B"), pinned=gone_engine).outcome == 3  # NO_ENGINE
        session.close()
    finally:
        mesh.close()


def router_records(url: str, namespace: str) -> dict[str, bytes]:
    async def read() -> dict[str, bytes]:
        discovery = await open_discovery(url, ttl=2.0)
        try:
            return await discovery.get_prefix(instance_prefix(namespace, "router"))
        finally:
            await discovery.close()

    return asyncio.run(read())


def test_router_is_not_serving_nor_registered_until_its_index_is_restored(tmp_path):
    mesh = Mesh(tmp_path)
    proxy = None
    try:
        worker = mesh.worker(engines=2, namespace="hidden")
        traffic(worker, "BC", 3)
        proxy = KvFaultProxy(worker.address).start()
        proxy.republish(mesh.url, "hidden", mesh.namespace)
        proxy.hold_subscriptions()  # the worker "does not answer" the restore yet
        router = mesh.router(wait=False)
        wait_until(lambda: router.daemon.health() is not None, 10, "the router answers health checks")
        for _ in range(10):  # ~0.5 s: warming up, not serving, not in discovery
            assert router.daemon.health() == health_pb2.HealthCheckResponse.NOT_SERVING
            assert router_records(mesh.url, mesh.namespace) == {}
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as refused:
            router.session().route("early", prompt("A", "B"))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        proxy.hold_subscriptions(False)
        router.daemon.wait_serving(5)  # well before --warmup-timeout (10 s): it waited for the restore
        assert len(router_records(mesh.url, mesh.namespace)) == 1
        assert router.index() == worker.truth() and any(router.index().values())
        line = router.daemon.wait_log(r"warm restart: SERVING after ([0-9.]+) s")
        assert float(line.group(1)) >= 0.5
    finally:
        if proxy is not None:
            proxy.close()
        mesh.close()
