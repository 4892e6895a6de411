"""KV event ingest, the gRPC side: one subscription per engine, around its :class:`EngineCursor`.

:class:`EngineFeed` runs one engine's streams (the main subscription and, during a gap, the recovery
one) and feeds the pure cursor (:mod:`kvmesh_router.cursor`, where the state machine is written down);
:class:`Ingest` owns the feeds of the whole fleet.

A main stream that breaks (worker restart, network, RESOURCE_EXHAUSTED for a slow reader) is re-opened
with jittered exponential backoff (:class:`~kvmesh.backoff.Backoff`) from the cursor (the worker replays
or snapshots); a recovery in flight is abandoned and the resume covers it. ``OUT_OF_RANGE`` (the
worker's journal is behind our cursor: not the engine we followed) forces a full restore.

**Dead engines.** A main stream refused or broken with UNAVAILABLE (the worker process is gone, or
its host unreachable), or ended by the worker, takes every engine at its *address* out of routing at
once (``on_routable(engine_ids, False)``, see :mod:`kvmesh_router.engines`: a worker hosts several
engines and they die together). NOT_FOUND (the worker there does not host the engine: it was
restarted on the same address, with new engines, before the old one's record expired) takes out that
engine. An engine is routable again when a message comes on *its own* stream, or when its feed is
removed; the first one at an address wakes the others' retries there. A slow-subscriber cut
(RESOURCE_EXHAUSTED) or OUT_OF_RANGE says nothing about the engine.

Everything runs on the router's event loop thread, so applying an event never races a decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict

import grpc
from kvmesh.backoff import Backoff
from kvmesh.v1 import worker_pb2, worker_pb2_grpc

from kvmesh_router.cursor import DEFAULT_MAX_BUFFER, EngineCursor, FeedState, IngestStats
from kvmesh_router.indexer import KvIndexer

__all__ = ["EngineFeed", "Ingest"]

log = logging.getLogger(__name__)

INITIAL_BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0
RESTORE_POLL_S = 0.05  # warm-up's check of the feeds it waits for


class EngineFeed:
    """The gRPC side of one engine's ingest: the main subscription and, during a gap, the recovery one."""

    def __init__(
        self,
        engine_id: int,
        address: str,
        channel: grpc.aio.Channel,
        cursor: EngineCursor,
        *,
        max_backoff_s: float = MAX_BACKOFF_S,
        on_link: Callable[[EngineFeed, bool | None], None] = lambda _feed, _up: None,
    ) -> None:
        """``on_link(feed, up)``: a message came (True), the worker is gone (False; ``feed.down_reason``
        says why), or it does not host this engine (None)."""
        self.engine_id = engine_id
        self.down_reason = ""
        self.address = address
        self.on_link = on_link
        self._retry_now = asyncio.Event()
        self.cursor = cursor
        self.stub = worker_pb2_grpc.WorkerServiceStub(channel)
        self.max_backoff_s = max_backoff_s
        self.restored = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._recovery: asyncio.Task[None] | None = None
        self._recovery_epoch = -1

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-feed-{self.engine_id:x}")

    def stop(self) -> None:
        for task in (self._task, self._recovery):
            if task is not None and not task.done():
                task.cancel()

    def retry_now(self) -> None:
        """End the current backoff wait (its worker answers again)."""
        self._retry_now.set()

    async def wait_stopped(self) -> None:
        tasks = [t for t in (self._task, self._recovery) if t is not None]
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ main stream

    async def _run(self) -> None:
        cursor = self.cursor
        stats = cursor.stats
        backoff = Backoff(INITIAL_BACKOFF_S, self.max_backoff_s)
        first = True
        while True:
            if cursor.state is FeedState.RECOVERING:
                self._cancel_recovery()
                cursor.abandon_recovery()
            start = cursor.next_id if cursor.state is not FeedState.RESTORING else None
            request = worker_pb2.SubscribeKvEventsRequest(engine_id=self.engine_id)
            if start is not None:
                request.start_event_id = start
            if not first:
                stats.resubscribes += 1
            first = False
            call = self.stub.SubscribeKvEvents(request)
            try:
                async for item in call:
                    if backoff.attempts:
                        backoff.reset()
                    self.on_link(self, True)
                    if item.HasField("snapshot"):
                        cursor.on_snapshot(item.snapshot)
                        if cursor.state is FeedState.LIVE:
                            self.restored.set()
                    else:
                        cursor.on_events(item.events.events)
                    if cursor.state is FeedState.RESTORING:
                        # The recovery buffer overflowed (a stream's first message, a snapshot when it
                        # has no start id, leaves the cursor LIVE): restore on a fresh subscription.
                        break
                    if cursor.state is FeedState.RECOVERING or self._recovery is not None:
                        self._sync_recovery()
                    if start is not None and cursor.state is FeedState.LIVE and not self.restored.is_set():
                        self.restored.set()
                else:  # the worker ended the stream (it is draining or restarting), not our restore break
                    self.down_reason = "it ended the KV event stream"
                    self.on_link(self, False)
                log.info("engine %x: KV event stream from %s ended; resubscribing", self.engine_id, self.address)
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    # gRPC's own wording names the cause: refused, reset, or a TLS handshake that failed.
                    self.down_reason = f"{code.name}: {exc.details()}"
                    self.on_link(self, False)
                if code == grpc.StatusCode.NOT_FOUND:
                    self.on_link(self, None)
                elif code == grpc.StatusCode.OUT_OF_RANGE:
                    log.warning("engine %x: %s; restoring from a snapshot", self.engine_id, exc.details())
                    cursor.reset()
                elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    log.warning("engine %x: cut as a slow subscriber; resuming from %s", self.engine_id, cursor.next_id)
                else:
                    log.info(
                        "engine %x: KV event stream from %s broke (%s: %s); retrying",
                        self.engine_id,
                        self.address,
                        code.name,
                        exc.details(),
                    )
            finally:
                call.cancel()
            self._retry_now.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._retry_now.wait(), backoff.next_delay())

    # ------------------------------------------------------------------ recovery stream

    def _sync_recovery(self) -> None:
        """Run exactly the recovery the cursor asks for (start a new epoch's, cancel a stale one)."""
        cursor = self.cursor
        if cursor.state is FeedState.RECOVERING:
            if self._recovery is None or self._recovery.done() or self._recovery_epoch != cursor.epoch:
                self._cancel_recovery()
                self._recovery_epoch = cursor.epoch
                self._recovery = asyncio.get_running_loop().create_task(
                    self._recover(cursor.epoch, cursor.gap_from), name=f"kv-recover-{self.engine_id:x}"
                )
        else:
            self._cancel_recovery()

    def _cancel_recovery(self) -> None:
        task = self._recovery
        self._recovery = None
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()

    async def _recover(self, epoch: int, start: int | None) -> None:
        cursor = self.cursor
        backoff = Backoff(INITIAL_BACKOFF_S, self.max_backoff_s)
        while cursor.state is FeedState.RECOVERING and cursor.epoch == epoch:
            request = worker_pb2.SubscribeKvEventsRequest(engine_id=self.engine_id)
            if start is not None:
                request.start_event_id = start
            call = self.stub.SubscribeKvEvents(request)
            try:
                async for item in call:
                    if item.HasField("snapshot"):
                        cursor.on_recovery_snapshot(item.snapshot, epoch)
                    else:
                        cursor.on_recovery_events(item.events.events, epoch)
                    if cursor.epoch != epoch or cursor.state is not FeedState.RECOVERING:
                        break
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.OUT_OF_RANGE:
                    start = None  # cannot resume: take a snapshot
                else:
                    log.info("engine %x: recovery stream failed (%s); retrying", self.engine_id, exc.code().name)
            finally:
                call.cancel()
            if cursor.state is FeedState.RECOVERING and cursor.epoch == epoch:
                await backoff.sleep()
        if self._recovery is asyncio.current_task():
            self._recovery = None
        self._sync_recovery()  # draining the buffer may have found another gap


