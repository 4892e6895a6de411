"""KV event ingest: one subscription per engine, contiguous event ids, gap detection and recovery.

An engine's KV events are its cache journal with contiguous ids from 0 (``kv_events.proto``). The
router follows each engine through ``WorkerService.SubscribeKvEvents`` and keeps, per engine, a
cursor: the next event id it expects. :class:`EngineCursor` is the pure state machine (no I/O, unit
tested on its own); :class:`EngineFeed` runs the gRPC streams around it; :class:`Ingest` owns the
feeds of the whole fleet.

Cursor states::

    RESTORING --snapshot--> LIVE --gap--> RECOVERING --replay reaches the buffer / snapshot--> LIVE
        ^                    ^                |  \\--Cleared in the buffered events (barrier)--> LIVE
        |                    +----------------+
        +-- OUT_OF_RANGE, or the recovery buffer overflowed (full restore)

- **RESTORING** (no cursor): the engine was just discovered (or its journal cannot be resumed). The
  subscription asks for no start id, so the worker sends a snapshot of its whole cache first; the
  engine's index entries are replaced by it and the cursor becomes ``snapshot.next_event_id``.
- **LIVE**: an event with the expected id is applied (batched: one loop per message, counters bumped
  once per batch); a smaller id is stale and dropped; a larger id is a **gap**.
- **Gap**: if the event after the gap is ``AllCleared`` it is a barrier: nothing before it matters,
  so the engine is cleared and the cursor jumps past it (no recovery). Otherwise the cursor enters
  RECOVERING: live events keep flowing on the main stream and are *buffered*, while a second,
  short-lived subscription resumes from the first missing id. The worker answers from its replay
  buffer (the missing events, in order) or, if they are gone, with a snapshot. Once the cursor
  reaches the first buffered id (always after the first replay batch or the snapshot, because both
  were produced after the buffered events), the buffer is drained through the LIVE rules (stale
  events dropped, a second gap starts a second recovery) and the recovery stream is cancelled.
- A ``Cleared`` arriving on the main stream *during* a recovery is also a barrier: it bumps the
  recovery epoch (the in-flight recovery's results are discarded), clears the engine and continues
  from the buffered events after it.
- A main stream that breaks (worker restart, network, RESOURCE_EXHAUSTED for a slow reader) is
  re-opened with exponential backoff from the cursor (the worker replays or snapshots); a recovery
  in flight is abandoned and the resume covers it. ``OUT_OF_RANGE`` (the worker's journal is behind
  our cursor: not the engine we followed) forces a full restore.

Everything runs on the router's event loop thread, so applying an event never races a decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from operator import itemgetter

import grpc
from kvmesh.backoff import Backoff
from kvmesh.kv_events import StoredBlock
from kvmesh.v1 import kv_events_pb2, worker_pb2, worker_pb2_grpc

from kvmesh_router.indexer import KvIndexer

__all__ = [
    "EngineCursor",
    "EngineFeed",
    "FeedState",
    "Ingest",
    "IngestStats",
    "WireBlock",
    "apply_event",
    "apply_snapshot",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_BUFFER = 65_536  # buffered live events per recovering engine before falling back to a restore
INITIAL_BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0


class FeedState(enum.Enum):
    RESTORING = "restoring"
    LIVE = "live"
    RECOVERING = "recovering"


@dataclass(slots=True)
class IngestStats:
    """Plain counters over every engine (read by the metrics collector at scrape time)."""

    events: int = 0
    batches: int = 0
    stale: int = 0
    gaps: int = 0
    recovered_replay: int = 0
    recovered_snapshot: int = 0
    recovered_barrier: int = 0
    snapshots: int = 0
    resubscribes: int = 0
    restores: int = 0


class WireBlock(tuple):  # type: ignore[type-arg]
    """A stored block read off the wire: a ``(block_hash, tokens_hash)`` tuple that reads like a
    :class:`~kvmesh.kv_events.StoredBlock`. Building it is a C-level tuple construction, about 3x
    cheaper than the frozen dataclass, and it is built for every block of every event (the hot path)."""

    __slots__ = ()
    block_hash = property(itemgetter(0))
    tokens_hash = property(itemgetter(1))


def wire_blocks(stored: kv_events_pb2.BlocksStored) -> list[StoredBlock]:
    return list(map(WireBlock, zip(stored.block_hashes, stored.tokens_hashes, strict=False)))  # type: ignore[arg-type]


def apply_event(index: KvIndexer, engine_id: int, ev: kv_events_pb2.KvEvent) -> None:
    """Apply one protobuf KV event's payload to the index."""
    kind = ev.WhichOneof("data")
    if kind == "stored":
        s = ev.stored
        index.store(engine_id, s.parent_hash if s.HasField("parent_hash") else None, wire_blocks(s))
    elif kind == "removed":
        index.remove(engine_id, ev.removed.block_hashes)
    elif kind == "cleared":
        index.clear(engine_id)


