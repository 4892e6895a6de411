"""etcd backend (client: ``aetcd`` 1.0.0, which has no keepalive, no watch resume and one endpoint).

* Endpoints: ``etcd://host:port[,host:port...]``. ``open`` probes them in order (a linearizable
  read, so a member without a leader does not count), in rounds until ``connect_timeout`` is
  spent (so a daemon may start together with etcd), and keeps the first that answers; on a
  connectivity error the connection fails over to the next endpoint (round robin). With one
  endpoint gRPC reconnects by itself; its reconnect backoff is capped at 1 s so RPCs work again
  about a second after etcd is back (gRPC's default grows to 120 s).
* Every unary RPC is bounded by ``op_timeout`` (``connect_timeout``); gRPC keepalive pings
  (10 s, 5 s timeout) detect a dead server under a silent watch stream.
* Leases: the keeper's heartbeat thread sends one LeaseKeepAlive round trip per beat on a
  *blocking* gRPC channel of its own, so a busy event loop cannot delay it; a TTL of 0 means the
  lease is gone. The heartbeat picks its endpoint itself: it starts on the connection's and moves
  to the next one after a beat that got no answer. Why: a daemon that only holds a lease (a worker
  watches nothing) makes no other etcd call that would notice a dead member, and its lease expired
  on the surviving members while every beat went to the dead one (issue 18, kill -9 of a member).
  TTLs are whole seconds on etcd (ceil of the requested TTL, at least 1).
* TLS: with ``kvmesh.tls.configure_etcd`` (a daemon's ``--etcd-tls``) every client is a
  :class:`TlsClient` (aetcd has no TLS): mTLS with the daemon's certificate, so an etcd started with
  ``--client-cert-auth`` refuses anyone without a certificate from its CA; the heartbeat's blocking
  channel uses the same credentials.
* Every call and watch carries etcd's require-leader metadata (``hasleader``): a member cut from its
  peers answers "no leader" (a connectivity error: failover) and cancels its watch streams, instead
  of serving a view that silently stops changing.
* Watches: list (get_prefix at revision R), yield Snapshot, watch from R+1. A lost stream
  (ConnectionFailedError), a compacted start revision (RevisionCompactedError) or a watch that
  ends for any other reason restarts the cycle with a fresh list and a fresh Snapshot.
* Watches are also checked against a fresh read, a level up (``Discovery.list_and_watch``): aetcd
  drops the server's ``canceled`` replies, which leaves a stream open and silent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions as etcd_errors
import grpc
from aetcd import rpc, watcher
from aetcd.rpc import rpc_pb2, rpc_pb2_grpc
from aetcd.rtypes import EventKind

from kvmesh import tls
from kvmesh.backoff import Backoff
from kvmesh.discovery.base import (
    Added,
    Discovery,
    Removed,
    Snapshot,
    WatchEvent,
)
from kvmesh.discovery.errors import (
    DiscoveryError,
    DiscoveryUnavailable,
    LeaseNotFound,
    bounded,
    raise_if_cancelling,
    stray_cancel,
)
from kvmesh.discovery_urls import parse_etcd_endpoints

__all__ = ["EtcdDiscovery"]

log = logging.getLogger("kvmesh.discovery.etcd")

T = TypeVar("T")

# gRPC reconnect backoff starts at 0.1 s and is capped at 1 s (default cap: 120 s). Note that gRPC
# uses min_reconnect_backoff as the *connect timeout* of one attempt: 2 s bounds an attempt against
# a black-holed host without failing a slow-but-alive handshake.
MAX_LISTING_BYTES = 256 * 1024 * 1024  # about 10000 engines' records and cards, with room to spare
CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 2000,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.http2.max_pings_without_data": 0,
    # Own subchannels per client: a new client must not inherit another one's reconnect backoff.
    "grpc.use_local_subchannel_pool": 1,
    # A prefix is listed in one response: past gRPC's default 4 MiB (5000 records of 1 KB, a worker's
    # 5000 engines' model cards) it could never be listed, and its watch never delivered a snapshot.
    "grpc.max_receive_message_length": MAX_LISTING_BYTES,
}
_CONNECTIVITY = (
    etcd_errors.ConnectionFailedError,
    etcd_errors.ConnectionTimeoutError,
    etcd_errors.WatchTimeoutError,
    TimeoutError,
    OSError,
    grpc.aio.UsageError,
)
_WATCH_BACKOFF_MAX = 1.0
# etcd's "require leader" metadata (clientv3.WithRequireLeader): a member without a leader refuses the
# call with "no leader" instead of serving stale data, and cancels watch streams it holds once it has
# had no leader for an election timeout. Without it a watch on a member cut from its peers (but not
# from this daemon) stays open and silently misses every change (issue 18: a worker killed during such
# a partition stayed in every frontend's view).
REQUIRE_LEADER = (("hasleader", "true"),)


def _fmt(ep: tuple[str, int]) -> str:
    host, port = ep
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())[:300]


class TlsClient(aetcd.Client):  # type: ignore[misc]  # aetcd ships no type hints
    """``aetcd.Client`` over mTLS: aetcd 1.0.0's ``connect`` with ``secure_channel`` for ``insecure_channel``.

    Why a copy: aetcd hardcodes the insecure channel (martyanov/aetcd#37) and has no hook; the copy
    relies on its private attributes, so aetcd is pinned exactly and tests/security/test_etcd_tls.py
    runs it against a real etcd with ``--client-cert-auth``.
    """

    def __init__(self, *args: Any, credentials: grpc.ChannelCredentials, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._credentials = credentials

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # type: ignore[has-type]  # another task is connecting: wait for it
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            self.channel = rpc.secure_channel(target, self._credentials, options=list(self._options.items()))
            if self._username is not None and self._password is not None:  # etcd's own auth, on top
                self.auth_stub = rpc.AuthStub(self.channel)
                request = rpc.AuthenticateRequest(name=self._username, password=self._password)
                resp = await self.auth_stub.Authenticate(request, timeout=self._timeout)
                self.metadata = (("token", resp.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


class _Connection:
    """The current aetcd client, with failover to the next endpoint on connectivity errors."""

    def __init__(self, endpoints: list[tuple[str, int]], op_timeout: float) -> None:
        self.endpoints = endpoints
        self.op_timeout = op_timeout
        self.index = 0
        self.client: aetcd.Client | None = None
        self._closing: set[asyncio.Task[None]] = set()

    def _make(self, index: int) -> aetcd.Client:
        host, port = self.endpoints[index]
        material = tls.etcd_material()
        client: aetcd.Client
        if material is not None:
            client = TlsClient(
                host=host,
                port=port,
                timeout=self.op_timeout,
                options=dict(CHANNEL_OPTIONS),
                credentials=tls.channel_credentials(material),
            )
        else:
            client = aetcd.Client(host=host, port=port, timeout=self.op_timeout, options=dict(CHANNEL_OPTIONS))
        # every call and watch of this client (aetcd sends client.metadata with each; set before the
        # lazy connect, which hands it to the watcher)
        client.metadata = REQUIRE_LEADER
        return client

    @property
    def endpoint(self) -> str:
        return _fmt(self.endpoints[self.index])

    async def open(self, connect_timeout: float) -> None:
        """Probe the endpoints in order, in rounds, until one answers or ``connect_timeout`` is spent."""
        deadline = time.monotonic() + connect_timeout
        errors: dict[int, str] = {}
        n = len(self.endpoints)
        while True:
            for i in range(n):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                client = self._make(i)
                try:
                    await bounded(client.get(b"v1/"), max(left / (n - i), 0.05))
                except Exception as exc:
                    errors[i] = f"{_fmt(self.endpoints[i])}: {_one_line(exc) if str(exc) else 'timed out'}"
                    with contextlib.suppress(Exception):
                        await bounded(client.close(), 1.0)
                    continue
                self.index, self.client = i, client
                return
            if deadline - time.monotonic() <= 0.1:
                break
            await asyncio.sleep(0.1)  # refused fast (etcd still starting?): try again while time is left
        where = ", ".join(_fmt(e) for e in self.endpoints)
        raise DiscoveryUnavailable(
            f"etcd unreachable at {where} within {connect_timeout:g}s ({'; '.join(errors.values())}); "
            "start etcd there or use --discovery file:///<dir> for a single machine"
        )

    def failed(self, client: aetcd.Client | None) -> None:
        """A connectivity error happened on ``client``: move to the next endpoint (if any)."""
        if client is not self.client or len(self.endpoints) < 2:
            return
        old = self.client
        self.index = (self.index + 1) % len(self.endpoints)
        self.client = self._make(self.index)
        log.warning("etcd: failing over to %s", self.endpoint)
        if old is not None:
            task = asyncio.ensure_future(self._close_client(old))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    @staticmethod
    async def _close_client(client: aetcd.Client) -> None:
        with contextlib.suppress(Exception):
            await bounded(client.close(), 2.0)

    async def close(self) -> None:
        if self.client is not None:
            await self._close_client(self.client)
            self.client = None
        for task in list(self._closing):
            with contextlib.suppress(Exception):
                await task


class EtcdDiscovery(Discovery):
    """Discovery on an etcd cluster (see the module docstring)."""

    def __init__(
        self,
        url: str,
        endpoints: list[tuple[str, int]],
        *,
        ttl: float,
        keepalive_interval: float | None,
        op_timeout: float,
    ) -> None:
        super().__init__(url, ttl=ttl, keepalive_interval=keepalive_interval, op_timeout=op_timeout)
        self._conn = _Connection(endpoints, op_timeout)
        self._sync_lock = threading.Lock()
        # the heartbeat's blocking channel per endpoint, kept when it moves on: a channel still connecting
        # (a loaded machine) finishes in the background instead of starting over (under _sync_lock)
        self._sync: dict[str, tuple[grpc.Channel, rpc_pb2_grpc.LeaseStub]] = {}
        self._beat_index: int | None = None  # the heartbeat's endpoint (under _sync_lock)

    @classmethod
    async def open(
        cls, url: str, *, ttl: float, connect_timeout: float, keepalive_interval: float | None = None
    ) -> EtcdDiscovery:
        self = cls(
            url,
            parse_etcd_endpoints(url),
            ttl=ttl,
            keepalive_interval=keepalive_interval,
            op_timeout=connect_timeout,
        )
        await self._conn.open(connect_timeout)
        return self

    @property
    def endpoint(self) -> str:
        """The endpoint currently in use (``host:port``)."""
        return self._conn.endpoint

    # -- plumbing ------------------------------------------------------------------------------
    def _client(self) -> aetcd.Client:
        self._check_open()
        client = self._conn.client
        if client is None:
            raise DiscoveryError(f"{self!r} is closed")
        return client

    async def _call(self, what: str, fn: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        client = self._client()
        try:
            return await bounded(fn(client), self.op_timeout)
        except asyncio.CancelledError as exc:
            if not stray_cancel(exc):
                raise
            self._note_unreachable()
            raise DiscoveryUnavailable(f"etcd {self._conn.endpoint}: {what} failed: connection closed") from None
        except _CONNECTIVITY as exc:
            self._conn.failed(client)
            self._note_unreachable()
            detail = _one_line(exc) if str(exc) else f"no answer within {self.op_timeout:g}s"
            raise DiscoveryUnavailable(f"etcd {self._conn.endpoint}: {what} failed: {detail}") from exc
        except etcd_errors.ClientError as exc:
            if "requested lease not found" in str(exc):
                raise LeaseNotFound(f"etcd {what} failed: {_one_line(exc)}") from exc
            raise DiscoveryError(f"etcd {what} failed: {_one_line(exc)}") from exc

    # -- public API ----------------------------------------------------------------------------
    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        result = await self._call("get_prefix", lambda c: c.get_prefix(prefix.encode()))
        return {kv.key.decode(): bytes(kv.value) for kv in result}

    async def _watch(self, prefix: str) -> AsyncGenerator[WatchEvent, None]:
        raw = prefix.encode()
        backoff = Backoff(0.1, _WATCH_BACKOFF_MAX)
        failures = 0
        while True:
            raise_if_cancelling()
            self._check_open()
            client = self._conn.client
            watch = None
            try:
                if client is None:
                    raise DiscoveryError(f"{self!r} is closed")
                listed = await bounded(client.get_prefix(raw), self.op_timeout)
                records = {kv.key.decode(): bytes(kv.value) for kv in listed}
                revision = listed.header.revision
                if failures:
                    log.info("etcd watch on %r: re-listed after %d failed attempt(s)", prefix, failures)
                yield Snapshot(records)
                backoff.reset()
                failures = 0
                # Created after the Snapshot was consumed; start_revision closes the gap, and if that
                # revision was compacted meanwhile etcd says so and we list again.
                watch = await bounded(client.watch_prefix(raw, start_revision=revision + 1), self.op_timeout)
                raise_if_cancelling()  # aetcd's watch creation uses wait_for, which can swallow a cancel
                events = aiter(watch)
                while True:
                    try:
                        event = await anext(events)
                    except StopAsyncIteration:
                        watch = None  # it was cancelled already
                        break
                    except Exception:
                        # Its stream failed: aetcd dropped every watch of it. Cancelling by its id now
                        # would cancel whichever watch of the new stream took that id (etcd numbers them
                        # anew on each stream), a sibling prefix's that reconnected first, silently.
                        watch = None
                        raise
                    key = event.kv.key.decode()
                    if event.kind == EventKind.PUT:
                        yield Added(key, bytes(event.kv.value))
                    else:
                        yield Removed(key)
                log.debug("etcd watch on %r ended; re-listing", prefix)  # e.g. its client was replaced
                await backoff.sleep()  # never a tight loop, whatever ends the watch
            except etcd_errors.RevisionCompactedError as exc:
                log.info("etcd watch on %r: %s; re-listing", prefix, exc)
            except DiscoveryError:
                raise
            except (Exception, asyncio.CancelledError) as exc:  # stream lost, etcd down, closed client: re-list
                if isinstance(exc, asyncio.CancelledError) and not stray_cancel(exc):
                    raise  # a real cancellation (see stray_cancel)
                if isinstance(exc, _CONNECTIVITY):
                    self._conn.failed(client)
                self._note_unreachable()
                failures += 1
                level = logging.WARNING if failures == 1 or failures % 20 == 0 else logging.DEBUG  # ~every 20 s
                log.log(
                    level,
                    "etcd watch on %r interrupted (%s: %s); re-listing until it answers (attempt %d)",
                    prefix,
                    type(exc).__name__,
                    _one_line(exc),
                    failures,
                )
                await backoff.sleep()
            finally:
                if watch is not None:
                    with contextlib.suppress(Exception):
                        await bounded(watch.cancel(), 1.0)

    async def _close_backend(self) -> None:
        await self._conn.close()
        with self._sync_lock:
            syncs, self._sync = list(self._sync.values()), {}
        for channel, _stub in syncs:
            channel.close()

    # -- lease primitives ----------------------------------------------------------------------
    async def _lease_grant(self, ttl: float) -> tuple[int, float]:
        lease = await self._call("lease grant", lambda c: c.lease(max(1, math.ceil(ttl))))
        return lease.id, float(lease.ttl)

    async def _lease_keepalive(self, lease_id: int) -> float:
        reply = await self._call("lease keepalive", lambda c: c.refresh_lease(lease_id))
        return 0.0 if reply is None else float(reply.TTL)

    _blocking_keepalive = True

    def _lease_keepalive_blocking(self, lease_id: int, timeout: float) -> float:
        """One LeaseKeepAlive round trip on a blocking channel (heartbeat thread); a beat without an answer
        moves the next one to the next endpoint."""
        with self._sync_lock:
            if self._closed:
                raise DiscoveryError(f"{self!r} is closed")
            if self._beat_index is None:
                self._beat_index = self._conn.index
            endpoint = _fmt(self._conn.endpoints[self._beat_index])
            if endpoint not in self._sync:
                material, options = tls.etcd_material(), list(CHANNEL_OPTIONS.items())
                channel = (
                    grpc.secure_channel(endpoint, tls.channel_credentials(material), options=options)
                    if material is not None
                    else grpc.insecure_channel(endpoint, options=options)
                )
                self._sync[endpoint] = (channel, rpc_pb2_grpc.LeaseStub(channel))
            stub = self._sync[endpoint][1]
        try:
            for reply in stub.LeaseKeepAlive(iter([rpc_pb2.LeaseKeepAliveRequest(ID=lease_id)]), timeout=timeout):
                return float(reply.TTL)
        except grpc.RpcError as exc:
            code, details = getattr(exc, "code", None), getattr(exc, "details", None)  # a grpc.Call, in practice
            reason = f"{code().name}: {details()}" if callable(code) and callable(details) else _one_line(exc)
            self._next_beat_endpoint(endpoint, reason)
            raise DiscoveryUnavailable(f"etcd {endpoint}: lease keepalive failed: {reason}") from exc
        self._next_beat_endpoint(endpoint, "the stream ended without an answer")
        raise DiscoveryUnavailable(f"etcd {endpoint}: lease keepalive ended without an answer")

    def _next_beat_endpoint(self, failed: str, reason: str) -> None:
        n = len(self._conn.endpoints)
        if n < 2:
            return
        with self._sync_lock:
            if self._beat_index is None or _fmt(self._conn.endpoints[self._beat_index]) != failed:
                return
            self._beat_index = (self._beat_index + 1) % n
            log.info(
                "etcd: lease keepalives move from %s to %s (%s)",
                failed,
                _fmt(self._conn.endpoints[self._beat_index]),
                " ".join(reason.split())[:200],
            )

    async def _lease_revoke(self, lease_id: int) -> None:
        try:
            await self._call("lease revoke", lambda c: c.revoke_lease(lease_id))
        except DiscoveryError as exc:
            if isinstance(exc, DiscoveryUnavailable) or "not found" not in str(exc):
                raise

    async def _put(self, key: str, value: bytes, lease_id: int) -> None:
        await self._call("put", lambda c: c.put(key.encode(), value, lease=lease_id))

    async def _delete(self, key: str) -> None:
        await self._call("delete", lambda c: c.delete(key.encode()))

    async def _get(self, key: str) -> bytes | None:
        found = await self._call("get", lambda c: c.get(key.encode()))
        return None if found is None else bytes(found.value)
