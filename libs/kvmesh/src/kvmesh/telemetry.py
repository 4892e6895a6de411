"""Metrics, traces and logs, set up the same way by every daemon.

- Prometheus: ``/metrics`` on ``--metrics-port``, served by prometheus-client's WSGI app on an HTTP
  thread of its own, so a busy event loop never delays a scrape; binding it never waits on DNS.
- OpenTelemetry: one tracer provider per process; trace context travels in gRPC metadata via the
  opentelemetry-instrumentation-grpc interceptors, so one request is one trace across daemons.
  With ``--otel-exporter none`` no interceptor is installed and the hot paths pay nothing.
- Logs: text or JSON lines; ``request_id`` is taken from a context variable so every line logged
  while serving a request carries it without threading it through calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import json
import logging
import socket
import socketserver
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, MutableMapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import grpc
from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("kvmesh_request_id", default="")

_tracing_enabled = False
# The span of the request this task is serving (frontend): requests multiplexed on one stream each get
# their own trace, so "current span" is explicit here rather than the stream call's span.
request_span_var: contextvars.ContextVar[Any] = contextvars.ContextVar("kvmesh_request_span", default=None)
# Streams whose every message is a request of its own: no span for the whole call (see per-request spans).
PER_REQUEST_STREAMS = frozenset(
    {
        "/inference.GRPCInferenceService/ModelStreamInfer",
        "/kvmesh.v1.WorkerService/GenerateStream",
        "/kvmesh.v1.RouterService/Session",
    }
)


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, request_id (+ exc)."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", "")  # set by _RequestIdFilter; absent on foreign records
        if request_id:
            doc["request_id"] = request_id
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


class TextFormatter(logging.Formatter):
    """Human-readable lines; ``[request_id]`` follows the level when one is being served."""

    def __init__(self, daemon: str) -> None:
        super().__init__(f"%(asctime)s {daemon} %(levelname)s %(name)s:%(request)s %(message)s")
        self.converter = time.gmtime

    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", "")
        record.request = f" [{request_id}]" if request_id else ""
        return super().format(record)


def setup_logging(daemon: str, level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter(daemon))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def start_metrics_server(port: int, host: str = "0.0.0.0") -> int | None:
    """Serve /metrics; ``port`` 0 picks a free port, negative disables. Returns the bound port.

    A port that cannot be bound is the user's to fix: one line and exit 2 (``settings.fail``), whose
    SystemExit unwinds the caller's lease and discovery like any other start-up refusal.
    """
    if port < 0:
        return None
    try:
        server = _serve_metrics(host, port)
    except OSError as exc:
        from pathlib import Path

        from kvmesh.settings import fail

        fail(Path(sys.argv[0]).name, f"--metrics-port {port}: cannot bind ({exc.strerror or exc})")
    return int(server.server_port)


class _MetricsHttpServer(ThreadingWSGIServer):
    """prometheus-client's server, minus the reverse DNS lookup of its own address at bind.

    ``http.server.HTTPServer.server_bind`` names itself ``socket.getfqdn(host)``. Where no resolver
    answers (a host whose DNS is down, a network namespace) that lookup blocks for the resolver's
    whole timeout, ~10 s, inside a daemon's start-up. The name only fills WSGI's ``SERVER_NAME``,
    which the metrics app never reads, so the bound address stands in for it.
    """

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)
        self.setup_environ()


class _SilentHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """A scrape is not worth a log line."""


def _serve_metrics(host: str, port: int) -> _MetricsHttpServer:
    """``/metrics`` of the default registry on a daemon thread (what ``start_http_server`` does)."""
    # "[::1]" is how an IPv6 --bind-host reads in a gRPC target; a socket wants it bare
    bare = host.strip("[]")
    family, _, _, _, sockaddr = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

    class Server(_MetricsHttpServer):
        address_family = family

    server = make_server(str(sockaddr[0]), port, make_wsgi_app(), Server, handler_class=_SilentHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


def setup_tracing(service_name: str, exporter: str = "none", endpoint: str = "") -> None:
    """Install the process tracer provider; a no-op for ``exporter == "none"``."""
    global _tracing_enabled
    if exporter == "none":
        return
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    span_exporter: SpanExporter
    if exporter == "console":
        span_exporter = ConsoleSpanExporter(out=sys.stderr)
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        span_exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True)
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    trace.set_tracer_provider(provider)
    _tracing_enabled = True


def shutdown_tracing() -> None:
    if not _tracing_enabled:
        return
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()


def _status_of(span: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    """The call's status on its SERVER span: handlers end a call with ``context.set_code`` (no exception)
    or ``context.abort`` (AbortError, the code already set), and the span must carry that code either way."""
    code: grpc.StatusCode | None = context.code()  # None (whatever the stubs say): nothing set, the call ends OK
    if code is None:
        code = grpc.StatusCode.OK
    _set_status(span, code, context.details() or "")


def _set_status(span: Any, code: grpc.StatusCode, details: str) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is not grpc.StatusCode.OK:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}"))


@contextlib.contextmanager
def _call_status(span: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Iterator[None]:
    """Put the call's outcome on ``span``: its gRPC status, CANCELLED, or the handler's bug (UNKNOWN)."""
    try:
        yield
    except grpc.aio.AbortError:
        _status_of(span, context)
        raise
    except (asyncio.CancelledError, GeneratorExit):  # a stream closed under its handler is a cancel, not a bug
        _set_status(span, grpc.StatusCode.CANCELLED, "the call was cancelled")
        raise
    except BaseException as exc:
        span.record_exception(exc)
        _set_status(span, grpc.StatusCode.UNKNOWN, type(exc).__name__)
        raise
    _status_of(span, context)


class TracingServerInterceptor(grpc.aio.ServerInterceptor):
    """One SERVER span per call, parented on the trace context the caller sent in metadata.

    Written here because opentelemetry-instrumentation-grpc's aio server interceptor only supports
    streaming handlers that are async generators; ours also stream with ``context.write``.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method in PER_REQUEST_STREAMS:
            return handler  # one trace per request on these streams, not one per stream
        from opentelemetry import propagate, trace

        method = handler_call_details.method
        carrier = {
            key: value for key, value in (handler_call_details.invocation_metadata or ()) if isinstance(value, str)
        }
        tracer = trace.get_tracer("kvmesh.grpc")

        def span() -> Any:
            return tracer.start_as_current_span(
                method.lstrip("/"),
                context=propagate.extract(carrier),
                kind=trace.SpanKind.SERVER,
                attributes={"rpc.system": "grpc", "rpc.method": method},
                record_exception=False,  # _call_status records what is a bug, not an abort's AbortError
                set_status_on_exception=False,
            )

        def wrap(behavior: Callable[..., Any]) -> Callable[..., Any]:
            if inspect.isasyncgenfunction(behavior):

                async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
                    with span() as current, _call_status(current, context):
                        async for response in behavior(request, context):
                            yield response

                return stream

            async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                with span() as current, _call_status(current, context):
                    return await behavior(request, context)

            return call

        kinds = (
            ("unary_unary", grpc.unary_unary_rpc_method_handler),
            ("unary_stream", grpc.unary_stream_rpc_method_handler),
            ("stream_unary", grpc.stream_unary_rpc_method_handler),
            ("stream_stream", grpc.stream_stream_rpc_method_handler),
        )
        for attr, factory in kinds:
            behavior = getattr(handler, attr)
            if behavior is not None:
                return factory(
                    wrap(behavior),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler


def inject_trace_context(carrier: MutableMapping[str, str], span: Any = None) -> None:
    """Write a span's W3C trace context into ``carrier`` (a no-op when tracing is off).

    ``span``, else the request's (``request_span_var``), else the current one. For requests multiplexed
    on one stream, where per-call gRPC metadata cannot carry a context per request.
    """
    if _tracing_enabled:
        from opentelemetry import propagate, trace

        span = span if span is not None else request_span_var.get()
        propagate.inject(carrier, context=trace.set_span_in_context(span) if span is not None else None)


def start_span(
    name: str,
    parent: Any = None,
    *,
    root: bool = False,
    server: bool = False,
    attributes: Mapping[str, Any] | None = None,
    start_time: float | None = None,
) -> Any:
    """A span under ``parent`` (a span; else the request's span, else the current one); None when off.

    ``root``: a new trace (one per request of a multiplexed stream). ``start_time``: epoch seconds,
    for a phase measured before the span could be made. Never made current: end it with :func:`end_span`.
    """
    if not _tracing_enabled:
        return None
    from opentelemetry import context as otel_context
    from opentelemetry import trace

    parent = parent if parent is not None else request_span_var.get()
    if root:
        ctx = otel_context.Context()
    elif parent is not None:
        ctx = trace.set_span_in_context(parent)
    else:
        ctx = None
    return trace.get_tracer("kvmesh").start_span(
        name,
        context=ctx,
        kind=trace.SpanKind.SERVER if server else trace.SpanKind.INTERNAL,
        attributes=dict(attributes or {}),
        start_time=None if start_time is None else int(start_time * 1e9),
    )


def end_span(
    span: Any, error: str | None = None, attributes: Mapping[str, Any] | None = None, end_time: float | None = None
) -> None:
    """End a span from :func:`start_span` (accepts None); ``end_time`` in epoch seconds."""
    if span is None:
        return
    if attributes:
        span.set_attributes(dict(attributes))
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=None if end_time is None else int(end_time * 1e9))


