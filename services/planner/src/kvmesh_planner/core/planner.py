"""``PlannerCore``: observations in, one decision per interval out. Pure: no I/O, no clock, no randomness.

Invariants (tests: ``tests/planner/test_core.py``):

- **Bounds.** Every target is within its pool's [min, max], and the targets of all managed pools add up to
  at most ``max_engines`` (the budget wins over the minimums only when they cannot all fit). Over the budget,
  growth is taken back first: a pool's scale-up never shrinks another pool.
- **One step at a time in load mode.** A pool moves by at most +-1 per decision, and only when *every* ready
  engine of the pool agrees (all above the scale-up threshold, or all below the scale-down one).
- **No scaling on stale capacity.** While a pool has engines starting, it is not scaled up again (the
  engines it already asked for have not absorbed the load yet) nor down.
- **Anti-oscillation.** A scale-down needs (load mode) ``down_confirmations`` consecutive intervals of
  agreement, the load projected onto one engine fewer to stay below ``down_projection_margin`` x the
  scale-up threshold, and ``scale_down_cooldown_s`` since the pool's last change; in SLA mode a lower
  count must be predicted ``sla_down_confirmations`` intervals in a row (one noisy ISL/OSL sample does
  not drain an engine) unless the predictor's trend points down (a falling rate is no blip). A scale-up
  only waits for ``scale_up_cooldown_s``: being late to scale up costs SLA, late to scale down engine-seconds.
- **Look-ahead (SLA).** A pool is sized for the larger of the next interval's predicted rate and the rate
  ``lookahead_s`` later (trend extrapolated): engines asked for now serve only after their start-up.
- **Corrections compare like with like.** The latency expected for the next interval, against which the
  observed one corrects the targets, is the latency of the engines that will serve it (those ready now),
  not of the target fleet (engines still starting serve nothing).
- **Disaggregated pools (SLA)** are sized apart: prefill engines on the TTFT target from ISL x rate, decode
  engines on the ITL target from OSL x rate at context ISL + OSL/2; TTFT corrects the prefill pool, ITL the
  decode pool.
- **Decision ids** are consecutive from ``first_decision_id``; a decision that changes nothing still gets
  one (the audit trail has every interval), so a new leader continues from the last committed id.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvmesh_planner.core.model import (
    Decision,
    EngineObservation,
    Observation,
    PlannerConfig,
    Pool,
    Prediction,
)
from kvmesh_planner.core.predictors import Predictor, make_predictor
from kvmesh_planner.core.profile import EngineProfile

# Dynamo's load-scaling thresholds (components/src/dynamo/planner/core/load_scaling.py), (up, down).
PREFILL_THRESHOLDS = {"throughput": (1.0, 0.1), "latency": (0.1, 0.0)}
"""Prefill: queued_prefill_tokens / context_length."""
KV_THRESHOLDS = {"throughput": (1.0, 0.6), "latency": (0.4, 0.1)}
"""Decode and aggregated: KV utilization (scheduled + queued tokens / KV capacity)."""


@dataclass(slots=True)
class _PoolState:
    last_change: float = -math.inf
    last_up: float = -math.inf
    down_streak: int = 0


@dataclass(slots=True)
class _SlaState:
    rate: Predictor
    isl: Predictor
    osl: Predictor
    ttft_cf: float = 1.0
    itl_cf: float = 1.0
    expected: tuple[float, float] | None = None  # (TTFT, ITL) the previous decision expected


@dataclass(slots=True)
class PlannerCore:
    config: PlannerConfig
    profile: EngineProfile | None = None
    first_decision_id: int = 1
    _next_id: int = field(init=False)
    _pools: dict[Pool, _PoolState] = field(init=False)
    _sla: _SlaState = field(init=False)
    _targets: dict[Pool, int] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.config.mode == "sla" and self.profile is None:
            raise ValueError("SLA mode needs an engine profile")
        self._next_id = self.first_decision_id
        self._pools = {p: _PoolState() for p in self.config.pools}
        name = self.config.predictor
        self._sla = _SlaState(make_predictor(name), make_predictor(name), make_predictor(name))

    @property
    def next_decision_id(self) -> int:
        return self._next_id

    def decide(self, obs: Observation) -> Decision:
        """The next decision. ``obs.actual`` is what exists now; the targets start from it."""
        previous: dict[Pool, int] = {p: int(obs.actual.get(p, 0)) for p in self.config.pools}
        if self.config.mode == "sla":
            target, reason, inputs, prediction = self._decide_sla(obs, previous)
        else:
            target, reason, inputs, prediction = self._decide_load(obs, previous)
        target, clamp_note = self._clamp(target, previous)
        if clamp_note:
            reason = f"{reason}; {clamp_note}"
        for pool in self.config.pools:
            if target[pool] != previous[pool]:
                state = self._pools[pool]
                state.last_change = obs.now
                state.down_streak = 0
                if target[pool] > previous[pool]:
                    state.last_up = obs.now
        decision = Decision(self._next_id, obs.now, self.config.mode, previous, target, reason, inputs, prediction)
        self._next_id += 1
        return decision

    # -- load mode ------------------------------------------------------------------------------
    def _decide_load(
        self, obs: Observation, previous: dict[Pool, int]
    ) -> tuple[dict[Pool, int], str, dict[str, float], Prediction | None]:
        cfg = self.config
        target = dict(previous)
        reasons: list[str] = []
        inputs: dict[str, float] = {}
        for pool in cfg.pools:
            engines = [e for e in obs.engines if e.pool == pool]
            metric, (up, down) = _load_metric(pool, cfg.load_profile)
            values = [metric(e) for e in engines]
            inputs[f"{pool}.ready"] = len(engines)
            inputs[f"{pool}.starting"] = obs.starting.get(pool, 0)
            if values:
                inputs[f"{pool}.metric_min"] = min(values)
                inputs[f"{pool}.metric_max"] = max(values)
                inputs[f"{pool}.metric_mean"] = sum(values) / len(values)
            state = self._pools[pool]
            n = previous[pool]
            if n < cfg.pools[pool].minimum:
                target[pool] = cfg.pools[pool].minimum
                reasons.append(f"{pool}: below its minimum {cfg.pools[pool].minimum}")
                continue
            if not values:
                reasons.append(f"{pool}: no ready engine to observe")
                continue
            if obs.starting.get(pool, 0):
                state.down_streak = 0
                reasons.append(f"{pool}: {obs.starting[pool]} engine(s) still starting, holding")
                continue
            name = "queued_prefill/context" if pool == "prefill" else "kv_utilization"
            if all(v >= up for v in values):
                state.down_streak = 0
                if obs.now - state.last_up < cfg.scale_up_cooldown_s:
                    reasons.append(f"{pool}: every engine's {name} >= {up} but in scale-up cooldown")
                    continue
                target[pool] = n + 1
                reasons.append(f"{pool}: every engine's {name} >= {up} (min {min(values):.3f}): +1")
                continue
            below = all((v <= down) if down == 0 else (v < down) for v in values)
            if not below:
                state.down_streak = 0
                reasons.append(f"{pool}: {name} in band [{min(values):.3f}, {max(values):.3f}]")
                continue
            state.down_streak += 1
            projected = sum(values) / max(1, n - 1)
            if n - 1 < cfg.pools[pool].minimum:
                reasons.append(f"{pool}: idle but at its minimum")
            elif state.down_streak < cfg.down_confirmations:
                reasons.append(f"{pool}: below {down} for {state.down_streak}/{cfg.down_confirmations} intervals")
            elif obs.now - state.last_change < cfg.scale_down_cooldown_s:
                reasons.append(f"{pool}: below {down} but in scale-down cooldown")
            elif projected >= cfg.down_projection_margin * up:
                reasons.append(f"{pool}: one engine fewer would carry {projected:.3f}, too close to {up}")
            else:
                target[pool] = n - 1
                reasons.append(f"{pool}: every engine's {name} below {down} for {state.down_streak} intervals: -1")
        return target, "; ".join(reasons), inputs, None

    # -- SLA mode -------------------------------------------------------------------------------
    def _decide_sla(
        self, obs: Observation, previous: dict[Pool, int]
    ) -> tuple[dict[Pool, int], str, dict[str, float], Prediction | None]:
        cfg, sla = self.config, self._sla
        assert self.profile is not None
        target = dict(previous)
        inputs: dict[str, float] = {}
        traffic = obs.traffic
        if traffic is not None and traffic.interval_s > 0 and traffic.is_finite():  # else no observation
            inputs.update(
                requests=traffic.requests,
                request_rate=traffic.request_rate,
                mean_isl=traffic.mean_isl,
                mean_osl=traffic.mean_osl,
            )
            sla.rate.observe(traffic.request_rate)
            if traffic.requests:
                sla.isl.observe(traffic.mean_isl)
                sla.osl.observe(traffic.mean_osl)
            self._correct(traffic.ttft_ms, traffic.itl_ms, inputs)
        rate, isl, osl = sla.rate.predict(), sla.isl.predict(), sla.osl.predict()
        ahead = sla.rate.predict_ahead(1.0 + cfg.lookahead_s / cfg.interval_s) if cfg.lookahead_s > 0 else rate
        pools = list(cfg.pools)
        if rate is None or isl is None or osl is None:
            for pool in pools:
                target[pool] = max(previous[pool], cfg.pools[pool].minimum)
            return target, "no traffic observed yet: holding", inputs, None
        shape = cfg.shape
        lo, hi = cfg.correction_bounds
        ttft_goal = cfg.ttft_ms * cfg.sla_headroom / min(hi, max(lo, sla.ttft_cf))
        itl_goal = cfg.itl_ms * cfg.sla_headroom / min(hi, max(lo, sla.itl_cf))
        eff_isl = isl * (1.0 - cfg.kv_hit_rate)
        plan_rate = max(rate, ahead if ahead is not None else rate)
        if cfg.lookahead_s > 0:
            inputs["rate_ahead"] = plan_rate
        later = sla.rate.predict_ahead(2.0)
        falling = later is not None and later < rate  # the trend points down: a lower count is no blip
        ahead_note = f" ({plan_rate:.3g} {cfg.lookahead_s:g} s later)" if plan_rate > rate else ""
        reasons: list[str] = []
        serving: dict[Pool, int] = {}
        capacity: dict[Pool, float] = {}
        for pool in pools:
            # Aggregated engines carry prefill and decode; a prefill engine is sized on TTFT alone, a decode
            # engine on ITL alone (Dynamo's SLA planner: prefill from ISL x rate, decode from OSL x rate).
            if pool == "prefill":
                per_engine = self.profile.prefill_rate(eff_isl, ttft_goal, shape)
            elif pool == "decode":
                per_engine = self.profile.decode_rate(isl, osl, itl_goal, shape)
            else:
                per_engine = self.profile.max_rate(eff_isl, osl, ttft_goal, itl_goal, shape)
            capacity[pool] = per_engine
            inputs[f"{pool}.engine_rate"] = per_engine
            if plan_rate <= 0:  # no traffic: nothing to size for, whatever one engine could carry
                needed = 0
            elif per_engine <= 0:  # no engine meets the targets at this shape: the most there may be
                needed = cfg.pools[pool].maximum
            else:
                needed = math.ceil(plan_rate / per_engine - 1e-9)
            reason = f"{pool}: predicted {rate:.3g} req/s{ahead_note} / {per_engine:.3g} req/s per engine -> {needed}"
            if per_engine <= 0 and plan_rate > 0:
                reason += " (no engine meets the latency targets at this load's shape)"
            want, reason = self._guard_sla(
                pool, max(cfg.pools[pool].minimum, needed), previous[pool], obs, falling, reason
            )
            target[pool] = want
            reasons.append(reason)
            # The next interval is served by the engines ready now (those asked for are still starting): the
            # correction factors compare the observed latency with what *they* should give, not the target fleet.
            ready = sum(1 for e in obs.engines if e.pool == pool)
            serving[pool] = max(1, min(want, ready) if ready else want)
        # TTFT is the prefill pool's (or the aggregated one's), ITL the decode pool's (or the aggregated one's).
        agg = (
            self.profile.latency(rate / serving["aggregated"], eff_isl, osl, shape) if "aggregated" in serving else None
        )
        expected_ttft = expected_itl = math.nan
        if "prefill" in serving:
            expected_ttft = self.profile.prefill_ttft(rate / serving["prefill"], eff_isl, shape)
        elif agg is not None:
            expected_ttft = agg[0]
        if "decode" in serving:
            expected_itl = self.profile.decode_itl(rate / serving["decode"], isl, osl, shape)
        elif agg is not None:
            expected_itl = agg[1]
        sla.expected = (expected_ttft, expected_itl)
        inputs.update(
            {k: v for k, v in (("expected_ttft_ms", expected_ttft), ("expected_itl_ms", expected_itl)) if v == v}
        )
        prediction = Prediction(
            rate, isl, osl, sla.ttft_cf, sla.itl_cf, capacity[pools[0]], sla.rate.name, dict(capacity)
        )
        return target, "; ".join(reasons), inputs, prediction

    def _guard_sla(
        self, pool: Pool, want: int, n: int, obs: Observation, falling: bool, reason: str
    ) -> tuple[int, str]:
        """The SLA mode's anti-oscillation on one pool's wanted size (see the module's invariants)."""
        cfg = self.config
        state = self._pools[pool]
        state.down_streak = state.down_streak + 1 if want < n else 0
        if want < n:
            if state.down_streak < cfg.sla_down_confirmations and not falling:
                return n, f"{reason}; lower for {state.down_streak}/{cfg.sla_down_confirmations} intervals"
            if obs.starting.get(pool, 0):
                return n, f"{reason}; holding while engines start"
            if obs.now - state.last_change < cfg.scale_down_cooldown_s:
                return n, f"{reason}; holding (scale-down cooldown)"
            return max(want, n - max(1, n // 4)), reason  # shed at most a quarter per interval (one at least)
        if want > n and obs.now - state.last_up < cfg.scale_up_cooldown_s:
            return n, f"{reason}; holding (scale-up cooldown)"
        return want, reason

    def _correct(self, ttft_ms: float | None, itl_ms: float | None, inputs: dict[str, float]) -> None:
        """Observed / expected latency of the interval just ended, smoothed into the correction factors."""
        sla, cfg = self._sla, self.config
        if sla.expected is None:
            return
        lo, hi = cfg.correction_bounds
        w = cfg.correction_smoothing
        exp_ttft, exp_itl = sla.expected
        if ttft_ms is not None and math.isfinite(exp_ttft) and exp_ttft > 0:
            inputs["observed_ttft_ms"] = ttft_ms
            sla.ttft_cf = min(hi, max(lo, (1 - w) * sla.ttft_cf + w * ttft_ms / exp_ttft))
        if itl_ms is not None and math.isfinite(exp_itl) and exp_itl > 0:
            inputs["observed_itl_ms"] = itl_ms
            sla.itl_cf = min(hi, max(lo, (1 - w) * sla.itl_cf + w * itl_ms / exp_itl))

    # -- bounds ---------------------------------------------------------------------------------
    def _clamp(self, target: Mapping[Pool, int], previous: Mapping[Pool, int]) -> tuple[dict[Pool, int], str]:
        cfg = self.config
        out = {p: min(cfg.pools[p].maximum, max(cfg.pools[p].minimum, target[p])) for p in cfg.pools}
        note = ""
        if sum(out.values()) > cfg.max_engines:
            # Over the budget: first take back growth (the pool that grew most gives first), so one pool's
            # scale-up never shrinks another pool that did not ask to (a shrink there would skip its guards);
            # only if the pools' sizes before the decision already exceed the budget, shrink the largest pools.
            while sum(out.values()) > cfg.max_engines:
                grown = [p for p in out if out[p] > previous.get(p, 0)]
                if grown:
                    pool = max(grown, key=lambda p: (out[p] - previous.get(p, 0), out[p]))
                else:
                    pool = max(out, key=lambda p: out[p])
                    if out[pool] == 0:
                        break
                out[pool] -= 1
            note = f"clamped to the budget of {cfg.max_engines} engines"
        return out, note


def _load_metric(pool: Pool, profile: str) -> tuple[Callable[[EngineObservation], float], tuple[float, float]]:
    if pool == "prefill":
        return _prefill_ratio, PREFILL_THRESHOLDS[profile]
    return _kv_utilization, KV_THRESHOLDS[profile]


def _prefill_ratio(e: EngineObservation) -> float:
    return e.prefill_queue_ratio


def _kv_utilization(e: EngineObservation) -> float:
    return e.kv_utilization
