"""Router benchmark: the Mooncake conversation trace through the router's ingest and decision paths.

Each trace request's ``hash_ids`` are 512-token blocks, chained into sequence hashes the way engines
publish them (:func:`kvmesh_bench.indexer_microbench.trace_requests`). A simulated fleet (one LRU
prefix cache per engine, :class:`kvmesh_bench.indexer_microbench.SimEngine`) serves every routed
request and emits the KV events a real engine would.

Per fleet size (``--engines 8,128,1000``), in process, on one core:

1. **core**: the indexer micro-benchmark's live replay (``Admission.decide`` per request, timed) and
   its isolated indexer replay (events applied/s, ``find_matches``/s and p50/p99, combined indexer
   ops/s = (events + find_matches) / time).
2. **daemon path**: the same trace through what the daemon runs per message, minus the socket:
   a ``RouteQuery`` protobuf into ``RouterState.route`` (decision + booking + metrics, timed), and the
   engine's events as a serialized ``KvEventBatch`` parsed and fed through the ingest cursor
   (``EngineCursor.on_events``: id check + index apply, timed: wire events/s).

Through the gRPC contract (``--grpc-engines 8``): the router side runs in a child process on
loopback with uvloop: ``RouterState`` + ``RouterServicer`` + the daemon's real ingest feeds
(``kvmesh_router.ingest.Ingest``), subscribed over gRPC to a fake ``WorkerService`` that the parent
hosts for the simulated engines. The parent plays the frontend and the engines: on one ``Session``
stream it routes the first ``--grpc-warm-requests`` trace requests (warm-up: after each decision the
chosen engine caches the prompt and its KV events stream to the router), then the next
``--grpc-requests`` sequentially (one query in flight; each decision's round trip timed, then
FINISHED) for p50/p99, the same queries for an unknown model (the transport floor), and pipelined
(``--grpc-window`` queries in flight) for decisions/s.

Run: ``python -m kvmesh_bench.router_bench --engines 8,128,1000 --json out.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing
import os
import random
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvmesh import kv_events_pb
from kvmesh.kv_events import EventData, KvEvent
from kvmesh.v1 import kv_events_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh_router.cursor import EngineCursor, IngestStats
from kvmesh_router.engines import EngineInfo
from kvmesh_router.metrics import RouterMetrics
from kvmesh_router.settings import RouterSettings
from kvmesh_router.state import RouterState

from kvmesh_bench import indexer_microbench as mb
from kvmesh_bench.argtypes import CommandParser, non_negative_int, output_file, positive_int, positive_ints
from kvmesh_bench.stats import percentile
from kvmesh_bench.tables import format_table, write_json
from kvmesh_bench.trace import TraceError

DEFAULT_TRACE = mb.DEFAULT_TRACE
MODEL = "mooncake"

Request = tuple[float, int, list[int]]  # (arrival s, input length, sequence hashes)


@dataclass
class FleetResult:
    engines: int
    requests: int
    events: int
    blocks: int
    # core (indexer micro-benchmark)
    indexer_events_per_s: float
    find_matches_per_s: float
    find_p50_us: float
    find_p99_us: float
    indexer_ops_per_s: float
    decide_p50_us: float
    decide_p99_us: float
    decisions_per_s: float
    # daemon path (protobuf in, protobuf out, metrics on)
    route_p50_us: float
    route_p99_us: float
    route_decisions_per_s: float
    wire_events_per_s: float
    wire_blocks_per_s: float
    index_entries: int
    decision_quality: float


@dataclass
class GrpcResult:
    engines: int
    requests: int
    warm_requests: int
    rtt_p50_us: float
    rtt_p99_us: float
    rtt_max_us: float
    floor_p50_us: float
    floor_p99_us: float
    server_decide_p50_us: float
    server_decide_p99_us: float
    pipelined_decisions_per_s: float
    window: int
    events_applied: int
    outcomes: dict[str, int] = field(default_factory=dict)


def engine_ids(n: int) -> list[int]:
    return [(i * 0x9E3779B97F4A7C15) & 0x7FFF_FFFF_FFFF_FFFF for i in range(1, n + 1)]


class SimFleet:
    """Engines' prefix caches plus each engine's journal position, emitting protobuf event batches."""

    def __init__(self, ids: list[int], capacity: int) -> None:
        self.engines = {e: mb.SimEngine(capacity) for e in ids}
        self.next_id = dict.fromkeys(ids, 0)

    def serve(self, engine_id: int, seq_hashes: list[int]) -> bytes | None:
        """The serialized KvEventBatch of the engine's cache changes for one request (None: no change)."""
        data: list[EventData] = self.engines[engine_id].serve(seq_hashes)
        if not data:
            return None
        first = self.next_id[engine_id]
        self.next_id[engine_id] = first + len(data)
        events = [KvEvent(first + i, d) for i, d in enumerate(data)]
        return kv_events_pb.batch_to_proto(events).SerializeToString()


