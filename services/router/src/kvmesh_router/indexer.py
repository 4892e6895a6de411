"""The prefix index: which engines hold which cached KV blocks, fed by the engines' KV events.

(About 700 lines on purpose: the bitmask store, its eviction and the match walk share one private data
layout tuned together for the hot path; split, each piece would expose that layout.)

Design (a flat sequence-hash index, not a node-object radix tree)
-----------------------------------------------------------------
A block's identity is its *sequence* hash, which chains every preceding block, so one sequence hash names
one whole prefix. A dict ``seq_hash -> engine bitmask`` therefore carries exactly the information of
Dynamo's radix tree (one node per prefix, annotated with its engines) without node objects:

- ``find_matches(seq_hashes)`` walks the request's hashes from the first and intersects the masks
  (``cand &= holders[h]``), recording an engine's score at the depth where its bit drops out. It stops at
  the first block nobody still in the candidate set holds. Cost: O(matched depth) dict look-ups plus
  O(engines that match at all) to decode bits (the size of the answer), independent of fleet size
  otherwise. The running intersections are computed at C speed (``itertools.accumulate`` over the
  masks, cut at the first empty one) and only the depths where the candidate set changes run Python code.
- Each engine gets a dense *slot* (its bit); freed slots are reused, lowest first, so masks stay short.
  Dense masks (hundreds of engines) are decoded with numpy, and when most candidates drop at once (a
  system prompt every engine holds, then divergence) they are all scored from a cached decode of the
  candidate mask and the few survivors overwritten later; when that happens first, the ``{engine: depth}``
  dict itself is copied from a small cache (``EngineSlots.scored``).
- There are no per-engine sets: an engine's membership is its bit, so a stored or removed block costs one
  ``holders`` update (plus one metadata row for a block new to the fleet). ``Cleared``, ``remove_engine``
  and ``dump`` scan the index instead (O(distinct blocks)); they are rare (engine restart, leave,
  recovery, ops). A global ``seq_hash -> (parent_hash, tokens_hash)`` table (one row per distinct block,
  shared by every engine holding it) rebuilds ``BlocksStored`` events for dumps. This assumes, like
  Dynamo, that a block hash means the same block on every engine (chained hashes guarantee it).
- Every big table maps ints to ints (hashes are u64, the metadata row is packed into one int), so the
  cyclic GC never tracks or traverses the index: no collection pause grows with its size.
- Measured alternatives, on the same Mooncake-derived event/query streams as
  ``kvmesh_bench.indexer_microbench`` (best of 7, interleaved): ``seq_hash -> set(engines)`` and a
  node-object radix tree (Dynamo's layout) apply events 10-45% slower and match up to 1.5x slower;
  per-engine hash sets (no global table) apply events 3x faster (C-level ``set.update``; an upper bound,
  the prototype kept no dump metadata) and match as fast at 8 engines, but matching is O(engines x
  depth): 2-3x slower at 128 engines, 5x at 1000. An earlier version of this index kept a per-engine
  set beside the masks: 30% slower events, for O(own blocks) clears.

Semantics (Dynamo ``radix_tree.rs``)
------------------------------------
- Store: the parent must be held *by that engine* (``None`` = a sequence start) or the whole store is
  dropped (:attr:`ApplyError.PARENT_NOT_FOUND`). Re-storing a held block is idempotent (it counts as
  a use for eviction). A block equal to its own parent stops the store there (:attr:`ApplyError.INVALID_SEQUENCE`).
- Remove: per hash, the engine stops holding it. Removal never cascades: a child may stay held while its
  parent is not; ``find_matches`` stops at the first block the engine does not hold, so such an orphan
  scores nothing until its parent is stored again. Unknown hashes are skipped and reported after the batch
  (:attr:`ApplyError.BLOCK_NOT_FOUND`).
- Cleared wipes one engine (which stays registered, empty); :meth:`KvIndexer.remove_engine` forgets it.
- Every rejected event is also counted in :attr:`KvIndexer.counters` (for metrics).

Bounded memory and the eviction policy
--------------------------------------
``max_entries`` caps the index size, counted in (engine, block) entries, the quantity that grows with
fleet size times cache size (ai-dynamo/dynamo#4429: an index that grows until the host runs out of RAM).
When a store pushes the size over the cap, whole **blocks** are evicted, **least recently stored or
matched first, globally, from every engine that holds them**, down to ``low_water_ratio * max_entries``
(batching keeps the amortized cost O(1) per stored block). Why this policy:

- Recency is tracked per block, not per (engine, block): a query touches at most its matched depth, so
  the bookkeeping cost of a ``find_matches`` does not grow with the number of engines holding a shared
  system prompt (per-entry recency would cost one touch per engine per matched block).
- Global, not per engine: engines have unequal caches and unequal traffic; a block no request has
  stored or matched for the longest time is the least useful routing signal on every engine alike, and
  dropping it whole also frees its shared metadata row.
- A match refreshes its prefix deepest block first, so ancestors end up more recent than descendants and
  eviction trims matched chains from the leaves. New blocks are appended in chain order; when an interior
  block is evicted, its stranded descendants (unmatchable from then on, so never refreshed) were stored
  right after it and follow it out in the same or the next batch.
- Recency costs two dict operations per touched block, which would halve ``find_matches`` throughput, so
  it is only maintained while the index is at least half full (``track_ratio``): below that nothing can be
  evicted soon, and by the time the cap is reached the order reflects the latest half of the history. A
  correctly sized cap (see below) is never approached and costs nothing.

Evicting only makes the router under-estimate an overlap (it never invents one). Two consequences: a
later ``Removed`` for an evicted block counts as unknown, and a later ``Stored`` whose parent was evicted
is dropped. Size the cap above the fleet's aggregate cache (sum of engines' total blocks, plus host tiers)
so that it only fires when removals were lost; then the evicted entries are mostly the stale ones.
``max_entries=None`` disables the cap (and the recency bookkeeping).

Nothing here does I/O, takes a lock or reads a clock: one owner (the router's event loop, or a
simulation) calls it.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass
from itertools import accumulate, repeat, takewhile
from operator import and_
from typing import Protocol

import numpy as np
from kvmesh.kv_events import (
    NO_PARENT,
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    EventData,
    KvEvent,
    StoredBlock,
    parent_of,
    tokens_hash_of,
)

__all__ = [
    "DEFAULT_MAX_ENTRIES",
    "ApplyError",
    "EngineSlots",
    "IndexerCounters",
    "KvIndexer",
    "PrefixIndex",
    "match_prefix",
]

#: Default cap on (engine, block) entries. Measured 100-200 bytes per entry (more when blocks are not shared
#: between engines), so about 0.5-0.9 GB at the cap.
DEFAULT_MAX_ENTRIES = 4_000_000


class PrefixIndex(Protocol):
    """What selection needs from an index: per engine, how many leading blocks of a request it holds."""

    def find_matches(self, seq_hashes: Sequence[int]) -> dict[int, int]:
        """``{engine: matched leading blocks}`` for every engine matching at least the first block."""
        ...


class ApplyError(enum.Enum):
    """Why (part of) an event was not applied; the index stays consistent either way."""

    PARENT_NOT_FOUND = "parent_not_found"
    BLOCK_NOT_FOUND = "block_not_found"
    INVALID_SEQUENCE = "invalid_sequence"


@dataclass(slots=True)
class IndexerCounters:
    """Monotonic counters for metrics."""

    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    stores_dropped: int = 0
    unknown_removals: int = 0
    invalid_sequences: int = 0
    clears: int = 0
    evicted_blocks: int = 0
    evicted_entries: int = 0


class EngineSlots:
    """Engine id (u63) <-> dense slot; bit ``1 << slot`` represents the engine in masks.

    Freed slots are reused lowest first so masks stay as short as the live fleet. :meth:`decode` turns a
    mask back into engine ids: bit by bit for sparse masks, with numpy for dense ones (a mask naming
    hundreds of engines decodes several times faster that way).
    """

    __slots__ = ("_array", "_cache", "_free", "_scored", "_slot_of", "names")

    def __init__(self) -> None:
        self._slot_of: dict[int, int] = {}
        self._free: list[int] = []
        #: slot -> engine id (None for a free slot); indexable by ``bit.bit_length() - 1``.
        self.names: list[int | None] = []
        self._array: np.ndarray | None = None  # names as int64, rebuilt lazily after membership changes
        self._cache: dict[int, list[int]] = {}  # mask -> decoded ids, for recurring dense masks
        self._scored: dict[tuple[int, int], dict[int, int]] = {}  # (mask, depth) -> {id: depth}, see scored

    def __contains__(self, engine_id: int) -> bool:
        return engine_id in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def get(self, engine_id: int) -> int | None:
        return self._slot_of.get(engine_id)

    def acquire(self, engine_id: int) -> int:
        slot = self._slot_of.get(engine_id)
        if slot is not None:
            return slot
        if self._free:
            slot = heapq.heappop(self._free)
            self.names[slot] = engine_id
        else:
            slot = len(self.names)
            self.names.append(engine_id)
        self._slot_of[engine_id] = slot
        self._array = None
        self._cache.clear()
        self._scored.clear()
        return slot

    def release(self, engine_id: int) -> int | None:
        slot = self._slot_of.pop(engine_id, None)
        if slot is not None:
            self.names[slot] = None
            heapq.heappush(self._free, slot)
            self._array = None
            self._cache.clear()
            self._scored.clear()
        return slot

    def engines(self) -> list[int]:
        return sorted(self._slot_of)

    def decode(self, mask: int) -> list[int]:
        """Engine ids of the bits set in ``mask`` (ascending slot order)."""
        names = self.names
        if mask.bit_count() <= _DENSE_DECODE_MIN_BITS:
            out: list[int] = []
            while mask:
                low = mask & -mask
                # a set bit is always an occupied slot, never None
                out.append(names[low.bit_length() - 1])  # type: ignore[arg-type]
                mask ^= low
            return out
        arr = self._array
        if arr is None:
            arr = self._array = np.array([-1 if n is None else n for n in names], dtype=np.int64)
        n = len(names)
        bits = np.unpackbits(np.frombuffer(mask.to_bytes((n + 7) // 8, "little"), np.uint8), bitorder="little")
        ids: list[int] = arr[bits[:n].view(np.bool_)].tolist()
        return ids

    def decode_cached(self, mask: int) -> list[int]:
        """:meth:`decode` through a small cache (valid until membership changes); do not mutate the result.

        The candidate mask of a popular first block (a system prompt every engine holds) recurs query
        after query, so its decode is worth keeping.
        """
        cache = self._cache
        out = cache.get(mask)
        if out is None:
            out = self.decode(mask)
            if len(cache) >= _DECODE_CACHE_SIZE:
                cache.clear()
            cache[mask] = out
        return out

    def scored(self, mask: int, depth: int) -> dict[int, int]:
        """A new ``{engine id: depth}`` for every bit of ``mask`` (ascending slot order), copied from a cache.

        A popular first block (a system prompt most engines hold) gives the same candidate mask and, where
        requests diverge right after it, the same depth query after query: copying a ready dict is several
        times cheaper than hashing its keys again (``dict.fromkeys``).
        """
        key = (mask, depth)
        cache = self._scored
        out = cache.get(key)
        if out is None:
            out = dict.fromkeys(self.decode_cached(mask), depth)
            if len(cache) >= _DECODE_CACHE_SIZE:
                cache.clear()
            cache[key] = out
        return out.copy()


#: Masks with more set bits than this are decoded with numpy (measured break-even is around 20-30).
_DENSE_DECODE_MIN_BITS = 32
_DECODE_CACHE_SIZE = 64


def match_prefix(
    get_mask: Callable[[int, int], int], slots: EngineSlots, seq_hashes: Sequence[int]
) -> tuple[dict[int, int], int]:
    """The shared prefix walk over a ``hash -> engine mask`` map.

    Returns ``({engine: leading blocks held}, deepest depth reached by any engine)``. An engine's score is
    the index of the first block it does not hold. ``get_mask`` is the map's ``get`` (called as
    ``get_mask(h, 0)``); ``slots`` maps bits to engine ids.
    """
    # The running intersections, computed at C speed (``accumulate``) and cut at the first empty one: the
    # masks are non-increasing (each is a subset of the previous), so only the few depths where the value
    # changes need Python work; they are found with ``dict.fromkeys`` (distinct values, in order) and
    # ``list.index``. Same look-ups as a per-block loop: none past the first block nobody left holds.
    cands: list[int] = list(takewhile(bool, accumulate(map(get_mask, seq_hashes, repeat(0)), and_)))
    depth = len(cands)
    if not depth:
        return {}, 0
    names = slots.names
    scores: dict[int, int] = {}
    cand = cands[0]
    if cand != cands[-1]:
        pos = 0
        for nxt in dict.fromkeys(cands):
            if nxt == cand:
                continue
            pos = cands.index(nxt, pos)
            gone = cand ^ nxt
            if not gone & (gone - 1):
                # a set bit is always an occupied slot, never None
                scores[names[gone.bit_length() - 1]] = pos  # type: ignore[index]
            elif gone.bit_count() <= _DENSE_DECODE_MIN_BITS or gone.bit_count() <= nxt.bit_count():
                for e in slots.decode(gone):
                    scores[e] = pos
            else:
                # Most candidates drop here: score all of them (a cached dict, C-level copy); the few
                # survivors are overwritten with their own depth when they drop later.
                if scores:
                    scores.update(dict.fromkeys(slots.decode_cached(cand), pos))
                else:
                    scores = slots.scored(cand, pos)
            cand = nxt
    # the last candidates hold every block up to ``depth`` (the end of the request, or where all drop)
    if not cand & (cand - 1):
        # a set bit is always an occupied slot, never None
        scores[names[cand.bit_length() - 1]] = depth  # type: ignore[index]
    elif depth < len(seq_hashes) and cand.bit_count() <= _DENSE_DECODE_MIN_BITS:
        for e in slots.decode(cand):
            scores[e] = depth
    elif scores:
        scores.update(dict.fromkeys(slots.decode_cached(cand), depth))
    else:
        scores = slots.scored(cand, depth)
    return scores, depth


class KvIndexer:
    """Which engines hold which prefix blocks, from their KV events. See the module docstring.

    ``max_entries`` caps (engine, block) entries (None: unbounded); an over-cap store evicts down to
    ``low_water_ratio * max_entries``; recency is tracked once the size reaches ``track_ratio * max_entries``.
    """

    __slots__ = (
        "_capped",
        "_counts",
        "_dumps",
        "_holders",
        "_low_water",
        "_meta",
        "_size",
        "_slots",
        "_track_from",
        "counters",
        "max_entries",
    )

    def __init__(
        self,
        max_entries: int | None = DEFAULT_MAX_ENTRIES,
        low_water_ratio: float = 0.9,
        track_ratio: float = 0.5,
        dumps: bool = True,
    ) -> None:
        """``dumps=False``: keep no per-block (parent, tokens hash) rows, so no dumps (they raise) and no cap;
        for a simulation that only routes (the offline replay): a stored block costs one dict row, not two.
        """
        if not dumps and max_entries is not None:
            raise ValueError("an index without dump metadata cannot be capped (its recency order lives there)")
        if max_entries is not None and max_entries <= 0:
            raise ValueError(f"max_entries must be positive or None, got {max_entries}")
        if not 0.0 < low_water_ratio <= 1.0:
            raise ValueError(f"low_water_ratio must be in (0, 1], got {low_water_ratio}")
        if not 0.0 <= track_ratio <= 1.0:
            raise ValueError(f"track_ratio must be in [0, 1], got {track_ratio}")
        self.max_entries = max_entries
        self._capped = max_entries is not None
        self._low_water = int(max_entries * low_water_ratio) if max_entries is not None else 0
        # Recency is maintained only from this size on (never when uncapped).
        self._track_from: float = max_entries * track_ratio if max_entries is not None else float("inf")
        self._holders: dict[int, int] = {}  # seq hash -> engine bitmask (never 0)
        # seq hash -> kvmesh.kv_events.pack_block_meta(parent hash, tokens hash). Its insertion order is the
        # recency order (oldest first): a touch re-inserts the key (a plain dict is half the memory of an OrderedDict).
        self._meta: dict[int, int] = {}  # stays empty with dumps=False
        self._dumps = dumps
        self._slots = EngineSlots()
        self._counts: list[int] = []  # slot -> blocks held by that engine
        self._size = 0
        self.counters = IndexerCounters()

    # ------------------------------------------------------------------ membership

    def add_engine(self, engine_id: int) -> None:
        """Register an engine with no blocks (engines are also registered by their first event)."""
        self._slot(engine_id)

    def _slot(self, engine_id: int) -> int:
        slot = self._slots.acquire(engine_id)
        if slot == len(self._counts):
            self._counts.append(0)
        return slot

    def remove_engine(self, engine_id: int) -> bool:
        """Forget an engine entirely (O(distinct blocks) scan); False if it was unknown."""
        slot = self._slots.get(engine_id)
        if slot is None:
            return False
        self._drop_all(slot)
        self._slots.release(engine_id)
        return True

    def engines(self) -> list[int]:
        """Registered engines (including empty ones), sorted."""
        return self._slots.engines()

    def __contains__(self, engine_id: int) -> bool:
        return engine_id in self._slots

    # ------------------------------------------------------------------ events

    def apply_event(self, engine_id: int, event: KvEvent) -> ApplyError | None:
        """Apply one journal entry (event ids and gaps are the transport's business, not the index's)."""
        return self.apply(engine_id, event.data)

    def apply(self, engine_id: int, data: EventData) -> ApplyError | None:
        """Apply one event's payload for ``engine_id``; returns the first error, or None."""
        self.counters.events += 1
        if type(data) is BlocksStored:
            return self.store(engine_id, data.parent_hash, data.blocks)
        if type(data) is BlocksRemoved:
            return self.remove(engine_id, data.block_hashes)
        if type(data) is AllCleared:
            self.clear(engine_id)
            return None
        raise TypeError(f"unknown KV event payload {type(data).__name__}")

    def store(self, engine_id: int, parent_hash: int | None, blocks: Sequence[StoredBlock]) -> ApplyError | None:
        """``engine_id`` cached ``blocks`` (a chain) after ``parent_hash``; dropped whole if the parent is unknown."""
        if not self._dumps:
            return self.store_chain(
                engine_id, parent_hash, [b.block_hash for b in blocks], [b.tokens_hash for b in blocks]
            )
        slot = self._slots._slot_of.get(engine_id)  # inlined EngineSlots.get: this is the hot path
        if slot is None:
            slot = self._slot(engine_id)
        bit = 1 << slot
        holders = self._holders
        get = holders.get
        if parent_hash is not None and not get(parent_hash, 0) & bit:
            self.counters.stores_dropped += 1
            return ApplyError.PARENT_NOT_FOUND
        meta = self._meta
        tracking = self._size >= self._track_from
        prev = NO_PARENT if parent_hash is None else parent_hash
        # added = blocks new to the fleet (the growth of holders) + blocks other engines already held
        fleet_before = len(holders)
        shared = 0
        error: ApplyError | None = None
        for block in blocks:
            h = block.block_hash
            if h == prev:
                self.counters.invalid_sequences += 1
                error = ApplyError.INVALID_SEQUENCE
                break
            mask = get(h)
            if mask is None:  # a block no engine holds yet: appended, i.e. most recent
                holders[h] = bit
                meta[h] = prev << 64 | block.tokens_hash
            else:
                if not mask & bit:
                    holders[h] = mask | bit
                    shared += 1
                if tracking:  # stored again (here or elsewhere): most recent
                    meta[h] = meta.pop(h)
            prev = h
        added = len(holders) - fleet_before + shared
        self._size += added
        self._counts[slot] += added
        self.counters.blocks_stored += added
        # _capped means max_entries is not None (a bool: cheaper on this hot path than the None test)
        if self._capped and self._size > self.max_entries:  # type: ignore[operator]
            self._evict(self._low_water)
        return error

    def store_chain(
        self, engine_id: int, parent_hash: int | None, block_hashes: Sequence[int], tokens_hashes: Sequence[int]
    ) -> ApplyError | None:
        """:meth:`store` with the chain as two parallel hash sequences (no StoredBlock objects to build).

        The same loop as ``store``, kept separate because each is a hot path (the daemon's events, the
        offline replay's changes) and a shared helper would cost one of them a conversion per block
        (measured: bulk ``dict.update`` inserts are no faster than this loop on a large index).
        """
        slot = self._slots._slot_of.get(engine_id)  # inlined EngineSlots.get: this is the hot path
        if slot is None:
            slot = self._slot(engine_id)
        bit = 1 << slot
        holders = self._holders
        get = holders.get
        if parent_hash is not None and not get(parent_hash, 0) & bit:
            self.counters.stores_dropped += 1
            return ApplyError.PARENT_NOT_FOUND
        meta = self._meta
        dumps = self._dumps
        tracking = self._size >= self._track_from
        prev = NO_PARENT if parent_hash is None else parent_hash
        fleet_before = len(holders)  # see store
        shared = 0
        error: ApplyError | None = None
        for h, tokens_hash in zip(block_hashes, tokens_hashes, strict=True):
            if h == prev:
                self.counters.invalid_sequences += 1
                error = ApplyError.INVALID_SEQUENCE
                break
            mask = get(h)
            if mask is None:  # a block no engine holds yet: appended, i.e. most recent
                holders[h] = bit
                if dumps:
                    meta[h] = prev << 64 | tokens_hash
            else:
                if not mask & bit:
                    holders[h] = mask | bit
                    shared += 1
                if tracking:  # stored again (here or elsewhere): most recent
                    meta[h] = meta.pop(h)
            prev = h
        added = len(holders) - fleet_before + shared
        self._size += added
        self._counts[slot] += added
        self.counters.blocks_stored += added
        if self._capped and self._size > self.max_entries:  # type: ignore[operator]
            self._evict(self._low_water)
        return error

    def remove(self, engine_id: int, block_hashes: Iterable[int]) -> ApplyError | None:
        """``engine_id`` evicted ``block_hashes`` (no cascade); unknown hashes are skipped and reported."""
        slot = self._slots.get(engine_id)
        removed = missing = 0
        if slot is None:
            missing = sum(1 for _ in block_hashes)
        else:
            bit = 1 << slot
            holders = self._holders
            get = holders.get
            meta = self._meta
            if isinstance(block_hashes, list | tuple):
                masks = list(map(get, block_hashes))
                n = len(masks)
                if masks.count(bit) == n and len(set(block_hashes)) == n:
                    # The usual removal: blocks only this engine held, each once; the same moves at C speed.
                    deque(map(holders.__delitem__, block_hashes), 0)
                    if self._dumps:
                        deque(map(meta.__delitem__, block_hashes), 0)
                    self._size -= n
                    self._counts[slot] -= n
                    self.counters.blocks_removed += n
                    return None
            for h in block_hashes:
                mask = get(h, 0)
                if not mask & bit:
                    missing += 1
                    continue
                mask ^= bit
                if mask:
                    holders[h] = mask
                else:
                    del holders[h]
                    if self._dumps:
                        del meta[h]
                removed += 1
            self._size -= removed
            self._counts[slot] -= removed
            self.counters.blocks_removed += removed
        if missing:
            self.counters.unknown_removals += missing
            return ApplyError.BLOCK_NOT_FOUND
        return None

    def clear(self, engine_id: int) -> None:
        """``engine_id`` dropped its whole cache; it stays registered, empty."""
        self._drop_all(self._slot(engine_id))
        self.counters.clears += 1

    def _drop_all(self, slot: int) -> None:
        if not self._counts[slot]:
            return
        bit = 1 << slot
        holders = self._holders
        meta = self._meta
        for h in [h for h, mask in holders.items() if mask & bit]:
            mask = holders[h] ^ bit
            if mask:
                holders[h] = mask
            else:
                del holders[h]
                if self._dumps:
                    del meta[h]
        self._size -= self._counts[slot]
        self._counts[slot] = 0

    def _evict(self, target: int) -> None:
        holders = self._holders
        meta = self._meta
        counts = self._counts
        excess = self._size - target
        victims: list[int] = []
        for h in meta:  # oldest first; the dict is mutated only after the walk
            if excess <= 0:
                break
            victims.append(h)
            excess -= holders[h].bit_count()
        evicted = 0
        for h in victims:
            del meta[h]
            mask = holders.pop(h)
            while mask:
                low = mask & -mask
                counts[low.bit_length() - 1] -= 1
                mask ^= low
                evicted += 1
        self._size -= evicted
        self.counters.evicted_blocks += len(victims)
        self.counters.evicted_entries += evicted

    # ------------------------------------------------------------------ queries

    def find_matches(self, seq_hashes: Sequence[int], touch: bool = True) -> dict[int, int]:
        """``{engine: leading blocks of seq_hashes it holds}``, engines with at least one block only.

        Contiguous from the first block: an engine's count stops at the first block it does not hold.
        With a cap, ``touch`` refreshes the recency of the matched blocks (deepest oldest).
        """
        scores, depth = match_prefix(self._holders.get, self._slots, seq_hashes)
        if touch and depth and self._size >= self._track_from:
            meta = self._meta
            pop = meta.pop
            for i in range(depth - 1, -1, -1):  # deepest first: ancestors end up more recent
                h = seq_hashes[i]
                meta[h] = pop(h)
        return scores

    def holds(self, engine_id: int, block_hash: int) -> bool:
        slot = self._slots.get(engine_id)
        return slot is not None and bool(self._holders.get(block_hash, 0) >> slot & 1)

    def __len__(self) -> int:
        """Total (engine, block) entries: the quantity ``max_entries`` bounds (export it as a gauge)."""
        return self._size

    @property
    def size(self) -> int:
        return self._size

    @property
    def num_blocks(self) -> int:
        """Distinct block hashes held by at least one engine."""
        return len(self._holders)

    def engine_size(self, engine_id: int) -> int:
        """Blocks held by one engine (0 if unknown)."""
        slot = self._slots.get(engine_id)
        return 0 if slot is None else self._counts[slot]

    # ------------------------------------------------------------------ dumps and comparison

    def _held_by_slot(self) -> dict[int, set[int]]:
        """slot -> hashes, for every slot holding something (one pass over the index)."""
        out: dict[int, set[int]] = {}
        names = self._slots.names
        for h, mask in self._holders.items():
            while mask:
                low = mask & -mask
                slot = low.bit_length() - 1
                if names[slot] is not None:
                    out.setdefault(slot, set()).add(h)
                mask ^= low
        return out

    def blocks_of(self, engine_id: int) -> frozenset[int]:
        """Every hash ``engine_id`` holds (O(distinct blocks) scan)."""
        slot = self._slots.get(engine_id)
        if slot is None or not self._counts[slot]:
            return frozenset()
        bit = 1 << slot
        return frozenset(h for h, mask in self._holders.items() if mask & bit)

    def dump(self, engine_id: int) -> list[BlocksStored]:
        """``BlocksStored`` events, parents before children, that rebuild ``engine_id``'s reachable blocks.

        One event per chain run, siblings in hash order (deterministic). Blocks whose parent the engine
        does not hold (orphans left by a non-cascading removal, and their descendants) are not included:
        a store of them would be rejected, and ``find_matches`` cannot reach them anyway (Dynamo's BFS
        dump omits them too). O(distinct blocks) scan: for recovery, ops and tests, not the hot path.
        """
        return self._dump_set(self.blocks_of(engine_id))

    def _dump_set(self, own: Set[int]) -> list[BlocksStored]:
        if not self._dumps:
            raise RuntimeError("this index keeps no dump metadata (dumps=False)")
        meta = self._meta
        roots: list[int] = []
        children: dict[int, list[int]] = {}
        for h in own:
            parent = parent_of(meta[h])
            if parent is None:
                roots.append(h)
            elif parent in own:
                children.setdefault(parent, []).append(h)
        roots.sort()
        for kids in children.values():
            kids.sort()
        out: list[BlocksStored] = []
        stack: list[tuple[int | None, int]] = [(None, h) for h in reversed(roots)]
        while stack:
            parent, h = stack.pop()
            run: list[StoredBlock] = []
            while True:
                run.append(StoredBlock(h, tokens_hash_of(meta[h])))
                next_kids = children.get(h)
                if not next_kids:
                    break
                for other in reversed(next_kids[1:]):
                    stack.append((h, other))
                h = next_kids[0]
            out.append(BlocksStored(parent, tuple(run)))
        return out

    def dump_all(self) -> dict[int, list[BlocksStored]]:
        """:meth:`dump` of every registered engine, in one pass over the index."""
        held = self._held_by_slot()
        slot_of = self._slots.get
        # every registered engine has a slot, so slot_of(e) is never None
        return {e: self._dump_set(held.get(slot_of(e)) or set()) for e in self.engines()}  # type: ignore[arg-type]

    def canonical(self, reachable_only: bool = False) -> dict[int, frozenset[int]]:
        """``{engine: frozenset(held hashes)}`` for comparing replicas; engines with no blocks are omitted.

        ``reachable_only`` keeps only blocks whose whole ancestor chain the engine holds (what a
        :meth:`dump` rebuilds).
        """
        held = self._held_by_slot()
        slot_of = self._slots.get
        out: dict[int, frozenset[int]] = {}
        for e in self.engines():
            own = held.get(slot_of(e))  # type: ignore[arg-type]  # a registered engine always has a slot
            if own and reachable_only:
                own = {b.block_hash for ev in self._dump_set(own) for b in ev.blocks}
            if own:
                out[e] = frozenset(own)
        return out

    @classmethod
    def from_dumps(cls, dumps: dict[int, list[BlocksStored]], max_entries: int | None = None) -> KvIndexer:
        """A fresh index rebuilt from :meth:`dump_all` output (tests, replica comparison)."""
        index = cls(max_entries=max_entries)
        for engine_id, events in dumps.items():
            index.add_engine(engine_id)
            for ev in events:
                index.store(engine_id, ev.parent_hash, ev.blocks)
        return index
