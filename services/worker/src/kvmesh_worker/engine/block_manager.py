"""KV block bookkeeping with vLLM's prefix-caching semantics and the KV events they imply.

Dynamo's mocker ``KvManager`` model (four moves: Use / Deref / Destroy / Promote), keyed by block
identity rather than by physical slot:

* a **full** block is identified by its sequence hash (which encodes its whole prefix), so two
  requests with the same prefix share it, and a hash seen again is a prefix-cache hit;
* a **partial** block (the tail of a sequence, not full yet) is private to its request and gets a
  negative key; when it fills it is *promoted* to its sequence hash.

Every block is *active* (referenced, with a refcount), *inactive* (unreferenced but still cached
and matchable, in LRU order) or absent. Capacity is ``num_blocks`` = active + inactive + unused;
an inactive block is evicted (LRU first) only when a new block needs its slot.

The KV events are the journal of the *cached set* (the full blocks that are active or inactive),
so they are emitted exactly when that set changes: BlocksStored when a full block enters it (one
event per run of consecutive new blocks, parent = the predecessor's sequence hash or None at the
sequence start), BlocksRemoved when one leaves it (eviction, destroy, clear). Reusing a cached block
and releasing a block to the inactive pool change nothing a router can see, so they emit nothing.

Events go out through ``emit`` as ``EventData`` (the journal's vocabulary), or, when a :class:`KvSink` is
given, as plain hash sequences to that sink instead (an in-process consumer such as the offline replay
applies them to its index directly, without building a StoredBlock object per block). Such a consumer
holds the cached set itself, so the block manager then keeps no per-block metadata (parent and tokens
hash, which only ``dump`` needs): ``dump`` and ``clear`` raise, and a block costs two dict rows fewer.

The caller checks capacity first (``free_slots`` vs ``num_missing``), so a move never half-fails.
Cost is proportional to the blocks moved; nothing scans the cache except ``dump`` and ``clear``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from itertools import islice, repeat
from operator import lshift, or_
from typing import Protocol

from kvmesh.kv_events import (
    NO_PARENT,
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    EventData,
    StoredBlock,
    pack_block_meta,
    parent_of,
    tokens_hash_of,
)

from .evictor import LRUEvictor

_NO_CHILDREN: tuple[int, ...] = ()  # typed so that ``children.get(h, _NO_CHILDREN)[0]`` is an int


class KvSink(Protocol):
    """The cached set's changes as plain hashes (the same moments and order as the EventData journal)."""

    def stored(self, parent_hash: int | None, block_hashes: Sequence[int], tokens_hashes: Sequence[int]) -> None:
        """A run of consecutive full blocks entered the cache (BlocksStored)."""
        ...

    def removed(self, block_hashes: Sequence[int]) -> None:
        """Blocks left the cache (BlocksRemoved)."""
        ...

    def cleared(self) -> None:
        """Every block left the cache (AllCleared)."""
        ...


class _EventSink:
    """The default sink: builds the ``EventData`` values and hands them to ``emit``."""

    __slots__ = ("_emit",)

    def __init__(self, emit: Callable[[EventData], object]) -> None:
        self._emit = emit

    def stored(self, parent_hash: int | None, block_hashes: Sequence[int], tokens_hashes: Sequence[int]) -> None:
        self._emit(BlocksStored(parent_hash, tuple(map(StoredBlock, block_hashes, tokens_hashes))))

    def removed(self, block_hashes: Sequence[int]) -> None:
        self._emit(BlocksRemoved(tuple(block_hashes)))

    def cleared(self) -> None:
        self._emit(AllCleared())


class NoFreeBlocks(RuntimeError):
    """A move needed a slot that does not exist (the caller skipped its capacity check: a bug)."""


