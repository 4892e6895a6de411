"""What the planner watches, turned into the core's ``Observation`` (the I/O half of the planner).

Sources, each through a contract or a scrape:

- **engines**: worker instance records and model cards in discovery (who exists, pid, role, KV capacity,
  context length), and one ``WorkerService.WatchLoad`` stream per worker process with
  ``forward_pass_metrics`` on (active blocks, queued prefill tokens, waiting/running, per-pass metrics);
- **router**: ``RouterService.GetActiveLoad`` of one router replica per interval (requests booked per engine);
- **traffic and latency**: a scrape of every frontend's Prometheus endpoint (``metrics_address`` in its
  instance record): the deltas over the interval of ``kvmesh_frontend_input_tokens`` /
  ``output_tokens`` (request count, mean ISL and OSL) and ``time_to_first_token_seconds`` /
  ``inter_token_latency_seconds`` (mean TTFT and ITL). A scrape, as Dynamo's planner scrapes Prometheus;
  the frontend has no contract for it and needs none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc
from kvmesh.channels import open_channel
from kvmesh.discovery import (
    Discovery,
    Removed,
    Snapshot,
    apply_watch_event,
    instance_prefix,
    model_prefix,
    parse_model_key,
)
from kvmesh.v1 import discovery_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvmesh_planner.connectors.base import EngineRef
from kvmesh_planner.core.model import EngineObservation, Pool, TrafficObservation

log = logging.getLogger(__name__)

_ROLE: dict[int, Pool] = {
    discovery_pb2.WORKER_ROLE_UNSPECIFIED: "aggregated",
    discovery_pb2.WORKER_ROLE_AGGREGATED: "aggregated",
    discovery_pb2.WORKER_ROLE_PREFILL: "prefill",
    discovery_pb2.WORKER_ROLE_DECODE: "decode",
}
#: WatchLoad failures of a worker going away, restarting or busy: retried quietly ...
_TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED})
#: ... unless they last this long while the worker is still registered: a worker that went away is
#: deregistered within its lease's TTL, so one still unreachable is misconfigured (a certificate the
#: planner does not trust, an address it cannot reach), which gRPC also reports as UNAVAILABLE.
UNREACHABLE_WARN_S = 30.0
_FAMILIES = {
    "kvmesh_frontend_input_tokens": "isl",
    "kvmesh_frontend_output_tokens": "osl",
    "kvmesh_frontend_time_to_first_token_seconds": "ttft",
    "kvmesh_frontend_inter_token_latency_seconds": "itl",
}


@dataclass(slots=True)
class _Totals:
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    started: float | None = None  # the frontend process's start time (the default registry's process collector)


def parse_frontend_metrics(text: str) -> _Totals:
    """Sum and count of each watched histogram, over every label set.

    ValueError if the text does not parse or a watched figure is no finite number: one NaN would make the
    interval's means NaN, and a predictor that learns a NaN forecasts nonsense from then on.
    """
    out = _Totals()
    for family in text_string_to_metric_families(text):
        if family.name == "process_start_time_seconds" and family.samples:
            out.started = family.samples[0].value
            if not math.isfinite(out.started):  # NaN differs from itself: a restart every interval
                raise ValueError(f"process_start_time_seconds is {out.started}")
            continue
        key = _FAMILIES.get(family.name)
        if key is None:
            continue
        for sample in family.samples:
            if not math.isfinite(sample.value) and not sample.name.endswith("_bucket"):
                raise ValueError(f"{sample.name} is {sample.value}")
            if sample.name.endswith("_sum"):
                out.sums[key] = out.sums.get(key, 0.0) + sample.value
            elif sample.name.endswith("_count"):
                out.counts[key] = out.counts.get(key, 0.0) + sample.value
    return out


def growth(before: _Totals, now: _Totals) -> _Totals:
    """One frontend's histograms' growth between two of its scrapes. A new process start time, or a count
    that went down, means the frontend restarted in between: all it has counted since is the growth."""
    restarted = before.started is not None and now.started != before.started
    if restarted or any(now.counts.get(key, 0.0) < count for key, count in before.counts.items()):
        return now
    return _Totals(
        {key: value - before.sums.get(key, 0.0) for key, value in now.sums.items()},
        {key: value - before.counts.get(key, 0.0) for key, value in now.counts.items()},
    )


def traffic_from(growths: Iterable[_Totals], interval_s: float) -> TrafficObservation:
    """The interval's traffic: the frontends' growths (each over this interval) summed."""
    total = _Totals()
    for g in growths:
        _add(total, g)
    sums, counts = total.sums, total.counts
    n_isl, n_osl = counts.get("isl", 0.0), counts.get("osl", 0.0)
    n_ttft, n_itl = counts.get("ttft", 0.0), counts.get("itl", 0.0)
    return TrafficObservation(
        interval_s=interval_s,
        requests=round(n_isl),
        mean_isl=sums.get("isl", 0.0) / n_isl if n_isl else 0.0,
        mean_osl=sums.get("osl", 0.0) / n_osl if n_osl else 0.0,
        ttft_ms=1000 * sums.get("ttft", 0.0) / n_ttft if n_ttft else None,
        itl_ms=1000 * sums.get("itl", 0.0) / n_itl if n_itl else None,
    )


@dataclass(slots=True)
class _Scrape:
    """A frontend's last good scrape, when it was taken, and its growth per second up to it."""

    totals: _Totals
    at: float
    per_second: _Totals | None = None


