"""Admission: select + book in one step, busy thresholds, rejection, and Dynamo's routing scenario."""

from __future__ import annotations

import random

import pytest
from kvmesh.hashing import sequence_hashes
from kvmesh.kv_events import BlocksStored, StoredBlock
from kvmesh_router.admission import (
    Admission,
    BusyThresholds,
    Decision,
    DuplicateRequestError,
    EngineSpec,
    Rejection,
    RejectReason,
    RouteRequest,
)
from kvmesh_router.approx import ApproxIndexer
from kvmesh_router.candidates import DEFAULT_FILTERS
from kvmesh_router.cost import RouterConfigOverride, RouterPolicyConfig
from kvmesh_router.indexer import KvIndexer
from kvmesh_router.selection import RoutingError, UnknownEngineError
from kvmesh_router.slot_tracker import SlotTracker

BS = 4
A_, B_ = 1, 2  # engine ids "a" and "b"
LOCAL = {name: 4000 + i for i, name in enumerate("ABCDEFGHIJKLMNOP")}
# The costs worked out by hand below are Dynamo's (the router's default, affinity, has its own tests).
DYNAMO = RouterPolicyConfig(cost_policy="dynamo")


def seq(*names: str) -> list[int]:
    return sequence_hashes([LOCAL[n] for n in names])


def request(rid: str, *names: str, pinned: int | None = None, **kw) -> RouteRequest:
    return RouteRequest(rid, seq(*names), len(names) * BS, pinned_engine=pinned, **kw)


class FakeEngine:
    """Caches every prompt it serves and emits the Stored event a real engine would (no eviction)."""

    def __init__(self) -> None:
        self.held: set[int] = set()

    def serve(self, names: tuple[str, ...]) -> BlocksStored | None:
        hashes = seq(*names)
        k = 0
        while k < len(hashes) and hashes[k] in self.held:
            k += 1
        if k == len(hashes):
            return None
        self.held.update(hashes[k:])
        blocks = tuple(StoredBlock(hashes[i], LOCAL[names[i]]) for i in range(k, len(names)))
        return BlocksStored(hashes[k - 1] if k else None, blocks)


def make(index=None, predictor=None, engines=(A_, B_), total_blocks=1000, seed=0, config=DYNAMO, **kw) -> Admission:
    adm = Admission(
        index if index is not None else KvIndexer(),
        SlotTracker(BS),
        config=config,
        rng=random.Random(seed),
        predictor=predictor,
        **kw,
    )
    for e in engines:
        adm.add_engine(EngineSpec(e, total_blocks=total_blocks, block_size=BS))
    return adm


def decided(result: Decision | Rejection) -> Decision:
    assert isinstance(result, Decision), result
    return result


# ---------------------------------------------------------------------- Dynamo's decision scenario


def test_dynamo_scenario_with_kv_events():
    """Seed a with [A,B] and [A,C,D], b with [A,C,E]; then [A,C,D,F] -> a and [A,C,E,G] -> b."""
    index = KvIndexer()
    adm = make(index)
    engines = {A_: FakeEngine(), B_: FakeEngine()}

    def run(rid, names, pinned, now):
        d = decided(adm.decide(request(rid, *names, pinned=pinned), now))
        ev = engines[d.engine_id].serve(names)  # the engine caches the prompt and publishes its event
        if ev is not None:
            assert index.apply(d.engine_id, ev) is None
        return d

    for i, (names, engine) in enumerate([(("A", "B"), A_), (("A", "C", "D"), A_), (("A", "C", "E"), B_)]):
        d = run(f"seed{i}", names, engine, float(i))
        assert d.engine_id == engine and d.mode == "direct"
        adm.free(d.request_id)  # seed requests complete
    assert index.find_matches(seq("A", "C", "D", "F")) == {A_: 3, B_: 2}

    d1 = run("q1", ("A", "C", "D", "F"), None, 10.0)
    assert (d1.engine_id, d1.overlap_blocks, d1.best_overlap_blocks, d1.mode) == (A_, 3, 3, "kv")
    # a: (0 + 16 - 12)/4 + 4 = 5; b: (0 + 16 - 8)/4 + 4 = 6
    assert d1.cost == 5.0
    d2 = run("q2", ("A", "C", "E", "G"), None, 11.0)
    # a (busy with q1): (4 + 16 - 8)/4 + (4 + 2) = 9; b: (0 + 16 - 12)/4 + 4 = 5
    assert (d2.engine_id, d2.overlap_blocks, d2.cost) == (B_, 3, 5.0)


