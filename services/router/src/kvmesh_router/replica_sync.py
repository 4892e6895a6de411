"""Replica sync: router replicas exchange their active-load bookings over ``RouterService.ReplicaSync``.

(Over 400 lines because link protocol, pair topology and the warm-up wait all act on one link table;
what the links carry lives in :mod:`kvmesh_router.replication`.)

Replicas are active-active: any frontend may use any replica, and each replica books the requests it
routes in its own slot tracker (it stays authoritative for them). To predict load from the whole
fleet's traffic, every replica also applies its peers' bookings, which arrive over one bidirectional
**link** per pair of replicas:

- **Contract.** On a link each side first sends its own bookings (snapshot), then its own booking
  events (added / prefill completed / freed), in order. The snapshot is taken and the link subscribed
  to local changes in the same synchronous step, so nothing falls between them. A replica ignores a
  link whose sender id is its own. Duplicate adds and marks/frees of unknown ids are no-ops.
- **Peer bookings.** A link's snapshot *replaces* everything known about that peer; when the peer's
  current link closes, its bookings are dropped (a killed replica's load disappears with it; a peer
  that comes back re-sends its snapshot). The slot tracker's expiry is the backstop for the rest.
- **Bounded.** Each link has a bounded outbound queue; a link whose queue overflows is cut (and the
  dialing side reconnects, which resends a fresh snapshot) rather than silently losing events.
- **Topology** (one link per pair). Replicas find each other in discovery
  (``InstanceRecord{component="router", endpoint="router"}``, registered only once a replica is
  ready). A starting replica dials every peer it sees in its first discovery snapshot (they cannot
  see it yet); afterwards the replica with the **smaller id** dials (and redials with backoff while
  the peer is in discovery and no link is up). If two links between the same pair exist (a race),
  both sides keep the one dialed by the smaller id (same dialer: the newer), so they agree. A link
  that lost applies nothing more, not even a message it read before: the winner's snapshot supersedes it.

Sync lag: an added booking carries its age when it is written on the link; the receiver records that
age (the sender's queueing delay plus the booking's age at publish time) in a histogram.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import grpc
from kvmesh.backoff import Backoff
from kvmesh.discovery import Discovery, Snapshot, apply_watch_event, instance_prefix, parse_instance_key
from kvmesh.v1 import discovery_pb2, router_pb2, router_pb2_grpc

from kvmesh_router.replication import BookingListener
from kvmesh_router.slot_tracker import Booking
from kvmesh_router.state import RouterState
from kvmesh_router.translate import booking_to_proto

__all__ = ["Link", "ReplicaHub"]

log = logging.getLogger(__name__)

DEFAULT_QUEUE_SIZE = 10_000
MAX_EVENTS_PER_MESSAGE = 512
_serials = itertools.count(1)


_ID_FORM = "a replica's instance id: lowercase hex, 1-16 digits, no leading zero"


def parse_router_id(text: str) -> int | None:
    """A ``router_id`` as the instance id it names, or None unless it is written as a router writes its own."""
    if not 0 < len(text) <= 16 or text.strip("0123456789abcdef"):
        return None
    value = int(text, 16)
    return value if f"{value:x}" == text else None


class Link:
    """One ReplicaSync stream with one peer, in either direction (``inbound``: the peer dialed)."""

    def __init__(
        self,
        hub: ReplicaHub,
        *,
        inbound: bool,
        send: Callable[[Any], Awaitable[None]],
        recv: Callable[[], Awaitable[Any | None]],
        message_type: type,
        expected_peer: int | None = None,
    ) -> None:
        self.hub = hub
        self.inbound = inbound
        self.peer_id = expected_peer
        self._send = send
        self._recv = recv
        self._type = message_type
        self.serial = next(_serials)
        self.queue: asyncio.Queue[tuple[float, router_pb2.BookingEvent]] = asyncio.Queue(hub.queue_size)
        self.attached = False
        self.ever_attached = False
        self.overflowed = False
        self.closed = asyncio.Event()
        self._stop = asyncio.Event()
        self.refusal: tuple[grpc.StatusCode, str] | None = None  # why the peer's first message was refused

    @property
    def dialer(self) -> int:
        if self.inbound:
            return self.peer_id if self.peer_id is not None else -1
        return self.hub.own_id

    def enqueue(self, t: float, event: router_pb2.BookingEvent) -> None:
        if self.overflowed:
            return
        try:
            self.queue.put_nowait((t, event))
        except asyncio.QueueFull:
            self.overflowed = True
            self.hub.overflows += 1
            log.warning(
                "replica sync link with %s overflowed (%d events queued); cutting it",
                self._peer_name(),
                self.queue.qsize(),
            )
            self._stop.set()

    def close(self) -> None:
        self._stop.set()

    def _peer_name(self) -> str:
        return f"{self.peer_id:x}" if self.peer_id is not None else "?"

    def _message(self, **fields: Any) -> Any:
        return self._type(router_id=self.hub.router_id, **fields)

    async def run(self) -> None:
        hub = self.hub
        hub.links.add(self)  # subscribe and snapshot in one synchronous step
        snapshot = hub.state.bookings.local_snapshot()
        tasks: list[asyncio.Task[Any]] = []
        try:
            await self._send(self._message(snapshot=snapshot))
            loop = asyncio.get_running_loop()
            tasks = [
                loop.create_task(self._send_loop()),
                loop.create_task(self._recv_loop()),
                loop.create_task(self._stop.wait()),
            ]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.cancelled():
                    continue
                exc = task.exception()
                if exc is not None and not isinstance(exc, grpc.RpcError | asyncio.CancelledError):
                    log.warning("replica sync link with %s failed: %r", self._peer_name(), exc)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task
            hub.detach(self)
            self.closed.set()

    async def _send_loop(self) -> None:
        queue = self.queue
        while True:
            first = await queue.get()
            batch = [first]
            while not queue.empty() and len(batch) < MAX_EVENTS_PER_MESSAGE:
                batch.append(queue.get_nowait())
            message = self._message()
            message.events.extend([ev for _, ev in batch])
            now = time.monotonic()
            for (t, _), ev in zip(batch, message.events, strict=True):
                if ev.HasField("added"):  # add the time it waited here to the age it had at publish
                    ev.added.age_ms += int((now - t) * 1000)
            await self._send(message)
            self.hub.sent += len(batch)

    async def _recv_loop(self) -> None:
        hub = self.hub
        first = await self._recv()
        if first is None:
            return
        peer = parse_router_id(first.router_id)
        if peer is None:
            shown = first.router_id[:40] + ("..." if len(first.router_id) > 40 else "")
            log.warning("replica sync: ignoring a link from malformed router id %r", shown)
            self.refusal = (grpc.StatusCode.INVALID_ARGUMENT, f"router_id {shown!r} is not a router id ({_ID_FORM})")
            return
        if peer == hub.own_id:
            log.warning("replica sync: a link to myself (%s); closing it", first.router_id)
            self.refusal = (grpc.StatusCode.FAILED_PRECONDITION, f"router {first.router_id} is this router itself")
            return
        if self.peer_id is not None and peer != self.peer_id:
            log.warning("replica sync: dialed %x but %x answered; closing", self.peer_id, peer)
            return
        self.peer_id = peer
        if not hub.attach(self, first.snapshot):
            return
        message = first
        while True:
            if not self.attached:
                return  # replaced by a newer link (or detached): its snapshot supersedes what this one still reads
            if message.events:
                lag = hub.state.bookings.apply_peer_events(peer, message.events)
                hub.received += len(message.events)
                if lag:
                    hub.state.metrics.sync_lag.observe(lag)
            message = await self._recv()
            if message is None:
                return


class ReplicaHub(BookingListener):
    """This replica's side of replica sync: links, peer discovery and dialing. See the module docstring."""

    def __init__(
        self,
        state: RouterState,
        own_id: int,
        channel_for: Callable[[str], grpc.aio.Channel],
        *,
        queue_size: int = DEFAULT_QUEUE_SIZE,
    ) -> None:
        self.state = state
        self.own_id = own_id
        self.router_id = f"{own_id:x}"
        self.channel_for = channel_for
        self.queue_size = queue_size
        self.links: set[Link] = set()
        self.current: dict[int, Link] = {}
        self.peers: dict[int, str] = {}  # peer id -> address, from discovery
        self._peer_keys: dict[str, int] = {}
        self.initial_peers: set[int] = set()
        self.unreachable: set[int] = set()  # peers whose last dial failed before they sent a snapshot
        self._supervisors: dict[int, asyncio.Task[None]] = {}
        self._changed = asyncio.Event()
        self._first_snapshot = asyncio.Event()
        self._watch_task: asyncio.Task[None] | None = None
        self._closing = False
        self.sent = 0
        self.received = 0
        self.overflows = 0
        state.bookings.add_listener(self)

    # ------------------------------------------------------------------ local changes -> every link

    def booking_added(self, key: str, booking: Booking) -> None:
        if self.links:
            now = time.monotonic()
            self._publish(now, router_pb2.BookingEvent(added=booking_to_proto(key, booking, self.state.clock())))

    def booking_prefill_completed(self, key: str) -> None:
        if self.links:
            self._publish(time.monotonic(), router_pb2.BookingEvent(prefill_completed_request_id=key))

    def booking_freed(self, key: str) -> None:
        if self.links:
            self._publish(time.monotonic(), router_pb2.BookingEvent(freed_request_id=key))

    def _publish(self, t: float, event: router_pb2.BookingEvent) -> None:
        for link in list(self.links):
            link.enqueue(t, event)

    # ------------------------------------------------------------------ links

    def attach(self, link: Link, snapshot: Any) -> bool:
        """``link`` received its peer's snapshot: make it the peer's current link (False: close it)."""
        peer = link.peer_id
        assert peer is not None
        if self._closing:
            return False
        cur = self.current.get(peer)
        if cur is not None and cur is not link and not cur.closed.is_set():
            keep_old = cur.dialer < link.dialer or (cur.dialer == link.dialer and cur.serial > link.serial)
            if keep_old:
                log.info("replica sync: second link with %x; keeping the one dialed by %x", peer, cur.dialer)
                return False
            log.info("replica sync: second link with %x; replacing the one dialed by %x", peer, cur.dialer)
            cur.attached = False
            cur.close()
        self.current[peer] = link
        link.attached = link.ever_attached = True
        self.unreachable.discard(peer)
        self.state.bookings.apply_peer_snapshot(peer, snapshot)
        log.info(
            "replica sync: linked with %x (%s, %d bookings in its snapshot)",
            peer,
            "inbound" if link.inbound else "outbound",
            len(snapshot),
        )
        self._notify()
        return True

    def detach(self, link: Link) -> None:
        self.links.discard(link)
        peer = link.peer_id
        if peer is not None and self.current.get(peer) is link:
            del self.current[peer]
            dropped = self.state.bookings.drop_peer(peer)
            log.info("replica sync: link with %x closed; dropped its %d bookings", peer, dropped)
        link.attached = False
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def serve(
        self,
        request_iterator: AsyncIterator[Any],
        context: grpc.aio.ServicerContext[router_pb2.ReplicaSyncRequest, router_pb2.ReplicaSyncResponse],
    ) -> None:
        """Server side of ``ReplicaSync`` (a peer dialed us)."""
        iterator = aiter(request_iterator)

        async def recv() -> Any | None:
            try:
                return await anext(iterator)
            except StopAsyncIteration:
                return None

        link = Link(self, inbound=True, send=context.write, recv=recv, message_type=router_pb2.ReplicaSyncResponse)
        await link.run()
        if link.refusal is not None:
            context.set_code(link.refusal[0])
            context.set_details(link.refusal[1])

    async def _dial(self, peer: int, address: str) -> Link:
        stub = router_pb2_grpc.RouterServiceStub(self.channel_for(address))
        call = stub.ReplicaSync()

        async def recv() -> Any | None:
            message = await call.read()
            # grpc.aio exports EOF at runtime; types-grpcio omits it
            return None if message is grpc.aio.EOF else message  # type: ignore[attr-defined]

        link = Link(
            self,
            inbound=False,
            send=call.write,
            recv=recv,
            message_type=router_pb2.ReplicaSyncRequest,
            expected_peer=peer,
        )
        try:
            await link.run()
        except grpc.aio.AioRpcError as exc:
            log.info("replica sync: link to %x at %s failed: %s %s", peer, address, exc.code().name, exc.details())
        finally:
            call.cancel()
        return link

    # ------------------------------------------------------------------ peers from discovery

    def start(self, discovery: Discovery, namespace: str) -> None:
        self._watch_task = asyncio.get_running_loop().create_task(
            self._watch(discovery, instance_prefix(namespace, "router", "router")), name="replica-watch"
        )

    async def _watch(self, discovery: Discovery, prefix: str) -> None:
        first = True
        async with contextlib.aclosing(discovery.list_and_watch(prefix)) as events:
            async for ev in events:
                apply_watch_event(ev, self._peer_keys, partial(self._peer_put, initial=first), self._peer_removed)
                if first and isinstance(ev, Snapshot):
                    first = False
                    self._first_snapshot.set()

    def _peer_put(self, key: str, value: bytes, *, initial: bool) -> None:
        try:
            peer = parse_instance_key(key).instance_id
            record = discovery_pb2.InstanceRecord.FromString(value)
        except Exception as exc:
            log.warning("ignoring router record %s: %s", key, exc)
            return
        if peer == self.own_id:
            return
        self._peer_keys[key] = peer
        known = self.peers.get(peer)
        self.peers[peer] = record.address
        if initial:
            self.initial_peers.add(peer)
        if known is None or known != record.address:
            task = self._supervisors.pop(peer, None)
            if task is not None:
                task.cancel()
            self._supervisors[peer] = asyncio.get_running_loop().create_task(
                self._supervise(peer, initial), name=f"replica-link-{peer:x}"
            )
        self._notify()

    def _peer_removed(self, key: str) -> None:
        peer = self._peer_keys.pop(key, None)
        if peer is None:
            return
        self.peers.pop(peer, None)
        self.initial_peers.discard(peer)
        self.unreachable.discard(peer)
        task = self._supervisors.pop(peer, None)
        if task is not None:
            task.cancel()
        self._notify()

    async def _supervise(self, peer: int, initial: bool) -> None:
        backoff = Backoff(0.05, 2.0)
        while peer in self.peers and not self._closing:
            cur = self.current.get(peer)
            if cur is not None and not cur.closed.is_set():
                await cur.closed.wait()
                continue
            if not (initial or self.own_id < peer):
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), 1.0)
                continue
            link = await self._dial(peer, self.peers[peer])
            if link.ever_attached:  # it worked for a while: retry quickly
                backoff.reset()
            elif peer not in self.unreachable:
                self.unreachable.add(peer)  # e.g. a kill -9'd replica whose record has not expired yet
                self._notify()
            await backoff.sleep()

    async def wait_initial_synced(self, timeout: float) -> list[int]:
        """Wait until every peer of the first discovery snapshot sent its bookings, went away, or could not
        be reached (a dead replica's record outlives it by up to a lease TTL); returns the peers that
        did not send their bookings in time."""
        deadline = time.monotonic() + timeout
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._first_snapshot.wait(), timeout)
        while True:
            missing = [p for p in self.initial_peers if p in self.peers and p not in self.current]
            left = deadline - time.monotonic()
            if left <= 0 or not [p for p in missing if p not in self.unreachable]:
                return missing
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(left, 0.5))

    async def close(self) -> None:
        self._closing = True
        tasks = list(self._supervisors.values())
        if self._watch_task is not None:
            tasks.append(self._watch_task)
        for task in tasks:
            task.cancel()
        for link in list(self.links):
            link.close()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    def stats_dict(self) -> dict[str, int]:
        links = list(self.links)
        return {
            "peers": len(self.current),
            "queued": sum(link.queue.qsize() for link in links),
            "sent": self.sent,
            "received": self.received,
            "overflows": self.overflows,
        }
