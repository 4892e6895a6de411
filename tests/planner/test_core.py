"""The planner's decision core on hand-made observations: load mode, SLA mode, bounds, predictors, profile."""

from __future__ import annotations

import math

import numpy as np
import pytest
from kvmesh_planner.core import (
    EngineObservation,
    Observation,
    PlannerConfig,
    PlannerCore,
    PoolBounds,
    TrafficObservation,
    load_profile,
    make_predictor,
)
from kvmesh_planner.core.model import EngineShape

TOTAL = 1000


def eng(i: int, util: float = 0.0, queued: int = 0, pool: str = "aggregated", ctx: int = 1000) -> EngineObservation:
    return EngineObservation(i, pool, int(util * TOTAL), TOTAL, queued, ctx)  # type: ignore[arg-type]


def load_cfg(**kw) -> PlannerConfig:
    base = dict(
        pools={"aggregated": PoolBounds(1, 4)}, max_engines=4, down_confirmations=2, scale_down_cooldown_s=30.0
    )
    base.update(kw)
    return PlannerConfig(**base)  # type: ignore[arg-type]


def obs(now: float, *engines: EngineObservation, starting: int = 0, traffic=None, pool="aggregated") -> Observation:
    return Observation(now, engines, {pool: len(engines) + starting}, {pool: starting}, traffic)


# -- load mode --------------------------------------------------------------------------------------
def test_load_scales_up_by_one_only_when_every_engine_is_over_the_threshold():
    core = PlannerCore(load_cfg())
    d = core.decide(obs(0, eng(1, 1.0), eng(2, 0.5)))
    assert d.target["aggregated"] == 2 and not d.changed and "in band" in d.reason
    d = core.decide(obs(10, eng(1, 1.0), eng(2, 1.2)))
    assert d.target["aggregated"] == 3 and d.changed
    assert d.inputs["aggregated.metric_min"] == pytest.approx(1.0)


def test_load_latency_profile_uses_lower_thresholds():
    thr = PlannerCore(load_cfg(load_profile="throughput"))
    lat = PlannerCore(load_cfg(load_profile="latency"))
    o = obs(0, eng(1, 0.45), eng(2, 0.5))
    assert thr.decide(o).target["aggregated"] == 2
    assert lat.decide(o).target["aggregated"] == 3


def test_prefill_pool_uses_queued_tokens_over_context_length():
    cfg = load_cfg(pools={"prefill": PoolBounds(1, 4)})
    core = PlannerCore(cfg)
    d = core.decide(obs(0, eng(1, queued=1000, pool="prefill"), eng(2, queued=1200, pool="prefill"), pool="prefill"))
    assert d.target["prefill"] == 3
    lat = PlannerCore(load_cfg(pools={"prefill": PoolBounds(1, 4)}, load_profile="latency"))
    d = lat.decide(obs(0, eng(1, queued=100, pool="prefill"), pool="prefill"))
    assert d.target["prefill"] == 2  # 0.1 is the latency profile's scale-up ratio


def test_no_scale_up_while_engines_start():
    core = PlannerCore(load_cfg())
    d = core.decide(obs(0, eng(1, 1.5), eng(2, 1.5), starting=1))
    assert not d.changed and "starting" in d.reason


def test_scale_down_needs_confirmations_cooldown_and_a_safe_projection():
    core = PlannerCore(load_cfg())
    assert core.decide(obs(0, eng(1, 1.0), eng(2, 1.0))).target["aggregated"] == 3  # t=0: a change
    idle = (eng(1, 0.1), eng(2, 0.1), eng(3, 0.1))
    assert not core.decide(obs(10, *idle)).changed  # 1/2 confirmations
    d = core.decide(obs(20, *idle))
    assert not d.changed and "cooldown" in d.reason  # confirmed, but 20 s < 30 s since the change
    d = core.decide(obs(40, *idle))
    assert d.target["aggregated"] == 2 and "-1" in d.reason
    # Below 0.6 each, but one engine fewer would carry 0.55 * 3 / 2 = 0.83 >= 0.8 x 1.0: no.
    core2 = PlannerCore(load_cfg())
    busy = (eng(1, 0.55), eng(2, 0.55), eng(3, 0.55))
    for t in (100, 110, 120):
        d = core2.decide(obs(t, *busy))
    assert not d.changed and "too close" in d.reason


