"""The ingest cursor state machine, without any I/O: contiguous ids, stale ids, gaps, recovery by
replay or snapshot, the Cleared barrier, and the bounded recovery buffer."""

from __future__ import annotations

from kvmesh import kv_events_pb
from kvmesh.kv_events import AllCleared, BlocksRemoved, BlocksStored, KvEvent, StoredBlock
from kvmesh.v1 import kv_events_pb2
from kvmesh_router.cursor import EngineCursor, FeedState, IngestStats
from kvmesh_router.indexer import KvIndexer

E = 7


def stored(eid: int, *hashes: int, parent: int | None = None) -> kv_events_pb2.KvEvent:
    out = kv_events_pb2.KvEvent()
    kv_events_pb.event_to_proto(
        KvEvent(eid, BlocksStored(parent, tuple(StoredBlock(h, h + 1000) for h in hashes))), out
    )
    return out


def removed(eid: int, *hashes: int) -> kv_events_pb2.KvEvent:
    out = kv_events_pb2.KvEvent()
    kv_events_pb.event_to_proto(KvEvent(eid, BlocksRemoved(hashes)), out)
    return out


def cleared(eid: int) -> kv_events_pb2.KvEvent:
    out = kv_events_pb2.KvEvent()
    kv_events_pb.event_to_proto(KvEvent(eid, AllCleared()), out)
    return out


def snapshot(next_id: int, *chains: tuple[int | None, tuple[int, ...]]) -> kv_events_pb2.KvIndexSnapshot:
    return kv_events_pb.snapshot_to_proto(
        [BlocksStored(p, tuple(StoredBlock(h, h + 1000) for h in hs)) for p, hs in chains], next_id
    )


def held(index: KvIndexer) -> set[int]:
    return set(index.canonical().get(E, ()))


def make(**kwargs) -> tuple[EngineCursor, KvIndexer, list[tuple[float, str]]]:
    index = KvIndexer(max_entries=None)
    recovered: list[tuple[float, str]] = []
    cursor = EngineCursor(E, index, IngestStats(), on_recovered=lambda s, m: recovered.append((s, m)), **kwargs)
    return cursor, index, recovered


def restored(cursor: EngineCursor, next_id: int = 0, *chains) -> None:
    cursor.on_snapshot(snapshot(next_id, *chains))
    assert cursor.state is FeedState.LIVE and cursor.next_id == next_id


def test_restore_replaces_the_engines_entries_and_sets_the_cursor():
    cursor, index, _ = make()
    index.store(E, None, [StoredBlock(99, 1)])  # stale state from before
    assert cursor.state is FeedState.RESTORING
    cursor.on_events([stored(0, 5)])  # events before the snapshot cannot be placed
    assert cursor.stats.stale == 1
    restored(cursor, 4, (None, (1, 2)), (2, (3,)))
    assert held(index) == {1, 2, 3} and cursor.stats.restores == 1


def test_contiguous_events_apply_and_stale_ones_are_dropped():
    cursor, index, _ = make()
    restored(cursor, 0)
    cursor.on_events([stored(0, 1, 2), stored(1, 3, parent=2), removed(2, 3)])
    cursor.on_events([stored(1, 8), stored(2, 9), stored(3, 4, parent=2)])  # 1 and 2 again: stale
    assert held(index) == {1, 2, 4}
    assert cursor.next_id == 4 and cursor.stats.events == 4 and cursor.stats.stale == 2 and cursor.stats.gaps == 0


def test_gap_buffers_live_events_and_recovers_from_the_replay():
    cursor, index, recovered = make()
    restored(cursor, 0)
    cursor.on_events([stored(0, 1)])
    cursor.on_events([stored(3, 4, parent=3), stored(4, 5, parent=4)])  # 1 and 2 were lost
    assert cursor.state is FeedState.RECOVERING and cursor.gap_from == 1 and cursor.stats.gaps == 1
    epoch = cursor.epoch
    cursor.on_events([stored(5, 6, parent=5)])  # live events keep coming: buffered, not applied
    assert held(index) == {1}
    # the recovery stream replays from the first missing id (and goes on with live events)
    cursor.on_recovery_events([stored(1, 2, parent=1), stored(2, 3, parent=2), stored(3, 4, parent=3)], epoch)
    assert cursor.state is FeedState.LIVE and cursor.next_id == 6
    assert held(index) == {1, 2, 3, 4, 5, 6}
    assert cursor.stats.recovered_replay == 1 and [m for _, m in recovered] == ["replay"]
    # a stale recovery batch (its epoch is over) changes nothing
    cursor.on_recovery_events([stored(6, 77)], epoch)
    assert cursor.next_id == 6 and 77 not in held(index)


