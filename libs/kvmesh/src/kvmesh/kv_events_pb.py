"""The KV event types (``kvmesh.kv_events``) in their protobuf wire form, for publishers.

Only the publishing direction lives here: the router decodes the wire messages straight into its
index (``kvmesh_router.ingest``), which is its one decode path. Hashes travel as packed repeated
uint64 (parallel arrays), which (de)serialises far faster in Python than one sub-message per block.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvmesh.kv_events import BlocksRemoved, BlocksStored, KvEvent
from kvmesh.v1 import kv_events_pb2 as pb


def stored_to_proto(data: BlocksStored, out: pb.BlocksStored) -> None:
    if data.parent_hash is not None:
        out.parent_hash = data.parent_hash
    out.block_hashes.extend([b.block_hash for b in data.blocks])
    out.tokens_hashes.extend([b.tokens_hash for b in data.blocks])


def event_to_proto(event: KvEvent, out: pb.KvEvent) -> None:
    out.event_id = event.event_id
    data = event.data
    if isinstance(data, BlocksStored):
        stored_to_proto(data, out.stored)
    elif isinstance(data, BlocksRemoved):
        out.removed.block_hashes.extend(data.block_hashes)
    else:
        out.cleared.SetInParent()


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
