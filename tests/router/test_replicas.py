"""Router replicas: booking sync between replicas and warm restart.

In process (two routers' states, hubs and servicers on loopback gRPC, no discovery): the ReplicaSync
link protocol: snapshot first, then events; duplicate adds and unknown frees are no-ops; a link to
oneself is refused; a duplicated link between a pair collapses to the one the smaller id dialed; a
peer's bookings disappear with its link; an overflowing queue cuts the link.

End to end (real worker and router processes): two replicas serve alternating requests and agree on
the active load; one is kill -9'd and restarted; once it reports SERVING, both replicas' DumpIndex
equal the workers' truth and GetActiveLoad agrees between them.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal

import grpc
import pytest
from kvmesh.v1 import router_pb2, router_pb2_grpc
from kvmesh_router.engines import EngineInfo
from kvmesh_router.metrics import RouterMetrics
from kvmesh_router.replica_sync import Link, ReplicaHub
from kvmesh_router.service import RouterServicer, add_to_server
from kvmesh_router.state import RouterState

from tests.router.test_router_e2e_harness import FIRST_TOKEN, ROUTED, Mesh, prompt, seq_hashes, wait_until

ENGINES = (11, 22)


# ---------------------------------------------------------------------- in process


class Clock:
    """A replica's clock, moved by the test (the booking TTL is 300 s)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Replica:
    def __init__(self, replica_id: int, queue_size: int = 1000) -> None:
        self.clock = Clock()
        self.state = RouterState(metrics=RouterMetrics(), clock=self.clock)
        for e in ENGINES:
            self.state.add_engine(EngineInfo(e, "m", f"w{e}", 16, 1000))
        self.pool: dict[str, grpc.aio.Channel] = {}
        self.hub = ReplicaHub(self.state, replica_id, self._channel, queue_size=queue_size)
        self.server = grpc.aio.server()
        add_to_server(RouterServicer(self.state, self.hub), self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.sessions = 0
        self.dials: list[asyncio.Task] = []

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self.pool:
            self.pool[address] = grpc.aio.insecure_channel(address)
        return self.pool[address]

    def dial(self, other: Replica) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(self.hub._dial(other.hub.own_id, other.address))
        self.dials.append(task)
        return task

    def book(self, rid: str, engine: int = 11, letters: str = "AB") -> router_pb2.RouteDecision:
        tokens = prompt(*letters)
        query = router_pb2.RouteQuery(
            request_id=rid, model="m", block_hashes=seq_hashes(tokens), num_tokens=len(tokens), pinned_engine_id=engine
        )
        out = router_pb2.RouteDecision()
        self.state.route(f"s1/{rid}", query, out)
        assert out.outcome == ROUTED
        return out

    def load(self) -> list[tuple[int, int, int, int]]:
        return self.state.active_load()

    async def close(self) -> None:
        await self.hub.close()
        for task in self.dials:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await self.server.stop(None)
        for channel in self.pool.values():
            await channel.close()


async def until(pred, timeout: float = 3.0, what: str = "") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what or pred}")
        await asyncio.sleep(0.01)


@pytest.fixture
async def pair():
    a, b = Replica(1), Replica(2)
    await a.server.start()
    await b.server.start()
    yield a, b
    await a.close()
    await b.close()


async def test_link_sends_snapshot_then_events_both_ways(pair):
    a, b = pair
    a.book("early")  # before the link: travels in a's snapshot
    b.book("b-early", engine=22)
    a.dial(b)
    await until(lambda: 1 in b.hub.current and 2 in a.hub.current, what="linked")
    assert a.load() == b.load() and sum(n for *_, n in a.load()) == 2
    a.book("live", letters="ACD")
    a.state.prefill_completed("s1/live")
    await until(lambda: a.load() == b.load(), what="live add synced")
    b.state.finish("s1/b-early")
    await until(lambda: a.load() == b.load() and sum(n for *_, n in a.load()) == 2, what="free synced")
    a.state.finish("s1/live")
    a.state.finish("s1/early")
    await until(lambda: all(x[1:] == (0, 0, 0) for x in b.load()), what="everything freed on b")
    assert b.state.bookings.peer_bookings.get(1) == {}


