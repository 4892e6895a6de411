"""``RouterService.Session``: one long-lived bidi stream per frontend.

The frontend multiplexes every request on it: a ``RouteQuery`` gets exactly one ``RouteDecision``
back, in order; ``LifecycleUpdate`` messages (no answer) move a routed request through its life:

- ``FIRST_TOKEN`` -> the booking's prefill tokens stop counting (``mark_prefill_completed``);
- ``FINISHED`` -> the booking is freed (the request finished, failed or was cancelled), and with it the
  booking of a remote prefill decided with it (``<id>/prefill``) if that one's own FINISHED has not come:
  a frontend that gives up on a query whose decision it never read knows nothing of its prefill.

A message that does not parse (garbage, or a string field that is not UTF-8) is answered with an
INVALID decision without a request id, and the session goes on: it may have been a query.

Request ids are the frontend's: unique among *this session's* active requests (a second query with an
active id is INVALID). Bookings are keyed ``s{session}/{request_id}``, so two frontends may use the
same ids. When the stream ends for any reason (the frontend closed it, crashed, or the connection
died), every booking the session still holds is freed: a dead frontend leaks nothing.

Each decision is computed synchronously inside the stream's handler (select + book never yields), so
decisions of all sessions are serialized on the event loop: no two see the same pre-booking load.

Batching: a ``SessionRequestBatch`` is a run of queries and updates applied in order, each exactly as if
it had come alone; its decisions go back in ``RouteDecisionBatch`` messages, in order (none if it held no
query). One message, unless deciding the batch takes longer than ``flush_after_s`` (1 ms): then the
decisions made so far go out before the next is computed, so that a decision never waits behind more
than about that much of later ones' work. At a thousand engines a decision costs 0.5-2 ms, and a burst of
ten queries answered in one message held the first for all ten. A lone query or update is served the
same way, one decision for one query.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from kvmesh import grpc_services
from kvmesh.v1 import router_pb2

from kvmesh_router.disagg import PREFILL_SUFFIX
from kvmesh_router.state import RouterState
from kvmesh_router.translate import INVALID, ROUTED

__all__ = ["SessionHandler"]

log = logging.getLogger(__name__)

_FIRST_TOKEN = router_pb2.LIFECYCLE_STAGE_FIRST_TOKEN
_FINISHED = router_pb2.LIFECYCLE_STAGE_FINISHED
#: How long a batch's decisions may wait for the rest of the batch before those made so far go out.
FLUSH_AFTER_S = 0.001
_MALFORMED = grpc_services.malformed_details(router_pb2.SessionRequest)


class SessionHandler:
    """Serves Session streams against one :class:`RouterState`."""

    def __init__(
        self, state: RouterState, is_ready: Callable[[], bool] = lambda: True, flush_after_s: float = FLUSH_AFTER_S
    ) -> None:
        self.state = state
        self.is_ready = is_ready
        self.flush_after_s = flush_after_s
        self._ids = itertools.count(1)
        # (stage, known) -> the bound counter: a labels() lookup per update costs more than the update.
        self._counters: dict[tuple[int, bool], Any] = {}

    async def serve(
        self,
        request_iterator: AsyncIterator[router_pb2.SessionRequest],
        context: grpc.aio.ServicerContext[router_pb2.SessionRequest, router_pb2.SessionResponse],
    ) -> AsyncIterator[router_pb2.SessionResponse]:
        if not self.is_ready():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "router replica is warming up; retry shortly")
        state = self.state
        prefix = f"s{next(self._ids)}/"
        active: dict[str, str] = {}  # request id -> booking key
        companions: dict[str, tuple[str, str]] = {}  # a decode booking key -> its remote prefill's (id, key)
        state.sessions += 1
        decide = self._decide
        update = self._update
        flush_after_s = self.flush_after_s
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind is None and grpc_services.is_malformed(message):  # in band: the session goes on
                    response = router_pb2.SessionResponse()
                    response.decision.outcome = INVALID
                    response.decision.message = _MALFORMED
                    state.metrics.observe_decision(state.admission.config.mode, "invalid", 0.0)  # as any invalid
                    yield response
                elif kind == "route":
                    response = router_pb2.SessionResponse()
                    decide(prefix, active, companions, message.route, response.decision)
                    yield response
                elif kind == "lifecycle":
                    update(active, companions, message.lifecycle)
                elif kind == "batch":
                    response = router_pb2.SessionResponse()
                    decisions = response.decision_batch.decisions
                    items = message.batch.requests
                    last = len(items) - 1
                    since = time.perf_counter()
                    for i, item in enumerate(items):
                        inner = item.WhichOneof("kind")
                        if inner == "route":
                            decide(prefix, active, companions, item.route, decisions.add())
                            if i < last and time.perf_counter() - since > flush_after_s:
                                yield response  # the decisions so far, while the rest are computed
                                response = router_pb2.SessionResponse()
                                decisions = response.decision_batch.decisions
                                since = time.perf_counter()
                        elif inner == "lifecycle":
                            update(active, companions, item.lifecycle)
                        # a nested batch is ignored (batches do not nest)
                    if decisions:
                        yield response
        finally:
            state.sessions -= 1
            if active:
                log.info("session %s ended with %d active requests; freeing their bookings", prefix[:-1], len(active))
                for key in active.values():
                    state.finish(key)
                state.metrics.sessions_freed.inc(len(active))

    def _decide(
        self,
        prefix: str,
        active: dict[str, str],
        companions: dict[str, tuple[str, str]],
        query: router_pb2.RouteQuery,
        decision: router_pb2.RouteDecision,
    ) -> None:
        state = self.state
        rid = query.request_id
        if not rid or rid in active:
            decision.request_id = rid
            decision.outcome = INVALID
            decision.message = (
                f"request id {rid!r} is already active on this session" if rid else "request_id is required"
            )
            state.metrics.observe_decision(state.admission.config.mode, "invalid", 0.0)
            return
        key = prefix + rid
        try:
            state.route(key, query, decision)
        except Exception:  # a bug must not take the frontend's whole session down, nor show its text to clients
            log.exception("route query %s failed", rid)
            state.finish(key)
            if rid + PREFILL_SUFFIX not in active:  # (else that key is the session's own request of the id)
                state.finish(key + PREFILL_SUFFIX)  # a remote prefill booked before the failure
            decision.Clear()
            decision.request_id = rid
            decision.outcome = router_pb2.DECISION_OUTCOME_ERROR
            decision.message = "internal router error (logged by the router); the query was not routed"
        if decision.outcome == ROUTED:
            active[rid] = key
            prefill = decision.prefill.request_id  # a remote prefill, booked beside the decode engine
            if prefill:
                active[prefill] = prefill_key = key + prefill[len(rid) :]
                companions[key] = (prefill, prefill_key)

    def _update(
        self, active: dict[str, str], companions: dict[str, tuple[str, str]], update: router_pb2.LifecycleUpdate
    ) -> None:
        stage = update.stage
        if stage == _FIRST_TOKEN:
            key = active.get(update.request_id)
            known = key is not None and self.state.prefill_completed(key)
        elif stage == _FINISHED:
            key = active.pop(update.request_id, None)
            known = key is not None and self.state.finish(key)
            if key is not None and (companion := companions.pop(key, None)) is not None:
                prefill, prefill_key = companion
                if active.get(prefill) == prefill_key:  # the prefill leg's own FINISHED has not come
                    del active[prefill]
                    self.state.finish(prefill_key)
        else:
            return
        counter = self._counters.get((stage, known))
        if counter is None:
            name = "first_token" if stage == _FIRST_TOKEN else "finished"
            counter = self._counters[stage, known] = self.state.metrics.lifecycle.labels(name, "yes" if known else "no")
        counter.inc()
