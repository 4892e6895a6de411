"""A call's SERVER span carries the call's status, however the handler ended it.

kvmesh handlers end a refused call with ``context.set_code`` rather than an exception (see the
frontend's ``_refuse``): a span that only saw exceptions said UNSET for every refusal. Others (and
grpc-health) end it with ``context.abort``, whose AbortError said only "Locally aborted".
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvmesh.telemetry import TracingServerInterceptor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode


class Refusing(health_pb2_grpc.HealthServicer):
    async def Check(self, request, context):
        if request.service == "refuse":
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details("no such service")
        elif request.service == "abort":
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not for you")
        elif request.service == "bug":
            raise KeyError("internal")
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr("opentelemetry.trace.get_tracer", provider.get_tracer)
    yield exporter


async def test_a_call_refused_with_set_code_is_an_error_span_and_an_answered_one_is_not(spans) -> None:
    server = grpc.aio.server(interceptors=[TracingServerInterceptor()])
    health_pb2_grpc.add_HealthServicer_to_server(Refusing(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest(service="fine"))
            for service in ("refuse", "abort", "bug"):
                with pytest.raises(grpc.aio.AioRpcError):
                    await stub.Check(health_pb2.HealthCheckRequest(service=service))
    finally:
        await server.stop(None)
    fine, refused, aborted, bug = spans.get_finished_spans()
    assert fine.status.status_code is StatusCode.UNSET and fine.attributes["rpc.grpc.status_code"] == 0
    assert refused.status.status_code is StatusCode.ERROR and refused.attributes["rpc.grpc.status_code"] == 5
    assert refused.status.description == "NOT_FOUND: no such service"
    assert aborted.status.status_code is StatusCode.ERROR and aborted.attributes["rpc.grpc.status_code"] == 7
    assert aborted.status.description == "PERMISSION_DENIED: not for you" and not aborted.events
    assert bug.attributes["rpc.grpc.status_code"] == 2 and bug.status.description == "UNKNOWN: KeyError"
    assert [event.name for event in bug.events] == ["exception"]  # the bug's traceback, for the operator


async def test_a_stream_closed_under_its_handler_is_a_cancelled_call_not_a_bug(spans) -> None:
    """gRPC closes a streaming handler's generator (GeneratorExit at its yield) when the call ends early."""

    async def numbers(request, context):
        for i in range(10):
            yield i

    async def continuation(_details):
        return grpc.unary_stream_rpc_method_handler(numbers)

    details = grpc.HandlerCallDetails()
    details.method, details.invocation_metadata = "/test.Numbers/Stream", ()
    handler = await TracingServerInterceptor().intercept_service(continuation, details)

    class Context:  # what the interceptor reads of a servicer context, for a call with no code set yet
        def code(self):
            return None

        def details(self):
            return None

    stream = handler.unary_stream(None, Context())
    assert await anext(stream) == 0
    await stream.aclose()
    (span,) = spans.get_finished_spans()
    assert span.attributes["rpc.grpc.status_code"] == 1
    assert span.status.description == "CANCELLED: the call was cancelled"
    assert not span.events  # no exception recorded: nothing went wrong
