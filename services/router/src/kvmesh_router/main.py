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

import prometheus_client
import uvloop
from kvmesh import telemetry
from kvmesh.channels import ChannelPool
from kvmesh.config import Config, Flag, fail, non_negative_float, non_negative_int, parse_config, port, positive_int
from kvmesh.runtime import DaemonRuntime
from kvmesh.v1 import router_pb2

from kvmesh_router.engines import EngineInfo
from kvmesh_router.fleet import Fleet
from kvmesh_router.indexer import DEFAULT_MAX_ENTRIES
from kvmesh_router.ingest import Ingest
from kvmesh_router.load_watch import LoadWatch
from kvmesh_router.metrics import RouterMetrics
from kvmesh_router.replica_sync import DEFAULT_QUEUE_SIZE, ReplicaHub
from kvmesh_router.service import RouterServicer, add_to_server
from kvmesh_router.settings import DEFAULT_COST_POLICY, RouterSettings
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


def _optional(parse: type) -> object:
    def convert(text: str) -> object:
        if text.strip().lower() in {"", "none", "off"}:
            return None
        value = parse(text)
        if value < 0:
            raise ValueError(f"must be >= 0 (or 'none'), got {value}")
        return value

    convert.__name__ = f"optional {parse.__name__}"
    return convert


FLAGS = (
    Flag("grpc-port", "gRPC port of RouterService (0 = any free port)", default=0, type=port),
    Flag(
        "router-mode",
        "how engines are picked when a query does not pin one",
        default="kv",
        choices=("kv", "round_robin", "random", "power_of_two"),
    ),
    Flag(
        "cost-policy",
        "kv cost function: 'affinity' (kvmesh's, backlog-discounted prefix affinity) or 'dynamo' (Dynamo's "
        "overlap-weighted prefill + decode blocks); see docs/benchmarks.md for the measured difference",
        default=DEFAULT_COST_POLICY,
        choices=("affinity", "dynamo"),
    ),
    Flag(
        "overlap-weight",
        "weight of prefill blocks against decode blocks in the kv cost",
        default=1.0,
        type=non_negative_float,
    ),
    Flag(
        "temperature", "softmax temperature of kv selection (0 = cheapest engine)", default=0.0, type=non_negative_float
    ),
    Flag(
        "busy-prefill-tokens",
        "an engine with more booked prefill tokens is busy ('none' = off)",
        default=None,
        type=_optional(int),
        metavar="TOKENS",
    ),
    Flag(
        "busy-prefill-frac",
        "busy above this fraction of the engine's max_num_batched_tokens ('none' = off)",
        default=None,
        type=_optional(float),
        metavar="FRAC",
    ),
    Flag(
        "busy-kv-usage",
        "busy above this fraction of the engine's KV blocks in use ('none' = off); a query is "
        "REJECTED only when every eligible engine is busy",
        default=None,
        type=_optional(float),
        metavar="FRAC",
    ),
    Flag(
        "kv-events",
        "follow the engines' KV events (--no-kv-events: approximate mode, the router's own "
        "decisions become predicted cached blocks with a TTL)",
        default=True,
        is_bool=True,
    ),
    Flag(
        "index-max-blocks",
        "cap on (engine, block) entries in the prefix index (0 = unbounded)",
        default=DEFAULT_MAX_ENTRIES,
        type=non_negative_int,
    ),
    Flag("approx-ttl", "approximate mode: seconds a predicted block lives", default=120.0, type=non_negative_float),
    Flag(
        "booking-ttl",
        "seconds after which a booking with no FINISHED is dropped (lost-update backstop)",
        default=300.0,
        type=non_negative_float,
    ),
    Flag("replica-sync", "exchange active-load bookings with the other router replicas", default=True, is_bool=True),
    Flag(
        "sync-queue-size",
        "booking events queued per replica link before the link is cut and re-synced",
        default=DEFAULT_QUEUE_SIZE,
        type=positive_int,
    ),
    Flag(
        "warmup-timeout",
        "longest wait, per phase, for engines' snapshots and peers' bookings before SERVING",
        default=10.0,
        type=non_negative_float,
    ),
    Flag(
        "seed",
        "seed of the router's random choices (tie-breaks, random modes); default: random",
        default=None,
        type=int,
    ),
)