def test_dynamo_scenario_in_approximate_mode():
    """No KV events: the router's own decisions populate the predicted index."""
    approx = ApproxIndexer()
    adm = make(approx, predictor=approx)
    for i, (names, engine) in enumerate([(("A", "B"), A_), (("A", "C", "D"), A_), (("A", "C", "E"), B_)]):
        d = decided(adm.decide(request(f"seed{i}", *names, pinned=engine), float(i)))
        adm.free(d.request_id)
    assert approx.find_matches(seq("A", "C", "D", "F")) == {A_: 3, B_: 2}
    d1 = decided(adm.decide(request("q1", "A", "C", "D", "F"), 10.0))
    assert (d1.engine_id, d1.overlap_blocks) == (A_, 3)
    d2 = decided(adm.decide(request("q2", "A", "C", "E", "G"), 11.0))
    assert (d2.engine_id, d2.overlap_blocks) == (B_, 3)
    # The decisions themselves became predictions ...
    assert approx.find_matches(seq("A", "C", "E", "G")) == {A_: 2, B_: 4}
    # ... which expire 120 s after they were made.
    approx.expire(200.0)
    assert approx.find_matches(seq("A", "C", "E", "G")) == {}


def test_side_predictor_next_to_the_event_index_takes_the_larger_overlap():
    index = KvIndexer()
    index.apply(A_, BlocksStored(None, (StoredBlock(seq("A")[0], LOCAL["A"]),)))
    predictor = ApproxIndexer()
    adm = make(index, predictor=predictor)
    predictor.record(B_, seq("A", "B"), now=0.0)
    assert adm.overlaps(seq("A", "B", "C")) == {A_: 1, B_: 2}
    d = decided(adm.decide(request("r", "A", "B", "C"), 1.0))
    assert (d.engine_id, d.overlap_blocks, d.best_overlap_blocks) == (B_, 2, 2)
    assert predictor.find_matches(seq("A", "B", "C")) == {B_: 3}


# ---------------------------------------------------------------------- serialized select + book


def test_booking_is_visible_to_the_next_decision():
    # No cache anywhere; the first booking adds 16 prefill tokens to its engine, so an identical second
    # request costs (16 + 16)/4 + 4 = 12 there and 16/4 + 4 = 8 on the idle engine.
    for seed in range(5):
        adm = make(seed=seed)
        first = decided(adm.decide(request("r1", "A", "B", "C", "D"), 0.0))
        second = decided(adm.decide(request("r2", "A", "B", "C", "D"), 0.0))
        assert {first.engine_id, second.engine_id} == {A_, B_}
        assert second.cost == 8.0
        assert adm.slots.active_prefill_tokens(first.engine_id) == 16


def test_round_robin_mode_books_too():
    adm = make(config=RouterPolicyConfig(mode="round_robin"), engines=(5, 6, 7))
    picks = [decided(adm.decide(request(f"r{i}", "A"), 0.0)).engine_id for i in range(4)]
    assert picks == [5, 6, 7, 5]
    assert adm.slots.active_requests(5) == 2


def test_duplicate_request_id_is_refused_until_freed():
    adm = make()
    decided(adm.decide(request("r", "A"), 0.0))
    with pytest.raises(DuplicateRequestError):
        adm.decide(request("r", "B"), 0.0)
    assert adm.free("r")
    decided(adm.decide(request("r", "B"), 1.0))


def test_decision_quality_compares_with_the_best_overlap_in_the_fleet():
    index = KvIndexer()
    index.apply(B_, BlocksStored(None, tuple(StoredBlock(h, 0) for h in seq("A", "B"))))
    adm = make(index, config=RouterPolicyConfig(mode="round_robin"))
    d = decided(adm.decide(request("r", "A", "B", "C"), 0.0))  # round robin starts at a
    assert (d.engine_id, d.overlap_blocks, d.best_overlap_blocks, d.quality) == (A_, 0, 2, 0.0)
    d = decided(adm.decide(request("s", "A", "B", "C", pinned=B_), 0.0))
    assert d.quality == 1.0
    assert decided(adm.decide(request("t", "P"), 0.0)).quality == 1.0  # nothing cached anywhere


# ---------------------------------------------------------------------- pinning and restrictions


