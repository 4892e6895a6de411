"""SlotTracker: active blocks and outstanding prefill tokens per engine, from the request lifecycle."""

from __future__ import annotations

import random

import pytest
from kvmesh.hashing import sequence_hashes
from kvmesh_router.slot_tracker import EngineLoad, PotentialLoad, SlotTracker

BS = 4
LOCAL = {name: 2000 + i for i, name in enumerate("ABCDEFGHIJ")}


def seq(*names: str) -> list[int]:
    return sequence_hashes([LOCAL[n] for n in names])


def test_shared_prefix_blocks_are_counted_once_and_refcounted():
    st = SlotTracker(BS)
    assert st.add_request("r1", 1, seq("A", "C", "D"), 12, 0, now=0.0)
    assert st.add_request("r2", 1, seq("A", "C", "E"), 12, 0, now=0.0)
    assert st.active_blocks(1) == 4  # A, C shared; D, E own
    assert st.free("r1")
    assert st.active_blocks(1) == 3  # A, C still held by r2
    assert st.free("r2")
    assert st.active_blocks(1) == 0
    # The same prefix on another engine is counted there separately.
    st.add_request("r3", 2, seq("A", "C"), 8, 0, now=0.0)
    st.add_request("r4", 1, seq("A", "C"), 8, 0, now=0.0)
    assert st.load(1) == EngineLoad(2, 8, 1) and st.load(2) == EngineLoad(2, 8, 1)


def test_prefill_lifecycle():
    st = SlotTracker(BS)
    st.add_request("r1", 1, seq("A", "B", "C", "D"), 18, 2, now=0.0)  # 18 - 2*4 = 10 tokens to prefill
    st.add_request("r2", 1, seq("A", "B"), 8, 0, now=0.0)
    assert st.active_prefill_tokens(1) == 18
    assert st.mark_prefill_completed("r1")
    assert st.active_prefill_tokens(1) == 8
    assert st.mark_prefill_completed("r1")  # idempotent for a known request
    assert st.active_blocks(1) == 4  # blocks stay until free
    assert st.free("r2")  # free implies prefill completed
    assert st.active_prefill_tokens(1) == 0
    assert st.load(1) == EngineLoad(4, 0, 1)


def test_overlap_beyond_the_prompt_never_yields_negative_prefill():
    st = SlotTracker(BS)
    st.add_request("r", 1, seq("A", "B"), 8, 2, now=0.0)
    assert st.active_prefill_tokens(1) == 0


def test_duplicate_add_and_unknown_mark_or_free_are_no_ops():
    st = SlotTracker(BS)
    assert st.add_request("r1", 1, seq("A"), 4, 0, now=0.0)
    assert not st.add_request("r1", 2, seq("B", "C"), 8, 0, now=0.0)
    assert st.load(1) == EngineLoad(1, 4, 1) and st.load(2) == EngineLoad(0, 0, 0)
    assert not st.free("nope")
    assert not st.mark_prefill_completed("nope")
    assert not st.free("r1", engine_id=2)  # free_if_engine: booked elsewhere -> no-op
    assert st.has_request("r1")
    assert st.free("r1", engine_id=1)
    assert not st.free("r1")
    assert len(st) == 0


def test_stale_bookings_expire_after_300_s_of_injected_time():
    st = SlotTracker(BS)  # defaults: 300 s expiry, checked at most every 30 s
    st.add_request("old", 1, seq("A", "B"), 8, 0, now=0.0)
    st.add_request("new", 1, seq("A", "C"), 8, 0, now=100.0)
    assert st.expire(299.0) == []
    assert st.expire(310.0) == []  # the last check was less than 30 s ago
    st.add_request("later", 2, seq("D"), 4, 0, now=331.0)  # lazy check on add: "old" is 331 s old
    assert not st.has_request("old")
    assert st.has_request("new") and st.has_request("later")
    assert st.load(1) == EngineLoad(2, 8, 1)
    assert st.expire(400.0, force=True) == ["new"]


def test_potential_load_for_one_and_for_all_engines():
    st = SlotTracker(BS)
    st.add_request("r1", 1, seq("A", "B", "C"), 12, 0, now=0.0)
    st.mark_prefill_completed("r1")
    st.add_request("r2", 2, seq("A", "D"), 8, 1, now=0.0)  # 4 prefill tokens
    st.add_engine(3)
    req = seq("A", "B", "E", "F")
    # engine 1: 3 active + E, F new = 5; prefill 0 + 16 - 2*4 = 8
    assert st.potential_load(1, req, 16, 2) == PotentialLoad(5, 8)
    # engine 2: 2 active + B, E, F new = 5; prefill 4 + 16 - 0 = 20
    assert st.potential_load(2, req, 16, 0) == PotentialLoad(5, 20)
    assert st.potential_load(3, req, 16, 0) == PotentialLoad(4, 16)
    assert st.potential_load(99, req, 16, 0) == PotentialLoad(4, 16)  # unknown engine: idle
    loads = st.potential_loads(req, 16, {1: 2})
    assert loads == {1: PotentialLoad(5, 8), 2: PotentialLoad(5, 20), 3: PotentialLoad(4, 16)}
    assert st.potential_loads(req, 16, {}, engines=[2, 99]) == {2: PotentialLoad(5, 20), 99: PotentialLoad(4, 16)}
    assert st.active_prefix(req) == {1: 2, 2: 1}


def test_remove_engine_drops_its_bookings():
    st = SlotTracker(BS)
    st.add_request("a", 1, seq("A"), 4, 0, now=0.0)
    st.add_request("b", 1, seq("B"), 4, 0, now=0.0)
    st.add_request("c", 2, seq("A"), 4, 0, now=0.0)
    assert st.remove_engine(1) == ["a", "b"]
    assert st.engines() == [2]
    assert not st.has_request("a")
    assert st.active_prefix(seq("A")) == {2: 1}
    assert st.remove_engine(1) == []


def test_per_engine_block_size():
    st = SlotTracker(16)
    st.add_engine(1, block_size=4)
    st.add_request("r", 1, seq("A", "B"), 10, 2, now=0.0)
    assert st.active_prefill_tokens(1) == 2


def test_invalid_block_size():
    with pytest.raises(ValueError):
        SlotTracker(0)


def test_active_blocks_are_always_the_union_of_the_live_bookings():
    """Random books and frees over shared prefixes, on several engines: every engine's active blocks and
    the active-prefix answer match a recount from the bookings still held (refcounts never drift)."""
    rng = random.Random(5)
    st = SlotTracker(BS)
    names = "ABCDEFGHIJ"
    live: dict[str, tuple[int, list[int]]] = {}
    for step in range(600):
        if live and rng.random() < 0.45:
            rid = rng.choice(sorted(live))
            assert st.free(rid)
            del live[rid]
        else:
            chain = seq(*rng.choices(names[:4], k=rng.randint(1, 3)), *rng.choices(names, k=rng.randint(0, 4)))
            engine = rng.randint(1, 3)
            rid = f"r{step}"
            assert st.add_request(rid, engine, chain, len(chain) * BS, 0, now=0.0)
            live[rid] = (engine, chain)
        for engine in (1, 2, 3):
            held = {h for e, chain in live.values() if e == engine for h in chain}
            assert st.active_blocks(engine) == len(held)
        probe = seq(*rng.choices(names[:4], k=3))
        expected = {}
        for engine in (1, 2, 3):
            held = {h for e, chain in live.values() if e == engine for h in chain}
            run = next((i for i, h in enumerate(probe) if h not in held), len(probe))
            if run:
                expected[engine] = run
        assert st.active_prefix(probe) == expected
    for rid in list(live):
        st.free(rid)
    assert all(st.active_blocks(e) == 0 for e in (1, 2, 3)) and st.active_prefix(seq("A")) == {}
