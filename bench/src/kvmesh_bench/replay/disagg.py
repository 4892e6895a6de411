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
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from kvmesh.hashing import block_hashes
from kvmesh_router.admission import BusyThresholds, Decision, EngineSpec, RouteRequest
from kvmesh_router.cost import RouterConfigOverride
from kvmesh_router.disagg import plan_prefill
from kvmesh_worker.engine import EngineCore, EngineError, EngineRequest, load_perf_model

from kvmesh_bench.replay.offline import HIT_SOURCE, OfflineConfig, SimRouter
from kvmesh_bench.replay.report import RunData
from kvmesh_bench.replay.workload import ReplayRequest, TokenMapper

__all__ = ["DisaggConfig", "run_offline_disagg"]

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


def run_offline_disagg(
    requests: Sequence[ReplayRequest],
    config: OfflineConfig,
    disagg: DisaggConfig,
    mapper: TokenMapper | None = None,
    label: str = "",
) -> RunData:
    """Replay ``requests`` through P prefill + D decode simulated engines; see the module docstring."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    mapper = mapper or TokenMapper(vocab_size=config.vocab_size, seed=config.seed)
    econf = config.engine_config()
    n_p, n_d = disagg.prefill_engines, disagg.decode_engines
    n_e = n_p + n_d
    cores = [EngineCore(econf, load_perf_model(config.perf_model)) for _ in range(n_e)]
    router = SimRouter(config.policy(), config.seed)
    roles = ["decode"] * n_d + ["prefill"] * n_p  # engines 0..D-1 decode, D..D+P-1 prefill
    for e in range(n_e):
        router.admission.add_engine(
            EngineSpec(e, econf.num_gpu_blocks, econf.block_size, econf.max_num_batched_tokens, role=roles[e])
        )
        router.index.add_engine(e)
    admission, apply_event = router.admission, router.index.apply_event
    decode_override = _DECODE
    if disagg.decode_overlap_weight is not None:
        decode_override = RouterConfigOverride(role="decode", overlap_score_weight=disagg.decode_overlap_weight)
    admission.thresholds = BusyThresholds(prefill_backlog_tokens=disagg.prefill_backlog_tokens)
    bs = econf.block_size
    bytes_per_block = disagg.model_bytes_per_token * bs
    ms_per_block = bytes_per_block / (disagg.transfer_gbps * 1e9) * 1e3 if disagg.transfer_gbps > 0 else 0.0

    n = len(requests)
    arrival = np.array([r.arrival_ms for r in requests], dtype=float)
    first = np.full(n, math.nan)
    finish = np.full(n, math.nan)
    engine_of = np.full(n, -1, dtype=np.int64)
    cached = np.zeros(n, dtype=np.int64)
    remote = np.zeros(n, dtype=bool)
    moved_blocks = np.zeros(n, dtype=np.int64)
    offered_blocks = np.zeros(n, dtype=np.int64)
    slot_of: dict[str, int] = {}
    errors: list[str] = []
    itl_d: list[float] = []
    itl_w: list[int] = []

    pending: list = [None] * n_e
    busy = [False] * n_e
    passes: list[tuple[float, int, int]] = []  # (pass end, seq, engine)
    transfers: list[tuple[float, int, int]] = []  # (transfer end, seq, request index)
    # Per request in flight on the P/D path: tokens, hashes, decode engine, prefill engine, decode pins.
    plan: dict[int, tuple[np.ndarray, list[int], list[int], int, int]] = {}
    decode_pins: dict[str, list[int]] = {}
    seq = 0
    inf = math.inf

    def start_pass(e: int, now: float) -> None:
        nonlocal seq
        out = cores[e].step()
        pending[e] = out
        seq += 1
        heapq.heappush(passes, (now + out.metrics.duration_ms, seq, e))

    def submit(e: int, rid: str, tokens: np.ndarray, max_tokens: int, now: float) -> bool:
        try:
            cores[e].add_request(EngineRequest(rid, tokens, max_tokens, ignore_eos=True))
        except EngineError as exc:
            errors.append(f"{rid}: engine {e} rejected it: {exc}")
            return False
        if not busy[e]:
            busy[e] = True
            start_pass(e, now)
        return True

    i = 0
    while True:
        ta = arrival[i] if i < n else inf
        tp = passes[0][0] if passes else inf
        tx = transfers[0][0] if transfers else inf
        if tp <= ta and tp <= tx and passes:
            t, _, e = heapq.heappop(passes)
            out = pending[e]
            pending[e] = None
            for ev in out.kv_events:
                apply_event(e, ev)
            core = cores[e]
            for o in out.outputs:
                rid = o.request_id
                if rid.endswith("/prefill"):  # a prefill leg ended: hold, then transfer
                    k = slot_of.pop(rid)
                    admission.mark_prefill_completed(rid)
                    admission.free(rid)
                    tokens, local, hashes, d, _ = plan[k]
                    held = core.pin_cached_prefix(hashes, local, len(hashes))
                    have = cores[d].pin_cached_prefix(hashes, local, held)
                    plan[k] = (tokens, local, hashes[:held], d, e)
                    decode_pins[requests[k].request_id] = hashes[:have]
                    moved_blocks[k] = held - have
                    offered_blocks[k] = held
                    seq += 1
                    heapq.heappush(transfers, (t + (held - have) * ms_per_block, seq, k))
                    continue
                k = slot_of[rid]
                if math.isnan(first[k]):
                    first[k] = t
                    cached[k] = o.num_cached_prompt_tokens or 0
                    admission.mark_prefill_completed(rid)
                if o.finished:
                    finish[k] = t
                    admission.free(rid)
                    del slot_of[rid]
            m = out.metrics
            if e < n_d and m.num_decode_requests:
                itl_d.append(m.duration_ms)
                itl_w.append(m.num_decode_requests)
            if core.has_unfinished():
                horizon = min(ta, transfers[0][0] if transfers else inf)
                if horizon > t:
                    running = len(core.scheduler.running)
                    k_passes, total = core.fast_forward(1 << 30, horizon - t)
                    if k_passes:
                        if e < n_d:
                            itl_d.append(total / k_passes)
                            itl_w.append(k_passes * running)
                        t += total
                start_pass(e, t)
            else:
                busy[e] = False
            continue
        if tx <= ta and transfers:
            t, _, k = heapq.heappop(transfers)
            tokens, local, blocks, d, p = plan.pop(k)
            rid = requests[k].request_id
            have = len(decode_pins[rid])
            try:
                cores[d].pin_new(blocks, local, have, len(blocks))
                decode_pins[rid] = blocks
            except EngineError:
                pass  # no room: the decode engine computes what it lacks (as a failed pull + local prefill)
            cores[p].unpin(blocks)
            ok = submit(d, rid, tokens, requests[k].max_tokens, t)
            cores[d].unpin(decode_pins.pop(rid))  # as the worker: pins end once the request is queued
            if not ok:
                admission.free(rid)
                continue
            slot_of[rid] = k
            continue
        if i >= n:
            break
        req = requests[i]
        k = i
        i += 1
        tokens = req.prompt(mapper)
        local, hashes = block_hashes(tokens, bs)
        decode_request = RouteRequest(
            req.request_id, hashes, int(tokens.size), req.max_tokens, override=decode_override
        )
        decision = admission.decide(decode_request, now=ta / 1000.0)
        if not isinstance(decision, Decision):
            errors.append(f"{req.request_id}: not routed ({decision.message})")
            continue
        d = decision.engine_id
        engine_of[k] = d
        if n_p:  # the router's own policy (kvmesh_router.disagg), as the live router decides it
            pd = plan_prefill(
                admission, decode_request, decision, bs, disagg.min_tokens, frozenset(), ta / 1000.0
            ).decision
            if pd is not None:
                prefill_id = pd.request_id
                plan[k] = (tokens, local, hashes, d, pd.engine_id)
                remote[k] = True
                if submit(pd.engine_id, prefill_id, tokens, 1, ta):
                    slot_of[prefill_id] = k
                    continue
                admission.free(prefill_id)
                plan.pop(k)
                remote[k] = False
        if submit(d, req.request_id, tokens, req.max_tokens, ta):
            slot_of[req.request_id] = k
        else:
            admission.free(req.request_id)

    inputs = np.array([r.input_length for r in requests], dtype=np.int64)
    return RunData(
        label=label or f"{n_p}P{n_d}D",
        kind="offline",
        arrival_ms=arrival,
        first_token_ms=first,
        finish_ms=finish,
        engine=engine_of,
        input_tokens=inputs,
        output_tokens=np.array([r.max_tokens for r in requests], dtype=np.int64),
        cached_tokens=cached,
        itl_ms=np.array(itl_d, dtype=float),
        itl_weight=np.array(itl_w, dtype=float),
        engines=n_e,
        hit_source=HIT_SOURCE,
        errors=errors,
        meta={
            "config": config.as_dict(),
            "disagg": {
                "prefill_engines": n_p,
                "decode_engines": n_d,
                "transfer_gbps": disagg.transfer_gbps,
                "min_tokens": disagg.min_tokens,
                "prefill_backlog_tokens": disagg.prefill_backlog_tokens,
                "model_bytes_per_block": bytes_per_block,
                "remote_prefill_fraction": float(remote.mean()) if n else 0.0,
                "transferred_blocks": int(moved_blocks.sum()),
                "pull_everything_blocks": int(offered_blocks.sum()),
            },
            "cpu_s": time.process_time() - cpu0,
            "wall_s": time.perf_counter() - wall0,
        },
    )
