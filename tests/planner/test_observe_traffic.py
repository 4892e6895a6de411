"""The planner's traffic figures from scraping the frontends' /metrics (``Observer.scrape_frontends``).

Real discovery (the file backend) and real HTTP: each "frontend" is a Prometheus endpoint serving the
histograms a frontend exports, fed here with known traffic. What must hold: the figures are per
frontend (one frontend restarting resets only its own counters), a frontend whose scrape fails counts
at its last known rate, and when no frontend could be scraped there is no figure at all (the planner
holds) rather than zero traffic (which shrank a busy pool to its minimum).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from kvmesh.discovery import instance_key, open_discovery
from kvmesh.v1 import discovery_pb2
from kvmesh_planner.observe import Observer
from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server

from tests.support.etcd import free_port

INTERVAL_S = 1.0


class _Frontend:
    """The four histograms a frontend exports, on a real HTTP /metrics endpoint."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.start()

    def start(self) -> None:  # a (re)started frontend counts from zero, with a new process start time
        registry = CollectorRegistry()
        names = ("input_tokens", "output_tokens", "time_to_first_token_seconds", "inter_token_latency_seconds")
        self.histograms = [Histogram(f"kvmesh_frontend_{name}", name, registry=registry) for name in names]
        Gauge("process_start_time_seconds", "process start", registry=registry).set(time.time())
        self.server, _ = start_http_server(self.port, addr="127.0.0.1", registry=registry)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def serve(self, requests: int) -> None:
        for _ in range(requests):
            for histogram, value in zip(self.histograms, (1000, 100, 0.05, 0.01), strict=True):
                histogram.observe(value)


class _Planner:
    """Scrapes every INTERVAL_S, as the planner's loop does (whatever the test did in between)."""

    def __init__(self, observer: Observer) -> None:
        self.observer = observer
        self.last = time.monotonic()

    async def scrape(self):
        traffic = await self.observer.scrape_frontends(INTERVAL_S)
        self.last = time.monotonic()
        return traffic

    async def tick(self, *fronts_and_requests: tuple[_Frontend, int]):
        """The rest of one interval: the frontends serve, then the planner scrapes."""
        for front, requests in fronts_and_requests:
            front.serve(requests)
        await asyncio.sleep(max(0.0, self.last + INTERVAL_S - time.monotonic()))
        return await self.scrape()


@contextlib.asynccontextmanager
async def observing(tmp_path: Path, *fronts: _Frontend) -> AsyncIterator[_Planner]:
    """A planner's observer of ``fronts``, registered in discovery as frontends."""
    discovery = await open_discovery(f"file://{tmp_path / 'disc'}", ttl=5)
    observer = Observer(discovery, "ns")
    try:
        lease = await discovery.grant_lease()
        for i, front in enumerate(fronts):
            record = discovery_pb2.InstanceRecord(component="frontend", metrics_address=front.address)
            await lease.put(instance_key("ns", "frontend", f"kserve{i}", lease.id), record.SerializeToString())
        await observer.start()
        async with asyncio.timeout(5):
            while len(observer.records("frontend")) < len(fronts):
                await asyncio.sleep(0.02)
        yield _Planner(observer)
    finally:
        await observer.close()
        for front in fronts:
            front.stop()
        await discovery.close()


async def test_traffic_is_measured_per_frontend_and_a_failed_scrape_is_no_traffic_figure(tmp_path: Path) -> None:
    a, b = _Frontend(free_port()), _Frontend(free_port())
    a.serve(5000)  # lifetime traffic before the planner started: not this interval's
    async with observing(tmp_path, a, b) as planner:
        assert await planner.scrape() is None  # a first scrape measures nothing

        both = await planner.tick((a, 100), (b, 100))
        assert both is not None and both.requests == pytest.approx(200, rel=0.25)
        assert (both.mean_isl, both.mean_osl, both.ttft_ms) == pytest.approx((1000, 100, 50))

        b.stop()  # b's scrape fails: it counts at its last rate
        one_failed = await planner.tick((a, 100))
        assert one_failed is not None and one_failed.requests == pytest.approx(200, rel=0.25)

        b.start()  # b restarted: its counters start over, and a's 5000 of before are no traffic of now
        restarted = await planner.tick((a, 100), (b, 100))
        # b's 100 since it restarted spread over the two intervals since its last good scrape: 100 + 50
        assert restarted is not None and restarted.requests == pytest.approx(150, rel=0.25)

        a.stop()
        b.stop()  # nothing answers: no figure, so the planner holds its pools
        assert await planner.tick() is None


async def test_a_frontend_exporting_a_figure_that_is_no_number_counts_as_a_failed_scrape(tmp_path: Path) -> None:
    """A NaN sum (one NaN observed) made the mean ISL NaN: ticks failed ("cannot convert float NaN to
    integer") or, through the Kalman predictor, poisoned the forecast for good and shrank a steady pool 5 to 1."""
    a = _Frontend(free_port())
    async with observing(tmp_path, a) as planner:
        await planner.scrape()
        assert (await planner.tick((a, 100))).requests == pytest.approx(100, rel=0.25)
        a.histograms[0].observe(float("nan"))
        assert await planner.tick((a, 100)) is None  # as when its scrape fails: no figure, the planner holds
