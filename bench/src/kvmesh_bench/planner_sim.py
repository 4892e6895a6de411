"""Offline planner simulation: the planner's real decision code in the loop of the offline replay.

The fleet is the offline replay's (``kvmesh_bench.replay.offline``: real ``EngineCore``s and the real router
core, virtual time), except that its size changes: every ``interval_s`` the simulation builds an
``Observation`` exactly as the daemon would (each ready engine's load, the last interval's arrivals, ISL,
OSL and the mean TTFT / ITL of the requests that finished in it), asks ``kvmesh_planner.core.PlannerCore``
for a decision and publishes it through the virtual connector's ``VirtualState``; the simulation is the
outside orchestrator: it starts engines that become routable ``engine_startup_s`` later, drains the
least-loaded ones on a scale-down (removed from the router at once, stopped when their last request ends)
and acknowledges the decision when it is carried out.

``run_planner_sim_disagg`` is the same loop over the offline P/D pipeline
(``kvmesh_bench.replay.disagg.DisaggFleet``: prefill -> KV transfer -> decode, the router's own P/D policy):
the planner manages the prefill and decode pools, each engine observed in its pool, and every pool is
grown with the start-up delay and shrunk by draining, as above.

Figures: SLA attainment (share of requests with TTFT <= target and mean ITL <= target; an unserved request
misses), engine-seconds (each engine from the moment it is asked for, start-up included, to the moment it
stops, or the end of the run), scaling events, and pool size / latency over time for the plots.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from kvmesh.hashing import block_hashes
from kvmesh.v1 import planner_pb2
from kvmesh_planner.connectors.virtual import VirtualState, pool_sizes
from kvmesh_planner.core import (
    EngineObservation,
    EngineShape,
    Observation,
    PlannerConfig,
    PlannerCore,
    TrafficObservation,
    load_profile,
)
from kvmesh_planner.core.model import Pool
from kvmesh_router.admission import Admission, BusyThresholds, Decision, EngineSpec, RouteRequest
from kvmesh_router.indexer import KvIndexer
from kvmesh_router.slot_tracker import DEFAULT_EXPIRY_S, SlotTracker
from kvmesh_worker.engine import EngineCore, EngineError, EngineRequest, load_perf_model
from kvmesh_worker.engine.perf_model import PolynomialPerfModel

from kvmesh_bench.replay.disagg import DisaggConfig, DisaggFleet
from kvmesh_bench.replay.offline import OfflineConfig
from kvmesh_bench.replay.workload import ReplayRequest, TokenMapper

__all__ = ["SimResult", "mocker_profile_arrays", "run_planner_sim", "run_planner_sim_disagg"]


@dataclass
class SimResult:
    label: str
    ttft_ms: np.ndarray
    itl_ms: np.ndarray
    served: np.ndarray
    arrival_ms: np.ndarray
    engine_seconds: float
    duration_s: float
    scaling_events: int
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t s, ready, asked-for)
    decisions: list[str] = field(default_factory=list)
    cpu_s: float = 0.0
    pool_timelines: dict[str, list[tuple[float, int, int]]] = field(default_factory=dict)
    """Disaggregated runs: per pool (t s, ready, asked-for)."""
    pool_engine_seconds: dict[str, float] = field(default_factory=dict)

    def attainment(self, ttft_ms: float, itl_ms: float) -> float:
        ok = self.served & (self.ttft_ms <= ttft_ms) & (self.itl_ms <= itl_ms)
        return float(ok.mean()) if ok.size else 0.0

    def summary(self, ttft_ms: float, itl_ms: float) -> dict[str, object]:
        served = self.served
        return {
            "label": self.label,
            "sla_attainment": self.attainment(ttft_ms, itl_ms),
            "engine_seconds": self.engine_seconds,
            "scaling_events": self.scaling_events,
            "requests": int(served.size),
            "failed": int((~served).sum()),
            "ttft_p50_ms": float(np.nanpercentile(self.ttft_ms[served], 50)) if served.any() else math.nan,
            "ttft_p95_ms": float(np.nanpercentile(self.ttft_ms[served], 95)) if served.any() else math.nan,
            "itl_p95_ms": float(np.nanpercentile(self.itl_ms[served], 95)) if served.any() else math.nan,
            "duration_s": self.duration_s,
            "cpu_s": self.cpu_s,
            **({"pool_engine_seconds": self.pool_engine_seconds} if self.pool_engine_seconds else {}),
        }


def mocker_profile_arrays(total_kv_tokens: int = 16384 * 64) -> dict[str, np.ndarray]:
    """The mocker's default polynomial perf model sampled into the NPZ profile format (the planner ships this)."""
    m = PolynomialPerfModel()
    isl = np.unique(np.concatenate([np.arange(0, 1025, 32), np.arange(1024, 16385, 256)])).astype(float)
    kv = np.linspace(0, total_kv_tokens, 65)
    ctx = np.array([1.0, 131072.0])
    return {
        "prefill_isl": isl,
        "prefill_ttft_ms": np.array([m.prefill_ms(int(t)) for t in isl]),
        "decode_active_kv_tokens": kv,
        "decode_context_length": ctx,
        "decode_itl": np.array([[m.decode_ms(int(k), total_kv_tokens, c) for c in ctx] for k in kv]),
    }


