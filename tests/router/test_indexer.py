"""KvIndexer: the prefix index fed by engines' KV events (executable documentation of its contract)."""

from __future__ import annotations

import random

import pytest
from kvmesh.hashing import chain_hash, sequence_hashes
from kvmesh.kv_events import AllCleared, BlocksRemoved, BlocksStored, KvEvent, StoredBlock
from kvmesh_router.indexer import ApplyError, KvIndexer

# Content ("tokens") hashes of named blocks; sequence hashes chain them, so "C after A" differs from "C after B".
LOCAL = {name: 1000 + i for i, name in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZ")}


def seq(*names: str) -> list[int]:
    return sequence_hashes([LOCAL[n] for n in names])


def stored(*names: str, start: int = 0) -> BlocksStored:
    """The Stored event an engine emits when it caches ``names[start:]`` on top of ``names[:start]``."""
    hashes = seq(*names)
    parent = hashes[start - 1] if start else None
    return BlocksStored(parent, tuple(StoredBlock(hashes[i], LOCAL[names[i]]) for i in range(start, len(names))))


def test_store_and_find_full_and_partial_matches():
    idx = KvIndexer()
    assert idx.apply(1, stored("A", "B")) is None
    assert idx.apply(2, stored("A", "C", "D")) is None

    assert idx.find_matches(seq("A", "C", "D", "F")) == {1: 1, 2: 3}
    assert idx.find_matches(seq("A", "B")) == {1: 2, 2: 1}
    assert idx.find_matches(seq("B")) == {}  # B alone is a different prefix than A,B
    assert idx.find_matches(seq("Z", "A")) == {}
    assert idx.find_matches([]) == {}
    assert len(idx) == 5 and idx.num_blocks == 4
    assert idx.engine_size(1) == 2 and idx.engine_size(2) == 3


def test_store_extends_a_chain_from_a_known_parent_and_is_idempotent():
    idx = KvIndexer()
    idx.apply(1, stored("A", "B"))
    assert idx.apply(1, stored("A", "B", "C", "D", start=2)) is None
    assert idx.find_matches(seq("A", "B", "C", "D")) == {1: 4}
    assert idx.apply(1, stored("A", "B", "C", start=1)) is None  # re-store of held blocks: no change
    assert len(idx) == 4


def test_store_with_parent_unknown_for_that_engine_is_dropped_whole():
    idx = KvIndexer()
    idx.apply(1, stored("A"))
    # Engine 2 never stored A: its extension of A is dropped whole, although engine 1 holds A.
    assert idx.apply(2, stored("A", "C", "D", start=1)) is ApplyError.PARENT_NOT_FOUND
    assert idx.apply(1, stored("X", "Y", start=1)) is ApplyError.PARENT_NOT_FOUND
    assert idx.find_matches(seq("A", "C", "D")) == {1: 1}
    assert len(idx) == 1
    assert idx.counters.stores_dropped == 2


def test_self_referencing_block_stops_the_store():
    idx = KvIndexer()
    a = seq("A")[0]
    assert idx.apply(1, BlocksStored(None, (StoredBlock(a, 1), StoredBlock(a, 1)))) is ApplyError.INVALID_SEQUENCE
    assert idx.find_matches([a]) == {1: 1}


def test_removal_does_not_cascade_but_matching_stops_at_first_missing_block():
    idx = KvIndexer()
    idx.apply(1, stored("A", "B", "C"))
    idx.apply(2, stored("A", "B", "C"))
    b = seq("A", "B")[1]
    c = seq("A", "B", "C")[2]
    assert idx.apply(1, BlocksRemoved((b,))) is None
    # Engine 1 still holds C (no cascade) but cannot match past the missing B.
    assert idx.holds(1, c)
    assert idx.find_matches(seq("A", "B", "C")) == {1: 1, 2: 3}
    assert len(idx) == 5
    # Re-storing B makes the orphaned C reachable again.
    idx.apply(1, stored("A", "B", start=1))
    assert idx.find_matches(seq("A", "B", "C")) == {1: 3, 2: 3}


def test_unknown_removals_are_skipped_and_reported_after_the_batch():
    idx = KvIndexer()
    idx.apply(1, stored("A", "B"))
    a, b = seq("A", "B")
    assert idx.apply(1, BlocksRemoved((12345, b))) is ApplyError.BLOCK_NOT_FOUND
    assert not idx.holds(1, b) and idx.holds(1, a)  # the known hash in the batch was still removed
    assert idx.apply(7, BlocksRemoved((a,))) is ApplyError.BLOCK_NOT_FOUND  # unknown engine
    assert idx.counters.unknown_removals == 2
    assert idx.find_matches([a, b]) == {1: 1}


def test_cleared_wipes_one_engine_only_and_keeps_it_registered():
    idx = KvIndexer()
    idx.apply(1, stored("A", "B"))
    idx.apply(2, stored("A", "B"))
    idx.apply_event(1, KvEvent(3, AllCleared()))
    assert idx.find_matches(seq("A", "B")) == {2: 2}
    assert idx.engines() == [1, 2]
    assert idx.engine_size(1) == 0 and len(idx) == 2
    # It can store again from scratch.
    idx.apply(1, stored("A"))
    assert idx.find_matches(seq("A", "B")) == {1: 1, 2: 2}


def test_remove_engine_forgets_it_and_its_slot_is_reused_clean():
    idx = KvIndexer()
    idx.apply(1, stored("A", "B"))
    idx.apply(2, stored("A"))
    assert idx.remove_engine(1) is True
    assert idx.remove_engine(1) is False
    assert idx.engines() == [2]
    assert idx.find_matches(seq("A", "B")) == {2: 1}
    assert len(idx) == 1
    idx.add_engine(99)  # takes engine 1's freed slot; must not inherit its blocks
    assert idx.find_matches(seq("A", "B")) == {2: 1}
    assert idx.engine_size(99) == 0


def _random_fleet(seed: int) -> KvIndexer:
    """A random but engine-like history: stores extending held prefixes, removals, one clear."""
    rng = random.Random(seed)
    idx = KvIndexer(max_entries=None)
    prompts = [[rng.randrange(6) for _ in range(rng.randrange(1, 7))] for _ in range(40)]
    for step in range(300):
        engine = rng.randrange(4)
        if rng.random() < 0.75:
            locals_ = prompts[rng.randrange(len(prompts))]
            hashes = sequence_hashes(locals_)
            k = 0
            while k < len(hashes) and idx.holds(engine, hashes[k]):
                k += 1
            blocks = tuple(StoredBlock(hashes[i], locals_[i]) for i in range(k, len(hashes)))
            if blocks:
                assert idx.apply(engine, BlocksStored(hashes[k - 1] if k else None, blocks)) is None
        elif step == 150:
            idx.apply(engine, AllCleared())
        else:
            held = sorted(idx.canonical().get(engine, ()))
            if held:
                idx.apply(engine, BlocksRemoved(tuple(rng.sample(held, min(2, len(held))))))
    return idx


def test_dump_rebuilds_the_same_state_parent_before_child():
    idx = KvIndexer()
    idx.apply(1, stored("A", "B"))
    idx.apply(1, stored("A", "C", "D", start=1))
    idx.apply(1, stored("A", "C", "E", start=2))
    idx.apply(2, stored("A", "C", "E", "G"))
    dumps = idx.dump_all()
    # Every event's parent precedes it, so a fresh index accepts every event.
    rebuilt = KvIndexer()
    for engine, events in dumps.items():
        for ev in events:
            assert rebuilt.apply(engine, ev) is None
    assert rebuilt.canonical() == idx.canonical()
    assert sum(len(ev.blocks) for ev in dumps[1]) == 5
    # tokens hashes survive the round trip (a dump of the rebuilt index is identical)
    assert rebuilt.dump_all() == dumps


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_dump_rebuild_equality_on_random_histories(seed):
    idx = _random_fleet(seed)
    rebuilt = KvIndexer.from_dumps(idx.dump_all())
    # Orphans (held blocks whose parent was removed) cannot be re-stored: a dump carries what is reachable.
    assert rebuilt.canonical() == idx.canonical(reachable_only=True)
    assert rebuilt.dump_all() == idx.dump_all()
    for names in (seq("A"), sequence_hashes([0, 1, 2, 3]), sequence_hashes([5, 4, 3])):
        assert rebuilt.find_matches(names) == idx.find_matches(names)


def test_dump_omits_orphans():
    idx = KvIndexer()
    idx.apply(1, stored("A", "B", "C"))
    idx.apply(1, BlocksRemoved((seq("A", "B")[1],)))
    assert idx.canonical() == {1: frozenset({seq("A")[0], seq("A", "B", "C")[2]})}
    assert idx.canonical(reachable_only=True) == {1: frozenset(seq("A"))}
    assert idx.dump(1) == [BlocksStored(None, (StoredBlock(seq("A")[0], LOCAL["A"]),))]
    assert idx.dump(42) == []


# ---------------------------------------------------------------------- bounded memory


def test_size_cap_evicts_least_recently_stored_or_matched_blocks_first():
    idx = KvIndexer(max_entries=6, low_water_ratio=1.0, track_ratio=0.0)

    def peek(*names):  # a query that does not count as a use
        return idx.find_matches(seq(*names), touch=False)

    idx.apply(1, stored("X", "Y"))  # oldest store ...
    idx.apply(1, stored("P", "Q"))
    idx.apply(2, stored("M", "N"))  # 6 entries: at the cap
    idx.find_matches(seq("X", "Y"))  # ... but recently matched
    idx.apply(2, stored("U", "V"))  # 8 > 6: evict the 2 least recently stored-or-matched blocks
    assert len(idx) == 6
    assert peek("P", "Q") == {}  # P,Q: stored long ago, never matched
    assert peek("X", "Y") == {1: 2} and peek("M", "N") == {2: 2} and peek("U", "V") == {2: 2}
    assert idx.counters.evicted_blocks == 2 and idx.counters.evicted_entries == 2
    # Recency order now: M N Y X U V. A re-store (here on another engine) also counts as a use.
    idx.apply(1, stored("M", "N"))  # 8 > 6: Y and X go
    assert peek("X", "Y") == {} and peek("M", "N") == {1: 2, 2: 2} and peek("U", "V") == {2: 2}


def test_eviction_trims_matched_chains_from_the_leaves():
    idx = KvIndexer(max_entries=3, low_water_ratio=1.0, track_ratio=0.0)
    idx.apply(1, stored("A", "B", "C"))
    idx.find_matches(seq("A", "B", "C"))  # refreshed deepest first: C is now the oldest
    idx.apply(1, stored("D"))  # over the cap by one: C goes, A and B stay matchable
    assert idx.find_matches(seq("A", "B", "C")) == {1: 2}
    assert idx.find_matches(seq("D")) == {1: 1}


def test_recency_is_tracked_only_from_track_ratio_of_the_cap():
    idx = KvIndexer(max_entries=6, low_water_ratio=1.0, track_ratio=0.5)
    idx.apply(1, stored("X", "Y"))
    idx.find_matches(seq("X", "Y"))  # 2 entries < 3: not tracked, X and Y stay the oldest
    idx.apply(1, stored("P", "Q"))
    idx.apply(2, stored("M", "N"))
    idx.find_matches(seq("P", "Q"))  # 6 >= 3: tracked
    idx.apply(2, stored("U", "V"))
    assert idx.find_matches(seq("X", "Y")) == {}
    assert idx.find_matches(seq("P", "Q")) == {1: 2}


def test_evicting_a_block_drops_it_from_every_engine():
    idx = KvIndexer(max_entries=4, low_water_ratio=0.5)
    for engine in (1, 2, 3):
        idx.apply(engine, stored("A"))  # one block, 3 entries
    idx.apply(1, stored("B", "C"))  # 5 > 4: evict down to 2
    assert idx.find_matches(seq("A")) == {}
    assert len(idx) == 2 and idx.engine_size(1) == 2 and idx.engine_size(2) == 0
    assert idx.counters.evicted_blocks == 1 and idx.counters.evicted_entries == 3
    assert idx.find_matches(seq("B", "C")) == {1: 2}
    # Removing an evicted block is reported as unknown; extending it is dropped (its parent is gone).
    assert idx.apply(2, BlocksRemoved(tuple(seq("A")))) is ApplyError.BLOCK_NOT_FOUND
    assert idx.apply(2, stored("A", "E", start=1)) is ApplyError.PARENT_NOT_FOUND


def test_uncapped_index_never_evicts():
    idx = KvIndexer(max_entries=None)
    for i in range(50):
        idx.apply(i % 3, BlocksStored(None, (StoredBlock(chain_hash(7, i), i),)))
    assert len(idx) == 50 and idx.counters.evicted_entries == 0


def test_invalid_cap_is_rejected():
    with pytest.raises(ValueError):
        KvIndexer(max_entries=0)
    with pytest.raises(ValueError):
        KvIndexer(max_entries=10, low_water_ratio=0.0)
    with pytest.raises(ValueError):
        KvIndexer(max_entries=10, track_ratio=2.0)


def test_large_fleets_decode_dense_masks_correctly():
    """Hundreds of engines sharing a prefix (the dense, numpy-decoded path) and a freed slot being reused."""
    idx = KvIndexer(max_entries=None)
    engines = [(i * 0x9E3779B97F4A7C15) & (2**63 - 1) for i in range(1, 301)]  # large u63 ids
    for i, e in enumerate(engines):
        idx.apply(e, stored("A", "B", "C") if i % 9 == 0 else stored("A", "B") if i % 3 == 0 else stored("A"))
    expected = {e: 3 if i % 9 == 0 else 2 if i % 3 == 0 else 1 for i, e in enumerate(engines)}
    for _ in range(2):  # the second query hits the decode cache
        assert idx.find_matches(seq("A", "B", "C", "D")) == expected
    expected = {e: min(n, 2) for e, n in expected.items()}
    assert idx.remove_engine(engines[0])
    idx.apply(42, stored("A", "B"))  # reuses engine 0's slot
    expected.pop(engines[0])
    expected[42] = 2
    assert idx.find_matches(seq("A", "B")) == expected
    assert sorted(idx.canonical()) == sorted(expected)


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_a_reference_model_on_random_histories(seed):
    """Differential check against per-engine sets (dense and sparse masks, removals, clears, engine churn)."""
    rng = random.Random(seed)
    idx = KvIndexer(max_entries=None)
    ref: dict[int, set[int]] = {}
    prompts = [sequence_hashes([rng.randrange(3) for _ in range(rng.randrange(1, 6))]) for _ in range(30)]
    for step in range(1500):
        engine = rng.randrange(120)
        r = rng.random()
        if r < 0.8:
            hashes = rng.choice(prompts)
            start = rng.randrange(len(hashes))
            parent = hashes[start - 1] if start else None
            ok = parent is None or parent in ref.get(engine, set())
            err = idx.apply(engine, BlocksStored(parent, tuple(StoredBlock(h, 0) for h in hashes[start:])))
            assert (err is None) == ok
            if ok:
                ref.setdefault(engine, set()).update(hashes[start:])
        elif r < 0.95:
            held = sorted(ref.get(engine, ()))
            gone = rng.sample(held, min(len(held), rng.randrange(1, 4)))
            idx.apply(engine, BlocksRemoved(tuple(gone)))
            ref.get(engine, set()).difference_update(gone)
        elif r < 0.99:
            idx.apply(engine, AllCleared())
            ref[engine] = set()
        else:
            idx.remove_engine(engine)
            ref.pop(engine, None)
        if step % 50 == 0:
            for hashes in prompts[:10]:
                want = {}
                for e, held in ref.items():
                    k = 0
                    while k < len(hashes) and hashes[k] in held:
                        k += 1
                    if k:
                        want[e] = k
                assert idx.find_matches(hashes) == want
    assert idx.canonical() == {e: frozenset(h) for e, h in ref.items() if h}
    assert len(idx) == sum(len(h) for h in ref.values())


def test_the_index_stays_invisible_to_the_cyclic_gc():
    """Its tables hold only ints, so the GC never tracks (and never traverses) them, however big."""
    import gc

    idx = KvIndexer()
    for e in range(3):
        idx.apply(e, stored("A", "B", "C"))
    idx.apply(1, BlocksRemoved(tuple(seq("A", "B", "C")[2:])))
    assert not gc.is_tracked(idx._holders) and not gc.is_tracked(idx._meta)


@pytest.mark.parametrize("seed", [4, 5])
def test_store_chain_is_store_with_parallel_hashes(seed):
    rng = random.Random(seed)
    by_store, by_chain = KvIndexer(max_entries=64), KvIndexer(max_entries=64)  # a cap: recency paths too
    prompts = [[rng.randrange(6) for _ in range(rng.randrange(1, 7))] for _ in range(30)]
    for _ in range(300):
        engine = rng.randrange(3)
        hashes = sequence_hashes(prompts[rng.randrange(len(prompts))])
        if rng.random() < 0.7:
            k = rng.randrange(len(hashes))
            parent = hashes[k - 1] if k else None
            blocks = tuple(StoredBlock(h, h ^ 7) for h in hashes[k:])
            a = by_store.store(engine, parent, blocks)
            b = by_chain.store_chain(engine, parent, [x.block_hash for x in blocks], [x.tokens_hash for x in blocks])
        else:
            a = by_store.remove(engine, hashes[-2:])
            b = by_chain.remove(engine, list(hashes[-2:]))
        assert a == b
    assert by_store.canonical() == by_chain.canonical()
    assert by_store.dump_all() == by_chain.dump_all()


@pytest.mark.parametrize("seed", [6, 7])
def test_an_index_without_dump_metadata_routes_the_same_and_refuses_dumps_and_caps(seed):
    rng = random.Random(seed)
    full, lean = KvIndexer(max_entries=None), KvIndexer(max_entries=None, dumps=False)
    prompts = [[rng.randrange(6) for _ in range(rng.randrange(1, 7))] for _ in range(30)]
    for step in range(300):
        engine = rng.randrange(3)
        hashes = sequence_hashes(prompts[rng.randrange(len(prompts))])
        if step == 150:
            full.clear(engine)
            lean.clear(engine)
        elif rng.random() < 0.7:
            k = rng.randrange(len(hashes))
            parent = hashes[k - 1] if k else None
            blocks = tuple(StoredBlock(h, h ^ 7) for h in hashes[k:])
            assert full.store(engine, parent, blocks) == lean.store(engine, parent, blocks)
        else:
            assert full.remove(engine, hashes[-2:]) == lean.remove(engine, list(hashes[-2:]))
        assert full.find_matches(hashes) == lean.find_matches(hashes)
    assert full.canonical() == lean.canonical()
    assert len(lean._meta) == 0
    with pytest.raises(RuntimeError, match="dump metadata"):
        lean.dump_all()
    with pytest.raises(ValueError, match="capped"):
        KvIndexer(max_entries=100, dumps=False)
