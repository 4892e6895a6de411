"""Selectors: pick one engine for one request, per routing mode. They never book anything.

Modes (``RouterPolicyConfig.mode``):

- ``kv``: the cost policy (:mod:`kvmesh_router.cost`) scores every candidate; temperature 0 takes the
  argmin with a uniformly random tie-break, temperature T > 0 samples ``p_i ∝ exp(-(c_i / range) / T)``
  over the range-normalised costs (shifted by the best cost for stability; all-equal costs -> uniform).
- ``round_robin``: each candidate in turn: the one picked least recently (never-picked ones first, lowest
  id first), so with a fixed candidate set the picks cycle in ascending id order, and the engines of
  each model (each candidate pool) take turns whatever the traffic of the others.
- ``random``: uniform.
- ``power_of_two``: two distinct random candidates; the one with the lower current load wins, load =
  ``active_blocks + active_prefill_tokens / block_size`` (booked decode memory plus queued prefill, in
  blocks; cache overlap is deliberately ignored: this is the cache-blind baseline).
- ``direct``: the request pins its engine; an engine that is not a candidate raises
  :class:`UnknownEngineError`.

Selectors are registered by mode name in :data:`~kvmesh_router.policies.POLICIES` (one registry for
selectors and cost policies). All randomness comes from the ``random.Random`` in the
:class:`SelectionContext` (seed it for deterministic tests and simulations). The only state a selector
keeps is round robin's record of when it last picked each engine.

A selector whose choice never depends on the prefix index or the bookings (``round_robin``, ``random``)
says so with ``reads_cache = False``; one without the attribute is taken to read them. The router daemon
feeds its index either way; the offline replay skips feeding an index that nothing reads.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence, Set
from typing import NamedTuple, Protocol

from kvmesh_router.cost import (
    MODES,
    CostBatch,
    CostInputs,
    CostPolicy,
    RouterPolicyConfig,
    fleet_context,
    policy_costs,
)
from kvmesh_router.policies import POLICIES

__all__ = [
    "MODES",
    "Choice",
    "DirectSelector",
    "KvSelector",
    "PowerOfTwoSelector",
    "RandomSelector",
    "RoundRobinSelector",
    "RoutingError",
    "SelectionContext",
    "Selector",
    "UnknownEngineError",
    "argmin_index",
    "pick_index",
    "reads_cache",
    "softmax_index",
    "softmax_probabilities",
]


class RoutingError(Exception):
    """A request cannot be routed as asked (a caller error, not overload)."""


class UnknownEngineError(RoutingError, LookupError):
    """The request pins an engine that is not registered (or not allowed for it)."""

    def __init__(self, engine_id: int | None, reason: str = "is not a known engine") -> None:
        self.engine_id = engine_id
        shown = "(none)" if engine_id is None else f"{engine_id:x}"  # hex, as discovery and kvmesh status show ids
        super().__init__(f"pinned engine {shown} {reason}")


class Choice(NamedTuple):
    """A selector's pick; ``cost`` is the policy cost (kv), the load (power_of_two), else None."""

    engine_id: int
    cost: float | None = None


