"""The publisher side of an engine's KV journal: event ids, replay buffer and live subscribers.

Every engine a worker hosts publishes through this module, whatever produces its events (the
mocker's core today, vLLM's ZMQ publisher re-hashed next), so the ``SubscribeKvEvents`` contract
holds for all of them. It plays the role of vLLM's ``distributed/kv_events.py``: events (the
vocabulary is ``kvmesh.kv_events``), a seq-numbered replay buffer (:class:`EventJournal`) and a
publisher (:class:`KvEventPublisher`) in one small module.

Invariants:

- event ids are contiguous per engine from 0, assigned by ``EventJournal.append``: a subscriber
  that sees a jump knows it lost events, and asks ``since(first_missing_id)``; the journal answers
  from its ring buffer, or None once the id has left it (the subscriber then needs a snapshot).
  This is Dynamo's worker-side ``LocalKvIndexer`` buffer (1024 events by default);
- ``KvEventPublisher.subscribe`` reads the replay or snapshot and registers the subscriber in one
  synchronous call, on the loop thread that also calls ``publish``: no gap, no duplicate. Events
  may be journalled before they are published (a pass in progress); a subscription drops the
  ones its replay or snapshot already covered;
- a subscriber that falls ``SUBSCRIBER_QUEUE_PASSES`` batches behind is cut off
  (:class:`SubscriberTooSlow`) and resumes from its next event id.

The journal itself does no I/O (the mocker's I/O-free engine core owns one); only the publisher
touches asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import islice

from kvmesh.kv_events import AllCleared, BlocksRemoved, BlocksStored, CacheDump, EventData, KvEvent, StoredBlock

# A subscriber that falls this many published batches behind is cut off; it resumes from its next id.
SUBSCRIBER_QUEUE_PASSES = 4096

# A buffered event as bytes: the kind, whether it has a parent, the parent, then the block hashes and
# (stored events) the tokens hashes, as little-endian u64. Bytes are never tracked by the garbage
# collector, so neither a full collection (a thousand engines' full journals hold millions of
# entries; measured ~1 s pauses with dataclass entries) nor a young one walks them. (Tuples of ints
# are untracked too, but only once a collection has seen them: while journals fill, every event's
# tuples counted towards the next young collection, whose pause delays every engine in the loop.)
_Packed = bytes
_STORED, _REMOVED, _CLEARED = 0, 1, 2
_HEADER = struct.Struct("<BBQ")


def _u64s(values: Iterable[int]) -> bytes:
    return array("Q", values).tobytes()


def _pack(data: EventData) -> _Packed:
    if isinstance(data, BlocksStored):
        parent = data.parent_hash
        head = _HEADER.pack(_STORED, parent is not None, parent or 0)
        blocks = data.blocks
        return head + _u64s([b.block_hash for b in blocks]) + _u64s([b.tokens_hash for b in blocks])
    if isinstance(data, BlocksRemoved):
        return _HEADER.pack(_REMOVED, False, 0) + _u64s(data.block_hashes)
    return _HEADER.pack(_CLEARED, False, 0)


def _unpack(event_id: int, packed: _Packed) -> KvEvent:
    kind, has_parent, parent = _HEADER.unpack_from(packed)
    values = array("Q")
    values.frombytes(packed[_HEADER.size :])
    if kind == _STORED:
        half = len(values) // 2
        blocks = tuple(map(StoredBlock, values[:half], values[half:]))
        return KvEvent(event_id, BlocksStored(parent if has_parent else None, blocks))
    if kind == _REMOVED:
        return KvEvent(event_id, BlocksRemoved(tuple(values)))
    return KvEvent(event_id, AllCleared())


class EventIdTooNew(ValueError):
    """A subscriber asked for events after an id this engine has not produced yet."""


class EventJournal:
    """Assigns an engine's event ids and keeps the most recent events for subscribers that resume."""

    def __init__(self, capacity: int = 1024) -> None:
        if capacity < 1:
            raise ValueError(f"journal capacity must be >= 1, got {capacity}")
        self._buffer: deque[_Packed] = deque(maxlen=capacity)
        self._next_id = 0

    @property
    def next_event_id(self) -> int:
        """The id the next event will get (= number of events so far)."""
        return self._next_id

    @property
    def first_buffered_id(self) -> int:
        """Oldest id still answerable by ``since`` (== next_event_id when nothing is buffered)."""
        return self._next_id - len(self._buffer)

    def append(self, data: EventData) -> KvEvent:
        event = KvEvent(self._next_id, data)
        self._next_id += 1
        self._buffer.append(_pack(data))
        return event

    def since(self, event_id: int) -> list[KvEvent] | None:
        """Events ``event_id .. next_event_id-1``; None if some of them are no longer buffered.

        ``since(next_event_id)`` is an empty list (the subscriber is up to date); an id beyond it
        raises EventIdTooNew (the subscriber is confused about which engine or epoch it follows).
        """
        if event_id < 0:
            raise ValueError(f"event ids start at 0, got {event_id}")
        if event_id > self._next_id:
            raise EventIdTooNew(f"event id {event_id} is newer than the next event id {self._next_id}")
        first = self.first_buffered_id
        if event_id < first:
            return None
        return [_unpack(i, packed) for i, packed in enumerate(islice(self._buffer, event_id - first, None), event_id)]


