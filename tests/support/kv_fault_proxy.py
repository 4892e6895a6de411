"""A fault-injecting gRPC proxy in front of a worker, for router tests (no production backdoor).

The proxy forwards every ``WorkerService`` call as raw bytes to the real worker, except that it can

- **drop KV events**: the next ``k`` events of ``SubscribeKvEvents`` streams (optionally of one
  engine) are removed from the batches they travel in (a batch left empty is not sent at all), so
  the subscriber sees a jump in event ids, exactly like a lost message;
- **cut subscriptions**: every open ``SubscribeKvEvents`` stream is aborted with UNAVAILABLE (a
  network break), so the subscriber must resume from its cursor;
- **hold subscriptions**: new ``SubscribeKvEvents`` calls wait (no snapshot, no events) until released
  (a worker too slow to answer a restore).

Routers find engines in discovery, so :meth:`KvFaultProxy.republish` mirrors the worker's instance
records and model cards from the namespace the worker registered in into another namespace, with
this proxy's address: a router started in that namespace talks to the engines through the proxy.

It runs its own asyncio loop in a thread, so sync and async tests alike can use it::

    with KvFaultProxy(worker.address) as proxy:
        proxy.republish(url, "hidden", "visible")
        proxy.drop_events(3)
        proxy.cut_subscriptions()
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import grpc
from kvmesh.discovery import (
    Added,
    Discovery,
    Snapshot,
    instance_key,
    instance_prefix,
    model_key,
    model_prefix,
    open_discovery,
    parse_instance_key,
    parse_model_key,
)
from kvmesh.v1 import discovery_pb2, worker_pb2

__all__ = ["KvFaultProxy"]

_SERVICE = "/kvmesh.v1.WorkerService/"
_KINDS = {
    "SubscribeKvEvents": "unary_stream",
    "DumpKvIndex": "unary_unary",
    "WatchLoad": "unary_stream",
    "GetModelCard": "unary_unary",
    "GetModelFile": "unary_stream",
    "ReleaseKv": "unary_unary",
}


class KvFaultProxy:
    """See the module docstring. ``address`` is where clients connect (after :meth:`start`)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.address = ""
        self.dropped: list[tuple[int, int]] = []  # (engine id, event id) of every dropped event
        self.cuts = 0
        self._lock = threading.Lock()
        self._drop_budget = 0
        self._drop_engine: int | None = None
        self._streams: set[_Stream] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kv-fault-proxy", daemon=True)
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None
        self._republishers: list[asyncio.Task[None]] = []
        self._open: asyncio.Event | None = None
        self._discoveries: list[Discovery] = []

    # ------------------------------------------------------------------ control (any thread)

    def start(self) -> KvFaultProxy:
        self._thread.start()
        self._call(self._start())
        return self

    def drop_events(self, count: int, engine_id: int | None = None) -> None:
        """Drop the next ``count`` events of KV subscriptions (of ``engine_id`` only, if given)."""
        with self._lock:
            self._drop_budget = count
            self._drop_engine = engine_id

    @property
    def pending_drops(self) -> int:
        with self._lock:
            return self._drop_budget

    def hold_subscriptions(self, hold: bool = True) -> None:
        """Make new SubscribeKvEvents calls wait until ``hold_subscriptions(False)``."""

        def apply() -> None:
            assert self._open is not None
            if hold:
                self._open.clear()
            else:
                self._open.set()

        self._loop.call_soon_threadsafe(apply)

    def cut_subscriptions(self) -> int:
        """Abort every open SubscribeKvEvents stream with UNAVAILABLE; returns how many were cut."""
        return self._call(self._cut())

    def republish(self, discovery_url: str, source_namespace: str, target_namespace: str) -> None:
        """Mirror the worker records of ``source_namespace`` into ``target_namespace`` at this address."""
        self._call(self._republish(discovery_url, source_namespace, target_namespace))

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> KvFaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(15)

    # ------------------------------------------------------------------ the proxy (its loop)

    async def _start(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._channel = grpc.aio.insecure_channel(self.target)
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers((_Handler(self),))
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        self.address = f"127.0.0.1:{port}"

    async def _stop(self) -> None:
        for task in self._republishers:
            task.cancel()
        await asyncio.gather(*self._republishers, return_exceptions=True)
        for discovery in self._discoveries:  # revokes its lease and stops its backend's tasks (file GC)
            with contextlib.suppress(Exception):
                await discovery.close()
        if self._server is not None:
            await self._server.stop(grace=None)
        if self._channel is not None:
            await self._channel.close()

    async def _cut(self) -> int:
        streams = list(self._streams)
        for stream in streams:
            stream.cut = True
            stream.call.cancel()
        self.cuts += len(streams)
        return len(streams)

    def _filter(self, engine_id: int, raw: bytes) -> bytes | None:
        with self._lock:
            if self._drop_budget <= 0 or (self._drop_engine is not None and self._drop_engine != engine_id):
                return raw
            message = worker_pb2.SubscribeKvEventsResponse.FromString(raw)
            if not message.HasField("events"):
                return raw
            kept = []
            for event in message.events.events:
                if self._drop_budget > 0:
                    self._drop_budget -= 1
                    self.dropped.append((engine_id, event.event_id))
                else:
                    kept.append(event)
        if not kept:
            return None
        del message.events.events[:]
        message.events.events.extend(kept)
        return message.SerializeToString()

    async def _subscribe(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        assert self._channel is not None
        engine_id = worker_pb2.SubscribeKvEventsRequest.FromString(request).engine_id
        assert self._open is not None
        await self._open.wait()
        call = self._channel.unary_stream(_SERVICE + "SubscribeKvEvents")(request)
        entry = _Stream(call)
        self._streams.add(entry)
        try:
            async for raw in call:
                out = self._filter(engine_id, raw)
                if out is not None:
                    yield out
        except asyncio.CancelledError:
            if not entry.cut:
                raise
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")
        finally:
            self._streams.discard(entry)
            call.cancel()
        if entry.cut:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection cut by the fault proxy")

    def _forward_unary(self, method: str) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]:
        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            assert self._channel is not None
            try:
                return await self._channel.unary_unary(method)(request)
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")
                raise  # pragma: no cover

        return forward

    def _forward_stream(self, method: str) -> Callable[[bytes, grpc.aio.ServicerContext], AsyncIterator[bytes]]:
        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            assert self._channel is not None
            call = self._channel.unary_stream(method)(request)
            try:
                async for raw in call:
                    yield raw
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")
            finally:
                call.cancel()

        return forward

    # ------------------------------------------------------------------ discovery mirror

    async def _republish(self, url: str, source: str, target: str) -> None:
        discovery = await open_discovery(url, ttl=2.0)
        self._discoveries.append(discovery)
        lease = await discovery.grant_lease()
        ready = asyncio.Event()
        remaining = {"records", "cards"}

        async def mirror(prefix: str, what: str) -> None:
            async with contextlib.aclosing(discovery.list_and_watch(prefix)) as events:
                async for ev in events:
                    items = ev.records.items() if isinstance(ev, Snapshot) else []
                    if isinstance(ev, Added):
                        items = [(ev.key, ev.value)]
                    for key, value in items:
                        if what == "records":
                            parsed = parse_instance_key(key)
                            record = discovery_pb2.InstanceRecord.FromString(value)
                            record.namespace = target
                            record.address = self.address
                            new_key = instance_key(target, parsed.component, parsed.endpoint, parsed.instance_id)
                            await lease.put(new_key, record.SerializeToString())
                        else:
                            parsed_model = parse_model_key(key)
                            card = discovery_pb2.ModelCard.FromString(value)
                            card.address = self.address
                            new_key = model_key(target, parsed_model.model, parsed_model.instance_id)
                            await lease.put(new_key, card.SerializeToString())
                    if isinstance(ev, Snapshot):
                        remaining.discard(what)
                        if not remaining:
                            ready.set()

        loop = asyncio.get_running_loop()
        self._republishers += [
            loop.create_task(mirror(instance_prefix(source, "worker"), "records")),
            loop.create_task(mirror(model_prefix(source), "cards")),
        ]
        await asyncio.wait_for(ready.wait(), 10)


class _Stream:
    __slots__ = ("call", "cut")

    def __init__(self, call: Any) -> None:
        self.call = call
        self.cut = False


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, proxy: KvFaultProxy) -> None:
        self.proxy = proxy

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if not method.startswith(_SERVICE):
            return None
        kind = _KINDS.get(method[len(_SERVICE) :])
        if kind is None:
            return None
        if method.endswith("/SubscribeKvEvents"):
            return grpc.unary_stream_rpc_method_handler(self.proxy._subscribe)
        if kind == "unary_unary":
            return grpc.unary_unary_rpc_method_handler(self.proxy._forward_unary(method))
        return grpc.unary_stream_rpc_method_handler(self.proxy._forward_stream(method))
