"""``async with DaemonRuntime(...)`` owns a daemon's lifetime (real file discovery, real gRPC server).

Leaving the block, however it is left, runs one sequence: draining starts and the lease is revoked
(``on_draining`` hooks run meanwhile), in-flight calls drain, then the daemon's ``resources`` close
newest first, then discovery. A stop signal during start-up leaves the block the same way, at once.
"""

import asyncio
import contextlib
import os
import signal
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
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


def _held_call_service(started: asyncio.Event, release: asyncio.Event) -> grpc.GenericRpcHandler:
    """``/test.Held/Wait``: a call that stays in flight until ``release`` is set."""

    async def wait(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        started.set()
        await release.wait()
        return b"done"

    return grpc.method_handlers_generic_handler("test.Held", {"Wait": grpc.unary_unary_rpc_method_handler(wait)})


async def _serve_with_a_held_call(tmp_path, release: asyncio.Event):
    """A daemon (drain timeout 60 s) with one call in flight: (its task, runtime, channel, the call)."""
    started = asyncio.Event()
    up: asyncio.Queue = asyncio.Queue()
    cfg = DaemonSettings(discovery=f"file://{tmp_path}", namespace="rt", lease_ttl=2.0, drain_timeout=60.0)

    async def daemon() -> None:
        async with DaemonRuntime("kvmesh-test", cfg) as runtime:
            runtime.server.add_generic_rpc_handlers((_held_call_service(started, release),))
            await up.put((runtime, await runtime.start(0, "127.0.0.1")))
            await runtime.wait_for_stop()

    task = asyncio.create_task(daemon())
    runtime, port = await asyncio.wait_for(up.get(), 10)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_unary("/test.Held/Wait")(b"")
    await asyncio.wait_for(started.wait(), 10)
    return task, runtime, channel, call


async def _until_draining(runtime: DaemonRuntime) -> None:
    async with asyncio.timeout(5):
        while runtime.is_serving():
            await asyncio.sleep(0.01)


async def test_a_second_stop_signal_cancels_the_calls_in_flight_instead_of_draining_them(tmp_path, monkeypatch):
    """Ctrl-C twice: the first signal drains (a call in flight may take the whole drain timeout), the
    second cancels what is still in flight and the daemon leaves at once."""
    monkeypatch.setattr(DaemonRuntime, "stop_signalled", False)
    task, runtime, channel, call = await _serve_with_a_held_call(tmp_path, asyncio.Event())
    async with channel:
        os.kill(os.getpid(), signal.SIGTERM)
        await _until_draining(runtime)
        await asyncio.sleep(0.3)
        assert not task.done() and not call.done(), "the first signal drains: the call in flight holds the exit"
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(grpc.aio.AioRpcError) as cancelled:
            await asyncio.wait_for(call, 5)
        assert cancelled.value.code() == grpc.StatusCode.UNAVAILABLE
        await asyncio.wait_for(task, 5)  # long before the 60 s drain timeout
    assert not list(tmp_path.rglob("*.lease")), "revoked, not left to expire"


async def test_one_stop_signal_after_a_drain_request_still_drains(tmp_path, monkeypatch):
    """``kvmesh drain``, then ``systemctl stop`` (one SIGTERM): that signal is the first, so the call in
    flight finishes; only a second *signal* cuts a drain short."""
    monkeypatch.setattr(DaemonRuntime, "stop_signalled", False)
    release = asyncio.Event()
    task, runtime, channel, call = await _serve_with_a_held_call(tmp_path, release)
    async with channel:
        drained = await admin_pb2_grpc.AdminServiceStub(channel).Drain(admin_pb2.DrainRequest(reason="test"))
        assert drained.started
        await _until_draining(runtime)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(0.3)
        assert not call.done()
        release.set()
        assert await asyncio.wait_for(call, 5) == b"done"
        await asyncio.wait_for(task, 5)


async def test_a_bound_port_is_held_through_a_long_start_up_and_answers_once_started(tmp_path):
    """A worker binds before loading its engines (a minute with vLLM): nothing else can take the port
    meanwhile (the engines' own rendezvous sockets once did), and a call made then is answered on start."""
    async with DaemonRuntime("kvmesh-test", settings(tmp_path)) as runtime:
        port = runtime.bind(0, "127.0.0.1")
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            check = asyncio.ensure_future(
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            )
            await asyncio.sleep(0.5)  # start-up work
            assert not check.done(), "no answer before the server starts"
            assert await runtime.start(port) == port
            assert (await check).status == health_pb2.HealthCheckResponse.SERVING