def apply_snapshot(index: KvIndexer, engine_id: int, stored: Iterable[kv_events_pb2.BlocksStored]) -> None:
    """Replace the engine's index entries by a snapshot's stores."""
    index.clear(engine_id)
    for s in stored:
        index.store(engine_id, s.parent_hash if s.HasField("parent_hash") else None, wire_blocks(s))


class EngineCursor:
    """One engine's position in its journal and the recovery state machine (no I/O).

    The feed calls :meth:`on_snapshot` / :meth:`on_events` for the main stream and
    :meth:`on_recovery_snapshot` / :meth:`on_recovery_events` (tagged with the recovery ``epoch`` it
    started) for the recovery stream; afterwards it compares :attr:`state` and :attr:`epoch` with the
    recovery it runs (start one, or cancel a stale one). ``on_recovered(seconds, method)`` reports each
    completed recovery.
    """

    __slots__ = (
        "_clock",
        "buffer",
        "engine_id",
        "epoch",
        "gap_from",
        "index",
        "max_buffer",
        "next_id",
        "on_recovered",
        "recovery_started",
        "state",
        "stats",
    )

    def __init__(
        self,
        engine_id: int,
        index: KvIndexer,
        stats: IngestStats | None = None,
        *,
        max_buffer: int = DEFAULT_MAX_BUFFER,
        on_recovered: Callable[[float, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine_id = engine_id
        self.index = index
        self.stats = stats if stats is not None else IngestStats()
        self.max_buffer = max_buffer
        self.on_recovered = on_recovered
        self._clock = clock
        self.state = FeedState.RESTORING
        self.next_id: int | None = None
        self.buffer: list[kv_events_pb2.KvEvent] = []
        self.epoch = 0
        self.gap_from = 0
        self.recovery_started = 0.0

    # ------------------------------------------------------------------ main stream

    def on_snapshot(self, snapshot: kv_events_pb2.KvIndexSnapshot) -> None:
        """A snapshot on the main stream (first message of a restore, or of a resume too old to replay)."""
        if self.state is FeedState.RECOVERING:
            self.on_recovery_snapshot(snapshot, self.epoch)
            return
        apply_snapshot(self.index, self.engine_id, snapshot.stored)
        self.next_id = snapshot.next_event_id
        self.stats.snapshots += 1
        if self.state is FeedState.RESTORING:
            self.stats.restores += 1
        self.state = FeedState.LIVE

    def on_events(self, events: Sequence[kv_events_pb2.KvEvent]) -> None:
        """A batch of live events from the main stream."""
        self.stats.batches += 1
        state = self.state
        if state is FeedState.LIVE:
            self._apply_live(events)
        elif state is FeedState.RECOVERING:
            self._buffer_during_recovery(events)
        else:  # RESTORING: nothing to anchor them to until the snapshot arrives
            self.stats.stale += len(events)

    def reset(self) -> None:
        """Forget the cursor: the next subscription must restore from a snapshot."""
        self.state = FeedState.RESTORING
        self.next_id = None
        self.buffer = []
        self.epoch += 1

    def abandon_recovery(self) -> None:
        """The main stream broke during a recovery: drop the buffer; resuming from the gap covers it."""
        if self.state is FeedState.RECOVERING:
            self.state = FeedState.LIVE
            self.next_id = self.gap_from if self.next_id is None else self.next_id
            self.buffer = []
            self.epoch += 1

    def _apply_live(self, events: Sequence[kv_events_pb2.KvEvent], start: int = 0) -> None:
        index = self.index
        engine = self.engine_id
        nxt = self.next_id
        assert nxt is not None
        applied = 0
        stale = 0
        for i in range(start, len(events)):
            ev = events[i]
            eid = ev.event_id
            if eid == nxt:
                apply_event(index, engine, ev)
                nxt += 1
                applied += 1
            elif eid < nxt:
                stale += 1
            else:
                self.stats.gaps += 1
                if ev.HasField("cleared"):  # a barrier: the events we missed cannot matter any more
                    index.clear(engine)
                    nxt = eid + 1
                    applied += 1
                    self.stats.recovered_barrier += 1
                    if self.on_recovered is not None:
                        self.on_recovered(0.0, "barrier")
                    continue
                self.next_id = nxt
                self._count(applied, stale)
                self._start_recovery(events[i:])
                return
        self.next_id = nxt
        self._count(applied, stale)

    def _count(self, applied: int, stale: int) -> None:
        stats = self.stats
        stats.events += applied
        if stale:
            stats.stale += stale

    def _start_recovery(self, pending: Sequence[kv_events_pb2.KvEvent]) -> None:
        self.state = FeedState.RECOVERING
        self.epoch += 1
        assert self.next_id is not None
        self.gap_from = self.next_id
        self.buffer = list(pending)
        self.recovery_started = self._clock()
        log.info(
            "engine %x: KV event gap (expected %d, got %d); recovering",
            self.engine_id,
            self.gap_from,
            pending[0].event_id,
        )

    def _buffer_during_recovery(self, events: Sequence[kv_events_pb2.KvEvent]) -> None:
        barrier = -1
        for i in range(len(events) - 1, -1, -1):
            if events[i].HasField("cleared"):
                barrier = i
                break
        if barrier >= 0:
            # Everything up to the Cleared is irrelevant: abandon the recovery, clear, go on from there.
            ev = events[barrier]
            self.index.clear(self.engine_id)
            self.next_id = ev.event_id + 1
            self.buffer = []
            self.state = FeedState.LIVE
            self.epoch += 1
            self.stats.events += 1
            self.stats.recovered_barrier += 1
            self._recovered("barrier")
            self._apply_live(events, barrier + 1)
            return
        self.buffer.extend(events)
        if len(self.buffer) > self.max_buffer:
            log.warning(
                "engine %x: recovery buffer overflowed (%d events); full restore", self.engine_id, len(self.buffer)
            )
            self.reset()

    # ------------------------------------------------------------------ recovery stream

    def on_recovery_snapshot(self, snapshot: kv_events_pb2.KvIndexSnapshot, epoch: int) -> None:
        if epoch != self.epoch or self.state is not FeedState.RECOVERING:
            return
        apply_snapshot(self.index, self.engine_id, snapshot.stored)
        self.next_id = snapshot.next_event_id
        self.stats.snapshots += 1
        self.stats.recovered_snapshot += 1
        self._finish_recovery("snapshot")

    def on_recovery_events(self, events: Sequence[kv_events_pb2.KvEvent], epoch: int) -> None:
        if epoch != self.epoch or self.state is not FeedState.RECOVERING:
            return
        index = self.index
        engine = self.engine_id
        nxt = self.next_id
        assert nxt is not None
        applied = 0
        target = self.buffer[0].event_id if self.buffer else nxt
        for ev in events:
            eid = ev.event_id
            if eid == nxt:
                apply_event(index, engine, ev)
                nxt += 1
                applied += 1
                if nxt >= target:
                    break
            elif eid > nxt:  # the replay itself has a hole: resume again from where it is
                self.next_id = nxt
                self.stats.events += applied
                self.stats.gaps += 1
                self.epoch += 1
                self.gap_from = nxt
                return
        self.next_id = nxt
        self.stats.events += applied
        if nxt >= target:
            self.stats.recovered_replay += 1
            self._finish_recovery("replay")

    def _finish_recovery(self, method: str) -> None:
        pending = self.buffer
        self.buffer = []
        self.state = FeedState.LIVE
        self.epoch += 1
        self._recovered(method)
        if pending:
            self._apply_live(pending)

    def _recovered(self, method: str) -> None:
        seconds = self._clock() - self.recovery_started
        log.info("engine %x: recovered by %s in %.3f s (next event %s)", self.engine_id, method, seconds, self.next_id)
        if self.on_recovered is not None:
            self.on_recovered(seconds, method)


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
    ) -> None:
        self.engine_id = engine_id
        self.address = address
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
                    if item.HasField("snapshot"):
                        cursor.on_snapshot(item.snapshot)
                        if cursor.state is FeedState.LIVE:
                            self.restored.set()
                    else:
                        cursor.on_events(item.events.events)
                    if cursor.state is FeedState.RESTORING and start is not None:
                        break  # the recovery buffer overflowed: restore from a snapshot
                    if cursor.state is FeedState.RECOVERING or self._recovery is not None:
                        self._sync_recovery()
                    if start is not None and cursor.state is FeedState.LIVE and not self.restored.is_set():
                        self.restored.set()
                log.info("engine %x: KV event stream from %s ended; resubscribing", self.engine_id, self.address)
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.OUT_OF_RANGE:
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
            await backoff.sleep()

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
    ) -> None:
        self.index = index
        self.channel_for = channel_for
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
        feed = EngineFeed(engine_id, address, self.channel_for(address), cursor, max_backoff_s=self.max_backoff_s)
        self.feeds[engine_id] = feed
        feed.start()

    def remove(self, engine_id: int) -> None:
        """Stop following an engine (its index entries are the caller's business)."""
        feed = self.feeds.pop(engine_id, None)
        if feed is not None:
            feed.stop()

    def next_event_id(self, engine_id: int) -> int | None:
        feed = self.feeds.get(engine_id)
        return None if feed is None else feed.cursor.next_id

    def is_restored(self, engine_id: int) -> bool:
        feed = self.feeds.get(engine_id)
        return feed is not None and feed.restored.is_set()

    async def wait_restored(self, engine_ids: Iterable[int], timeout: float) -> list[int]:
        """Wait until every given engine had its first restore; returns those that did not in time."""
        waits = {e: self.feeds[e].restored.wait() for e in engine_ids if e in self.feeds}
        if waits:
            tasks = [asyncio.ensure_future(w) for w in waits.values()]
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                task.cancel()
        return [e for e in waits if not self.is_restored(e)]

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
