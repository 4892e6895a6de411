"""Booking replication, the state side: this replica's own bookings as peers see them, and peers' bookings.

:mod:`kvmesh_router.replica_sync` owns the links (the network); this module owns what goes over them.
Own bookings are announced to :class:`BookingListener` s (the replica hub) as they are added, marked and
freed; peer bookings arrive as a snapshot per link, then as events, and are booked into the same slot
tracker under ``p{peer:x}/{key}`` so that peers' traffic counts in load predictions.

Invariants:

- a peer's snapshot replaces everything known about that peer; its link closing drops all of it;
- duplicate adds and marks/frees of unknown ids are no-ops (sync is advisory; the booking TTL is the
  backstop);
- a peer booking for an engine this replica has not seen yet is *parked* and booked when the engine
  appears (:meth:`Bookings.engine_added`); one for an engine that leaves is forgotten;
- every own booking that ends is announced freed, however it ends: FINISHED, the booking TTL, or its
  engine leaving (a peer that saw the engine leave first has parked it, and would keep it for good);
- a peer booking this replica's TTL expired is forgotten with it: a lost free costs no memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from kvmesh.v1 import router_pb2

from kvmesh_router.approx import ApproxIndexer
from kvmesh_router.slot_tracker import Booking, SlotTracker
from kvmesh_router.translate import booking_to_proto

__all__ = ["BookingListener", "Bookings"]


class BookingListener:
    """Receives this replica's own booking changes (the replica hub implements it)."""

    def booking_added(self, key: str, booking: Booking) -> None: ...

    def booking_prefill_completed(self, key: str) -> None: ...

    def booking_freed(self, key: str) -> None: ...


