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
    base = dict(pools={"aggregated": PoolBounds(1, 4)}, max_engines=4, down_confirmations=2, scale_down_cooldown_s=30.0)
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


def disagg_obs(now: float, prefill: list[EngineObservation], decode: list[EngineObservation]) -> Observation:
    return Observation(now, (*prefill, *decode), {"prefill": len(prefill), "decode": len(decode)}, {})


def test_load_mode_scales_prefill_and_decode_pools_each_on_its_own_metric():
    """Prefill follows queued prefill tokens / context length, decode its KV utilization; one pool's change
    leaves the other where it is, and each pool keeps its own scale-down streak."""
    cfg = load_cfg(pools={"prefill": PoolBounds(1, 4), "decode": PoolBounds(1, 4)}, max_engines=8)
    core = PlannerCore(cfg)
    # Prefill queues a full context on every engine (ratio 1.0 >= 1.0); decode is in band (KV 0.8).
    d = core.decide(disagg_obs(0, [eng(1, 0.0, queued=1000, pool="prefill")], [eng(2, 0.8, pool="decode")]))
    assert d.target == {"prefill": 2, "decode": 1}
    assert (
        "prefill: every engine's queued_prefill/context >= 1.0" in d.reason
        and "decode: kv_utilization in band" in d.reason
    )
    # Now decode is idle (KV 0.1 < 0.6) for two intervals while prefill stays busy: decode shrinks, prefill grows.
    busy = [eng(1, 0.0, queued=1500, pool="prefill"), eng(3, 0.0, queued=1200, pool="prefill")]
    idle = [eng(2, 0.1, pool="decode"), eng(4, 0.05, pool="decode")]
    d = core.decide(disagg_obs(40, busy, idle))
    assert d.target == {"prefill": 3, "decode": 2} and "decode: below 0.6 for 1/2 intervals" in d.reason
    d = core.decide(disagg_obs(80, busy, idle))
    assert d.target == {"prefill": 3, "decode": 1}
    assert "decode: every engine's kv_utilization below 0.6 for 2 intervals: -1" in d.reason


def test_load_mode_prefill_latency_profile_scales_down_only_on_an_empty_queue():
    cfg = load_cfg(
        pools={"prefill": PoolBounds(1, 4), "decode": PoolBounds(1, 4)},
        max_engines=8,
        load_profile="latency",
        down_confirmations=1,
        scale_down_cooldown_s=0.0,
    )
    core = PlannerCore(cfg)
    decode = [eng(9, 0.2, pool="decode")]  # in the latency band [0.1, 0.4)
    d = core.decide(disagg_obs(0, [eng(1, queued=100, pool="prefill")], decode))  # 0.1 >= 0.1: up
    assert d.target == {"prefill": 2, "decode": 1}
    d = core.decide(disagg_obs(10, [eng(1, queued=1, pool="prefill"), eng(2, pool="prefill")], decode))
    assert d.target["prefill"] == 2  # one queued token: not "= 0", no scale-down
    d = core.decide(disagg_obs(20, [eng(1, pool="prefill"), eng(2, pool="prefill")], decode))
    assert d.target == {"prefill": 1, "decode": 1}