class BlockManager:
    def __init__(
        self, num_blocks: int, emit: Callable[[EventData], object] | None = None, sink: KvSink | None = None
    ) -> None:
        """Events go to ``sink`` if given (no metadata, no dumps), else to ``emit`` as EventData."""
        # Every cached full block: sequence hash -> pack_block_meta(parent, tokens hash); None with a sink.
        self._meta: dict[int, int] | None = {} if sink is None else None
        if sink is None:
            if emit is None:
                raise ValueError("BlockManager needs an emit callback or a sink")
            sink = _EventSink(emit)
        self.num_blocks = num_blocks
        self.active: dict[int, int] = {}  # block key -> refcount
        self.inactive = LRUEvictor()  # full blocks only
        self._next_partial = -1
        self._stored = sink.stored
        self._removed = sink.removed
        self._cleared = sink.cleared

    # ----------------------------------------------------------------------------------------- queries

    @property
    def num_active(self) -> int:
        return len(self.active)

    @property
    def num_inactive(self) -> int:
        return len(self.inactive)

    @property
    def free_slots(self) -> int:
        """How many more blocks can become active (unused slots + evictable inactive blocks)."""
        return self.num_blocks - len(self.active)

    def num_missing(self, hashes: Sequence[int], lo: int, hi: int) -> int:
        """How many of ``hashes[lo:hi]`` are not active yet (each takes one of ``free_slots``)."""
        return hi - lo - sum(map(self.active.__contains__, hashes[lo:hi]))

    def match_prefix(self, hashes: Sequence[int], limit: int) -> tuple[int, int]:
        """(cached blocks, of which active) in the longest cached prefix of ``hashes[:limit]``."""
        active, inactive = self.active, self.inactive
        hits = active_hits = 0
        for i in range(min(limit, len(hashes))):
            h = hashes[i]
            if h in active:
                active_hits += 1
            elif h not in inactive:
                break
            hits += 1
        return hits, active_hits

    def cached_hashes(self) -> set[int]:
        """Sequence hashes of every cached full block (active or inactive)."""
        return {h for h in self.active if h >= 0} | set(self.inactive)

    # ------------------------------------------------------------------------------------------- moves

    def use(self, hashes: Sequence[int], local_hashes: Sequence[int], lo: int, hi: int) -> None:
        """Use: take one reference on the full blocks ``hashes[lo:hi]`` of one sequence.

        Active blocks get refcount + 1, inactive ones are reactivated (cache hits, no event), and the
        others are stored (evicting LRU blocks for room) and announced in BlocksStored events.
        Existing blocks are taken first so an eviction can never hit a block this call reuses.
        """
        active, inactive = self.active, self.inactive
        i = self._take(hashes, lo, hi, None)  # the cached prefix: hits
        if i == hi:
            return
        rest = hashes[i:hi]
        runs: list[tuple[int, int]] = []
        if active.keys().isdisjoint(rest) and inactive.keys().isdisjoint(rest):
            runs.append((i, hi))  # the usual shape: everything after the first miss is new
        else:
            self._take(hashes, i, hi, runs)
        n_new = sum(b - a for a, b in runs)
        n_evict = n_new - (self.num_blocks - len(active) - len(inactive))
        if n_evict > len(inactive):
            raise NoFreeBlocks(f"{n_new} new blocks do not fit: {len(active)} of {self.num_blocks} are active")
        meta = self._meta
        if n_evict > 0:
            evicted = list(islice(inactive, n_evict))  # LRU first
            deque(map(inactive.__delitem__, evicted), 0)
            if meta is not None:
                for h in evicted:
                    del meta[h]
            self._removed(evicted)
        for a, b in runs:  # bulk inserts: this is the hot path of every prefill
            blocks, tokens = hashes[a:b], local_hashes[a:b]
            parent = hashes[a - 1] if a else None
            active.update(dict.fromkeys(blocks, 1))
            if meta is not None:
                parents = [NO_PARENT if parent is None else parent, *blocks[:-1]]
                meta.update(zip(blocks, map(or_, map(lshift, parents, repeat(64)), tokens), strict=True))
            self._stored(parent, blocks, tokens)

    def _take(self, hashes: Sequence[int], lo: int, hi: int, runs: list[tuple[int, int]] | None) -> int:
        """Take one reference on each cached block of ``hashes[lo:hi]``.

        With ``runs`` None, stop at the first block not cached and return its index (``hi`` if none);
        else go on and append the ``(start, stop)`` runs of uncached blocks to ``runs``.
        """
        active, inactive = self.active, self.inactive
        for i in range(lo, hi):
            h = hashes[i]
            rc = active.get(h)
            if rc is not None:
                active[h] = rc + 1
            elif h in inactive:
                del inactive[h]
                active[h] = 1
            elif runs is None:
                return i
            elif runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        return hi

    def new_partial(self) -> int:
        """Allocate a private partial block (evicting if needed); returns its key."""
        evicted: list[int] = []
        self._take_slot(evicted)
        if evicted:
            self._removed(evicted)
        key = self._next_partial
        self._next_partial -= 1
        self.active[key] = 1
        return key

    def promote(self, key: int, block_hash: int, tokens_hash: int, parent: int | None, position: int) -> None:
        """Promote: partial block ``key`` filled up and becomes full block ``block_hash``.

        If that block is already cached (another request computed the same tokens), the partial
        block's slot is released and the existing block is used instead; otherwise it is stored.
        ``position`` (the block's index in its sequence) is part of the move's description, not stored.
        """
        del self.active[key]
        if block_hash in self.active:
            self.active[block_hash] += 1
        elif self.inactive.take(block_hash):
            self.active[block_hash] = 1
        else:
            self.active[block_hash] = 1
            if self._meta is not None:
                self._meta[block_hash] = pack_block_meta(parent, tokens_hash)
            self._stored(parent, (block_hash,), (tokens_hash,))

    def deref(self, keys: Sequence[int]) -> None:
        """Deref: drop one reference on each block of a sequence.

        A full block left unreferenced becomes inactive (still cached, no event); a partial one is
        freed. Released tail-first (as vLLM does), so a sequence's last block is evicted before its
        prefix, which keeps every cached block's parent cached as long as the block itself.
        """
        active, inactive = self.active, self.inactive
        if keys and max(map(active.__getitem__, keys)) == 1:
            # The usual release: nobody else holds any of them; the same moves at C speed (partial last).
            full = keys if keys[-1] >= 0 else keys[:-1]
            deque(map(active.__delitem__, keys), 0)
            deque(map(inactive.__setitem__, reversed(full), repeat(None)), 0)
            return
        for key in self._drop_refs(keys):
            inactive[key] = None  # push as most recent (an active block is never in inactive)

    def destroy(self, keys: Sequence[int]) -> None:
        """Destroy: drop one reference; an unreferenced block leaves the cache (BlocksRemoved), not to inactive.

        Blocks other sequences still reference stay active: destroying is never done behind a holder's back.
        """
        removed = self._drop_refs(keys)
        meta = self._meta
        if meta is not None:
            for key in removed:
                del meta[key]
        if removed:
            self._removed(removed)

    def _drop_refs(self, keys: Sequence[int]) -> list[int]:
        """Drop one reference on each of ``keys``, tail-first; the full blocks left unreferenced, in that order.

        A partial block (negative key) left unreferenced is simply gone: it was never cached.
        """
        active = self.active
        unreferenced: list[int] = []
        for key in reversed(keys):
            rc = active[key] - 1
            if rc:
                active[key] = rc
            else:
                del active[key]
                if key >= 0:
                    unreferenced.append(key)
        return unreferenced

    def clear(self) -> None:
        """Drop every inactive block; active ones are in use and stay.

        Emits AllCleared (the subscriber drops this engine's whole index) followed by the Stored
        events of the surviving active blocks, so an index that applies the stream stays exact.
        """
        meta = self._require_meta("clear")
        for h in self.inactive:
            del meta[h]
        self.inactive.clear()
        self._cleared()
        for event in self.dump():
            self._stored(event.parent_hash, [b.block_hash for b in event.blocks], [b.tokens_hash for b in event.blocks])

    def dump(self) -> list[BlocksStored]:
        """The cached set as Stored events, parents before children (one event per unbranched chain)."""
        meta = self._require_meta("dump")
        children: dict[int, list[int]] = {}
        roots: list[int] = []
        for h, packed in meta.items():
            parent = parent_of(packed)
            if parent is not None and parent in meta:
                children.setdefault(parent, []).append(h)
            else:
                roots.append(h)  # a sequence start (or, never in practice, a block whose parent left)
        out: list[BlocksStored] = []
        stack = [(parent_of(meta[h]), h) for h in reversed(roots)]
        while stack:
            parent, h = stack.pop()
            chain = [h]
            while len(kids := children.get(h, _NO_CHILDREN)) == 1:
                h = kids[0]
                chain.append(h)
            out.append(BlocksStored(parent, tuple(StoredBlock(b, tokens_hash_of(meta[b])) for b in chain)))
            stack.extend((h, kid) for kid in reversed(children.get(h, _NO_CHILDREN)))
        return out

    # ----------------------------------------------------------------------------------------- helpers

    def _require_meta(self, what: str) -> dict[int, int]:
        if self._meta is None:
            raise RuntimeError(f"{what} needs block metadata, which a block manager with a KvSink does not keep")
        return self._meta

    def _take_slot(self, evicted: list[int]) -> None:
        """Make room for one more active block, evicting the LRU inactive block if the cache is full."""
        if len(self.active) + len(self.inactive) < self.num_blocks:
            return
        if not self.inactive:
            raise NoFreeBlocks(f"all {self.num_blocks} blocks are active")
        h = self.inactive.evict()
        if self._meta is not None:
            del self._meta[h]
        evicted.append(h)
