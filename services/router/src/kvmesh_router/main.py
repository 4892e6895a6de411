"""``kvmesh-router``: a router replica (run one or more; they are active-active).

It discovers worker engines, follows every engine's KV event journal into its prefix index, and
answers frontends' route queries on ``RouterService.Session`` streams, booking each routed request in
its slot tracker; replicas exchange their bookings over ``ReplicaSync``.

**Warm restart.** A (re)started replica is useless until it knows the fleet's caches and load, so it
reports NOT_SERVING (grpc.health.v1) and stays out of discovery until it has

1. read the fleet from discovery (worker instance records and model cards),
2. restored every engine's index from the worker itself (``SubscribeKvEvents`` with no start id: a
   snapshot of the engine's cache, then live events), and
3. received the bookings of every peer replica it found in discovery (``ReplicaSync`` snapshots),

each bounded by ``--warmup-timeout`` (an engine or peer that does not answer in time is logged and
left to catch up in the background). Then it turns SERVING, registers
``InstanceRecord{component="router", endpoint="router"}`` and logs how long it took.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import time
from collections.abc import Sequence

import grpc
import prometheus_client
from kvmesh.channels import ChannelPool
from kvmesh.runtime import DaemonRuntime, run_daemon

from kvmesh_router.engines import EngineInfo
from kvmesh_router.fleet import Fleet
from kvmesh_router.identity_gate import IdentityGate
from kvmesh_router.ingest import Ingest
from kvmesh_router.load_watch import LoadWatch
from kvmesh_router.metrics import RouterMetrics
from kvmesh_router.replica_sync import ReplicaHub
from kvmesh_router.service import IN_BAND, SERVICE, RouterServicer
from kvmesh_router.settings import Settings
from kvmesh_router.state import RouterState

log = logging.getLogger("kvmesh_router")

PROG = "kvmesh-router"


def _process_started() -> float:
    """Monotonic time at which this process started (Linux /proc), else now (module import)."""
    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return time.monotonic() - max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic()


_STARTED = _process_started()


async def serve(settings: Settings) -> int:
    async with DaemonRuntime(PROG, settings) as runtime:
        return await _serve(runtime, settings)


async def _serve(runtime: DaemonRuntime, settings: Settings) -> int:
    """Build the replica on ``runtime``; what it opens closes, after the drain, in reverse order."""
    metrics = RouterMetrics(prometheus_client.REGISTRY)
    state = RouterState(settings, metrics)
    pool = ChannelPool()
    runtime.resources.push_async_callback(pool.close)

    def channel_for(address: str) -> grpc.aio.Channel:
        return pool.get(f"worker/{address}", address, role="worker")  # with TLS: only a worker certificate answers

    def replica_channel(address: str) -> grpc.aio.Channel:
        return pool.get(f"router/{address}", address, role="router")

    ingest: Ingest | None = None
    if state.kv_index is not None:
        ingest = Ingest(
            state.kv_index,
            channel_for,
            on_recovered=lambda s, _m: metrics.recovery_seconds.observe(s),
            on_routable=state.engines.set_routable,
        )
        metrics.add_source("ingest", ingest.stats_dict)
        runtime.resources.push_async_callback(ingest.close)
    hub: ReplicaHub | None = None
    if settings.replica_sync:
        hub = ReplicaHub(state, runtime.instance_id, replica_channel, queue_size=settings.sync_queue_size)
        metrics.add_source("replicas", hub.stats_dict)
        # Replica links are endless streams: they end when draining starts, or the drain would wait for them.
        runtime.on_draining(hub.close)

    load_watch = LoadWatch(state, channel_for) if settings.busy_kv_usage is not None else None
    if load_watch is not None:
        runtime.resources.push_async_callback(load_watch.close)

    def engine_added(info: EngineInfo) -> None:
        state.add_engine(info)
        if load_watch is not None:
            load_watch.sync(fleet.engines)
        if ingest is not None:
            if info.kv_events:
                ingest.add(info.engine_id, info.address)
            else:
                log.warning(
                    "engine %x publishes no KV events: it gets no cache overlap in kv-events mode", info.engine_id
                )

    def engine_removed(engine_id: int) -> None:
        if ingest is not None:
            ingest.remove(engine_id)
        info = state.engines.get(engine_id)
        dropped = state.remove_engine(engine_id)
        if info is not None and not any(e.address == info.address for e in state.engines.values()):
            # its worker left: a fleet that scales (new workers on new ports) kept a channel to each for good
            pool.release(f"worker/{info.address}")
        if load_watch is not None:
            load_watch.sync(fleet.engines)
        if dropped:
            log.info("engine %x gone: dropped %d bookings", engine_id, len(dropped))

    if settings.tls_enabled:  # security: an engine is routable only once a worker certificate answered for it
        gate = IdentityGate(channel_for, engine_added, engine_removed)
        runtime.resources.push_async_callback(gate.close)
        fleet = Fleet(runtime.discovery, settings.namespace, gate.added, gate.removed)
    else:
        fleet = Fleet(runtime.discovery, settings.namespace, engine_added, engine_removed)
    runtime.resources.push_async_callback(fleet.close)
    warm = asyncio.Event()  # set once warm, cleared when draining starts
    runtime.on_draining(warm.clear)
    servicer = RouterServicer(state, hub, ingest.next_event_id if ingest else lambda _e: None, warm.is_set)
    runtime.add_service(SERVICE, servicer, in_band=IN_BAND)

    # Health answers NOT_SERVING from the first moment until the replica is warm.
    await runtime.start(settings.grpc_port, ready=False)
    t_warm = time.monotonic()

    # 1. The fleet as discovery knows it.
    fleet.start()
    if not await fleet.wait_initial(max(settings.warmup_timeout, 1.0)):
        log.warning("warm-up: discovery gave no initial fleet within %.1f s", settings.warmup_timeout)
    t_fleet = time.monotonic()
    # 2. Every engine's index from its worker, and 3. every peer's bookings, concurrently.
    if hub is not None:
        hub.start(runtime.discovery, settings.namespace)
    engines = list(fleet.engines)
    late_engines = await ingest.wait_restored(engines, settings.warmup_timeout) if ingest else []
    t_index = time.monotonic()
    late_peers = await hub.wait_initial_synced(settings.warmup_timeout) if hub else []
    t_peers = time.monotonic()
    if late_engines:
        log.warning(
            "warm-up: %d engines not restored (%s: their worker is unreachable or slow); they catch up in the "
            "background",
            len(late_engines),
            ", ".join(f"{e:x}" for e in late_engines),
        )
    if late_peers:
        log.warning(
            "warm-up: no bookings from peers %s (unreachable or slow; a dead replica's record outlives it by up "
            "to a lease TTL); syncing in the background",
            ", ".join(f"{p:x}" for p in late_peers),
        )

    # The warm state (index, bookings, protobuf classes) is long-lived: keep it out of every future
    # full collection, so a large index does not turn GC passes into decision-latency spikes.
    gc.collect()
    gc.freeze()
    warm.set()
    await runtime.register(runtime.instance_record("router", "router"))
    await runtime.set_ready()
    now = time.monotonic()
    metrics.warmup_seconds.set(now - _STARTED)
    index_size = state.kv_index.size if state.kv_index is not None else 0
    peers = len(hub.current) if hub else 0
    log.info(
        "warm restart: SERVING after %.3f s (%.3f s since process start): fleet %d engines in %.3f s, "
        "index %d entries from %d engines in %.3f s, %d peer bookings from %d peers in %.3f s; "
        "instance %x on %s, mode %s%s",
        now - t_warm,
        now - _STARTED,
        len(engines),
        t_fleet - t_warm,
        index_size,
        len(engines) - len(late_engines),
        t_index - t_fleet,
        len(state.slots) - len(state.bookings.local_keys),
        peers,
        t_peers - t_index,
        runtime.instance_id,
        runtime.address,
        settings.mode,
        "" if settings.kv_events else " (approximate: no KV events)",
    )

    await runtime.wait_for_stop()
    log.info("stopping: deregistering and draining sessions")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    settings = Settings.load(
        PROG, "kvmesh router: KV-aware routing for frontends (one or more active-active replicas)", argv
    )
    return run_daemon(PROG, settings, serve)


if __name__ == "__main__":
    sys.exit(main())