def test_over_the_budget_a_scale_up_never_shrinks_another_pool():
    """Budget 5, prefill 1 + decode 4: prefill asking for a second engine is refused, decode keeps its 4."""
    cfg = load_cfg(pools={"prefill": PoolBounds(1, 4), "decode": PoolBounds(1, 4)}, max_engines=5)
    core = PlannerCore(cfg)
    decode = [eng(10 + i, 0.8, pool="decode") for i in range(4)]
    d = core.decide(disagg_obs(0, [eng(1, queued=5000, pool="prefill")], decode))
    assert d.target == {"prefill": 1, "decode": 4} and "budget of 5" in d.reason
    # Both pools over their thresholds: the growth is taken back, neither pool goes below what it has.
    core = PlannerCore(load_cfg(pools={"prefill": PoolBounds(1, 4), "decode": PoolBounds(1, 4)}, max_engines=4))
    hot = [eng(10, 2.0, pool="decode"), eng(11, 2.0, pool="decode")]
    d = core.decide(disagg_obs(0, [eng(1, queued=5000, pool="prefill")], hot))
    assert sum(d.target.values()) == 4 and d.target["prefill"] >= 1 and d.target["decode"] >= 2


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
    fleet = [eng(i) for i in range(4)]  # what 20 req/s needs, all ready: their latency is what is expected
    plain.decide(obs(0, *fleet, traffic=traffic(20)))
    corrected.decide(obs(0, *fleet, traffic=traffic(20)))
    a = plain.decide(obs(10, *fleet, traffic=traffic(20)))
    b = corrected.decide(obs(10, *fleet, traffic=traffic(20, ttft=5000.0, itl=100.0)))
    assert b.prediction is not None and b.prediction.itl_correction > 1.0
    assert b.target["aggregated"] > a.target["aggregated"]
    assert "observed_itl_ms" in b.inputs
    # An overloaded fleet (one engine at 20 req/s) is expected to saturate: its latency corrects nothing.
    lone = PlannerCore(sla_cfg(), profile)
    lone.decide(obs(0, eng(1), traffic=traffic(20)))
    c = lone.decide(obs(10, eng(1), starting=3, traffic=traffic(20, ttft=5000.0, itl=100.0)))
    assert c.prediction is not None and c.prediction.itl_correction == 1.0


def test_sla_correction_learns_engines_three_times_faster_than_the_profile():
    """Prefix-cache hits the profile does not model make real engines far faster than it predicts: the
    correction follows them down to a third (a floor of 0.5 held an engine too many at every peak)."""
    profile = load_profile(None)
    core = PlannerCore(sla_cfg(), profile)
    fleet = [eng(i) for i in range(4)]
    first = core.decide(obs(0, *fleet, traffic=traffic(20)))
    expected_ttft, expected_itl = first.inputs["expected_ttft_ms"], first.inputs["expected_itl_ms"]
    decision, sizes = first, []
    for k in range(1, 8):
        fast = traffic(20, ttft=expected_ttft / 3, itl=expected_itl / 3)
        decision = core.decide(obs(10 * k, *fleet, traffic=fast))
        sizes.append(decision.target["aggregated"])
        expected_ttft, expected_itl = decision.inputs["expected_ttft_ms"], decision.inputs["expected_itl_ms"]
    assert decision.prediction is not None and first.prediction is not None
    assert decision.prediction.itl_correction == pytest.approx(1 / 3, abs=0.02)
    assert decision.prediction.ttft_correction == pytest.approx(1 / 3, abs=0.02)
    assert decision.prediction.itl_correction >= 1 / 3  # never past the floor, however fast they look
    assert decision.prediction.engine_request_rate > 1.3 * first.prediction.engine_request_rate
    assert first.target["aggregated"] == 4 and min(sizes) == 3  # one engine fewer serves the same traffic


def test_sla_scale_down_sheds_at_most_a_quarter_per_interval():
    core = PlannerCore(sla_cfg(), load_profile(None))
    d = core.decide(Observation(0, (), {"aggregated": 12}, {}, traffic(0.5)))
    assert d.target["aggregated"] == 12 and "1/2 intervals" in d.reason  # one low interval is not enough
    d = core.decide(Observation(10, (), {"aggregated": 12}, {}, traffic(0.5)))
    assert d.target["aggregated"] == 9
    core = PlannerCore(sla_cfg(), load_profile(None))  # a quarter of 5 is one engine, not two (40 %)
    for t in (0, 10):
        d = core.decide(Observation(t, (), {"aggregated": 5}, {}, traffic(0.5)))
    assert d.target["aggregated"] == 4


def test_no_traffic_sizes_the_pool_at_its_minimum_even_where_no_engine_meets_the_targets():
    """One engine's modelled capacity of 0 (targets no engine meets at this shape) sized every pool at its
    maximum, also with no request at all: 4 idle engines for good."""
    core = PlannerCore(sla_cfg(ttft_ms=0.001), load_profile(None))
    busy = core.decide(obs(0, eng(1), traffic=traffic(5)))
    assert busy.target["aggregated"] == 16 and "no engine meets the latency targets" in busy.reason
    idle = PlannerCore(sla_cfg(ttft_ms=0.001), load_profile(None)).decide(obs(0, eng(1), traffic=traffic(0)))
    assert idle.target["aggregated"] == 1


