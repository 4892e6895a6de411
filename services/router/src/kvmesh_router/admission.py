"""Admission: the one place where a request is matched, checked for overload, assigned and booked.

(About 400 lines: the decision pipeline is kept in one module on purpose, so that it stays one call.)

:meth:`Admission.decide` is a single synchronous call: candidate filters (:mod:`kvmesh_router.candidates`)
-> prefix overlaps -> busy filter -> selector (side-effect free) -> booking in the slot tracker (and, in
approximate mode, the prediction). Because selection and booking happen in one call that never yields,
no two decisions can see the same pre-booking load (Dynamo's ``admission_gate``): in an asyncio daemon,
call it without an ``await`` in between; in a simulation, call it in event order. No I/O, no clock.

Busy thresholds (all optional, Dynamo ``worker_monitor.rs``; an engine is busy if ANY fires):

- ``active_prefill_tokens``: booked prefill tokens > the absolute threshold;
- ``active_prefill_tokens_frac``: booked prefill tokens > frac * the engine's ``max_num_batched_tokens``
  (10,000,000 if it did not report one);
- ``kv_usage_frac``: max(booked active blocks, engine-reported used blocks) > frac * ``total_blocks``;
- ``requests_frac``: booked requests >= frac * ``max_requests`` (the engine's ``max_num_seqs +
  max_waiting_requests``, from its card; engines with an unbounded queue never trip it). At 1.0 the
  router never sends an engine a request its waiting queue would refuse: it picks another engine, or
  rejects at once, instead of a round trip to the worker to learn the queue is full.

Busy engines are skipped; the request is rejected (:class:`Rejection`, the frontend's
RESOURCE_EXHAUSTED) only when *every* eligible engine is busy. Only engines with a booking or reported KV
in use are checked (:meth:`Admission.available`): with valid thresholds nothing fires on an idle engine,
so a decision costs O(booked engines) there, not O(fleet). A pinned request considers only its
engine. A request id has at most one booking: deciding for a booked id raises
:class:`DuplicateRequestError`.

The policy of one decision is the admission's config with the query's :class:`RouterConfigOverride`
applied (mode and worker role included), resolved once in :meth:`Admission.policy_for`; a pinned query is
``direct``. Selectors and cost policies are looked up by name in :data:`~kvmesh_router.policies.POLICIES`.

The :class:`Decision` reports the overlap achieved on the chosen engine and the best overlap any
registered engine offered, for the "decision quality" metric (achieved / best).

Modes and overlap sources:

- event mode: ``index`` is the :class:`~kvmesh_router.indexer.KvIndexer` fed by the engines' events (owned
  by the ingest side; admission only reads it);
- approximate mode: pass an :class:`~kvmesh_router.approx.ApproxIndexer` as both ``index`` and
  ``predictor``: every decision is recorded as predicted blocks;
- both: a real ``index`` plus a side ``predictor``; an engine's overlap is the larger of the two.
"""

from __future__ import annotations

import enum
import random
from collections import Counter
from collections.abc import Sequence, Set
from dataclasses import dataclass, field, replace
from itertools import repeat

from kvmesh_router.approx import DecisionPredictor
from kvmesh_router.candidates import DEFAULT_FILTERS, CandidateFilter
from kvmesh_router.cost import CostBatch, RouterConfigOverride, RouterPolicyConfig
from kvmesh_router.indexer import PrefixIndex
from kvmesh_router.policies import POLICIES
from kvmesh_router.selection import RoutingError, SelectionContext, Selector, UnknownEngineError
from kvmesh_router.slot_tracker import SlotTracker

__all__ = [
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "Admission",
    "BusyThresholds",
    "Decision",
    "DuplicateRequestError",
    "EngineSpec",
    "RejectReason",
    "Rejection",
    "RouteRequest",
]

#: Dynamo's stand-in for engines that do not report ``max_num_batched_tokens``.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 10_000_000


