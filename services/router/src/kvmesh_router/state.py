"""The router replica's mutable state: engines, prefix index, slot tracker, admission, bookings.

Everything that changes routing state goes through :class:`RouterState`, on the daemon's one event
loop thread, without awaiting in between (so a decision's select + book is atomic, and events, peers
and sessions never interleave inside one update). The modules around it only translate:

- :mod:`kvmesh_router.fleet` calls :meth:`add_engine` / :meth:`remove_engine` from discovery;
- :mod:`kvmesh_router.ingest` applies KV events to :attr:`kv_index` (event mode);
- :mod:`kvmesh_router.session` calls :meth:`route` / :meth:`prefill_completed` / :meth:`finish`;
- :mod:`kvmesh_router.replica_sync` listens to local booking changes (:meth:`add_listener`) and feeds
  peer bookings in (:meth:`apply_peer_snapshot`, :meth:`apply_peer_events`, :meth:`drop_peer`).

Booking keys in the slot tracker are namespaced so that ids never collide: ``s{session}/{request_id}``
for this replica's own bookings (request ids are only unique within one frontend session) and
``p{peer:x}/{key}`` for a peer's.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from kvmesh.v1 import router_pb2

from kvmesh_router.admission import (
    Admission,
    BusyThresholds,
    Decision,
    EngineSpec,
    Rejection,
    RejectReason,
    RouteRequest,
)
from kvmesh_router.approx import ApproxIndexer
from kvmesh_router.cost import RouterConfigOverride, RouterPolicyConfig
from kvmesh_router.indexer import KvIndexer
from kvmesh_router.metrics import RouterMetrics
from kvmesh_router.selection import RoutingError, UnknownEngineError
from kvmesh_router.settings import RouterSettings
from kvmesh_router.slot_tracker import Booking, SlotTracker

__all__ = ["BookingListener", "EngineInfo", "RouterSettings", "RouterState", "TimedIndex"]

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16

_PB_MODES = {
    router_pb2.ROUTER_MODE_KV: "kv",
    router_pb2.ROUTER_MODE_ROUND_ROBIN: "round_robin",
    router_pb2.ROUTER_MODE_RANDOM: "random",
    router_pb2.ROUTER_MODE_POWER_OF_TWO: "power_of_two",
    router_pb2.ROUTER_MODE_DIRECT: "direct",
}
ROUTED = router_pb2.DECISION_OUTCOME_ROUTED
REJECTED = router_pb2.DECISION_OUTCOME_REJECTED
NO_ENGINE = router_pb2.DECISION_OUTCOME_NO_ENGINE
INVALID = router_pb2.DECISION_OUTCOME_INVALID
_OUTCOME_NAMES = {ROUTED: "routed", REJECTED: "rejected", NO_ENGINE: "no_engine", INVALID: "invalid"}


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """A routable engine as discovery describes it (instance record + model card)."""

    engine_id: int
    model: str
    address: str
    block_size: int
    total_blocks: int
    max_num_batched_tokens: int | None = None
    kv_events: bool = True


class TimedIndex:
    """Wraps a prefix index to time ``find_matches``; everything else passes through."""

    __slots__ = ("_index", "_observe")

    def __init__(self, index: KvIndexer | ApproxIndexer, observe: Callable[[float], None]) -> None:
        self._index = index
        self._observe = observe

    def find_matches(self, seq_hashes: Sequence[int]) -> dict[int, int]:
        t0 = time.perf_counter()
        out = self._index.find_matches(seq_hashes)
        self._observe(time.perf_counter() - t0)
        return out

    def __getattr__(self, name: str) -> object:
        return getattr(self._index, name)


class BookingListener:
    """Receives this replica's own booking changes (the replica hub implements it)."""

    def booking_added(self, key: str, booking: Booking) -> None: ...

    def booking_prefill_completed(self, key: str) -> None: ...

    def booking_freed(self, key: str) -> None: ...