class SelectionContext:
    """One decision as selectors see it: the candidates, the policy, the rng and lazily built load inputs.

    ``engines`` are the eligible, non-busy candidates in ascending id order. ``inputs_fn`` builds the
    :class:`CostBatch` of a subset of them (selectors that ignore load never pay for it).
    ``interchangeable_fn`` (optional) gives groups of candidates whose cost inputs are all the same (idle
    engines with nothing of the request cached, one group per block size), each of two or more: a
    selector may score one of each group for all of them.
    """

    __slots__ = ("_inputs_fn", "_interchangeable_fn", "config", "engines", "overlaps", "pinned_engine", "rng")

    def __init__(
        self,
        engines: Sequence[int],
        config: RouterPolicyConfig,
        rng: random.Random,
        inputs_fn: Callable[[Sequence[int]], CostBatch],
        overlaps: Mapping[int, int] | None = None,
        pinned_engine: int | None = None,
        interchangeable_fn: Callable[[], list[Set[int]]] | None = None,
    ) -> None:
        self.engines = engines
        self.config = config
        self.rng = rng
        self._inputs_fn = inputs_fn
        self._interchangeable_fn = interchangeable_fn
        self.overlaps = overlaps or {}
        self.pinned_engine = pinned_engine

    def interchangeable(self) -> list[Set[int]]:
        """Groups of candidates with the same cost inputs (each of 2+); none when the context cannot tell."""
        return [] if self._interchangeable_fn is None else self._interchangeable_fn()

    def inputs(self, engines: Sequence[int] | None = None) -> CostBatch:
        """Cost inputs of ``engines`` (default: every candidate), in that order."""
        return self._inputs_fn(self.engines if engines is None else engines)

    @classmethod
    def from_inputs(
        cls,
        inputs: Sequence[CostInputs],
        config: RouterPolicyConfig | None = None,
        rng: random.Random | None = None,
        pinned_engine: int | None = None,
    ) -> SelectionContext:
        """A context over precomputed inputs (tests, offline analysis)."""
        by_id = {c.engine_id: c for c in inputs}
        return cls(
            sorted(by_id),
            config or RouterPolicyConfig(),
            rng or random.Random(0),
            lambda engines: CostBatch.from_rows([by_id[e] for e in engines]),
            {c.engine_id: c.overlap_blocks for c in inputs},
            pinned_engine,
        )


class Selector(Protocol):
    name: str

    def select(self, ctx: SelectionContext) -> Choice: ...


def reads_cache(mode: str) -> bool:
    """Whether routing mode ``mode``'s selector reads the prefix index or the bookings (see the module docstring)."""
    return bool(getattr(POLICIES.make_selector(mode), "reads_cache", True))


# ---------------------------------------------------------------------- cost -> index


