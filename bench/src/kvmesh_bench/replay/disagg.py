"""Offline replay of a disaggregated fleet: P prefill + D decode engines, same cores, same router core.

The aggregated replay (:mod:`kvmesh_bench.replay.offline`) is untouched; this is its P/D twin, built from
the same parts: every engine is an ``EngineCore``, the router is the daemon's ``Admission`` (its role
filter picks the pool), and the frontend's orchestration is mirrored step for step
(``kvmesh_frontend.disagg``):

1. at arrival, a decode engine is chosen (role ``decode``; its cached prefix counts in the cost);
2. if the prompt minus that prefix exceeds ``min_tokens`` and a prefill engine is routable, the prompt
   goes to a prefill engine with ``max_tokens=1`` (booked as ``id/prefill``); otherwise the decode engine
   prefills it locally;
3. when the prefill pass ends, the decode engine pins its own cached prefix and the prefill engine pins
   the prompt's blocks (the hold); the missing blocks then take ``missing x model bytes per block /
   gbps`` (the worker's modelled time; the real NIXL time on one host is far below it at these sizes);
4. at the transfer's end the blocks are stored on the decode engine (``EngineCore.pin_new``: KV events as
   a real pull causes), the hold is released, and the request joins the decode engine (its pins end
   there, as in the worker), where only the last partial block is computed.

TTFT is the decode engine's first token - arrival (the prefill's token is dropped, as live). ITL is the
decode engines' pass durations weighted by their decode tokens.

The pipeline is :class:`DisaggFleet`, whose pools may change while it runs: ``add_engine`` makes an engine
routable, ``drain_engine`` stops routing to one and records when its last request ends, and a
:class:`FleetControl` gets the loop at the times it asks for (the planner simulation,
``kvmesh_bench.planner_sim``, scales the pools from there). ``run_offline_disagg`` is the static fleet.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from kvmesh.hashing import block_hashes
from kvmesh_router.admission import BusyThresholds, Decision, EngineSpec, RouteRequest
from kvmesh_router.cost import RouterConfigOverride
from kvmesh_router.disagg import plan_prefill
from kvmesh_worker.engine import EngineCore, EngineError, EngineRequest, load_perf_model

from kvmesh_bench.replay.offline import HIT_SOURCE, OfflineConfig, SimRouter
from kvmesh_bench.replay.report import RunData
from kvmesh_bench.replay.workload import ReplayRequest, TokenMapper

__all__ = ["DisaggConfig", "DisaggFleet", "FleetControl", "run_offline_disagg"]

_DECODE = RouterConfigOverride(role="decode")
# kvmesh-mock's config.json (Llama-3-8B shaped): 32 layers x 2 x 8 KV heads x 128 x 2 bytes per token.
DEFAULT_MODEL_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    prefill_engines: int
    decode_engines: int
    transfer_gbps: float = 100.0
    min_tokens: int = 0
    model_bytes_per_token: int = DEFAULT_MODEL_BYTES_PER_TOKEN
    # The router daemon's default (--prefill-backlog-tokens): over it a prefill engine is busy, and when
    # every prefill engine is, the decode engine prefills locally. None: unbounded.
    prefill_backlog_tokens: int | None = 65536
    # Weight of the decode engine's cached prefix in the decode choice; None: the router's (kvmesh counts
    # it). 0 is Dynamo's decode router, which zeroes overlap credit on the decode side.
    decode_overlap_weight: float | None = None


class FleetControl(Protocol):
    """Called by :meth:`DisaggFleet.run` between events: after pass ends and transfers due at the same time,
    before arrivals due then."""

    def next_ms(self) -> float:
        """Virtual time of the next control event (inf: none)."""
        ...

    def on_event(self, now_ms: float) -> None: ...


class DisaggFleet:
    """P prefill + D decode engine cores behind the router core, replaying ``requests`` in virtual time."""

    def __init__(
        self,
        requests: Sequence[ReplayRequest],
        config: OfflineConfig,
        disagg: DisaggConfig,
        mapper: TokenMapper | None = None,
    ) -> None:
        self.requests = requests
        self.config = config
        self.disagg = disagg
        self.mapper = mapper or TokenMapper(vocab_size=config.vocab_size, seed=config.seed)
        self.econf = config.engine_config()
        self.perf = load_perf_model(config.perf_model)
        self.router = SimRouter(config.policy(), config.seed)
        self.admission = self.router.admission
        self.decode_override = _DECODE
        if disagg.decode_overlap_weight is not None:
            self.decode_override = RouterConfigOverride(
                role="decode", overlap_score_weight=disagg.decode_overlap_weight
            )
        self.admission.thresholds = BusyThresholds(prefill_backlog_tokens=disagg.prefill_backlog_tokens)
        self.bs = self.econf.block_size
        self.bytes_per_block = disagg.model_bytes_per_token * self.bs
        gbps = disagg.transfer_gbps
        self.ms_per_block = self.bytes_per_block / (gbps * 1e9) * 1e3 if gbps > 0 else 0.0
        self.cores: list[EngineCore] = []
        self.roles: list[str] = []
        self.routable: list[bool] = []
        self.draining: list[bool] = []
        self.stopped_ms: list[float | None] = []
        n = len(requests)
        self.arrival = np.array([r.arrival_ms for r in requests], dtype=float)
        self.first = np.full(n, math.nan)
        self.finish = np.full(n, math.nan)
        self.engine_of = np.full(n, -1, dtype=np.int64)
        self.cached = np.zeros(n, dtype=np.int64)
        self.remote = np.zeros(n, dtype=bool)
        self.moved_blocks = np.zeros(n, dtype=np.int64)
        self.offered_blocks = np.zeros(n, dtype=np.int64)
        self.slot_of: dict[str, int] = {}
        self.errors: list[str] = []
        self.itl_d: list[float] = []
        self.itl_w: list[int] = []
        self.finished: list[int] = []
        """Indices of requests finished since the control last cleared it."""
        self.arrived = 0
        """Requests that arrived so far (they arrive in order)."""
        self._pending: list[object] = []
        self._busy: list[bool] = []
        self._passes: list[tuple[float, int, int]] = []  # (pass end, seq, engine)
        self._transfers: list[tuple[float, int, int]] = []  # (transfer end, seq, request index)
        # Per request in flight on the P/D path: tokens, hashes, decode engine, prefill engine.
        self._plan: dict[int, tuple[np.ndarray, list[int], list[int], int, int]] = {}
        self._decode_pins: dict[str, list[int]] = {}
        self._seq = 0

    def add_engine(self, role: str) -> int:
        """A new engine of ``role`` (prefill or decode), routable at once; returns its id."""
        e = len(self.cores)
        self.cores.append(EngineCore(self.econf, self.perf))
        self.roles.append(role)
        self.routable.append(True)
        self.draining.append(False)
        self.stopped_ms.append(None)
        self._pending.append(None)
        self._busy.append(False)
        econf = self.econf
        self.admission.add_engine(
            EngineSpec(e, econf.num_gpu_blocks, econf.block_size, econf.max_num_batched_tokens, role=role)
        )
        self.router.index.add_engine(e)
        return e

    def drain_engine(self, e: int, now_ms: float) -> None:
        """Stop routing to ``e``; its requests (and those whose prefill it awaits) finish, then it stops."""
        if self.draining[e]:
            return
        self.draining[e] = True
        self.routable[e] = False
        self.admission.remove_engine(e)
        self.router.index.remove_engine(e)
        self._maybe_stop(e, now_ms)

    def in_flight(self) -> int:
        return len(self.slot_of) + len(self._plan)

    def _maybe_stop(self, e: int, now: float) -> None:
        if not self.draining[e] or self.stopped_ms[e] is not None or self.cores[e].has_unfinished():
            return
        if any(p[3] == e for p in self._plan.values()):
            return  # a request routed here is still being prefilled elsewhere
        self.stopped_ms[e] = now

    def _start_pass(self, e: int, now: float) -> None:
        out = self.cores[e].step()
        self._pending[e] = out
        self._seq += 1
        heapq.heappush(self._passes, (now + out.metrics.duration_ms, self._seq, e))

    def _submit(self, e: int, rid: str, tokens: np.ndarray, max_tokens: int, now: float) -> bool:
        try:
            self.cores[e].add_request(EngineRequest(rid, tokens, max_tokens, ignore_eos=True))
        except EngineError as exc:
            self.errors.append(f"{rid}: engine {e} rejected it: {exc}")
            return False
        if not self._busy[e]:
            self._busy[e] = True
            self._start_pass(e, now)
        return True

    def run(self, control: FleetControl | None = None) -> None:
        """Replay every request to its end (and the control's events until it has none)."""
        requests, admission, cores = self.requests, self.admission, self.cores
        apply_event = self.router.index.apply_event
        passes, transfers, plan, slot_of = self._passes, self._transfers, self._plan, self.slot_of
        arrival, first, finish = self.arrival, self.first, self.finish
        bs, ms_per_block, mapper = self.bs, self.ms_per_block, self.mapper
        n = len(requests)
        inf = math.inf
        i = 0
        while True:
            ta = arrival[i] if i < n else inf
            tp = passes[0][0] if passes else inf
            tx = transfers[0][0] if transfers else inf
            tc = control.next_ms() if control is not None else inf
            if tp <= ta and tp <= tx and tp <= tc and passes:
                t, _, e = heapq.heappop(passes)
                out = self._pending[e]
                self._pending[e] = None
                if self.routable[e]:
                    for ev in out.kv_events:  # type: ignore[attr-defined]
                        apply_event(e, ev)
                core = cores[e]
                for o in out.outputs:  # type: ignore[attr-defined]
                    rid = o.request_id
                    if rid.endswith("/prefill"):  # a prefill leg ended: hold, then transfer
                        k = slot_of.pop(rid)
                        admission.mark_prefill_completed(rid)
                        admission.free(rid)
                        tokens, local, hashes, d, _ = plan[k]
                        held = core.pin_cached_prefix(hashes, local, len(hashes))
                        have = cores[d].pin_cached_prefix(hashes, local, held)
                        plan[k] = (tokens, local, hashes[:held], d, e)
                        self._decode_pins[requests[k].request_id] = hashes[:have]
                        self.moved_blocks[k] = held - have
                        self.offered_blocks[k] = held
                        self._seq += 1
                        heapq.heappush(transfers, (t + (held - have) * ms_per_block, self._seq, k))
                        continue
                    k = slot_of[rid]
                    if math.isnan(first[k]):
                        first[k] = t
                        self.cached[k] = o.num_cached_prompt_tokens or 0
                        admission.mark_prefill_completed(rid)
                    if o.finished:
                        finish[k] = t
                        admission.free(rid)
                        del slot_of[rid]
                        self.finished.append(k)
                m = out.metrics  # type: ignore[attr-defined]
                is_decode = self.roles[e] == "decode"
                if is_decode and m.num_decode_requests:
                    self.itl_d.append(m.duration_ms)
                    self.itl_w.append(m.num_decode_requests)
                if core.has_unfinished():
                    horizon = min(ta, transfers[0][0] if transfers else inf, tc)
                    if horizon > t:
                        running = len(core.scheduler.running)
                        k_passes, total = core.fast_forward(1 << 30, horizon - t)
                        if k_passes:
                            if is_decode:
                                self.itl_d.append(total / k_passes)
                                self.itl_w.append(k_passes * running)
                            t += total
                    self._start_pass(e, t)
                else:
                    self._busy[e] = False
                    self._maybe_stop(e, t)
                continue
            if tx <= ta and tx <= tc and transfers:
                t, _, k = heapq.heappop(transfers)
                tokens, local, blocks, d, p = plan.pop(k)
                rid = requests[k].request_id
                have = len(self._decode_pins[rid])
                try:
                    cores[d].pin_new(blocks, local, have, len(blocks))
                    self._decode_pins[rid] = blocks
                except EngineError:
                    pass  # no room: the decode engine computes what it lacks (as a failed pull + local prefill)
                cores[p].unpin(blocks)
                ok = self._submit(d, rid, tokens, requests[k].max_tokens, t)
                cores[d].unpin(self._decode_pins.pop(rid))  # as the worker: pins end once the request is queued
                if not ok:
                    admission.free(rid)
                    self._maybe_stop(d, t)
                    continue
                slot_of[rid] = k
                continue
            if tc <= ta and control is not None and tc < inf:
                control.on_event(tc)
                continue
            if i >= n:
                break
            req = requests[i]
            k = i
            i += 1
            self.arrived = i
            tokens = req.prompt(mapper)
            local, hashes = block_hashes(tokens, bs)
            decode_request = RouteRequest(
                req.request_id, hashes, int(tokens.size), req.max_tokens, override=self.decode_override
            )
            decision = admission.decide(decode_request, now=ta / 1000.0)
            if not isinstance(decision, Decision):
                self.errors.append(f"{req.request_id}: not routed ({decision.message})")
                continue
            d = decision.engine_id
            self.engine_of[k] = d
            # The router's own policy (kvmesh_router.disagg), as the live router decides it.
            if any(r and role == "prefill" for r, role in zip(self.routable, self.roles, strict=True)):
                pd = plan_prefill(
                    admission, decode_request, decision, bs, self.disagg.min_tokens, frozenset(), ta / 1000.0
                ).decision
                if pd is not None:
                    prefill_id = pd.request_id
                    plan[k] = (tokens, local, hashes, d, pd.engine_id)
                    self.remote[k] = True
                    if self._submit(pd.engine_id, prefill_id, tokens, 1, ta):
                        slot_of[prefill_id] = k
                        continue
                    admission.free(prefill_id)
                    plan.pop(k)
                    self.remote[k] = False
            if self._submit(d, req.request_id, tokens, req.max_tokens, ta):
                slot_of[req.request_id] = k
            else:
                admission.free(req.request_id)


def run_offline_disagg(
    requests: Sequence[ReplayRequest],
    config: OfflineConfig,
    disagg: DisaggConfig,
    mapper: TokenMapper | None = None,
    label: str = "",
) -> RunData:
    """Replay ``requests`` through P prefill + D decode simulated engines; see the module docstring."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    fleet = DisaggFleet(requests, config, disagg, mapper)
    n_p, n_d = disagg.prefill_engines, disagg.decode_engines
    for _ in range(n_d):  # engines 0..D-1 decode, D..D+P-1 prefill
        fleet.add_engine("decode")
    for _ in range(n_p):
        fleet.add_engine("prefill")
    fleet.run()
    n = len(requests)
    inputs = np.array([r.input_length for r in requests], dtype=np.int64)
    return RunData(
        label=label or f"{n_p}P{n_d}D",
        kind="offline",
        arrival_ms=fleet.arrival,
        first_token_ms=fleet.first,
        finish_ms=fleet.finish,
        engine=fleet.engine_of,
        input_tokens=inputs,
        output_tokens=np.array([r.max_tokens for r in requests], dtype=np.int64),
        cached_tokens=fleet.cached,
        itl_ms=np.array(fleet.itl_d, dtype=float),
        itl_weight=np.array(fleet.itl_w, dtype=float),
        engines=n_p + n_d,
        hit_source=HIT_SOURCE,
        errors=fleet.errors,
        meta={
            "config": config.as_dict(),
            "disagg": {
                "prefill_engines": n_p,
                "decode_engines": n_d,
                "transfer_gbps": disagg.transfer_gbps,
                "min_tokens": disagg.min_tokens,
                "prefill_backlog_tokens": disagg.prefill_backlog_tokens,
                "model_bytes_per_block": fleet.bytes_per_block,
                "remote_prefill_fraction": float(fleet.remote.mean()) if n else 0.0,
                "transferred_blocks": int(fleet.moved_blocks.sum()),
                "pull_everything_blocks": int(fleet.offered_blocks.sum()),
            },
            "cpu_s": time.process_time() - cpu0,
            "wall_s": time.perf_counter() - wall0,
        },
    )