@dataclass(slots=True)
class _Engine:
    record: discovery_pb2.InstanceRecord
    card: discovery_pb2.ModelCard | None = None
    load: worker_pb2.EngineLoad | None = None


class Observer:
    def __init__(self, discovery: Discovery, namespace: str, unreachable_warn_s: float = UNREACHABLE_WARN_S) -> None:
        self._disc, self._ns = discovery, namespace
        self._unreachable_warn_s = unreachable_warn_s
        self.engines: dict[int, _Engine] = {}
        self._records: dict[str, discovery_pb2.InstanceRecord] = {}
        self._cards: dict[int, discovery_pb2.ModelCard] = {}
        self._streams: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._scrapes: dict[str, _Scrape] = {}
        self._router_active: dict[int, int] = {}
        self.passes = 0
        """Forward passes reported since start (the FPM stream is alive)."""

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._watch_instances()),
            loop.create_task(self._watch_cards()),
        ]

    async def close(self) -> None:
        for task in [*self._tasks, *self._streams.values()]:
            task.cancel()
        for task in [*self._tasks, *self._streams.values()]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # -- discovery ------------------------------------------------------------------------------
    async def _watch_instances(self) -> None:
        async for ev in self._disc.list_and_watch(instance_prefix(self._ns)):
            known = list(self._records)

            def put(key: str, value: bytes) -> None:
                self._records[key] = discovery_pb2.InstanceRecord.FromString(value)

            def delete(key: str) -> None:
                self._records.pop(key, None)

            apply_watch_event(ev, known, put, delete)
            self._sync_engines()

    async def _watch_cards(self) -> None:
        async for ev in self._disc.list_and_watch(model_prefix(self._ns)):
            if isinstance(ev, Snapshot):
                self._cards = {
                    parse_model_key(k).instance_id: discovery_pb2.ModelCard.FromString(v) for k, v in ev.records.items()
                }
            elif isinstance(ev, Removed):
                self._cards.pop(parse_model_key(ev.key).instance_id, None)
            else:
                self._cards[parse_model_key(ev.key).instance_id] = discovery_pb2.ModelCard.FromString(ev.value)
            for eid, engine in self.engines.items():
                engine.card = self._cards.get(eid)

    def records(self, component: str) -> list[discovery_pb2.InstanceRecord]:
        return [r for r in self._records.values() if r.component == component]

    def _sync_engines(self) -> None:
        workers = {r.instance_id: r for r in self.records("worker") if r.endpoint == "engine"}
        for eid in [e for e in self.engines if e not in workers]:
            del self.engines[eid]
        for eid, rec in workers.items():
            if eid in self.engines:
                self.engines[eid].record = rec
            else:
                self.engines[eid] = _Engine(rec, self._cards.get(eid))
        addresses = {r.address for r in workers.values()}
        loop = asyncio.get_running_loop()
        for address in [a for a in self._streams if a not in addresses]:
            self._streams.pop(address).cancel()
        for address in addresses - set(self._streams):
            self._streams[address] = loop.create_task(self._watch_load(address))

    async def _watch_load(self, address: str) -> None:
        """One WatchLoad stream per worker process; reopened while the worker is registered.

        A refusal that retrying will not cure (a role the worker does not accept, a worker without the
        method) is a warning, once per kind: the worker's engines then count as not ready. So is a transient
        failure that lasts ``unreachable_warn_s`` (see ``UNREACHABLE_WARN_S``), once until the watch works."""
        loop = asyncio.get_running_loop()
        warned: grpc.StatusCode | None = None
        failing_since: float | None = None  # first failure since the stream last delivered
        while True:
            try:
                async with open_channel(address, role="worker") as channel:
                    stub = worker_pb2_grpc.WorkerServiceStub(channel)
                    call = stub.WatchLoad(worker_pb2.WatchLoadRequest(forward_pass_metrics=True))
                    async for msg in call:
                        warned, failing_since = None, None  # watching: a later failure is news again
                        for load in msg.loads:
                            engine = self.engines.get(load.engine_id)
                            if engine is not None:
                                engine.load = load
                        self.passes += len(msg.passes)
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                now = loop.time()
                failing_since = now if failing_since is None else failing_since
                if code in _TRANSIENT and warned is None and now - failing_since >= self._unreachable_warn_s:
                    warned = code
                    self._forget_load(address)
                    log.warning(
                        "cannot watch the load of the worker at %s for %.0f s (%s: %s); its engines are not counted "
                        "as ready",
                        address,
                        now - failing_since,
                        code.name,
                        exc.details(),
                    )
                elif code in _TRANSIENT or code == warned:
                    log.debug("WatchLoad %s: %s", address, code)
                else:
                    warned = code
                    self._forget_load(address)
                    log.warning(
                        "cannot watch the load of the worker at %s (%s: %s); its engines are not counted as ready",
                        address,
                        code.name,
                        exc.details(),
                    )
            await asyncio.sleep(0.5)

    def _forget_load(self, address: str) -> None:
        """The engines at ``address`` are no longer observed: a load they reported before is stale."""
        for engine in self.engines.values():
            if engine.record.address == address:
                engine.load = None

    # -- per-interval polls ---------------------------------------------------------------------
    async def poll_router(self) -> None:
        """The router's active load (requests booked per engine), from the first replica that answers."""
        for rec in self.records("router"):
            try:
                async with open_channel(rec.address, role="router") as channel:
                    stub = router_pb2_grpc.RouterServiceStub(channel)
                    reply = await stub.GetActiveLoad(router_pb2.GetActiveLoadRequest(), timeout=2.0)
            except grpc.aio.AioRpcError:
                continue
            self._router_active = {e.engine_id: e.active_requests for e in reply.engines}
            return

    async def scrape_frontends(self, interval_s: float) -> TrafficObservation | None:
        """Traffic over the interval, summed over every frontend; None when no frontend's could be measured.

        Per frontend: its growth since its own last good scrape (a restart resets only its counters),
        scaled to the interval. A frontend whose scrape failed counts at its last known rate; one never
        measured yet, not at all. None (the planner holds) when no frontend was measured this interval: a
        failed scrape is no evidence of zero traffic, and reading it so shrank a busy pool to its minimum."""
        addresses = sorted({r.metrics_address for r in self.records("frontend") if r.metrics_address})
        for gone in self._scrapes.keys() - set(addresses):
            del self._scrapes[gone]
        if not addresses:
            return None
        texts = await asyncio.gather(*(asyncio.to_thread(_fetch, a) for a in addresses), return_exceptions=True)
        now = time.monotonic()
        growths: list[_Totals] = []
        measured = False
        for address, text in zip(addresses, texts, strict=True):
            last = self._scrapes.get(address)
            if not isinstance(text, BaseException):
                try:
                    totals = parse_frontend_metrics(text)
                except ValueError as exc:  # what it exports cannot be read: a failed scrape
                    log.warning("frontend metrics at %s are unusable: %s", address, exc)
                    text = exc
            if isinstance(text, BaseException):
                log.debug("scrape %s: %s", address, text)
                if last is not None and last.per_second is not None:
                    growths.append(_scaled(last.per_second, interval_s))
                continue
            scrape = self._scrapes[address] = _Scrape(totals, now)
            if last is not None and now > last.at:
                scrape.per_second = _scaled(growth(last.totals, totals), 1.0 / (now - last.at))
                growths.append(_scaled(scrape.per_second, interval_s))
                measured = True
        return traffic_from(growths, interval_s) if measured else None

    # -- the core's view ------------------------------------------------------------------------
    def engine_observations(self) -> tuple[EngineObservation, ...]:
        out = []
        for eid, e in sorted(self.engines.items()):
            if e.load is None:
                continue
            bs = e.card.block_size if e.card is not None and e.card.block_size else 64
            ctx = e.card.context_length if e.card is not None and e.card.context_length else e.load.total_blocks * bs
            out.append(
                EngineObservation(
                    engine_id=eid,
                    pool=_ROLE.get(e.record.role, "aggregated"),
                    kv_active_tokens=e.load.active_blocks * bs,
                    kv_total_tokens=e.load.total_blocks * bs,
                    queued_prefill_tokens=e.load.queued_prefill_tokens,
                    context_length=ctx,
                    running=e.load.running,
                    waiting=e.load.waiting,
                    router_active_requests=self._router_active.get(eid, 0),
                )
            )
        return tuple(out)

    def engine_refs(self, observations: Iterable[EngineObservation]) -> list[EngineRef]:
        """Registered engines, least loaded first (the drain order)."""
        refs = []
        for o in observations:
            rec = self.engines[o.engine_id].record
            load = o.kv_utilization + o.prefill_queue_ratio + o.router_active_requests + o.running + o.waiting
            refs.append(EngineRef(o.engine_id, o.pool, rec.pid, rec.hostname, load))
        return sorted(refs, key=lambda r: (r.load, r.engine_id))

    def registered_pids(self) -> set[int]:
        return {e.record.pid for e in self.engines.values()}


def _fetch(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=2.0) as reply:
        return str(reply.read().decode())


def _scaled(totals: _Totals, factor: float) -> _Totals:
    return _Totals({k: v * factor for k, v in totals.sums.items()}, {k: v * factor for k, v in totals.counts.items()})


def _add(into: _Totals, more: _Totals) -> None:
    for k, v in more.sums.items():
        into.sums[k] = into.sums.get(k, 0.0) + v
    for k, v in more.counts.items():
        into.counts[k] = into.counts.get(k, 0.0) + v
