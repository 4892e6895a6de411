"""The frontend's engine streams (``EngineStreams``) against a worker on real gRPC over loopback.

The worker here is a double that plays one worker behaviour the tests need exactly: a prefill that
finishes just as the frontend's cancel for it arrives, the two crossing on the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
from kvmesh.channels import ChannelPool
from kvmesh.v1 import worker_pb2, worker_pb2_grpc
from kvmesh_frontend.engine_stream import EngineCall, EngineStreams


class _PrefillCrossingTheCancel(worker_pb2_grpc.WorkerServiceServicer):
    """Answers a cancel with the request's last output and its KV hold, as a real prefill worker does when
    the prefill ended before the cancel reached it; records every ReleaseKv."""

    def __init__(self) -> None:
        self.released: asyncio.Queue[tuple[int, str]] = asyncio.Queue()

    async def GenerateStream(
        self, request_iterator: AsyncIterator[worker_pb2.GenerateStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateStreamResponse]:
        started: set[str] = set()
        async for message in request_iterator:
            started.update(request.request_id for request in message.requests)
            for request_id in message.cancel_request_ids:
                if request_id in started:
                    out = worker_pb2.GenerateStreamResponse()
                    response = out.outputs.add(request_id=request_id).response
                    response.token_ids.append(7)
                    response.finish_reason = worker_pb2.FINISH_REASON_LENGTH
                    response.kv_transfer.source_engine_id = 5
                    response.kv_transfer.transfer_id = f"hold-of-{request_id}"
                    yield out

    async def ReleaseKv(
        self, request: worker_pb2.ReleaseKvRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseKvResponse:
        await self.released.put((request.engine_id, request.transfer_id))
        return worker_pb2.ReleaseKvResponse(released=True)


@contextlib.asynccontextmanager
async def _prefill_on(worker: worker_pb2_grpc.WorkerServiceServicer, request_id: str) -> AsyncIterator[EngineCall]:
    """``worker`` served on loopback, and a prefill (one token, its KV held) started on it."""
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    streams = EngineStreams(ChannelPool())
    try:
        sampling = worker_pb2.SamplingOptions(max_tokens=1)
        yield streams.start(
            address,
            worker_pb2.GenerateRequest(
                request_id=request_id, engine_id=5, token_ids=[1, 2, 3], sampling=sampling, hold_kv_for_transfer=True
            ),
        )
    finally:
        await streams.close()
        await server.stop(None)


async def test_a_prefills_hold_that_arrives_after_its_request_was_cancelled_is_released() -> None:
    """The client left as its prefill finished: nobody will pull that KV, so the frontend releases the hold
    at once, not at the hold's lease (``--kv-hold-timeout``, 30 s), which kept its blocks from others."""
    worker = _PrefillCrossingTheCancel()
    async with _prefill_on(worker, "p1") as call:
        call.cancel()
        assert await asyncio.wait_for(worker.released.get(), 10) == (5, "hold-of-p1")


class _PrefillFinishingAtOnce(_PrefillCrossingTheCancel):
    """Finishes every prefill at once: its last output and its KV hold come before any cancel."""

    async def GenerateStream(
        self, request_iterator: AsyncIterator[worker_pb2.GenerateStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateStreamResponse]:
        async for message in request_iterator:
            for request in message.requests:
                out = worker_pb2.GenerateStreamResponse()
                response = out.outputs.add(request_id=request.request_id).response
                response.token_ids.append(7)
                response.finish_reason = worker_pb2.FINISH_REASON_LENGTH
                response.kv_transfer.source_engine_id = 5
                response.kv_transfer.transfer_id = f"hold-of-{request.request_id}"
                yield out


async def test_a_prefills_hold_that_came_but_was_not_read_when_its_request_was_cancelled_is_released() -> None:
    """The same race one step later: the hold reached the frontend, and the request was cancelled before
    its reader took it (the client left as it arrived)."""
    worker = _PrefillFinishingAtOnce()
    async with _prefill_on(worker, "p2") as call:
        async with asyncio.timeout(10):
            while not call._items:  # the hold arrived, unread
                await asyncio.sleep(0.01)
        call.cancel()
        assert await asyncio.wait_for(worker.released.get(), 10) == (5, "hold-of-p2")
