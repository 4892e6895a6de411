"""``PlannerService``: the current view (``GetStatus``) and the audit stream of decisions (``WatchDecisions``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
from kvmesh.v1 import planner_pb2, planner_pb2_grpc

from kvmesh_planner.connectors.virtual import pool_sizes
from kvmesh_planner.core.model import Decision


def decision_message(d: Decision, planner_id: int, applied: bool, unix_ms: int) -> planner_pb2.ScalingDecision:
    msg = planner_pb2.ScalingDecision(
        decision_id=d.decision_id,
        unix_ms=unix_ms,
        target=pool_sizes(d.target),
        previous=pool_sizes(d.previous),
        reason=d.reason,
        applied=applied,
        inputs={k: float(v) for k, v in d.inputs.items()},
        mode=d.mode,
        planner_id=planner_id,
        changed=d.changed,
    )
    if d.prediction is not None:
        q = d.prediction
        msg.prediction.CopyFrom(
            planner_pb2.Prediction(
                request_rate=q.request_rate,
                isl=q.isl,
                osl=q.osl,
                ttft_correction=q.ttft_correction,
                itl_correction=q.itl_correction,
                engine_request_rate=q.engine_request_rate,
                predictor=q.predictor,
                engine_request_rates={str(k): float(v) for k, v in q.engine_request_rates.items()},
            )
        )
    return msg


#: Decisions a watcher may have unread before its stream is cut (RESOURCE_EXHAUSTED; it watches again).
WATCH_QUEUE_SIZE = 1024
#: Queued for a watcher that fell behind (never published: an identity, not a decision).
_TOO_SLOW = planner_pb2.ScalingDecision()
_Queue = asyncio.Queue[planner_pb2.ScalingDecision | None]


class PlannerServicer(planner_pb2_grpc.PlannerServiceServicer):
    """Fan-out of decisions to watchers (bounded queues: a slow watcher loses its stream, not the planner)."""

    def __init__(self, status: Callable[[], planner_pb2.GetStatusResponse]) -> None:
        self._status = status
        self._watchers: set[tuple[_Queue, bool]] = set()
        self.latest: planner_pb2.ScalingDecision | None = None

    def publish(self, msg: planner_pb2.ScalingDecision) -> None:
        self.latest = msg
        for queue, all_decisions in list(self._watchers):
            if msg.changed or all_decisions:
                try:
                    queue.put_nowait(msg)
                except asyncio.QueueFull:  # end the slow watcher's stream; it re-subscribes
                    _end(queue, _TOO_SLOW)
                    self._watchers.discard((queue, all_decisions))

    def close(self) -> None:
        for queue, _ in list(self._watchers):
            _end(queue)
        self._watchers.clear()

    async def GetStatus(
        self,
        request: planner_pb2.GetStatusRequest,
        context: grpc.aio.ServicerContext[planner_pb2.GetStatusRequest, planner_pb2.GetStatusResponse],
    ) -> planner_pb2.GetStatusResponse:
        return self._status()

    async def WatchDecisions(
        self,
        request: planner_pb2.WatchDecisionsRequest,
        context: grpc.aio.ServicerContext[planner_pb2.WatchDecisionsRequest, planner_pb2.WatchDecisionsResponse],
    ) -> AsyncIterator[planner_pb2.WatchDecisionsResponse]:
        queue: _Queue = asyncio.Queue(maxsize=WATCH_QUEUE_SIZE)
        entry = (queue, request.include_unchanged)
        self._watchers.add(entry)
        try:
            while True:
                msg = await queue.get()
                if msg is None:
                    return
                if msg is _TOO_SLOW:
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"this watcher fell {WATCH_QUEUE_SIZE} decisions behind; watch again (GetStatus has the last)",
                    )
                yield planner_pb2.WatchDecisionsResponse(decision=msg)
        finally:
            self._watchers.discard(entry)


def _end(queue: _Queue, why: planner_pb2.ScalingDecision | None = None) -> None:
    """Make ``queue``'s watcher end: None at shutdown (status OK, after what it has queued if that leaves room),
    :data:`_TOO_SLOW` when it fell behind (at once)."""
    if why is not None or queue.full():
        while not queue.empty():
            queue.get_nowait()
    queue.put_nowait(why)