def tracing_enabled() -> bool:
    return _tracing_enabled


@contextlib.contextmanager
def current_span(span: Any = None) -> Iterator[None]:
    """Make ``span`` (else the request's, ``request_span_var``) current for the calls made inside, so that
    a background call of a request (a ``ReleaseKv``) joins the request's trace; a no-op when tracing is off."""
    span = span if span is not None else request_span_var.get()
    if not _tracing_enabled or span is None:
        yield
        return
    from opentelemetry import context, trace

    token = context.attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        context.detach(token)


def start_request_span(name: str, carrier: Mapping[str, str]) -> Any:
    """A SERVER span for one request of a multiplexed stream, parented on ``carrier``; None when tracing is off."""
    if not _tracing_enabled:
        return None
    from opentelemetry import propagate, trace

    return trace.get_tracer("kvmesh.grpc").start_span(
        name, context=propagate.extract(dict(carrier)), kind=trace.SpanKind.SERVER, attributes={"rpc.system": "grpc"}
    )


def end_request_span(span: Any, error: str | None) -> None:
    """End a span from :func:`start_request_span` (``error`` marks it failed); accepts None."""
    if span is None:
        return
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    return [TracingServerInterceptor()] if _tracing_enabled else []


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    if not _tracing_enabled:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors, filters

    # A span per long-lived stream would sit in whichever request's trace opened it: requests on these
    # streams carry their own context in the message instead.
    per_request = filters.any_of(*(filters.full_method_name(m) for m in PER_REQUEST_STREAMS))
    return list(aio_client_interceptors(filter_=filters.negate(per_request)))