def test_gap_recovered_by_snapshot_drains_only_newer_buffered_events():
    cursor, index, recovered = make()
    restored(cursor, 0)
    cursor.on_events([stored(0, 1), stored(1, 2, parent=1)])
    cursor.on_events([stored(5, 9, parent=2), stored(6, 10, parent=9)])  # 2..4 lost
    epoch = cursor.epoch
    # the replay buffer no longer holds id 2: the worker answers with a snapshot as of id 6
    cursor.on_recovery_snapshot(snapshot(6, (None, (1, 2, 9))), epoch)
    assert cursor.state is FeedState.LIVE and cursor.next_id == 7
    assert held(index) == {1, 2, 9, 10}  # 5 was in the snapshot (stale in the buffer), 6 applied after it
    assert cursor.stats.recovered_snapshot == 1 and cursor.stats.stale == 1
    assert [m for _, m in recovered] == ["snapshot"]


def test_second_gap_while_draining_starts_a_new_recovery():
    cursor, _, _ = make()
    restored(cursor, 0)
    cursor.on_events([stored(2, 3)])  # 0, 1 lost
    first_epoch = cursor.epoch
    cursor.on_events([stored(5, 6)])  # buffered; 3, 4 lost too
    cursor.on_recovery_events([stored(0, 1), stored(1, 2, parent=1)], first_epoch)
    assert cursor.state is FeedState.RECOVERING and cursor.gap_from == 3 and cursor.epoch != first_epoch
    cursor.on_recovery_events([stored(3, 4, parent=3), stored(4, 5, parent=4)], cursor.epoch)
    assert cursor.state is FeedState.LIVE and cursor.next_id == 6 and cursor.stats.gaps == 2


def test_cleared_after_a_gap_is_a_barrier_no_recovery_needed():
    cursor, index, recovered = make()
    restored(cursor, 0, (None, (1, 2)))
    cursor.on_events([cleared(4), stored(5, 7)])  # 0..3 lost, but the Cleared makes them irrelevant
    assert cursor.state is FeedState.LIVE and cursor.next_id == 6
    assert held(index) == {7} and cursor.stats.recovered_barrier == 1 and cursor.stats.gaps == 1
    assert [m for _, m in recovered] == ["barrier"]


def test_cleared_during_a_recovery_cancels_it():
    cursor, index, _ = make()
    restored(cursor, 0, (None, (1,)))
    cursor.on_events([stored(2, 3)])  # gap
    epoch = cursor.epoch
    cursor.on_events([stored(3, 4), cleared(4), stored(5, 5)])
    assert cursor.state is FeedState.LIVE and cursor.next_id == 6 and cursor.epoch != epoch
    assert held(index) == {5}
    cursor.on_recovery_events([stored(0, 9)], epoch)  # the abandoned recovery's late answer is ignored
    assert held(index) == {5}


def test_hole_in_the_replay_restarts_the_recovery_from_there():
    cursor, _, _ = make()
    restored(cursor, 0)
    cursor.on_events([stored(4, 5)])
    epoch = cursor.epoch
    cursor.on_recovery_events([stored(0, 1), stored(2, 3)], epoch)  # 1 missing in the replay itself
    assert cursor.state is FeedState.RECOVERING and cursor.gap_from == 1 and cursor.epoch != epoch


def test_recovery_buffer_is_bounded_then_a_full_restore_is_needed():
    cursor, _, _ = make(max_buffer=3)
    restored(cursor, 0)
    cursor.on_events([stored(5, 1)])
    cursor.on_events([stored(6, 2), stored(7, 3), stored(8, 4)])
    assert cursor.state is FeedState.RESTORING and cursor.next_id is None and cursor.buffer == []


def test_abandon_recovery_resumes_from_the_cursor():
    cursor, _, _ = make()
    restored(cursor, 0)
    cursor.on_events([stored(0, 1), stored(3, 4)])
    cursor.abandon_recovery()
    assert cursor.state is FeedState.LIVE and cursor.next_id == 1 and cursor.buffer == []
