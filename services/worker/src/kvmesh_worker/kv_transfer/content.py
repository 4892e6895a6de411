"""A block's bytes are a deterministic function of its sequence hash, so a receiver can verify every block.

The pattern is 64-bit words ``hash ^ (i * GOLDEN)`` for word index ``i``: every word of a block differs, so
a corrupted byte, a torn block (half of one block, half of another) or a block sent to the wrong place all
fail :func:`verify_block`. Cost is one vectorised pass over the block, on both sides.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_WORDS_CACHE: dict[int, np.ndarray] = {}


def _word_index(nbytes: int) -> np.ndarray:
    words = _WORDS_CACHE.get(nbytes)
    if words is None:
        n = (nbytes + 7) // 8
        words = _WORDS_CACHE[nbytes] = np.arange(n, dtype=np.uint64) * _GOLDEN
    return words


def block_content(seq_hash: int, nbytes: int) -> np.ndarray:
    """The ``nbytes`` bytes block ``seq_hash`` holds (uint8)."""
    words = _word_index(nbytes) ^ np.uint64(seq_hash & 0xFFFFFFFFFFFFFFFF)
    return words.view(np.uint8)[:nbytes]


def fill_block(view: np.ndarray, seq_hash: int) -> None:
    """Write block ``seq_hash``'s content into ``view`` (a uint8 slice of an arena)."""
    view[:] = block_content(seq_hash, view.size)


def verify_block(view: np.ndarray, seq_hash: int) -> bool:
    """Whether ``view`` holds exactly block ``seq_hash``'s content."""
    return bool(np.array_equal(view, block_content(seq_hash, view.size)))
