"""``virtual`` connector: publish the desired pool sizes for an outside orchestrator, which acknowledges them.

Protocol (Dynamo's ``VirtualConnector``, over kvmesh discovery):

1. the planner puts ``PlannerTargets{decision_id, target}`` at ``v1/planner/{ns}/targets`` under its lease
   (the targets vanish with the planner: an orchestrator never acts on a dead planner's wish);
2. the orchestrator scales, then puts ``PlannerTargetsAck{decision_id, actual}`` at ``v1/planner/{ns}/ack``;
3. until the ack for the latest decision arrives (or ``ack_timeout`` passes), the planner holds: the
   decision is still being carried out, and deciding again would count the same engines twice.

:class:`VirtualState` is the protocol's pure part; the offline simulation drives it directly, being the
orchestrator itself (it starts engines after ``--engine-startup-s`` and acknowledges), so the simulation
runs the connector's bookkeeping, not a copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError
from kvmesh.discovery import Added, Discovery, Lease, Snapshot
from kvmesh.v1 import planner_pb2

from kvmesh_planner.connectors.base import EngineRef
from kvmesh_planner.core.model import POOLS, Pool

log = logging.getLogger(__name__)


def targets_key(namespace: str) -> str:
    return f"v1/planner/{namespace}/targets"


def ack_key(namespace: str) -> str:
    return f"v1/planner/{namespace}/ack"


def pool_sizes(sizes: Mapping[Pool, int]) -> planner_pb2.PoolSizes:
    return planner_pb2.PoolSizes(**{p: int(sizes.get(p, 0)) for p in POOLS})


def from_pool_sizes(msg: planner_pb2.PoolSizes) -> dict[Pool, int]:
    return {"aggregated": msg.aggregated, "prefill": msg.prefill, "decode": msg.decode}


@dataclass(slots=True)
class VirtualState:
    """Latest published targets and the orchestrator's latest acknowledgement."""

    published: planner_pb2.PlannerTargets | None = None
    acked: planner_pb2.PlannerTargetsAck | None = None
    published_at: float = 0.0
    _actual: dict[Pool, int] = field(default_factory=dict)

    def publish(self, decision_id: int, target: Mapping[Pool, int], now: float) -> planner_pb2.PlannerTargets:
        self.published = planner_pb2.PlannerTargets(
            decision_id=decision_id, target=pool_sizes(target), unix_ms=int(time.time() * 1000)
        )
        self.published_at = now
        return self.published

    def acknowledge(self, ack: planner_pb2.PlannerTargetsAck) -> None:
        if self.acked is None or ack.decision_id >= self.acked.decision_id:
            self.acked = ack
            self._actual = from_pool_sizes(ack.actual)

    def pending(self, now: float, timeout: float) -> bool:
        """The latest published decision is neither acknowledged nor timed out."""
        if self.published is None:
            return False
        return not self.acknowledged(self.published.decision_id) and now - self.published_at < timeout

    def acknowledged(self, decision_id: int) -> bool:
        return self.acked is not None and self.acked.decision_id >= decision_id

    def desired(self) -> dict[Pool, int]:
        return from_pool_sizes(self.published.target) if self.published is not None else dict(self._actual)

    def actual(self) -> dict[Pool, int]:
        """While the latest decision is unacknowledged, what it asked for (the engines are being brought up or
        drained); once acknowledged, what the orchestrator says it runs (it may not have done it all)."""
        if self.published is not None and (self.acked is None or self.acked.decision_id < self.published.decision_id):
            return self.desired()
        return dict(self._actual)


class VirtualConnector:
    name = "virtual"

    def __init__(self, discovery: Discovery, lease: Lease, namespace: str, ack_timeout: float = 1800.0) -> None:
        self.state = VirtualState()
        self._discovery, self._lease, self._ns = discovery, lease, namespace
        self._ack_timeout = ack_timeout
        self._watch: asyncio.Task[None] | None = None
        self._acked = asyncio.Event()
        self._timed_out: int | None = None  # the decision whose ack timeout was logged

    async def start(self) -> None:
        """Watch the acknowledgements; called at every leadership term, so a previous watch ends first."""
        await self.close()
        self._watch = asyncio.get_running_loop().create_task(self._watch_acks())

    async def _watch_acks(self) -> None:
        async for ev in self._discovery.list_and_watch(ack_key(self._ns)):
            values: list[bytes] = []
            if isinstance(ev, Snapshot):
                values = [v for k, v in ev.records.items() if k == ack_key(self._ns)]
            elif isinstance(ev, Added) and ev.key == ack_key(self._ns):
                values = [ev.value]
            for value in values:
                try:
                    ack = planner_pb2.PlannerTargetsAck.FromString(value)
                except DecodeError:  # one bad record must not end the watch: every later ack would go unheard
                    log.warning("virtual connector: %s holds no PlannerTargetsAck; ignored (the orchestrator's "
                                "next ack replaces it)", ack_key(self._ns))  # fmt: skip
                    continue
                self.state.acknowledge(ack)
                log.info("virtual connector: decision %d acknowledged", ack.decision_id)
                self._acked.set()

    def actual(self) -> dict[Pool, int]:
        return {p: n for p, n in self.state.actual().items() if n or p == "aggregated"}

    def heard_from_orchestrator(self) -> bool:
        """Whether this planner has published targets or read an acknowledgement (else it knows of the
        orchestrator's engines only what registered)."""
        return self.state.published is not None or self.state.acked is not None

    def starting(self, registered_pids: set[int]) -> dict[Pool, int]:
        return {}  # no process of its own: see awaited

    def awaited(self, registered: Mapping[Pool, int]) -> dict[Pool, int]:
        """Engines the targets ask for (unacknowledged) or the orchestrator says it runs, per pool, that have
        not registered: they count as starting, so the pool neither grows again nor shrinks on the capacity
        of the engines already there (a pool asked for engines that never came grew 1 -> 2 -> 3 -> 4, one
        step per ack timeout, on one engine's load)."""
        return {p: n - registered.get(p, 0) for p, n in self.actual().items() if n > registered.get(p, 0)}

    def draining(self) -> dict[Pool, int]:
        return {}

    def pending(self) -> bool:
        waiting = self.state.pending(time.monotonic(), self._ack_timeout)
        published = self.state.published
        timed_out = not waiting and published is not None and not self.state.acknowledged(published.decision_id)
        if timed_out and published is not None and self._timed_out != published.decision_id:
            self._timed_out = published.decision_id
            log.warning(
                "virtual connector: decision %d not acknowledged within --ack-timeout %gs; deciding on, its "
                "engines counted as starting until they register",
                published.decision_id,
                self._ack_timeout,
            )
        return waiting

    async def apply(self, decision_id: int, target: Mapping[Pool, int], engines: Sequence[EngineRef]) -> bool:
        msg = self.state.publish(decision_id, target, time.monotonic())
        # remembered only while the lease lives: a leader paused past its lease leads no more, and its keeper
        # put its old targets back over the new leader's at every check (the pool drained and started an
        # engine every few seconds for as long as both lived)
        await self._lease.put(targets_key(self._ns), msg.SerializeToString(), until_lost=True)
        return True

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch
