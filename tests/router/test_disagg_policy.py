"""Conditional disaggregation as a router policy (issue 12 item 5): the prefill is decided beside the decode
engine, with the decode engine's cached prefix known, in the same synchronous step (``kvmesh_router.disagg``)."""

from __future__ import annotations

import random

from kvmesh.kv_events import BlocksStored, StoredBlock
from kvmesh.v1 import router_pb2
from kvmesh_router.admission import Admission, BusyThresholds, EngineSpec
from kvmesh_router.cost import RouterConfigOverride
from kvmesh_router.disagg import PrefillPlace, plan_prefill
from kvmesh_router.engines import EngineInfo
from kvmesh_router.indexer import KvIndexer
from kvmesh_router.metrics import RouterMetrics
from kvmesh_router.settings import RouterSettings
from kvmesh_router.slot_tracker import SlotTracker
from kvmesh_router.state import RouterState

from tests.router.test_admission import BS, decided, request, seq
from tests.router.test_router_e2e_harness import ROUTED
from tests.router.test_session_bad_input import disagg_query

PREFILL, PREFILL_2, DECODE = 3, 5, 4
PROMPT = tuple("ABCDEFGHIJ")  # 10 blocks of BS tokens


def fleet(**thresholds) -> tuple[Admission, KvIndexer]:
    index = KvIndexer()
    adm = Admission(index, SlotTracker(BS), rng=random.Random(0), thresholds=BusyThresholds(**thresholds))
    for engine, role in ((PREFILL, "prefill"), (PREFILL_2, "prefill"), (DECODE, "decode")):
        adm.add_engine(EngineSpec(engine, total_blocks=1000, block_size=BS, role=role))
    return adm, index


def plan(adm: Admission, rid: str, min_tokens: int, excluded: frozenset[int] = frozenset()):
    decode_request = request(rid, *PROMPT, override=RouterConfigOverride(role="decode"))
    decode = decided(adm.decide(decode_request, 0.0))
    assert decode.engine_id == DECODE
    return decode, plan_prefill(adm, decode_request, decode, BS, min_tokens, excluded, 0.0)


def test_new_tokens_are_the_prompt_minus_what_the_decode_engine_caches():
    adm, index = fleet()
    _decode, cold = plan(adm, "cold", min_tokens=16)
    assert cold.place is PrefillPlace.REMOTE and cold.uncached_tokens == 10 * BS
    assert cold.decision is not None and cold.decision.engine_id in (PREFILL, PREFILL_2)
    assert adm.slots.has_request("cold/prefill")  # booked: the prefill pool's backlog counts it at once

    # the decode engine now holds 7 of the 10 blocks (an earlier turn): 3 blocks = 12 tokens are new
    index.apply(DECODE, BlocksStored(None, tuple(StoredBlock(h, 0) for h in seq(*PROMPT[:7]))))
    decode, warm = plan(adm, "warm", min_tokens=16)
    assert decode.overlap_blocks == 7
    assert warm.place is PrefillPlace.LOCAL_SHORT and warm.uncached_tokens == 3 * BS
    assert warm.reason == "local: 12 uncached prompt tokens <= --disagg-min-tokens 16"
    assert not adm.slots.has_request("warm/prefill")  # nothing booked on a prefill engine


def test_a_busy_prefill_pool_means_local_prefill():
    adm, _index = fleet(prefill_backlog_tokens=10 * BS - 1)  # busy once one 40-token prompt is booked there
    placed = {plan(adm, f"r{i}", min_tokens=0)[1] for i in range(2)}
    assert {p.place for p in placed} == {PrefillPlace.REMOTE}
    assert {p.decision.engine_id for p in placed if p.decision} == {PREFILL, PREFILL_2}
    _decode, third = plan(adm, "r2", min_tokens=0)
    assert third.place is PrefillPlace.LOCAL_BUSY and third.reason == "local: every prefill engine is busy"
    adm.mark_prefill_completed("r0/prefill")  # its prompt is computed: the backlog is gone
    assert plan(adm, "r3", min_tokens=0)[1].place is PrefillPlace.REMOTE


def test_failed_prefill_engines_are_excluded_then_local():
    adm, _index = fleet()
    _decode, other = plan(adm, "m1", min_tokens=0, excluded=frozenset({PREFILL}))
    assert other.decision is not None and other.decision.engine_id == PREFILL_2
    _decode, none = plan(adm, "m2", min_tokens=0, excluded=frozenset({PREFILL, PREFILL_2}))
    assert none.place is PrefillPlace.LOCAL_NO_ENGINE
    assert none.reason == "local: no other prefill engine after a failed one"
    adm.remove_engine(PREFILL)
    adm.remove_engine(PREFILL_2)
    _decode, gone = plan(adm, "m3", min_tokens=0)
    assert gone.place is PrefillPlace.LOCAL_NO_ENGINE and gone.reason == "local: no prefill engine"


def test_a_request_pinned_to_its_decode_engine_is_still_prefilled_remotely():
    """The frontend pins ``kvmesh.worker_id`` requests with mode "direct"; the pin is the decode engine's."""
    adm, _index = fleet()
    pinned = request("pin", *PROMPT, pinned=DECODE, override=RouterConfigOverride(mode="direct", role="decode"))
    decode = decided(adm.decide(pinned, 0.0))
    assert decode.engine_id == DECODE
    prefill = plan_prefill(adm, pinned, decode, BS, 0, frozenset(), 0.0)
    assert prefill.place is PrefillPlace.REMOTE and prefill.reason == "remote"
    assert prefill.decision is not None and prefill.decision.engine_id in (PREFILL, PREFILL_2)


def test_a_request_is_one_decision_and_its_prefill_placement_is_counted_apart():
    """A prefill kept local because the prefill pool is busy is still served: it is a placement, not a
    second (rejected) routing decision of the request."""
    state = RouterState(RouterSettings(prefill_backlog_tokens=8 * 16 - 1), RouterMetrics())
    state.add_engine(EngineInfo(11, "m", "w11", 16, 1000, role="decode"))
    state.add_engine(EngineInfo(22, "m", "w22", 16, 1000, role="prefill"))
    places = []
    for rid in ("a", "b"):  # 8 blocks of 16 each: the first booked prompt makes the prefill pool busy
        route = router_pb2.SessionRequest.FromString(disagg_query(rid)).route
        out = router_pb2.RouteDecision()
        state.route(f"s/{rid}", route, out)
        assert out.outcome == ROUTED
        places.append(out.prefill.place)
    assert places == [router_pb2.PREFILL_PLACE_REMOTE, router_pb2.PREFILL_PLACE_LOCAL_BUSY]

    def sample(name: str, **labels: str) -> float | None:
        return state.metrics.registry.get_sample_value(name, labels)

    assert sample("kvmesh_router_decisions_total", mode="kv", outcome="routed") == 2
    assert sample("kvmesh_router_decisions_total", mode="kv", outcome="rejected") == 0
    assert sample("kvmesh_router_prefill_placements_total", place="remote") == 1
    assert sample("kvmesh_router_prefill_placements_total", place="local_busy") == 1
