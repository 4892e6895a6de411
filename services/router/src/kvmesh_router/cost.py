"""The router's cost function: how much it would cost to send a request to an engine (lower wins).

Policy ``"dynamo"`` (Dynamo ``scheduling/selector.rs``, the documented linear cost)::

    prefill_blocks = (active_prefill_tokens + max(0, isl - overlap_blocks * block_size)) / block_size
    decode_blocks  = active_blocks + blocks of this request not already active on the engine
    cost           = overlap_score_weight * prefill_blocks + decode_blocks

``overlap_blocks`` are the request's leading blocks already cached on the engine (from the indexer or the
approximate predictor): the prefill work it saves. ``decode_blocks`` is the memory the engine would hold.
``overlap_score_weight`` (default 1.0) trades cache affinity against load spreading.

Policy ``"affinity"`` (:class:`AffinityCost`, kvmesh's): backlog-discounted prefix affinity, see its docstring.
It is the default (:data:`~kvmesh_router.policies.DEFAULT_COST_POLICY`), here as in the router daemon.

Policies are pluggable: anything with ``name`` and ``cost(inputs, fleet, config) -> float`` satisfies
:class:`CostPolicy`; ``POLICIES.register_cost_policy`` (:mod:`kvmesh_router.policies`) makes it selectable
by name through ``RouterPolicyConfig.cost_policy`` (globally or per request), so a new policy runs side by
side with Dynamo's. :class:`FleetContext` gives a policy fleet-relative facts (e.g. the least prefill backlog among
the candidates) for load-aware variants; ``RouterPolicyConfig.params`` carries their extra knobs.

Selection hands a policy the candidates as a :class:`CostBatch` (one column per input). A policy may
add ``costs(batch, fleet, config) -> list[float]`` to score the whole batch at once (``"dynamo"`` does:
with a thousand engines, building a :class:`CostInputs` per candidate costs more than the arithmetic);
:func:`policy_costs` falls back to ``cost`` per row otherwise. Both must agree exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol

from kvmesh_router.policies import DEFAULT_COST_POLICY, POLICIES

__all__ = [
    "MAX_WEIGHT",
    "MODES",
    "ROLES",
    "AffinityCost",
    "CostBatch",
    "CostInputs",
    "CostPolicy",
    "DynamoCost",
    "FleetContext",
    "RouterConfigOverride",
    "RouterPolicyConfig",
    "dynamo_cost",
    "fleet_context",
    "policy_costs",
]

MODES = ("kv", "round_robin", "random", "power_of_two", "direct")
#: Worker roles a query may ask for (``discovery.proto`` ``WorkerRole``; unspecified counts as aggregated).
ROLES = ("aggregated", "prefill", "decode")
#: Bound of every weight and policy parameter: far above any useful value, and low enough that a cost
#: (a weight times at most ~2^40 tokens) stays finite, so costs never become inf or NaN.
MAX_WEIGHT = 1e6


@dataclass(frozen=True, slots=True)
class RouterPolicyConfig:
    """Global routing policy; a request may override parts of it with :class:`RouterConfigOverride`.

    - ``mode``: ``kv`` (cost-based, default), ``round_robin``, ``random``, ``power_of_two``, ``direct``, or
      any selector registered in :data:`~kvmesh_router.policies.POLICIES`.
    - ``role``: the worker role candidates must have (:data:`ROLES`); the role filter of admission applies it.
    - ``cost_policy``: name of a registered :class:`CostPolicy` (default ``"affinity"``, the daemon's).
    - ``overlap_score_weight``: weight of the prefill term (Dynamo ``--router-kv-overlap-score-weight``).
    - ``temperature``: 0 = argmin with a random tie-break; > 0 = softmax sampling over range-normalised
      costs (Dynamo ``--router-temperature``).
    - ``params``: extra knobs for non-default policies (ignored by ``"dynamo"``).
    """

    mode: str = "kv"
    cost_policy: str = DEFAULT_COST_POLICY
    overlap_score_weight: float = 1.0
    temperature: float = 0.0
    params: Mapping[str, float] = field(default_factory=dict, hash=False, compare=True)
    role: str = "aggregated"

    def __post_init__(self) -> None:
        if self.mode not in MODES and self.mode not in POLICIES.modes:
            raise ValueError(f"unknown routing mode {self.mode!r}; expected one of {', '.join(POLICIES.modes)}")
        if self.role not in ROLES:
            raise ValueError(f"unknown worker role {self.role!r}; expected one of {', '.join(ROLES)}")
        if not 0 <= self.overlap_score_weight <= MAX_WEIGHT:
            raise ValueError(f"overlap_score_weight must be in [0, {MAX_WEIGHT:g}], got {self.overlap_score_weight}")
        for name, value in self.params.items():
            if not 0 <= value <= MAX_WEIGHT:
                raise ValueError(f"policy parameter {name} must be in [0, {MAX_WEIGHT:g}], got {value}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")

    def with_override(self, override: RouterConfigOverride | None) -> RouterPolicyConfig:
        """This config with the override's set fields applied (``params`` are merged key by key)."""
        if override is None:
            return self
        changes: dict[str, Any] = {}
        if override.mode is not None:
            changes["mode"] = override.mode
        if override.role is not None:
            changes["role"] = override.role
        if override.cost_policy is not None:
            changes["cost_policy"] = override.cost_policy
        if override.overlap_score_weight is not None:
            changes["overlap_score_weight"] = override.overlap_score_weight
        if override.temperature is not None:
            changes["temperature"] = override.temperature
        if override.params:
            changes["params"] = {**self.params, **override.params}
        return replace(self, **changes) if changes else self


@dataclass(frozen=True, slots=True)
class RouterConfigOverride:
    """Per-query override of the policy (Dynamo ``RouterConfigOverride`` / ``nvext``); None = keep the global.

    Mode and role are overrides like any other knob: a query asking for ``round_robin``, or (with
    disaggregation) for a ``prefill`` engine, is decided with the replica's config plus this override, in
    the same call; nothing global is swapped.
    """

    mode: str | None = None
    role: str | None = None
    cost_policy: str | None = None
    overlap_score_weight: float | None = None
    temperature: float | None = None
    params: Mapping[str, float] = field(default_factory=dict, hash=False)


@dataclass(slots=True)
class CostInputs:
    """What a cost policy knows about one candidate engine for one request."""

    engine_id: int
    block_size: int
    isl_tokens: int
    request_blocks: int  # full blocks of the prompt (len of its sequence hashes)
    overlap_blocks: int  # leading blocks cached on the engine
    active_prefill_tokens: int
    active_blocks: int
    potential_decode_blocks: int  # active_blocks + request blocks not already active there
    active_requests: int = 0


@dataclass(slots=True)
class CostBatch:
    """The candidates of one decision, column by column (index ``i`` of every column is candidate ``i``).

    ``copies``: row ``i`` stands for ``copies[i]`` candidates whose inputs are all the same (None: one each).
    A selector only passes it to a policy with ``counts_copies`` (its costs are per row, and whatever it
    counts over the batch counts copies); the built-in policies have it.
    """

    engine_ids: Sequence[int]
    block_size: Sequence[int]
    isl_tokens: int
    request_blocks: int
    overlap_blocks: Sequence[int]
    active_prefill_tokens: Sequence[int]
    active_blocks: Sequence[int]
    potential_decode_blocks: Sequence[int]
    active_requests: Sequence[int]
    copies: Sequence[int] | None = None

    def __len__(self) -> int:
        return len(self.engine_ids)

    def row(self, i: int) -> CostInputs:
        return CostInputs(
            self.engine_ids[i],
            self.block_size[i],
            self.isl_tokens,
            self.request_blocks,
            self.overlap_blocks[i],
            self.active_prefill_tokens[i],
            self.active_blocks[i],
            self.potential_decode_blocks[i],
            self.active_requests[i],
        )

    def rows(self) -> list[CostInputs]:
        return [self.row(i) for i in range(len(self.engine_ids))]

    @classmethod
    def from_rows(cls, rows: Sequence[CostInputs]) -> CostBatch:
        """Columns of ``rows`` (which must describe the same request: one ISL, one block count)."""
        if not rows:
            return cls([], [], 0, 0, [], [], [], [], [])
        isl, n = rows[0].isl_tokens, rows[0].request_blocks
        if any(r.isl_tokens != isl or r.request_blocks != n for r in rows):
            raise ValueError("a CostBatch describes one request: rows disagree on isl_tokens / request_blocks")
        return cls(
            [r.engine_id for r in rows],
            [r.block_size for r in rows],
            isl,
            n,
            [r.overlap_blocks for r in rows],
            [r.active_prefill_tokens for r in rows],
            [r.active_blocks for r in rows],
            [r.potential_decode_blocks for r in rows],
            [r.active_requests for r in rows],
        )


@dataclass(frozen=True, slots=True)
class FleetContext:
    """Facts about the whole candidate set of one decision (for fleet-relative policies)."""

    candidates: int
    min_active_prefill_tokens: int
    max_overlap_blocks: int


class CostPolicy(Protocol):
    """A routing cost: lower is better. Must be a pure function of its arguments.

    Optional: a batch ``costs(batch, fleet, config)`` (every candidate at once, the same values), and
    ``counts_copies = True`` when that method reads ``CostBatch.copies`` wherever it counts candidates:
    then a selector may score a row per group of interchangeable candidates (idle engines with nothing
    cached) instead of one per engine.
    """

    name: str

    def cost(self, c: CostInputs, fleet: FleetContext, config: RouterPolicyConfig) -> float: ...


def fleet_context(batch: CostBatch) -> FleetContext:
    """Fleet-relative facts of a (non-empty) candidate batch (copies counted)."""
    candidates = len(batch) if batch.copies is None else sum(batch.copies)
    return FleetContext(candidates, min(batch.active_prefill_tokens), max(batch.overlap_blocks))


def policy_costs(policy: CostPolicy, batch: CostBatch, fleet: FleetContext, config: RouterPolicyConfig) -> list[float]:
    """Every candidate's cost: the policy's batch ``costs`` if it has one, else ``cost`` row by row."""
    batch_costs = getattr(policy, "costs", None)
    if batch_costs is not None:
        costs: list[float] = batch_costs(batch, fleet, config)  # found by getattr, so mypy sees Any
        return costs
    cost = policy.cost
    return [cost(row, fleet, config) for row in batch.rows()]


def dynamo_cost(
    *,
    isl_tokens: int,
    overlap_blocks: int,
    block_size: int,
    active_prefill_tokens: int,
    potential_decode_blocks: int,
    overlap_score_weight: float = 1.0,
) -> float:
    """Dynamo's linear cost with explicit arguments (see the module docstring)."""
    new_prefill = isl_tokens - overlap_blocks * block_size
    prefill_blocks = (active_prefill_tokens + (new_prefill if new_prefill > 0 else 0)) / block_size
    return overlap_score_weight * prefill_blocks + potential_decode_blocks


class DynamoCost:
    """``overlap_score_weight * prefill_blocks + decode_blocks`` (Dynamo's default)."""

    name = "dynamo"
    counts_copies: ClassVar[bool] = True  # a cost per row, nothing counted

    def cost(self, c: CostInputs, fleet: FleetContext, config: RouterPolicyConfig) -> float:
        new_prefill = c.isl_tokens - c.overlap_blocks * c.block_size
        prefill_blocks = (c.active_prefill_tokens + (new_prefill if new_prefill > 0 else 0)) / c.block_size
        return config.overlap_score_weight * prefill_blocks + c.potential_decode_blocks

    def costs(self, batch: CostBatch, fleet: FleetContext, config: RouterPolicyConfig) -> list[float]:
        """:meth:`cost` of every candidate, bit-for-bit (same operations in the same order)."""
        w = config.overlap_score_weight
        isl = batch.isl_tokens
        return [
            w * ((p + (isl - o * bs if isl > o * bs else 0)) / bs) + d
            for p, o, bs, d in zip(
                batch.active_prefill_tokens,
                batch.overlap_blocks,
                batch.block_size,
                batch.potential_decode_blocks,
                strict=True,
            )
        ]


class AffinityCost:
    """Backlog-discounted prefix affinity (kvmesh's policy; ``cost_policy="affinity"``), in blocks::

        excess  = max(0, active_prefill_tokens - fleet.min_active_prefill_tokens)
        credit  = overlap_blocks / (1 + credit_decay * excess / isl_tokens)
        new     = isl_tokens / block_size - credit               # the request's own uncached prefill
        backlog = active_prefill_tokens / block_size             # prefill queued on the engine
        cost    = overlap_score_weight * (new + backlog_weight * backlog) + decode_weight * potential_decode_blocks

    Knobs (``RouterPolicyConfig.params``): ``backlog_weight`` (default 0.05), ``credit_decay`` (0.15),
    ``decode_weight`` (0.05), ``near_tie`` (0.05). Compared with ``"dynamo"``
    (``new + backlog + decode_blocks``):

    - **Queued prefill counts a twentieth of a cached block.** Dynamo prices a token of someone else's queued
      prefill like a token this request must compute itself, which is right for this request's TTFT
      alone. But a prefix recomputed elsewhere is paid by the whole fleet: compute every later request
      queues behind, and cache space that evicts other sessions' prefixes sooner.
    - **Decode memory weighs a twentieth** (``decode_weight`` 0.05; Dynamo: 1): a cache-hit engine running one
      more long request does not lose to a cold one, but KV usage cannot pile up on hot engines without
      limit: with short prompts nothing else pushes back, and a decode pass slows with the engine's KV use
      (at x6 on a short-prompt trace, 0 gave an ITL p99 3x Dynamo's). 0.05 rather than 0.02 or 0.1: over
      the routing matrix (5 traces x 5 loads, two sets of synthesized traces and seeds) it loses the fewest
      cells to ``"dynamo"``; it gives back TTFT p50 at mid loads, still below Dynamo's.
    - **Affinity decays under a backlog that is large for this request** (Dynamo's newer
      ``overlap_score_credit_decay``).
    - **Near-ties go to Dynamo's pick** (``near_tie``): the candidates whose cost is within ``near_tie`` x the
      request's blocks of the best (when there are two or more) are re-ranked by Dynamo's cost, inside that
      band (their costs become ``best + band * d / (1 + d)``, ``d`` = Dynamo's cost, so every band member
      still beats every engine outside it). These are the decisions where the cache does not tell engines
      apart (a new conversation, a giant prompt whose only hit is a shared system prompt); breaking them at
      random spread decode memory unevenly and lost TTFT p99 and ITL p99 to ``"dynamo"`` at light load
      (docs/benchmarks.md, "Routing that never loses"). The band needs the whole batch, so :meth:`cost`
      (one row) gives the costs before it; :meth:`costs` is what the selector uses.
    """

    name = "affinity"
    counts_copies: ClassVar[bool] = True  # the near-tie band counts its members with their copies
    DEFAULTS: Mapping[str, float] = {
        "backlog_weight": 0.05,
        "credit_decay": 0.15,
        "decode_weight": 0.05,
        "near_tie": 0.05,
    }

    @staticmethod
    def _params(config: RouterPolicyConfig) -> tuple[float, float, float]:
        p = config.params
        d = AffinityCost.DEFAULTS
        return (
            float(p.get("backlog_weight", d["backlog_weight"])),
            float(p.get("credit_decay", d["credit_decay"])),
            float(p.get("decode_weight", d["decode_weight"])),
        )

    def cost(self, c: CostInputs, fleet: FleetContext, config: RouterPolicyConfig) -> float:
        lam, decay, dw = self._params(config)
        return _affinity(
            config.overlap_score_weight,
            lam,
            decay,
            dw,
            fleet.min_active_prefill_tokens,
            c.isl_tokens,
            c.overlap_blocks,
            c.block_size,
            c.active_prefill_tokens,
            c.potential_decode_blocks,
        )

    def costs(self, batch: CostBatch, fleet: FleetContext, config: RouterPolicyConfig) -> list[float]:
        """:meth:`cost` of every candidate (bit-for-bit), then the near-tie band re-ranked by Dynamo's cost."""
        lam, decay, dw = self._params(config)
        w, low, isl = config.overlap_score_weight, fleet.min_active_prefill_tokens, batch.isl_tokens
        costs = [
            _affinity(w, lam, decay, dw, low, isl, o, bs, p, d)
            for o, bs, p, d in zip(
                batch.overlap_blocks,
                batch.block_size,
                batch.active_prefill_tokens,
                batch.potential_decode_blocks,
                strict=True,
            )
        ]
        near = float(config.params.get("near_tie", self.DEFAULTS["near_tie"]))
        if near <= 0 or len(costs) < 2:
            return costs
        best = min(costs)
        band = best + w * near * isl / (batch.block_size[0] or 1)
        if band <= best or _band_members(costs, batch.copies, band) < 2:
            return costs  # no near-tie: the affinity costs as they are
        dynamo = _DYNAMO.costs(batch, fleet, config)
        span = band - best
        return [best + span * (d / (1.0 + d)) if c <= band else c for c, d in zip(costs, dynamo, strict=True)]


def _band_members(costs: Sequence[float], copies: Sequence[int] | None, band: float) -> int:
    """Candidates whose cost is within ``band``, each row counted with its copies."""
    if copies is None:
        return sum(1 for c in costs if c <= band)
    return sum(k for c, k in zip(costs, copies, strict=True) if c <= band)


def _affinity(
    weight: float,
    backlog_weight: float,
    credit_decay: float,
    decode_weight: float,
    min_prefill: int,
    isl: int,
    overlap: int,
    bs: int,
    prefill: int,
    decode_blocks: int,
) -> float:
    credit = float(overlap)
    if credit and credit_decay and prefill > min_prefill:
        credit /= 1.0 + credit_decay * (prefill - min_prefill) / (isl if isl > 0 else 1)
    new = isl / bs - credit
    if new < 0.0:
        new = 0.0
    return weight * (new + backlog_weight * (prefill / bs)) + decode_weight * decode_blocks


_DYNAMO = DynamoCost()
POLICIES.register_cost_policy(_DYNAMO)
POLICIES.register_cost_policy(AffinityCost())