@dataclass
class _Engine:
    eid: int
    core: EngineCore
    asked_s: float
    ready_s: float
    ready: bool = False
    draining: bool = False
    stopped_s: float | None = None
    busy: bool = False
    pending: object = None


def run_planner_sim(
    requests: Sequence[ReplayRequest],
    fleet: OfflineConfig,
    planner: PlannerConfig | None,
    *,
    static_engines: int = 1,
    initial_engines: int = 1,
    engine_startup_s: float = 30.0,
    profile: str | None = None,
    label: str = "",
) -> SimResult:
    """Replay ``requests`` on a fleet sized by ``planner`` (None: ``static_engines`` engines throughout)."""
    cpu0 = time.process_time()
    mapper = TokenMapper(vocab_size=fleet.vocab_size, seed=fleet.seed)
    econf = fleet.engine_config()
    bs = econf.block_size
    index = KvIndexer(max_entries=None)
    slots = SlotTracker(16, expiry_s=DEFAULT_EXPIRY_S)
    rng = random.Random(fleet.seed)
    admission = Admission(index, slots, config=fleet.policy(), thresholds=BusyThresholds(), rng=rng)
    perf = load_perf_model(fleet.perf_model)
    shape = EngineShape(
        total_kv_tokens=econf.num_gpu_blocks * bs,
        max_num_seqs=econf.max_num_seqs,
        max_num_batched_tokens=econf.max_num_batched_tokens,
        context_length=econf.num_gpu_blocks * bs,
    )
    core: PlannerCore | None = None
    virtual = VirtualState()
    if planner is not None:
        from dataclasses import replace

        planner = replace(planner, shape=shape)
        core = PlannerCore(planner, load_profile(profile) if planner.mode == "sla" else None)

    engines: dict[int, _Engine] = {}
    next_eid = 0

    def ask_engine(now_s: float, delay_s: float) -> None:
        nonlocal next_eid
        e = _Engine(next_eid, EngineCore(econf, perf), asked_s=now_s, ready_s=now_s + delay_s)
        engines[next_eid] = e
        next_eid += 1
        if delay_s <= 0:
            make_ready(e)

    def make_ready(e: _Engine) -> None:
        e.ready = True
        admission.add_engine(EngineSpec(e.eid, econf.num_gpu_blocks, bs, econf.max_num_batched_tokens))
        index.add_engine(e.eid)

    count0 = static_engines if core is None else initial_engines
    for _ in range(count0):
        ask_engine(0.0, 0.0)

    n = len(requests)
    arrival = np.array([r.arrival_ms for r in requests], dtype=float)
    first = np.full(n, math.nan)
    finish = np.full(n, math.nan)
    slot_of: dict[str, int] = {}
    heap: list[tuple[float, int, int]] = []
    seq = 0
    inf = math.inf
    interval_ms = (planner.interval_s if planner else 10.0) * 1000.0
    next_tick = interval_ms if core is not None else inf
    tick_start_i = 0
    finished_in_tick: list[int] = []
    timeline: list[tuple[float, int, int]] = [(0.0, count0, count0)]
    decisions: list[str] = []
    events = 0

    def start_pass(e: _Engine, now: float) -> None:
        nonlocal seq
        out = e.core.step()
        e.pending = out
        seq += 1
        heapq.heappush(heap, (now + out.metrics.duration_ms, seq, e.eid))

    def maybe_stop(e: _Engine, now: float) -> None:
        if e.draining and e.stopped_s is None and not e.core.has_unfinished():
            e.stopped_s = now / 1000.0

    def next_ready_ms() -> float:
        waits = [e.ready_s * 1000.0 for e in engines.values() if not e.ready and not e.draining]
        return min(waits) if waits else inf

    def tick(now: float) -> None:
        nonlocal tick_start_i, events
        assert core is not None and planner is not None
        now_s = now / 1000.0
        i_end = int(np.searchsorted(arrival, now, side="right"))
        batch = requests[tick_start_i:i_end]
        tick_start_i = i_end
        done = finished_in_tick[:]
        finished_in_tick.clear()
        ttfts = [first[k] - arrival[k] for k in done]
        itls = [(finish[k] - first[k]) / (requests[k].max_tokens - 1) for k in done if requests[k].max_tokens > 1]
        traffic = TrafficObservation(
            interval_s=planner.interval_s,
            requests=len(batch),
            mean_isl=float(np.mean([r.input_length for r in batch])) if batch else 0.0,
            mean_osl=float(np.mean([r.max_tokens for r in batch])) if batch else 0.0,
            ttft_ms=float(np.mean(ttfts)) if ttfts else None,
            itl_ms=float(np.mean(itls)) if itls else None,
        )
        obs_engines = []
        for e in engines.values():
            if e.ready and not e.draining:
                ld = e.core.load()
                obs_engines.append(
                    EngineObservation(
                        e.eid,
                        "aggregated",
                        ld.active_blocks * bs,
                        econf.num_gpu_blocks * bs,
                        ld.queued_prefill_tokens,
                        shape.context_length,
                        ld.num_running,
                        ld.num_waiting,
                    )
                )
        live = [e for e in engines.values() if not e.draining]
        starting = sum(1 for e in live if not e.ready)
        obs = Observation(now_s, tuple(obs_engines), {"aggregated": len(live)}, {"aggregated": starting}, traffic)
        decision = core.decide(obs)
        virtual.publish(decision.decision_id, decision.target, now_s)
        if decision.changed:
            events += 1
            decisions.append(f"t={now_s:.0f}s {decision.log_line()}")
            want = decision.target["aggregated"]
            if want > len(live):
                for _ in range(want - len(live)):
                    ask_engine(now_s, engine_startup_s)
            else:
                # Drain the least loaded: not-ready ones first, then by KV utilization + queue.
                order = sorted(live, key=lambda e: (e.ready, e.core.load().active_blocks + e.core.load().num_waiting))
                for e in order[: len(live) - want]:
                    e.draining = True
                    if e.ready:
                        admission.remove_engine(e.eid)
                        index.remove_engine(e.eid)
                    maybe_stop(e, now)
                    if not e.ready:
                        e.stopped_s = now_s
        live = [e for e in engines.values() if not e.draining]
        actual = pool_sizes({"aggregated": len(live)})
        virtual.acknowledge(planner_pb2.PlannerTargetsAck(decision_id=decision.decision_id, actual=actual))
        timeline.append((now_s, sum(1 for e in live if e.ready), len(live)))

    i = 0
    while True:
        ta = arrival[i] if i < n else inf
        tr = next_ready_ms()
        th = heap[0][0] if heap else inf
        t_next = min(ta, tr, th, next_tick)
        if t_next == inf or (i >= n and not heap and not slot_of):
            break
        if th == t_next:
            t, _, eid = heapq.heappop(heap)
            e = engines[eid]
            out = e.pending
            e.pending = None
            for ev in out.kv_events:  # type: ignore[attr-defined]
                if e.ready and not e.draining:
                    index.apply_event(eid, ev)
            for o in out.outputs:  # type: ignore[attr-defined]
                k = slot_of[o.request_id]
                if math.isnan(first[k]):
                    first[k] = t
                    admission.mark_prefill_completed(o.request_id)
                if o.finished:
                    finish[k] = t
                    admission.free(o.request_id)
                    del slot_of[o.request_id]
                    finished_in_tick.append(k)
            if e.core.has_unfinished():
                horizon = min(ta, next_tick, tr)
                if horizon > t:
                    k_passes, total = e.core.fast_forward(1 << 30, horizon - t)
                    if k_passes:
                        t += total
                start_pass(e, t)
            else:
                e.busy = False
                maybe_stop(e, t)
            continue
        if tr == t_next:
            for e in engines.values():
                if not e.ready and not e.draining and e.ready_s * 1000.0 <= tr:
                    make_ready(e)
            continue
        if next_tick == t_next:
            if i >= n and not slot_of:
                next_tick = inf
                continue
            tick(next_tick)
            next_tick += interval_ms
            continue
        req = requests[i]
        i += 1
        tokens = req.prompt(mapper)
        hashes = block_hashes(tokens, bs)[1]
        decision = admission.decide(
            RouteRequest(req.request_id, hashes, int(tokens.size), req.max_tokens), now=ta / 1000.0
        )
        if not isinstance(decision, Decision):
            continue
        e = engines[decision.engine_id]
        try:
            e.core.add_request(EngineRequest(req.request_id, tokens, req.max_tokens, ignore_eos=True))
        except EngineError:
            admission.free(req.request_id)
            continue
        slot_of[req.request_id] = i - 1
        if not e.busy:
            e.busy = True
            start_pass(e, ta)

    end_s = float(np.nanmax(finish) / 1000.0) if n and not np.all(np.isnan(finish)) else 0.0
    end_s = max(end_s, float(arrival[-1]) / 1000.0 if n else 0.0)
    engine_seconds = sum(
        max(0.0, min(e.stopped_s if e.stopped_s is not None else end_s, end_s) - e.asked_s) for e in engines.values()
    )
    served = ~np.isnan(finish)
    out_len = np.array([r.max_tokens for r in requests], dtype=float)
    itl = np.where(out_len > 1, (finish - first) / np.maximum(1.0, out_len - 1), 0.0)
    return SimResult(
        label=label or (f"planner:{planner.mode}" if planner else f"static {static_engines}"),
        ttft_ms=np.where(served, first - arrival, math.inf),
        itl_ms=np.where(served, itl, math.inf),
        served=served,
        arrival_ms=arrival,
        engine_seconds=engine_seconds,
        duration_s=end_s,
        scaling_events=events,
        timeline=timeline,
        decisions=decisions,
        cpu_s=time.process_time() - cpu0,
    )


