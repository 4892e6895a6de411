"""Engine calls multiplexed on one ``WorkerService.GenerateStream`` per worker process.

Per-request ``Generate`` calls cost a call setup, trailers and a handler task on both sides; on a
2-core machine that was a third of the whole request path. Instead each worker address gets one
long-lived stream (opened on first use, reopened after it ends): requests and cancellations queued
during one event-loop tick go out as one ``GenerateStreamRequest``, and each
``GenerateStreamResponse`` is demultiplexed by request id into per-request :class:`EngineCall`
objects, which the generation flow iterates like a ``Generate`` call.

Failure semantics match a unary call: an in-band error ends one request with its status code; the
end of the stream (the worker died, drained, or the connection broke) ends every request still on
it with UNAVAILABLE, which the flow treats as "migrate".

**Dead addresses.** A stream that ends for any reason but the frontend closing it marks its worker
*address* down for ``down_s`` seconds (default: the lease TTL + 1 s, by which discovery has dropped a
dead worker's records): the generation flow then excludes every engine at that address, for the
migration and for new requests, instead of finding them dead one engine at a time. A message on a
new stream to the address, discovery retiring it, or a new engine registering there (the worker
restarted on the same port) clears the mark.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable

import grpc
from kvmesh import telemetry
from kvmesh.channels import ChannelPool
from kvmesh.kv_release import KvReleases
from kvmesh.v1 import worker_pb2, worker_pb2_grpc
from kvmesh.v1.kv_transfer_pb2 import KvTransferParams
from kvmesh.wakeup import Wakeup

from kvmesh_frontend.errors import failure_line

log = logging.getLogger(__name__)


class EngineError(Exception):
    """A request ended on its engine with a gRPC status (in-band, or the stream's end)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


_CODES = {code.value[0]: code for code in grpc.StatusCode}


#: Engine responses waiting for a busy consumer are folded into one once this many pile up: a client
#: that stops reading then costs its request one growing token list, not a message object per engine
#: response (a soak audit: +27-35 MB of frontend RSS per stalled 120k-token stream, and growing).
FOLD_AT = 64


class EngineCall:
    """One request on a GenerateStream: an async iterator of its ``GenerateResponse`` messages."""

    __slots__ = ("_done", "_error", "_folded", "_items", "_stream", "_wakeup", "request_id")

    def __init__(self, stream: EngineStream, request_id: str) -> None:
        self._stream = stream
        self.request_id = request_id
        self._items: list[worker_pb2.GenerateResponse] = []
        self._folded = False  # ``_items[0]`` is a merge this call made (and may extend)
        self._error: EngineError | None = None
        self._done = False
        self._wakeup = Wakeup()  # the request's own task is the one waiter

    def _push(self, response: worker_pb2.GenerateResponse) -> None:
        items = self._items
        items.append(response)
        if len(items) >= FOLD_AT:
            self._items = [_merge(items, self._folded)]
            self._folded = True
        self._wakeup.set()

    def _fail(self, error: EngineError) -> None:
        self._error = error
        self._done = True
        self._wakeup.set()

    def __aiter__(self) -> EngineCall:
        return self

    async def __anext__(self) -> worker_pb2.GenerateResponse:
        """Everything received since the previous call, merged into one response.

        A consumer that keeps up gets each engine response as it came; one that was busy (writing
        to a slow client) gets the tokens that piled up meanwhile in one response instead of a
        backlog, so a slow client gets fewer, larger deltas.
        """
        while not self._items:
            if self._error is not None:
                raise self._error
            if self._done:
                raise StopAsyncIteration
            await self._wakeup.wait()
        items, self._items = self._items, []
        item = items[0] if len(items) == 1 else _merge(items, self._folded)
        self._folded = False
        if item.finish_reason:
            self._done = True
        return item

    def cancel(self) -> None:
        """Abort the request on its engine (blocks freed); a no-op once it ended.

        A prefill whose last response (its KV hold) came but was not read yet ended on the engine
        already: nobody will pull that hold, so it is released at once, as the reader does for a hold
        that arrives after the cancel, instead of staying pinned until it expires."""
        if not self._done:
            self._done = True
            self._stream.cancel(self.request_id)
            for item in self._items:
                if item.HasField("kv_transfer"):
                    self._stream.release_unclaimed_hold(item.kv_transfer)
            self._items = []
            self._wakeup.set()


def _merge(items: list[worker_pb2.GenerateResponse], into_first: bool = False) -> worker_pb2.GenerateResponse:
    """``items`` as one response; ``into_first``: ``items[0]`` is an earlier merge, extended in place."""
    if into_first:
        merged, rest = items[0], items[1:]
    else:
        merged = worker_pb2.GenerateResponse(
            num_cached_tokens=items[0].num_cached_tokens, num_prompt_tokens=items[0].num_prompt_tokens
        )
        if items[0].HasField("kv_report"):
            merged.kv_report.CopyFrom(items[0].kv_report)
        rest = items
    for item in rest:
        merged.token_ids.extend(item.token_ids)
        merged.logprobs.extend(item.logprobs)  # one per token id, when asked for
    merged.finish_reason = items[-1].finish_reason
    return merged


class EngineStream:
    """One GenerateStream to one worker process; see the module docstring."""

    def __init__(
        self,
        address: str,
        channel: grpc.aio.Channel,
        on_closed: Callable[[EngineStream], None],
        on_idle: Callable[[EngineStream], None],
        on_unclaimed_hold: Callable[[EngineStream, KvTransferParams], None] = lambda _stream, _params: None,
    ) -> None:
        self.address = address
        self._on_unclaimed_hold = on_unclaimed_hold
        self.closed = False
        self.reason = ""
        self.by_frontend = False  # closed on purpose (retire, shutdown): says nothing about the worker
        self.delivered = False  # the worker answered on this stream at least once
        self._on_closed = on_closed
        self._on_idle = on_idle
        self._loop = asyncio.get_running_loop()
        self._calls: dict[str, EngineCall] = {}
        self._outbox = worker_pb2.GenerateStreamRequest()
        self._call = worker_pb2_grpc.WorkerServiceStub(channel).GenerateStream()
        self._reader = self._loop.create_task(
            self._read(), name=f"engine-stream-{address}", context=contextvars.Context()
        )  # shared by many requests: none's request id or span in its logs
        self._writer: asyncio.Task[None] | None = None

    def start(self, request: worker_pb2.GenerateRequest) -> EngineCall:
        call = EngineCall(self, request.request_id)
        if self.closed:
            call._fail(EngineError(grpc.StatusCode.UNAVAILABLE, f"the stream to worker {self.address} is closed"))
            return call
        self._calls[request.request_id] = call
        telemetry.inject_trace_context(request.trace_context)
        self._outbox.requests.append(request)
        self._schedule_flush()
        return call

    @property
    def idle(self) -> bool:
        """No request in flight on this stream."""
        return not self._calls

    def release_unclaimed_hold(self, params: KvTransferParams) -> None:
        self._on_unclaimed_hold(self, params)

    def cancel(self, request_id: str) -> None:
        if self._calls.pop(request_id, None) is not None and not self.closed:
            self._outbox.cancel_request_ids.append(request_id)
            self._schedule_flush()
            if not self._calls:
                self._on_idle(self)

    # -- writing: one message per event-loop tick ------------------------------------------------
    def _schedule_flush(self) -> None:
        # The writer task first runs on the next loop iteration, so everything queued in this tick
        # goes out in its first message; while a write is in flight, the next message accumulates.
        if self._writer is None or self._writer.done():
            self._writer = self._loop.create_task(self._write(), context=contextvars.Context())

    async def _write(self) -> None:
        try:
            while not self.closed and (self._outbox.requests or self._outbox.cancel_request_ids):
                message, self._outbox = self._outbox, worker_pb2.GenerateStreamRequest()
                await self._call.write(message)
        except Exception as exc:  # the stream is broken: the reader reports why
            self._close(f"write failed: {failure_line(exc)}")
            self._call.cancel()

    # -- reading ----------------------------------------------------------------------------------
    async def _read(self) -> None:
        reason = "the worker ended the stream"
        try:
            async for message in self._call:
                if not self.delivered:
                    self.delivered = True
                    self._on_idle(self)  # lets EngineStreams clear a down mark (no-op otherwise)
                calls = self._calls
                for output in message.outputs:
                    call = calls.get(output.request_id)
                    if call is None:  # cancelled meanwhile
                        if output.response.HasField("kv_transfer"):  # a prefill that ended as it was cancelled
                            self.release_unclaimed_hold(output.response.kv_transfer)
                        continue
                    if output.error_code:
                        del calls[output.request_id]
                        code = _CODES.get(output.error_code, grpc.StatusCode.UNKNOWN)
                        call._fail(EngineError(code, output.error_message))
                        continue
                    if output.response.finish_reason:
                        del calls[output.request_id]
                    call._push(output.response)
                if not calls and message.outputs:
                    self._on_idle(self)
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            reason = "closed by the frontend"
            self.by_frontend = True
        except Exception as exc:  # pragma: no cover - defensive: never leave a request hanging
            reason = f"stream reader failed: {exc!r}"
        finally:
            self._close(reason)

    def _close(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.reason = reason
        calls, self._calls = self._calls, {}
        if calls:
            log.warning("stream to worker %s ended with %d request(s) on it: %s", self.address, len(calls), reason)
        error = EngineError(grpc.StatusCode.UNAVAILABLE, f"worker {self.address}: {reason}")
        for call in calls.values():
            call._fail(error)
        self._on_closed(self)

    async def close(self) -> None:
        self.by_frontend = True
        self._call.cancel()
        tasks = [task for task in (self._reader, self._writer) if task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)


class EngineStreams:
    """The open GenerateStream of each worker address (one HTTP/2 connection each, from the pool).

    A worker that leaves discovery (``retire``) keeps its stream until the requests on it end; then
    the stream is closed and the connection dropped, so a fleet that churns does not leave the
    frontend reconnecting to addresses that are gone.
    """

    def __init__(
        self, pool: ChannelPool, address_live: Callable[[str], bool] = lambda _address: True, down_s: float = 11.0
    ) -> None:
        self._pool = pool
        self._address_live = address_live
        self._releases = KvReleases(pool, log, logging.DEBUG)
        self._streams: dict[str, EngineStream] = {}
        self._dropping: set[asyncio.Task[None]] = set()
        self.down_s = down_s
        self._down: dict[str, float] = {}  # worker address -> monotonic time its stream failed

    def is_down(self, address: str) -> bool:
        """The stream to ``address`` failed less than ``down_s`` ago (see the module docstring)."""
        if not self._down:
            return False
        since = self._down.get(address)
        if since is None:
            return False
        if time.monotonic() - since < self.down_s:
            return True
        del self._down[address]
        return False

    def revive(self, address: str) -> None:
        """A new engine registered at ``address``: whatever failed there before is not what runs now."""
        self._down.pop(address, None)

    @property
    def any_down(self) -> bool:
        return bool(self._down)

    def start(self, address: str, request: worker_pb2.GenerateRequest) -> EngineCall:
        stream = self._streams.get(address)
        if stream is None or stream.closed:
            channel = self._pool.get(address, address, role="worker")
            stream = self._streams[address] = EngineStream(
                address, channel, self._forget, self._idle, self._release_unclaimed
            )
        return stream.start(request)

    def _release_unclaimed(self, stream: EngineStream, params: KvTransferParams) -> None:
        """A prefill's hold whose request ended first: nobody will pull that KV, so free it now, not at the
        hold's lease (``--kv-hold-timeout``), which kept those blocks from other requests meanwhile."""
        held = KvTransferParams()
        held.CopyFrom(params)
        held.source_address = stream.address
        self._releases.start(held)

    def retire(self, address: str) -> None:
        """No live engine is left at ``address``: let its stream and connection go once idle."""
        self._down.pop(address, None)
        stream = self._streams.get(address)
        if stream is None or stream.closed or stream.idle:
            self._drop(address)

    def _idle(self, stream: EngineStream) -> None:
        if stream.delivered and self._down:
            self._down.pop(stream.address, None)  # the worker answers again
        if stream.idle and not self._address_live(stream.address) and self._streams.get(stream.address) is stream:
            self._drop(stream.address)

    def _forget(self, stream: EngineStream) -> None:
        if not stream.by_frontend:
            if stream.address not in self._down:
                log.warning("worker %s: stream failed (%s); excluding its engines", stream.address, stream.reason)
            self._down[stream.address] = time.monotonic()
        if self._streams.get(stream.address) is stream:
            del self._streams[stream.address]
            if not self._address_live(stream.address):
                self._drop(stream.address)

    def _drop(self, address: str) -> None:
        stream = self._streams.pop(address, None)
        task = asyncio.get_running_loop().create_task(self._close(stream, address))
        self._dropping.add(task)
        task.add_done_callback(self._dropping.discard)

    async def _close(self, stream: EngineStream | None, address: str) -> None:
        if stream is not None:
            await stream.close()
        if address not in self._streams:  # not reopened meanwhile
            await self._pool.drop(address)

    def __contains__(self, address: object) -> bool:
        return address in self._streams

    async def close(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        await asyncio.gather(*(stream.close() for stream in streams), *self._dropping, return_exceptions=True)
        await self._releases.wait()