class SubscriberTooSlow(Exception):
    """The subscriber's queue overflowed; it must resubscribe from its next event id."""


@dataclass(eq=False)
class KvSubscription:
    """Live KV events of one engine for one subscriber, after its initial replay or snapshot."""

    # The first event id the subscriber has not been given (its replay or snapshot covers the rest).
    next_event_id: int = 0
    queue: asyncio.Queue[list[KvEvent]] = field(default_factory=lambda: asyncio.Queue(SUBSCRIBER_QUEUE_PASSES))
    overflowed: bool = False
    ended: bool = False

    def end(self) -> None:
        """Its stream is to end (the engine's process drains): :meth:`next` returns ``[]`` once the
        events queued so far are read."""
        self.ended = True
        with contextlib.suppress(asyncio.QueueFull):
            self.queue.put_nowait([])  # wakes a reader waiting on the queue

    def push(self, events: list[KvEvent]) -> None:
        if self.overflowed or self.ended:
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
        """The next events, coalesced; ``[]`` once the subscription has ended (see :meth:`end`)."""
        if self.queue.empty():
            if self.ended:
                return []
            if self.overflowed:
                raise SubscriberTooSlow
        events = await self.queue.get()
        if self.queue.empty():
            return events
        events = list(events)  # a batch's list is shared by every subscriber: copy before extending
        while not self.queue.empty():  # coalesce whatever piled up into one message, in linear time
            events.extend(self.queue.get_nowait())
        return events


class KvEventPublisher:
    """Fans one engine's journal out to its live subscribers.

    ``snapshot`` returns the engine's whole cached set as of ``journal.next_event_id``; it is read
    only when a subscriber has no start id or one that has left the replay buffer.
    """

    def __init__(self, journal: EventJournal, snapshot: Callable[[], CacheDump]) -> None:
        self.journal = journal
        self._snapshot = snapshot
        self._subscribers: set[KvSubscription] = set()

    def subscribe(self, start_event_id: int | None) -> tuple[CacheDump | list[KvEvent], KvSubscription]:
        """Initial replay (events from ``start_event_id``) or snapshot, plus the live subscription.

        Synchronous on purpose: nothing can run between reading the journal and registering.
        Raises EventIdTooNew for a start id beyond the next event id.
        """
        replay = self.journal.since(start_event_id) if start_event_id is not None else None
        initial: CacheDump | list[KvEvent] = replay if replay is not None else self._snapshot()
        subscription = KvSubscription(next_event_id=self.journal.next_event_id)
        self._subscribers.add(subscription)
        return initial, subscription

    def unsubscribe(self, subscription: KvSubscription) -> None:
        self._subscribers.discard(subscription)

    def publish(self, events: list[KvEvent]) -> None:
        """Hand journalled events (in id order, non-empty) to every live subscriber."""
        for subscription in self._subscribers:
            subscription.push(events)
