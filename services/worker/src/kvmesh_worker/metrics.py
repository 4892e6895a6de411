"""Prometheus view of the engines, read at scrape time.

A collector reads each engine's load and counters when Prometheus scrapes, instead of updating
gauges on every pass: a thousand engines stepping at full speed then pay nothing for metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvmesh_worker.engine_runner import EngineRunner

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
    def __init__(self, runners: Sequence[EngineRunner]) -> None:
        self.runners = runners

    @classmethod
    def register(cls, runners: Sequence[EngineRunner]) -> EngineCollector:
        collector = cls(runners)
        REGISTRY.register(collector)
        return collector

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        loads = [(f"{r.engine_id:x}", r.core.load(), r) for r in self.runners]
        yield from self._gauges(loads)
        for name, doc, attr in _COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["engine"])
            for engine, _load, runner in loads:
                family.add_metric([engine], getattr(runner, attr))
            yield family

    @staticmethod
    def _gauges(loads: list) -> Iterator[GaugeMetricFamily]:
        for name, doc, attr in _GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["engine"])
            for engine, load, _runner in loads:
                family.add_metric([engine], getattr(load, attr))
            yield family