def test_sla_lookahead_sizes_the_pool_for_the_rate_when_the_new_engines_arrive():
    """On a rising rate the look-ahead asks now for the engines the trend says are needed a start-up later."""
    profile = load_profile(None)
    plain = PlannerCore(sla_cfg(predictor="kalman"), profile)
    ahead = PlannerCore(sla_cfg(predictor="kalman", lookahead_s=60.0), profile)
    for t in range(12):  # 2, 4, ... 24 req/s: +2 req/s per interval
        a = plain.decide(obs(10 * t, eng(1), traffic=traffic(2.0 + 2 * t)))
        b = ahead.decide(obs(10 * t, eng(1), traffic=traffic(2.0 + 2 * t)))
    assert a.prediction is not None and b.prediction is not None
    assert b.prediction.request_rate == pytest.approx(a.prediction.request_rate)  # same next-interval prediction
    assert b.inputs["rate_ahead"] == pytest.approx(b.prediction.request_rate + 6 * 2.0, rel=0.1)  # 6 more intervals
    assert b.target["aggregated"] == math.ceil(b.inputs["rate_ahead"] / b.prediction.engine_request_rate)
    assert b.target["aggregated"] > a.target["aggregated"]
    assert "60 s later" in b.reason and "rate_ahead" not in a.inputs


def test_sla_falling_trend_scales_down_without_waiting_for_confirmations():
    """A lower count on a falling trend is no blip: it applies at once; on a flat series it must repeat."""
    profile = load_profile(None)
    falling = PlannerCore(sla_cfg(predictor="kalman"), profile)
    for t in range(8):  # 30, 27, ... req/s with a pool of 8 that 30 req/s needs
        d = falling.decide(Observation(10 * t, (), {"aggregated": 8}, {}, traffic(30.0 - 3 * t)))
    assert d.target["aggregated"] < 8 and "intervals" not in d.reason
    flat = PlannerCore(sla_cfg(predictor="kalman"), profile)
    for t in range(8):
        d = flat.decide(Observation(10 * t, (), {"aggregated": 8}, {}, traffic(5.0)))
        if t == 0:
            assert d.target["aggregated"] == 8 and "1/2 intervals" in d.reason


def test_sla_expected_latency_is_that_of_the_engines_ready_now():
    """While new engines start, the interval is served by the ready ones: the correction compares with them."""
    profile = load_profile(None)
    core = PlannerCore(sla_cfg(), profile)
    d = core.decide(obs(0, eng(1), eng(2), traffic=traffic(14)))
    assert d.target["aggregated"] > 2
    expected_ttft, expected_itl, _ = profile.latency(14 / 2, 3000, 300, EngineShape())
    assert d.inputs["expected_itl_ms"] == pytest.approx(expected_itl)
    assert d.inputs["expected_ttft_ms"] == pytest.approx(expected_ttft)
    # The next interval observes exactly that latency: no correction.
    d = core.decide(obs(10, eng(1), eng(2), starting=1, traffic=traffic(14, ttft=expected_ttft, itl=expected_itl)))
    assert d.prediction is not None
    assert d.prediction.itl_correction == pytest.approx(1.0) and d.prediction.ttft_correction == pytest.approx(1.0)


def disagg_cfg(**kw) -> PlannerConfig:
    return sla_cfg(pools={"prefill": PoolBounds(1, 16), "decode": PoolBounds(1, 16)}, max_engines=32, **kw)


def test_sla_sizes_prefill_from_isl_and_decode_from_osl():
    """Prefill engines follow ISL x rate against TTFT, decode engines OSL x rate against ITL, each on its own."""
    profile, shape = load_profile(None), EngineShape()
    d = PlannerCore(disagg_cfg(), profile).decide(
        obs(0, eng(1, pool="prefill"), eng(2, pool="decode"), traffic=traffic(20))
    )
    per_prefill = profile.prefill_rate(3000, 600 * 0.7, shape)
    per_decode = profile.decode_rate(3000, 300, 30 * 0.7, shape)
    assert d.target == {"prefill": math.ceil(20 / per_prefill), "decode": math.ceil(20 / per_decode)}
    assert d.inputs["prefill.engine_rate"] == pytest.approx(per_prefill)
    assert d.inputs["decode.engine_rate"] == pytest.approx(per_decode)
    assert d.prediction is not None
    assert d.prediction.engine_request_rates == pytest.approx({"prefill": per_prefill, "decode": per_decode})
    assert "prefill: predicted 20 req/s" in d.reason and "decode: predicted 20 req/s" in d.reason
    # Four times the prompt: more prefill engines. Four times the output: more decode engines, prefill unchanged.
    long_prompts = PlannerCore(disagg_cfg(), profile).decide(obs(0, traffic=traffic(20, isl=12000)))
    long_outputs = PlannerCore(disagg_cfg(), profile).decide(obs(0, traffic=traffic(20, osl=1200)))
    assert long_prompts.target["prefill"] > d.target["prefill"]
    assert long_outputs.target["decode"] > d.target["decode"]
    assert long_outputs.target["prefill"] == d.target["prefill"]


