"""Drives one I/O-free ``EngineCore`` in real time and fans its outputs out to asyncio consumers.

The loop is step → sleep → deliver: a pass's tokens and KV events exist only once the pass is
over, so they are delivered after sleeping the pass's modelled duration (÷ ``speedup_ratio``).
Deadlines are absolute (``next += modelled``), so the time spent in Python does not accumulate as
drift; only after a stall longer than ``MAX_CATCH_UP_S`` (a starved process) does the schedule
restart from now instead of rushing the following passes. The sleeps go through one
``DeadlineTimer`` per event loop (a Linux timerfd): uvloop's own timers round to whole
milliseconds, which alone is ±10-20 % of a 6 ms decode pass. An idle engine awaits an
``asyncio.Event`` and costs nothing: no polling, so a process can host a thousand of them.

At speedup 0 there is no modelled time to sleep: passes run back to back, each delivered as soon
as it is computed, and the loop yields to the event loop only every ``UNPACED_SLICE_S`` (or
``UNPACED_SLICE_PASSES``), so that consumers find several passes queued and send them as one
message instead of one per token.

Subscribers of the KV journal register synchronously together with their snapshot or replay
(the loop and the core share one thread). The journal already holds the events of the pass in
progress (the core records them at ``step()``), so a subscription remembers the first event id its
replay or snapshot did not cover and drops the older ones when that pass is delivered: together
this is what makes "no gap, no duplicate" hold.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import heapq
import itertools
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.kv_events import KvEvent

from kvmesh_worker.engine import CacheDump, EngineCore, EngineRequest, ForwardPassMetrics, RequestOutput

log = logging.getLogger(__name__)

# A subscriber that falls this many passes behind is cut off; it resumes from its last event id.
SUBSCRIBER_QUEUE_PASSES = 4096
# A pass that starts more than this late (the process was starved) restarts the schedule from now.
MAX_CATCH_UP_S = 0.002
# Deadlines this close together are served by one timer wakeup.
_TIMER_SLACK_S = 20e-6
# Speedup 0 (no sleeping): passes run back to back for up to this long (or this many passes) before
# the loop yields to its consumers, so that each yield delivers a batch of tokens, not one.
UNPACED_SLICE_S = 0.001
UNPACED_SLICE_PASSES = 64


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


class _Itimerspec(ctypes.Structure):
    _fields_ = (("it_interval", _Timespec), ("it_value", _Timespec))


def _timerfd_api() -> tuple[Callable[..., int], Callable[..., int]] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        create, settime = libc.timerfd_create, libc.timerfd_settime
    except (OSError, AttributeError):
        return None
    create.argtypes, create.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settime.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p)
    settime.restype = ctypes.c_int
    return create, settime


_TIMERFD = _timerfd_api()
_CLOCK_MONOTONIC, _TFD_NONBLOCK, _TFD_CLOEXEC, _TFD_TIMER_ABSTIME = 1, os.O_NONBLOCK, os.O_CLOEXEC, 1


class DeadlineTimer:
    """Wakes coroutines at absolute ``time.monotonic()`` deadlines, with sub-millisecond precision.

    One per event loop, shared by all its runners: a heap of deadlines and one timerfd (same
    clock as ``time.monotonic``) armed at the earliest, watched by the loop like any socket. No
    deadline, no wakeup. Without timerfd (not Linux) it falls back to the loop's own timers.
    """

    _by_loop: dict[asyncio.AbstractEventLoop, DeadlineTimer] = {}

    @classmethod
    def acquire(cls, loop: asyncio.AbstractEventLoop) -> DeadlineTimer:
        timer = cls._by_loop.get(loop)
        if timer is None:
            timer = cls._by_loop[loop] = cls(loop)
        timer._users += 1
        return timer

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._users = 0
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._armed_at = float("inf")
        self._spec = _Itimerspec()
        self._fd = -1
        if _TIMERFD is not None:
            fd = _TIMERFD[0](_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
            if fd >= 0:
                self._fd = fd
                loop.add_reader(fd, self._on_fire)

    def release(self) -> None:
        self._users -= 1
        if self._users > 0:
            return
        del self._by_loop[self._loop]
        if self._fd >= 0:
            if not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1

    async def sleep_until(self, deadline: float) -> None:
        if self._fd < 0:
            delay = deadline - time.monotonic()
            await asyncio.sleep(delay if delay > 0 else 0)
            return
        if deadline - time.monotonic() <= _TIMER_SLACK_S:
            await asyncio.sleep(0)  # due already: just let other tasks run
            return
        future = self._loop.create_future()
        heapq.heappush(self._heap, (deadline, next(self._seq), future))
        if deadline < self._armed_at:
            self._arm(deadline)
        await future

    def _arm(self, deadline: float) -> None:
        self._armed_at = deadline
        value = self._spec.it_value
        value.tv_sec = int(deadline)
        value.tv_nsec = int((deadline - value.tv_sec) * 1e9)
        if _TIMERFD[1](self._fd, _TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None) != 0:  # type: ignore[index]
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    def _on_fire(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._fd, 8)
        heap = self._heap
        due = time.monotonic() + _TIMER_SLACK_S
        while heap and heap[0][0] <= due:
            future = heapq.heappop(heap)[2]
            if not future.done():  # a cancelled sleeper leaves its entry behind
                future.set_result(None)
        self._armed_at = float("inf")
        if heap:
            self._arm(heap[0][0])


class SubscriberTooSlow(Exception):
    """The subscriber's queue overflowed; it must resubscribe from its last event id."""


