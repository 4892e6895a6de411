"""The cost function and the selectors of every routing mode (no booking here: selectors are pure)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from kvmesh_router.cost import (
    MAX_WEIGHT,
    AffinityCost,
    CostBatch,
    CostInputs,
    DynamoCost,
    FleetContext,
    RouterConfigOverride,
    RouterPolicyConfig,
    dynamo_cost,
    fleet_context,
    policy_costs,
)
from kvmesh_router.policies import POLICIES
from kvmesh_router.selection import (
    Choice,
    KvSelector,
    PowerOfTwoSelector,
    RandomSelector,
    RoundRobinSelector,
    RoutingError,
    SelectionContext,
    UnknownEngineError,
    pick_index,
    softmax_probabilities,
)

BS = 4
FLEET = FleetContext(candidates=3, min_active_prefill_tokens=0, max_overlap_blocks=3)


def inputs(engine, *, overlap=0, prefill=0, active=0, new=None, isl=16, blocks=4, requests=0):
    """A candidate for a 16-token (4-block) request; ``new`` = request blocks not already active there."""
    new = blocks if new is None else new
    return CostInputs(engine, BS, isl, blocks, overlap, prefill, active, active + new, requests)


# ---------------------------------------------------------------------- cost


def test_dynamo_cost_by_hand_for_a_small_fleet():
    # cost = w * (active_prefill + isl - overlap * bs) / bs + (active_blocks + new_blocks)
    a = inputs(1, overlap=3, prefill=8, active=10, new=1)  # (8 + 16 - 12)/4 = 3   + 11 = 14
    b = inputs(2, overlap=0, prefill=0, active=2, new=4)  # (0 + 16 - 0)/4 = 4    +  6 = 10
    c = inputs(3, overlap=2, prefill=4, active=0, new=4)  # (4 + 16 - 8)/4 = 3    +  4 = 7
    policy = POLICIES.cost_policy("dynamo")
    w1 = RouterPolicyConfig()
    assert [policy.cost(x, FLEET, w1) for x in (a, b, c)] == [14.0, 10.0, 7.0]
    w2 = RouterPolicyConfig(overlap_score_weight=2.0)
    assert [policy.cost(x, FLEET, w2) for x in (a, b, c)] == [17.0, 14.0, 10.0]
    w0 = RouterPolicyConfig(overlap_score_weight=0.0)  # pure load balancing on decode blocks
    assert [policy.cost(x, FLEET, w0) for x in (a, b, c)] == [11.0, 6.0, 4.0]
    assert dynamo_cost(
        isl_tokens=16, overlap_blocks=3, block_size=4, active_prefill_tokens=8, potential_decode_blocks=11
    ) == pytest.approx(14.0)


def test_batch_costs_equal_row_costs_exactly():
    rng = random.Random(11)
    rows = [
        CostInputs(e, 16, 300, 18, rng.randrange(25), rng.randrange(5000), a, a + rng.randrange(19), rng.randrange(9))
        for e, a in enumerate(rng.randrange(400) for _ in range(50))
    ]
    batch = CostBatch.from_rows(rows)
    assert batch.rows() == rows
    fleet = fleet_context(batch)
    assert fleet == FleetContext(50, min(r.active_prefill_tokens for r in rows), max(r.overlap_blocks for r in rows))
    policy = DynamoCost()
    for config in (RouterPolicyConfig(), RouterPolicyConfig(overlap_score_weight=0.37)):
        assert policy_costs(policy, batch, fleet, config) == [policy.cost(r, fleet, config) for r in rows]
    with pytest.raises(ValueError):
        CostBatch.from_rows([inputs(1), inputs(2, isl=20)])


def test_kv_selector_picks_the_argmin_and_reports_its_cost():
    ctx = SelectionContext.from_inputs(
        [inputs(1, overlap=3, prefill=8, active=10, new=1), inputs(2, active=2), inputs(3, overlap=2, prefill=4)],
        RouterPolicyConfig(cost_policy="dynamo"),
    )
    assert KvSelector().select(ctx) == (3, 7.0)


def test_per_request_override_changes_the_weights():
    base = RouterPolicyConfig(cost_policy="dynamo", overlap_score_weight=1.0)
    over = base.with_override(RouterConfigOverride(overlap_score_weight=0.0, temperature=0.5))
    assert (over.overlap_score_weight, over.temperature, over.mode) == (0.0, 0.5, "kv")
    assert base.with_override(None) is base and base.with_override(RouterConfigOverride()) is base
    # weight 1: the cached engine wins on prefill; weight 0: the idle one wins on decode load
    cands = [inputs(1, overlap=4, active=6, new=0), inputs(2, active=0)]  # w=1: 6 vs 8; w=0: 6 vs 4
    assert KvSelector().select(SelectionContext.from_inputs(cands, base)).engine_id == 1
    zero = base.with_override(RouterConfigOverride(overlap_score_weight=0.0))
    assert KvSelector().select(SelectionContext.from_inputs(cands, zero)).engine_id == 2


def test_config_validation():
    with pytest.raises(ValueError):
        RouterPolicyConfig(mode="fastest")
    with pytest.raises(ValueError):
        RouterPolicyConfig(temperature=-1)
    with pytest.raises(ValueError):
        RouterPolicyConfig(overlap_score_weight=math.nan)
    with pytest.raises(ValueError):
        POLICIES.cost_policy("nope")


@pytest.mark.parametrize("weight", [MAX_WEIGHT * 10, 1e308, -0.5])
def test_weights_are_bounded_so_that_costs_stay_finite(weight):
    """A weight of 1e308 made costs inf and the near-tie band inf / inf = nan: no engine was the argmin."""
    with pytest.raises(ValueError, match="must be in"):
        RouterPolicyConfig(overlap_score_weight=weight)
    with pytest.raises(ValueError, match="decode_weight must be in"):
        RouterPolicyConfig(params={"decode_weight": weight})
    heaviest = RouterPolicyConfig(
        overlap_score_weight=MAX_WEIGHT, params=dict.fromkeys(AffinityCost.DEFAULTS, MAX_WEIGHT)
    )
    cands = [inputs(1, overlap=3, prefill=2**40, active=2**40), inputs(2, prefill=2**39, active=2**41)]
    costs = policy_costs(AffinityCost(), CostBatch.from_rows(cands), FLEET, heaviest)
    assert all(math.isfinite(c) for c in costs)
    assert KvSelector().select(SelectionContext.from_inputs(cands, heaviest)).engine_id in (1, 2)


def test_cost_policies_are_pluggable_and_selectable_by_name():
    class FewestRequests:
        name = "test_fewest_requests"

        def cost(self, c, fleet, config):
            return float(c.active_requests)

    POLICIES.register_cost_policy(FewestRequests())
    try:
        with pytest.raises(ValueError):
            POLICIES.register_cost_policy(FewestRequests())
        cands = [inputs(1, requests=5), inputs(2, requests=1, active=50)]
        dynamo = SelectionContext.from_inputs(cands)
        custom = SelectionContext.from_inputs(cands, RouterPolicyConfig(cost_policy="test_fewest_requests"))
        assert KvSelector().select(dynamo).engine_id == 1
        assert KvSelector().select(custom).engine_id == 2
    finally:
        POLICIES.unregister_cost_policy("test_fewest_requests")
    assert isinstance(POLICIES.cost_policy("dynamo"), DynamoCost)


# ---------------------------------------------------------------------- temperature


def test_temperature_zero_breaks_ties_uniformly_at_random():
    rng = random.Random(7)
    costs = [5.0, 3.0, 3.0, 9.0, 3.0]
    counts = Counter(pick_index(costs, 0.0, rng) for _ in range(3000))
    assert set(counts) == {1, 2, 4}
    assert all(800 < counts[i] < 1200 for i in (1, 2, 4))
    assert pick_index([4.0, 1.0, 2.0], 0.0, rng) == 1


def test_positive_temperature_samples_follow_the_softmax_of_normalised_costs():
    costs = [10.0, 12.0, 14.0]  # range 4 -> normalised 0, .5, 1; T = 0.5 -> p ∝ 1, e^-1, e^-2
    expected = [1.0, math.exp(-1), math.exp(-2)]
    expected = [x / sum(expected) for x in expected]
    assert softmax_probabilities(costs, 0.5) == pytest.approx(expected)
    rng = random.Random(1234)
    n = 20000
    counts = Counter(pick_index(costs, 0.5, rng) for _ in range(n))
    for i, p in enumerate(expected):
        assert counts[i] / n == pytest.approx(p, abs=0.015)


def test_softmax_of_equal_costs_is_uniform_and_high_temperature_flattens():
    assert softmax_probabilities([3.0, 3.0, 3.0, 3.0], 0.1) == [0.25] * 4
    hot = softmax_probabilities([0.0, 100.0], 100.0)
    assert hot[0] == pytest.approx(0.5, abs=0.01)
    cold = softmax_probabilities([0.0, 100.0], 0.01)
    assert cold[0] > 0.999


@pytest.mark.parametrize("temperature", [5e-324, 1e-320])
def test_a_temperature_too_small_to_scale_the_costs_picks_the_argmin(temperature):
    """spread x temperature underflowed to 0 (a division by zero) or 1 / it overflowed to inf (0 x inf = nan)."""
    assert softmax_probabilities([7.0, 3.0, 6403.0, 3.0], temperature) == [0.0, 0.5, 0.0, 0.5]
    assert pick_index([7.0, 3.0, 6403.0], temperature, random.Random(0)) == 1


# ---------------------------------------------------------------------- modes


def _ctx(engines, rng=None, pinned=None, loads=None):
    loads = loads or {}
    by_id = {e: inputs(e, active=loads.get(e, 0)) for e in engines}
    return SelectionContext(
        sorted(engines),
        RouterPolicyConfig(),
        rng or random.Random(0),
        lambda es: CostBatch.from_rows([by_id[e] for e in es]),
        pinned_engine=pinned,
    )


def test_round_robin_cycles_in_id_order_and_survives_membership_changes():
    rr = RoundRobinSelector()
    assert [rr.select(_ctx([3, 1, 2])).engine_id for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    # engine 2 leaves: continue after the last pick (1) with the next id present
    assert [rr.select(_ctx([1, 3])).engine_id for _ in range(3)] == [3, 1, 3]


def test_round_robin_gives_each_pools_engines_their_turns_whatever_the_other_pools_traffic():
    """One selector serves every model: model A's picks must not move model B's turn (one cursor shared by
    the pools gave all of B's requests to one of its two engines under A, A, B traffic)."""
    pools = {"A": [10, 20], "B": [15, 25]}
    for pattern in ("AAB", "ABB", "AB", "AAAB"):
        rr = RoundRobinSelector()
        picks: dict[int, int] = {}
        for model in pattern * 12:
            engine = rr.select(_ctx(pools[model])).engine_id
            picks[engine] = picks.get(engine, 0) + 1
        for model, engines in pools.items():
            counts = [picks.get(e, 0) for e in engines]
            assert max(counts) - min(counts) <= 1, (pattern, model, counts)


def test_random_is_seeded_and_covers_all_engines():
    def run(seed):
        rng = random.Random(seed)
        return [RandomSelector().select(_ctx([1, 2, 3], rng)).engine_id for _ in range(100)]

    assert run(5) == run(5)
    assert set(run(5)) == {1, 2, 3}


def test_power_of_two_picks_the_less_loaded_of_two_random_candidates():
    rng = random.Random(3)
    sel = PowerOfTwoSelector()
    # Two engines: both are always sampled, the lighter always wins.
    assert {sel.select(_ctx([1, 2], rng, loads={1: 10, 2: 3})).engine_id for _ in range(50)} == {2}
    # Three engines: the heaviest loses to either other; the lightest wins whenever it is sampled.
    picks = Counter(sel.select(_ctx([1, 2, 3], rng, loads={1: 10, 2: 3, 3: 5})).engine_id for _ in range(600))
    assert picks[1] == 0
    assert picks[2] > picks[3] > 0
    assert sel.select(_ctx([7], rng)).engine_id == 7


def test_direct_pins_and_rejects_unknown_engines():
    sel = POLICIES.make_selector("direct")
    assert sel.select(_ctx([1, 2, 3], pinned=2)).engine_id == 2
    with pytest.raises(UnknownEngineError) as err:
        sel.select(_ctx([1, 2, 3], pinned=9))
    assert err.value.engine_id == 9 and "9" in str(err.value)
    with pytest.raises(RoutingError):
        sel.select(_ctx([1, 2, 3]))


def test_one_registry_knows_every_mode_and_cost_policy():
    assert POLICIES.modes == ("kv", "round_robin", "random", "power_of_two", "direct")
    for mode in POLICIES.modes:
        assert POLICIES.make_selector(mode).name == mode
    assert POLICIES.make_selector("round_robin") is not POLICIES.make_selector("round_robin")  # own cursor each
    assert {"dynamo", "affinity"} <= set(POLICIES.cost_policies)
    with pytest.raises(ValueError):
        POLICIES.make_selector("fastest")


def test_selectors_are_pluggable_and_selectable_by_name_globally_or_per_query():
    class HighestId:
        name = "test_highest_id"

        def select(self, ctx):
            return Choice(max(ctx.engines))

    POLICIES.register_selector(HighestId.name, HighestId)
    try:
        with pytest.raises(ValueError):
            POLICIES.register_selector(HighestId.name, HighestId)
        assert RouterPolicyConfig().with_override(RouterConfigOverride(mode="test_highest_id")).mode == HighestId.name
        assert POLICIES.make_selector(HighestId.name).select(_ctx([1, 5, 3])).engine_id == 5
    finally:
        POLICIES.unregister_selector(HighestId.name)
    with pytest.raises(ValueError):
        RouterPolicyConfig(mode="test_highest_id")


# ---------------------------------------------------------------------- interchangeable candidates


@pytest.mark.parametrize("policy", ["affinity", "dynamo"])
def test_scoring_each_group_of_idle_engines_once_changes_no_decision(policy, monkeypatch) -> None:
    """In a large fleet most engines are idle and hold nothing of the request: the kv selector scores one
    of each such group (per block size) for all of them. Decisions, their costs and every random draw are
    those of scoring each engine, through bookings, frees, prefill marks and cached prefixes."""
    from kvmesh.hashing import block_hashes
    from kvmesh_router import admission as admission_module
    from kvmesh_router.admission import Admission, Decision, EngineSpec, RouteRequest
    from kvmesh_router.indexer import KvIndexer
    from kvmesh_router.settings import RouterSettings
    from kvmesh_router.slot_tracker import SlotTracker

    def run(grouping: bool) -> list[object]:
        monkeypatch.setattr(admission_module, "_GROUPING_MIN_CANDIDATES", 2 if grouping else 10**9)
        index, slots = KvIndexer(max_entries=None), SlotTracker(16)
        admission = Admission(
            index,
            slots,
            config=RouterPolicyConfig(cost_policy=policy),
            thresholds=RouterSettings().busy_thresholds(),
            rng=random.Random(0),
        )
        for e in range(1, 161):  # two block sizes: two groups of idle engines
            admission.add_engine(EngineSpec(e, 400, 16 if e % 5 else 32, 512, max_requests=4))
            index.add_engine(e)
        workload = random.Random(1)
        prefixes = [[workload.randrange(2000) for _ in range(48)] for _ in range(6)]
        booked: list[str] = []
        seen: list[object] = []
        for k in range(600):
            tokens = workload.choice(prefixes) + [workload.randrange(2000) for _ in range(workload.randrange(64))]
            local, seq = block_hashes(tokens, 16)
            decision = admission.decide(RouteRequest(f"r{k}", seq, len(tokens), 16), now=k * 0.01)
            seen.append((decision.engine_id, decision.cost, decision.overlap_blocks)
                        if isinstance(decision, Decision) else decision.reason)  # fmt: skip
            if isinstance(decision, Decision):
                booked.append(f"r{k}")
                if workload.random() < 0.7:
                    index.store_chain(decision.engine_id, None, seq, local)
                if workload.random() < 0.5:
                    admission.mark_prefill_completed(booked[workload.randrange(len(booked))])
            while len(booked) > workload.randrange(10, 120):
                admission.free(booked.pop(workload.randrange(len(booked))))
        return [*seen, admission.rng.random()]

    grouped, each = run(grouping=True), run(grouping=False)
    assert grouped == each
    assert len({s[0] for s in each[:-1] if isinstance(s, tuple)}) > 20  # the load spread over the fleet