class Bookings:
    """Own booking keys and listeners, and every peer's bookings; see the module docstring."""

    def __init__(
        self,
        slots: SlotTracker,
        engines: Mapping[int, object],
        clock: Callable[[], float],
        approx: ApproxIndexer | None = None,
    ) -> None:
        self.slots = slots
        self.engines = engines
        self.clock = clock
        self.approx = approx
        self.local_keys: set[str] = set()
        # peer id -> {peer's booking key -> what the peer told us} (parked ones included)
        self.peer_bookings: dict[int, dict[str, router_pb2.ActiveBooking]] = {}
        self._listeners: list[BookingListener] = []
        slots.on_expired = self._expired

    def add_listener(self, listener: BookingListener) -> None:
        self._listeners.append(listener)

    # ------------------------------------------------------------------ own bookings

    def added(self, key: str) -> None:
        """``key`` was just booked by a decision of this replica."""
        self.local_keys.add(key)
        if self._listeners:
            booking = self.slots.booking(key)
            assert booking is not None
            for listener in self._listeners:
                listener.booking_added(key, booking)

    def prefill_completed(self, key: str) -> bool:
        if not self.slots.mark_prefill_completed(key):
            return False
        for listener in self._listeners:
            listener.booking_prefill_completed(key)
        return True

    def finish(self, key: str) -> bool:
        """The request ended; False if it had no booking (expired, engine gone, never booked)."""
        was_local = key in self.local_keys
        self.local_keys.discard(key)
        freed = self.slots.free(key)
        if freed or was_local:  # an expired booking still tells peers, so they forget it too
            for listener in self._listeners:
                listener.booking_freed(key)
        return freed

    def _expired(self, keys: list[str]) -> None:
        """The slot tracker's TTL freed ``keys``: announce own ones, forget peers' ones."""
        for key in keys:
            if key in self.local_keys:
                self._forget_own(key)
                continue
            peer, _, rid = key.partition("/")
            try:
                mine = self.peer_bookings.get(int(peer.removeprefix("p"), 16)) if peer.startswith("p") else None
            except ValueError:
                continue
            if mine is not None:
                mine.pop(rid, None)

    def _forget_own(self, key: str) -> None:
        self.local_keys.discard(key)
        for listener in self._listeners:
            listener.booking_freed(key)

    def local_snapshot(self) -> list[router_pb2.ActiveBooking]:
        """This replica's own bookings, as sent first on every sync link."""
        now = self.clock()
        out = []
        stale = []
        for key in self.local_keys:
            booking = self.slots.booking(key)
            if booking is None:  # expired or its engine went away
                stale.append(key)
                continue
            out.append(booking_to_proto(key, booking, now))
        for key in stale:
            self.local_keys.discard(key)
        return out

    # ------------------------------------------------------------------ engines come and go

    def engine_added(self, engine_id: int) -> None:
        """Book the parked peer bookings of a newly seen engine."""
        now = self.clock()
        for peer, mine in list(self.peer_bookings.items()):
            for ab in [ab for ab in mine.values() if ab.engine_id == engine_id]:  # booking may expire others
                self._book_peer(peer, ab, now)

    def engine_removed(self, engine_id: int, dropped: Iterable[str]) -> None:
        """Forget the bookings of an engine that left (``dropped``: the slot tracker's keys of it)."""
        for key in dropped:
            if key in self.local_keys:
                self._forget_own(key)
        for mine in self.peer_bookings.values():  # peers drop these too when they see the engine go
            for rid in [rid for rid, ab in mine.items() if ab.engine_id == engine_id]:
                del mine[rid]

    # ------------------------------------------------------------------ peers

    def apply_peer_snapshot(self, peer: int, snapshot: Iterable[router_pb2.ActiveBooking]) -> None:
        """Replace everything known about ``peer``'s bookings with its snapshot."""
        self.drop_peer(peer)
        mine = self.peer_bookings.setdefault(peer, {})
        now = self.clock()
        for ab in snapshot:
            mine[ab.request_id] = ab
            self._book_peer(peer, ab, now)

    def apply_peer_events(self, peer: int, events: Iterable[router_pb2.BookingEvent]) -> float:
        """Apply a peer's booking events; returns the largest age (seconds) of the added bookings, the
        sync lag."""
        mine = self.peer_bookings.setdefault(peer, {})
        now = self.clock()
        lag = 0.0
        prefix = f"p{peer:x}/"
        for ev in events:
            kind = ev.WhichOneof("kind")
            if kind == "added":
                ab = ev.added
                if ab.request_id in mine:
                    continue
                mine[ab.request_id] = ab
                self._book_peer(peer, ab, now)
                lag = max(lag, ab.age_ms / 1000.0)
            elif kind == "prefill_completed_request_id":
                rid = ev.prefill_completed_request_id
                booked = mine.get(rid)
                if booked is not None:
                    booked.prefill_completed = True
                    self.slots.mark_prefill_completed(prefix + rid)
            elif kind == "freed_request_id":
                rid = ev.freed_request_id
                if mine.pop(rid, None) is not None:
                    self.slots.free(prefix + rid)
        return lag

    def drop_peer(self, peer: int) -> int:
        """Forget every booking of ``peer`` (its link closed, or a new snapshot replaces them)."""
        mine = self.peer_bookings.pop(peer, None)
        if not mine:
            return 0
        prefix = f"p{peer:x}/"
        for rid in mine:
            self.slots.free(prefix + rid)
        return len(mine)

    def _book_peer(self, peer: int, ab: router_pb2.ActiveBooking, now: float) -> None:
        if ab.engine_id not in self.engines:
            return  # parked: applied by engine_added if the engine shows up
        key = f"p{peer:x}/{ab.request_id}"
        started = now - ab.age_ms / 1000.0
        expected = ab.expected_output_tokens or None
        hashes = list(ab.block_hashes)
        self.slots.add_request(key, ab.engine_id, hashes, ab.num_tokens, ab.overlap_blocks, expected, now=started)
        if ab.prefill_completed:
            self.slots.mark_prefill_completed(key)
        if self.approx is not None and hashes:
            # Approximate mode: a peer's routing decision predicts the engine's cache as well as ours.
            self.approx.record(ab.engine_id, hashes, now)  # now, not started: the TTL queue stays ordered
