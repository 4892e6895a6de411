"""Synthesize a Mooncake-format trace that keeps a source trace's prefix structure (``kvmesh datagen synthesize``).

Learning (see :mod:`kvmesh_bench.datagen.prefix_tree`): the source's core radix tree of shared prefixes with
per-node transition CDFs (children, "end", "cache end"), the empirical distribution of unique-leaf lengths,
the residual ISL (tokens in the last block), the OSL, the number of requests per timestamp and the gaps
between timestamps.

Sampling one request: walk the core tree from the root, picking each transition from the node's CDF, until
"end" (the request ends in the core tree) or "cache end" (append a unique leaf of a sampled length, with
fresh hash ids). ``input_length = (blocks - 1) * block_size + residual``, so
``len(hash_ids) == ceil(input_length / block_size)`` always holds; the OSL is drawn from its empirical
distribution.

Every empirical distribution (each node's transitions, leaf lengths, residuals, OSLs, requests per timestamp,
gaps) is sampled *stratified* by default: a shuffled deck of the source's values, dealt one by one and
reshuffled when it runs out, so over a pass the values come out in the source's proportions (sampling
without replacement). The probabilities are exactly the empirical CDFs', only the variance is lower: with
as many requests as the source, every core node is visited as often as in the source and the means and the
infinite-cache hit rate are reproduced. Independent draws (``sampling="iid"``, Dynamo's behaviour) leave some
rarely used prefixes unvisited and overstate the hit rate (+3.8% relative expected on the conversation trace,
more on smaller traces), and their means wander by a few percent on a small source.

Knobs: ``prefix_len_multiplier`` stretches every core node (its length in blocks, rounded, at least 1);
``prefix_root_multiplier`` k makes k copies of the core tree with disjoint ids, each request using a random
copy (drawn like the other distributions, so stratified copies take turns in shuffled order);
``prompt_len_multiplier`` scales unique-leaf lengths; ``osl_multiplier`` scales the OSL; ``speedup_ratio``
divides the gaps between timestamps; ``min_isl``/``max_isl`` drop requests outside the range (sampling goes
on until ``num_requests`` are kept). Output hash ids: the core tree's nodes get contiguous ids ``0 .. C-1``
(copy j: ``j*C ..``), the unique leaves fresh ids from ``k*C`` on. Same seed, same output.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Generic, Literal, TypeVar

import networkx as nx

from kvmesh_bench.datagen.prefix_tree import ROOT, CoreTree, extract_core_tree, request_exits
from kvmesh_bench.trace import DEFAULT_BLOCK_SIZE, TraceRequest

__all__ = ["DatagenError", "SynthesisConfig", "Synthesizer", "synthesize"]

_END = -1
_CACHE_END = -2


class DatagenError(ValueError):
    """Bad synthesizer settings or a source trace the synthesizer cannot learn from."""


@dataclass(frozen=True)
class SynthesisConfig:
    """The synthesizer's knobs (all multipliers 1: a trace statistically like the source)."""

    prefix_len_multiplier: float = 1.0
    prefix_root_multiplier: int = 1
    prompt_len_multiplier: float = 1.0
    osl_multiplier: float = 1.0
    speedup_ratio: float = 1.0
    min_isl: int | None = None
    max_isl: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    seed: int = 0
    sampling: Literal["stratified", "iid"] = "stratified"
    order_jitter_s: float | None = 15.0

    def validate(self) -> None:
        """Raise :class:`DatagenError` for an out-of-range knob."""
        for name in ("prefix_len_multiplier", "prompt_len_multiplier", "osl_multiplier", "speedup_ratio"):
            value = getattr(self, name)
            if not value > 0:
                raise DatagenError(f"{name.replace('_', '-')} must be positive, got {value}")
        if isinstance(self.prefix_root_multiplier, bool) or self.prefix_root_multiplier < 1:
            raise DatagenError(f"prefix-root-multiplier must be an integer >= 1, got {self.prefix_root_multiplier}")
        if self.block_size < 1:
            raise DatagenError(f"block-size must be at least 1, got {self.block_size}")
        if self.min_isl is not None and self.min_isl < 0:
            raise DatagenError(f"min-isl must be non-negative, got {self.min_isl}")
        if self.max_isl is not None and self.max_isl < 0:
            raise DatagenError(f"max-isl must be non-negative, got {self.max_isl}")
        if self.min_isl is not None and self.max_isl is not None and self.min_isl > self.max_isl:
            raise DatagenError(f"min-isl ({self.min_isl}) is larger than max-isl ({self.max_isl})")
        if self.order_jitter_s is not None and not (self.order_jitter_s >= 0 and math.isfinite(self.order_jitter_s)):
            raise DatagenError(f"order-jitter must be a finite number of seconds >= 0, got {self.order_jitter_s}")
        if self.sampling not in ("stratified", "iid"):
            raise DatagenError(f"sampling must be 'stratified' or 'iid', got {self.sampling!r}")