class DuplicateRequestError(RoutingError):
    """The request id already has an active booking."""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """A routable engine: its id, KV capacity, block size and worker role (``cost.ROLES``)."""

    engine_id: int
    total_blocks: int
    block_size: int
    max_num_batched_tokens: int | None = None
    role: str = "aggregated"
    max_requests: int | None = None  # requests the engine holds at most (running + waiting); None = unbounded

    def __post_init__(self) -> None:
        if self.total_blocks <= 0 or self.block_size <= 0:
            raise ValueError(f"engine {self.engine_id}: total_blocks and block_size must be positive")


#: Below this many candidates, scoring each costs less than finding the interchangeable ones (measured:
#: per decision at the router's defaults, 60 engines booked: 110 against 125 µs at 64 engines, 157 against
#: 133 at 128, 769 against 219 at 1000).
_GROUPING_MIN_CANDIDATES = 100


@dataclass(frozen=True, slots=True)
class BusyThresholds:
    """Overload thresholds; None disables a check (all are off by default)."""

    active_prefill_tokens: int | None = None
    active_prefill_tokens_frac: float | None = None
    kv_usage_frac: float | None = None
    # Prefill-role engines only: booked prompt tokens not computed yet (the prefill pool's backlog). A
    # disaggregated frontend prefills locally (or answers RESOURCE_EXHAUSTED) when every prefill engine is
    # over it, so the prefill pool never queues without bound.
    prefill_backlog_tokens: int | None = None
    requests_frac: float | None = None

    @property
    def enabled(self) -> bool:
        return (
            self.active_prefill_tokens is not None
            or self.active_prefill_tokens_frac is not None
            or self.kv_usage_frac is not None
            or self.prefill_backlog_tokens is not None
            or self.requests_frac is not None
        )

    @property
    def spare_idle_engines(self) -> bool:
        """No threshold fires on an engine with nothing booked and no KV in use (true of every valid setting)."""
        return all(
            x is None or x >= 0
            for x in (
                self.active_prefill_tokens,
                self.active_prefill_tokens_frac,
                self.kv_usage_frac,
                self.prefill_backlog_tokens,
            )
        ) and (self.requests_frac is None or self.requests_frac > 0)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router needs to place a request.

    ``seq_hashes`` are the chained sequence hashes of the prompt's full blocks; ``isl_tokens`` the prompt
    length. ``pinned_engine`` forces direct routing; ``allowed_engines`` / ``excluded_engines`` restrict
    the candidates (e.g. a migration retry excludes the engine that failed).
    """

    request_id: str
    seq_hashes: Sequence[int]
    isl_tokens: int
    expected_output_tokens: int | None = None
    pinned_engine: int | None = None
    allowed_engines: frozenset[int] | None = None
    excluded_engines: frozenset[int] = field(default_factory=frozenset)
    override: RouterConfigOverride | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """The request was booked on ``engine_id``."""

    request_id: str
    engine_id: int
    overlap_blocks: int  # cached prefix blocks on the chosen engine
    best_overlap_blocks: int  # the best any registered engine offered
    mode: str
    cost: float | None = None

    @property
    def quality(self) -> float:
        """Achieved / best overlap (1.0 when no engine had any overlap)."""
        return 1.0 if self.best_overlap_blocks == 0 else self.overlap_blocks / self.best_overlap_blocks


class RejectReason(enum.Enum):
    ALL_BUSY = "all_busy"
    NO_ENGINES = "no_engines"


@dataclass(frozen=True, slots=True)
class Rejection:
    """The request was not booked: every eligible engine is busy, or there is none."""

    request_id: str
    reason: RejectReason
    busy_engines: tuple[int, ...] = ()

    @property
    def message(self) -> str:
        if self.reason is RejectReason.NO_ENGINES:
            return "no eligible engine is registered"
        return f"all {len(self.busy_engines)} eligible engines are over their busy thresholds"


class Admission:
    """Serialized select + book over registered engines. See the module docstring."""

    def __init__(
        self,
        index: PrefixIndex,
        slots: SlotTracker,
        *,
        config: RouterPolicyConfig | None = None,
        thresholds: BusyThresholds | None = None,
        rng: random.Random | None = None,
        predictor: DecisionPredictor | None = None,
        filters: Sequence[CandidateFilter] = DEFAULT_FILTERS,
    ) -> None:
        self.index = index
        self.slots = slots
        self.predictor = predictor
        self.config = config or RouterPolicyConfig()
        self.thresholds = thresholds or BusyThresholds()
        self.rng = rng if rng is not None else random.Random()
        self._specs: dict[int, EngineSpec] = {}
        self._block_size: dict[int, int] = {}
        self._block_sizes: Counter[int] = Counter()  # engines per block size (one size: no grouping by it)
        self._sorted: list[int] = []
        self._reported_used: dict[int, int] = {}
        self._reporting_use: set[int] = set()  # engines whose last reported KV use is above 0
        self._no_request_room: set[int] = set()  # engines whose spec holds no request at all (max_requests <= 0)
        self._by_role: dict[str, frozenset[int]] = {}
        self.filters = tuple(filters)
        self._selectors: dict[str, Selector] = {mode: POLICIES.make_selector(mode) for mode in POLICIES.modes}

    # ------------------------------------------------------------------ engines

    def add_engine(self, spec: EngineSpec) -> None:
        """Register (or update) a routable engine."""
        old = self._specs.get(spec.engine_id)
        if old is None:
            self._sorted.append(spec.engine_id)
            self._sorted.sort()
        else:
            self._set_role(spec.engine_id, old.role, None)
        self._set_role(spec.engine_id, None, spec.role)
        self._specs[spec.engine_id] = spec
        if old is not None:
            self._count_block_size(old.block_size, -1)
        self._count_block_size(spec.block_size, 1)
        self._block_size[spec.engine_id] = spec.block_size
        if spec.max_requests is not None and spec.max_requests <= 0:
            self._no_request_room.add(spec.engine_id)
        else:
            self._no_request_room.discard(spec.engine_id)
        self.slots.add_engine(spec.engine_id, spec.block_size)

    def remove_engine(self, engine_id: int) -> list[str]:
        """Stop routing to an engine; drops its bookings (returned) and predictions. The event indexer is
        not touched (its owner removes the engine there)."""
        spec = self._specs.pop(engine_id, None)
        if spec is None:
            return []
        self._set_role(engine_id, spec.role, None)
        self._count_block_size(spec.block_size, -1)
        del self._block_size[engine_id]
        self._sorted.remove(engine_id)
        self._reported_used.pop(engine_id, None)
        self._reporting_use.discard(engine_id)
        self._no_request_room.discard(engine_id)
        if self.predictor is not None:
            self.predictor.remove_engine(engine_id)
        return self.slots.remove_engine(engine_id)

    def _count_block_size(self, block_size: int, delta: int) -> None:
        self._block_sizes[block_size] += delta
        if not self._block_sizes[block_size]:
            del self._block_sizes[block_size]

    def engines(self) -> list[int]:
        return list(self._sorted)

    def __len__(self) -> int:
        """Registered engines (with :meth:`with_role`, the :class:`~kvmesh_router.candidates.FleetView`)."""
        return len(self._specs)

    def with_role(self, role: str) -> frozenset[int]:
        """The registered engines of worker role ``role``."""
        return self._by_role.get(role, frozenset())

    def _set_role(self, engine_id: int, old: str | None, new: str | None) -> None:
        if old is not None:
            self._by_role[old] = self._by_role[old] - {engine_id}
        if new is not None:
            self._by_role[new] = self._by_role.get(new, frozenset()) | {engine_id}

    def report_kv_usage(self, engine_id: int, used_blocks: int | None) -> None:
        """An engine's own figure of used KV blocks (``kv_used_blocks``); None forgets it."""
        if used_blocks is None:
            self._reported_used.pop(engine_id, None)
        else:
            self._reported_used[engine_id] = used_blocks
        if used_blocks:
            self._reporting_use.add(engine_id)
        else:
            self._reporting_use.discard(engine_id)

    def is_busy(self, engine_id: int) -> bool:
        """Whether an engine is over any busy threshold right now."""
        spec = self._specs.get(engine_id)
        return spec is not None and self._busy(spec)

    def available(self, eligible: Sequence[int]) -> Sequence[int]:
        """The engines of ``eligible`` under every busy threshold (``eligible`` itself when none is busy).

        Only engines that hold a booking or report KV in use can be over a threshold (unless the thresholds
        fire on idle engines), so only those are checked: a few dozen in a fleet of a thousand, instead of
        every engine on every decision.
        """
        specs = self._specs
        if not self.thresholds.spare_idle_engines:
            return [e for e in eligible if not self._busy(specs[e])]
        suspects = self.slots.booked_engines()
        suspects |= self._reporting_use
        if self.thresholds.requests_frac is not None:
            suspects |= self._no_request_room
        busy = {e for e in suspects if e in specs and self._busy(specs[e])}
        return [e for e in eligible if e not in busy] if busy else eligible

    def _busy(self, spec: EngineSpec) -> bool:
        t = self.thresholds
        slots = self.slots
        e = spec.engine_id
        if t.active_prefill_tokens is not None or t.active_prefill_tokens_frac is not None:
            prefill = slots.active_prefill_tokens(e)
            if t.active_prefill_tokens is not None and prefill > t.active_prefill_tokens:
                return True
            if t.active_prefill_tokens_frac is not None:
                budget = spec.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
                if prefill > t.active_prefill_tokens_frac * budget:
                    return True
        if (
            t.prefill_backlog_tokens is not None
            and spec.role == "prefill"
            and slots.active_prefill_tokens(e) > t.prefill_backlog_tokens
        ):
            return True
        if t.kv_usage_frac is not None:
            used = max(slots.active_blocks(e), self._reported_used.get(e, 0))
            if used > t.kv_usage_frac * spec.total_blocks:
                return True
        limit = spec.max_requests
        return t.requests_frac is not None and limit is not None and slots.active_requests(e) >= t.requests_frac * limit

    # ------------------------------------------------------------------ decisions

    def overlaps(self, seq_hashes: Sequence[int]) -> dict[int, int]:
        """Cached leading blocks per engine (index, or the max of index and predictor)."""
        overlaps = self.index.find_matches(seq_hashes)
        predictor = self.predictor
        if predictor is not None and predictor is not self.index:
            for e, n in predictor.find_matches(seq_hashes).items():
                if n > overlaps.get(e, 0):
                    overlaps[e] = n
        return overlaps

    def decide(self, request: RouteRequest, now: float) -> Decision | Rejection:
        """Select an engine for ``request`` and book it there, in one step; or reject it.

        Raises :class:`UnknownEngineError` for a pinned engine that is not registered or not allowed,
        :class:`DuplicateRequestError` for an id that is already booked, :class:`RoutingError` for an
        unusable request (``direct`` mode without a pinned engine, an invalid policy override). Nothing is
        booked when it raises or rejects.
        """
        rid = request.request_id
        slots = self.slots
        if slots.has_request(rid):
            raise DuplicateRequestError(f"request {rid!r} is already booked")
        config = self.policy_for(request)
        mode = config.mode
        slots.expire(now)
        if self.predictor is not None:
            self.predictor.expire(now)

        pinned = request.pinned_engine
        eligible: Sequence[int]
        if pinned is not None:
            if pinned not in self._specs:
                raise UnknownEngineError(pinned)
            eligible = self._filter([pinned], request, config)
            if not eligible:
                raise UnknownEngineError(pinned, "is not allowed for this request")
        else:
            if mode == "direct":
                raise RoutingError("routing mode 'direct' needs a pinned engine")
            eligible = self._filter(self._sorted, request, config)
        if not eligible:
            return Rejection(rid, RejectReason.NO_ENGINES)

        seq_hashes = request.seq_hashes
        overlaps = self.overlaps(seq_hashes)
        specs = self._specs
        best = 0
        for e, n in overlaps.items():
            if n > best and e in specs:
                best = n

        if self.thresholds.enabled:
            available = self.available(eligible)
            if not available:
                return Rejection(rid, RejectReason.ALL_BUSY, tuple(eligible))
        else:
            available = eligible

        isl = request.isl_tokens
        n_blocks = len(seq_hashes)
        block_size = self._block_size

        def inputs(engines: Sequence[int]) -> CostBatch:
            active, prefill, requests, already = slots.candidate_columns(seq_hashes, engines)
            return CostBatch(
                engines,
                list(map(block_size.__getitem__, engines)),
                isl,
                n_blocks,
                list(map(overlaps.get, engines, repeat(0))) if overlaps else [0] * len(engines),
                prefill,
                active,
                [a + n_blocks - k for a, k in zip(active, already, strict=True)],
                requests,
            )

        def interchangeable() -> list[Set[int]]:
            # Candidates with nothing booked and nothing of the request cached all have an idle engine's
            # inputs: no load, no overlap, the whole prompt to prefill (one group per block size).
            if len(available) < _GROUPING_MIN_CANDIDATES:
                return []
            idle = set(available).difference(slots.booked_engines(), overlaps)
            if len(idle) < 2:
                return []
            if len(self._block_sizes) == 1:
                return [idle]
            by_size: dict[int, set[int]] = {}
            for e in idle:
                by_size.setdefault(block_size[e], set()).add(e)
            return [group for group in by_size.values() if len(group) > 1]

        ctx = SelectionContext(available, config, self.rng, inputs, overlaps, pinned, interchangeable)
        selector = self._selectors.get(mode)
        if selector is None:  # registered after this admission was built
            selector = self._selectors[mode] = POLICIES.make_selector(mode)
        choice = selector.select(ctx)
        engine = choice.engine_id
        overlap = overlaps.get(engine, 0)
        slots.add_request(rid, engine, seq_hashes, isl, overlap, request.expected_output_tokens, now=now)
        if self.predictor is not None:
            self.predictor.record(engine, seq_hashes, now)
        return Decision(rid, engine, overlap, best, mode, choice.cost)

    def mode_of(self, request: RouteRequest) -> str:
        """The routing mode ``request`` is decided in: ``direct`` when pinned, else its override's mode, else
        the config's. The one place a decision's mode is determined (metrics label failures with it too)."""
        if request.pinned_engine is not None:
            return "direct"
        override = request.override
        if override is not None and override.mode is not None:
            return override.mode
        return self.config.mode

    def policy_for(self, request: RouteRequest) -> RouterPolicyConfig:
        """The policy ``request`` is decided with: the config plus its override, in :meth:`mode_of`'s mode.

        Raises :class:`RoutingError` for an invalid override (unknown mode, role or cost policy, a
        negative weight).
        """
        try:
            config = self.config.with_override(request.override)
            mode = self.mode_of(request)
            if config.mode != mode:
                config = replace(config, mode=mode)
        except ValueError as e:
            raise RoutingError(f"invalid policy override: {e}") from None
        if not POLICIES.has_cost_policy(config.cost_policy):
            names = ", ".join(POLICIES.cost_policies)
            raise RoutingError(f"unknown cost policy {config.cost_policy!r}: choose {names}")
        return config

    def _filter(self, engines: Sequence[int], request: RouteRequest, config: RouterPolicyConfig) -> Sequence[int]:
        for keep in self.filters:
            engines = keep(engines, request, config, self)
        return engines

    # ------------------------------------------------------------------ lifecycle (pass-through)

    def mark_prefill_completed(self, request_id: str) -> bool:
        """First token seen for ``request_id``; False if unknown."""
        return self.slots.mark_prefill_completed(request_id)

    def free(self, request_id: str, engine_id: int | None = None) -> bool:
        """``request_id`` ended (completed, failed, cancelled); False if unknown or on another engine."""
        return self.slots.free(request_id, engine_id)