def settings_from(cfg: Config) -> RouterSettings:
    try:
        return RouterSettings(
            mode=cfg.router_mode,
            cost_policy=cfg.cost_policy,
            overlap_weight=cfg.overlap_weight,
            temperature=cfg.temperature,
            busy_prefill_tokens=cfg.busy_prefill_tokens,
            busy_prefill_frac=cfg.busy_prefill_frac,
            busy_kv_usage=cfg.busy_kv_usage,
            kv_events=cfg.kv_events,
            index_max_blocks=cfg.index_max_blocks or None,
            approx_ttl_s=cfg.approx_ttl or 120.0,
            booking_ttl_s=cfg.booking_ttl or 300.0,
            seed=cfg.seed,
        )
    except ValueError as exc:
        fail(PROG, str(exc))


async def serve(cfg: Config) -> int:
    settings = settings_from(cfg)
    runtime = DaemonRuntime(PROG, cfg)
    await runtime.connect()
    assert runtime.discovery is not None
    metrics = RouterMetrics(prometheus_client.REGISTRY)
    state = RouterState(settings, metrics)
    pool = ChannelPool()

    def channel_for(address: str):  # noqa: ANN202 - grpc.aio.Channel
        return pool.get(address, address)

    ingest: Ingest | None = None
    if state.kv_index is not None:
        ingest = Ingest(state.kv_index, channel_for, on_recovered=lambda s, _m: metrics.recovery_seconds.observe(s))
        metrics.add_source("ingest", ingest.stats_dict)
    hub: ReplicaHub | None = None
    if cfg.replica_sync:
        hub = ReplicaHub(state, runtime.instance_id, channel_for, queue_size=cfg.sync_queue_size)
        metrics.add_source("replicas", hub.stats_dict)

    load_watch = LoadWatch(state, channel_for) if settings.busy_kv_usage is not None else None

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
        dropped = state.remove_engine(engine_id)
        if load_watch is not None:
            load_watch.sync(fleet.engines)
        if dropped:
            log.info("engine %x gone: dropped %d bookings", engine_id, len(dropped))

    fleet = Fleet(runtime.discovery, cfg.namespace, engine_added, engine_removed)
    ready = False
    servicer = RouterServicer(state, hub, ingest.next_event_id if ingest else lambda _e: None, lambda: ready)
    runtime.add_service(router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name, add_to_server, servicer)

    # Health answers NOT_SERVING from the first moment until the replica is warm.
    await runtime.start(cfg.grpc_port, ready=False)
    t_warm = time.monotonic()

    # 1. The fleet as discovery knows it.
    fleet.start()
    if not await fleet.wait_initial(max(cfg.warmup_timeout, 1.0)):
        log.warning("warm-up: discovery gave no initial fleet within %.1f s", cfg.warmup_timeout)
    t_fleet = time.monotonic()
    # 2. Every engine's index from its worker, and 3. every peer's bookings, concurrently.
    if hub is not None:
        hub.start(runtime.discovery, cfg.namespace)
    engines = list(fleet.engines)
    late_engines = await ingest.wait_restored(engines, cfg.warmup_timeout) if ingest else []
    t_index = time.monotonic()
    late_peers = await hub.wait_initial_synced(cfg.warmup_timeout) if hub else []
    t_peers = time.monotonic()
    if late_engines:
        log.warning(
            "warm-up: %d engines not restored in time (%s); they catch up in the background",
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
    ready = True
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
    ready = False
    # shutdown() marks the runtime draining before its first await (new calls are refused from then on);
    # close the replica links right after, or the drain would wait for these endless streams.
    shutdown = asyncio.get_running_loop().create_task(runtime.shutdown())
    await asyncio.sleep(0)
    if hub is not None:
        await hub.close()
    await shutdown
    await fleet.close()
    if load_watch is not None:
        await load_watch.close()
    if ingest is not None:
        await ingest.close()
    await pool.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_config(
        PROG, "kvmesh router: KV-aware routing for frontends (one or more active-active replicas)", FLAGS, argv
    )
    telemetry.setup_logging(PROG, cfg.log_level, cfg.log_format)
    telemetry.setup_tracing(PROG, cfg.otel_exporter, cfg.otel_endpoint)
    return uvloop.run(serve(cfg))


if __name__ == "__main__":
    sys.exit(main())