def make_state(ids: list[int], block_size: int, capacity: int, seed: int) -> RouterState:
    state = RouterState(RouterSettings(seed=seed, index_max_blocks=None), RouterMetrics())
    for e in ids:
        state.add_engine(EngineInfo(e, MODEL, f"sim:{e:x}", block_size, max(capacity, 1)))
    return state


def make_cursors(state: RouterState, ids: list[int]) -> dict[int, EngineCursor]:
    assert state.kv_index is not None
    stats = IngestStats()
    cursors = {e: EngineCursor(e, state.kv_index, stats) for e in ids}
    empty = kv_events_pb2.KvIndexSnapshot(next_event_id=0)
    for cursor in cursors.values():
        cursor.on_snapshot(empty)
    return cursors


def daemon_path(requests: list[Request], n: int, args: argparse.Namespace) -> dict[str, float]:
    """RouterState.route per request (timed) and the engines' events through the ingest cursor (timed)."""
    ids = engine_ids(n)
    state = make_state(ids, args.block_size, args.engine_capacity_blocks, args.seed)
    cursors = make_cursors(state, ids)
    fleet = SimFleet(ids, args.engine_capacity_blocks)
    clock = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns
    route_ns: list[int] = []
    wire_ns = 0
    events = blocks = 0
    active: deque[str] = deque()
    quality = 0.0
    parse = kv_events_pb2.KvEventBatch.FromString
    for i, (_, isl, seq) in enumerate(requests):
        key = f"s1/r{i}"
        query = router_pb2.RouteQuery(request_id=f"r{i}", model=MODEL, block_hashes=seq, num_tokens=isl)
        out = router_pb2.RouteDecision()
        t0 = clock()
        state.route(key, query, out)
        route_ns.append(clock() - t0)
        quality += out.overlap_blocks / out.best_overlap_blocks if out.best_overlap_blocks else 1.0
        raw = fleet.serve(out.engine_id, seq)
        if raw is not None:
            t0 = clock()
            batch = parse(raw)
            cursors[out.engine_id].on_events(batch.events)
            wire_ns += clock() - t0
            events += len(batch.events)
            blocks += sum(len(ev.stored.block_hashes) + len(ev.removed.block_hashes) for ev in batch.events)
        active.append(key)
        if len(active) > args.prefill_lag:
            state.prefill_completed(active[-1 - args.prefill_lag])
        if len(active) > args.concurrency:
            state.finish(active.popleft())
    route_us = [ns / 1000 for ns in route_ns]
    assert state.kv_index is not None
    return {
        "route_p50_us": percentile(route_us, 50, method="nearest", empty=0.0),
        "route_p99_us": percentile(route_us, 99, method="nearest", empty=0.0),
        "route_decisions_per_s": len(route_ns) / (sum(route_ns) / 1e9),
        "wire_events_per_s": events / (wire_ns / 1e9) if wire_ns else 0.0,
        "wire_blocks_per_s": blocks / (wire_ns / 1e9) if wire_ns else 0.0,
        "index_entries": state.kv_index.size,
        "decision_quality": quality / len(requests),
    }


