"""A Session stream outlives any one bad message: bytes that do not parse, overrides out of range, and a
bug inside a decision each get one INVALID (a bug: ERROR) decision, and the stream's other queries keep their bookings
(a real RouterServicer over gRPC on loopback; the router's state in process). Also the router's other bad
input: a prefill id the session already uses, an engine it does not know in DumpIndex."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from kvmesh.v1 import discovery_pb2, router_pb2, router_pb2_grpc
from kvmesh_router.engines import EngineInfo
from kvmesh_router.metrics import RouterMetrics
from kvmesh_router.replication import BookingListener
from kvmesh_router.service import RouterServicer, add_to_server
from kvmesh_router.state import RouterState
from kvmesh_router.translate import MAX_QUERY_BLOCKS

from tests.router.test_router_e2e_harness import ROUTED, prompt, seq_hashes

INVALID = router_pb2.DECISION_OUTCOME_INVALID
ERROR = router_pb2.DECISION_OUTCOME_ERROR
#: A SessionRequest whose route.request_id (field 1 of field 1) is not UTF-8, as a C++ or Go client can send.
NOT_UTF8 = b"\x0a\x04\x0a\x02\xff\xfe"


def query(rid: str, letters: str, **overrides: float) -> bytes:
    tokens = prompt(*letters)
    route = router_pb2.RouteQuery(request_id=rid, model="m", block_hashes=seq_hashes(tokens), num_tokens=len(tokens))
    if overrides:
        route.overrides.CopyFrom(router_pb2.RouterConfigOverride(**overrides))
    return router_pb2.SessionRequest(route=route).SerializeToString()


@contextlib.asynccontextmanager
async def serving(state: RouterState) -> AsyncIterator[grpc.aio.Channel]:
    """A channel to ``state``'s RouterService, served on loopback as the daemon serves it."""
    server = grpc.aio.server()
    add_to_server(RouterServicer(state), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            yield channel
    finally:
        await server.stop(None)


async def decide(state: RouterState, messages: list[bytes]) -> tuple[list[router_pb2.RouteDecision], int]:
    """Each message's decision, in order, and the bookings held before the session ends."""
    async with serving(state) as channel:
        session = channel.stream_stream(
            "/kvmesh.v1.RouterService/Session", lambda b: b, router_pb2.SessionResponse.FromString
        )
        call = session()
        decisions = []
        for message in messages:
            await call.write(message)
            decisions.append((await asyncio.wait_for(call.read(), 10)).decision)
        booked = sum(n for *_, n in state.active_load())
        await call.done_writing()
        assert await call.code() is grpc.StatusCode.OK
    return decisions, booked


def router() -> RouterState:
    state = RouterState(metrics=RouterMetrics())
    for e in (11, 22):
        state.add_engine(EngineInfo(e, "m", f"w{e}", 16, 1000))
    return state


async def test_a_message_that_does_not_parse_is_refused_in_band_and_the_session_goes_on() -> None:
    state = router()
    decisions, booked = await decide(state, [query("r1", "AB"), NOT_UTF8, b"\xff\xff", query("r2", "CD")])
    invalid = state.metrics.registry.get_sample_value(
        "kvmesh_router_decisions_total", {"mode": "kv", "outcome": "invalid"}
    )
    assert invalid == 2  # counted as any invalid query
    assert [d.outcome for d in decisions] == [ROUTED, INVALID, INVALID, ROUTED]
    assert decisions[1].request_id == ""
    assert decisions[1].message == (
        "the message is not a valid kvmesh.v1.SessionRequest (it does not parse, or a string field is not UTF-8)"
    )
    assert booked == 2  # r1's booking survived the bad messages


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ({"overlap_weight": 1e308}, "overlap_score_weight must be in [0, 1e+06]"),
        ({"temperature": float("nan")}, "temperature must be finite"),
    ],
)
async def test_an_override_out_of_range_is_invalid_naming_the_bound(overrides, why) -> None:
    decisions, booked = await decide(router(), [query("r1", "AB", **overrides), query("r2", "AB")])
    assert decisions[0].outcome == INVALID and why in decisions[0].message
    assert decisions[1].outcome == ROUTED and booked == 1


async def test_a_vanishing_temperature_routes_to_the_cheapest_engine() -> None:
    """5e-324 x the costs' spread underflowed to 0: a ZeroDivisionError inside the decision."""
    state = router()
    decisions, _ = await decide(state, [query("big", "ABCDEFGH"), query("r", "XY", temperature=5e-324)])
    assert [d.outcome for d in decisions] == [ROUTED, ROUTED]
    assert decisions[1].engine_id != decisions[0].engine_id  # the idle engine is the cheaper one


async def test_a_bug_inside_a_decision_is_one_invalid_answer_that_names_no_exception(monkeypatch, caplog) -> None:
    state = router()
    real = state.route

    def route(key, query, out):
        if query.request_id == "boom":
            raise ZeroDivisionError("float division by zero")
        return real(key, query, out)

    monkeypatch.setattr(state, "route", route)
    decisions, booked = await decide(state, [query("boom", "AB"), query("r2", "AB")])
    assert decisions[0].outcome == ERROR and decisions[0].request_id == "boom"
    assert "ZeroDivision" not in decisions[0].message and "division" not in decisions[0].message
    assert decisions[0].message == "internal router error (logged by the router); the query was not routed"
    assert decisions[1].outcome == ROUTED and booked == 1
    assert any(r.levelno == logging.ERROR and r.exc_info for r in caplog.records)  # the operator sees it


