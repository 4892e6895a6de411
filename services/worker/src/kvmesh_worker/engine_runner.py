"""The mocker engine: drives one I/O-free ``EngineCore`` in real time behind the ``Engine`` interface.

The loop is step → sleep → deliver: a pass's tokens and KV events exist only once the pass is
over, so they are delivered after sleeping the pass's modelled duration (÷ ``speedup_ratio``).
The delivery runs in the timer's own callback, for every pass due at that wakeup, before any
runner computes its next pass: computing a pass is the slow part (tens of microseconds, more for a
prefill), and its result is not needed until its deadline, whereas a delivery is late by whatever
runs before it. With a thousand engines in one loop, runners resuming one after another to
deliver *and* step made the k-th due delivery wait for k-1 steps.
Deadlines are absolute (``next += modelled``), so the time spent in Python does not accumulate as
drift; only after a stall longer than ``MAX_CATCH_UP_S`` (a starved process) does the schedule
restart from now instead of rushing the following passes. The sleeps go through one
``DeadlineTimer`` per event loop (a Linux timerfd): uvloop's own timers round to whole
milliseconds, which alone is ±10-20 % of a 6 ms decode pass. An idle engine awaits a
``Wakeup`` and costs nothing: no polling, so a process can host a thousand of them.

At speedup 0 there is no modelled time to sleep: passes run back to back, each delivered as soon
as it is computed, and the loop yields to the event loop only every ``UNPACED_SLICE_S`` (or
``UNPACED_SLICE_PASSES``), so that consumers find several passes queued and send them as one
message instead of one per token.

KV events go out through ``kvmesh.kv_publisher`` like every engine's. The core journals a pass's
events at ``step()``, before the pass is delivered; the publisher's subscriptions drop what their
replay or snapshot already covered, which keeps "no gap, no duplicate" across a pass in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import heapq
import itertools
import logging
import os
import sys
import time
from collections.abc import Callable

from kvmesh.kv_events import CacheDump, KvEvent
from kvmesh.kv_publisher import KvEventPublisher, KvSubscription
from kvmesh.v1.kv_transfer_pb2 import KvTransferParams, KvTransferReport
from kvmesh.wakeup import Wakeup

from kvmesh_worker.engine import (
    DuplicateRequest,
    EngineCore,
    EngineLoad,
    EngineRequest,
    ForwardPassMetrics,
    InvalidRequest,
    RequestOutput,
    StepOutput,
)
from kvmesh_worker.engines.api import EngineSpec, KvNotHeld, KvPullFailed, OutputSink, PassObserver, Role
from kvmesh_worker.kv_transfer.mocker_kv import MockerKv

log = logging.getLogger(__name__)

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
        self._heap: list[tuple[float, int, asyncio.Future[None], Callable[[], None] | None]] = []
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

    async def sleep_until(self, deadline: float, on_due: Callable[[], None] | None = None) -> None:
        """Return at ``deadline``; ``on_due`` runs at the deadline, in the timer's callback.

        Every ``on_due`` of one wakeup runs before any of the woken sleepers resumes, so work that
        must happen *at* the deadline (a delivery) is not queued behind work that can wait (the
        sleepers' next steps). A sleeper cancelled before its deadline never runs its ``on_due``; an
        ``on_due`` that raises makes its sleeper raise.
        """
        if self._fd < 0:
            delay = deadline - time.monotonic()
            await asyncio.sleep(delay if delay > 0 else 0)
            if on_due is not None:
                on_due()
            return
        if deadline - time.monotonic() <= _TIMER_SLACK_S:
            if on_due is not None:
                on_due()  # due already: at once, then let other tasks run
            await asyncio.sleep(0)
            return
        future = self._loop.create_future()
        heapq.heappush(self._heap, (deadline, next(self._seq), future, on_due))
        if deadline < self._armed_at:
            self._arm(deadline)
        await future

    def _arm(self, deadline: float) -> None:
        self._armed_at = deadline
        value = self._spec.it_value
        value.tv_sec = int(deadline)
        value.tv_nsec = int((deadline - value.tv_sec) * 1e9)
        # _arm runs only on a timer whose __init__ opened the timerfd, so _TIMERFD is not None here.
        if _TIMERFD[1](self._fd, _TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None) != 0:  # type: ignore[index]
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    def _on_fire(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._fd, 8)
        heap = self._heap
        due = time.monotonic() + _TIMER_SLACK_S
        while heap and heap[0][0] <= due:
            _, _, future, on_due = heapq.heappop(heap)
            if future.done():  # a cancelled sleeper leaves its entry behind
                continue
            if on_due is not None:
                try:
                    on_due()
                except Exception as exc:  # the sleeper's own failure, raised where it awaits
                    future.set_exception(exc)
                    continue
            future.set_result(None)
        self._armed_at = float("inf")
        if heap:
            self._arm(heap[0][0])


def _ran_nothing(out: StepOutput) -> bool:
    """A pass that scheduled no request: only a change from outside (``EngineRunner._poke``) can alter the next."""
    return not out.outputs and out.metrics.batch_size == 0 and not out.metrics.num_preempted


class EngineRunner:
    """One mocker engine (an ``Engine``): its real-time loop, request sinks, KV publisher and pass observers."""

    def __init__(
        self,
        engine_id: int,
        core: EngineCore,
        speedup_ratio: float = 1.0,
        role: Role = "aggregated",
        kv: MockerKv | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.core = core
        self.speedup_ratio = speedup_ratio
        # Disaggregation (prefill/decode roles only): holds, pulls and their arena; None when aggregated.
        self.kv = kv
        self._hold_requests: dict[str, EngineRequest] = {}
        config = core.config
        self.spec = EngineSpec(
            kind="mocker",
            role=role,
            block_size=config.block_size,
            context_length=config.context_length,
            total_kv_blocks=config.num_gpu_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_waiting_requests=config.max_waiting_requests or 0,
        )
        self.publisher = KvEventPublisher(core.journal, core.dump_cache)
        self._wakeup = Wakeup()
        self._poked = False  # see ``_poke``
        self._load_listeners: list[Callable[[int], None]] = []
        if kv is not None:
            kv.on_unpinned = self._unpinned
        self._streams: dict[str, OutputSink] = {}
        # A paced pass is computed, then delivered at its deadline: ids aborted in between may be reused by
        # then, so their outputs in that pass are stale and must reach no one (see ``_complete``).
        self._pass_in_flight = False
        self._stale: set[str] = set()
        self._observers: list[PassObserver] = []
        self._task: asyncio.Task[None] | None = None
        self._timer: DeadlineTimer | None = None
        self.passes = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        # Modelled time lost to stalls: each restart of the schedule adds how late the pass started.
        self.schedule_slip_s = 0.0

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = DeadlineTimer.acquire(loop)
        self._task = loop.create_task(self._run(), name=f"engine-{self.engine_id:x}")

    async def wait_dead(self) -> BaseException:
        """Until the engine's loop ends by an error, which it returns (logged). It ends no other way while
        the worker serves, so the worker then exits (``main``) rather than go on SERVING an engine that
        answers nothing: a bug in a pass once left every request of the engine hanging, silently."""
        task = self._task
        assert task is not None, "start() first"
        await asyncio.wait([task])
        error = task.exception() if not task.cancelled() else None
        if error is None:
            error = RuntimeError("the engine loop ended")
        log.critical("engine %x: its loop failed", self.engine_id, exc_info=error)
        return error

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._timer is not None:
            self._timer.release()
            self._timer = None
        if self.kv is not None:
            self.kv.release_all()

    def add_observer(self, observer: PassObserver) -> None:
        self._observers.append(observer)

    def add_load_listener(self, listener: Callable[[int], None]) -> None:
        """Told of load changes no pass reports: KV held for a transfer or pinned by a pull, let go."""
        self._load_listeners.append(listener)

    def _unpinned(self) -> None:
        # A pull's stored blocks, unpinned with no request to run (cancelled mid-transfer, refused): no
        # pass will publish them, so they go out now, in journal order (no pass is running).
        if events := self.core.take_events():
            self.publisher.publish(events)
        self._poke()  # a hold released or expired may let a queued request in
        for listener in self._load_listeners:  # and an idle engine runs no pass to say its blocks are free
            listener(self.engine_id)

    # -- requests -------------------------------------------------------------------------------
    def submit(self, request: EngineRequest, sink: OutputSink) -> None:
        """Queue a request whose outputs go to ``sink``; raises the core's InvalidRequest / QueueFull."""
        kv = self.kv
        if request.hold_kv and self.spec.role != "prefill":  # a decode engine's hold would pin blocks for 30 s
            raise InvalidRequest(
                f"engine {self.engine_id:x} is {self.spec.role}: only --role prefill holds KV for a transfer"
            )
        try:
            if request.request_id in self._streams:  # running, or finished with its last output not delivered yet
                raise DuplicateRequest(f"request id {request.request_id!r} is already in the engine")
            self.core.add_request(request)
        except BaseException:  # refused: the blocks its pull pinned go back
            if kv is not None:
                kv.unpin_request(request.request_id)
            raise
        if kv is not None:
            # A pull's pins end once the request is queued: the blocks stay cached (the most recently used,
            # so evicted last) and its admission finds them; pinning until admission could deadlock a full
            # engine whose queued requests pin the blocks that running ones need.
            kv.unpin_request(request.request_id)
        if request.hold_kv:
            self._hold_requests[request.request_id] = request
        self._streams[request.request_id] = sink
        self._poke()

    def abort(self, request_id: str, sink: OutputSink) -> None:
        """Cancel ``sink``'s request; its blocks are freed at once (the core releases them in ``abort_request``)."""
        if self.kv is not None:
            self.kv.unpin_request(request_id)  # a pull's pins: only the pulling stream's (a submit ends them)
        if self._streams.get(request_id) is not sink:
            return  # not running, or another stream's request of the same id
        del self._streams[request_id]
        self._hold_requests.pop(request_id, None)
        self.core.abort_request(request_id)
        if self._pass_in_flight:
            self._stale.add(request_id)
        self._poke()

    def _poke(self) -> None:
        """What the next pass can do changed (a request came or went, pinned blocks were freed): step again.

        The loop waits instead of stepping after a pass that ran nothing (a queued request that the pinned
        blocks of KV holds keep out, nothing running): stepping on, a prefill engine spun through tens of
        thousands of empty passes a second until the hold ended. ``_poked`` tells it that this pass is
        already stale, since a ``Wakeup`` does not remember a ``set()`` made while nobody waited."""
        self._poked = True
        self._wakeup.set()

    def release_kv(self, transfer_id: str) -> bool:
        if self.kv is None or self.spec.role != "prefill":
            raise KvNotHeld(
                f"engine {self.engine_id:x} is {self.spec.role}: only --role prefill holds KV for transfers"
            )
        return self.kv.release(transfer_id)

    @property
    def kv_reading_blocks(self) -> int | None:
        """Blocks of NIXL reads in flight now; None for an aggregated engine (no such gauge)."""
        return None if self.kv is None else self.kv.reading_blocks

    async def pull_kv(self, request: EngineRequest, params: KvTransferParams) -> KvTransferReport:
        if self.kv is None:
            raise KvPullFailed(
                "FAILED_PRECONDITION", f"engine {self.engine_id:x} is aggregated: it cannot pull KV (--role decode)"
            )
        return await self.kv.pull(request, params)

    # -- KV journal, load -----------------------------------------------------------------------
    def subscribe(self, start_event_id: int | None) -> tuple[CacheDump | list[KvEvent], KvSubscription]:
        return self.publisher.subscribe(start_event_id)

    def unsubscribe(self, subscription: KvSubscription) -> None:
        self.publisher.unsubscribe(subscription)

    def dump_cache(self) -> CacheDump:
        return self.core.dump_cache()

    def load(self) -> EngineLoad:
        return self.core.load()

    # -- the loop -------------------------------------------------------------------------------
    async def _run(self) -> None:
        timer = self._timer
        assert timer is not None, "start() first"
        clock = time.monotonic  # the loop's own clock is whole milliseconds under uvloop
        scale = 1000.0 * self.speedup_ratio
        core, wakeup = self.core, self._wakeup
        while True:
            while not core.has_unfinished():
                await wakeup.wait()
            if scale <= 0:
                await self._run_unpaced(clock)
                continue
            deadline = clock()
            while self.core.has_unfinished():
                started = clock()
                self._poked = False
                out = self.core.step()
                self._pass_in_flight = True
                if started - deadline > MAX_CATCH_UP_S:
                    self.schedule_slip_s += started - deadline
                    deadline = started  # stalled: restart the schedule rather than rush the next passes
                deadline += out.metrics.duration_ms / scale
                await timer.sleep_until(deadline, functools.partial(self._complete, out, started))
                if _ran_nothing(out) and not self._poked:
                    await wakeup.wait()  # see ``_poke``
                    deadline = clock()  # waiting is no stall

    def _complete(self, out: StepOutput, started: float) -> None:
        """The pass is over: deliver its tokens and KV events, then account for it."""
        self._pass_in_flight = False
        outputs = out.outputs
        if self._stale:  # aborted while the pass ran: their ids may belong to new requests by now
            stale, self._stale = self._stale, set()
            outputs = [o for o in outputs if o.request_id not in stale]
        self._deliver(outputs, out.kv_events)
        self._account(out.metrics, time.monotonic() - started)

    async def _run_unpaced(self, clock: Callable[[], float]) -> None:
        """Speedup 0: no modelled time, so passes run back to back in slices of ``UNPACED_SLICE_S``.

        Each pass is delivered as soon as it is computed (there is no time to sleep); the loop
        yields to the event loop only between slices. Consumers that were not scheduled meanwhile
        find several passes queued and send them as one message (GenerateStream sessions and the KV
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
                if now >= slice_end or not core.has_unfinished() or _ran_nothing(out):
                    break
            if _ran_nothing(out):
                await self._wakeup.wait()  # see ``_poke`` (no pass ran since the check: nothing was missed)
            else:
                await asyncio.sleep(0)  # let consumers (and new submissions) run between slices

    def _deliver(self, outputs: list[RequestOutput], events: list[KvEvent]) -> None:
        streams = self._streams
        if self.kv is not None:
            self._deliver_kv(outputs)
        for output in outputs:
            queue = streams.get(output.request_id)
            if queue is None:
                continue  # aborted while the pass ran
            queue.put_nowait(output)
            if output.finished:
                del streams[output.request_id]
        if events:
            self.publisher.publish(events)

    def _deliver_kv(self, outputs: list[RequestOutput]) -> None:
        """A held request's last output carries where its KV is held."""
        kv = self.kv
        assert kv is not None
        holds = self._hold_requests
        for output in outputs:
            if output.finished:
                request = holds.pop(output.request_id, None)
                if request is not None and output.request_id in self._streams:
                    output.kv_transfer = kv.hold(request)

    def _account(self, metrics: ForwardPassMetrics, wall_s: float) -> None:
        self.passes += 1
        self.prefill_tokens += metrics.prefill_tokens
        self.decode_tokens += metrics.decode_tokens
        for observer in self._observers:
            observer(self.engine_id, metrics, wall_s)
