"""A Session batch's decisions: one message when deciding is quick, the decisions made so far first when it
is not (a real RouterServicer over gRPC on loopback; the router's state in process)."""

from __future__ import annotations

import asyncio

import grpc
from kvmesh.v1 import router_pb2, router_pb2_grpc
from kvmesh_router.engines import EngineInfo
from kvmesh_router.metrics import RouterMetrics
from kvmesh_router.service import RouterServicer, add_to_server
from kvmesh_router.state import RouterState

from tests.router.test_router_e2e_harness import FIRST_TOKEN, ROUTED, prompt, seq_hashes

ENGINES = (11, 22)


def query(rid: str, letters: str) -> router_pb2.SessionRequest:
    tokens = prompt(*letters)
    return router_pb2.SessionRequest(
        route=router_pb2.RouteQuery(request_id=rid, model="m", block_hashes=seq_hashes(tokens), num_tokens=len(tokens))
    )


def first_token(rid: str) -> router_pb2.SessionRequest:
    return router_pb2.SessionRequest(lifecycle=router_pb2.LifecycleUpdate(request_id=rid, stage=FIRST_TOKEN))


async def answers(
    flush_after_s: float, batch: list[router_pb2.SessionRequest]
) -> tuple[list[list[str]], list[tuple[int, int, int, int]]]:
    """The decision_batch messages (their request ids) a router answers one batch with, and its load then
    (before the session ends and frees its bookings)."""
    state = RouterState(metrics=RouterMetrics())
    for e in ENGINES:
        state.add_engine(EngineInfo(e, "m", f"w{e}", 16, 1000))
    servicer = RouterServicer(state)
    servicer.sessions.flush_after_s = flush_after_s
    server = grpc.aio.server()
    add_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    queries = sum(1 for item in batch if item.WhichOneof("kind") == "route")
    messages: list[list[str]] = []
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            call = router_pb2_grpc.RouterServiceStub(channel).Session()
            await call.write(router_pb2.SessionRequest(batch=router_pb2.SessionRequestBatch(requests=batch)))
            while sum(map(len, messages)) < queries:
                response = await asyncio.wait_for(call.read(), 10)
                assert response.WhichOneof("kind") == "decision_batch"
                decisions = response.decision_batch.decisions
                assert all(d.outcome == ROUTED for d in decisions)
                messages.append([d.request_id for d in decisions])
            load = state.active_load()  # (engine, blocks, prefill tokens, requests)
            await call.done_writing()
    finally:
        await server.stop(None)
    return messages, load


async def test_a_quickly_decided_batch_is_answered_in_one_message() -> None:
    batch = [query("r1", "AB"), first_token("r1"), query("r2", "AC"), query("r3", "DE")]
    messages, _ = await answers(1.0, batch)
    assert messages == [["r1", "r2", "r3"]]


async def test_a_slowly_decided_batch_sends_the_decisions_made_so_far_first_in_order() -> None:
    """With a zero budget every decision goes out before the next is computed; updates still apply in order."""
    batch = [query("r1", "AB"), first_token("r1"), query("r2", "AC"), query("r3", "DE")]
    messages, load = await answers(0.0, batch)
    assert messages == [["r1"], ["r2"], ["r3"]]
    assert sum(n for *_, n in load) == 3  # every query booked once, none twice
    assert sum(prefill for _, _, prefill, _ in load) == 64  # r2 and r3 (32 tokens each); r1's first token came
