"""Offline replay: a discrete-event simulation in virtual time over the real engine and router cores.

Nothing is re-implemented here. Every engine is a :class:`kvmesh_worker.engine.EngineCore` (the mocker
scheduler, block manager and perf model the worker daemon runs) and the router is the daemon's own
core, wired as :class:`kvmesh_router.state.RouterState` wires it: a :class:`~kvmesh_router.indexer.KvIndexer`
fed by the engines' KV events, a :class:`~kvmesh_router.slot_tracker.SlotTracker` and an
:class:`~kvmesh_router.admission.Admission` (select + book) with the configured
:class:`~kvmesh_router.cost.RouterPolicyConfig`. Only the transport is gone: no gRPC, no clock.

Virtual time follows the worker's real-time loop (``kvmesh_worker.engine_runner``) exactly:

- an idle engine starts a pass the moment a request arrives; a busy one runs passes back to back;
- a pass's state change happens when it starts (``step()``), but its tokens and KV events exist only
  when it ends, ``duration_ms`` later: requests that arrive meanwhile wait for the next pass;
- at a pass end the KV events reach the indexer (in event-id order), a request's first token marks
  its prefill completed in the slot tracker and its last one frees its booking, all before any
  arrival at the same instant is routed (the router sees the freshest state the daemons could);
- an arrival is routed (``Admission.decide``) and queued on the chosen engine at its trace time
  (timestamp / ``arrival_speedup``).

The engines report their KV changes through a :class:`~kvmesh_worker.engine.block_manager.KvSink` (plain
hashes, the same changes in the same order as their ``KvEvent`` journal) that the replay holds back until
the pass ends and then applies with the index's ``store_chain`` / ``remove``: the same index updates as
``apply_event``, without building an event object per pass and a StoredBlock per block.
A routing mode that reads neither the index nor the bookings (``round_robin``, ``random``: their
selectors say ``reads_cache = False``) decides the same without them, so by default the replay does not
feed the index then (a round-robin replay takes 0.80-0.88x the CPU), and it books such a request in the slot
tracker without its block hashes (no per-block refcounts that nothing reads; its prefill tokens still count);
``OfflineConfig.router_view`` feeds the index and books the hashes anyway, for the router-view figures (the
overlap of the engines chosen, the best one offered) that only it gives.

Runs of *quiet* decode passes (no output, no event, nothing a router can see) are skipped with
``EngineCore.fast_forward``, bounded by the next arrival, which is exactly equivalent to stepping
through them. That, plus ``emit_token_ids=False``, is what makes the whole conversation trace with
8 engines take seconds of CPU rather than hours.

The cyclic garbage collector is paused while a replay runs. The replay makes no reference cycles (all it
drops is freed by reference counting; a collection right after a replay finds nothing, which a test
checks), so the collector's passes over its growing heap (booking tuples, memoized hash lists) found
nothing either, and cost ~0.25 s of CPU on the 4000-request conversation trace (7-10 %).

Figures are measured as Dynamo's replay measures them: TTFT = first token time - arrival, end-to-end
= last token time - arrival, and ITL is the distribution of every token-to-token gap. In a pass every
running decode request gets exactly one token, so each gap is the duration of the pass that produced
the later token: the ITL distribution is the pass durations weighted by their decode tokens (quiet
passes skipped together have equal durations under the polynomial model; a preempted request's long
gap is the one thing this leaves out). The prefix hit rate is the engines' own figure: prompt tokens
found in the prefix cache at a request's first admission ÷ prompt tokens.
"""

from __future__ import annotations

import gc
import heapq
import math
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
from kvmesh.hashing import block_hashes, local_block_hashes, sequence_hashes, u32_block_hashes
from kvmesh_router.admission import Admission, BusyThresholds, Decision, EngineSpec, RouteRequest
from kvmesh_router.cost import RouterPolicyConfig
from kvmesh_router.indexer import KvIndexer
from kvmesh_router.policies import DEFAULT_COST_POLICY
from kvmesh_router.selection import reads_cache
from kvmesh_router.slot_tracker import DEFAULT_EXPIRY_S, SlotTracker
from kvmesh_worker.engine import EngineConfig, EngineCore, EngineError, EngineRequest, load_perf_model

