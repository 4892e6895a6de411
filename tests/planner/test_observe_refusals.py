"""The planner's load watch (``Observer``) against a worker that refuses it: one warning that says what
it means, then quiet retries; a worker that is merely gone is retried without a warning, until it has
been unreachable for longer than a worker that went away stays registered."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from kvmesh.discovery import instance_key, open_discovery
from kvmesh.v1 import discovery_pb2, worker_pb2, worker_pb2_grpc
from kvmesh_planner.observe import Observer

from tests.support.etcd import free_port


class _RefusingWorker(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def WatchLoad(
        self, request: worker_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.WatchLoadResponse]:
        self.calls += 1
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "role planner may not call this method")
        yield worker_pb2.WatchLoadResponse()  # never reached: makes this a stream handler


async def _watch_for(observer: Observer, address: str, seconds: float) -> None:
    task = asyncio.get_running_loop().create_task(observer._watch_load(address))
    await asyncio.sleep(seconds)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_refused_watch_is_one_warning_and_a_vanished_worker_none(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="kvmesh_planner.observe")
    discovery = await open_discovery(f"file://{tmp_path / 'disc'}", ttl=5)
    server = grpc.aio.server()
    worker = _RefusingWorker()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        observer = Observer(discovery, "ns")
        await _watch_for(observer, f"127.0.0.1:{port}", 1.3)
        assert worker.calls >= 2  # retried
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warnings == [
            f"cannot watch the load of the worker at 127.0.0.1:{port} (PERMISSION_DENIED: role planner may not "
            "call this method); its engines are not counted as ready"
        ]
        caplog.clear()
        await _watch_for(observer, f"127.0.0.1:{free_port()}", 0.7)  # nobody listens there
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert any("UNAVAILABLE" in r.getMessage() for r in caplog.records)
    finally:
        await server.stop(None)
        await discovery.close()


async def test_a_worker_unreachable_for_long_is_one_warning_with_grpcs_reason(tmp_path: Path, caplog) -> None:
    """UNAVAILABLE is also what a TLS handshake the planner cannot complete looks like: past the threshold
    it is a warning carrying gRPC's reason (here the refused connection), once, then quiet again."""
    caplog.set_level(logging.DEBUG, logger="kvmesh_planner.observe")
    discovery = await open_discovery(f"file://{tmp_path / 'disc'}", ttl=5)
    try:
        observer = Observer(discovery, "ns", unreachable_warn_s=1.0)
        address = f"127.0.0.1:{free_port()}"  # nobody listens there
        await _watch_for(observer, address, 3.0)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert warnings[0].startswith(f"cannot watch the load of the worker at {address} for ")
        assert "(UNAVAILABLE: failed to connect to all addresses" in warnings[0]
        assert warnings[0].endswith("its engines are not counted as ready")
    finally:
        await discovery.close()


class _WorkerThatStopsAnswering(worker_pb2_grpc.WorkerServiceServicer):
    """Reports engine 7 once, ends the stream, then refuses every later watch (a changed role policy)."""

    def __init__(self) -> None:
        self.calls = 0

    async def WatchLoad(
        self, request: worker_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.WatchLoadResponse]:
        self.calls += 1
        if self.calls > 1:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "role planner may not call this method")
        yield worker_pb2.WatchLoadResponse(loads=[worker_pb2.EngineLoad(engine_id=7, total_blocks=100)])


async def test_an_engine_whose_load_can_no_longer_be_watched_is_not_counted_with_its_last_load(tmp_path: Path) -> None:
    """The warning says its engines are not counted as ready: the load they last reported goes with it
    (it stayed, an idle reading that drove scale-downs and put that engine first in the drain order)."""
    discovery = await open_discovery(f"file://{tmp_path / 'disc'}", ttl=5)
    server = grpc.aio.server()
    worker = _WorkerThatStopsAnswering()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    observer = Observer(discovery, "ns")
    try:
        lease = await discovery.grant_lease()
        record = discovery_pb2.InstanceRecord(component="worker", endpoint="engine", instance_id=7, address=address)
        await lease.put(instance_key("ns", "worker", "engine", 7), record.SerializeToString())
        await observer.start()
        async with asyncio.timeout(5):
            while worker.calls < 2:  # watched once (engine 7 reported), then refused
                await asyncio.sleep(0.02)
            while observer.engine_observations():
                await asyncio.sleep(0.02)
    finally:
        await observer.close()
        await server.stop(None)
        await discovery.close()