async def test_a_query_with_more_block_hashes_than_any_prompt_needs_is_invalid() -> None:
    """Deciding is O(blocks) and serialized across sessions: 6.5M hashes held every other session for seconds."""
    huge = router_pb2.RouteQuery(request_id="huge", model="m", block_hashes=range(MAX_QUERY_BLOCKS + 1), num_tokens=5)
    decisions, booked = await decide(router(), [router_pb2.SessionRequest(route=huge).SerializeToString()])
    assert decisions[0].outcome == INVALID and f"at most {MAX_QUERY_BLOCKS} are accepted" in decisions[0].message
    assert booked == 0


async def test_a_query_with_more_block_hashes_than_tokens_is_invalid() -> None:
    """More hashes than tokens: booked, a query of 0 tokens got the cache credit of blocks it does not have.
    (Repeated hashes are not looked for: 7 µs of set building per decision, against queries only the mesh's
    own authenticated frontends send.)"""
    h = seq_hashes(prompt("A"))[0]
    queries = [
        router_pb2.RouteQuery(request_id="many", model="m", block_hashes=seq_hashes(prompt(*"AB")), num_tokens=1),
        router_pb2.RouteQuery(request_id="none", model="m", block_hashes=[h], num_tokens=0),
    ]
    messages = [router_pb2.SessionRequest(route=q).SerializeToString() for q in queries]
    decisions, booked = await decide(router(), messages)
    assert [d.outcome for d in decisions] == [INVALID] * 2 and booked == 0
    assert "2 block hashes for a prompt of 1 tokens" in decisions[0].message


async def test_a_prefill_whose_id_the_session_already_uses_is_local_and_says_why_without_internal_keys() -> None:
    """The remote prefill of "b" is booked as "b/prefill": a request of that very id made it fall back with
    the reason "request 's659/b/prefill' is already booked", the router's internal booking key."""
    state = RouterState(metrics=RouterMetrics())
    state.add_engine(EngineInfo(11, "m", "w11", 16, 1000, role="decode"))
    state.add_engine(EngineInfo(22, "m", "w22", 16, 1000, role="prefill"))
    decode = router_pb2.RouterConfigOverride(role=discovery_pb2.WORKER_ROLE_DECODE)
    tokens = prompt(*"ABCDEFGH")

    def disagg(rid: str) -> bytes:
        route = router_pb2.RouteQuery(
            request_id=rid, model="m", block_hashes=seq_hashes(tokens), num_tokens=len(tokens), overrides=decode
        )
        route.disagg.SetInParent()
        return router_pb2.SessionRequest(route=route).SerializeToString()

    decisions, _ = await decide(state, [disagg("a"), disagg("b/prefill"), disagg("b")])
    assert decisions[0].prefill.place == router_pb2.PREFILL_PLACE_REMOTE  # the normal case
    assert decisions[2].outcome == ROUTED and decisions[2].prefill.place == router_pb2.PREFILL_PLACE_LOCAL_NO_ENGINE
    assert decisions[2].prefill.reason == (
        "local: request 'b/prefill' is active, and a remote prefill of this one needs that id"
    )


def disagg_router() -> RouterState:
    state = RouterState(metrics=RouterMetrics())
    state.add_engine(EngineInfo(11, "m", "w11", 16, 1000, role="decode"))
    state.add_engine(EngineInfo(22, "m", "w22", 16, 1000, role="prefill"))
    return state


def disagg_query(rid: str) -> bytes:
    tokens = prompt(*"ABCDEFGH")
    route = router_pb2.RouteQuery(
        request_id=rid,
        model="m",
        block_hashes=seq_hashes(tokens),
        num_tokens=len(tokens),
        overrides=router_pb2.RouterConfigOverride(role=discovery_pb2.WORKER_ROLE_DECODE),
    )
    route.disagg.SetInParent()
    return router_pb2.SessionRequest(route=route).SerializeToString()


class FailsOn(BookingListener):
    """A bug in whatever follows a booking (a listener, metrics, a trace span), for the keys ending so."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix

    def booking_added(self, key: str, booking: object) -> None:
        if key.endswith(self.suffix):
            raise RuntimeError("a bug")


async def test_a_bug_after_the_remote_prefill_was_booked_leaves_neither_booking() -> None:
    """The ERROR answer names no prefill, so nobody would ever free it: it held its engine for the TTL."""
    state = disagg_router()
    state.bookings.add_listener(FailsOn("/c/prefill"))
    decisions, booked = await decide(state, [disagg_query("c"), disagg_query("d")])
    assert decisions[0].outcome == ERROR and decisions[1].prefill.place == router_pb2.PREFILL_PLACE_REMOTE
    assert booked == 2  # d and d's prefill


async def test_a_bug_in_a_decision_frees_no_other_request_of_the_session() -> None:
    """Freeing the failed decision's prefill key must not free the session's own request of that id."""
    state = disagg_router()
    state.bookings.add_listener(FailsOn("/b"))
    decisions, booked = await decide(state, [disagg_query("b/prefill"), disagg_query("b")])
    assert decisions[0].outcome == ROUTED and decisions[1].outcome == ERROR
    assert booked == 2  # "b/prefill" and its own remote prefill, "b/prefill/prefill"


async def test_dumping_an_engine_the_router_does_not_know_is_not_found() -> None:
    """It was left out of the answer silently, so a typo read as "this engine caches nothing"."""
    async with serving(router()) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        known = await stub.DumpIndex(router_pb2.DumpIndexRequest(engine_ids=[11]))
        assert [e.engine_id for e in known.engines] == [11]
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.DumpIndex(router_pb2.DumpIndexRequest(engine_ids=[11, 0x3039]))
        assert caught.value.code() is grpc.StatusCode.NOT_FOUND
        assert caught.value.details() == "engines not known to this router: 3039"