@dataclass
class _Slot:
    """One engine of a pool as the orchestrator sees it: asked for, then ready (an engine id), then draining."""

    pool: Pool
    asked_s: float
    ready_s: float
    eid: int | None = None
    draining: bool = False
    cancelled_s: float | None = None


class _PoolOrchestrator:
    """The virtual connector's outside orchestrator for a P/D fleet, and the planner's observer, in one.

    A :class:`kvmesh_bench.replay.disagg.FleetControl`: at every interval it builds the daemon's
    ``Observation`` (ready engines by pool, the interval's traffic and latency), runs ``PlannerCore.decide``,
    publishes the targets, and carries them out: new engines become routable ``startup_s`` later; a
    scale-down cancels engines still starting, then drains the least-loaded ready ones.
    """

    def __init__(
        self,
        fleet: DisaggFleet,
        core: PlannerCore | None,
        planner: PlannerConfig | None,
        initial: dict[Pool, int],
        startup_s: float,
        block_size: int,
        shape: EngineShape,
    ) -> None:
        self.fleet, self.core, self.planner = fleet, core, planner
        self.startup_s, self.bs, self.shape = startup_s, block_size, shape
        self.virtual = VirtualState()
        self.slots: list[_Slot] = []
        order: tuple[Pool, ...] = ("decode", "prefill")
        for pool in order:  # ids as in the static replay: decode engines first
            for _ in range(initial.get(pool, 0)):
                slot = _Slot(pool, 0.0, 0.0)
                slot.eid = fleet.add_engine(pool)
                self.slots.append(slot)
        self.interval_ms = planner.interval_s * 1000.0 if planner else math.inf
        self.next_tick = self.interval_ms
        self.tick_start = 0
        self.events = 0
        self.decisions: list[str] = []
        self.timeline: dict[str, list[tuple[float, int, int]]] = {"prefill": [], "decode": []}
        self._record(0.0)

    def _live(self, pool: str) -> list[_Slot]:
        return [s for s in self.slots if s.pool == pool and not s.draining]

    def _record(self, now_s: float) -> None:
        for pool, line in self.timeline.items():
            live = self._live(pool)
            line.append((now_s, sum(1 for s in live if s.eid is not None), len(live)))

    def _next_ready_ms(self) -> float:
        waits = [s.ready_s * 1000.0 for s in self.slots if s.eid is None and not s.draining]
        return min(waits) if waits else math.inf

    def next_ms(self) -> float:
        tick = self.next_tick
        if self.fleet.arrived >= len(self.fleet.requests) and not self.fleet.in_flight():
            tick = math.inf  # the trace is over: no more decisions
        return min(tick, self._next_ready_ms())

    def on_event(self, now_ms: float) -> None:
        if self._next_ready_ms() <= now_ms:
            for s in self.slots:
                if s.eid is None and not s.draining and s.ready_s * 1000.0 <= now_ms:
                    s.eid = self.fleet.add_engine(s.pool)
            return
        self._tick(now_ms)
        self.next_tick += self.interval_ms

    def _tick(self, now: float) -> None:
        assert self.core is not None and self.planner is not None
        fleet, bs, now_s = self.fleet, self.bs, now / 1000.0
        requests = fleet.requests
        batch = requests[self.tick_start : fleet.arrived]
        self.tick_start = fleet.arrived
        done = fleet.finished[:]
        fleet.finished.clear()
        first, finish, arrival = fleet.first, fleet.finish, fleet.arrival
        ttfts = [first[k] - arrival[k] for k in done]
        itls = [(finish[k] - first[k]) / (requests[k].max_tokens - 1) for k in done if requests[k].max_tokens > 1]
        traffic = TrafficObservation(
            interval_s=self.planner.interval_s,
            requests=len(batch),
            mean_isl=float(np.mean([r.input_length for r in batch])) if batch else 0.0,
            mean_osl=float(np.mean([r.max_tokens for r in batch])) if batch else 0.0,
            ttft_ms=float(np.mean(ttfts)) if ttfts else None,
            itl_ms=float(np.mean(itls)) if itls else None,
        )
        econf = fleet.econf
        observed = []
        for s in self.slots:
            if s.eid is not None and not s.draining:
                ld = fleet.cores[s.eid].load()
                observed.append(
                    EngineObservation(
                        s.eid,
                        s.pool,
                        ld.active_blocks * bs,
                        econf.num_gpu_blocks * bs,
                        ld.queued_prefill_tokens,
                        self.shape.context_length,
                        ld.num_running,
                        ld.num_waiting,
                    )
                )
        pools: tuple[Pool, ...] = ("prefill", "decode")
        actual = {p: len(self._live(p)) for p in pools}
        starting = {p: sum(1 for s in self._live(p) if s.eid is None) for p in pools}
        decision = self.core.decide(Observation(now_s, tuple(observed), actual, starting, traffic))
        self.virtual.publish(decision.decision_id, decision.target, now_s)
        if decision.changed:
            self.events += 1
            self.decisions.append(f"t={now_s:.0f}s {decision.log_line()}")
            for pool in pools:
                live = self._live(pool)
                want = decision.target.get(pool, len(live))
                if want > len(live):
                    for _ in range(want - len(live)):
                        self.slots.append(_Slot(pool, now_s, now_s + self.startup_s))
                    continue

                def load(s: _Slot) -> tuple[bool, int]:
                    if s.eid is None:
                        return (False, 0)
                    ld = fleet.cores[s.eid].load()
                    return (True, ld.active_blocks + ld.num_waiting)

                for s in sorted(live, key=load)[: len(live) - want]:  # starting ones first, then least loaded
                    s.draining = True
                    if s.eid is None:
                        s.cancelled_s = now_s
                    else:
                        fleet.drain_engine(s.eid, now)
        actual = {p: len(self._live(p)) for p in pools}
        ack = planner_pb2.PlannerTargetsAck(decision_id=decision.decision_id, actual=pool_sizes(actual))
        self.virtual.acknowledge(ack)
        self._record(now_s)

    def engine_seconds(self, end_s: float) -> dict[str, float]:
        out = {"prefill": 0.0, "decode": 0.0}
        for s in self.slots:
            if s.cancelled_s is not None:
                stop = s.cancelled_s
            elif s.eid is not None and self.fleet.stopped_ms[s.eid] is not None:
                stop = float(self.fleet.stopped_ms[s.eid]) / 1000.0  # type: ignore[arg-type]
            else:
                stop = end_s
            out[s.pool] += max(0.0, min(stop, end_s) - s.asked_s)
        return out