def test_direct_routing_and_its_errors():
    adm = make()
    assert decided(adm.decide(request("r1", "A", pinned=B_), 0.0)).engine_id == B_
    with pytest.raises(UnknownEngineError):
        adm.decide(request("r2", "A", pinned=99), 0.0)
    with pytest.raises(UnknownEngineError):
        adm.decide(request("r3", "A", pinned=B_, excluded_engines=frozenset({B_})), 0.0)
    with pytest.raises(RoutingError):
        adm.decide(request("r5", "A", override=RouterConfigOverride(temperature=-1.0)), 0.0)
    with pytest.raises(RoutingError, match=r"unknown cost policy .nope.: choose dynamo, affinity"):
        adm.decide(request("r6", "A", override=RouterConfigOverride(cost_policy="nope")), 0.0)
    direct_mode = make(config=RouterPolicyConfig(mode="direct"))
    with pytest.raises(RoutingError):
        direct_mode.decide(request("r4", "A"), 0.0)
    assert not adm.slots.has_request("r2") and not adm.slots.has_request("r3")


def test_allowed_and_excluded_engines_restrict_the_candidates():
    adm = make(engines=(1, 2, 3))
    for i in range(6):
        d = decided(adm.decide(request(f"x{i}", "A", "BC"[i % 2], excluded_engines=frozenset({1})), 0.0))
        assert d.engine_id != 1
    for i in range(6):
        d = decided(adm.decide(request(f"y{i}", "D", allowed_engines=frozenset({3})), 0.0))
        assert d.engine_id == 3
    rej = adm.decide(request("z", "A", allowed_engines=frozenset({9})), 0.0)
    assert isinstance(rej, Rejection) and rej.reason is RejectReason.NO_ENGINES
    # The model's engines are usually the whole fleet (and may name engines this admission has not met yet)
    picked = {decided(adm.decide(request(f"w{i}", "E", allowed_engines=frozenset({1, 2, 3, 4})), 0.0)).engine_id
              for i in range(30)}  # fmt: skip
    assert picked == {1, 2, 3}


def test_per_request_override_reaches_the_cost():
    index = KvIndexer()
    index.apply(A_, BlocksStored(None, tuple(StoredBlock(h, 0) for h in seq("A", "B", "C", "D"))))
    adm = make(index)
    adm.decide(request("bg", *"EFGHIJ", pinned=A_), 0.0)  # 6 unrelated active blocks on a, prefill done
    adm.mark_prefill_completed("bg")
    # a: 0 prefill blocks + (6 active + 4 new) = 10;  b: 4 + 4 = 8 with weight 1 ... -> b
    assert decided(adm.decide(request("w1", "A", "B", "C", "D"), 0.0)).engine_id == B_
    adm.free("w1")
    # weight 3: a = 0 + 10 = 10; b = 12 + 4 = 16 -> a
    heavy = RouterConfigOverride(overlap_score_weight=3.0)
    assert decided(adm.decide(request("w3", "A", "B", "C", "D", override=heavy), 0.0)).engine_id == A_


# ---------------------------------------------------------------------- busy thresholds


def test_busy_engines_are_skipped_and_rejection_comes_only_when_all_are_busy():
    adm = make(thresholds=BusyThresholds(active_prefill_tokens=10))
    first = decided(adm.decide(request("r1", "A", "B", "C"), 0.0))  # 12 prefill tokens: now busy
    assert adm.is_busy(first.engine_id)
    second = decided(adm.decide(request("r2", "A", "B", "C"), 0.0))
    assert second.engine_id != first.engine_id  # the busy engine is skipped
    rej = adm.decide(request("r3", "A"), 0.0)
    assert isinstance(rej, Rejection) and rej.reason is RejectReason.ALL_BUSY
    assert rej.busy_engines == (A_, B_) and "2" in rej.message
    assert not adm.slots.has_request("r3")
    adm.mark_prefill_completed("r1")  # first token: engine no longer busy
    assert decided(adm.decide(request("r3", "A"), 1.0)).engine_id == first.engine_id


def test_a_pinned_request_checks_only_its_engine():
    adm = make(thresholds=BusyThresholds(active_prefill_tokens=10))
    decided(adm.decide(request("r1", "A", "B", "C", pinned=A_), 0.0))
    rej = adm.decide(request("r2", "D", pinned=A_), 0.0)
    assert isinstance(rej, Rejection) and rej.busy_engines == (A_,)
    assert decided(adm.decide(request("r3", "D", pinned=B_), 0.0)).engine_id == B_


