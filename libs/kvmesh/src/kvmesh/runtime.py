"""The lifecycle every kvmesh daemon shares: lease, gRPC server, health, reflection, drain.

Invariants (the reasons this module exists):
- **Serving never depends on discovery being reachable.** Health and the serving gate follow only
  the process's own state (warm-up, drain). While etcd is unreachable the daemon keeps serving on
  the membership it last saw; whether it is dead is decided by the others (routers and frontends
  drop an instance whose record vanished while discovery is up), never by the daemon stopping itself.
- **No zombie.** The lease keeper never gives up: if the backend dropped the lease (this process was
  frozen, cut off, or etcd expired it), the keeper re-registers every record under its old key
  (same instance id) within about a second of discovery answering, without a restart. Instance
  ids are minted from the first lease and never change, so caches and streams keyed by them survive.
- **Graceful exit.** SIGTERM/SIGINT: new calls are refused and health goes NOT_SERVING, then the lease
  is revoked (every record vanishes at once, so nobody routes new work here) while ``on_draining``
  hooks end endless streams; then the port closes (gRPC's graceful stop: GOAWAY, new connections
  refused, so a health probe from then on sees no server, and only a Watch opened before saw
  NOT_SERVING), in-flight calls get ``--drain-timeout`` seconds to finish, and the process exits 0.
  A *second* stop signal (Ctrl-C twice) cuts the drain short: the calls still in flight are
  cancelled (UNAVAILABLE) and the exit goes on at once. Only signals count: one SIGTERM after a
  ``kvmesh drain`` (``systemctl stop`` once the operator drained it) is the first, and drains.
  SIGHUP, the parent-death signal of a daemon that ``kvmesh up`` or the planner started
  (``kvmesh.children``), stops it like a first SIGTERM, however many times it comes.
  The handlers are installed before the lease is taken: a signal during start-up (``kvmesh up``
  stopping a daemon whose sibling failed) lets the lease grant finish, then cancels the start-up, so
  leaving the block revokes the lease; it is never left to expire.
- **Bad config** exits 2 with one line (``kvmesh.settings.fail``), a gRPC port that cannot be bound
  included (checked before gRPC binds it); **unreachable discovery** at start-up
  exits 69 (``EXIT_UNAVAILABLE``) with one line: a restart can fix that, not a bad setting.
- **Ownership.** ``async with DaemonRuntime(...)`` is the process's lifetime, as with Temporal's
  ``Worker``. Leaving the block (stop signal, error or ``fail``) always runs the same sequence:
  draining starts (new calls refused, ``on_draining`` hooks), the lease is revoked, in-flight calls
  drain, then everything handed to ``runtime.resources`` (an ``AsyncExitStack``) closes, newest
  first, and discovery and tracing last. No daemon orders ``close()`` calls by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import inspect
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Coroutine, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import grpc
import uvloop
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection

from kvmesh import grpc_services, sd_notify, telemetry, tls
from kvmesh import reflection as kvmesh_reflection
from kvmesh.children import PARENT_DEATH_SIGNAL
from kvmesh.discovery import Discovery, DiscoveryRefused, DiscoveryUnavailable, Lease, instance_key, open_discovery
from kvmesh.grpc_options import SERVER_OPTIONS
from kvmesh.identity import RoleGate
from kvmesh.settings import EXIT_UNAVAILABLE, DaemonSettings, fail
from kvmesh.v1 import admin_pb2, admin_pb2_grpc, discovery_pb2

log = logging.getLogger(__name__)

VERSION = "0.1.0"
_ALWAYS_ALLOWED = ("/grpc.health.v1.Health/", "/grpc.reflection.", "/kvmesh.v1.AdminService/")


class _ServingGate(grpc.aio.ServerInterceptor):
    """Refuses new calls while the daemon must not serve (draining)."""

    def __init__(self, is_serving: Callable[[], bool], reason: Callable[[], str]) -> None:
        self._is_serving = is_serving
        self._reason = reason

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        if self._is_serving() or handler_call_details.method.startswith(_ALWAYS_ALLOWED):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        reason = self._reason()

        # Refusals set the status and return instead of ``context.abort``: an abort that reaches a
        # streaming client before its first write makes grpc.aio's client report "INTERNAL: Internal
        # error from Core" instead of UNAVAILABLE, and an aborted call's request stays in memory
        # until the cyclic GC runs. A client-streaming call is refused after its first message
        # arrives (or 1 s), so that the client's first write cannot race the trailers.
        async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            if handler.request_streaming:
                await _first_message(request)
            context.set_code(grpc.StatusCode.UNAVAILABLE)
            context.set_details(reason)

        async def refuse_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            await refuse(request, context)
            nothing: tuple[Any, ...] = ()
            for item in nothing:  # a yield makes this an async generator; it yields nothing
                yield item

        if handler.response_streaming:
            factory = (
                grpc.unary_stream_rpc_method_handler
                if not handler.request_streaming
                else grpc.stream_stream_rpc_method_handler
            )
            return factory(
                refuse_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        factory = (
            grpc.unary_unary_rpc_method_handler
            if not handler.request_streaming
            else grpc.stream_unary_rpc_method_handler
        )
        return factory(
            refuse, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )


async def _first_message(requests: AsyncIterator[Any]) -> None:
    """Wait (up to 1 s) for a refused stream's first message, or for the client to end it."""
    with contextlib.suppress(TimeoutError, StopAsyncIteration, grpc.RpcError):
        async with asyncio.timeout(1.0):
            await anext(aiter(requests))


