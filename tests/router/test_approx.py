"""ApproxIndexer: predicted prefix blocks from the router's own decisions, with a TTL and a size cap."""

from __future__ import annotations

import pytest
from kvmesh.hashing import sequence_hashes
from kvmesh_router.approx import ApproxIndexer

LOCAL = {name: 3000 + i for i, name in enumerate("ABCDEFGHIJKLMN")}


def seq(*names: str) -> list[int]:
    return sequence_hashes([LOCAL[n] for n in names])


def test_recorded_decisions_answer_like_the_indexer():
    ap = ApproxIndexer()
    ap.record(1, seq("A", "B"), now=0.0)
    ap.record(2, seq("A", "C", "D"), now=0.0)
    assert ap.find_matches(seq("A", "C", "D", "F")) == {1: 1, 2: 3}
    assert ap.find_matches(seq("B")) == {}
    assert ap.find_matches([]) == {}
    assert len(ap) == 5
    assert ap.canonical() == {1: frozenset(seq("A", "B")), 2: frozenset(seq("A", "C", "D"))}


def test_predictions_expire_after_the_ttl_and_a_new_decision_refreshes_them():
    ap = ApproxIndexer(ttl_s=120.0)
    ap.record(1, seq("A", "B"), now=0.0)
    ap.record(2, seq("A"), now=50.0)
    ap.record(1, seq("A"), now=100.0)  # A on engine 1 refreshed; B is not
    assert ap.expire(119.9) == 0
    assert ap.expire(120.0) == 1  # B on engine 1
    assert ap.find_matches(seq("A", "B")) == {1: 1, 2: 1}
    ap.expire(170.0)  # A on engine 2
    assert ap.find_matches(seq("A", "B")) == {1: 1}
    ap.expire(220.0)
    assert ap.find_matches(seq("A", "B")) == {} and len(ap) == 0
    assert ap.expired_entries == 3


def test_size_cap_prunes_the_oldest_predictions_down_to_80_percent():
    ap = ApproxIndexer(max_entries=10)
    ap.record(1, seq("A", "B", "C", "D", "E", "F"), now=0.0)
    ap.record(2, seq("G", "H", "I", "J", "K", "L"), now=1.0)  # 12 > 10 -> prune to 8
    assert len(ap) == 8 and ap.pruned_entries == 4
    # The oldest chain lost its deepest blocks first; the newest decision is intact.
    assert ap.find_matches(seq("A", "B", "C", "D", "E", "F")) == {1: 2}
    assert ap.find_matches(seq("G", "H", "I", "J", "K", "L")) == {2: 6}


def test_clear_and_remove_engine():
    ap = ApproxIndexer()
    ap.record(1, seq("A", "B"), now=0.0)
    ap.record(2, seq("A", "B"), now=0.0)
    ap.clear(1)
    assert ap.find_matches(seq("A", "B")) == {2: 2}
    assert ap.remove_engine(2) and not ap.remove_engine(2)
    assert ap.find_matches(seq("A", "B")) == {} and len(ap) == 0
    ap.record(3, seq("A"), now=1.0)  # reuses a freed slot without inheriting anything
    assert ap.find_matches(seq("A", "B")) == {3: 1}


def test_invalid_parameters():
    with pytest.raises(ValueError):
        ApproxIndexer(ttl_s=0)
    with pytest.raises(ValueError):
        ApproxIndexer(max_entries=0)
    with pytest.raises(ValueError):
        ApproxIndexer(prune_target_ratio=1.0)


def test_repeated_refreshes_keep_the_queue_bounded_and_the_gc_out():
    import gc

    ap = ApproxIndexer(ttl_s=10.0)
    for t in range(3000):  # the same prediction refreshed again and again
        ap.record(1, seq("A", "B"), now=float(t) / 100)
    assert len(ap) == 2 and len(ap._queue_keys) <= 2 * 2 + 1024 + 2
    assert ap.find_matches(seq("A", "B")) == {1: 2}
    assert ap.expire(29.99 + 10.0) == 2
    assert not gc.is_tracked(ap._holders) and not gc.is_tracked(ap._deadline)
