"""Generating on a worker the way frontends do: over ``WorkerService.GenerateStream``.

``generate`` / ``generate_sync`` run one request on a stream of its own (send it, half-close, read
until its final output) for tests that need one request's outcome; :class:`StreamClient` keeps one
stream open for many requests and cancellations. A request's failure comes back in-band
(``GenerateStreamOutput.error_code``); ``generate*`` raise it as :class:`RequestFailed`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import grpc
from kvmesh.v1 import worker_pb2, worker_pb2_grpc


class RequestFailed(Exception):
    """A request ended with an in-band error; ``code`` is its gRPC status code."""

    def __init__(self, output: worker_pb2.GenerateStreamOutput) -> None:
        self.code = next(c for c in grpc.StatusCode if c.value[0] == output.error_code)
        self.message = output.error_message
        super().__init__(f"{self.code.name}: {self.message}")


def is_final(output: worker_pb2.GenerateStreamOutput) -> bool:
    return bool(output.error_code or output.response.finish_reason)


def _checked(outputs: list[worker_pb2.GenerateStreamOutput]) -> list[worker_pb2.GenerateResponse]:
    if not outputs or not is_final(outputs[-1]):
        raise AssertionError(f"the stream ended before the request did: {outputs}")
    if outputs[-1].error_code:
        raise RequestFailed(outputs[-1])
    return [output.response for output in outputs]


async def generate(
    stub: worker_pb2_grpc.WorkerServiceStub, request: worker_pb2.GenerateRequest, timeout: float = 30.0
) -> list[worker_pb2.GenerateResponse]:
    """One request's responses, in order (the last has the finish reason); raises RequestFailed."""
    call = stub.GenerateStream(timeout=timeout)
    await call.write(worker_pb2.GenerateStreamRequest(requests=[request]))
    await call.done_writing()  # the worker ends the stream once the request is done
    outputs = [output async for message in call for output in message.outputs]
    return _checked(outputs)


def generate_sync(
    stub: worker_pb2_grpc.WorkerServiceStub, request: worker_pb2.GenerateRequest, timeout: float = 30.0
) -> list[worker_pb2.GenerateResponse]:
    """:func:`generate` with a synchronous stub."""
    messages = stub.GenerateStream(iter([worker_pb2.GenerateStreamRequest(requests=[request])]), timeout=timeout)
    return _checked([output for message in messages for output in message.outputs])


async def engine_ids(stub: worker_pb2_grpc.WorkerServiceStub) -> list[int]:
    """The worker's engine ids: the first message of a WatchLoad stream carries every engine's load."""
    call = stub.WatchLoad(worker_pb2.WatchLoadRequest())
    first = await call.read()
    call.cancel()
    return [load.engine_id for load in first.loads]


def tokens_of(responses: Iterable[worker_pb2.GenerateResponse]) -> list[int]:
    return [token for response in responses for token in response.token_ids]


class StreamClient:
    """One GenerateStream call kept open; outputs collected per request id."""

    def __init__(self, stub: worker_pb2_grpc.WorkerServiceStub) -> None:
        self.call = stub.GenerateStream()
        self.outputs: dict[str, list[worker_pb2.GenerateStreamOutput]] = {}
        self.messages = 0
        self.ended = asyncio.Event()
        self.task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            async for message in self.call:
                self.messages += 1
                for output in message.outputs:
                    self.outputs.setdefault(output.request_id, []).append(output)
        finally:
            self.ended.set()

    async def send(self, requests: Iterable[worker_pb2.GenerateRequest] = (), cancel: Iterable[str] = ()) -> None:
        message = worker_pb2.GenerateStreamRequest(requests=list(requests), cancel_request_ids=list(cancel))
        await self.call.write(message)

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs.get(request_id, []) for t in o.response.token_ids]

    def final(self, request_id: str) -> worker_pb2.GenerateStreamOutput | None:
        outputs = self.outputs.get(request_id, [])
        return outputs[-1] if outputs and is_final(outputs[-1]) else None

    async def wait_first(self, request_id: str, timeout: float = 10.0) -> worker_pb2.GenerateStreamOutput:
        async with asyncio.timeout(timeout):
            while not self.outputs.get(request_id):
                assert not self.task.done(), "the stream ended"
                await asyncio.sleep(0.005)
        return self.outputs[request_id][0]

    async def wait_final(self, *request_ids: str, timeout: float = 10.0) -> list[worker_pb2.GenerateStreamOutput]:
        async with asyncio.timeout(timeout):
            while any(self.final(rid) is None for rid in request_ids):
                assert not self.task.done(), "the stream ended"
                await asyncio.sleep(0.005)
        return [output for rid in request_ids if (output := self.final(rid)) is not None]

    async def close(self) -> None:
        self.call.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
