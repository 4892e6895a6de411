"""The identity gate admits an engine once a worker answered at its address, and keeps it through updates.

A real gRPC WorkerService answers ``GetModelCard`` (without TLS any answer is the proof; with it, the
channel's pinned name makes only a worker certificate able to answer: ``tests/security``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import grpc
import pytest
from kvmesh.v1 import discovery_pb2, worker_pb2, worker_pb2_grpc
from kvmesh_router.engines import EngineInfo
from kvmesh_router.identity_gate import IdentityGate


class CardServer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self) -> None:
        self.proofs = 0

    async def GetModelCard(self, request: worker_pb2.GetModelCardRequest, context: grpc.aio.ServicerContext):
        self.proofs += 1
        return worker_pb2.GetModelCardResponse(card=discovery_pb2.ModelCard(engine_id=request.engine_id))


@pytest.fixture
async def worker() -> AsyncIterator[tuple[CardServer, str]]:
    servicer = CardServer()
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(None)


async def test_a_proven_engines_updated_card_passes_through_without_dropping_it(worker) -> None:
    """A re-published card (same id, same address) was proven again: the gate removed the engine first,
    and the router dropped every booking on it, its own and its replica peers' (found under TLS)."""
    servicer, address = worker
    events: list[tuple[str, object]] = []
    channels: dict[str, grpc.aio.Channel] = {}
    gate = IdentityGate(
        lambda a: channels.setdefault(a, grpc.aio.insecure_channel(a)),
        lambda info: events.append(("added", info.total_blocks)),
        lambda engine_id: events.append(("removed", engine_id)),
    )
    info = EngineInfo(engine_id=0x11, model="m", address=address, block_size=16, total_blocks=1000)
    try:
        gate.added(info)
        await _until(lambda: events == [("added", 1000)])
        gate.added(dataclasses.replace(info, total_blocks=2000))
        assert events == [("added", 1000), ("added", 2000)] and servicer.proofs == 1
        # Elsewhere (the fleet removes it first): a new process, proven again before it is routable.
        gate.removed(0x11)
        gate.added(dataclasses.replace(info, total_blocks=2000, address=address.replace("127.0.0.1", "localhost")))
        await _until(lambda: servicer.proofs == 2 and len(events) == 4)
        assert events[2:] == [("removed", 0x11), ("added", 2000)]
    finally:
        await gate.close()
        for channel in channels.values():
            await channel.close()


async def _until(condition, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)
