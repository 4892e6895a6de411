"""The replica's routing state, composed: engine registry, prefix index, admission, bookings.

:class:`RouterState` is the one writer of routing state. Everything runs on the daemon's one event loop
thread without awaiting inside an update, so a decision's select + book is atomic and events, peers and
sessions never interleave inside one update. Each job lives in its own module; this one only wires them
and keeps them in step:

- :mod:`kvmesh_router.engines`: the engine registry (engines by id, engines per model);
- :mod:`kvmesh_router.admission`: select + book (with :mod:`~kvmesh_router.candidates` and
  :mod:`~kvmesh_router.policies`);
- :mod:`kvmesh_router.translate`: ``RouteQuery`` -> request, decision -> ``RouteDecision``;
- :mod:`kvmesh_router.replication`: own bookings as peers see them, peers' bookings;
- :mod:`kvmesh_router.metrics` / :mod:`kvmesh_router.settings`: what is measured, what is configured.

Callers: :mod:`~kvmesh_router.fleet` (add/remove engines), :mod:`~kvmesh_router.ingest` (events into
:attr:`RouterState.kv_index`), :mod:`~kvmesh_router.session` (route / prefill completed / finish),
:mod:`~kvmesh_router.replica_sync` (:attr:`RouterState.bookings`).

Booking keys in the slot tracker are namespaced so that ids never collide: ``s{session}/{request_id}``
for this replica's own bookings (request ids are only unique within one frontend session) and
``p{peer:x}/{key}`` for a peer's.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable

from kvmesh import telemetry
from kvmesh.v1 import router_pb2

from kvmesh_router.admission import (
    Admission,
    Decision,
    DuplicateRequestError,
    EngineSpec,
    Rejection,
    RejectReason,
    RouteRequest,
)
from kvmesh_router.approx import ApproxIndexer
from kvmesh_router.cost import RouterPolicyConfig
from kvmesh_router.disagg import PREFILL_SUFFIX, PrefillPlace, plan_prefill
from kvmesh_router.engines import EngineInfo, EngineRegistry
from kvmesh_router.indexer import KvIndexer
from kvmesh_router.metrics import RouterMetrics, TimedIndex, index_stats
from kvmesh_router.replication import Bookings
from kvmesh_router.selection import RoutingError, UnknownEngineError
from kvmesh_router.settings import RouterSettings
from kvmesh_router.slot_tracker import SlotTracker
from kvmesh_router.translate import (
    INVALID,
    NO_ENGINE,
    OUTCOME_NAMES,
    REJECTED,
    ROUTED,
    QueryError,
    fail,
    route_request,
)

__all__ = ["RouterState"]

DEFAULT_BLOCK_SIZE = 16
_PLACES = {
    PrefillPlace.REMOTE: router_pb2.PREFILL_PLACE_REMOTE,
    PrefillPlace.LOCAL_SHORT: router_pb2.PREFILL_PLACE_LOCAL_SHORT,
    PrefillPlace.LOCAL_BUSY: router_pb2.PREFILL_PLACE_LOCAL_BUSY,
    PrefillPlace.LOCAL_NO_ENGINE: router_pb2.PREFILL_PLACE_LOCAL_NO_ENGINE,
}


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
            index,
            self.slots,
            config=RouterPolicyConfig(
                mode=s.mode,
                cost_policy=s.cost_policy,
                overlap_score_weight=s.overlap_weight,
                temperature=s.temperature,
            ),
            thresholds=s.busy_thresholds(),
            rng=random.Random(s.seed),
            # TimedIndex passes the DecisionPredictor methods through __getattr__, which mypy cannot see
            predictor=predictor,  # type: ignore[arg-type]
        )
        self.engines = EngineRegistry()
        self.bookings = Bookings(self.slots, self.engines, clock, self.approx)
        self.sessions = 0
        self._last_cost: float | None = None  # of the decision just made (for its trace span)
        self.metrics.add_source("state", self._stats)
        if (kv_index := self.kv_index) is not None:
            self.metrics.add_source("index", lambda: index_stats(kv_index))

    # ------------------------------------------------------------------ engines

    def add_engine(self, info: EngineInfo) -> None:
        """Register (or update) a routable engine."""
        old = self.engines.put(info)
        self.admission.add_engine(
            EngineSpec(
                info.engine_id,
                max(info.total_blocks, 1),
                info.block_size,
                info.max_num_batched_tokens,
                info.role,
                info.max_requests,
            )
        )
        if self.kv_index is not None:
            self.kv_index.add_engine(info.engine_id)
        if old is None:
            self.bookings.engine_added(info.engine_id)

    def remove_engine(self, engine_id: int) -> list[str]:
        """Forget an engine: its index entries, its bookings (returned) and predictions."""
        if self.engines.remove(engine_id) is None:
            return []
        dropped = self.admission.remove_engine(engine_id)
        if self.kv_index is not None:
            self.kv_index.remove_engine(engine_id)
        self.bookings.engine_removed(engine_id, dropped)
        return dropped

    # ------------------------------------------------------------------ decisions

    def route(self, key: str, query: router_pb2.RouteQuery, out: router_pb2.RouteDecision) -> str:
        """Decide for ``query`` and book it under ``key``; fills ``out`` and returns the mode used.

        Never raises for a bad query: every problem is an outcome (INVALID, NO_ENGINE, REJECTED).
        """
        t0 = time.perf_counter()
        out.request_id = query.request_id
        mode = self.admission.config.mode
        # The decision joins the frontend's request trace (its context travels in the query).
        context = query.trace_context
        span = telemetry.start_request_span("kvmesh.router/decision", context) if context else None
        try:
            mode = self._route(key, query, out)
        finally:
            if span is not None:
                self._trace_decision(span, query, out, mode)
            self.metrics.observe_decision(
                mode,
                OUTCOME_NAMES.get(out.outcome, "invalid"),
                time.perf_counter() - t0,
                out.overlap_blocks,
                out.best_overlap_blocks,
            )
        return mode

    def _trace_decision(
        self, span: object, query: router_pb2.RouteQuery, out: router_pb2.RouteDecision, mode: str
    ) -> None:
        """The decision span's attributes: engine, overlap, cost, and the runner-up by overlap."""
        attributes: dict[str, str | int | float] = {
            "kvmesh.request_id": query.request_id,
            "kvmesh.model": query.model,
            "kvmesh.mode": mode,
            "kvmesh.outcome": router_pb2.DecisionOutcome.Name(out.outcome),
        }
        if out.outcome == ROUTED:
            attributes["kvmesh.engine_id"] = f"{out.engine_id:x}"
            attributes["kvmesh.overlap_blocks"] = out.overlap_blocks
            attributes["kvmesh.best_overlap_blocks"] = out.best_overlap_blocks
            if self._last_cost is not None:
                attributes["kvmesh.cost"] = self._last_cost
            # only when tracing: one more index walk, for the engine that came closest on the cache
            overlaps = self.admission.overlaps(list(query.block_hashes))
            others = {e: n for e, n in overlaps.items() if e != out.engine_id}
            if others:
                runner_up = max(others, key=lambda e: (others[e], -e))
                attributes["kvmesh.runner_up_engine_id"] = f"{runner_up:x}"
                attributes["kvmesh.runner_up_overlap_blocks"] = others[runner_up]
        error = None if out.outcome == ROUTED else out.message or "not routed"
        telemetry.end_span(span, error, attributes)

    def _route(self, key: str, query: router_pb2.RouteQuery, out: router_pb2.RouteDecision) -> str:
        admission = self.admission
        mode = admission.config.mode
        model = query.model
        if not model:
            fail(out, INVALID, "RouteQuery.model is required")
            return mode
        allowed = self.engines.for_model(model, query.block_size)
        if not allowed:
            sizes = self.engines.block_sizes(model) if query.block_size else None
            if sizes:
                fail(out, NO_ENGINE, f"no live engine of model {model!r} has block size {query.block_size} "
                                     f"(its engines have {', '.join(map(str, sizes))})")  # fmt: skip
            else:
                fail(out, NO_ENGINE, f"no live engine serves model {model!r}")
            return mode
        try:
            request = route_request(key, query, allowed)
            mode = admission.mode_of(request)
            result = admission.decide(request, self.clock())
        except QueryError as exc:
            fail(out, exc.outcome, exc.message)
            return mode
        except UnknownEngineError as exc:
            fail(out, NO_ENGINE, str(exc))
            return mode
        except (RoutingError, ValueError) as exc:
            fail(out, INVALID, str(exc))
            return mode
        if isinstance(result, Rejection):
            fail(out, REJECTED if result.reason is RejectReason.ALL_BUSY else NO_ENGINE, result.message)
            return mode
        self._last_cost = result.cost
        info = self.engines[result.engine_id]
        out.outcome = ROUTED
        out.engine_id = result.engine_id
        out.address = info.address
        out.overlap_blocks = result.overlap_blocks
        out.best_overlap_blocks = result.best_overlap_blocks
        out.block_size = info.block_size
        self.bookings.added(key)
        if query.HasField("disagg") and request.override is not None and request.override.role == "decode":
            self._plan_prefill(key, query, request, result, info.block_size, out.prefill)
        return result.mode

    def _plan_prefill(
        self,
        key: str,
        query: router_pb2.RouteQuery,
        request: RouteRequest,
        decode: Decision,
        block_size: int,
        out: router_pb2.PrefillDecision,
    ) -> None:
        """Conditional disaggregation (:mod:`kvmesh_router.disagg`), right after the decode booking.

        The placement is counted in ``kvmesh_router_prefill_placements_total{place}``, not as a second
        routing decision: the request was decided once, and a prefill kept local is still served.
        """
        excluded = frozenset(query.disagg.excluded_prefill_engine_ids)
        try:
            plan = plan_prefill(
                self.admission, request, decode, block_size, self.settings.disagg_min_tokens, excluded, self.clock()
            )
        except DuplicateRequestError:  # the session's own request "<id>/prefill" holds the prefill's booking key
            out.place = router_pb2.PREFILL_PLACE_LOCAL_NO_ENGINE
            taken = query.request_id + PREFILL_SUFFIX
            out.reason = f"local: request {taken!r} is active, and a remote prefill of this one needs that id"
            self.metrics.observe_prefill_place("local_id_taken")
            return
        except RoutingError as exc:
            out.place = router_pb2.PREFILL_PLACE_LOCAL_NO_ENGINE
            out.reason = f"local: {exc}"
            self.metrics.observe_prefill_place(PrefillPlace.LOCAL_NO_ENGINE.value)
            return
        out.place = _PLACES[plan.place]
        out.uncached_tokens = plan.uncached_tokens
        out.reason = plan.reason
        self.metrics.observe_prefill_place(plan.place.value)
        chosen = plan.decision
        if chosen is None:
            return
        self.metrics.observe_overlap(chosen.overlap_blocks, chosen.best_overlap_blocks)
        out.engine_id = chosen.engine_id
        out.address = self.engines[chosen.engine_id].address
        out.request_id = query.request_id + PREFILL_SUFFIX
        out.overlap_blocks = chosen.overlap_blocks
        self.bookings.added(key + PREFILL_SUFFIX)

    def prefill_completed(self, key: str) -> bool:
        return self.bookings.prefill_completed(key)

    def finish(self, key: str) -> bool:
        """The request ended; False if it had no booking (expired, engine gone, never booked)."""
        return self.bookings.finish(key)

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
        local = len(self.bookings.local_keys)
        return {
            "engines": len(self.engines),
            "local_bookings": local,
            "peer_bookings": max(0, len(self.slots) - local),
            "sessions": self.sessions,
        }