def run_fleet(requests: list[Request], n: int, args: argparse.Namespace) -> FleetResult:
    # The daemon's default thresholds and cost policy (live_replay's default), as the daemon path below decides.
    work = mb.live_replay(
        requests, n, "kv", args.engine_capacity_blocks, args.concurrency, args.prefill_lag, args.block_size, args.seed,
        RouterSettings().busy_thresholds(),
    )  # fmt: skip
    core = mb.replay_indexer(work.ops)
    core.pop("index")
    decide_us = [ns / 1000 for ns in work.decide_ns]
    path = daemon_path(requests, n, args)
    return FleetResult(
        engines=n,
        requests=len(requests),
        events=core["events"],
        blocks=core["blocks_stored"] + core["blocks_removed"],
        indexer_events_per_s=core["events_per_s"],
        find_matches_per_s=core["find_matches_per_s"],
        find_p50_us=core["find_p50_us"],
        find_p99_us=core["find_p99_us"],
        indexer_ops_per_s=core["indexer_ops_per_s"],
        decide_p50_us=percentile(decide_us, 50, method="nearest", empty=0.0),
        decide_p99_us=percentile(decide_us, 99, method="nearest", empty=0.0),
        decisions_per_s=len(decide_us) / (sum(decide_us) / 1e6),
        route_p50_us=path["route_p50_us"],
        route_p99_us=path["route_p99_us"],
        route_decisions_per_s=path["route_decisions_per_s"],
        wire_events_per_s=path["wire_events_per_s"],
        wire_blocks_per_s=path["wire_blocks_per_s"],
        index_entries=int(path["index_entries"]),
        decision_quality=path["decision_quality"],
    )


# ---------------------------------------------------------------------- through the gRPC contract


class _FakeWorker(worker_pb2_grpc.WorkerServiceServicer):
    """The bench client's stand-in for the workers: ``SubscribeKvEvents`` for the simulated engines.

    The router process subscribes to it with its real ingest feeds (``kvmesh_router.ingest.Ingest``), so
    KV events reach the router over gRPC streams exactly as a worker's do, while the engine simulation
    itself (LRU caches, event encoding) runs in the client process, not on the router's loop.
    """

    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet
        self.queues: dict[int, list[asyncio.Queue[bytes]]] = {e: [] for e in fleet.engines}

    def publish(self, engine_id: int, seq_hashes: list[int]) -> None:
        raw = self.fleet.serve(engine_id, seq_hashes)
        if raw is not None:
            for queue in self.queues[engine_id]:
                queue.put_nowait(raw)

    async def SubscribeKvEvents(self, request: Any, context: Any) -> Any:

        queue: asyncio.Queue[bytes] = asyncio.Queue()
        self.queues[request.engine_id].append(queue)
        try:
            if not request.HasField("start_event_id"):  # the caches are empty when the router subscribes
                snap = kv_events_pb2.KvIndexSnapshot(next_event_id=self.fleet.next_id[request.engine_id])
                yield worker_pb2.SubscribeKvEventsResponse(snapshot=snap)
            while True:
                batch = kv_events_pb2.KvEventBatch.FromString(await queue.get())
                yield worker_pb2.SubscribeKvEventsResponse(events=batch)
        finally:
            self.queues[request.engine_id].remove(queue)


def _server_process(conn: Any, args: dict[str, Any]) -> None:
    import uvloop

    uvloop.run(_serve(conn, args))