async def test_duplicate_adds_and_unknown_frees_are_no_ops():
    state = RouterState(metrics=RouterMetrics())
    state.add_engine(EngineInfo(11, "m", "w", 16, 1000))
    booking = router_pb2.ActiveBooking(request_id="x", engine_id=11, block_hashes=[1, 2], num_tokens=32)
    events = [
        router_pb2.BookingEvent(added=booking),
        router_pb2.BookingEvent(added=booking),
        router_pb2.BookingEvent(freed_request_id="unknown"),
        router_pb2.BookingEvent(prefill_completed_request_id="unknown"),
    ]
    state.bookings.apply_peer_events(5, events)
    assert state.slots.load(11) == (2, 32, 1)
    # a booking for an engine not known yet is parked until the engine shows up
    parked = router_pb2.BookingEvent(added=router_pb2.ActiveBooking(request_id="y", engine_id=33))
    state.bookings.apply_peer_events(5, [parked])
    assert state.slots.load(33) == (0, 0, 0)
    state.add_engine(EngineInfo(33, "m", "w", 16, 1000))
    assert state.slots.load(33)[2] == 1
    assert state.bookings.drop_peer(5) == 2 and len(state.slots) == 0


async def test_link_to_myself_is_refused(pair):
    a, _ = pair
    link = await asyncio.wait_for(a.hub._dial(1, a.address), 5)
    assert not link.ever_attached and a.hub.current == {}


@pytest.mark.parametrize(
    ("router_id", "code", "why"),
    [
        ("", grpc.StatusCode.INVALID_ARGUMENT, "is not a router id"),
        ("zz", grpc.StatusCode.INVALID_ARGUMENT, "is not a router id"),
        ("-1", grpc.StatusCode.INVALID_ARGUMENT, "is not a router id"),
        ("0x10", grpc.StatusCode.INVALID_ARGUMENT, "is not a router id"),
        ("010", grpc.StatusCode.INVALID_ARGUMENT, "is not a router id"),
        (
            "\u0661\u0662",
            grpc.StatusCode.INVALID_ARGUMENT,
            "is not a router id",
        ),  # Arabic-Indic digits: int() takes them
        ("f" * 5000, grpc.StatusCode.INVALID_ARGUMENT, "..."),  # shown cut short
        ("1", grpc.StatusCode.FAILED_PRECONDITION, "router 1 is this router itself"),
    ],
)
async def test_a_link_from_something_that_is_no_router_ends_with_a_status_saying_why(pair, router_id, code, why):
    """Such links ended OK with no details (the reason was only in the router's log)."""
    a, _ = pair
    async with grpc.aio.insecure_channel(a.address) as channel:
        call = router_pb2_grpc.RouterServiceStub(channel).ReplicaSync()
        await call.write(router_pb2.ReplicaSyncRequest(router_id=router_id))
        await call.done_writing()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in call:  # a's own snapshot comes first
                pass
        assert caught.value.code() is code
        assert why in caught.value.details() and len(caught.value.details()) < 200
    assert a.hub.current == {}


async def test_two_links_between_a_pair_collapse_to_the_smaller_dialers(pair):
    a, b = pair
    a.dial(b)
    await until(lambda: 1 in b.hub.current, what="first link")
    first = b.hub.current[1]
    b.dial(a)  # the larger id dials too (a race): both sides keep a's link
    await until(lambda: len(a.hub.links) == 1 and len(b.hub.links) == 1, what="duplicate closed")
    assert b.hub.current[1] is first and not a.hub.current[2].inbound
    a.book("r")
    await until(lambda: a.load() == b.load() and sum(n for *_, n in b.load()) == 1, what="still syncing")


async def test_peer_bookings_vanish_with_its_link(pair):
    a, b = pair
    task = a.dial(b)
    await until(lambda: 1 in b.hub.current, what="linked")
    a.book("r1")
    await until(lambda: sum(n for *_, n in b.load()) == 1, what="synced")
    task.cancel()  # a's side of the link dies (as with a kill -9)
    await until(lambda: sum(n for *_, n in b.load()) == 0, what="dropped on b")
    assert 1 not in b.hub.current