def test_an_engine_holding_its_running_plus_waiting_slots_in_bookings_is_busy():
    # max_requests = max_num_seqs + max_waiting_requests from the card: a further request would only be
    # refused by the engine's waiting queue, so the router places it elsewhere or rejects it itself.
    adm = make(engines=(), thresholds=BusyThresholds(requests_frac=1.0))
    adm.add_engine(EngineSpec(A_, total_blocks=1000, block_size=BS, max_requests=2))
    adm.add_engine(EngineSpec(B_, total_blocks=1000, block_size=BS, max_requests=1))
    placed = [decided(adm.decide(request(f"r{i}", "A"), 0.0)).engine_id for i in range(3)]
    assert sorted(placed) == [A_, A_, B_]
    rej = adm.decide(request("r3", "A"), 0.0)
    assert isinstance(rej, Rejection) and rej.reason is RejectReason.ALL_BUSY
    adm.free("r0")
    assert not adm.is_busy(placed[0]) and decided(adm.decide(request("r3", "A"), 0.0)).engine_id == placed[0]


def test_an_engine_with_an_unbounded_queue_is_never_busy_by_request_count():
    adm = make(engines=(), thresholds=BusyThresholds(requests_frac=1.0))
    adm.add_engine(EngineSpec(A_, total_blocks=1000, block_size=BS))  # max_requests None: unbounded
    for i in range(50):
        assert decided(adm.decide(request(f"r{i}", "A"), 0.0)).engine_id == A_


def test_kv_usage_threshold_uses_booked_blocks_and_engine_reports():
    adm = make(thresholds=BusyThresholds(kv_usage_frac=0.5), total_blocks=8)
    adm.report_kv_usage(A_, 5)  # the engine says 5 of 8 blocks are in use: over 50%
    assert adm.is_busy(A_) and not adm.is_busy(B_)
    d = decided(adm.decide(request("r1", "A", "B", "C", "D", "E"), 0.0))  # 5 active blocks on b
    assert d.engine_id == B_
    rej = adm.decide(request("r2", "F"), 0.0)
    assert isinstance(rej, Rejection)
    adm.report_kv_usage(A_, None)
    assert decided(adm.decide(request("r2", "F"), 0.0)).engine_id == A_


def test_prefill_fraction_threshold_uses_max_num_batched_tokens():
    adm = make(engines=(), thresholds=BusyThresholds(active_prefill_tokens_frac=0.5))
    adm.add_engine(EngineSpec(A_, total_blocks=100, block_size=BS, max_num_batched_tokens=16))
    decided(adm.decide(request("r1", "A", "B"), 0.0))  # 8 tokens = 0.5 * 16: not over
    assert not adm.is_busy(A_)
    decided(adm.decide(request("r2", "C"), 0.0))
    assert adm.is_busy(A_)


@pytest.mark.parametrize(
    "thresholds",
    [
        BusyThresholds(kv_usage_frac=0.95, requests_frac=1.0),  # the router's defaults
        BusyThresholds(active_prefill_tokens=6, active_prefill_tokens_frac=0.5, prefill_backlog_tokens=4),
        BusyThresholds(kv_usage_frac=0.3),
        BusyThresholds(requests_frac=0.0),  # fires on idle engines too: every engine is checked
        BusyThresholds(active_prefill_tokens=-1),
    ],
)
def test_the_busy_filter_checks_only_engines_that_can_be_busy_and_agrees_with_checking_all(thresholds):
    """Only booked engines and engines reporting KV in use are checked; the answer is the full scan's."""
    rng = random.Random(7)
    engines = list(range(1, 41))
    adm = make(engines=(), thresholds=thresholds)
    for e in engines:
        limit = rng.choice([None, 0, 1, 2, 3])  # 0: an engine that holds no request at all
        adm.add_engine(EngineSpec(e, total_blocks=12, block_size=BS, max_requests=limit, max_num_batched_tokens=16))
    names = list(LOCAL)
    live: list[str] = []
    for step in range(300):
        roll = rng.random()
        if roll < 0.45:
            rid = f"r{step}"
            prompt = rng.sample(names, rng.randint(1, 5))
            result = adm.decide(request(rid, *prompt, allowed_engines=frozenset(rng.sample(engines, 10))), float(step))
            if isinstance(result, Decision):
                live.append(rid)
        elif roll < 0.65 and live:
            adm.free(live.pop(rng.randrange(len(live))))
        elif roll < 0.75 and live:
            adm.mark_prefill_completed(rng.choice(live))
        elif roll < 0.95:
            adm.report_kv_usage(rng.choice(engines), rng.choice([None, 0, 0, 3, 11]))
        else:
            gone = rng.choice(adm.engines())
            adm.remove_engine(gone)
            live = [rid for rid in live if adm.slots.has_request(rid)]
            adm.add_engine(EngineSpec(gone, total_blocks=12, block_size=BS, max_requests=2))
        eligible = adm.engines()
        assert list(adm.available(eligible)) == [e for e in eligible if not adm.is_busy(e)]