def _scale(length: int, multiplier: float) -> int:
    return length if multiplier == 1 else max(1, round(length * multiplier))


class Synthesizer:
    """Learns a source trace's statistics once; :meth:`generate` samples new requests from them."""

    def __init__(self, source: Sequence[TraceRequest], config: SynthesisConfig | None = None) -> None:
        self.config = config = config or SynthesisConfig()
        config.validate()
        if not source:
            raise DatagenError("the source trace has no requests")
        self.num_source_requests = len(source)
        self.tree: CoreTree = extract_core_tree(source)
        index = self._compile_tree(self.tree.graph)

        block_size = config.block_size
        if any(r.hash_ids for r in source) and not any(
            r.hash_ids and 0 < r.input_length - (len(r.hash_ids) - 1) * block_size <= block_size for r in source
        ):
            raise DatagenError(
                f"no request has len(hash_ids) == ceil(input_length / {block_size}): is --block-size right?"
            )
        # Every source request's walk: which outcome it took at each core node it passed, and at the node it
        # left the tree its own (unique leaf length, residual tokens, OSL), all stamped with its arrival time.
        n = len(self._length)
        self._outcomes: list[list[int]] = [[] for _ in range(n)]
        self._outcome_times: list[list[float]] = [[] for _ in range(n)]
        self._profiles: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        self._profile_times: dict[tuple[int, int], list[float]] = {}
        prompt_multiplier = config.prompt_len_multiplier
        for request, (path, covered) in zip(source, request_exits(self.tree.graph, source), strict=True):
            t = float(request.timestamp_ms)
            nodes = [index[node] for node in path]
            for parent, child in pairwise(nodes):
                self._outcomes[parent].append(child)
                self._outcome_times[parent].append(t)
            blocks = len(request.hash_ids)
            kind = _CACHE_END if covered < blocks else _END
            self._outcomes[nodes[-1]].append(kind)
            self._outcome_times[nodes[-1]].append(t)
            leaf = _scale(blocks - covered, prompt_multiplier) if covered < blocks else 0
            residual = min(max(request.input_length - (blocks - 1) * block_size, 1), block_size) if blocks else 0
            self._profiles.setdefault((nodes[-1], kind), []).append((leaf, residual, request.output_length))
            self._profile_times.setdefault((nodes[-1], kind), []).append(t)
        timestamps = sorted(request.timestamp_ms for request in source)
        per_timestamp = Counter(timestamps)
        self.requests_per_timestamp = list(per_timestamp.values())
        self.stamp_times = [float(t) for t in per_timestamp]
        distinct = list(per_timestamp)
        self.timestamp_gaps = [later - earlier for earlier, later in pairwise(distinct)]

    def _compile_tree(self, graph: nx.DiGraph) -> dict[Hashable, int]:
        """Number the core tree's nodes (preorder) and assign their output ids; returns node -> number."""
        multiplier = self.config.prefix_len_multiplier
        index: dict[Hashable, int] = {}
        order: list[Hashable] = []
        stack: list[Hashable] = [ROOT]
        while stack:  # preorder, children in first-appearance order
            node = stack.pop()
            index[node] = len(order)
            order.append(node)
            stack.extend(reversed(list(graph.successors(node))))
        self._first_id: list[int] = []
        self._length: list[int] = []
        next_id = 0
        for node in order:
            length = 0 if node == ROOT else _scale(graph.nodes[node]["length"], multiplier)
            self._first_id.append(next_id)
            self._length.append(length)
            next_id += length
        #: Output hash ids per copy of the core tree; copy j uses [j * core_ids, (j + 1) * core_ids).
        self.core_ids = next_id
        return index

    def generate(self, num_requests: int | None = None) -> list[TraceRequest]:
        """Sample ``num_requests`` requests (default: as many as the source). Same config, same output."""
        config = self.config
        count = self.num_source_requests if num_requests is None else num_requests
        if count < 1:
            raise DatagenError(f"num-requests must be at least 1, got {count}")
        rng = random.Random(config.seed)
        stratified = config.sampling == "stratified"
        jitter_ms = None if config.order_jitter_s is None else config.order_jitter_s * 1000.0

        def sampler(values: Sequence[_T], times: Sequence[float] | None = None) -> _Sampler[_T]:
            return _Sampler(values, rng, stratified, times, jitter_ms)

        group_sizes = sampler(self.requests_per_timestamp, self.stamp_times)
        gaps = sampler(self.timestamp_gaps, self.stamp_times[1:])
        copy_offsets = sampler([copy * self.core_ids for copy in range(config.prefix_root_multiplier)])
        transitions: dict[int, _Sampler[int]] = {}
        profiles: dict[tuple[int, int], _Sampler[tuple[int, int, int]]] = {}

        copies = config.prefix_root_multiplier
        block_size = config.block_size
        next_leaf_id = copies * self.core_ids
        max_attempts = 100 * count + 10_000
        attempts = 0
        out: list[TraceRequest] = []
        clock = 0.0
        while len(out) < count:
            for _ in range(group_sizes.draw()):
                attempts += 1
                if attempts > max_attempts:
                    raise DatagenError(
                        f"the ISL filter (min-isl {config.min_isl}, max-isl {config.max_isl}) kept only {len(out)} "
                        f"of {attempts - 1} sampled requests; widen it"
                    )
                offset = copy_offsets.draw() if copies > 1 else 0
                ids: list[int] = []
                node = 0  # the root; walk the core tree
                while True:
                    transition = transitions.get(node)
                    if transition is None:
                        transition = transitions[node] = sampler(self._outcomes[node], self._outcome_times[node])
                    outcome = transition.draw()
                    if outcome < 0:
                        break
                    first = self._first_id[outcome] + offset
                    ids.extend(range(first, first + self._length[outcome]))
                    node = outcome
                key = (node, outcome)
                profile = profiles.get(key)
                if profile is None:
                    profile = profiles[key] = sampler(self._profiles[key], self._profile_times[key])
                leaf, residual, output_length = profile.draw()
                if leaf:
                    ids.extend(range(next_leaf_id, next_leaf_id + leaf))
                    next_leaf_id += leaf
                input_length = (len(ids) - 1) * block_size + residual if ids else 0
                if config.osl_multiplier != 1 and output_length > 0:
                    output_length = max(1, round(output_length * config.osl_multiplier))
                if (config.min_isl is not None and input_length < config.min_isl) or (
                    config.max_isl is not None and input_length > config.max_isl
                ):
                    continue
                out.append(TraceRequest(round(clock), input_length, output_length, tuple(ids)))
                if len(out) >= count:
                    break
            if self.timestamp_gaps:
                clock += gaps.draw() / config.speedup_ratio
        start = out[0].timestamp_ms
        if start:  # the ISL filter dropped the first groups: times count from the first kept request
            out = [dataclasses.replace(r, timestamp_ms=r.timestamp_ms - start) for r in out]
        return out


