"""WorkerService: the gRPC face of the engines one worker process hosts.

Every RPC names its engine by id; the servicer only translates between protobuf and the
``Engine`` interface (``kvmesh_worker.engines``) — scheduling, caching and KV events are the
engine's business, whichever implementation it is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc
from kvmesh import kv_events_pb
from kvmesh.channels import ChannelPool
from kvmesh.kv_events import CacheDump
from kvmesh.kv_publisher import EventIdTooNew, KvSubscription, SubscriberTooSlow
from kvmesh.kv_release import RELEASE_CHANNELS, KvReleases
from kvmesh.v1 import discovery_pb2, worker_pb2, worker_pb2_grpc
from kvmesh.v1.kv_transfer_pb2 import KvTransferParams

from kvmesh_worker.engine import ForwardPassMetrics
from kvmesh_worker.engines import Engine, KvNotHeld
from kvmesh_worker.generate_stream import GenerateStreamSession
from kvmesh_worker.model_files import ModelFiles

log = logging.getLogger(__name__)

FILE_CHUNK_BYTES = 1 << 20
LOAD_COALESCE_S = 0.05
#: Forward passes a WatchLoad watcher may have unsent (~200 bytes each) before its watch is cut.
MAX_UNSENT_PASSES = 1 << 16
#: GenerateStream answers a message that does not parse in band (an error output without a request id)
#: and serves the stream's other requests; every other method's call ends INVALID_ARGUMENT.
IN_BAND = ("GenerateStream",)


class _LoadWatcher:
    """Engines whose load changed and passes completed since this watcher's last message."""

    def __init__(self, engine_ids: set[int] | None, want_passes: bool) -> None:
        self.engine_ids = engine_ids
        self.want_passes = want_passes
        self.dirty: set[int] = set()
        self.passes: list[worker_pb2.ForwardPassMetrics] = []
        self.too_slow = False  # MAX_UNSENT_PASSES piled up: the watch ends with RESOURCE_EXHAUSTED
        self.ended = False  # the worker drains: the watch ends (OK) instead of holding the drain open
        self.changed = asyncio.Event()

    def end(self) -> None:
        self.ended = True
        self.changed.set()

    def on_pass(self, engine_id: int, metrics: ForwardPassMetrics, wall_s: float) -> None:
        if self.engine_ids is not None and engine_id not in self.engine_ids:
            return
        self.dirty.add(engine_id)
        if self.want_passes and not self.too_slow:
            if len(self.passes) >= MAX_UNSENT_PASSES:  # a watcher that stopped reading: memory stays bounded
                self.too_slow = True
                self.passes = []
                self.changed.set()
                return
            self.passes.append(
                worker_pb2.ForwardPassMetrics(
                    engine_id=engine_id,
                    prefill_tokens=metrics.prefill_tokens,
                    decode_tokens=metrics.decode_tokens,
                    batch_size=metrics.batch_size,
                    num_prefill_requests=metrics.num_prefill_requests,
                    num_decode_requests=metrics.num_decode_requests,
                    modelled_ms=metrics.duration_ms,
                    wall_ms=wall_s * 1000.0,
                    end_unix_s=time.time(),
                )
            )
        self.changed.set()

    def on_load_changed(self, engine_id: int) -> None:
        if self.engine_ids is None or engine_id in self.engine_ids:
            self.dirty.add(engine_id)
            self.changed.set()


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(
        self,
        engines: Iterable[Engine],
        cards: dict[int, discovery_pb2.ModelCard],
        model: ModelFiles,
        refusal: Callable[[], str | None] = lambda: None,
        stream_interval: int = 1,
    ) -> None:
        """``refusal``: why new requests are refused right now (lease lost, draining), None while serving;
        ``stream_interval``: every GenerateStream request's floor (``--stream-interval``)."""
        self.engines = {engine.engine_id: engine for engine in engines}
        self._stream_interval = stream_interval
        self.cards = cards
        self.model = model
        self._refusal = refusal
        self._watchers: set[_LoadWatcher] = set()
        self._subscriptions: set[KvSubscription] = set()
        self._sessions: set[GenerateStreamSession] = set()
        self._draining = False
        self._pool = ChannelPool(RELEASE_CHANNELS)  # to other workers, for ReleaseKv after a pull
        self._releases = KvReleases(self._pool, log, logging.INFO)
        for engine in self.engines.values():
            engine.add_observer(self._on_pass)
            # Optional: an engine whose load can change with no pass to report it (vLLM going idle).
            add_load_listener = getattr(engine, "add_load_listener", None)
            if add_load_listener is not None:
                add_load_listener(self._load_changed)

    def _on_pass(self, engine_id: int, metrics: ForwardPassMetrics, wall_s: float) -> None:
        for watcher in self._watchers:
            watcher.on_pass(engine_id, metrics, wall_s)

    async def _engine(self, engine_id: int, context: grpc.aio.ServicerContext[Any, Any]) -> Engine:
        engine = self.engines.get(engine_id)
        if engine is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"engine {engine_id:x} is not hosted by this worker (it hosts "
                f"{', '.join(f'{e:x}' for e in self.engines)})",
            )
        return engine

    # -- generation -----------------------------------------------------------------------------
    # grpc.aio also serves a stream-stream RPC from a coroutine that writes through context.write (the
    # session's writer task); the generated servicer stub only models generator methods.
    async def GenerateStream(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[worker_pb2.GenerateStreamRequest],
        context: grpc.aio.ServicerContext[worker_pb2.GenerateStreamRequest, worker_pb2.GenerateStreamResponse],
    ) -> None:
        session = GenerateStreamSession(
            self.engines,
            self._refusal,
            self._aborted,
            context,
            self.model.name,
            self._release_remote,
            self._stream_interval,
        )
        self._sessions.add(session)
        if self._draining:
            session.stop_when_idle()
        try:
            await session.serve(request_iterator)
        finally:
            self._sessions.discard(session)

    def drain(self) -> None:
        """The worker is shutting down: open GenerateStreams end as soon as their requests are done, and
        the endless ones (KV events, load) at once: each held the drain open for all of --drain-timeout."""
        self._draining = True
        for session in self._sessions:
            session.stop_when_idle()
        for subscription in self._subscriptions:
            subscription.end()
        for watcher in self._watchers:
            watcher.end()

    def _release_remote(self, params: KvTransferParams, span: Any = None) -> None:
        """Tell a transfer's source to drop its hold (fire and forget: its lease is the backstop), in the
        trace of the request's ``span``."""
        if not params.transfer_id or not params.source_address:
            return
        self._releases.start(params, span)

    async def close(self) -> None:
        await self._releases.wait()
        await self._pool.close()

    def _aborted(self, engine: Engine) -> None:
        # No pass may follow an abort (an engine left idle does not step), so tell the watchers here.
        self._load_changed(engine.engine_id)

    def _load_changed(self, engine_id: int) -> None:
        for watcher in self._watchers:
            watcher.on_load_changed(engine_id)

    # -- KV journal -----------------------------------------------------------------------------
    async def SubscribeKvEvents(
        self,
        request: worker_pb2.SubscribeKvEventsRequest,
        context: grpc.aio.ServicerContext[worker_pb2.SubscribeKvEventsRequest, worker_pb2.SubscribeKvEventsResponse],
    ) -> AsyncIterator[worker_pb2.SubscribeKvEventsResponse]:
        engine = await self._engine(request.engine_id, context)
        start = request.start_event_id if request.HasField("start_event_id") else None
        try:
            initial, subscription = engine.subscribe(start)
        except EventIdTooNew as exc:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(exc))
        self._subscriptions.add(subscription)
        if self._draining:
            subscription.end()
        try:
            if isinstance(initial, CacheDump):
                yield worker_pb2.SubscribeKvEventsResponse(
                    snapshot=kv_events_pb.snapshot_to_proto(initial.stored, initial.next_event_id)
                )
            else:  # the missed events, maybe none: either way the subscriber learns at once that it is live
                yield worker_pb2.SubscribeKvEventsResponse(events=kv_events_pb.batch_to_proto(initial))
            while events := await subscription.next():
                yield worker_pb2.SubscribeKvEventsResponse(events=kv_events_pb.batch_to_proto(events))
        except SubscriberTooSlow:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "KV event subscriber fell too far behind; resubscribe from your next event id",
            )
        finally:
            self._subscriptions.discard(subscription)
            engine.unsubscribe(subscription)

    async def DumpKvIndex(
        self,
        request: worker_pb2.DumpKvIndexRequest,
        context: grpc.aio.ServicerContext[worker_pb2.DumpKvIndexRequest, worker_pb2.DumpKvIndexResponse],
    ) -> worker_pb2.DumpKvIndexResponse:
        engine = await self._engine(request.engine_id, context)
        dump = engine.dump_cache()
        return worker_pb2.DumpKvIndexResponse(snapshot=kv_events_pb.snapshot_to_proto(dump.stored, dump.next_event_id))

    # -- load -----------------------------------------------------------------------------------
    def _load(self, engine_id: int) -> worker_pb2.EngineLoad:
        load = self.engines[engine_id].load()
        return worker_pb2.EngineLoad(
            engine_id=engine_id,
            active_blocks=load.active_blocks,
            cached_blocks=load.cached_blocks,
            total_blocks=load.total_blocks,
            waiting=load.num_waiting,
            running=load.num_running,
            queued_prefill_tokens=load.queued_prefill_tokens,
        )

    async def WatchLoad(
        self,
        request: worker_pb2.WatchLoadRequest,
        context: grpc.aio.ServicerContext[worker_pb2.WatchLoadRequest, worker_pb2.WatchLoadResponse],
    ) -> AsyncIterator[worker_pb2.WatchLoadResponse]:
        wanted = set(request.engine_ids) or None
        unknown = (wanted or set()) - set(self.engines)
        if unknown:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"engines not hosted here: {', '.join(f'{e:x}' for e in sorted(unknown))}"
            )
        watcher = _LoadWatcher(wanted, request.forward_pass_metrics)
        self._watchers.add(watcher)
        if self._draining:
            watcher.end()
        try:
            yield worker_pb2.WatchLoadResponse(loads=[self._load(e) for e in (wanted or self.engines)])
            while True:
                await watcher.changed.wait()
                if watcher.ended:
                    return
                await asyncio.sleep(LOAD_COALESCE_S)  # one message per burst of passes
                if watcher.too_slow:
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"this watcher fell {MAX_UNSENT_PASSES} forward passes behind; watch again",
                    )
                watcher.changed.clear()
                dirty, watcher.dirty = watcher.dirty, set()
                passes, watcher.passes = watcher.passes, []
                yield worker_pb2.WatchLoadResponse(loads=[self._load(e) for e in sorted(dirty)], passes=passes)
        finally:
            self._watchers.discard(watcher)

    # -- model ----------------------------------------------------------------------------------
    async def GetModelCard(
        self,
        request: worker_pb2.GetModelCardRequest,
        context: grpc.aio.ServicerContext[worker_pb2.GetModelCardRequest, worker_pb2.GetModelCardResponse],
    ) -> worker_pb2.GetModelCardResponse:
        await self._engine(request.engine_id, context)
        return worker_pb2.GetModelCardResponse(card=self.cards[request.engine_id])

    async def GetModelFile(
        self,
        request: worker_pb2.GetModelFileRequest,
        context: grpc.aio.ServicerContext[worker_pb2.GetModelFileRequest, worker_pb2.GetModelFileResponse],
    ) -> AsyncIterator[worker_pb2.GetModelFileResponse]:
        await self._engine(request.engine_id, context)
        data = self.model.files.get(request.name)
        if data is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"model file {request.name!r} not served; available: {', '.join(self.model.files)}",
            )
        yield worker_pb2.GetModelFileResponse(data=data[:FILE_CHUNK_BYTES], total_size=len(data))
        for offset in range(FILE_CHUNK_BYTES, len(data), FILE_CHUNK_BYTES):
            yield worker_pb2.GetModelFileResponse(data=data[offset : offset + FILE_CHUNK_BYTES])

    async def ReleaseKv(
        self,
        request: worker_pb2.ReleaseKvRequest,
        context: grpc.aio.ServicerContext[worker_pb2.ReleaseKvRequest, worker_pb2.ReleaseKvResponse],
    ) -> worker_pb2.ReleaseKvResponse:
        engine = await self._engine(request.engine_id, context)
        try:
            released = engine.release_kv(request.transfer_id)
        except KvNotHeld as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        if released:
            self._aborted(engine)  # its held blocks are free now: tell the load watchers
        return worker_pb2.ReleaseKvResponse(released=released)
