"""Prometheus view of the engines, read at scrape time.

A collector reads each engine's load and counters (through the ``Engine`` interface) when
Prometheus scrapes, instead of updating gauges on every pass: a thousand engines stepping at full
speed then pay nothing for metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import REGISTRY
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


class EngineCollector(Collector):
    def __init__(self, engines: Sequence[Engine]) -> None:
        self.engines = engines

    @classmethod
    def register(cls, engines: Sequence[Engine]) -> EngineCollector:
        collector = cls(engines)
        REGISTRY.register(collector)
        return collector

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        loads = [(f"{e.engine_id:x}", e.load(), e) for e in self.engines]
        yield from self._gauges(loads)
        for name, doc, attr in _COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["engine"])
            for label, _load, engine in loads:
                family.add_metric([label], getattr(engine, attr))
            yield family

    @staticmethod
    def _gauges(loads: list[tuple[str, EngineLoad, Engine]]) -> Iterator[GaugeMetricFamily]:
        for name, doc, attr in _GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["engine"])
            for label, load, _engine in loads:
                family.add_metric([label], getattr(load, attr))
            yield family