class Ingest:
    """The KV event feeds of every engine this replica follows."""

    def __init__(
        self,
        index: KvIndexer,
        channel_for: Callable[[str], grpc.aio.Channel],
        *,
        max_buffer: int = DEFAULT_MAX_BUFFER,
        max_backoff_s: float = MAX_BACKOFF_S,
        on_recovered: Callable[[float, str], None] | None = None,
        on_routable: Callable[[Iterable[int], bool], None] = lambda _engine_ids, _routable: None,
    ) -> None:
        self.index = index
        self.channel_for = channel_for
        self.on_routable = on_routable
        self.down: dict[str, set[int]] = {}  # address -> the engines there this ingest took out of routing
        self.max_buffer = max_buffer
        self.max_backoff_s = max_backoff_s
        self.on_recovered = on_recovered
        self.stats = IngestStats()
        self.feeds: dict[int, EngineFeed] = {}

    def add(self, engine_id: int, address: str) -> None:
        """Follow an engine (a full restore first). Re-adding at a new address restarts its feed."""
        feed = self.feeds.get(engine_id)
        if feed is not None:
            if feed.address == address:
                return
            self.remove(engine_id)
        cursor = EngineCursor(
            engine_id, self.index, self.stats, max_buffer=self.max_buffer, on_recovered=self.on_recovered
        )
        feed = EngineFeed(
            engine_id,
            address,
            self.channel_for(address),
            cursor,
            max_backoff_s=self.max_backoff_s,
            on_link=self._link,
        )
        self.feeds[engine_id] = feed
        feed.start()

    def remove(self, engine_id: int) -> None:
        """Stop following an engine (its index entries are the caller's business)."""
        feed = self.feeds.pop(engine_id, None)
        if feed is not None:
            feed.stop()
            down = self.down.get(feed.address)
            if down is not None and engine_id in down:  # nothing left to judge: forget the verdict, quietly
                down.discard(engine_id)  # (its worker did not come back: no "reachable again")
                if not down:
                    del self.down[feed.address]
                self.on_routable((engine_id,), True)

    def _link(self, feed: EngineFeed, up: bool | None) -> None:
        """A feed's news (see :class:`EngineFeed`): runs for every message, so the usual case returns at once."""
        address, engine_id = feed.address, feed.engine_id
        down = self.down.get(address)
        if up and (down is None or engine_id not in down):
            return
        if self.feeds.get(engine_id) is not feed:
            return
        if up:
            assert down is not None
            self._up(address, down, engine_id)
            for other in down:  # the worker answers again: the others there need not wait out their backoff
                self.feeds[other].retry_now()
        elif up is None:
            if down is None or engine_id not in down:
                self.down.setdefault(address, set()).add(engine_id)
                log.warning(
                    "engine %x: the worker at %s does not host it (restarted with new engines?): not routing to it",
                    engine_id,
                    address,
                )
                self.on_routable((engine_id,), False)
        else:
            there = {f.engine_id for f in self.feeds.values() if f.address == address}
            fresh = there - down if down is not None else there
            if fresh:
                self.down.setdefault(address, set()).update(fresh)
                log.warning(
                    "worker %s is unreachable (%s): not routing to its %d engine(s)",
                    address,
                    feed.down_reason,
                    len(fresh),
                )
                self.on_routable(fresh, False)

    def _up(self, address: str, down: set[int], engine_id: int) -> None:
        down.discard(engine_id)
        if not down:
            del self.down[address]
            log.info("worker %s is reachable again: its engines are routable", address)
        self.on_routable((engine_id,), True)

    def next_event_id(self, engine_id: int) -> int | None:
        feed = self.feeds.get(engine_id)
        return None if feed is None else feed.cursor.next_id

    def is_restored(self, engine_id: int) -> bool:
        feed = self.feeds.get(engine_id)
        return feed is not None and feed.restored.is_set()

    async def wait_restored(self, engine_ids: Iterable[int], timeout: float) -> list[int]:
        """Wait until each given engine had its first restore, left the fleet, or is on a worker found
        unreachable; returns those still followed and not restored.

        A dead worker's record outlives it by up to a lease TTL: waiting for its engines kept a restarted
        replica out of service for all of ``timeout`` (no replica at all, for a single router). Such an
        engine is not routed to anyway, and is restored in the background if its worker answers again."""
        engine_ids = list(engine_ids)
        deadline = time.monotonic() + timeout
        waiting = {e for e in engine_ids if e in self.feeds}
        while waiting:
            waiting = {e for e in waiting if e in self.feeds and not self.is_restored(e) and not self._is_down(e)}
            if not waiting or time.monotonic() >= deadline:
                break
            await asyncio.sleep(RESTORE_POLL_S)
        return sorted(e for e in engine_ids if e in self.feeds and not self.is_restored(e))

    def _is_down(self, engine_id: int) -> bool:
        feed = self.feeds[engine_id]
        return engine_id in self.down.get(feed.address, ())

    async def close(self) -> None:
        feeds = list(self.feeds.values())
        self.feeds.clear()
        for feed in feeds:
            feed.stop()
        for feed in feeds:
            with contextlib.suppress(Exception):
                await feed.wait_stopped()

    def stats_dict(self) -> dict[str, int]:
        d = asdict(self.stats)
        recovering = 0
        for feed in list(self.feeds.values()):
            if feed.cursor.state is FeedState.RECOVERING:
                recovering += 1
        d["recovering"] = recovering
        d["feeds"] = len(self.feeds)
        return d
