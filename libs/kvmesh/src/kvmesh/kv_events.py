"""The KV event vocabulary engines publish and routers ingest, independent of any transport.

An engine's events are its cache journal: ``event_id`` is contiguous per engine from 0, so a
subscriber that sees a jump knows it lost events. Protobuf conversion lives with the transport
(``kvmesh.kv_events_pb``); engine and router cores only see these types.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """One newly cached full block: its sequence hash (identity) and its tokens hash (content)."""

    block_hash: int
    tokens_hash: int


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Consecutive full blocks newly cached after ``parent_hash`` (None: they start a sequence)."""

    parent_hash: int | None
    blocks: tuple[StoredBlock, ...]


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    """Cached blocks evicted or destroyed; removal never implies anything about descendants."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllCleared:
    """The engine dropped its whole cache (a barrier: nothing before it still holds)."""


EventData = BlocksStored | BlocksRemoved | AllCleared

# A cached block's (parent, tokens hash) as one int, ``parent << 64 | tokens_hash``, for the tables that
# keep one row per block (the router's index, the mocker's block manager). Ints are never tracked by the
# cyclic GC, whereas a tuple per block is tracked from its creation until a collection has seen it: every
# block stored would count towards the next young collection and be walked by it.
U64_MASK = (1 << 64) - 1
#: The "parent" of a sequence's first block: not a u64, so no block hash equals it (and a store loop
#: needs no None test per block).
NO_PARENT = 1 << 64


def pack_block_meta(parent_hash: int | None, tokens_hash: int) -> int:
    return (NO_PARENT if parent_hash is None else parent_hash) << 64 | tokens_hash


def parent_of(packed: int) -> int | None:
    """The parent hash of a :func:`pack_block_meta` row (None at a sequence start)."""
    top = packed >> 64
    return None if top == NO_PARENT else top


def tokens_hash_of(packed: int) -> int:
    return packed & U64_MASK


@dataclass(frozen=True, slots=True)
class KvEvent:
    """One journal entry of one engine."""

    event_id: int
    data: EventData


@dataclass(frozen=True, slots=True)
class CacheDump:
    """An engine's whole cached set as Stored events (parents before children): a journal snapshot.

    Applying ``stored`` to an empty index rebuilds the engine's cache as of ``next_event_id``:
    a subscriber then continues with the events from ``next_event_id`` on.
    """

    stored: list[BlocksStored]
    next_event_id: int

    @property
    def last_event_id(self) -> int | None:
        return self.next_event_id - 1 if self.next_event_id else None
