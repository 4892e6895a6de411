"""The router's Prometheus metrics (all names start with ``kvmesh_router_``).

Two kinds, chosen by how hot the code path that feeds them is:

- **Per decision** (the Session stream): prometheus-client counters and histograms updated in line
  (a few microseconds per decision, far below the gRPC round trip).
- **Per KV event** (the ingest hot path): plain integer counters kept by the ingest, the index and the
  replica hub, read at scrape time by :class:`_CoreCollector`. The event path pays one integer add per
  batch, nothing per event.

:class:`TimedIndex` times the prefix lookups of decisions; :func:`index_stats` is the index's scrape-time
source.

Rates (events/s, decisions/s) are ``rate()`` of the counters. Each :class:`RouterMetrics` owns its
registry unless given one, so tests and benchmarks can build several routers in one process; the
daemon passes prometheus-client's default registry (what ``--metrics-port`` serves).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvmesh_router.approx import ApproxIndexer
from kvmesh_router.indexer import KvIndexer

__all__ = ["RouterMetrics", "TimedIndex", "index_stats"]

_LATENCY_BUCKETS = (
    10e-6,
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    100e-3,
)
_OVERLAP_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_QUALITY_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _CoreCollector(Collector):
    """Reads the core's plain counters at scrape time (runs on the metrics HTTP thread: scalars only)."""

    def __init__(self) -> None:
        self.sources: dict[str, Callable[[], dict[str, Any]]] = {}

    def collect(self) -> Iterator[Metric]:
        for source, families in _SCRAPED:
            read = self.sources.get(source)
            if read is None:
                continue
            s = read()
            for kind, name, doc, what in families:
                if isinstance(what, str):
                    yield kind(f"kvmesh_router_{name}", doc, value=s[what])
                    continue
                label, keys = what
                fam = kind(f"kvmesh_router_{name}", doc, labels=[label])
                for value, key in keys:
                    fam.add_metric([value], s[key])
                yield fam


_Family = type[CounterMetricFamily] | type[GaugeMetricFamily]
#: (kind, name after ``kvmesh_router_``, help, the source's key, or (label, ((label value, key), ...))).
_Scraped = tuple[_Family, str, str, str | tuple[str, tuple[tuple[str, str], ...]]]
_C, _G = CounterMetricFamily, GaugeMetricFamily

#: Each scrape-time source and the families read from one call of it, in exposition order.
_SCRAPED: tuple[tuple[str, tuple[_Scraped, ...]], ...] = (
    (
        "ingest",
        (
            (_C, "kv_events", "KV events applied to the index", "events"),
            (_C, "kv_event_batches", "KV event batches received from workers", "batches"),
            (_C, "kv_stale_events", "KV events dropped because their id was already applied", "stale"),
            (_C, "kv_gaps", "gaps detected in an engine's KV event ids", "gaps"),
            (
                _C,
                "kv_recoveries",
                "completed gap recoveries by method",
                ("method", tuple((m, f"recovered_{m}") for m in ("replay", "snapshot", "barrier"))),
            ),
            (_C, "kv_snapshots", "engine snapshots applied (restores and recoveries)", "snapshots"),
            (_C, "kv_resubscribes", "KV event subscriptions re-opened after a break", "resubscribes"),
            (_G, "kv_recoveries_in_flight", "engines whose gap recovery is in progress", "recovering"),
            (_G, "kv_feeds", "engines whose KV events this router follows", "feeds"),
        ),
    ),
    (
        "index",
        (
            (_G, "index_entries", "(engine, block) entries in the prefix index", "entries"),
            (_G, "index_blocks", "distinct blocks in the prefix index", "blocks"),
            (_G, "index_max_entries", "cap on index entries (0 = unbounded)", "max_entries"),
            (_C, "index_evicted_entries", "index entries evicted by the size cap", "evicted_entries"),
            (_C, "index_stores_dropped", "stores dropped because their parent was unknown", "stores_dropped"),
            (_C, "index_unknown_removals", "removals of blocks the index did not hold", "unknown_removals"),
        ),
    ),
    (
        "state",
        (
            (_G, "engines", "routable engines", "engines"),
            (
                _G,
                "active_bookings",
                "active bookings by origin",
                ("origin", (("local", "local_bookings"), ("peer", "peer_bookings"))),
            ),
            (_G, "sessions", "open frontend Session streams", "sessions"),
        ),
    ),
    (
        "replicas",
        (
            (_G, "replica_peers", "peer replicas with a live sync link", "peers"),
            (_G, "replica_sync_queue_depth", "booking events queued to peers, not yet sent", "queued"),
            (
                _C,
                "replica_sync_events",
                "booking events exchanged with peers",
                ("direction", (("sent", "sent"), ("received", "received"))),
            ),
            (_C, "replica_sync_links_dropped", "sync links cut because a queue overflowed", "overflows"),
        ),
    ),
)


