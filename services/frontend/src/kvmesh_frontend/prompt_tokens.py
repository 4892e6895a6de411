"""A prompt's token ids in the form the mesh moves them: u32 little-endian bytes.

The frontend hashes a prompt into the router's block hashes and sends it to the worker
(``GenerateRequest.token_ids_u32le``), both from these bytes. A pre-tokenized KServe prompt
(``input_ids``, raw INT32) arrives as almost exactly them, so it crosses the frontend without
becoming one Python int per token: for a 14k-token prompt that was ~1 ms of the event loop (the
list, a min and a max over it, and two conversions back to bytes), paid before the route and
so by every request queued behind it. Python ints are made only where tokens are read one by one:
the detokenizer's few tokens of context and an echoed prompt's text.

Invariant: ``u32le`` holds whole u32 ids (its length is a multiple of 4).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
from kvmesh.hashing import XXH3_SEED, sequence_hashes, u32_block_hashes, u32_le_bytes


@dataclass(frozen=True, slots=True)
class PromptTokens(Sequence[int]):
    """Token ids as u32 LE bytes; a read-only sequence of ints for the few readers that want them so."""

    u32le: bytes

    def __post_init__(self) -> None:
        if len(self.u32le) % 4:
            raise ValueError(f"{len(self.u32le)} bytes are not whole u32 token ids")

    @classmethod
    def of(cls, ids: Sequence[int] | np.ndarray) -> PromptTokens:
        """From token ids that fit in u32 (a tokenizer's list, or a checked array)."""
        return cls(u32_le_bytes(ids))

    def _array(self) -> np.ndarray:
        return np.frombuffer(self.u32le, dtype="<u4")

    def __len__(self) -> int:
        return len(self.u32le) >> 2

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            ids: list[int] = self._array()[index].tolist()
            return ids
        return int(self._array()[index])

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def max_id(self) -> int:
        """The largest token id (0 for an empty prompt)."""
        return int(self._array().max()) if self.u32le else 0

    def tolist(self) -> list[int]:
        ids: list[int] = self._array().tolist()
        return ids

    def extended(self, more: Sequence[int]) -> PromptTokens:
        """These tokens followed by ``more`` (a migrated request's prompt: the original plus what was generated)."""
        return PromptTokens(self.u32le + u32_le_bytes(more)) if more else self

    def block_hashes(self, block_size: int, seed: int = XXH3_SEED) -> list[int]:
        """The sequence hashes of the full blocks (``kvmesh.hashing.block_hashes(ids, block_size)[1]``)."""
        return sequence_hashes(u32_block_hashes(self.u32le, block_size, seed), seed)
