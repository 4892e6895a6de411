"""``RouterService``: the gRPC face of one router replica (``protos/kvmesh/v1/router.proto``).

The servicer only translates; the work is elsewhere: ``Session`` in :mod:`kvmesh_router.session`,
``ReplicaSync`` in :mod:`kvmesh_router.replica_sync`, the state behind ``DumpIndex`` and
``GetActiveLoad`` in :mod:`kvmesh_router.state`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from kvmesh import grpc_services
from kvmesh.v1 import router_pb2, router_pb2_grpc

from kvmesh_router.replica_sync import ReplicaHub
from kvmesh_router.session import SessionHandler
from kvmesh_router.state import RouterState

__all__ = ["RouterServicer"]

Context = grpc.aio.ServicerContext[Any, Any]


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(
        self,
        state: RouterState,
        hub: ReplicaHub | None = None,
        next_event_id: Callable[[int], int | None] = lambda _engine: None,
        is_ready: Callable[[], bool] = lambda: True,
    ) -> None:
        self.state = state
        self.hub = hub
        self.next_event_id = next_event_id
        self.sessions = SessionHandler(state, is_ready)

    @property
    def Session(
        self,
    ) -> Callable[[AsyncIterator[router_pb2.SessionRequest], Context], AsyncIterator[router_pb2.SessionResponse]]:
        """The session handler's own async generator function: handing it to gRPC as is (instead of wrapping it
        in another generator) saves a generator hop per message on the decision path."""
        return self.sessions.serve

    async def ReplicaSync(  # type: ignore[override]  # grpc.aio writer API: responses go out via context.write
        self, request_iterator: AsyncIterator[router_pb2.ReplicaSyncRequest], context: Context
    ) -> None:
        if self.hub is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "replica sync is disabled on this router")
        else:
            await self.hub.serve(request_iterator, context)

    async def DumpIndex(self, request: router_pb2.DumpIndexRequest, context: Context) -> router_pb2.DumpIndexResponse:
        response = router_pb2.DumpIndexResponse()
        dumps = self.state.dump_index(request.engine_ids)
        unknown = sorted(set(request.engine_ids) - dumps.keys())
        if unknown:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"engines not known to this router: {', '.join(f'{e:x}' for e in unknown)}"
            )
        for engine_id, hashes in dumps.items():
            entry = response.engines.add(engine_id=engine_id, block_hashes=hashes)
            nxt = self.next_event_id(engine_id)
            if nxt is not None:
                entry.next_event_id = nxt
        return response

    async def GetActiveLoad(
        self, request: router_pb2.GetActiveLoadRequest, context: Context
    ) -> router_pb2.GetActiveLoadResponse:
        response = router_pb2.GetActiveLoadResponse()
        for engine_id, blocks, prefill, n in self.state.active_load():
            response.engines.add(
                engine_id=engine_id, active_blocks=blocks, active_prefill_tokens=prefill, active_requests=n
            )
        return response


SERVICE = router_pb2.DESCRIPTOR.services_by_name["RouterService"]
#: Session answers a message that does not parse in band (an INVALID decision); the session goes on.
IN_BAND = ("Session",)


def add_to_server(servicer: Any, server: grpc.aio.Server) -> None:
    """The router's service on ``server`` as the daemon serves it (for a server outside the daemon's runtime)."""
    grpc_services.add_service(server, SERVICE, servicer, in_band=IN_BAND)