from kvmesh_bench.replay.report import RunData
from kvmesh_bench.replay.workload import DEFAULT_VOCAB_SIZE, ReplayRequest, TokenMapper

__all__ = ["HIT_SOURCE", "OfflineConfig", "SimRouter", "run_offline"]

HIT_SOURCE = "engine prefix cache at first admission"

# The router daemon's slot-tracker default block size (kvmesh_router.state.DEFAULT_BLOCK_SIZE); each
# engine's own block size is registered with it, so this only matters for unknown engines.
_ROUTER_DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class OfflineConfig:
    """One simulated fleet: engine knobs (Dynamo mocker defaults) and the router policy."""

    engines: int = 8
    block_size: int = 64
    num_gpu_blocks: int = 16384
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    perf_model: str | None = None  # None / "polynomial", or an .npz profile
    router_mode: str = "kv"
    cost_policy: str = DEFAULT_COST_POLICY
    overlap_weight: float = 1.0
    temperature: float = 0.0
    policy_params: Mapping[str, float] = field(default_factory=dict)
    seed: int = 0
    vocab_size: int = DEFAULT_VOCAB_SIZE
    load_sample_ms: float | None = None  # per-engine load sampling period; None: span / 400 (>= 100 ms)
    router_view: bool = False  # feed the router's index even when the routing mode does not read it

    def policy(self) -> RouterPolicyConfig:
        return RouterPolicyConfig(
            mode=self.router_mode,
            cost_policy=self.cost_policy,
            overlap_score_weight=self.overlap_weight,
            temperature=self.temperature,
            params=dict(self.policy_params),
        )

    def label(self) -> str:
        if self.router_mode != "kv":
            return self.router_mode
        return f"kv:{self.cost_policy}"

    def as_dict(self) -> dict[str, object]:
        out = {f: getattr(self, f) for f in self.__dataclass_fields__}
        out["policy_params"] = dict(self.policy_params)
        return out

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            num_gpu_blocks=self.num_gpu_blocks,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            vocab_size=self.vocab_size,
            emit_token_ids=False,
        )


class _PassChanges:
    """One engine's KV changes since the last pass started (a KvSink): ``(stored?, parent, hashes, tokens)``."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[tuple[int, int | None, Sequence[int], Sequence[int]]] = []

    def stored(self, parent_hash: int | None, block_hashes: Sequence[int], tokens_hashes: Sequence[int]) -> None:
        self.items.append((_STORED, parent_hash, block_hashes, tokens_hashes))

    def removed(self, block_hashes: Sequence[int]) -> None:
        self.items.append((_REMOVED, None, block_hashes, ()))

    def cleared(self) -> None:
        self.items.append((_CLEARED, None, (), ()))

    def take(self) -> list[tuple[int, int | None, Sequence[int], Sequence[int]]]:
        items, self.items = self.items, []
        return items


class _NoIndex(_PassChanges):
    """The sink of a replay that keeps no router index: the engines' KV changes go nowhere."""

    __slots__ = ()

    def stored(self, parent_hash: int | None, block_hashes: Sequence[int], tokens_hashes: Sequence[int]) -> None:
        pass

    def removed(self, block_hashes: Sequence[int]) -> None:
        pass

    def cleared(self) -> None:
        pass


_STORED, _REMOVED, _CLEARED = 0, 1, 2


