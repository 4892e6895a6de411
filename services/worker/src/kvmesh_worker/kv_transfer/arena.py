"""The mocker's block arena: one host-memory buffer per engine, in fixed-size slots, registered with NIXL.

Slots are refcounted by sequence hash: a prefill engine materialises a held block's bytes in a slot
(shared by every hold of the same block) and a decode engine lands pulled blocks in fresh slots.
Invariants: a slot is written only while no reader can see it (fill before it is advertised; landing
slots are private to one pull); a slot returns to the free list only when its refcount reaches 0, so
a block advertised in KvTransferParams stays byte-stable until its hold is released or expires.
"""

from __future__ import annotations

import numpy as np

from kvmesh_worker.kv_transfer.content import fill_block


class ArenaFull(Exception):
    """No free slot: more blocks are held or landing than the arena has slots."""


class KvArena:
    def __init__(self, num_slots: int, bytes_per_block: int) -> None:
        self.num_slots = num_slots
        self.bytes_per_block = bytes_per_block
        # Pre-touched (not np.empty): a first NIXL read into untouched pages pays the page faults.
        self.buffer = np.zeros(num_slots * bytes_per_block, dtype=np.uint8)
        self.address = int(self.buffer.ctypes.data)
        self._free = list(range(num_slots - 1, -1, -1))
        self._by_hash: dict[int, tuple[int, int]] = {}  # seq hash -> (slot, refcount)

    @property
    def used(self) -> int:
        return self.num_slots - len(self._free)

    def view(self, slot: int) -> np.ndarray:
        start = slot * self.bytes_per_block
        return self.buffer[start : start + self.bytes_per_block]

    def hold(self, hashes: list[int]) -> list[int]:
        """Materialise blocks ``hashes`` (content from their hashes); returns their slots. All or nothing."""
        need = sum(1 for h in set(hashes) if h not in self._by_hash)
        if need > len(self._free):
            raise ArenaFull(f"KV arena full: {need} blocks needed, {len(self._free)} of {self.num_slots} slots free")
        slots = []
        for h in hashes:
            entry = self._by_hash.get(h)
            if entry is None:
                slot = self._free.pop()
                fill_block(self.view(slot), h)
                self._by_hash[h] = (slot, 1)
            else:
                slot = entry[0]
                self._by_hash[h] = (slot, entry[1] + 1)
            slots.append(slot)
        return slots

    def unhold(self, hashes: list[int]) -> None:
        for h in hashes:
            slot, rc = self._by_hash[h]
            if rc > 1:
                self._by_hash[h] = (slot, rc - 1)
            else:
                del self._by_hash[h]
                self._free.append(slot)

    def take(self, n: int) -> list[int]:
        """``n`` private landing slots for a pull."""
        if n > len(self._free):
            raise ArenaFull(f"KV arena full: {n} landing slots needed, {len(self._free)} of {self.num_slots} free")
        return [self._free.pop() for _ in range(n)]

    def give_back(self, slots: list[int]) -> None:
        self._free.extend(slots)

    def corrupt(self, seq_hash: int) -> bool:
        """Test hook: flip one byte of a held block (the injected-corruption check). False if not held."""
        entry = self._by_hash.get(seq_hash)
        if entry is None:
            return False
        view = self.view(entry[0])
        view[view.size // 2] ^= 0xFF
        return True