class _Admin(admin_pb2_grpc.AdminServiceServicer):
    """``kvmesh drain``: the SIGTERM drain by RPC; operator certificate (kvmesh.identity), or loopback without TLS."""

    def __init__(self, runtime: DaemonRuntime) -> None:
        self._runtime = runtime

    async def Drain(
        self, request: admin_pb2.DrainRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> admin_pb2.DrainResponse:
        runtime = self._runtime
        if runtime.tls is None and not context.peer().startswith(("ipv4:127.", "ipv6:[::1]", "unix:")):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "without TLS, drain is accepted from loopback only")
        started = not runtime._stop.is_set() and not runtime._draining
        log.warning("drain requested by %s: %s", context.peer(), request.reason or "no reason given")
        runtime._stop.set()
        return admin_pb2.DrainResponse(instance_id=f"{runtime.instance_id:x}", started=started)


_IN_USE = os.strerror(errno.EADDRINUSE)


def grpc_target(host: str, port: int) -> str:
    """``host:port`` as gRPC reads it: an IPv6 address in brackets (``[::1]:8001``)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _why_unbindable(host: str, port: int) -> str | None:
    """Why gRPC could bind none of ``host``'s addresses on ``port`` (in use, not this host's), or None.

    The same rules as gRPC's own bind: SO_REUSEADDR (a port in TIME_WAIT is free), no SO_REUSEPORT
    (``grpc.so_reuseport`` is off), and a host name is fine if any of its addresses binds.
    """
    try:  # port 0 too: it binds wherever the host is one of this machine's addresses
        addresses = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve {host!r}: {exc.strerror}"
    why = "no address"
    for family, kind, proto, _name, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                why = exc.strerror or str(exc)
                continue
        return None
    return why


_S = TypeVar("_S", bound=DaemonSettings)


def run_daemon(prog: str, settings: _S, serve: Callable[[_S], Coroutine[Any, Any, int | None]]) -> int:
    """A daemon's ``main`` after parsing its settings: logging and tracing set up, then ``serve`` on uvloop."""
    telemetry.setup_logging(prog, settings.log_level, settings.log_format)
    telemetry.setup_tracing(prog, settings.otel_exporter, settings.otel_endpoint)
    try:
        return uvloop.run(serve(settings)) or 0
    except asyncio.CancelledError:
        if not DaemonRuntime.stop_signalled:
            raise
        return 0  # stopped by SIGTERM/SIGINT during start-up, after a clean unwind (see DaemonRuntime)
    finally:
        release_grpc_objects()


