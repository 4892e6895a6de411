"""Bytes that are not a method's request message get INVALID_ARGUMENT naming the message, never UNKNOWN
with protobuf's DecodeError; a method that asked for them (``in_band``) sees them as a sentinel and goes on.

Real servers on loopback, serving the real health and reflection servicers the daemons serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2
from kvmesh import grpc_services

HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
REFLECTION = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]
#: Not a HealthCheckRequest: field 1 (service, a string) holding bytes that are not UTF-8.
NOT_UTF8 = b"\x0a\x02\xff\xfe"
GARBAGE = b"\xff\xff\xff\xff"


def identity(data: bytes) -> bytes:
    return data


class InBandEcho:
    """A stream that answers each message, saying which ones did not parse (as Session and GenerateStream do)."""

    async def ServerReflectionInfo(
        self, requests: AsyncIterator[reflection_pb2.ServerReflectionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[reflection_pb2.ServerReflectionResponse]:
        async for request in requests:
            answer = "malformed" if grpc_services.is_malformed(request) else request.host
            yield reflection_pb2.ServerReflectionResponse(valid_host=answer)


@contextlib.asynccontextmanager
async def serving(service: ServiceDescriptor, servicer: object, in_band: tuple[str, ...] = ()):
    """A channel to a loopback server with ``servicer`` registered through grpc_services."""
    server = grpc.aio.server()
    grpc_services.add_service(server, service, servicer, in_band=in_band)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(None)


def reflection_info(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall:
    """A ServerReflectionInfo call that sends raw bytes."""
    method = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    return channel.stream_stream(method, identity, reflection_pb2.ServerReflectionResponse.FromString)()


async def test_a_unary_method_answers_bytes_that_do_not_parse_with_invalid_argument(caplog) -> None:
    servicer = health.aio.HealthServicer()
    await servicer.set("svc", health_pb2.HealthCheckResponse.SERVING)
    caplog.set_level(logging.DEBUG)
    async with serving(HEALTH, servicer) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check", identity, health_pb2.HealthCheckResponse.FromString)
        for data in (NOT_UTF8, GARBAGE):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await check(data)
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details() == (
                "the message is not a valid grpc.health.v1.HealthCheckRequest "
                "(it does not parse, or a string field is not UTF-8)"
            )
        served = await check(health_pb2.HealthCheckRequest(service="svc").SerializeToString())
        assert served.status == health_pb2.HealthCheckResponse.SERVING
        watch = channel.unary_stream(
            "/grpc.health.v1.Health/Watch", identity, health_pb2.HealthCheckResponse.FromString
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in watch(GARBAGE):
                pass
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    # gRPC logs a handler's exception as ERROR "Unexpected [DecodeError] raised by servicer method" (other
    # loggers may carry unrelated noise, e.g. a poller thread waking an earlier test's closed loop)
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("grpc") and r.levelno >= logging.WARNING]
    assert not logged, f"a client's bad bytes were logged: {logged}"


async def test_a_stream_ends_invalid_argument_at_the_first_message_that_does_not_parse() -> None:
    async with serving(REFLECTION, reflection.aio.ReflectionServicer(["svc"])) as channel:
        call = reflection_info(channel)
        await call.write(reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString())
        listed = await call.read()
        assert [s.name for s in listed.list_services_response.service] == ["svc"]
        await call.write(GARBAGE)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "grpc.reflection.v1alpha.ServerReflectionRequest" in caught.value.details()


async def test_an_in_band_stream_sees_the_sentinel_and_serves_the_rest() -> None:
    async with serving(REFLECTION, InBandEcho(), ("ServerReflectionInfo",)) as channel:
        call = reflection_info(channel)
        for message in (b"\x0a\x01a", GARBAGE, b"\x0a\x01b"):  # host "a", garbage, host "b"
            await call.write(message)
        answers = [(await asyncio.wait_for(call.read(), 5)).valid_host for _ in range(3)]
        assert answers == ["a", "malformed", "b"]
        await call.done_writing()
        assert await call.code() is grpc.StatusCode.OK


def test_the_sentinel_is_one_instance_per_message_type_and_no_real_message_is_one() -> None:
    sentinel = grpc_services.malformed(health_pb2.HealthCheckRequest)
    assert grpc_services.malformed(health_pb2.HealthCheckRequest) is sentinel
    assert grpc_services.is_malformed(sentinel)
    assert not grpc_services.is_malformed(health_pb2.HealthCheckRequest())
    assert not grpc_services.is_malformed(health_pb2.HealthCheckResponse())


async def test_naming_a_method_the_service_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="has no method Chek"):
        grpc_services.add_service(grpc.aio.server(), HEALTH, health.aio.HealthServicer(), in_band=("Chek",))