@dataclass(eq=False)
class KvSubscription:
    """Live KV events of one engine for one subscriber, after its initial replay or snapshot."""

    # The first event id the subscriber has not been given (its replay or snapshot covers the rest).
    next_event_id: int = 0
    queue: asyncio.Queue[list[KvEvent]] = field(default_factory=lambda: asyncio.Queue(SUBSCRIBER_QUEUE_PASSES))
    overflowed: bool = False

    def push(self, events: list[KvEvent]) -> None:
        if self.overflowed:
            return
        if events[0].event_id < self.next_event_id:  # already in the replay or snapshot (the pass was in progress)
            events = [e for e in events if e.event_id >= self.next_event_id]
            if not events:
                return
        self.next_event_id = events[-1].event_id + 1
        try:
            self.queue.put_nowait(events)
        except asyncio.QueueFull:
            self.overflowed = True  # the reader drains what is queued, then sees the flag

    async def next(self) -> list[KvEvent]:
        if self.overflowed and self.queue.empty():
            raise SubscriberTooSlow
        events = await self.queue.get()
        if self.queue.empty():
            return events
        events = list(events)  # a pass's list is shared by every subscriber: copy before extending
        while not self.queue.empty():  # coalesce whatever piled up into one message, in linear time
            events.extend(self.queue.get_nowait())
        return events


class OutputStream:
    """One request's outputs, in order, for its one consumer: a lean ``asyncio.Queue`` (unbounded).

    Every pass of a busy engine puts one output per running request, so this sits on the hot path;
    it keeps the Queue methods the callers use (``get``, ``get_nowait``, ``put_nowait``, ``empty``,
    ``qsize``) and adds :meth:`get_all`, which takes everything queued in one call.
    """

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque[RequestOutput] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: RequestOutput) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # a cancelled getter leaves its future behind
                waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    def get_nowait(self) -> RequestOutput:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def _wait(self) -> None:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    async def get(self) -> RequestOutput:
        if not self._items:
            await self._wait()
        return self._items.popleft()

    async def get_all(self) -> list[RequestOutput]:
        """Every queued output (at least one: waits for the first)."""
        if not self._items:
            await self._wait()
        items = list(self._items)
        self._items.clear()
        return items


