"""Prometheus view of the engines, read at scrape time.

A collector reads each engine's load and counters (through the ``Engine`` interface) when
Prometheus scrapes, instead of updating gauges on every pass: a thousand engines stepping at full
speed then pay nothing for metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import REGISTRY, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvmesh_worker.engine import EngineLoad
from kvmesh_worker.engines import Engine

_GAUGES = (
    ("kvmesh_engine_active_blocks", "KV blocks referenced by running requests", "active_blocks"),
    ("kvmesh_engine_cached_blocks", "cached, unreferenced (evictable) KV blocks", "cached_blocks"),
    ("kvmesh_engine_total_blocks", "KV blocks of the engine", "total_blocks"),
    ("kvmesh_engine_waiting_requests", "requests waiting to be scheduled", "num_waiting"),
    ("kvmesh_engine_running_requests", "requests running", "num_running"),
    ("kvmesh_engine_queued_prefill_tokens", "prompt tokens not computed yet", "queued_prefill_tokens"),
)
_COUNTERS = (
    ("kvmesh_engine_passes", "forward passes", "passes"),
    ("kvmesh_engine_prefill_tokens", "prompt tokens computed", "prefill_tokens"),
    ("kvmesh_engine_decode_tokens", "tokens decoded", "decode_tokens"),
)
# Counters only some engines keep (a vLLM decode engine: what its KV connector says it pulled).
_OPTIONAL_COUNTERS = (
    (
        "kvmesh_engine_kv_pulled_tokens",
        "prompt tokens whose KV the engine pulled from a prefill engine",
        "kv_pulled_tokens",
    ),
    ("kvmesh_engine_kv_pulled_bytes", "KV bytes the engine pulled from prefill engines", "kv_pulled_bytes"),
    (
        "kvmesh_engine_schedule_slip_seconds",
        "a mocker's modelled time lost to its process running passes late (a starved process)",
        "schedule_slip_s",
    ),
)

# Gauges only some engines keep (a mocker prefill/decode engine: its NIXL reads in flight).
_OPTIONAL_GAUGES = (("kvmesh_engine_kv_reading_blocks", "KV blocks of NIXL reads in flight now", "kv_reading_blocks"),)


class EngineCollector(Collector):
    """Every engine's gauges and counters, labelled by engine and by the model it serves."""

    def __init__(self, engines: Sequence[Engine], model: str = "") -> None:
        self.engines = engines
        self.model = model

    @classmethod
    def register(cls, engines: Sequence[Engine], model: str = "") -> EngineCollector:
        collector = cls(engines, model)
        REGISTRY.register(collector)
        return collector

    def unregister(self) -> None:
        """Leave the process-wide registry: it would otherwise keep the engines, and through them the
        whole daemon, alive to the end of the process."""
        REGISTRY.unregister(self)

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        loads = [(f"{e.engine_id:x}", e.load(), e) for e in self.engines]
        yield from self._gauges(loads, self.model)
        for name, doc, attr in _COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["engine", "model"])
            for label, _load, engine in loads:
                family.add_metric([label, self.model], getattr(engine, attr))
            yield family
        for name, doc, attr, kind in [
            *((n, d, a, CounterMetricFamily) for n, d, a in _OPTIONAL_COUNTERS),
            *((n, d, a, GaugeMetricFamily) for n, d, a in _OPTIONAL_GAUGES),
        ]:
            kept = [
                (label, value) for label, _load, engine in loads if (value := getattr(engine, attr, None)) is not None
            ]
            if kept:
                family = kind(name, doc, labels=["engine", "model"])
                for label, value in kept:
                    family.add_metric([label, self.model], value)
                yield family

    @staticmethod
    def _gauges(loads: list[tuple[str, EngineLoad, Engine]], model: str) -> Iterator[GaugeMetricFamily]:
        for name, doc, attr in _GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["engine", "model"])
            for label, load, _engine in loads:
                family.add_metric([label, model], getattr(load, attr))
            yield family


_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)


class RequestMetrics:
    """Per-request latencies the worker sees (GenerateStream), by model and engine.

    Queue and prefill are split at the start of the forward pass that produced the request's first
    token (see ``generate_stream``): with chunked prefill, earlier chunks count as queue time.
    """

    def __init__(self) -> None:
        labels = ["model", "engine"]
        self.queue_time = Histogram(
            "kvmesh_worker_queue_time_seconds",
            "request submitted to the engine -> the pass that produced its first token started",
            labels,
            buckets=_LATENCY_BUCKETS,
        )
        self.prefill_time = Histogram(
            "kvmesh_worker_prefill_time_seconds",
            "the pass that produced a request's first token (its prefill), start to end",
            labels,
            buckets=_LATENCY_BUCKETS,
        )
        self.time_per_output_token = Histogram(
            "kvmesh_worker_time_per_output_token_seconds",
            "first token -> last token, divided by the tokens after the first (requests of 2+ tokens)",
            labels,
            buckets=_TPOT_BUCKETS,
        )


_request_metrics: RequestMetrics | None = None


def request_metrics() -> RequestMetrics:
    """The process's one RequestMetrics (created on first use: one registration per process)."""
    global _request_metrics
    if _request_metrics is None:
        _request_metrics = RequestMetrics()
    return _request_metrics