async def _serve(conn: Any, args: dict[str, Any]) -> None:
    """The router side: RouterState + the real ingest feeds + RouterServicer on loopback (uvloop)."""
    import grpc
    from kvmesh.grpc_options import CLIENT_OPTIONS, SERVER_OPTIONS
    from kvmesh_router.ingest import Ingest
    from kvmesh_router.service import RouterServicer, add_to_server

    ids = engine_ids(args["engines"])
    state = make_state(ids, args["block_size"], args["capacity"], args["seed"])
    channel = grpc.aio.insecure_channel(args["worker"], options=CLIENT_OPTIONS)
    assert state.kv_index is not None
    ingest = Ingest(state.kv_index, lambda _address: channel)
    for e in ids:
        ingest.add(e, args["worker"])
    await ingest.wait_restored(ids, 30)
    decide_s: list[float] = []
    observe = state.metrics.observe_decision

    def timed_observe(mode: str, outcome: str, seconds: float, overlap: int = 0, best: int = 0) -> None:
        if outcome == "routed":
            decide_s.append(seconds)
        observe(mode, outcome, seconds, overlap, best)

    state.metrics.observe_decision = timed_observe  # type: ignore[method-assign]  # the bench times decisions here
    server = grpc.aio.server(options=SERVER_OPTIONS)
    add_to_server(RouterServicer(state), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    conn.send(port)
    loop = asyncio.get_running_loop()
    while True:
        command = await loop.run_in_executor(None, conn.recv)
        if command == "measure":  # warm-up done: a daemon freezes its long-lived state after warming up
            gc.collect()
            gc.freeze()
            decide_s.clear()
            conn.send("ok")
        else:
            break
    us = [x * 1e6 for x in decide_s]
    conn.send(
        {
            "events_applied": ingest.stats.events,
            "index_entries": state.kv_index.size,
            "decide_p50_us": percentile(us, 50, method="nearest", empty=0.0),
            "decide_p99_us": percentile(us, 99, method="nearest", empty=0.0),
        }
    )
    await server.stop(None)
    await ingest.close()
    await channel.close()


async def _client(conn: Any, worker: _FakeWorker, warm: list[Request], measured: list[Request], window: int) -> dict:
    """The frontend side (plus the engines): warm-up, sequential round trips, pipelined throughput."""
    import grpc
    from kvmesh.grpc_options import CLIENT_OPTIONS

    from kvmesh_bench.streams import drain, read_message

    loop = asyncio.get_running_loop()
    port = await loop.run_in_executor(None, conn.recv)
    finished = router_pb2.LIFECYCLE_STAGE_FINISHED
    clock = time.perf_counter

    def query(tag: str, i: int, request: Request, model: str = MODEL) -> router_pb2.SessionRequest:
        _, isl, seq = request
        return router_pb2.SessionRequest(
            route=router_pb2.RouteQuery(request_id=f"{tag}{i}", model=model, block_hashes=seq, num_tokens=isl)
        )

    def lifecycle(request_id: str) -> router_pb2.SessionRequest:
        return router_pb2.SessionRequest(lifecycle=router_pb2.LifecycleUpdate(request_id=request_id, stage=finished))

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CLIENT_OPTIONS) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        outcomes: dict[str, int] = {}

        async def sequential(tag: str, requests: list[Request], model: str = MODEL) -> list[float]:
            call = stub.Session()
            rtts: list[float] = []
            for i, request in enumerate(requests):
                message = query(tag, i, request, model)
                t0 = clock()
                await call.write(message)
                response = await read_message(call, router_pb2.SessionResponse)
                rtts.append((clock() - t0) * 1e6)
                decision = response.decision
                if decision.outcome == router_pb2.DECISION_OUTCOME_ROUTED:
                    worker.publish(decision.engine_id, request[2])  # the engine caches the prompt
                    await call.write(lifecycle(decision.request_id))
                if tag == "q":
                    name = router_pb2.DecisionOutcome.Name(decision.outcome)
                    outcomes[name] = outcomes.get(name, 0) + 1
            await call.done_writing()
            await drain(call)
            return rtts

        await sequential("w", warm)
        await loop.run_in_executor(None, conn.send, "measure")
        await loop.run_in_executor(None, conn.recv)
        floor = await sequential("f", measured[: min(500, len(measured))], model="no-such-model")
        rtts = await sequential("q", measured)

        # pipelined: ``window`` queries in flight on one stream (one writer task: one write at a time)
        call = stub.Session()
        slots = asyncio.Semaphore(window)
        outgoing: asyncio.Queue[router_pb2.SessionRequest | None] = asyncio.Queue()

        async def writer() -> None:
            while (message := await outgoing.get()) is not None:
                await call.write(message)
            await call.done_writing()

        async def reader() -> None:
            for _ in measured:
                response = await read_message(call, router_pb2.SessionResponse)
                decision = response.decision
                worker.publish(decision.engine_id, by_id[decision.request_id])
                outgoing.put_nowait(lifecycle(decision.request_id))
                slots.release()

        by_id = {f"p{i}": request[2] for i, request in enumerate(measured)}
        t0 = clock()
        tasks = [loop.create_task(reader()), loop.create_task(writer())]
        for i, request in enumerate(measured):
            await slots.acquire()
            outgoing.put_nowait(query("p", i, request))
        await tasks[0]
        elapsed = clock() - t0
        outgoing.put_nowait(None)
        await tasks[1]
        await drain(call)
    return {"rtts": rtts, "floor": floor, "pipelined_per_s": len(measured) / elapsed, "outcomes": outcomes}