def test_no_engines_and_engine_removal():
    adm = make(engines=())
    rej = adm.decide(request("r", "A"), 0.0)
    assert isinstance(rej, Rejection) and rej.reason is RejectReason.NO_ENGINES
    adm = make()
    decided(adm.decide(request("r1", "A", pinned=A_), 0.0))
    assert adm.remove_engine(A_) == ["r1"]
    assert adm.engines() == [B_] and adm.remove_engine(A_) == []
    assert decided(adm.decide(request("r2", "A"), 0.0)).engine_id == B_


def test_stale_bookings_expire_through_decide():
    adm = make(engines=(A_,))
    decided(adm.decide(request("r1", "A", "B"), 0.0))
    decided(adm.decide(request("r2", "C"), 400.0))
    assert not adm.slots.has_request("r1")
    assert adm.slots.active_blocks(A_) == 1


# ---------------------------------------------------------------------- per-query overrides and candidate filters


def test_mode_is_a_per_query_override_and_the_config_never_changes():
    adm = make(engines=(1, 2, 3))
    config = adm.config
    rr = RouterConfigOverride(mode="round_robin")
    picks = [decided(adm.decide(request(f"r{i}", "A", override=rr), now=0.0)) for i in range(3)]
    assert [d.engine_id for d in picks] == [1, 2, 3] and {d.mode for d in picks} == {"round_robin"}
    assert adm.config is config  # decided with config + override; nothing global was swapped
    assert decided(adm.decide(request("k", "A"), now=0.0)).mode == "kv"
    assert adm.mode_of(request("p", "A", pinned=2, override=rr)) == "direct"  # a pin always wins
    with pytest.raises(RoutingError, match="pinned"):
        adm.decide(request("d", "A", override=RouterConfigOverride(mode="direct")), now=0.0)
    with pytest.raises(RoutingError, match="invalid policy override"):
        adm.decide(request("x", "A", override=RouterConfigOverride(role="encoder")), now=0.0)


def test_role_filter_serves_aggregated_by_default_and_other_roles_on_request():
    adm = make(engines=(1, 2))
    adm.add_engine(EngineSpec(3, total_blocks=1000, block_size=BS, role="prefill"))
    adm.add_engine(EngineSpec(4, total_blocks=1000, block_size=BS, role="decode"))
    assert {decided(adm.decide(request(f"a{i}", "A"), now=0.0)).engine_id for i in range(20)} <= {1, 2}
    prefill = decided(adm.decide(request("p", "A", override=RouterConfigOverride(role="prefill")), now=0.0))
    decode = decided(adm.decide(request("d", "A", override=RouterConfigOverride(role="decode")), now=0.0))
    assert (prefill.engine_id, decode.engine_id) == (3, 4)
    with pytest.raises(UnknownEngineError, match="not allowed"):  # a pin must have the asked role too
        adm.decide(request("pin", "A", pinned=3), now=0.0)
    adm.remove_engine(4)
    none = adm.decide(request("d2", "A", override=RouterConfigOverride(role="decode")), now=0.0)
    assert isinstance(none, Rejection) and none.reason is RejectReason.NO_ENGINES


def test_candidate_filters_compose():
    def even_only(engines, request, config, fleet):
        return [e for e in engines if e % 2 == 0]

    adm = make(engines=(1, 2, 3, 4), filters=(*DEFAULT_FILTERS, even_only))
    picks = {
        decided(adm.decide(request(f"r{i}", "A", excluded_engines=frozenset({4})), now=0.0)).engine_id
        for i in range(10)
    }
    assert picks == {2}
