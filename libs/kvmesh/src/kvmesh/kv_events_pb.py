"""Conversion between the KV event types (``kvmesh.kv_events``) and their protobuf wire form.

One place for both directions so that publisher and subscriber cannot drift apart. Hashes
travel as packed repeated uint64 (parallel arrays), which (de)serialises far faster in Python
than one sub-message per block.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvmesh.kv_events import AllCleared, BlocksRemoved, BlocksStored, EventData, KvEvent, StoredBlock
from kvmesh.v1 import kv_events_pb2 as pb

_CLEARED = AllCleared()


def stored_to_proto(data: BlocksStored, out: pb.BlocksStored) -> None:
    if data.parent_hash is not None:
        out.parent_hash = data.parent_hash
    out.block_hashes.extend([b.block_hash for b in data.blocks])
    out.tokens_hashes.extend([b.tokens_hash for b in data.blocks])


def stored_from_proto(msg: pb.BlocksStored) -> BlocksStored:
    parent = msg.parent_hash if msg.HasField("parent_hash") else None
    blocks = tuple(map(StoredBlock, msg.block_hashes, msg.tokens_hashes))
    return BlocksStored(parent, blocks)


def event_to_proto(event: KvEvent, out: pb.KvEvent) -> None:
    out.event_id = event.event_id
    data = event.data
    if isinstance(data, BlocksStored):
        stored_to_proto(data, out.stored)
    elif isinstance(data, BlocksRemoved):
        out.removed.block_hashes.extend(data.block_hashes)
    else:
        out.cleared.SetInParent()


def data_from_proto(msg: pb.KvEvent) -> EventData:
    kind = msg.WhichOneof("data")
    if kind == "stored":
        return stored_from_proto(msg.stored)
    if kind == "removed":
        return BlocksRemoved(tuple(msg.removed.block_hashes))
    if kind == "cleared":
        return _CLEARED
    raise ValueError(f"KV event {msg.event_id} carries no data")


def event_from_proto(msg: pb.KvEvent) -> KvEvent:
    return KvEvent(msg.event_id, data_from_proto(msg))


def batch_to_proto(events: Iterable[KvEvent]) -> pb.KvEventBatch:
    batch = pb.KvEventBatch()
    for event in events:
        event_to_proto(event, batch.events.add())
    return batch


def snapshot_to_proto(stored: Iterable[BlocksStored], next_event_id: int) -> pb.KvIndexSnapshot:
    snap = pb.KvIndexSnapshot(next_event_id=next_event_id)
    for data in stored:
        stored_to_proto(data, snap.stored.add())
    return snap


def snapshot_from_proto(msg: pb.KvIndexSnapshot) -> tuple[list[BlocksStored], int]:
    return [stored_from_proto(s) for s in msg.stored], msg.next_event_id