class OutputSink(Protocol):
    """Where the loop delivers a request's outputs, in order, as each pass completes."""

    def put_nowait(self, item: RequestOutput) -> None: ...


PassObserver = Callable[[int, ForwardPassMetrics, float], None]


class EngineRunner:
    """One engine's real-time loop plus its request streams, KV subscribers and pass observers."""

    def __init__(self, engine_id: int, core: EngineCore, speedup_ratio: float = 1.0) -> None:
        self.engine_id = engine_id
        self.core = core
        self.speedup_ratio = speedup_ratio
        self._wake = asyncio.Event()
        self._streams: dict[str, OutputSink] = {}
        self._subscribers: set[KvSubscription] = set()
        self._observers: list[PassObserver] = []
        self._task: asyncio.Task[None] | None = None
        self._timer: DeadlineTimer | None = None
        self.passes = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = DeadlineTimer.acquire(loop)
        self._task = loop.create_task(self._run(), name=f"engine-{self.engine_id:x}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._timer is not None:
            self._timer.release()
            self._timer = None

    def add_observer(self, observer: PassObserver) -> None:
        self._observers.append(observer)

    # -- requests -------------------------------------------------------------------------------
    def submit(self, request: EngineRequest) -> OutputStream:
        """Queue a request whose outputs go to a new stream; raises the engine's InvalidRequest / QueueFull."""
        stream = OutputStream()
        self.submit_to(request, stream)
        return stream

    def submit_to(self, request: EngineRequest, sink: OutputSink) -> None:
        """Queue a request whose outputs go to ``sink`` (a multiplexed stream shares one among its requests)."""
        self.core.add_request(request)
        self._streams[request.request_id] = sink
        self._wake.set()

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
        subscription = KvSubscription(next_event_id=self.core.next_event_id)
        self._subscribers.add(subscription)
        return initial, subscription

    def unsubscribe(self, subscription: KvSubscription) -> None:
        self._subscribers.discard(subscription)

    # -- the loop -------------------------------------------------------------------------------
    async def _run(self) -> None:
        timer = self._timer
        assert timer is not None, "start() first"
        clock = time.monotonic  # the loop's own clock is whole milliseconds under uvloop
        scale = 1000.0 * self.speedup_ratio
        while True:
            await self._wake.wait()
            self._wake.clear()
            if scale <= 0:
                await self._run_unpaced(clock)
                continue
            deadline = clock()
            while self.core.has_unfinished():
                started = clock()
                out = self.core.step()
                if started - deadline > MAX_CATCH_UP_S:
                    deadline = started  # stalled: restart the schedule rather than rush the next passes
                deadline += out.metrics.duration_ms / scale
                await timer.sleep_until(deadline)
                self._deliver(out.outputs, out.kv_events)
                self._account(out.metrics, clock() - started)

    async def _run_unpaced(self, clock: Callable[[], float]) -> None:
        """Speedup 0: no modelled time, so passes run back to back in slices of ``UNPACED_SLICE_S``.

        Each pass is delivered as soon as it is computed (there is no time to sleep); the loop
        yields to the event loop only between slices. Consumers that were not scheduled meanwhile
        find several passes queued and send them as one message (the Generate handler and the KV
        subscribers coalesce what piled up), which is what makes a request at speedup 0 cost a few
        gRPC messages instead of one per token. Requests submitted during a slice join at the next
        pass after it, i.e. within one slice.
        """
        core = self.core
        step, deliver, account = core.step, self._deliver, self._account
        while core.has_unfinished():
            started = clock()
            slice_end = started + UNPACED_SLICE_S
            for _ in range(UNPACED_SLICE_PASSES):
                out = step()
                deliver(out.outputs, out.kv_events)
                now = clock()
                account(out.metrics, now - started)
                started = now
                if now >= slice_end or not core.has_unfinished():
                    break
            await asyncio.sleep(0)  # let consumers (and new submissions) run between slices

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