async def test_bookings_whose_free_never_came_expire_on_both_replicas_and_leave_nothing(pair):
    """A frontend that died holding requests never sends their FINISHED: the TTL frees them. The owner
    kept their keys and the peer kept them, block hashes and all, for as long as the link lived."""
    a, b = pair
    a.dial(b)
    await until(lambda: 1 in b.hub.current and 2 in a.hub.current, what="linked")
    for i in range(50):
        a.book(f"lost{i}", letters="ABCDEFGH")
    await until(lambda: len(b.state.bookings.peer_bookings.get(1, {})) == 50, what="synced")
    a.clock.now += 301
    a.state.active_load()  # the TTL runs lazily: on a decision or a load query
    assert not a.state.bookings.local_keys
    await until(lambda: not b.state.bookings.peer_bookings.get(1), what="the owner's expiry reached the peer")
    # The peer's own TTL, if the owner's word is lost too, forgets them the same way.
    a.book("lost-again")
    await until(lambda: len(b.state.bookings.peer_bookings.get(1, {})) == 1, what="synced")
    b.clock.now += 301
    assert all(blocks == 0 for _, blocks, _, _ in b.load()) and not b.state.bookings.peer_bookings.get(1)


async def test_bookings_dropped_with_a_departed_engine_are_freed_on_peers_that_parked_them(pair):
    """A lease flap seen by the two replicas in turn: b sees the engine leave first, then a books on it
    (b parks those), then a sees it leave and dropped them silently. b kept them parked for good, and
    booked them as fresh load for another whole TTL when the engine came back."""
    a, b = pair
    a.dial(b)
    await until(lambda: 1 in b.hub.current and 2 in a.hub.current, what="linked")
    b.state.remove_engine(11)
    for i in range(20):
        a.book(f"r{i}")
    await until(lambda: len(b.state.bookings.peer_bookings.get(1, {})) == 20, what="parked on b")
    a.state.remove_engine(11)
    await until(lambda: not b.state.bookings.peer_bookings.get(1), what="a's frees reached b")
    b.state.add_engine(EngineInfo(11, "m", "w11", 16, 1000))
    assert b.load() == [(11, 0, 0, 0), (22, 0, 0, 0)]


def _queued_transport() -> tuple[asyncio.Queue, object, object]:
    """A link's two ends as plain queues: the test delivers the peer's messages one by one, in any order."""
    inbox: asyncio.Queue = asyncio.Queue()

    async def send(_message: object) -> None:
        pass

    async def recv() -> object:
        return await inbox.get()

    return inbox, send, recv


async def test_a_replaced_link_applies_nothing_after_its_successors_snapshot():
    """Two links with one peer collapse to one; the other may still hold messages read before it lost. A
    booking the peer added and freed before the new link's snapshot (so not in it) arrives on the old link
    as 'added' after that snapshot, and its 'freed' never comes: applied, it stayed booked here as load
    until the 300 s TTL. The replaced link's snapshot is superseded, and so is everything after it."""
    hub = ReplicaHub(RouterState(metrics=RouterMetrics()), 5, lambda _address: None)  # type: ignore[arg-type, return-value]
    hub.state.add_engine(EngineInfo(11, "m", "w11", 16, 1000))
    loop = asyncio.get_running_loop()
    old_inbox, send, recv = _queued_transport()
    old = Link(hub, inbound=False, send=send, recv=recv, message_type=router_pb2.ReplicaSyncRequest, expected_peer=2)
    tasks = [loop.create_task(old.run())]
    old_inbox.put_nowait(router_pb2.ReplicaSyncResponse(router_id="2"))  # the peer's (empty) snapshot
    await until(lambda: hub.current.get(2) is old, what="the first link attached")
    new_inbox, send, recv = _queued_transport()
    new = Link(hub, inbound=True, send=send, recv=recv, message_type=router_pb2.ReplicaSyncResponse)
    tasks.append(loop.create_task(new.run()))
    for _ in range(5):  # both links wait for the peer's next message
        await asyncio.sleep(0)
    # In one tick: the new link's snapshot (peer 2 dialed it, so it replaces the old one), then, read by
    # the old link, the 'added' of a booking that the new snapshot no longer has (freed meanwhile).
    new_inbox.put_nowait(router_pb2.ReplicaSyncRequest(router_id="2"))
    booked = router_pb2.ActiveBooking(request_id="s1/Y", engine_id=11, block_hashes=[1, 2], num_tokens=32)
    old_inbox.put_nowait(router_pb2.ReplicaSyncResponse(router_id="2", events=[router_pb2.BookingEvent(added=booked)]))
    await until(lambda: hub.current.get(2) is new and old.closed.is_set(), what="the old link replaced")
    await asyncio.sleep(0.05)
    assert not hub.state.slots.has_request("p2/s1/Y")
    assert hub.state.active_load() == [(11, 0, 0, 0)]
    new.close()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_overflowing_link_is_cut_not_silently_lossy():
    a, b = Replica(1), Replica(2, queue_size=2)
    await a.server.start()
    await b.server.start()
    try:
        a.dial(b)
        await until(lambda: 1 in b.hub.current, what="linked")
        link = b.hub.current[1]
        for i in range(10):  # b publishes faster than its loop can send: the queue (2) overflows
            b.book(f"r{i}")
        assert link.overflowed and b.hub.overflows == 1
        await until(lambda: link.closed.is_set(), what="overflowed link closed")
    finally:
        await a.close()
        await b.close()


