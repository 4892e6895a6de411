"""The engine's KV event journal: assigns event ids and keeps the most recent events for resumption.

Event ids are contiguous per engine from 0, so a subscriber that sees a jump knows it lost events.
It then asks ``since(first_missing_id)``: the journal answers from its ring buffer, or None when the
id has already left the buffer (the subscriber must take a full ``dump_cache()`` instead). This is
Dynamo's worker-side ``LocalKvIndexer`` buffer (1024 events by default).
"""

from __future__ import annotations

from collections import deque
from itertools import islice

from kvmesh.kv_events import EventData, KvEvent


class EventIdTooNew(ValueError):
    """A subscriber asked for events after an id this engine has not produced yet."""


class EventJournal:
    def __init__(self, capacity: int = 1024) -> None:
        if capacity < 1:
            raise ValueError(f"journal capacity must be >= 1, got {capacity}")
        self._buffer: deque[KvEvent] = deque(maxlen=capacity)
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
        self._buffer.append(event)
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
        return list(islice(self._buffer, event_id - first, None))