def run_planner_sim_disagg(
    requests: Sequence[ReplayRequest],
    fleet: OfflineConfig,
    disagg: DisaggConfig,
    planner: PlannerConfig | None,
    *,
    initial: tuple[int, int] = (1, 1),
    engine_startup_s: float = 30.0,
    profile: str | None = None,
    label: str = "",
) -> SimResult:
    """Replay ``requests`` on a P/D fleet: ``initial`` = (prefill, decode) engines, then sized by ``planner``
    (which must manage the prefill and decode pools), or static throughout when ``planner`` is None."""
    from dataclasses import replace

    cpu0 = time.process_time()
    pd = DisaggFleet(requests, fleet, disagg)
    econf = pd.econf
    bs = econf.block_size
    shape = EngineShape(
        total_kv_tokens=econf.num_gpu_blocks * bs,
        max_num_seqs=econf.max_num_seqs,
        max_num_batched_tokens=econf.max_num_batched_tokens,
        context_length=econf.num_gpu_blocks * bs,
    )
    core: PlannerCore | None = None
    if planner is not None:
        if set(planner.pools) != {"prefill", "decode"}:
            raise ValueError("a disaggregated simulation needs a planner managing the prefill and decode pools")
        planner = replace(planner, shape=shape)
        core = PlannerCore(planner, load_profile(profile) if planner.mode == "sla" else None)
    orch = _PoolOrchestrator(
        pd, core, planner, {"prefill": initial[0], "decode": initial[1]}, engine_startup_s, bs, shape
    )
    pd.run(orch if core is not None else None)
    n = len(requests)
    finish, first, arrival = pd.finish, pd.first, pd.arrival
    end_s = float(np.nanmax(finish) / 1000.0) if n and not np.all(np.isnan(finish)) else 0.0
    end_s = max(end_s, float(arrival[-1]) / 1000.0 if n else 0.0)
    per_pool = orch.engine_seconds(end_s)
    served = ~np.isnan(finish)
    out_len = np.array([r.max_tokens for r in requests], dtype=float)
    itl = np.where(out_len > 1, (finish - first) / np.maximum(1.0, out_len - 1), 0.0)
    lines = orch.timeline
    total = [(p[0], p[1] + d[1], p[2] + d[2]) for p, d in zip(lines["prefill"], lines["decode"], strict=True)]
    return SimResult(
        label=label or (f"planner:{planner.mode}" if planner else f"static {initial[0]}P+{initial[1]}D"),
        ttft_ms=np.where(served, first - arrival, math.inf),
        itl_ms=np.where(served, itl, math.inf),
        served=served,
        arrival_ms=arrival,
        engine_seconds=sum(per_pool.values()),
        duration_s=end_s,
        scaling_events=orch.events,
        timeline=total,
        decisions=orch.decisions,
        cpu_s=time.process_time() - cpu0,
        pool_timelines=lines,
        pool_engine_seconds=per_pool,
    )
