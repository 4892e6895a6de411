"""Approximate mode: a prefix index predicted from the router's own decisions (engines without KV events).

Dynamo ``--no-router-kv-events``: when the router sends a request to an engine it assumes that engine
will cache the request's prompt blocks, so it records the request's sequence hashes as *predicted*
blocks of that engine. A prediction lives ``ttl_s`` (default 120 s) after the decision that last
recorded it (routing the same prefix to the same engine again refreshes it). When the predicted index
exceeds ``max_entries`` (engine, block) entries (default 2**20), the oldest predictions are pruned down to
``prune_target_ratio`` (0.8) of the cap.

:class:`ApproxIndexer` answers :meth:`~ApproxIndexer.find_matches` with the same contract as
:class:`kvmesh_router.indexer.KvIndexer` (``{engine: leading blocks}``), so selection does not care which
one it reads. It can also run beside a real indexer as a side predictor (Dynamo
``router_predicted_ttl_secs``); the admission then takes each engine's larger overlap.

Time is injected: :meth:`~ApproxIndexer.record` and :meth:`~ApproxIndexer.expire` take ``now`` (any
monotonic clock, real or virtual); expiry is lazy (nothing runs between calls).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

from kvmesh_router.indexer import EngineSlots, match_prefix

__all__ = ["DEFAULT_MAX_ENTRIES", "DEFAULT_PRUNE_TARGET_RATIO", "DEFAULT_TTL_S", "ApproxIndexer", "DecisionPredictor"]

DEFAULT_TTL_S = 120.0
DEFAULT_MAX_ENTRIES = 1 << 20
DEFAULT_PRUNE_TARGET_RATIO = 0.8


class DecisionPredictor(Protocol):
    """What admission needs from a predictor (:class:`ApproxIndexer`, or a wrapper around one)."""

    def find_matches(self, seq_hashes: Sequence[int]) -> dict[int, int]: ...

    def record(self, engine_id: int, seq_hashes: Sequence[int], now: float) -> None: ...

    def expire(self, now: float) -> int: ...

    def remove_engine(self, engine_id: int) -> bool: ...


class ApproxIndexer:
    """Predicted ``{engine: blocks}`` from routing decisions, with a TTL and a size cap.

    Tables: ``hash -> engine mask`` (the same walk as the indexer) and ``(hash, slot) -> deadline`` (the key
    packed into one int), plus a queue of ``(key, deadline)`` in record order, which is deadline order
    because the TTL is constant. A refresh appends a new queue entry; the old one is skipped when it
    reaches the front. Only ints and floats: the GC never traverses the tables.
    """

    def __init__(
        self,
        ttl_s: float = DEFAULT_TTL_S,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        prune_target_ratio: float = DEFAULT_PRUNE_TARGET_RATIO,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        if not 0.0 <= prune_target_ratio < 1.0:
            raise ValueError(f"prune_target_ratio must be in [0, 1), got {prune_target_ratio}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._prune_target = int(max_entries * prune_target_ratio)
        self._slots = EngineSlots()
        self._holders: dict[int, int] = {}  # seq hash -> engine bitmask
        self._deadline: dict[int, float] = {}  # hash << 32 | slot -> when the prediction expires
        self._queue_keys: deque[int] = deque()  # record order (= deadline order), may hold stale refreshes
        self._queue_deadlines: deque[float] = deque()
        self.expired_entries = 0
        self.pruned_entries = 0

    # ------------------------------------------------------------------ updates

    def record(self, engine_id: int, seq_hashes: Sequence[int], now: float) -> None:
        """The router sent a request with these sequence hashes to ``engine_id`` at ``now``."""
        self.expire(now)
        slot = self._slots.acquire(engine_id)
        bit = 1 << slot
        holders = self._holders
        deadlines = self._deadline
        push_key = self._queue_keys.append
        push_deadline = self._queue_deadlines.append
        deadline = now + self.ttl_s
        # Deepest first, so a prefix's ancestors expire (and are pruned) after its descendants.
        for i in range(len(seq_hashes) - 1, -1, -1):
            h = seq_hashes[i]
            key = h << 32 | slot
            if key not in deadlines:
                holders[h] = holders.get(h, 0) | bit
            deadlines[key] = deadline
            push_key(key)
            push_deadline(deadline)
        if len(deadlines) > self.max_entries:
            self.pruned_entries += self._pop_front(None, len(deadlines) - self._prune_target)
        elif len(self._queue_keys) > 2 * len(deadlines) + 1024:
            self._compact()

    def expire(self, now: float) -> int:
        """Drop predictions whose TTL ran out at or before ``now``; returns how many."""
        n = self._pop_front(now, None)
        self.expired_entries += n
        return n

    def _pop_front(self, now: float | None, count: int | None) -> int:
        """Pop queue entries while they are due (``now``) or until ``count`` live ones were dropped."""
        keys = self._queue_keys
        stamps = self._queue_deadlines
        deadlines = self._deadline
        n = 0
        while keys and (now is None or stamps[0] <= now) and (count is None or n < count):
            key = keys.popleft()
            stamp = stamps.popleft()
            if deadlines.get(key) == stamp:  # else a stale entry of a refreshed (or dropped) prediction
                self._drop(key)
                n += 1
        return n

    def _compact(self) -> None:
        """Rebuild the queue without stale entries (many refreshes of the same predictions)."""
        live = sorted(self._deadline.items(), key=lambda kv: kv[1])
        self._queue_keys = deque(k for k, _ in live)
        self._queue_deadlines = deque(d for _, d in live)

    def _drop(self, key: int) -> None:
        del self._deadline[key]
        slot = key & _SLOT_MASK
        h = key >> 32
        mask = self._holders[h] & ~(1 << slot)
        if mask:
            self._holders[h] = mask
        else:
            del self._holders[h]

    def clear(self, engine_id: int) -> None:
        """Forget every prediction for ``engine_id`` (e.g. it restarted); it stays known. O(predictions)."""
        slot = self._slots.get(engine_id)
        if slot is None:
            return
        for key in [k for k in self._deadline if k & _SLOT_MASK == slot]:
            self._drop(key)

    def remove_engine(self, engine_id: int) -> bool:
        """Forget an engine entirely; False if unknown."""
        if engine_id not in self._slots:
            return False
        self.clear(engine_id)
        self._slots.release(engine_id)
        return True

    # ------------------------------------------------------------------ queries

    def find_matches(self, seq_hashes: Sequence[int]) -> dict[int, int]:
        """``{engine: leading blocks predicted there}`` (call :meth:`expire` first to honour the TTL)."""
        return match_prefix(self._holders.get, self._slots, seq_hashes)[0]

    def __len__(self) -> int:
        """Predicted (engine, block) entries (the quantity ``max_entries`` bounds)."""
        return len(self._deadline)

    def engines(self) -> list[int]:
        return self._slots.engines()

    def canonical(self) -> dict[int, frozenset[int]]:
        """``{engine: frozenset(predicted hashes)}``, engines without predictions omitted."""
        held: dict[int, set[int]] = {}
        for key in self._deadline:
            held.setdefault(key & _SLOT_MASK, set()).add(key >> 32)
        names = self._slots.names
        # a slot holding predictions is always occupied: the None filter only narrows the type
        by_engine = {e: frozenset(hs) for slot, hs in held.items() if (e := names[slot]) is not None}
        return {e: by_engine[e] for e in sorted(by_engine)}


_SLOT_MASK = (1 << 32) - 1
