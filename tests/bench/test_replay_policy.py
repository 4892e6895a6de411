"""The ``affinity`` cost policy on hand-made inputs, side by side with Dynamo's."""

import random

import pytest
from kvmesh_router.cost import (
    AffinityCost,
    CostBatch,
    CostInputs,
    RouterConfigOverride,
    RouterPolicyConfig,
    fleet_context,
    policy_costs,
)
from kvmesh_router.policies import POLICIES
from kvmesh_router.selection import KvSelector, SelectionContext

BS = 16
ISL = 320  # 20 blocks


def row(engine, overlap, prefill=0, active=0, already=0, requests=0):
    return CostInputs(engine, BS, ISL, ISL // BS, overlap, prefill, active, active + ISL // BS - already, requests)


def costs(rows, policy, **params):
    if policy == "affinity":  # the hand-computed figures below leave the decode term out unless they set it
        params = {"decode_weight": 0.0, **params}
    config = RouterPolicyConfig(cost_policy=policy, params=params)
    batch = CostBatch.from_rows(rows)
    return policy_costs(POLICIES.cost_policy(policy), batch, fleet_context(batch), config)


def test_both_policies_are_registered_and_dynamo_stays_the_documented_formula():
    assert {"dynamo", "affinity"} <= set(POLICIES.cost_policies)
    # Dynamo: (prefill tokens + new tokens) / bs + decode blocks.
    assert costs([row(1, 10, prefill=800, active=100)], "dynamo") == [(800 + 320 - 160) / 16 + 120]


def test_affinity_by_hand():
    rows = [row(1, 10), row(2, 0)]
    # No backlog anywhere: own uncached blocks only.
    assert costs(rows, "affinity") == [20 - 10, 20]
    # 800 queued prefill tokens (50 blocks) on the cached engine, none on the other (the fleet minimum):
    # credit 10 / (1 + 0.15 * 800 / 320) = 7.2727..., new 12.7272..., backlog 0.05 * 50 = 2.5.
    rows = [row(1, 10, prefill=800), row(2, 0)]
    a, b = costs(rows, "affinity")
    assert a == pytest.approx(20 - 10 / 1.375 + 2.5)
    assert b == 20
    # Dynamo sends that request away from its cache; affinity keeps it there.
    d1, d2 = costs(rows, "dynamo")
    assert d2 < d1 and a < b


def test_affinity_knobs():
    rows = [row(1, 10, prefill=800, active=300), row(2, 0, active=0)]
    # backlog_weight 1, no decay, decode weight 1: Dynamo's ranking exactly (same numbers).
    same = costs(rows, "affinity", backlog_weight=1.0, credit_decay=0.0, decode_weight=1.0, near_tie=0.0)
    assert same == costs(rows, "dynamo")
    # No decay: the full 10 blocks of credit.
    assert costs(rows, "affinity", credit_decay=0.0)[0] == pytest.approx(20 - 10 + 2.5)
    # A per-request override merges its params into the global ones.
    config = RouterPolicyConfig(cost_policy="dynamo").with_override(
        RouterConfigOverride(cost_policy="affinity", params={"backlog_weight": 0.5})
    )
    batch = CostBatch.from_rows(rows)
    decode = 0.05 * (300 + 20)  # the default decode weight times the engine's potential decode blocks
    assert policy_costs(AffinityCost(), batch, fleet_context(batch), config)[0] == pytest.approx(
        20 - 10 / 1.375 + 0.5 * 50 + decode
    )


def test_a_short_request_does_not_queue_behind_a_huge_backlog_for_its_cache():
    # 5 cached blocks of a 6-block request, but 100k tokens queued there: the decayed credit is ~0.
    short = [
        CostInputs(1, BS, 96, 6, 5, 100_000, 0, 6, 1),
        CostInputs(2, BS, 96, 6, 0, 0, 0, 6, 0),
    ]
    a, b = costs(short, "affinity")
    assert b < a


def test_batch_and_row_costs_agree_bit_for_bit():
    rng = random.Random(3)
    rows = [
        CostInputs(e, BS, ISL, 20, rng.randint(0, 20), rng.randint(0, 50_000), a := rng.randint(0, 5000), a + 7, 3)
        for e in range(12)
    ]
    batch = CostBatch.from_rows(rows)
    fleet = fleet_context(batch)
    # (near_tie re-ranks within the batch, which a row alone cannot see: off here)
    config = RouterPolicyConfig(cost_policy="affinity", params={"decode_weight": 0.01, "near_tie": 0.0})
    policy = AffinityCost()
    assert policy.costs(batch, fleet, config) == [policy.cost(r, fleet, config) for r in rows]


def test_the_selector_picks_the_cached_engine_under_affinity():
    rows = [row(1, 10, prefill=800, active=40), row(2, 0)]
    for policy, expected in (("affinity", 1), ("dynamo", 2)):
        ctx = SelectionContext.from_inputs(rows, RouterPolicyConfig(cost_policy=policy))
        assert KvSelector().select(ctx).engine_id == expected


def test_near_ties_go_to_the_engine_dynamo_would_pick():
    # Same cache on both (a shared system prompt), no backlog: affinity alone ties them and leaves the
    # pick to chance; with near_tie the engine holding less decode memory wins (Dynamo's pick).
    rows = [row(1, 2, active=900), row(2, 2, active=100)]
    assert costs(rows, "affinity", near_tie=0.0)[0] == costs(rows, "affinity", near_tie=0.0)[1]
    a, b = costs(rows, "affinity", near_tie=0.05)
    assert b < a
    ctx = SelectionContext.from_inputs(rows, RouterPolicyConfig(cost_policy="affinity", params={"near_tie": 0.05}))
    assert KvSelector().select(ctx).engine_id == 2


def test_a_cache_hit_beyond_the_near_tie_band_still_wins():
    # 10 of 20 blocks cached on the busy engine: 10 blocks better, far outside a 5 % band (1 block).
    rows = [row(1, 10, active=900), row(2, 0, active=100)]
    a, b = costs(rows, "affinity", near_tie=0.05)
    assert a < b
    assert costs(rows, "dynamo")[1] < costs(rows, "dynamo")[0]  # Dynamo would leave the cache


def test_near_tie_only_reorders_within_the_band():
    rng = random.Random(5)
    rows = [row(e, rng.randint(0, 20), prefill=rng.randint(0, 4000), active=rng.randint(0, 900)) for e in range(10)]
    plain = costs(rows, "affinity", near_tie=0.0)
    banded = costs(rows, "affinity", near_tie=0.1)
    band = min(plain) + 0.1 * ISL / BS
    inside = [i for i, c in enumerate(plain) if c <= band]
    outside = [i for i, c in enumerate(plain) if c > band]
    assert all(banded[i] == plain[i] for i in outside)
    assert max(banded[i] for i in inside) < min((plain[i] for i in outside), default=float("inf"))
    dynamo = costs(rows, "dynamo")
    assert sorted(inside, key=lambda i: banded[i]) == sorted(inside, key=lambda i: dynamo[i])
