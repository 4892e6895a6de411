"""LRU order over inactive (cached, unreferenced) blocks.

An OrderedDict gives O(1) insert-as-newest, O(1) removal of an arbitrary block (when a cache hit
reactivates it) and O(1) pop-oldest, which is all vLLM's free-block queue and Dynamo's
``LRUEvictor`` need. Being an OrderedDict keeps the block manager's hot loops at C speed: there,
``h in lru``, ``del lru[h]`` (take) and ``lru[h] = None`` (push of a block not in it) are used directly.
"""

from __future__ import annotations

from collections import OrderedDict


class LRUEvictor(OrderedDict[int, None]):
    """Block hashes from least to most recently released."""

    def take(self, block_hash: int) -> bool:
        """Remove ``block_hash`` (it is being reused); False if it was not here."""
        return self.pop(block_hash, False) is None

    def evict(self) -> int:
        """Remove and return the least recently released block (KeyError if empty)."""
        return self.popitem(last=False)[0]