def test_a_reading_in_band_resets_the_scale_down_streak():
    core = PlannerCore(load_cfg(scale_down_cooldown_s=0))
    core.decide(obs(0, eng(1, 0.1), eng(2, 0.1)))
    core.decide(obs(10, eng(1, 0.7), eng(2, 0.1)))  # in band: streak resets
    assert not core.decide(obs(20, eng(1, 0.1), eng(2, 0.1))).changed
    assert core.decide(obs(30, eng(1, 0.1), eng(2, 0.1))).target["aggregated"] == 1


def test_bounds_and_budget():
    core = PlannerCore(load_cfg(pools={"aggregated": PoolBounds(2, 3)}))
    assert core.decide(obs(0, eng(1, 0.0))).target["aggregated"] == 2  # below minimum
    d = core.decide(obs(10, eng(1, 2.0), eng(2, 2.0), eng(3, 2.0)))
    assert d.target["aggregated"] == 3  # at maximum
    two = PlannerConfig(
        pools={"prefill": PoolBounds(1, 4), "decode": PoolBounds(1, 4)}, max_engines=3, down_confirmations=1
    )
    core = PlannerCore(two)
    o = Observation(
        0,
        (eng(1, queued=5000, pool="prefill"), eng(2, 2.0, pool="decode"), eng(3, 2.0, pool="decode")),
        {"prefill": 1, "decode": 2},
        {},
    )
    d = core.decide(o)
    assert sum(d.target.values()) <= 3 and "budget" in d.reason


def test_decision_ids_are_consecutive_from_the_first_id_and_every_decision_is_auditable():
    core = PlannerCore(load_cfg(), first_decision_id=41)
    ids = [core.decide(obs(t, eng(1, 0.5))).decision_id for t in (0, 10, 20)]
    assert ids == [41, 42, 43]
    d = core.decide(obs(30, eng(1, 1.5)))
    line = d.log_line()
    assert line.startswith("decision 44 mode=load aggregated=1->2") and "kv_utilization" in line


# -- SLA mode ---------------------------------------------------------------------------------------
def sla_cfg(**kw) -> PlannerConfig:
    base = dict(
        mode="sla",
        pools={"aggregated": PoolBounds(1, 16)},
        max_engines=16,
        ttft_ms=600.0,
        itl_ms=30.0,
        predictor="constant",
        scale_down_cooldown_s=0.0,
    )
    base.update(kw)
    return PlannerConfig(**base)  # type: ignore[arg-type]


def traffic(rate: float, isl: float = 3000, osl: float = 300, ttft=None, itl=None) -> TrafficObservation:
    return TrafficObservation(10.0, int(rate * 10), isl, osl, ttft, itl)


def test_sla_engines_follow_the_predicted_rate_through_the_profile():
    profile = load_profile(None)
    core = PlannerCore(sla_cfg(), profile)
    d = core.decide(obs(0, eng(1), traffic=traffic(20)))
    q = d.prediction
    assert q is not None and q.request_rate == pytest.approx(20)
    per_engine = profile.max_rate(3000, 300, 600 * 0.7, 30 * 0.7, EngineShape())
    assert q.engine_request_rate == pytest.approx(per_engine)
    assert d.target["aggregated"] == math.ceil(20 / per_engine)
    assert d.target["aggregated"] > 1
    # Higher traffic, more engines; the budget caps it.
    d2 = core.decide(obs(10, eng(1), traffic=traffic(200)))
    assert d2.target["aggregated"] == 16 and "budget" not in d2.reason  # the pool's max is the binding bound


def test_sla_holds_without_traffic_and_needs_a_profile():
    with pytest.raises(ValueError):
        PlannerCore(sla_cfg(), None)
    core = PlannerCore(sla_cfg(), load_profile(None))
    d = core.decide(obs(0, eng(1)))
    assert not d.changed and "no traffic" in d.reason


