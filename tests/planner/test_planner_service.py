"""PlannerService over gRPC on loopback: a watcher that stops reading loses its stream with RESOURCE_EXHAUSTED
(so it knows to watch again), and the planner's shutdown ends every watch with OK."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from kvmesh import grpc_services
from kvmesh.v1 import planner_pb2, planner_pb2_grpc
from kvmesh_planner.service import WATCH_QUEUE_SIZE, PlannerServicer

SERVICE = planner_pb2.DESCRIPTOR.services_by_name["PlannerService"]


def decision(i: int) -> planner_pb2.ScalingDecision:
    return planner_pb2.ScalingDecision(decision_id=i, reason="x" * 200, changed=True)


@contextlib.asynccontextmanager
async def watching() -> AsyncIterator[tuple[PlannerServicer, grpc.aio.UnaryStreamCall]]:
    """A planner servicer on loopback and one WatchDecisions call, registered with it before the yield."""
    servicer = PlannerServicer(planner_pb2.GetStatusResponse)
    server = grpc.aio.server()
    grpc_services.add_service(server, SERVICE, servicer)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = planner_pb2_grpc.PlannerServiceStub(channel).WatchDecisions(planner_pb2.WatchDecisionsRequest())
            async with asyncio.timeout(5):
                while not servicer._watchers:
                    await asyncio.sleep(0.01)
            yield servicer, call
    finally:
        await server.stop(None)


async def test_a_watcher_that_stops_reading_is_cut_with_resource_exhausted() -> None:
    async with watching() as (servicer, call):
        for i in range(WATCH_QUEUE_SIZE * 16):  # ~4 MB: far more than flow control lets through unread
            servicer.publish(decision(i))
            if i % 64 == 0:
                await asyncio.sleep(0)
        assert not servicer._watchers  # cut: the planner keeps nothing for it
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for response in call:
                received.append(response.decision.decision_id)
        assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"fell {WATCH_QUEUE_SIZE} decisions behind; watch again" in caught.value.details()
        assert received == list(range(len(received)))  # what it did get came in order, none twice


async def test_shutdown_ends_every_watch_with_ok() -> None:
    async with watching() as (servicer, call):
        servicer.publish(decision(1))
        servicer.close()
        assert [r.decision.decision_id async for r in call] == [1]
        assert await call.code() is grpc.StatusCode.OK
