"""With mTLS on, an engine joins routing only once a worker certificate has answered at its address.

Why: a discovery record is only a claim (issue 15: a rogue process copied a model card under its own
lease and got 22 of 40 requests). The proof is a handshake: the router calls ``GetModelCard`` over a
channel pinned to ``worker.kvmesh`` (``kvmesh.channels``), which only a process holding a worker
certificate from the mesh CA can complete. Until then the engine is not routable; a failed proof is
retried with backoff for as long as the record lives (a real worker may just be slow to start).
Without TLS there is nothing to prove and engines join at once, as before.

An admitted engine whose record changes at the same address (a re-published model card) is the same
proven process: the update passes straight through, its bookings kept. The fleet removes an engine
before re-adding it whenever its address (or geometry) changes, and that one is proven again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc
from kvmesh.v1 import worker_pb2, worker_pb2_grpc

from kvmesh_router.engines import EngineInfo

__all__ = ["IdentityGate"]

log = logging.getLogger(__name__)


class IdentityGate:
    """Sits between the fleet's callbacks and the router state (see the module docstring)."""

    def __init__(
        self,
        channel_for: Callable[[str], grpc.aio.Channel],
        on_added: Callable[[EngineInfo], None],
        on_removed: Callable[[int], None],
        *,
        timeout: float = 5.0,
        max_backoff: float = 5.0,
    ) -> None:
        self._channel_for = channel_for
        self._on_added = on_added
        self._on_removed = on_removed
        self._timeout = timeout
        self._max_backoff = max_backoff
        self._pending: dict[int, asyncio.Task[None]] = {}
        self._admitted: dict[int, str] = {}  # engine id -> the address its identity was proven at

    def added(self, info: EngineInfo) -> None:
        if self._admitted.get(info.engine_id) == info.address:
            self._on_added(info)  # an update of a proven engine: removing it would drop its bookings
            return
        self.removed(info.engine_id)  # a re-registration elsewhere is proven again
        self._pending[info.engine_id] = asyncio.get_running_loop().create_task(
            self._prove(info), name=f"identity {info.engine_id:x}"
        )

    def removed(self, engine_id: int) -> None:
        task = self._pending.pop(engine_id, None)
        if task is not None:
            task.cancel()
        if self._admitted.pop(engine_id, None) is not None:
            self._on_removed(engine_id)

    async def _prove(self, info: EngineInfo) -> None:
        backoff = 0.2
        while True:
            stub = worker_pb2_grpc.WorkerServiceStub(self._channel_for(info.address))
            try:
                await stub.GetModelCard(worker_pb2.GetModelCardRequest(engine_id=info.engine_id), timeout=self._timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    break  # it answered with a worker certificate: the identity is proven
                log.warning(  # gRPC's details name the cause, e.g. a certificate this router's CA did not sign
                    "engine %x at %s: no worker certificate answered (%s: %s); not routable",
                    info.engine_id,
                    info.address,
                    exc.code().name,
                    exc.details(),
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._max_backoff)
                continue
            break
        self._pending.pop(info.engine_id, None)
        self._admitted[info.engine_id] = info.address
        self._on_added(info)

    async def close(self) -> None:
        tasks = list(self._pending.values())
        self._pending.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