def test_sla_correction_factor_adds_engines_when_observed_latency_exceeds_the_expected():
    profile = load_profile(None)
    plain = PlannerCore(sla_cfg(), profile)
    corrected = PlannerCore(sla_cfg(), profile)
    plain.decide(obs(0, eng(1), traffic=traffic(20)))
    corrected.decide(obs(0, eng(1), traffic=traffic(20)))
    a = plain.decide(obs(10, eng(1), traffic=traffic(20)))
    b = corrected.decide(obs(10, eng(1), traffic=traffic(20, ttft=5000.0, itl=100.0)))
    assert b.prediction is not None and b.prediction.itl_correction > 1.0
    assert b.target["aggregated"] > a.target["aggregated"]
    assert "observed_itl_ms" in b.inputs


def test_sla_scale_down_sheds_at_most_a_quarter_per_interval():
    core = PlannerCore(sla_cfg(), load_profile(None))
    d = core.decide(Observation(0, (), {"aggregated": 12}, {}, traffic(0.5)))
    assert d.target["aggregated"] == 12 and "1/2 intervals" in d.reason  # one low interval is not enough
    d = core.decide(Observation(10, (), {"aggregated": 12}, {}, traffic(0.5)))
    assert d.target["aggregated"] == 9


# -- predictors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["constant", "moving_average", "kalman"])
def test_predictors_track_a_constant_series(name):
    p = make_predictor(name)
    assert p.predict() is None
    for _ in range(10):
        p.observe(5.0)
    assert p.predict() == pytest.approx(5.0, rel=0.05)


def test_kalman_follows_a_ramp_ahead_of_the_moving_average():
    k, m = make_predictor("kalman"), make_predictor("moving_average")
    for t in range(20):
        k.observe(2.0 + t)
        m.observe(2.0 + t)
    assert k.predict() == pytest.approx(22.0, rel=0.1)
    assert m.predict() < k.predict()
    with pytest.raises(ValueError):
        make_predictor("prophet")


# -- the profile ------------------------------------------------------------------------------------
def test_shipped_profile_matches_the_mockers_perf_model():
    from kvmesh_worker.engine.perf_model import PolynomialPerfModel

    m, p = PolynomialPerfModel(), load_profile("mocker-polynomial")
    for tokens in (1, 100, 1000, 3000, 8192):
        assert p.prefill_pass_ms(tokens) == pytest.approx(m.prefill_ms(tokens), rel=0.01)
    total = 16384 * 64
    for u in (0.0, 0.1, 0.5, 0.9):
        assert p.decode_ms(u * total, 4000) == pytest.approx(m.decode_ms(int(u * total), total, 4000), rel=0.01)


def test_profile_round_trips_through_the_worker_npz_loader(tmp_path):
    from kvmesh_bench.planner_sim import mocker_profile_arrays
    from kvmesh_worker.engine.perf_model import InterpolatedPerfModel

    path = tmp_path / "p.npz"
    np.savez(path, **mocker_profile_arrays())
    worker_side = InterpolatedPerfModel.from_npz(path)  # the same file drives a mocker engine
    planner_side = load_profile(str(path))
    assert planner_side.prefill_pass_ms(2000) == pytest.approx(worker_side.prefill_ms(2000))
    assert planner_side.decode_ms(300000, 2000) == pytest.approx(worker_side.decode_ms(300000, 16384 * 64, 2000))


def test_capacity_is_monotone_in_the_targets():
    p = load_profile(None)
    shape = EngineShape()
    loose = p.max_rate(3000, 300, 1000, 50, shape)
    tight = p.max_rate(3000, 300, 300, 20, shape)
    assert loose > tight > 0
    ttft, itl, _ = p.latency(tight, 3000, 300, shape)
    assert ttft <= 300 + 1e-6 and itl <= 20 + 1e-6
    assert p.max_rate(3000, 300, 10, 20, shape) == 0.0  # a prompt alone takes longer than 10 ms