class _PromptHasher:
    """``block_hashes(prompt, block_size)`` of trace prompts, memoized per trace block and its prefix.

    A prompt is its trace ids' token blocks laid end to end (see ``workload``), so when the engine block
    size divides the trace block, the engine blocks of a full trace block depend only on that id and on
    the sequence hash before it: ``(parent sequence hash, id) -> (tokens hashes, sequence hashes)`` of its
    engine blocks is the same in every prompt that reaches it. Multi-turn traces repeat their prefixes,
    so most trace blocks are hashed once per replay. The result equals ``block_hashes`` exactly.
    """

    def __init__(self, mapper: TokenMapper, block_size: int) -> None:
        self._bs = block_size
        self._bt = mapper.block_tokens
        self._usable = mapper.block_tokens % block_size == 0
        self._memo: dict[tuple[int | None, int], tuple[list[int], list[int]]] = {}

    def __call__(self, hash_ids: Sequence[int], tokens: np.ndarray) -> tuple[list[int], list[int]]:
        if not self._usable:
            return block_hashes(tokens, self._bs)
        bs, bt, memo = self._bs, self._bt, self._memo
        local: list[int] = []
        seq: list[int] = []
        parent: int | None = None
        full = len(tokens) // bt  # trace blocks whose every token is in the prompt
        raw: memoryview | None = None  # the full trace blocks as u32 bytes, converted once, on the first miss
        for j in range(full):
            key = (parent, hash_ids[j])
            hit = memo.get(key)
            if hit is None:
                if raw is None:
                    raw = memoryview(np.ascontiguousarray(tokens[: full * bt], dtype="<u4").tobytes())
                lo = u32_block_hashes(raw[j * bt * 4 : (j + 1) * bt * 4], bs)
                hit = memo[key] = (lo, sequence_hashes(lo, parent=parent))
            local += hit[0]
            seq += hit[1]
            parent = seq[-1]
        tail = local_block_hashes(tokens[full * bt :], bs)
        if tail:
            local += tail
            seq += sequence_hashes(tail, parent=parent)
        return local, seq


class SimRouter:
    """The router daemon's routing core without its transport (see ``kvmesh_router.state.RouterState``)."""

    def __init__(self, policy: RouterPolicyConfig, seed: int, booking_ttl_s: float = DEFAULT_EXPIRY_S) -> None:
        # RouterSettings.index_max_blocks defaults to unbounded; a simulation never dumps its index.
        self.index = KvIndexer(max_entries=None, dumps=False)
        self.slots = SlotTracker(_ROUTER_DEFAULT_BLOCK_SIZE, expiry_s=booking_ttl_s)
        self.admission = Admission(
            self.index, self.slots, config=policy, thresholds=BusyThresholds(), rng=random.Random(seed)
        )

    def add_engine(self, engine_id: int, config: EngineConfig) -> None:
        self.admission.add_engine(
            EngineSpec(engine_id, config.num_gpu_blocks, config.block_size, config.max_num_batched_tokens)
        )
        self.index.add_engine(engine_id)


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (and restore its state after); reference counting still frees."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def run_offline(
    requests: Sequence[ReplayRequest], config: OfflineConfig, mapper: TokenMapper | None = None, label: str = ""
) -> RunData:
    """Replay ``requests`` (in arrival order) through a fresh simulated fleet; see the module docstring."""
    with _cyclic_gc_paused():
        return _simulate(requests, config, mapper, label)