class RouterMetrics:
    """Every metric of one router; pass ``registry=None`` for a private registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.decisions = Counter(
            "kvmesh_router_decisions", "routing decisions by mode and outcome", ["mode", "outcome"], registry=r
        )
        self.prefill_places = Counter(
            "kvmesh_router_prefill_placements",
            "where the prefills of disaggregated decode requests went (remote, or local and why)",
            ["place"],
            registry=r,
        )

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(f"kvmesh_router_{name}", doc, buckets=buckets, registry=r)

        self.overlap = histogram("overlap_blocks", "cached prompt blocks on the chosen engine", _OVERLAP_BUCKETS)
        self.quality = histogram(
            "decision_quality_ratio",
            "overlap achieved / best overlap any eligible engine had (decisions with some overlap available)",
            _QUALITY_BUCKETS,
        )
        self.decision_latency = histogram(
            "decision_seconds", "time to decide and book one route query", _LATENCY_BUCKETS
        )
        self.find_matches_latency = histogram(
            "find_matches_seconds", "prefix-index lookup time per decision", _LATENCY_BUCKETS
        )
        self.recovery_seconds = histogram(
            "kv_recovery_seconds", "gap detected -> engine index consistent again", _SECONDS_BUCKETS
        )
        self.sync_lag = histogram(
            "replica_sync_lag_seconds",
            "age of a peer's booking when it reached this replica (peer queueing + transport)",
            (*_LATENCY_BUCKETS, 0.25, 1.0, 5.0),
        )
        self.lifecycle = Counter(
            "kvmesh_router_lifecycle_updates",
            "lifecycle updates by stage and whether the request was known",
            ["stage", "known"],
            registry=r,
        )
        self.sessions_freed = Counter(
            "kvmesh_router_session_orphans_freed", "bookings freed because their Session stream ended", registry=r
        )
        self.warmup_seconds = Gauge(
            "kvmesh_router_warmup_seconds", "start -> SERVING of this process (index and load rebuilt)", registry=r
        )
        self.core = _CoreCollector()
        r.register(self.core)
        self._decision_children: dict[tuple[str, str], Any] = {}
        # Pre-create the label sets people alert on, so they exist (at 0) before the first event.
        for outcome in ("routed", "rejected", "no_engine", "invalid"):
            self.decisions.labels("kv", outcome)
        self._place_children = {
            place: self.prefill_places.labels(place)
            for place in ("remote", "local_short", "local_busy", "local_no_engine", "local_id_taken")
        }

    def add_source(self, name: str, read: Callable[[], dict[str, Any]]) -> None:
        """Register a scrape-time reader (``ingest``, ``index``, ``state``, ``replicas``)."""
        self.core.sources[name] = read

    def observe_prefill_place(self, place: str) -> None:
        self._place_children[place].inc()

    def observe_decision(self, mode: str, outcome: str, seconds: float, overlap: int = 0, best: int = 0) -> None:
        child = self._decision_children.get((mode, outcome))
        if child is None:  # labels() costs a lock and a tuple build per call: resolve each child once
            child = self._decision_children[(mode, outcome)] = self.decisions.labels(mode, outcome)
        child.inc()
        self.decision_latency.observe(seconds)
        if outcome == "routed":
            self.observe_overlap(overlap, best)

    def observe_overlap(self, overlap: int, best: int) -> None:
        """The chosen engine's cached blocks, of a routed decision or a remote prefill's placement."""
        self.overlap.observe(overlap)
        if best:
            self.quality.observe(overlap / best)


class TimedIndex:
    """Wraps a prefix index to time ``find_matches``; everything else passes through."""

    __slots__ = ("_index", "_observe")

    def __init__(self, index: KvIndexer | ApproxIndexer, observe: Callable[[float], None]) -> None:
        self._index = index
        self._observe = observe

    def find_matches(self, seq_hashes: Sequence[int]) -> dict[int, int]:
        t0 = time.perf_counter()
        out = self._index.find_matches(seq_hashes)
        self._observe(time.perf_counter() - t0)
        return out

    def __getattr__(self, name: str) -> object:
        return getattr(self._index, name)


def index_stats(index: KvIndexer) -> dict[str, int]:
    """The event index's size and health counters (the ``index`` scrape-time source)."""
    c = index.counters
    return {
        "entries": index.size,
        "blocks": index.num_blocks,
        "max_entries": index.max_entries or 0,
        "evicted_entries": c.evicted_entries,
        "stores_dropped": c.stores_dropped,
        "unknown_removals": c.unknown_removals,
    }
