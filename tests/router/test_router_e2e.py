"""Router end-to-end: real ``kvmesh-worker`` (mocker engines, real KV events) and ``kvmesh-router``
processes, driven through the contracts the way a frontend drives them.

- Dynamo's decision scenario (``test_router_decisions``): seeds [A,B]->a, [A,C,D]->a, [A,C,E]->b pinned
  (RouteQuery with pinned_engine_id, GenerateStream on the worker, FIRST_TOKEN, FINISHED); once the router's
  index reflects the stores, [A,C,D,F] goes to a and [A,C,E,G] to b. With KV events (file and etcd
  discovery) and in approximate mode (``--no-kv-events``).
- Overload: with a low busy threshold a burst gets some REJECTED decisions, never a hang, and the
  rejection counter equals their number.
- Frontend death: a Session stream cut mid-flight (the frontend process is kill -9'd) frees every
  booking it made.
- Contract outcomes: NO_ENGINE (unknown model, pinned engine gone), INVALID (duplicate active id).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from kvmesh.v1 import discovery_pb2, router_pb2

from tests.router.test_router_e2e_harness import (
    FINISHED,
    FIRST_TOKEN,
    INVALID,
    MODEL,
    NO_ENGINE,
    REJECTED,
    ROUTED,
    Mesh,
    prompt,
    seq_hashes,
    wait_until,
)
from tests.support.etcd import EtcdServer, etcd_available

pytestmark = pytest.mark.e2e


@pytest.fixture
def mesh(tmp_path):
    m = Mesh(tmp_path)
    yield m
    m.close()


def run_decision_scenario(mesh: Mesh, *router_flags: str) -> None:
    worker = mesh.worker(engines=2)
    router = mesh.router(*router_flags)
    a, b = worker.engine_ids
    session = router.session()
    try:
        for rid, letters, engine in (("s1", "AB", a), ("s2", "ACD", a), ("s3", "ACE", b)):
            decision = session.run(worker, rid, prompt(*letters), pinned=engine)
            assert decision.engine_id == engine and decision.address == worker.address
            assert decision.block_size == 16

        expected = {a: [prompt("A", "B"), prompt("A", "C", "D")], b: [prompt("A", "C", "E")]}
        want = {e: {h for p in prompts for h in seq_hashes(p)} for e, prompts in expected.items()}
        wait_until(lambda: all(want[e] <= router.index().get(e, set()) for e in want), 10, "the index has the seeds")
        wait_until(lambda: all(n == 0 for _, _, n in router.load().values()), 5, "seed bookings freed")

        first = session.run(worker, "q1", prompt("A", "C", "D", "F"))
        assert (first.engine_id, first.overlap_blocks, first.best_overlap_blocks) == (a, 3, 3), first
        second = session.run(worker, "q2", prompt("A", "C", "E", "G"))
        assert (second.engine_id, second.overlap_blocks, second.best_overlap_blocks) == (b, 3, 3), second
        metrics = router.metrics()
        assert metrics["kvmesh_router_decisions_total{mode=direct,outcome=routed}"] == 3
        assert metrics["kvmesh_router_decisions_total{mode=kv,outcome=routed}"] == 2
        assert metrics["kvmesh_router_decision_quality_ratio_count"] == 4  # the first seed had no overlap anywhere
    finally:
        session.close()


def test_router_decisions_with_kv_events(mesh):
    run_decision_scenario(mesh)
    router = mesh._owned[-1]
    worker = mesh._owned[0]
    # the router's index is the workers' truth, and every event counted
    assert router.index() == worker.truth()
    assert router.metrics()["kvmesh_router_kv_events_total"] > 0


def test_router_decisions_approximate_mode(mesh):
    run_decision_scenario(mesh, "--no-kv-events")


@pytest.mark.etcd
@pytest.mark.skipif(not etcd_available(), reason="etcd binary not installed")
def test_router_decisions_on_etcd(tmp_path):
    with EtcdServer(tmp_path / "etcd") as etcd:
        m = Mesh(tmp_path, etcd.url)
        try:
            run_decision_scenario(m)
        finally:
            m.close()


def test_overload_burst_is_rejected_never_hangs_and_counted(mesh):
    worker = mesh.worker(engines=2)
    # 64-token prompts: one booked prefill (64) already exceeds 40 tokens, so each engine takes one.
    router = mesh.router("--busy-prefill-tokens", "40")
    session = router.session()
    try:
        burst = 12
        for i in range(burst):
            session.send_query(f"b{i}", seq_hashes(prompt("H", "I", "J", chr(ord("K") + i))), 64)
        decisions = [session.decision(timeout=5) for _ in range(burst)]
        routed = [d for d in decisions if d.outcome == ROUTED]
        rejected = [d for d in decisions if d.outcome == REJECTED]
        assert len(routed) + len(rejected) == burst
        assert len(routed) == 2 and {d.engine_id for d in routed} == set(worker.engine_ids)
        assert rejected and all("busy" in d.message for d in rejected)
        metrics = router.metrics()
        assert metrics["kvmesh_router_decisions_total{mode=kv,outcome=rejected}"] == len(rejected)
        # prefill done -> not busy any more: the next query is routed again
        for d in routed:
            session.lifecycle(d.request_id, FIRST_TOKEN)
        assert session.route("after", prompt("H", "I", "J", "Z")).outcome == ROUTED
    finally:
        session.close()


def test_contract_outcomes_and_per_request_overrides(mesh):
    worker = mesh.worker(engines=2)
    router = mesh.router()
    session = router.session()
    try:
        tokens = prompt("A", "B")
        unknown = session.route("m1", tokens, model="no-such-model")
        assert unknown.outcome == NO_ENGINE and "no-such-model" in unknown.message
        gone = session.route("p1", tokens, pinned=12345)
        assert gone.outcome == NO_ENGINE, gone
        direct = session.route("x1", tokens, mode=router_pb2.ROUTER_MODE_DIRECT)  # direct needs a pin
        assert direct.outcome == INVALID and "pinned" in direct.message
        assert session.route("d1", tokens).outcome == ROUTED
        duplicate = session.route("d1", tokens)
        assert duplicate.outcome == INVALID and "already active" in duplicate.message
        session.lifecycle("d1", FINISHED)
        assert session.route("d1", tokens).outcome == ROUTED  # the id is free again
        session.lifecycle("d1", FINISHED)
        # per-request mode: round robin walks both engines whatever the cache says
        rr = [session.route(f"rr{i}", tokens, mode=router_pb2.ROUTER_MODE_ROUND_ROBIN) for i in range(4)]
        assert {d.engine_id for d in rr} == set(worker.engine_ids)
        for d in rr:
            session.lifecycle(d.request_id, FINISHED)
        excluded = session.route("e1", tokens, excluded=[worker.engine_ids[0]])
        assert excluded.engine_id == worker.engine_ids[1]
        session.lifecycle("e1", FINISHED)
        # another session may use the same ids; a closed session frees its bookings
        other = router.session()
        assert other.route("d1", tokens).outcome == ROUTED
        assert session.route("d1", tokens).outcome == ROUTED
        other.close()
        wait_until(lambda: sum(n for _, _, n in router.load().values()) == 1, 5, "one booking left")
        metrics = router.metrics()
        assert metrics["kvmesh_router_decisions_total{mode=round_robin,outcome=routed}"] == 4
        assert metrics["kvmesh_router_decisions_total{mode=kv,outcome=invalid}"] == 1
    finally:
        session.close()


_FRONTEND = textwrap.dedent(
    """
    import sys, time, grpc
    from kvmesh.v1 import router_pb2, router_pb2_grpc
    address, n = sys.argv[1], int(sys.argv[2])
    hashes = [int(h) for h in sys.argv[3].split(",")]
    channel = grpc.insecure_channel(address)
    def requests():
        for i in range(n):
            yield router_pb2.SessionRequest(route=router_pb2.RouteQuery(
                request_id=f"f{i}", model="MODEL", block_hashes=hashes, num_tokens=16 * len(hashes)))
        time.sleep(3600)
    responses = router_pb2_grpc.RouterServiceStub(channel).Session(requests())
    for i in range(n):
        assert next(responses).decision.outcome == router_pb2.DECISION_OUTCOME_ROUTED
    print("READY", flush=True)
    time.sleep(3600)
    """
).replace("MODEL", MODEL)


def test_frontend_death_frees_its_bookings(mesh):
    mesh.worker(engines=2)
    router = mesh.router()
    hashes = seq_hashes(prompt("A", "B", "C"))
    frontend = subprocess.Popen(
        [sys.executable, "-c", _FRONTEND, router.address, "5", ",".join(map(str, hashes))],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert frontend.stdout is not None and frontend.stdout.readline().strip() == "READY"
        load = router.load()
        assert sum(n for _, _, n in load.values()) == 5 and sum(p for _, p, _ in load.values()) > 0
        frontend.send_signal(signal.SIGKILL)  # mid-flight: no FINISHED will ever come
        frontend.wait(5)
        wait_until(lambda: all(v == (0, 0, 0) for v in router.load().values()), 5, "bookings freed")
        assert router.metrics()["kvmesh_router_session_orphans_freed_total"] == 5
    finally:
        if frontend.poll() is None:
            frontend.kill()
            frontend.wait()


def test_busy_kv_usage_counts_what_the_engine_reports(mesh):
    # One small engine; a long request sent to the worker directly (no router booking) fills it.
    worker = mesh.worker(engines=1, blocks=64, speedup=1.0)
    router = mesh.router("--busy-kv-usage", "0.1")
    session = router.session()
    engine = worker.engine_ids[0]
    runner = threading.Thread(target=worker.generate, args=(engine, prompt(*"ABCDEFGH")), kwargs={"max_tokens": 150})
    try:
        assert session.route("idle", prompt("X")).outcome == ROUTED  # 1 booked block < 6.4: not busy
        session.lifecycle("idle", FINISHED)
        runner.start()  # 8+ active blocks on the engine that the router never booked

        def rejected() -> bool:
            decision = session.route(f"r{time.monotonic_ns()}", prompt("X"))
            if decision.outcome == ROUTED:
                session.lifecycle(decision.request_id, FINISHED)
            return decision.outcome == REJECTED

        wait_until(rejected, 5, "busy from the engine's own KV usage")
        runner.join(30)
        wait_until(lambda: not rejected(), 5, "not busy once the engine is idle again")
    finally:
        if runner.is_alive():
            runner.join(30)
        session.close()


def test_a_disaggregated_query_books_decode_and_prefill_and_both_are_freed(mesh):
    decode = mesh.worker("--role", "decode", engines=1)
    prefill = mesh.worker("--role", "prefill", engines=1)
    router = mesh.router("--disagg-min-tokens", "32")
    session = router.session()
    try:
        tokens = prompt("A", "B", "C", "D")  # 64 tokens, none cached anywhere: remote
        decision = session.route("r1", tokens, role=discovery_pb2.WORKER_ROLE_DECODE, excluded_prefill=())
        assert decision.outcome == ROUTED and decision.engine_id == decode.engine_ids[0], decision
        plan = decision.prefill
        assert plan.place == router_pb2.PREFILL_PLACE_REMOTE and plan.reason == "remote", plan
        assert (plan.engine_id, plan.address, plan.request_id) == (prefill.engine_ids[0], prefill.address, "r1/prefill")
        assert plan.uncached_tokens == len(tokens)
        assert sum(n for _, _, n in router.load().values()) == 2  # both legs booked, in one step
        session.lifecycle("r1/prefill", FIRST_TOKEN)
        session.lifecycle("r1/prefill", FINISHED)
        session.lifecycle("r1", FINISHED)
        wait_until(lambda: all(v == (0, 0, 0) for v in router.load().values()), 5, "both bookings freed")

        short = session.route("r2", prompt("E", "F"), role=discovery_pb2.WORKER_ROLE_DECODE, excluded_prefill=())
        assert short.prefill.place == router_pb2.PREFILL_PLACE_LOCAL_SHORT, short.prefill
        assert short.prefill.reason == "local: 32 uncached prompt tokens <= --disagg-min-tokens 32"
        failed = session.route("r3", tokens, role=discovery_pb2.WORKER_ROLE_DECODE, excluded_prefill=prefill.engine_ids)
        assert failed.prefill.place == router_pb2.PREFILL_PLACE_LOCAL_NO_ENGINE, failed.prefill
        session.lifecycle("r2", FINISHED)
        session.lifecycle("r3", FINISHED)

        # A frontend that gives up on a query (its client cancelled, a hedge lost) before it read the
        # decision sends FINISHED for the request only: it never learnt of the prefill leg, freed with it.
        abandoned = session.route("r5", prompt("G", "H", "I", "J"), role=discovery_pb2.WORKER_ROLE_DECODE,
                                  excluded_prefill=())  # fmt: skip
        assert abandoned.prefill.place == router_pb2.PREFILL_PLACE_REMOTE, abandoned.prefill
        session.lifecycle("r5", FINISHED)
        wait_until(lambda: all(v == (0, 0, 0) for v in router.load().values()), 5, "the prefill leg freed too")

        session.route("r4", tokens, role=discovery_pb2.WORKER_ROLE_DECODE, excluded_prefill=())
        assert sum(n for _, _, n in router.load().values()) == 2
    finally:
        session.cancel()  # the frontend goes away with r4 and r4/prefill booked: both are freed
    wait_until(lambda: all(v == (0, 0, 0) for v in router.load().values()), 5, "orphaned bookings freed")