def test_disaggregated_capacity_meets_its_target_exactly_at_the_edge():
    profile, shape = load_profile(None), EngineShape()
    r = profile.prefill_rate(3000, 400.0, shape)
    assert profile.prefill_ttft(r, 3000, shape) == pytest.approx(400.0, rel=1e-3)
    assert profile.prefill_ttft(r * 1.05, 3000, shape) > 400.0
    r = profile.decode_rate(3000, 300, 20.0, shape)
    assert profile.decode_itl(r, 3000, 300, shape) == pytest.approx(20.0, rel=1e-3)
    assert profile.decode_itl(r * 1.05, 3000, 300, shape) > 20.0
    # A prefill engine that only prefills carries more prompts than an aggregated one under the same targets.
    assert profile.prefill_rate(3000, 420, shape) > profile.max_rate(3000, 300, 420, 21, shape)


def test_sla_ttft_over_expectation_grows_the_prefill_pool_only():
    profile = load_profile(None)
    plain, corrected = PlannerCore(disagg_cfg(), profile), PlannerCore(disagg_cfg(), profile)
    fleet = [eng(i, pool="prefill") for i in range(4)] + [eng(10 + i, pool="decode") for i in range(4)]
    first = plain.decide(obs(0, *fleet, traffic=traffic(40)))
    corrected.decide(obs(0, *fleet, traffic=traffic(40)))
    expected_ttft = first.inputs["expected_ttft_ms"]
    expected_itl = first.inputs["expected_itl_ms"]
    a = plain.decide(obs(10, *fleet, traffic=traffic(40, ttft=expected_ttft, itl=expected_itl)))
    b = corrected.decide(obs(10, *fleet, traffic=traffic(40, ttft=10 * expected_ttft, itl=expected_itl)))
    assert b.prediction is not None and b.prediction.ttft_correction > 1.0
    assert b.prediction.itl_correction == pytest.approx(1.0)
    assert b.target["prefill"] > a.target["prefill"] and b.target["decode"] == a.target["decode"]


def test_sla_disaggregated_pools_share_the_budget():
    core = PlannerCore(
        sla_cfg(pools={"prefill": PoolBounds(1, 16), "decode": PoolBounds(1, 16)}, max_engines=6), load_profile(None)
    )
    d = core.decide(obs(0, traffic=traffic(200)))
    assert sum(d.target.values()) == 6 and min(d.target.values()) >= 1 and "budget of 6" in d.reason


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
    assert k.predict_ahead(3.0) == pytest.approx(24.0, rel=0.1)  # the trend extrapolated
    assert m.predict_ahead(3.0) == m.predict()  # no trend: flat
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


@pytest.mark.parametrize("predictor", ["constant", "moving_average", "kalman"])
def test_traffic_that_is_no_number_is_no_observation(predictor: str):
    """One NaN mean ISL raised in some predictors (a failed tick) and poisoned the Kalman one for good:
    a steady pool of 5 shrank to 1. It is ignored, as an interval with no figure is."""
    profile = load_profile(None)
    steady, poisoned = (
        PlannerCore(sla_cfg(predictor=predictor), profile),
        PlannerCore(sla_cfg(predictor=predictor), profile),
    )
    fleet = [eng(i) for i in range(5)]
    for k in range(12):
        bad = traffic(20, isl=math.nan) if k == 4 else traffic(20)
        expected = steady.decide(obs(10 * k, *fleet, traffic=None if k == 4 else traffic(20)))
        assert poisoned.decide(obs(10 * k, *fleet, traffic=bad)).target == expected.target