def _simulate(
    requests: Sequence[ReplayRequest], config: OfflineConfig, mapper: TokenMapper | None, label: str
) -> RunData:
    cpu0, wall0 = time.process_time(), time.perf_counter()
    mapper = mapper or TokenMapper(vocab_size=config.vocab_size, seed=config.seed)
    econf = config.engine_config()
    keep_index = config.router_view or reads_cache(config.router_mode)
    sinks = [_PassChanges() if keep_index else _NoIndex() for _ in range(config.engines)]
    cores = [EngineCore(econf, load_perf_model(config.perf_model), sink) for sink in sinks]
    router = SimRouter(config.policy(), config.seed)
    for e in range(config.engines):
        router.add_engine(e, econf)
    admission, index = router.admission, router.index
    store_chain, remove_blocks, clear_engine = index.store_chain, index.remove, index.clear
    bs = econf.block_size
    prompt_hashes = _PromptHasher(mapper, bs)

    n = len(requests)
    arrival = np.array([r.arrival_ms for r in requests], dtype=float)
    first = np.full(n, math.nan)
    finish = np.full(n, math.nan)
    engine_of = np.full(n, -1, dtype=np.int64)
    cached = np.zeros(n, dtype=np.int64)
    predicted = np.zeros(n, dtype=np.int64)
    best = np.zeros(n, dtype=np.int64)
    slot_of: dict[str, int] = {}
    errors: list[str] = []

    itl_d: list[float] = []
    itl_w: list[int] = []
    span = float(arrival[-1]) if n else 0.0
    sample_ms = config.load_sample_ms or max(100.0, span / 400.0)
    next_sample = [0.0] * config.engines
    samples: list[tuple[float, int, int, int, int, int]] = []

    pending: list = [None] * config.engines  # the StepOutput and KV changes of each engine's pass in flight
    busy = [False] * config.engines
    heap: list[tuple[float, int, int]] = []  # (pass end, seq, engine)
    seq = 0
    passes = skipped = 0
    inf = math.inf

    def start_pass(e: int, now: float) -> None:
        nonlocal seq, passes
        out = cores[e].step()
        pending[e] = (out, sinks[e].take())
        passes += 1
        seq += 1
        heapq.heappush(heap, (now + out.metrics.duration_ms, seq, e))

    i = 0
    while True:
        ta = arrival[i] if i < n else inf
        if heap and heap[0][0] <= ta:
            t, _, e = heapq.heappop(heap)
            out, changes = pending[e]
            pending[e] = None
            for kind, parent, hashes, tokens in changes:
                if kind == _STORED:
                    store_chain(e, parent, hashes, tokens)
                elif kind == _REMOVED:
                    remove_blocks(e, hashes)
                else:
                    clear_engine(e)
            for o in out.outputs:
                k = slot_of[o.request_id]
                if math.isnan(first[k]):
                    first[k] = t
                    cached[k] = o.num_cached_prompt_tokens or 0
                    admission.mark_prefill_completed(o.request_id)
                if o.finished:
                    finish[k] = t
                    admission.free(o.request_id)
                    del slot_of[o.request_id]
            m = out.metrics
            if m.num_decode_requests:
                itl_d.append(m.duration_ms)
                itl_w.append(m.num_decode_requests)
            core = cores[e]
            if t >= next_sample[e]:
                ld = core.load()
                samples.append((t, e, ld.active_blocks, ld.num_running, ld.num_waiting, ld.queued_prefill_tokens))
                next_sample[e] = t + sample_ms
            if core.has_unfinished():
                if ta > t:
                    running = len(core.scheduler.running)
                    k_passes, total = core.fast_forward(1 << 30, ta - t)
                    if k_passes:
                        itl_d.append(total / k_passes)
                        itl_w.append(k_passes * running)
                        skipped += k_passes
                        t += total
                start_pass(e, t)
            else:
                busy[e] = False
            continue
        if i >= n:
            break
        req = requests[i]
        i += 1
        tokens = req.prompt(mapper)
        local_hashes, hashes = prompt_hashes(req.hash_ids, tokens)
        decision = admission.decide(
            RouteRequest(req.request_id, hashes if keep_index else (), int(tokens.size), req.max_tokens),
            now=ta / 1000.0,
        )
        k = i - 1
        if not isinstance(decision, Decision):
            errors.append(f"{req.request_id}: not routed ({decision.message})")
            continue
        e = decision.engine_id
        engine_of[k] = e
        predicted[k] = decision.overlap_blocks * bs
        best[k] = decision.best_overlap_blocks * bs
        try:
            cores[e].add_request(
                EngineRequest(
                    req.request_id, tokens, req.max_tokens, ignore_eos=True, prompt_hashes=(local_hashes, hashes)
                )
            )
        except EngineError as exc:
            admission.free(req.request_id)
            errors.append(f"{req.request_id}: engine {e} rejected it: {exc}")
            continue
        slot_of[req.request_id] = k
        if not busy[e]:
            busy[e] = True
            start_pass(e, ta)

    inputs = np.array([r.input_length for r in requests], dtype=np.int64)
    total_in = max(1, int(inputs.sum()))
    return RunData(
        label=label or config.label(),
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
        engines=config.engines,
        hit_source=HIT_SOURCE,
        errors=errors,
        load=np.array(samples, dtype=float).reshape(-1, 6),
        meta={
            "config": config.as_dict(),
            # None: not kept (see the module docstring)
            "router_hit_rate": float(predicted.sum()) / total_in if keep_index else None,
            "best_offered_hit_rate": float(best.sum()) / total_in if keep_index else None,
            "passes": passes,
            "skipped_quiet_passes": skipped,
            "cpu_s": time.process_time() - cpu0,
            "wall_s": time.perf_counter() - wall0,
        },
    )