def argmin_index(costs: Sequence[float], rng: random.Random) -> int:
    """Index of the lowest cost; ties broken uniformly at random."""
    best = min(costs)
    tied = [i for i, c in enumerate(costs) if c == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def softmax_probabilities(costs: Sequence[float], temperature: float) -> list[float]:
    """``p_i ∝ exp(-(c_i / range) / T)`` with range = max - min; uniform when all costs are equal."""
    lo = min(costs)
    spread = max(costs) - lo
    if spread <= 0 or not math.isfinite(spread):
        return [1.0 / len(costs)] * len(costs)
    width = spread * temperature
    scale = 1.0 / width if width > 0 else math.inf
    if math.isinf(scale):  # a temperature that vanishes next to the spread (0 * inf would be nan): the argmin
        ties = [c == lo for c in costs]
        share = 1.0 / sum(ties)
        return [share if tie else 0.0 for tie in ties]
    weights = [math.exp(-(c - lo) * scale) for c in costs]
    total = sum(weights)
    return [w / total for w in weights]


def softmax_index(costs: Sequence[float], temperature: float, rng: random.Random) -> int:
    """Sample an index from :func:`softmax_probabilities` (cumulative sum against ``U[0, 1)``)."""
    probs = softmax_probabilities(costs, temperature)
    r = rng.random()
    acc = 0.0
    for i, p in enumerate(probs):
        acc += p
        if r < acc:
            return i
    return len(probs) - 1


def pick_index(costs: Sequence[float], temperature: float, rng: random.Random) -> int:
    """Temperature 0: :func:`argmin_index`; otherwise :func:`softmax_index`."""
    if not costs:
        raise ValueError("no candidates")
    if temperature <= 0 or len(costs) == 1:
        return argmin_index(costs, rng)
    return softmax_index(costs, temperature, rng)


# ---------------------------------------------------------------------- selectors


class KvSelector:
    """Scores the candidates with the cost policy and picks (argmin, or softmax with a temperature).

    At temperature 0, with a policy that ``counts_copies``, each group of interchangeable candidates
    (:meth:`SelectionContext.interchangeable`: in a large fleet, most engines are idle and hold nothing
    of the request) is scored once, as one row with its copies, and a tie is expanded back to the engines
    before the random tie-break. Invariant: the same engine, cost and random draws as scoring every
    candidate (``tests/router/test_cost_and_selection.py``); only the work is O(distinct candidates).
    """

    name = "kv"
    reads_cache = True

    def select(self, ctx: SelectionContext) -> Choice:
        config = ctx.config
        policy = POLICIES.cost_policy(config.cost_policy)
        groups = ctx.interchangeable() if config.temperature <= 0 and getattr(policy, "counts_copies", False) else []
        if groups:
            return self._select_grouped(ctx, policy, groups)
        batch = ctx.inputs()
        if not len(batch):
            raise ValueError("no candidates")
        costs = policy_costs(policy, batch, fleet_context(batch), config)
        i = pick_index(costs, config.temperature, ctx.rng)
        return Choice(batch.engine_ids[i], costs[i])

    @staticmethod
    def _select_grouped(ctx: SelectionContext, policy: CostPolicy, groups: list[Set[int]]) -> Choice:
        engines = ctx.engines
        grouped: set[int] = set().union(*groups)
        rep_group = {min(group): group for group in groups}  # the first of a group in candidate order
        rows = sorted([e for e in engines if e not in grouped] + list(rep_group))  # candidate order
        batch = ctx.inputs(rows)
        batch.copies = [len(rep_group[e]) if e in rep_group else 1 for e in rows]
        costs = policy_costs(policy, batch, fleet_context(batch), ctx.config)
        best = min(costs)
        tied_rows = [e for e, c in zip(rows, costs, strict=True) if c == best]
        if len(tied_rows) == 1 and tied_rows[0] not in rep_group:
            return Choice(tied_rows[0], best)
        tie: set[int] = set()
        for e in tied_rows:
            tie |= rep_group.get(e, {e})
        # argmin_index's tie-break over every candidate: the same list, so the same draw picks the same engine
        return Choice(ctx.rng.choice([e for e in engines if e in tie]), best)


class RoundRobinSelector:
    """The candidate picked least recently. Per engine, not one cursor: a cursor after the last pick,
    shared by every model's candidate pool, let one model's picks move it past another's engines, and
    under A, A, B traffic one of B's two engines got no request at all."""

    name = "round_robin"
    reads_cache = False
    _FORGET_AT = 65536  # engines remembered; past it the half picked longest ago are forgotten

    def __init__(self) -> None:
        self._picked: dict[int, int] = {}  # engine id -> pick number of its last pick
        self._picks = 0

    def select(self, ctx: SelectionContext) -> Choice:
        if not ctx.engines:
            raise ValueError("no candidates")
        picked = self._picked
        engine = min(ctx.engines, key=lambda e: (picked.get(e, 0), e))  # ties: the lowest id
        self._picks += 1
        picked[engine] = self._picks
        if len(picked) > self._FORGET_AT:  # engines that left the fleet long ago
            recent = sorted(picked.items(), key=lambda item: item[1])[len(picked) // 2 :]
            self._picked = dict(recent)
        return Choice(engine)


class RandomSelector:
    name = "random"
    reads_cache = False

    def select(self, ctx: SelectionContext) -> Choice:
        if not ctx.engines:
            raise ValueError("no candidates")
        return Choice(ctx.rng.choice(ctx.engines))


class PowerOfTwoSelector:
    name = "power_of_two"
    reads_cache = True  # a booking's queued prefill is its prompt less the cached overlap

    def select(self, ctx: SelectionContext) -> Choice:
        engines = ctx.engines
        if not engines:
            raise ValueError("no candidates")
        picks = [engines[0]] if len(engines) == 1 else ctx.rng.sample(engines, 2)
        b = ctx.inputs(picks)
        loads = [a + p / bs for a, p, bs in zip(b.active_blocks, b.active_prefill_tokens, b.block_size, strict=True)]
        i = 1 if len(loads) == 2 and loads[1] < loads[0] else 0
        return Choice(picks[i], loads[i])


class DirectSelector:
    name = "direct"
    reads_cache = False

    def select(self, ctx: SelectionContext) -> Choice:
        engine = ctx.pinned_engine
        if engine is None:
            raise RoutingError("direct routing needs a pinned engine")
        if engine not in ctx.engines:
            raise UnknownEngineError(engine)
        return Choice(engine)


for _selector in (KvSelector, RoundRobinSelector, RandomSelector, PowerOfTwoSelector, DirectSelector):
    POLICIES.register_selector(_selector.name, _selector)
