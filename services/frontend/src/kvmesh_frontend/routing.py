"""The router session client: one long-lived ``RouterService.Session`` stream per replica, with failover.

Router replicas register ``InstanceRecord{component="router", endpoint="router"}``. The client keeps
a Session stream open to every live replica it uses and spreads queries over them round-robin
(replicas share bookings through replica sync, so any of them decides as well as another); a
replica that joins, or comes back after a restart, gets its share from the next query on (issue 14
item 9: with one stream per frontend, a restarted replica got no decision at all). Each stream
multiplexes requests: a ``RouteQuery`` goes out, the matching ``RouteDecision`` comes back by request
id; lifecycle updates (first token, finished) go to the replica that booked the request, on the
same ordered stream.

Failover: when the stream breaks (the replica died, or disappeared from discovery) every query
still waiting for a decision is re-sent on a stream to another replica; a query still without a
decision after ``--route-hedge`` seconds (a replica behind a dropped link: its stream breaks only
when gRPC keepalive notices) is also sent to another replica, the first decision wins; the failed replica is
avoided for a few seconds even if its record is still in discovery (a kill -9'd process keeps its
record until its lease expires). Bookings made on a dead replica die with it; lifecycle updates
for them are dropped.

No leak: a query abandoned by its caller (cancelled, timed out) is followed at once by a FINISHED
update, so the replica frees the booking if it made one; a decision nobody waits for is freed the
same way.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from asyncio import FIRST_COMPLETED
from collections.abc import Callable

import grpc
from kvmesh.channels import ChannelPool
from kvmesh.discovery.base import WatchEvent, apply_watch_event, parse_instance_key
from kvmesh.v1 import discovery_pb2, router_pb2, router_pb2_grpc
from kvmesh.wakeup import Wakeup

from kvmesh_frontend.errors import failure_line, unavailable

log = logging.getLogger(__name__)

_SUSPECT_S = 5.0
_FINISHED = router_pb2.LIFECYCLE_STAGE_FINISHED
_FIRST_TOKEN = router_pb2.LIFECYCLE_STAGE_FIRST_TOKEN
_ROUTED = router_pb2.DECISION_OUTCOME_ROUTED
_UNREACHABLE = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)


class SessionBroken(Exception):
    """The Session stream to a replica ended while a query waited for its decision."""


class RouterSession:
    """One Session stream to one router replica.

    Writes are serialized (gRPC allows one outstanding write per call) through an outbox that one
    writer task empties in order; whatever is queued when the writer runs goes out as one
    ``SessionRequestBatch`` (its decisions come back in ``RouteDecisionBatch`` messages, in order: one, or
    several when the replica takes long to decide them). The writer runs
    at the end of the event-loop tick, so the queries and updates of every request served in that
    tick share one message (a request whose tokens arrive together sends its FIRST_TOKEN and
    FINISHED in one). Every replica understands batches: there is no negotiation.
    """

    def __init__(
        self,
        replica_id: int,
        address: str,
        channel: grpc.aio.Channel,
        on_closed: Callable[[RouterSession, str], None],
    ) -> None:
        self.replica_id = replica_id
        self.address = address
        self.closed = False
        self.closing = False  # closed on purpose (replica left discovery, shutdown): not a failure
        self.reason = ""
        self._on_closed = on_closed
        self._loop = asyncio.get_running_loop()
        self._outbox: list[router_pb2.SessionRequest] = []
        self._wakeup = Wakeup()
        self._pending: dict[str, asyncio.Future[router_pb2.RouteDecision]] = {}
        self._call = router_pb2_grpc.RouterServiceStub(channel).Session()
        # Shared by many requests: not in the context of the one that opened the session (its request id
        # and span would tag every later log line of the session).
        self._reader = self._loop.create_task(
            self._read(), name=f"router-session-{replica_id:x}", context=contextvars.Context()
        )
        self._writer = self._loop.create_task(
            self._write_loop(), name=f"router-session-writer-{replica_id:x}", context=contextvars.Context()
        )

    # -- writing ---------------------------------------------------------------------------------
    async def _write_loop(self) -> None:
        try:
            while not self.closed:
                if not self._outbox:
                    await self._wakeup.wait()
                    continue
                messages, self._outbox = self._outbox, []
                if len(messages) == 1:
                    message = messages[0]
                else:
                    message = router_pb2.SessionRequest(batch=router_pb2.SessionRequestBatch(requests=messages))
                await self._call.write(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the stream broke: the reader reports why
            self._write_failed(exc)

    def _write_failed(self, exc: BaseException) -> None:
        if not self.closed:
            self._call.cancel()
            self._close(f"write failed: {failure_line(exc)}")

    # -- reading ---------------------------------------------------------------------------------
    async def _read(self) -> None:
        reason = "the router ended the session"
        try:
            async for response in self._call:
                kind = response.WhichOneof("kind")
                if kind == "decision":
                    self._decided(response.decision)
                elif kind == "decision_batch":
                    for decision in response.decision_batch.decisions:
                        self._decided(decision)
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            reason = "closed by the frontend"
        except Exception as exc:  # pragma: no cover - defensive: never leave waiters hanging
            reason = f"session reader failed: {exc!r}"
        finally:
            self._close(reason)

    def _decided(self, decision: router_pb2.RouteDecision) -> None:
        future = self._pending.pop(decision.request_id, None)
        if future is None:
            if decision.outcome == _ROUTED:  # nobody waits for it any more: free the booking
                self.lifecycle(decision.request_id, _FINISHED)
        elif not future.done():
            future.set_result(decision)

    def _close(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.reason = reason
        self._outbox.clear()
        self._wakeup.set()  # the writer sees `closed` and ends
        pending, self._pending = self._pending, {}
        error = SessionBroken(f"router replica {self.replica_id:x} at {self.address}: {reason}")
        for future in pending.values():
            if not future.done():
                future.set_exception(error)
        self._on_closed(self, reason)

    # -- the API ---------------------------------------------------------------------------------
    async def submit(self, query: router_pb2.RouteQuery) -> asyncio.Future[router_pb2.RouteDecision]:
        """Send a query; the future resolves with its decision (or SessionBroken)."""
        future: asyncio.Future[router_pb2.RouteDecision] = self._loop.create_future()
        if self.closed:
            future.set_exception(SessionBroken(f"router replica {self.replica_id:x}: {self.reason}"))
            return future
        self._pending[query.request_id] = future
        self._outbox.append(router_pb2.SessionRequest(route=query))
        self._wakeup.set()
        return future

    def lifecycle(self, request_id: str, stage: router_pb2.LifecycleStage.ValueType) -> None:
        """Report progress of a request this replica routed (dropped if the stream is gone).

        Updates are not on any request's critical path: the writer is woken one loop iteration
        later, so the client write that a first token triggers goes out before the update does.
        """
        if not self.closed:
            self._outbox.append(
                router_pb2.SessionRequest(lifecycle=router_pb2.LifecycleUpdate(request_id=request_id, stage=stage))
            )
            self._loop.call_soon(self._wakeup.set)

    def first_token(self, request_id: str) -> None:
        self.lifecycle(request_id, _FIRST_TOKEN)

    def finished(self, request_id: str) -> None:
        self.lifecycle(request_id, _FINISHED)

    def abandon(self, request_id: str) -> None:
        """The caller no longer waits for this query: free whatever the replica booked for it."""
        self._pending.pop(request_id, None)
        self.lifecycle(request_id, _FINISHED)

    async def close(self) -> None:
        self.closing = True
        self._call.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        self._writer.cancel()
        await asyncio.gather(self._writer, return_exceptions=True)


class RouterClient:
    """Routes requests through router replicas found in discovery, failing over between them."""

    def __init__(
        self, pool: ChannelPool, namespace: str, route_timeout: float = 30.0, route_hedge: float = 1.0
    ) -> None:
        self._pool = pool
        self._namespace = namespace
        self._timeout = route_timeout
        self._hedge = route_hedge
        self._replicas: dict[int, str] = {}  # replica id -> address
        self._keys: dict[str, int] = {}
        self._sessions: dict[int, RouterSession] = {}  # replica id -> its open session
        self._turn = 0  # round-robin position
        self._suspect: dict[int, float] = {}  # replica id -> monotonic time its session broke
        self._reachable: dict[int, bool] = {}  # replica id -> whether its channel was last READY
        self._closing: set[asyncio.Task[None]] = set()

    # -- discovery ------------------------------------------------------------------------------
    def apply(self, event: WatchEvent) -> None:
        apply_watch_event(event, self._keys, self._add, self._remove)

    def _add(self, key: str, value: bytes) -> None:
        try:
            parsed = parse_instance_key(key)
            record = discovery_pb2.InstanceRecord.FromString(value)
        except Exception as exc:
            log.warning("ignoring unreadable router record %s: %s", key, exc)
            return
        if parsed.namespace != self._namespace or parsed.component != "router":
            return
        replica_id = record.instance_id or parsed.instance_id
        if replica_id not in self._replicas:
            log.info("router replica %x at %s appeared", replica_id, record.address)
        elif self._replicas[replica_id] != record.address:
            self._reachable.pop(replica_id, None)  # a new channel: no verdict yet
        self._replicas[replica_id] = record.address
        self._keys[key] = replica_id
        session = self._sessions.get(replica_id)
        if session is not None and session.address != record.address:
            self._drop_session(session)

    def _remove(self, key: str) -> None:
        replica_id = self._keys.pop(key, None)
        if replica_id is None:
            return
        self._replicas.pop(replica_id, None)
        self._reachable.pop(replica_id, None)
        log.info("router replica %x left discovery", replica_id)
        self._drop_session(self._sessions.get(replica_id), drop_channel=replica_id)

    def _drop_session(self, session: RouterSession | None, drop_channel: int | None = None) -> None:
        """Close ``session`` (if any), then the replica's channel if ``drop_channel`` names it."""
        if session is not None and self._sessions.get(session.replica_id) is session:
            del self._sessions[session.replica_id]

        async def close() -> None:
            if session is not None:
                await session.close()
            if drop_channel is not None:
                await self._pool.drop(drop_channel)

        task = asyncio.get_running_loop().create_task(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def has_reachable_replica(self) -> bool:
        """Whether a replica in discovery is reachable: its channel's last settled state was READY (the TCP
        connection and any TLS handshake done). The frontend is not ready without one. A replica killed
        -9 keeps its record until its lease expires, and one whose certificate this frontend refuses
        keeps it for good: both fail every request UNAVAILABLE, so a load balancer must not pick this
        frontend meanwhile. A channel connecting, or idle, keeps its last verdict, so an idle channel's
        reconnect does not flap readiness."""
        reachable = False
        for replica_id, address in self._replicas.items():
            state = self._pool.get(replica_id, address, role="router").get_state(try_to_connect=True)
            if state is grpc.ChannelConnectivity.READY:
                self._reachable[replica_id] = True
            elif state in _UNREACHABLE:
                self._reachable[replica_id] = False
            reachable = reachable or self._reachable.get(replica_id, False)
        return reachable

    # -- sessions -------------------------------------------------------------------------------
    def _on_closed(self, session: RouterSession, reason: str) -> None:
        if self._sessions.get(session.replica_id) is session:
            del self._sessions[session.replica_id]
        if not session.closing and session.replica_id in self._replicas:
            self._suspect[session.replica_id] = time.monotonic()
            log.warning(
                "router session to %x at %s broke (%s); failing over", session.replica_id, session.address, reason
            )

    @property
    def sessions(self) -> dict[int, RouterSession]:
        """The open session of each replica in use."""
        return dict(self._sessions)

    def _current(self, tried: set[int]) -> RouterSession:
        """The next replica's session, round-robin over live replicas not tried yet (suspects last)."""
        candidates = [rid for rid in self._replicas if rid not in tried]
        if not candidates:
            if not self._replicas:
                raise unavailable(f"no router replica is registered in namespace '{self._namespace}'")
            raise unavailable(f"every router replica failed ({len(tried)} tried)")
        now = time.monotonic()
        healthy = [rid for rid in candidates if now - self._suspect.get(rid, -1e9) > _SUSPECT_S] or candidates
        healthy.sort()
        self._turn += 1
        replica_id = healthy[self._turn % len(healthy)]
        session = self._sessions.get(replica_id)
        if session is not None and not session.closed:
            return session
        address = self._replicas[replica_id]
        # A channel per replica, not per address: a replica restarted on its port (Restart=on-failure) must
        # not inherit the dead one's channel, whose reconnect backoff failed the new session's first write.
        channel = self._pool.get(replica_id, address, role="router")
        session = RouterSession(replica_id, address, channel, self._on_closed)
        self._sessions[replica_id] = session
        log.info("router session opened to replica %x at %s", replica_id, address)
        return session

    async def route(self, query: router_pb2.RouteQuery) -> tuple[router_pb2.RouteDecision, RouterSession]:
        """The decision for one query and the session that booked it (UNAVAILABLE if no replica answers).

        Hedged: a query with no decision after ``route_hedge`` seconds is also sent to another replica
        (once), and the first decision wins; the other attempt is abandoned (FINISHED frees whatever it
        booked). Why: a replica behind a dropped link stalls silently until gRPC keepalive notices
        (~5 s); issue 18 measured that as the TTFT of every query caught on it.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        tried: set[int] = set()
        attempts: dict[asyncio.Future[router_pb2.RouteDecision], RouterSession] = {}
        hedged = self._hedge <= 0
        broken: SessionBroken | None = None
        try:
            while True:
                if not attempts:
                    if broken is not None and not [rid for rid in self._replicas if rid not in tried]:
                        # why each broke (addresses, gRPC's diagnostics) is in the log, never in the reply
                        raise unavailable(f"no router replica could route the request ({len(tried)} tried)")
                    session = self._current(tried)
                    tried.add(session.replica_id)
                    attempts[await session.submit(query)] = session
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError
                done, _ = await asyncio.wait(
                    list(attempts), timeout=left if hedged else min(left, self._hedge), return_when=FIRST_COMPLETED
                )
                if not done:
                    if not hedged:
                        hedged = True
                        if [rid for rid in self._replicas if rid not in tried]:
                            slow = next(iter(attempts.values()))
                            self._suspect[slow.replica_id] = time.monotonic()
                            session = self._current(tried)
                            tried.add(session.replica_id)
                            log.info("route query %s: no decision from replica %x within %gs; also asking %x",
                                     query.request_id, slow.replica_id, self._hedge, session.replica_id)  # fmt: skip
                            attempts[await session.submit(query)] = session
                    continue
                for future in done:
                    session = attempts.pop(future)
                    error = future.exception()
                    if error is None:
                        for other in attempts.values():
                            other.abandon(query.request_id)
                        attempts.clear()
                        return future.result(), session
                    if not isinstance(error, SessionBroken):
                        raise error
                    broken = error
                    log.warning("route query %s: %s; trying another replica", query.request_id, error)
        except TimeoutError:
            where = ", ".join(f"{s.replica_id:x} at {s.address}" for s in attempts.values())
            log.warning("route query %s: no decision from router replica %s within %gs", query.request_id, where,
                        self._timeout)  # fmt: skip
            # the replicas' addresses are for the log: a KServe client may be anyone
            raise unavailable(
                f"no router replica gave a decision within {self._timeout:g}s ({len(tried)} tried)"
            ) from None
        finally:
            for session in attempts.values():  # cancelled, timed out or failed: free what they booked
                session.abandon(query.request_id)

    async def close(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        await asyncio.gather(*(session.close() for session in sessions), return_exceptions=True)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
