"""Drives one I/O-free ``EngineCore`` in real time and fans its outputs out to asyncio consumers.

The loop is step → sleep → deliver: a pass's tokens and KV events exist only once the pass is
over, so they are delivered after sleeping the pass's modelled duration (÷ ``speedup_ratio``;
0 means no sleeping at all). Deadlines are absolute (``next += modelled``), so the time spent in
Python does not accumulate as drift. An idle engine awaits an ``asyncio.Event`` and costs nothing:
no polling, so a process can host a thousand of them.

Subscribers of the KV journal register synchronously together with their snapshot or replay
(the loop and the core share one thread), which is what makes "no gap, no duplicate" hold.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.kv_events import KvEvent

from kvmesh_worker.engine import CacheDump, EngineCore, EngineRequest, ForwardPassMetrics, RequestOutput

log = logging.getLogger(__name__)

# A subscriber that falls this many passes behind is cut off; it resumes from its last event id.
SUBSCRIBER_QUEUE_PASSES = 4096


class SubscriberTooSlow(Exception):
    """The subscriber's queue overflowed; it must resubscribe from its last event id."""


@dataclass(eq=False)
class KvSubscription:
    """Live KV events of one engine for one subscriber, after its initial replay or snapshot."""

    queue: asyncio.Queue[list[KvEvent]] = field(default_factory=lambda: asyncio.Queue(SUBSCRIBER_QUEUE_PASSES))
    overflowed: bool = False

    def push(self, events: list[KvEvent]) -> None:
        if self.overflowed:
            return
        try:
            self.queue.put_nowait(events)
        except asyncio.QueueFull:
            self.overflowed = True  # the reader drains what is queued, then sees the flag

    async def next(self) -> list[KvEvent]:
        if self.overflowed and self.queue.empty():
            raise SubscriberTooSlow
        events = await self.queue.get()
        while not self.queue.empty():  # coalesce whatever piled up into one message
            events = events + self.queue.get_nowait()
        return events


PassObserver = Callable[[int, ForwardPassMetrics, float], None]


class EngineRunner:
    """One engine's real-time loop plus its request streams, KV subscribers and pass observers."""

    def __init__(self, engine_id: int, core: EngineCore, speedup_ratio: float = 1.0) -> None:
        self.engine_id = engine_id
        self.core = core
        self.speedup_ratio = speedup_ratio
        self._wake = asyncio.Event()
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._subscribers: set[KvSubscription] = set()
        self._observers: list[PassObserver] = []
        self._task: asyncio.Task[None] | None = None
        self.passes = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"engine-{self.engine_id:x}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def add_observer(self, observer: PassObserver) -> None:
        self._observers.append(observer)

    # -- requests -------------------------------------------------------------------------------
    def submit(self, request: EngineRequest) -> asyncio.Queue[RequestOutput]:
        """Queue a request; raises the engine's InvalidRequest / QueueFull synchronously."""
        self.core.add_request(request)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request.request_id] = queue
        self._wake.set()
        return queue

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks are freed within one scheduler pass."""
        if self._streams.pop(request_id, None) is not None:
            self.core.abort_request(request_id)
            self._wake.set()

    # -- KV journal -----------------------------------------------------------------------------
    def subscribe(self, start_event_id: int | None) -> tuple[CacheDump | list[KvEvent], KvSubscription]:
        """Initial replay (events from ``start_event_id``) or snapshot, plus the live subscription.

        Synchronous on purpose: nothing can run between reading the journal and registering.
        """
        replay = self.core.events_since(start_event_id) if start_event_id is not None else None
        initial: CacheDump | list[KvEvent] = replay if replay is not None else self.core.dump_cache()
        subscription = KvSubscription()
        self._subscribers.add(subscription)
        return initial, subscription

    def unsubscribe(self, subscription: KvSubscription) -> None:
        self._subscribers.discard(subscription)

    # -- the loop -------------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            deadline = loop.time()
            while self.core.has_unfinished():
                started = loop.time()
                out = self.core.step()
                if self.speedup_ratio > 0:
                    deadline = max(deadline, started) + out.metrics.duration_ms / 1000.0 / self.speedup_ratio
                    delay = deadline - loop.time()
                    await asyncio.sleep(delay if delay > 0 else 0)
                else:
                    await asyncio.sleep(0)  # let consumers run between passes
                self._deliver(out.outputs, out.kv_events)
                self._account(out.metrics, loop.time() - started)

    def _deliver(self, outputs: list[RequestOutput], events: list[KvEvent]) -> None:
        streams = self._streams
        for output in outputs:
            queue = streams.get(output.request_id)
            if queue is None:
                continue  # aborted while the pass ran
            queue.put_nowait(output)
            if output.finished:
                del streams[output.request_id]
        if events:
            for subscription in self._subscribers:
                subscription.push(events)

    def _account(self, metrics: ForwardPassMetrics, wall_s: float) -> None:
        self.passes += 1
        self.prefill_tokens += metrics.prefill_tokens
        self.decode_tokens += metrics.decode_tokens
        for observer in self._observers:
            observer(self.engine_id, metrics, wall_s)
