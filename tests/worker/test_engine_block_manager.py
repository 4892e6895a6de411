"""Block manager moves (Use / Deref / Destroy / Promote), LRU eviction and the events they imply."""

import pytest
from kvmesh.kv_events import AllCleared, BlocksRemoved, BlocksStored, StoredBlock
from kvmesh_worker.engine.block_manager import BlockManager, NoFreeBlocks
from kvmesh_worker.engine.evictor import LRUEvictor


def make(num_blocks: int = 8) -> tuple[BlockManager, list]:
    events: list = []
    return BlockManager(num_blocks, events.append), events


def chain(n: int, base: int = 100) -> tuple[list[int], list[int]]:
    """Fake (sequence hashes, tokens hashes) of an n-block sequence."""
    return [base + i for i in range(n)], [1000 + base + i for i in range(n)]


def test_use_stores_new_blocks_once_with_parent_and_reuse_is_silent():
    bm, events = make()
    seq, loc = chain(3)
    bm.use(seq, loc, 0, 2)
    assert events == [BlocksStored(None, (StoredBlock(100, 1100), StoredBlock(101, 1101)))]
    bm.use(seq, loc, 0, 3)  # blocks 0-1 are re-used (refcount 2), block 2 is new: its parent is block 1
    assert events[1:] == [BlocksStored(101, (StoredBlock(102, 1102),))]
    assert bm.active == {100: 2, 101: 2, 102: 1}


def test_deref_keeps_blocks_cached_and_silent_and_rehit_reactivates():
    bm, events = make()
    seq, loc = chain(3)
    bm.use(seq, loc, 0, 3)
    events.clear()
    bm.deref(seq)
    assert bm.num_active == 0 and list(bm.inactive) == [102, 101, 100]  # tail first: evicted first
    assert bm.cached_hashes() == {100, 101, 102}
    bm.use(seq, loc, 0, 2)
    assert events == [] and bm.active == {100: 1, 101: 1} and list(bm.inactive) == [102]


def test_lru_eviction_order_and_removed_events():
    bm, events = make(num_blocks=4)
    a, la = chain(2, base=100)
    b, lb = chain(2, base=200)
    bm.use(a, la, 0, 2)
    bm.use(b, lb, 0, 2)
    bm.deref(a)  # inactive: 101, 100
    bm.deref(b)  # inactive: 101, 100, 201, 200
    events.clear()
    c, lc = chain(3, base=300)
    bm.use(c, lc, 0, 3)
    assert events == [
        BlocksRemoved((101, 100, 201)),  # oldest first
        BlocksStored(None, (StoredBlock(300, 1300), StoredBlock(301, 1301), StoredBlock(302, 1302))),
    ]
    assert list(bm.inactive) == [200]


def test_use_never_evicts_a_block_it_reuses():
    bm, events = make(num_blocks=3)
    seq, loc = chain(3)
    bm.use(seq, loc, 0, 2)
    bm.deref(seq[:2])  # 2 inactive, 1 unused
    events.clear()
    bm.use(seq, loc, 0, 3)  # reuses both inactive blocks and takes the unused slot
    assert events == [BlocksStored(101, (StoredBlock(102, 1102),))]


def test_partial_block_promotion():
    bm, events = make()
    seq, loc = chain(2)
    bm.use(seq, loc, 0, 1)
    key = bm.new_partial()
    assert key < 0 and bm.num_active == 2 and events[1:] == []
    bm.promote(key, 101, 1101, parent=100, position=1)
    assert events[1:] == [BlocksStored(100, (StoredBlock(101, 1101),))]
    assert bm.active == {100: 1, 101: 1}


def test_promotion_onto_an_existing_block_frees_the_partial_slot_silently():
    bm, events = make()
    seq, loc = chain(2)
    bm.use(seq, loc, 0, 2)  # another sequence computed the same two blocks
    bm.use(seq, loc, 0, 1)
    key = bm.new_partial()
    events.clear()
    bm.promote(key, 101, 1101, parent=100, position=1)
    assert events == [] and bm.active == {100: 2, 101: 2}


def test_deref_frees_partial_blocks_without_caching_them():
    bm, _ = make()
    key = bm.new_partial()
    bm.deref([key])
    assert bm.num_active == 0 and bm.num_inactive == 0 and bm.free_slots == 8


def test_destroy_removes_unshared_blocks_from_the_cache():
    bm, events = make()
    seq, loc = chain(2)
    bm.use(seq, loc, 0, 2)
    bm.use(seq, loc, 0, 1)  # block 100 is shared
    events.clear()
    bm.destroy(seq)
    assert events == [BlocksRemoved((101,))]
    assert bm.active == {100: 1} and bm.cached_hashes() == {100}


def test_capacity_checks():
    bm, _ = make(num_blocks=2)
    seq, loc = chain(3)
    assert bm.num_missing(seq, 0, 3) == 3 and bm.free_slots == 2
    bm.use(seq, loc, 0, 2)
    assert bm.num_missing(seq, 0, 3) == 1 and bm.free_slots == 0
    with pytest.raises(NoFreeBlocks):
        bm.use(seq, loc, 2, 3)
    with pytest.raises(NoFreeBlocks):
        bm.new_partial()


def test_match_prefix_stops_at_first_miss():
    bm, _ = make()
    seq, loc = chain(4)
    bm.use(seq, loc, 0, 3)
    bm.deref(seq[1:3])  # 100 active, 101-102 inactive
    assert bm.match_prefix(seq, 4) == (3, 1)
    assert bm.match_prefix(seq, 2) == (2, 1)
    assert bm.match_prefix([7, *seq], 5) == (0, 0)


def test_dump_lists_parents_before_children_one_event_per_chain():
    bm, _ = make(num_blocks=16)
    trunk, lt = chain(2, base=100)
    bm.use(trunk, lt, 0, 2)
    for base in (200, 300):  # two branches below block 101
        seq = [*trunk, base, base + 1]
        loc = [*lt, 1000 + base, 1001 + base]
        bm.use(seq, loc, 2, 4)
    dump = bm.dump()
    assert dump == [
        BlocksStored(None, (StoredBlock(100, 1100), StoredBlock(101, 1101))),
        BlocksStored(101, (StoredBlock(200, 1200), StoredBlock(201, 1201))),
        BlocksStored(101, (StoredBlock(300, 1300), StoredBlock(301, 1301))),
    ]


def test_clear_drops_inactive_and_restates_active_blocks():
    bm, events = make()
    a, la = chain(2, base=100)
    b, lb = chain(1, base=200)
    bm.use(a, la, 0, 2)
    bm.use(b, lb, 0, 1)
    bm.deref(b)
    events.clear()
    bm.clear()
    assert events == [AllCleared(), BlocksStored(None, (StoredBlock(100, 1100), StoredBlock(101, 1101)))]
    assert bm.cached_hashes() == {100, 101} and bm.num_inactive == 0


def test_lru_evictor_order():
    lru = LRUEvictor()
    for h in (3, 1, 2):
        lru[h] = None
    assert lru.take(1) and not lru.take(1)
    lru[1] = None  # released again: now the most recent
    assert [lru.evict() for _ in range(3)] == [3, 2, 1]