def release_grpc_objects() -> None:
    """Free the stopped daemon's objects, gRPC's among them, before the interpreter's exit hooks run.

    With TLS on, gRPC core's exit hook waits up to 2 s for every gRPC object to be released
    (``grpc_wait_for_shutdown_with_timeout``). A daemon's server, servicers and channels form reference
    cycles, and the worker and router freeze their start-up objects out of the cyclic GC
    (``gc.freeze``), so nothing frees them before that hook: every TLS daemon took 2 s more to exit
    after its drain. Unfrozen and collected here, they are gone when the hook runs.
    """
    gc.unfreeze()
    gc.collect()


class DaemonRuntime:
    """Owns discovery, the lease, the gRPC server and the signal handling of one daemon process.

    Usage (``async with`` takes the lease; leaving it drains and releases everything)::

        async with DaemonRuntime("kvmesh-worker", settings) as runtime:
            pool = ChannelPool()
            runtime.resources.push_async_callback(pool.close)  # closed after the drain
            runtime.add_service(...)
            await runtime.start(settings.grpc_port)
            await runtime.register(runtime.instance_record(...))
            await runtime.wait_for_stop()
    """

    stop_signalled = False
    """A stop signal reached a runtime of this process (``run_daemon`` then exits 0 on a cancelled start-up)."""

    def __init__(
        self,
        name: str,
        settings: DaemonSettings,
        *,
        server_options: Sequence[tuple[str, Any]] = SERVER_OPTIONS,
        interceptors: tuple[grpc.aio.ServerInterceptor, ...] = (),
    ) -> None:
        self.name = name
        self.settings = settings
        self.resources = AsyncExitStack()
        """What the daemon built on top of the runtime; closed after the drain, newest first."""
        self.instance_id = 0
        self.address = ""
        self._bound = 0  # the gRPC port, once bound
        self.metrics_address = ""
        self.server = grpc.aio.server(
            interceptors=[
                _ServingGate(self.is_serving, self._refusal_reason),
                *([RoleGate()] if settings.tls_enabled else []),  # security: mesh roles, see kvmesh.identity
                *interceptors,
                *telemetry.server_interceptors(),
            ],
            options=list(server_options),
        )
        self.health = health.aio.HealthServicer()
        grpc_services.add_service(self.server, admin_pb2.DESCRIPTOR.services_by_name["AdminService"], _Admin(self))
        self._discovery: Discovery | None = None
        self._lease: Lease | None = None
        self._service_names: list[str] = [
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            kvmesh_reflection.V1_SERVICE_NAME,  # health answers SERVING for every service listed
            reflection.SERVICE_NAME,
            admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
        ]
        self._records: dict[str, discovery_pb2.InstanceRecord] = {}
        self._publish_failing = False  # a publish failed and none has succeeded since: warned once
        self._draining = False
        self._ready = True
        self._stop = asyncio.Event()
        self._started_task: asyncio.Task[Any] | None = None  # the block's task: a start-up signal cancels it
        self._waiting = False  # in wait_for_stop: a signal then just ends the wait
        self._stop_signals = 0  # SIGTERM/SIGINT received: from the second on, the drain is cut short
        self._server_stopping = False  # the drain's graceful server stop is under way
        self._cut_short: asyncio.Task[None] | None = None  # the second signal's server stop (a reference)
        self._drain_hooks: list[Callable[[], Awaitable[None] | None]] = []
        self._exit = AsyncExitStack()
        self.started_unix_ms = int(time.time() * 1000)
        self.tls: tls.TlsMaterial | None = None
        self._notified_ready = False
        self._notify_before_ready = False
        self._started = False

    @property
    def discovery(self) -> Discovery:
        assert self._discovery is not None, "inside `async with DaemonRuntime(...)` only"
        return self._discovery

    @property
    def lease(self) -> Lease:
        assert self._lease is not None, "inside `async with DaemonRuntime(...)` only"
        return self._lease

    # -- lifecycle ------------------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        """Open discovery and take the lease; unreachable discovery exits 69 with one line."""
        settings = self.settings
        async with AsyncExitStack() as stack:  # unwinds what was opened if anything here fails
            stack.callback(telemetry.shutdown_tracing)
            self._handle_stop_signals(stack)
            self._open_tls_and_watchdog(stack)
            try:
                self._discovery = await open_discovery(settings.discovery, ttl=settings.lease_ttl)
                stack.push_async_callback(self._discovery.close)
                self._lease = await self._discovery.grant_lease(
                    on_lost=self._on_lease_lost, on_renewed=self._on_lease_renewed
                )
            except DiscoveryRefused as exc:
                fail(self.name, f"--discovery {settings.discovery}: {exc}")
            except DiscoveryUnavailable as exc:
                fail(self.name, f"--discovery {settings.discovery}: {exc}", EXIT_UNAVAILABLE)
            self.instance_id = self._lease.id
            port = telemetry.start_metrics_server(settings.metrics_port, settings.bind_host)
            if port is not None:
                self.metrics_address = f"{settings.host}:{port}"
            stack.push_async_callback(self.resources.aclose)
            stack.push_async_callback(self._drain)  # exits run newest first: drain, resources, discovery
            self._exit = stack.pop_all()
        self._started_task = asyncio.current_task()
        if self._stop.is_set():  # signalled while taking the lease: leave the block as soon as it is entered
            self._cancel_start_up()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # only callbacks are on the stack, so it never suppresses: None tells mypy the body's return is final
        await self._exit.__aexit__(exc_type, exc, tb)

    def _handle_stop_signals(self, stack: AsyncExitStack) -> None:
        """SIGTERM/SIGINT set the stop event from now on, start-up included (see the module docstring);
        so does SIGHUP, the parent-death signal of a daemon started by another (``kvmesh.children``)."""
        loop = asyncio.get_running_loop()
        handlers = {signal.SIGTERM: self._on_stop_signal, signal.SIGINT: self._on_stop_signal}
        handlers[PARENT_DEATH_SIGNAL] = self._on_parent_gone
        for sig, handler in handlers.items():
            try:
                loop.add_signal_handler(sig, handler)
            except (ValueError, RuntimeError):  # a loop outside the main thread (in-process tests): no signals
                return
            stack.callback(loop.remove_signal_handler, sig)

    def _on_parent_gone(self) -> None:
        """The kernel sends it once per thread of the dying parent that the child passes through: only
        the first counts, as a first stop signal would; it never cuts a drain short."""
        if self._stop_signals == 0:
            log.warning("the process that started this daemon is gone: stopping")
            self._on_stop_signal()

    def _on_stop_signal(self) -> None:
        DaemonRuntime.stop_signalled = True
        self._stop_signals += 1
        if self._stop_signals > 1:
            if self._stop_signals == 2:
                self._cut_drain_short()
            return
        self._stop.set()
        if not self._waiting:
            self._cancel_start_up()

    def _cut_drain_short(self) -> None:
        """A second stop signal: cancel the calls still in flight now instead of after ``--drain-timeout``."""
        log.warning("second stop signal: cancelling the calls still in flight instead of draining them")
        if self._server_stopping:  # else the drain, once it gets there, stops the server with no grace
            self._cut_short = asyncio.get_running_loop().create_task(self.server.stop(grace=0))

    def _cancel_start_up(self) -> None:
        task = self._started_task
        if task is not None and not task.done() and not self._draining:
            log.info("stop signal during start-up: leaving before serving")
            task.cancel()

    def _open_tls_and_watchdog(self, stack: AsyncExitStack) -> None:
        """Load this daemon's mesh identity (client and server side) and start systemd's watchdog pings."""
        self._load_tls()
        interval = sd_notify.watchdog_interval()
        if interval is not None:
            task = asyncio.get_running_loop().create_task(sd_notify.watchdog_loop(interval))
            stack.callback(task.cancel)

    def _load_tls(self) -> None:
        """The mesh identity, once: on entering the block, or earlier by a :meth:`bind` before it."""
        settings = self.settings
        if not settings.tls_enabled or self.tls is not None:
            return
        try:
            self.tls = tls.load(settings.tls_cert, settings.tls_key, settings.tls_ca)
            etcd_ca = Path(settings.etcd_ca).read_bytes() if settings.etcd_ca else self.tls.ca
        except OSError as exc:
            fail(self.name, f"--tls-*/--etcd-ca: cannot read {exc.filename}: {exc.strerror}")
        tls.configure_client(self.tls)
        if settings.etcd_tls:
            tls.configure_etcd(tls.TlsMaterial(self.tls.cert, self.tls.key, etcd_ca))

    async def _drain(self) -> None:
        """Deregister at once (while ``on_draining`` hooks end endless streams), then drain in-flight calls."""
        self._draining = True  # before the first await: from here on new calls are refused
        sd_notify.notify("STOPPING=1\nSTATUS=draining")
        await self._set_health(False)  # first: a revoke stuck on a hung etcd must not keep probes on SERVING
        started = [result for hook in self._drain_hooks if inspect.isawaitable(result := hook())]
        for error in await asyncio.gather(self._revoke(), *started, return_exceptions=True):
            if isinstance(error, BaseException):
                log.error("a drain hook failed", exc_info=error)
        # gRPC's graceful stop: the port closes (GOAWAY on open connections, new ones refused) and the
        # calls in flight get the drain timeout. Probes and a second Drain are answered until then.
        self._server_stopping = True
        await self.server.stop(grace=0 if self._stop_signals > 1 else self.settings.drain_timeout)

    async def _revoke(self) -> None:
        try:
            await self.lease.revoke()
        except Exception:  # discovery may be down; the lease then expires by itself
            log.warning("could not revoke the lease; records expire within the TTL", exc_info=True)

    def add_service(self, service: ServiceDescriptor, servicer: Any, *, in_band: Collection[str] = ()) -> None:
        """Serve ``servicer`` as ``service`` (see :func:`kvmesh.grpc_services.add_service` for ``in_band``)."""
        grpc_services.add_service(self.server, service, servicer, in_band=in_band)
        self._service_names.append(service.full_name)

    def bind(self, port: int, bind_host: str | None = None, *, require_client_cert: bool = True) -> int:
        """Take ``bind_host:port`` now (default ``--bind-host``; 0 picks one) and return the bound port.

        The port listens from here on, but calls wait in the backlog until :meth:`start`. A daemon
        whose start-up is long (a worker loading its engines) binds first, before the block if it loads
        before taking its lease: its engines' own sockets (vLLM's rendezvous ports) can then never take
        the port meanwhile, and a port in use fails the daemon at once instead of after the load.

        With TLS on the port is TLS only; ``require_client_cert=False`` is for the frontend's KServe
        port alone (external clients), every daemon-to-daemon port requires a mesh client certificate.
        """
        if self._bound:
            raise RuntimeError("the gRPC port is already bound")
        self._load_tls()
        host = bind_host or self.settings.bind_host
        target = grpc_target(host, port)
        unbindable = _why_unbindable(host, port)
        if unbindable is not None:  # said before gRPC tries: its C core logs a line of its own first
            # a port in use is the port's fault; a host that is not this machine's (or no host) is the host's
            flag = f"--grpc-port {port}" if port and unbindable == _IN_USE else f"--bind-host {host}"
            fail(self.name, f"{flag}: cannot bind {target} ({unbindable})")
        try:
            if self.tls is not None:
                creds = tls.server_credentials(self.tls, require_client_cert=require_client_cert)
                bound = self.server.add_secure_port(target, creds)
            else:
                bound = self.server.add_insecure_port(target)
        except RuntimeError as exc:
            fail(self.name, f"--grpc-port {port}: cannot bind {target} ({exc})")
        if bound == 0:
            fail(self.name, f"--grpc-port {port}: cannot bind {target} (address in use, or not one of this host's?)")
        self._bound = bound
        return bound

    async def start(
        self,
        port: int,
        bind_host: str | None = None,
        *,
        ready: bool = True,
        require_client_cert: bool = True,
        notify_before_ready: bool = False,
    ) -> int:
        """Start serving, binding first as :meth:`bind` does unless that was done; returns the bound port.

        ``ready=False`` starts with health NOT_SERVING (a daemon that must warm up first, e.g. a
        router rebuilding its index); it turns SERVING on ``set_ready()``. systemd hears READY=1 when
        health first turns SERVING, or, with ``notify_before_ready``, as soon as the port serves: for a
        daemon whose readiness depends on others (the frontend's on a router and an engine), so that
        systemd does not hold its start until they come.
        """
        self._ready = ready
        self._notify_before_ready = notify_before_ready
        await self._set_health(False)  # before the port opens: no probe ever sees SERVING too early
        grpc_services.add_service(self.server, health_pb2.DESCRIPTOR.services_by_name["Health"], self.health)
        kvmesh_reflection.enable_server_reflection(self._service_names, self.server)  # v1 and v1alpha
        bound = self._bound or self.bind(port, bind_host, require_client_cert=require_client_cert)
        await self.server.start()
        self.address = f"{self.settings.host}:{bound}"
        self._started = True
        await self._set_health(True)
        return bound

    async def set_ready(self, ready: bool = True) -> None:
        """Health turns SERVING (the warm-up started with ``start(ready=False)`` is over), or, with
        ``ready=False``, NOT_SERVING again (until the next ``set_ready()``). Draining wins either way."""
        self._ready = ready
        await self._set_health(self._started)

    def instance_record(
        self, component: str, endpoint: str, instance_id: int | None = None, **fields: Any
    ) -> discovery_pb2.InstanceRecord:
        return discovery_pb2.InstanceRecord(
            namespace=self.settings.namespace,
            component=component,
            endpoint=endpoint,
            instance_id=instance_id if instance_id is not None else self.instance_id,
            lease_id=self.lease.id,
            address=self.address,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            version=VERSION,
            started_unix_ms=self.started_unix_ms,
            metrics_address=self.metrics_address,
            **fields,
        )

    async def register(self, record: discovery_pb2.InstanceRecord) -> str:
        """Publish an instance record under the lease; it lives exactly as long as the lease."""
        key = instance_key(record.namespace, record.component, record.endpoint, record.instance_id)
        self._records[key] = record
        await self.put(key, record.SerializeToString())
        return key

    async def put(self, key: str, value: bytes) -> None:
        """Publish any other record (e.g. a model card) under the lease.

        A write discovery does not take now (etcd frozen or down, a directory refusing writes) is not
        the daemon's end: the lease remembers the record and its keeper writes it once discovery answers
        again. Raising here stopped a serving daemon that an etcd blip caught publishing at start-up."""
        try:
            await self.lease.put(key, value)
        except DiscoveryUnavailable as exc:
            if not self._publish_failing:
                log.warning("%s: publishing %s failed (%s); it and those after it are kept and published once "
                            "discovery answers", self.name, key, exc)  # fmt: skip
            self._publish_failing = True
        else:
            self._publish_failing = False

    def is_serving(self) -> bool:
        """Not draining. Deliberately not "lease alive": see the module docstring."""
        return not self._draining and self._lease is not None

    def refusal(self) -> str | None:
        """Why new work is refused right now (draining); None while serving."""
        return None if self.is_serving() else self._refusal_reason()

    def on_draining(self, hook: Callable[[], Awaitable[None] | None]) -> None:
        """Run ``hook`` (awaited if async) when shutdown begins, before in-flight calls drain: endless streams end."""
        self._drain_hooks.append(hook)

    def _refusal_reason(self) -> str:
        if self._draining:
            return f"{self.name} is shutting down; retry on another instance"
        return f"{self.name} is not started yet; retry on another instance"

    async def wait_for_stop(self) -> None:
        """Serve until SIGTERM/SIGINT (or a drain request); leaving the block then drains."""
        self._waiting = True
        await self._stop.wait()

    # -- lease callbacks ------------------------------------------------------------------------
    def _on_lease_lost(self) -> None:
        log.error("discovery dropped this instance's lease; re-registering as %x (still serving)", self.instance_id)

    async def _on_lease_renewed(self, new_lease_id: int) -> None:
        log.warning("instance %x re-registered under lease %x", self.instance_id, new_lease_id)
        for key, record in self._records.items():  # refresh the lease id the records carry
            record.lease_id = new_lease_id
            await self.lease.put(key, record.SerializeToString())

    async def _set_health(self, serving: bool) -> None:
        up = serving and self.is_serving()
        status = (
            health_pb2.HealthCheckResponse.SERVING if up and self._ready else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self._service_names):
            await self.health.set(name, status)
        if up and (self._ready or self._notify_before_ready) and not self._notified_ready:
            self._notified_ready = True  # systemd: READY=1 only once (see ``start``)
            sd_notify.notify(f"READY=1\nSTATUS=serving on {self.address}\nMAINPID={os.getpid()}")