_T = TypeVar("_T")


class _Sampler(Generic[_T]):
    """Draws from an empirical distribution: a deck of the values (stratified) or independent picks.

    A stratified deck is dealt whole before it is dealt again. With the values' source ``times`` and a
    ``jitter_ms``, a deck is dealt in the order of ``time + N(0, jitter)`` (the source's order, locally
    shuffled); otherwise in a random order.
    """

    __slots__ = ("_deck", "_jitter", "_rng", "_stratified", "_times", "_values")

    def __init__(
        self,
        values: Sequence[_T],
        rng: random.Random,
        stratified: bool,
        times: Sequence[float] | None = None,
        jitter_ms: float | None = None,
    ) -> None:
        self._values: Sequence[_T] = values
        self._rng = rng
        self._stratified = stratified
        self._times = times if jitter_ms is not None else None
        self._jitter = jitter_ms or 0.0
        self._deck: list[_T] = []

    def draw(self) -> _T:
        if not self._stratified:
            return self._values[self._rng.randrange(len(self._values))]
        if not self._deck:
            if self._times is None:
                self._deck = list(self._values)
                self._rng.shuffle(self._deck)
            else:
                gauss, jitter, times = self._rng.gauss, self._jitter, self._times
                keys = [t + gauss(0.0, jitter) if jitter else t for t in times]
                order = sorted(range(len(keys)), key=keys.__getitem__, reverse=True)  # dealt from the end
                self._deck = [self._values[i] for i in order]
        return self._deck.pop()


def synthesize(
    source: Sequence[TraceRequest], config: SynthesisConfig | None = None, num_requests: int | None = None
) -> list[TraceRequest]:
    """Learn from ``source`` and sample ``num_requests`` requests (default: as many as the source)."""
    return Synthesizer(source, config).generate(num_requests)