# ---------------------------------------------------------------------- end to end


@pytest.mark.e2e
def test_replicas_serve_alternately_and_warm_restart_converges(tmp_path):
    mesh = Mesh(tmp_path)
    try:
        worker = mesh.worker(engines=2)
        r1 = mesh.router()
        r2 = mesh.router()
        s1, s2 = r1.session(), r2.session()
        letters = "BCDEFGHIJ"
        for i in range(8):  # alternate replicas; shared prefixes across them
            (s1 if i % 2 == 0 else s2).run(worker, f"q{i}", prompt("A", letters[i % 4], letters[4 + i % 5]))
        for i in range(4):  # four more stay in flight: booked, generated, not finished
            session = s1 if i % 2 == 0 else s2
            tokens = prompt("A", "Z", letters[i])
            decision = session.route(f"live{i}", tokens)
            worker.generate(decision.engine_id, tokens)
            if i < 2:
                session.lifecycle(f"live{i}", FIRST_TOKEN)
        wait_until(lambda: r1.load() == r2.load() and sum(v[2] for v in r1.load().values()) == 4, 5, "load synced")
        truth = worker.truth()
        wait_until(lambda: r1.index() == truth and r2.index() == truth, 5, "indexes == workers' truth")

        r2.daemon.signal(signal.SIGKILL)
        r2.daemon.wait(5)
        # r2's bookings died with it (its link closed); r1 keeps its own two
        wait_until(lambda: sum(v[2] for v in r1.load().values()) == 2, 5, "r1 dropped r2's bookings")

        r3 = mesh.router()  # the restart: SERVING only once index and load are rebuilt
        truth = worker.truth()
        assert r3.index() == truth
        assert r1.index() == truth
        assert r3.load() == r1.load()
        line = r3.daemon.wait_log(r"warm restart: SERVING after ([0-9.]+) s.*?(\d+) peer bookings from (\d+) peers")
        assert (line.group(2), line.group(3)) == ("2", "1"), line.group(0)
        assert float(line.group(1)) < 5.0

        # the restarted replica routes, and its bookings reach the other one
        s3 = r3.session()
        decision = s3.route("after-restart", prompt("A", "Y"))
        assert decision.outcome == ROUTED
        wait_until(lambda: r1.load() == r3.load() and sum(v[2] for v in r1.load().values()) == 3, 5, "synced")
        assert re.search(r"replica sync: linked with", r1.daemon.log_text())
        s3.close()
        s1.close()
    finally:
        mesh.close()


def test_a_restarted_replica_does_not_wait_for_the_engines_of_a_dead_worker(tmp_path):
    """A worker killed with the router leaves its record behind for up to a lease TTL. A replica starting
    meanwhile waited for that engine's index for its whole ``--warmup-timeout``, out of service (no router
    at all, if it was the only one): it now stops waiting once the worker is found unreachable."""
    mesh = Mesh(tmp_path)
    try:
        live = mesh.worker(engines=1)
        dead = mesh.worker("--lease-ttl", "60", engines=1)  # its record outlives it by up to a minute
        dead.daemon.signal(signal.SIGKILL)
        dead.daemon.wait(5)
        router = mesh.router("--warmup-timeout", "120", wait=False)
        router.daemon.wait_serving(45)  # before the dead record expires, let alone the warm-up timeout
        line = router.daemon.wait_log(r"warm-up: 1 engines not restored \(([0-9a-f]+)")
        assert int(line.group(1), 16) == dead.engine_ids[0]
        index = router.index()  # the dead engine is still in the fleet (its record is), with nothing indexed
        assert {e: index[e] for e in live.engine_ids} == live.truth() and not index[dead.engine_ids[0]]
    finally:
        mesh.close()
