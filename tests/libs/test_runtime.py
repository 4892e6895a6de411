"""``async with DaemonRuntime(...)`` owns a daemon's lifetime (real file discovery, real gRPC server).

Leaving the block, however it is left, runs one sequence: draining starts and the lease is revoked
(``on_draining`` hooks run meanwhile), in-flight calls drain, then the daemon's ``resources`` close
newest first, then discovery. A stop signal during start-up leaves the block the same way, at once.
"""

import asyncio
import contextlib
import os
import signal

import grpc
import pytest
from kvmesh.discovery import DiscoveryError, instance_prefix, open_discovery
from kvmesh.runtime import DaemonRuntime
from kvmesh.settings import DaemonSettings
from kvmesh.v1 import admin_pb2, admin_pb2_grpc


def settings(tmp_path):
    return DaemonSettings(discovery=f"file://{tmp_path}", namespace="rt", lease_ttl=2.0, drain_timeout=0.5)


async def records(url):
    async with await open_discovery(url, ttl=2.0) as disc:
        return await disc.get_prefix(instance_prefix("rt"))


@pytest.mark.parametrize("how", ["stop", "error"])
async def test_leaving_the_block_drains_then_closes_resources_newest_first(tmp_path, how):
    cfg = settings(tmp_path)
    events = []
    with pytest.raises(RuntimeError) if how == "error" else contextlib.nullcontext():
        async with DaemonRuntime("kvmesh-test", cfg) as runtime:
            runtime.resources.push_async_callback(_note, events, "first resource closed")
            runtime.resources.push_async_callback(_note, events, "second resource closed")
            runtime.on_draining(lambda: events.append(f"draining hook: serving={runtime.is_serving()}"))
            await runtime.start(0, "127.0.0.1")
            await runtime.register(runtime.instance_record("test", "test"))
            assert runtime.is_serving() and len(await records(cfg.discovery)) == 1
            if how == "error":
                raise RuntimeError("the daemon failed")
    assert events == ["draining hook: serving=False", "second resource closed", "first resource closed"]
    assert await records(cfg.discovery) == {}  # revoked, not left to expire
    with pytest.raises(DiscoveryError):  # closed last
        await runtime.discovery.get_prefix(instance_prefix("rt"))


async def test_a_stop_signal_during_start_up_leaves_the_block_and_revokes_the_lease(tmp_path, monkeypatch):
    monkeypatch.setattr(DaemonRuntime, "stop_signalled", False)
    events = []
    with pytest.raises(asyncio.CancelledError):
        async with DaemonRuntime("kvmesh-test", settings(tmp_path)) as runtime:
            runtime.resources.push_async_callback(_note, events, "resource closed")
            assert list(tmp_path.rglob("*.lease")), "the lease is taken on entering the block"
            os.kill(os.getpid(), signal.SIGTERM)  # kvmesh up stopping it because a sibling failed to start
            await asyncio.sleep(10)  # start-up work: the signal cuts it short
            events.append("start-up went on")
    assert events == ["resource closed"]
    assert DaemonRuntime.stop_signalled  # run_daemon exits 0 on this cancellation
    assert not list(tmp_path.rglob("*.lease")), "revoked, not left to expire"
    # The handlers went with the runtime: SIGTERM is the default action again.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


async def _note(events, text):
    events.append(text)


async def test_a_second_drain_is_answered_started_false_while_the_first_drains(tmp_path):
    """The serving gate refused every call while draining, Drain included: admin.proto's ``started = false``
    could never be seen, only UNAVAILABLE."""
    hold = asyncio.Event()  # holds the drain open (an on_draining hook) until the second Drain is answered
    up: asyncio.Queue = asyncio.Queue()

    async def daemon() -> None:
        async with DaemonRuntime("kvmesh-test", settings(tmp_path)) as runtime:
            runtime.on_draining(hold.wait)
            await up.put((runtime, await runtime.start(0, "127.0.0.1")))
            await runtime.wait_for_stop()

    task = asyncio.create_task(daemon())
    runtime, port = await asyncio.wait_for(up.get(), 10)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        drain = admin_pb2_grpc.AdminServiceStub(channel).Drain
        first = await drain(admin_pb2.DrainRequest(reason="test"))
        async with asyncio.timeout(5):
            while runtime.is_serving():
                await asyncio.sleep(0.01)
        second = await drain(admin_pb2.DrainRequest(reason="again"))
    hold.set()
    await asyncio.wait_for(task, 10)
    assert first.started and not second.started
    assert first.instance_id == second.instance_id
