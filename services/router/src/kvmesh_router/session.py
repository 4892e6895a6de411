"""``RouterService.Session``: one long-lived bidi stream per frontend.

The frontend multiplexes every request on it: a ``RouteQuery`` gets exactly one ``RouteDecision``
back, in order; ``LifecycleUpdate`` messages (no answer) move a routed request through its life:

- ``FIRST_TOKEN`` -> the booking's prefill tokens stop counting (``mark_prefill_completed``);
- ``FINISHED`` -> the booking is freed (the request finished, failed or was cancelled).

Request ids are the frontend's: unique among *this session's* active requests (a second query with an
active id is INVALID). Bookings are keyed ``s{session}/{request_id}``, so two frontends may use the
same ids. When the stream ends for any reason (the frontend closed it, crashed, or the connection
died), every booking the session still holds is freed: a dead frontend leaks nothing.

Each decision is computed synchronously inside the stream's handler (select + book never yields), so
decisions of all sessions are serialized on the event loop: no two see the same pre-booking load.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from kvmesh.v1 import router_pb2

from kvmesh_router.state import INVALID, ROUTED, RouterState

__all__ = ["SessionHandler"]

log = logging.getLogger(__name__)

_FIRST_TOKEN = router_pb2.LIFECYCLE_STAGE_FIRST_TOKEN
_FINISHED = router_pb2.LIFECYCLE_STAGE_FINISHED


class SessionHandler:
    """Serves Session streams against one :class:`RouterState`."""

    def __init__(self, state: RouterState, is_ready: Callable[[], bool] = lambda: True) -> None:
        self.state = state
        self.is_ready = is_ready
        self._ids = itertools.count(1)

    async def serve(
        self, request_iterator: AsyncIterator[router_pb2.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.SessionResponse]:
        if not self.is_ready():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "router replica is warming up; retry shortly")
        state = self.state
        prefix = f"s{next(self._ids)}/"
        active: dict[str, str] = {}  # request id -> booking key
        lifecycle = state.metrics.lifecycle
        state.sessions += 1
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "route":
                    query = message.route
                    response = router_pb2.SessionResponse()
                    decision = response.decision
                    rid = query.request_id
                    if not rid or rid in active:
                        decision.request_id = rid
                        decision.outcome = INVALID
                        decision.message = (
                            f"request id {rid!r} is already active on this session" if rid else "request_id is required"
                        )
                        state.metrics.observe_decision(state.admission.config.mode, "invalid", 0.0)
                    else:
                        key = prefix + rid
                        try:
                            state.route(key, query, decision)
                        except Exception as exc:  # a bug must not take the frontend's whole session down
                            log.exception("route query %s failed", rid)
                            state.finish(key)
                            decision.outcome = INVALID
                            decision.message = f"internal router error: {exc!r}"
                        if decision.outcome == ROUTED:
                            active[rid] = key
                    yield response
                elif kind == "lifecycle":
                    update = message.lifecycle
                    rid = update.request_id
                    key = active.get(rid)
                    if update.stage == _FIRST_TOKEN:
                        known = key is not None and state.prefill_completed(key)
                        lifecycle.labels("first_token", "yes" if known else "no").inc()
                    elif update.stage == _FINISHED:
                        if key is not None:
                            del active[rid]
                            known = state.finish(key)
                        else:
                            known = False
                        lifecycle.labels("finished", "yes" if known else "no").inc()
        finally:
            state.sessions -= 1
            if active:
                log.info("session %s ended with %d active requests; freeing their bookings", prefix[:-1], len(active))
                for key in active.values():
                    state.finish(key)
                state.metrics.sessions_freed.inc(len(active))
