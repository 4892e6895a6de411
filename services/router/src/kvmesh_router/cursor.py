"""One engine's KV event cursor: contiguous event ids, gap detection and the recovery state machine (no I/O).

An engine's KV events are its cache journal with contiguous ids from 0 (``kv_events.proto``). The
router follows each engine through ``WorkerService.SubscribeKvEvents`` and keeps, per engine, a
cursor: the next event id it expects. :class:`EngineCursor` is the pure state machine (no I/O, unit
tested on its own); :mod:`kvmesh_router.ingest` runs the gRPC streams around it.

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

Invariants: the index only ever sees an engine's events in id order, each once; the recovery buffer is
bounded (``DEFAULT_MAX_BUFFER``, then a full restore); results of a recovery from an older epoch are
discarded.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import itemgetter

from kvmesh.kv_events import StoredBlock
from kvmesh.v1 import kv_events_pb2

from kvmesh_router.indexer import KvIndexer

__all__ = [
    "DEFAULT_MAX_BUFFER",
    "EngineCursor",
    "FeedState",
    "IngestStats",
    "WireBlock",
    "apply_event",
    "apply_snapshot",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_BUFFER = 65_536  # buffered live events per recovering engine before falling back to a restore


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


class WireBlock(tuple[int, int]):
    """A stored block read off the wire: a ``(block_hash, tokens_hash)`` tuple that reads like a
    :class:`~kvmesh.kv_events.StoredBlock`. Building it is a C-level tuple construction, about 3x
    cheaper than the frozen dataclass, and it is built for every block of every event (the hot path)."""

    __slots__ = ()
    block_hash = property(itemgetter(0))
    tokens_hash = property(itemgetter(1))


def wire_blocks(stored: kv_events_pb2.BlocksStored) -> list[StoredBlock]:
    # WireBlock reads like a StoredBlock (duck typing on the hot path), not a subclass of it
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