class RouterState:
    """See the module docstring."""

    def __init__(
        self,
        settings: RouterSettings | None = None,
        metrics: RouterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = s = settings or RouterSettings()
        self.metrics = metrics or RouterMetrics()
        self.clock = clock
        self.kv_index: KvIndexer | None = None
        self.approx: ApproxIndexer | None = None
        if s.kv_events:
            self.kv_index = KvIndexer(max_entries=s.index_max_blocks)
            index = TimedIndex(self.kv_index, self.metrics.find_matches_latency.observe)
            predictor = None
        else:
            self.approx = ApproxIndexer(ttl_s=s.approx_ttl_s, max_entries=s.index_max_blocks or (1 << 20))
            index = TimedIndex(self.approx, self.metrics.find_matches_latency.observe)
            predictor = index  # the same object: admission records every decision as predicted blocks
        self.slots = SlotTracker(DEFAULT_BLOCK_SIZE, expiry_s=s.booking_ttl_s)
        self.admission = Admission(
            index,  # type: ignore[arg-type]
            self.slots,
            config=RouterPolicyConfig(
                mode=s.mode,
                cost_policy=s.cost_policy,
                overlap_score_weight=s.overlap_weight,
                temperature=s.temperature,
            ),
            thresholds=BusyThresholds(s.busy_prefill_tokens, s.busy_prefill_frac, s.busy_kv_usage),
            rng=random.Random(s.seed),
            predictor=predictor,  # type: ignore[arg-type]
        )
        self.engines: dict[int, EngineInfo] = {}
        self._by_model: dict[str, frozenset[int]] = {}
        self.local_keys: set[str] = set()
        # peer id -> {peer's booking key -> what the peer told us}; applied to the slot tracker when the
        # engine is known here (a booking for an engine not yet seen in discovery is parked until it is).
        self.peer_bookings: dict[int, dict[str, router_pb2.ActiveBooking]] = {}
        self._listeners: list[BookingListener] = []
        self.sessions = 0
        self.metrics.add_source("state", self._stats)
        if self.kv_index is not None:
            self.metrics.add_source("index", self._index_stats)

    # ------------------------------------------------------------------ engines

    def add_engine(self, info: EngineInfo) -> None:
        """Register (or update) a routable engine."""
        old = self.engines.get(info.engine_id)
        self.engines[info.engine_id] = info
        self.admission.add_engine(
            EngineSpec(info.engine_id, max(info.total_blocks, 1), info.block_size, info.max_num_batched_tokens)
        )
        if self.kv_index is not None:
            self.kv_index.add_engine(info.engine_id)
        if old is None or old.model != info.model:
            self._set_model(info.engine_id, old.model if old is not None else None, info.model)
        if old is None:
            self._apply_parked(info.engine_id)

    def remove_engine(self, engine_id: int) -> list[str]:
        """Forget an engine: its index entries, its bookings (returned) and predictions."""
        info = self.engines.pop(engine_id, None)
        if info is None:
            return []
        dropped = self.admission.remove_engine(engine_id)
        if self.kv_index is not None:
            self.kv_index.remove_engine(engine_id)
        for key in dropped:
            self.local_keys.discard(key)
        for mine in self.peer_bookings.values():  # peers drop these too when they see the engine go
            for rid in [rid for rid, ab in mine.items() if ab.engine_id == engine_id]:
                del mine[rid]
        self._set_model(engine_id, info.model, None)
        return dropped

    def engines_for(self, model: str) -> frozenset[int]:
        return self._by_model.get(model, frozenset())

    def _set_model(self, engine_id: int, old: str | None, new: str | None) -> None:
        # Frozensets, replaced (not mutated): a decision holds its model's set as ``allowed_engines``.
        if old is not None:
            rest = self._by_model.get(old, frozenset()) - {engine_id}
            if rest:
                self._by_model[old] = rest
            else:
                self._by_model.pop(old, None)
        if new is not None:
            self._by_model[new] = self._by_model.get(new, frozenset()) | {engine_id}

    # ------------------------------------------------------------------ decisions

    def route(self, key: str, query: router_pb2.RouteQuery, out: router_pb2.RouteDecision) -> str:
        """Decide for ``query`` and book it under ``key``; fills ``out`` and returns the mode used.

        Never raises for a bad query: every problem is an outcome (INVALID, NO_ENGINE, REJECTED).
        """
        t0 = time.perf_counter()
        out.request_id = query.request_id
        mode = self.admission.config.mode
        try:
            mode = self._route(key, query, out, mode)
        finally:
            self.metrics.observe_decision(
                mode,
                _OUTCOME_NAMES.get(out.outcome, "invalid"),
                time.perf_counter() - t0,
                out.overlap_blocks,
                out.best_overlap_blocks,
            )
        return mode

    def _route(self, key: str, query: router_pb2.RouteQuery, out: router_pb2.RouteDecision, mode: str) -> str:
        model = query.model
        if not model:
            return _fail(out, INVALID, "RouteQuery.model is required", mode)
        allowed = self._by_model.get(model)
        if not allowed:
            return _fail(out, NO_ENGINE, f"no live engine serves model {model!r}", mode)
        override: RouterConfigOverride | None = None
        ov = query.overrides
        if query.HasField("overrides"):
            if ov.mode:
                if ov.mode not in _PB_MODES:
                    return _fail(out, INVALID, f"unknown routing mode {ov.mode}", mode)
                mode = _PB_MODES[ov.mode]
            if ov.HasField("overlap_weight") or ov.HasField("temperature") or ov.HasField("policy"):
                override = RouterConfigOverride(
                    cost_policy=ov.policy if ov.HasField("policy") else None,
                    overlap_score_weight=ov.overlap_weight if ov.HasField("overlap_weight") else None,
                    temperature=ov.temperature if ov.HasField("temperature") else None,
                )
        pinned = query.pinned_engine_id if query.HasField("pinned_engine_id") else None
        if pinned is not None:
            mode = "direct"
        elif mode == "direct":
            return _fail(out, INVALID, "ROUTER_MODE_DIRECT needs RouteQuery.pinned_engine_id", mode)
        request = RouteRequest(
            key,
            list(query.block_hashes),
            query.num_tokens,
            query.expected_output_tokens or None,
            pinned,
            allowed,
            frozenset(query.excluded_engine_ids),
            override,
        )
        now = self.clock()
        try:
            result = self._decide(request, mode, now)
        except UnknownEngineError as exc:
            return _fail(out, NO_ENGINE, str(exc), mode)
        except (RoutingError, ValueError) as exc:
            return _fail(out, INVALID, str(exc), mode)
        if isinstance(result, Rejection):
            if result.reason is RejectReason.ALL_BUSY:
                return _fail(out, REJECTED, result.message, mode)
            return _fail(out, NO_ENGINE, result.message, mode)
        assert isinstance(result, Decision)
        info = self.engines[result.engine_id]
        out.outcome = ROUTED
        out.engine_id = result.engine_id
        out.address = info.address
        out.overlap_blocks = result.overlap_blocks
        out.best_overlap_blocks = result.best_overlap_blocks
        out.block_size = info.block_size
        self.local_keys.add(key)
        if self._listeners:
            booking = self.slots.booking(key)
            assert booking is not None
            for listener in self._listeners:
                listener.booking_added(key, booking)
        return result.mode

    def _decide(self, request: RouteRequest, mode: str, now: float) -> Decision | Rejection:
        admission = self.admission
        config = admission.config
        if mode == config.mode or mode == "direct":
            return admission.decide(request, now)
        # Per-request mode: RouterConfigOverride has no ``mode`` (yet), so swap the config for this one
        # synchronous call (nothing else can run in between on the event loop).
        admission.config = replace(config, mode=mode)
        try:
            return admission.decide(request, now)
        finally:
            admission.config = config

    # ------------------------------------------------------------------ lifecycle of own bookings

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

    # ------------------------------------------------------------------ replica sync

    def add_listener(self, listener: BookingListener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: BookingListener) -> None:
        self._listeners.remove(listener)

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

    def apply_peer_snapshot(self, peer: int, snapshot: Iterable[router_pb2.ActiveBooking]) -> None:
        """Replace everything known about ``peer``'s bookings with its snapshot."""
        self.drop_peer(peer)
        mine = self.peer_bookings.setdefault(peer, {})
        now = self.clock()
        for ab in snapshot:
            mine[ab.request_id] = ab
            self._book_peer(peer, ab, now)

    def apply_peer_events(self, peer: int, events: Iterable[router_pb2.BookingEvent]) -> float:
        """Apply a peer's booking events (duplicate adds and unknown ids are no-ops); returns the largest
        age (seconds) of the added bookings, the sync lag."""
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
                ab = mine.get(rid)
                if ab is not None:
                    ab.prefill_completed = True
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
            return  # parked: applied by add_engine if the engine shows up
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

    def _apply_parked(self, engine_id: int) -> None:
        now = self.clock()
        for peer, mine in self.peer_bookings.items():
            for ab in mine.values():
                if ab.engine_id == engine_id:
                    self._book_peer(peer, ab, now)

    # ------------------------------------------------------------------ introspection

    def dump_index(self, engine_ids: Iterable[int] = ()) -> dict[int, list[int]]:
        """``{engine: sorted block hashes}`` the router believes each engine holds (predicted ones in
        approximate mode); every known engine appears, possibly with no blocks."""
        wanted = set(engine_ids) or set(self.engines)
        if self.kv_index is not None:
            held = self.kv_index.canonical()
        else:
            assert self.approx is not None
            self.approx.expire(self.clock())
            held = self.approx.canonical()
        return {e: sorted(held.get(e, ())) for e in sorted(wanted) if e in self.engines or e in held}

    def active_load(self) -> list[tuple[int, int, int, int]]:
        """``(engine, active blocks, active prefill tokens, active requests)`` for every engine."""
        self.slots.expire(self.clock())
        out = []
        for e in sorted(self.engines):
            blocks, prefill, n = self.slots.load(e)
            out.append((e, blocks, prefill, n))
        return out

    def _stats(self) -> dict[str, int]:
        local = len(self.local_keys)
        return {
            "engines": len(self.engines),
            "local_bookings": local,
            "peer_bookings": max(0, len(self.slots) - local),
            "sessions": self.sessions,
        }

    def _index_stats(self) -> dict[str, int]:
        index = self.kv_index
        assert index is not None
        c = index.counters
        return {
            "entries": index.size,
            "blocks": index.num_blocks,
            "max_entries": index.max_entries or 0,
            "evicted_entries": c.evicted_entries,
            "stores_dropped": c.stores_dropped,
            "unknown_removals": c.unknown_removals,
        }


def booking_to_proto(key: str, booking: Booking, now: float) -> router_pb2.ActiveBooking:
    return router_pb2.ActiveBooking(
        request_id=key,
        engine_id=booking.engine_id,
        block_hashes=booking.seq_hashes,
        num_tokens=booking.isl_tokens,
        overlap_blocks=booking.overlap_blocks,
        expected_output_tokens=booking.expected_output_tokens or 0,
        prefill_completed=booking.prefill_tokens == 0,
        age_ms=max(0, int((now - booking.started_at) * 1000)),
    )


def _fail(out: router_pb2.RouteDecision, outcome: int, message: str, mode: str) -> str:
    out.outcome = outcome  # type: ignore[assignment]
    out.message = message
    return mode