async def _grpc_client_side(
    parent: Any, requests: list[Request], warm: int, n_measured: int, args: argparse.Namespace
) -> tuple[dict, dict]:
    import grpc

    ids = engine_ids(args.grpc_engines)
    # the base's defaults answer UNIMPLEMENTED for the RPCs the router never calls here
    worker = _FakeWorker(SimFleet(ids, args.engine_capacity_blocks))  # type: ignore[abstract]
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, parent.send, f"127.0.0.1:{port}")
    try:
        client = await _client(parent, worker, requests[:warm], requests[warm : warm + n_measured], args.grpc_window)
        await loop.run_in_executor(None, parent.send, "stop")
        stats = await loop.run_in_executor(None, parent.recv) if parent.poll(30) else {}
    finally:
        await server.stop(None)
    return client, stats


def _server_bootstrap(conn: Any, args: dict[str, Any]) -> None:
    args["worker"] = conn.recv()
    _server_process(conn, args)


def run_grpc(requests: list[Request], args: argparse.Namespace) -> GrpcResult:
    import uvloop

    warm = min(len(requests) // 2, args.grpc_warm_requests)
    n_measured = min(args.grpc_requests, len(requests) - warm)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    server_args = {
        "engines": args.grpc_engines,
        "block_size": args.block_size,
        "capacity": args.engine_capacity_blocks,
        "seed": args.seed,
    }
    proc = ctx.Process(target=_server_bootstrap, args=(child, server_args), daemon=True)
    proc.start()
    try:
        client, server_stats = uvloop.run(_grpc_client_side(parent, requests, warm, n_measured, args))
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    rtts = client["rtts"]
    return GrpcResult(
        engines=args.grpc_engines,
        requests=n_measured,
        warm_requests=warm,
        rtt_p50_us=percentile(rtts, 50, method="nearest", empty=0.0),
        rtt_p99_us=percentile(rtts, 99, method="nearest", empty=0.0),
        rtt_max_us=max(rtts) if rtts else 0.0,
        floor_p50_us=percentile(client["floor"], 50, method="nearest", empty=0.0),
        floor_p99_us=percentile(client["floor"], 99, method="nearest", empty=0.0),
        server_decide_p50_us=float(server_stats.get("decide_p50_us", 0.0)),
        server_decide_p99_us=float(server_stats.get("decide_p99_us", 0.0)),
        pipelined_decisions_per_s=client["pipelined_per_s"],
        window=args.grpc_window,
        events_applied=int(server_stats.get("events_applied", 0)),
        outcomes=client["outcomes"],
    )


# ---------------------------------------------------------------------- report


_FLEET_COLUMNS = [
    ("engines", "engines", "{:d}"),
    ("events", "events", "{:d}"),
    ("indexer_events_per_s", "idx events/s", "{:,.0f}"),
    ("find_matches_per_s", "find/s", "{:,.0f}"),
    ("find_p50_us", "find p50 µs", "{:.1f}"),
    ("find_p99_us", "find p99 µs", "{:.1f}"),
    ("indexer_ops_per_s", "idx ops/s", "{:,.0f}"),
    ("decide_p50_us", "decide p50 µs", "{:.1f}"),
    ("decide_p99_us", "decide p99 µs", "{:.1f}"),
    ("decisions_per_s", "decisions/s", "{:,.0f}"),
    ("route_p50_us", "route p50 µs", "{:.1f}"),
    ("route_p99_us", "route p99 µs", "{:.1f}"),
    ("wire_events_per_s", "wire events/s", "{:,.0f}"),
    ("wire_blocks_per_s", "wire blocks/s", "{:,.0f}"),
]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = CommandParser(prog="kvmesh bench router", description=__doc__.split("\n\n")[0])
    mb.add_replay_args(p)
    p.add_argument(
        "--max-requests", type=non_negative_int, default=4000, help="trace requests replayed per fleet (0 = all)"
    )
    p.add_argument(
        "--grpc-engines", type=non_negative_int, default=8, help="fleet size of the gRPC measurement (0 = skip it)"
    )
    p.add_argument(
        "--grpc-requests", type=positive_int, default=2000, help="queries measured through the Session stream"
    )
    p.add_argument(
        "--grpc-warm-requests", type=positive_int, default=2000, help="requests that warm the server's index"
    )
    p.add_argument("--grpc-window", type=positive_int, default=32, help="queries in flight in the pipelined run")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="clock of the daemon-path timings: wall, or this thread's CPU time (robust on a shared machine)",
    )
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--json", type=output_file, default=None, help="write the results as JSON to this path")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # no C-core info lines (GOAWAY at teardown) in the report
    try:
        sizes = positive_ints(args.engines)
    except argparse.ArgumentTypeError as exc:
        print(f"--engines: {exc}", file=sys.stderr)
        return 2
    try:
        requests = mb.trace_requests(args.trace, args.max_requests or None, args.block_size)
    except TraceError as exc:
        print(f"kvmesh bench router: error: {exc}", file=sys.stderr)
        return 2
    if not requests:
        print(f"{args.trace}: no requests", file=sys.stderr)
        return 1
    random.seed(args.seed)
    fleets: list[FleetResult] = []
    for n in sizes:
        fleets.append(run_fleet(requests, n, args))
        print(f"... {n} engines done", file=sys.stderr, flush=True)
    grpc_result = None
    if args.grpc_engines > 0:
        grpc_result = run_grpc(requests, args)
        print("... gRPC session done", file=sys.stderr, flush=True)

    print(
        f"trace {args.trace.name}: {len(requests)} requests, {args.block_size}-token blocks, engine cache "
        f"{args.engine_capacity_blocks} blocks; in-process figures on one core (core: wall clock; route/wire: "
        f"{args.clock} clock)"
    )
    print(format_table([asdict(r) for r in fleets], _FLEET_COLUMNS))
    if grpc_result is not None:
        g = grpc_result
        print(
            f"\ngRPC Session stream ({g.engines} engines, {g.requests} queries after {g.warm_requests} warm-up, "
            f"{g.events_applied} KV events streamed to the router's ingest in all; outcomes {g.outcomes}):"
        )
        rows = [
            ("decision round trip (one in flight)", g.rtt_p50_us, g.rtt_p99_us),
            ("  of which deciding on the server", g.server_decide_p50_us, g.server_decide_p99_us),
            ("transport floor (unknown model)", g.floor_p50_us, g.floor_p99_us),
        ]
        for name, p50, p99 in rows:
            print(f"  {name:<38} p50 {p50:8.0f} µs   p99 {p99:8.0f} µs")
        print(f"  {'pipelined, ' + str(g.window) + ' in flight':<38} {g.pipelined_decisions_per_s:,.0f} decisions/s")
    goals = {
        "indexer_ops_per_s>=100k": all(r.indexer_ops_per_s >= 100_000 for r in fleets),
        "grpc_decision_p99<1ms@8": grpc_result is not None and grpc_result.rtt_p99_us < 1000,
    }
    print("goals: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in goals.items()))
    if args.json is not None:
        payload = {
            "benchmark": "router_bench",
            "trace": str(args.trace),
            "python": sys.version.split()[0],
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"},
            "fleets": [asdict(r) for r in fleets],
            "grpc": asdict(grpc_result) if grpc_result is not None else None,
            "goals": goals,
        }
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
