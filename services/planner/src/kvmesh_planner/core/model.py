"""What the planner core sees (observations), how it is configured, and what it says (decisions).

All plain frozen dataclasses: the daemon builds observations from gRPC streams and scrapes, the offline
simulation from its engine cores; both hand them to :class:`~kvmesh_planner.core.planner.PlannerCore`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Pool = Literal["aggregated", "prefill", "decode"]
POOLS: tuple[Pool, ...] = ("aggregated", "prefill", "decode")
Mode = Literal["load", "sla"]
LoadProfile = Literal["throughput", "latency"]


@dataclass(frozen=True, slots=True)
class EngineShape:
    """What one engine can hold (from its model card): the SLA mode's capacity model needs it."""

    total_kv_tokens: int = 16384 * 64
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    context_length: int = 16384 * 64


@dataclass(frozen=True, slots=True)
class EngineObservation:
    """One ready engine's load, as its worker reports it (``WatchLoad``) or the simulation reads it."""

    engine_id: int
    pool: Pool
    kv_active_tokens: int
    """KV tokens referenced by running requests (active blocks x block size)."""
    kv_total_tokens: int
    queued_prefill_tokens: int
    """Prompt tokens not yet computed, waiting and running requests together."""
    context_length: int
    running: int = 0
    waiting: int = 0
    router_active_requests: int = 0
    """The router's view (``GetActiveLoad``): requests it booked on this engine; 0 when unknown."""

    @property
    def kv_utilization(self) -> float:
        """Dynamo's decode metric: (scheduled + queued) KV tokens / KV capacity."""
        return (self.kv_active_tokens + self.queued_prefill_tokens) / max(1, self.kv_total_tokens)

    @property
    def prefill_queue_ratio(self) -> float:
        """Dynamo's prefill metric: queued prefill tokens / context length."""
        return self.queued_prefill_tokens / max(1, self.context_length)


@dataclass(frozen=True, slots=True)
class TrafficObservation:
    """The last interval's traffic and latency at the frontends (scraped, or measured by the simulation)."""

    interval_s: float
    requests: int
    """Requests that arrived (or, scraped, that finished) in the interval."""
    mean_isl: float
    mean_osl: float
    ttft_ms: float | None = None
    """Mean observed TTFT of the interval, None when nothing finished."""
    itl_ms: float | None = None
    """Mean observed inter-token latency of the interval, None when nothing finished."""

    @property
    def request_rate(self) -> float:
        return self.requests / self.interval_s if self.interval_s > 0 else 0.0

    def is_finite(self) -> bool:
        """Every figure a number: a predictor that learned one NaN would forecast NaN from then on."""
        figures = (self.interval_s, self.requests, self.mean_isl, self.mean_osl, self.ttft_ms, self.itl_ms)
        return all(math.isfinite(f) for f in figures if f is not None)


@dataclass(frozen=True, slots=True)
class Observation:
    """Everything one decision is computed from. ``now`` is seconds on any monotonic clock."""

    now: float
    engines: tuple[EngineObservation, ...]
    """Ready engines (registered in discovery and not draining)."""
    actual: Mapping[Pool, int]
    """Engines per pool that exist now: ready + starting (the connector's view)."""
    starting: Mapping[Pool, int] = field(default_factory=dict)
    """Engines per pool asked for but not ready yet."""
    traffic: TrafficObservation | None = None


@dataclass(frozen=True, slots=True)
class PoolBounds:
    minimum: int = 1
    maximum: int = 8


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """The decision core's knobs (the daemon's settings and the simulation's flags map onto these)."""

    mode: Mode = "load"
    load_profile: LoadProfile = "throughput"
    pools: Mapping[Pool, PoolBounds] = field(default_factory=lambda: {"aggregated": PoolBounds()})
    """Pools the planner manages, with their bounds; other pools are left alone."""
    max_engines: int = 8
    """Total engine budget over every managed pool."""
    interval_s: float = 10.0
    scale_up_cooldown_s: float = 0.0
    """Minimum time between two scale-ups of a pool (besides waiting for the engines it started)."""
    scale_down_cooldown_s: float = 60.0
    """Minimum time from any scale change of a pool to its next scale-down."""
    down_confirmations: int = 3
    """Load mode: consecutive intervals the scale-down condition must hold."""
    sla_down_confirmations: int = 2
    """SLA mode: consecutive intervals a lower engine count must be predicted before scaling down, unless the
    predictor's trend says the rate is falling (then one interval is enough)."""
    down_projection_margin: float = 0.8
    """Scale down only if the load moved onto one engine fewer stays below this x the scale-up threshold."""
    ttft_ms: float = 500.0
    itl_ms: float = 50.0
    sla_headroom: float = 0.7
    """SLA mode plans for mean latencies of this fraction of the targets (tails exceed means)."""
    predictor: str = "kalman"
    lookahead_s: float = 0.0
    """SLA mode also sizes each pool for the rate predicted this many seconds past the next interval (the
    predictor's trend extrapolated over the engines' start-up time): an engine asked for now serves only
    then, and one drained now cannot be back sooner."""
    correction_bounds: tuple[float, float] = (1 / 3, 3.0)
    """Observed / expected latency is believed up to 3x either way. The profile knows nothing of the prefix
    cache, so engines serving multi-turn traffic run well under its latencies (a third of its ITL on the
    synthesized conversation traces); a floor of 0.5 kept the planner from learning that and it bought an
    engine too many at every peak."""
    correction_smoothing: float = 0.5
    """Weight of the newest observed/expected ratio in the correction factors (exponential smoothing)."""
    shape: EngineShape = field(default_factory=EngineShape)
    kv_hit_rate: float = 0.0
    """Prompt share expected from the prefix cache (lowers the prefill work per request)."""


@dataclass(frozen=True, slots=True)
class Prediction:
    request_rate: float
    isl: float
    osl: float
    ttft_correction: float
    itl_correction: float
    engine_request_rate: float
    predictor: str
    engine_request_rates: Mapping[Pool, float] = field(default_factory=dict)
    """Per managed pool: requests per second one engine of that pool sustains."""


@dataclass(frozen=True, slots=True)
class Decision:
    """One decision and everything needed to audit it."""

    decision_id: int
    now: float
    mode: Mode
    previous: Mapping[Pool, int]
    target: Mapping[Pool, int]
    reason: str
    inputs: Mapping[str, float]
    prediction: Prediction | None = None

    @property
    def changed(self) -> bool:
        return any(self.target.get(p, 0) != self.previous.get(p, 0) for p in POOLS)

    def log_line(self) -> str:
        """The decision as one log line: id, sizes, reason, inputs, prediction."""
        sizes = " ".join(f"{p}={self.previous.get(p, 0)}->{self.target.get(p, 0)}" for p in self.target)
        inputs = " ".join(f"{k}={v:.4g}" for k, v in sorted(self.inputs.items()))
        pred = ""
        if self.prediction is not None:
            q = self.prediction
            pred = (
                f" prediction(rate={q.request_rate:.3g}/s isl={q.isl:.0f} osl={q.osl:.0f} "
                f"engine_rate={q.engine_request_rate:.3g}/s cf_ttft={q.ttft_correction:.2f} "
                f"cf_itl={q.itl_correction:.2f} {q.predictor})"
            )
        return f"decision {self.decision_id} mode={self.mode} {sizes} reason={self.reason!r} inputs({inputs}){pred}"
