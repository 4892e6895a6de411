"""Channels to peers (``kvmesh.channels``): a peer restarted on its old address is reached at once."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kvmesh.channels import ChannelPool
from kvmesh.ports import free_port


async def _serve(port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def _check(channel: grpc.aio.Channel) -> grpc.StatusCode:
    try:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def test_a_new_instance_on_a_dead_ones_address_does_not_inherit_its_reconnect_backoff() -> None:
    """systemd restarts a router on its fixed port under a new instance id. The dead instance's channel
    failed to connect and is backing off; it is closed only later (a task). The new instance's channel
    must connect at once, not share the old one's connection attempt and fail its first call with the
    old "connection refused" (gRPC shares subchannels between channels of one target and options
    unless told not to)."""
    pool = ChannelPool()
    address = f"127.0.0.1:{free_port()}"
    try:
        dead = pool.get(0xAA, address)
        assert await _check(dead) == grpc.StatusCode.UNAVAILABLE  # nothing listens: backoff starts
        server = await _serve(int(address.rsplit(":", 1)[1]))
        try:
            restarted = pool.get(0xAB, address)  # the dead one's channel is still open
            assert await _check(restarted) == grpc.StatusCode.OK
        finally:
            await server.stop(grace=None)
    finally:
        await pool.close()


async def test_a_bounded_pool_closes_its_least_recently_used_channel() -> None:
    """A decode worker keeps a channel per prefill worker it released KV to, keyed by the address the
    request named: unbounded, 4000 addresses cost 4000 file descriptors and 170 MB, for good."""
    pool = ChannelPool(max_channels=2)
    server = await _serve(port := free_port())
    address = f"127.0.0.1:{port}"
    try:
        first = pool.get("a", address)
        assert await _check(first) == grpc.StatusCode.OK
        pool.get("b", address)
        assert pool.get("a", address) is first  # used again: now "b" is the least recently used
        pool.get("c", address)
        assert len(pool) == 2 and "b" not in pool and "a" in pool
        assert await _check(first) == grpc.StatusCode.OK
        pool.get("d", address)  # "a" goes now: closed once its calls end (there are none)
        async with asyncio.timeout(5):
            while first.get_state() != grpc.ChannelConnectivity.SHUTDOWN:
                await asyncio.sleep(0.01)
    finally:
        await pool.close()
        await server.stop(None)


async def test_a_peer_that_left_has_its_channel_closed_and_a_new_one_if_it_comes_back() -> None:
    """A router keeps a channel per worker address: in a fleet that scales on new ports, one per worker
    it ever saw, for good. Released when the worker's last engine leaves."""
    pool = ChannelPool()
    server = await _serve(port := free_port())
    address = f"127.0.0.1:{port}"
    try:
        old = pool.get("worker/x", address)
        assert await _check(old) == grpc.StatusCode.OK
        pool.release("worker/x")
        assert "worker/x" not in pool
        async with asyncio.timeout(5):
            while old.get_state() != grpc.ChannelConnectivity.SHUTDOWN:
                await asyncio.sleep(0.01)
        new = pool.get("worker/x", address)
        assert new is not old and await _check(new) == grpc.StatusCode.OK
        pool.release("worker/never-seen")  # nothing to do
    finally:
        await pool.close()
        await server.stop(None)
