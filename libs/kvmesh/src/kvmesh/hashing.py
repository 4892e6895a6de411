"""Block hashing shared by engines (who publish hashes) and routers (who match them).

Dynamo-compatible so that a kvmesh router can index any engine that hashes the same way:
XXH3-64 with seed 1337 over each *full* block's tokens as u32 little-endian (the "local" or
tokens hash); the sequence hash of block i chains the previous sequence hash with the local hash:
``seq[0] = local[0]``, ``seq[i] = XXH3(le64(seq[i-1]) ++ le64(local[i]), 1337)``. A partial tail
block is never hashed: it cannot be shared until it fills.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import numpy as np
import xxhash

XXH3_SEED = 1337

_xxh3 = xxhash.xxh3_64_intdigest
_pack_pair = struct.Struct("<QQ").pack
# A list of ints becomes u32 LE bytes 3-4x faster through array('I') than through numpy (no dtype
# discovery pass): ~0.1 ms per 8k-token prompt, paid by the frontend and the engine on every request.
_ARRAY_U32 = "I" if sys.byteorder == "little" and array("I").itemsize == 4 else None


def _u32_le_bytes(tokens: Sequence[int] | np.ndarray, count: int) -> bytes:
    if _ARRAY_U32 is not None and isinstance(tokens, list):
        try:
            return array(_ARRAY_U32, tokens[:count] if count < len(tokens) else tokens).tobytes()
        except (OverflowError, TypeError):
            pass  # out of u32 range or not ints: numpy raises its own, as before
    return np.asarray(tokens[:count], dtype="<u4").tobytes()


def u32_le_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as u32 little-endian bytes (the hashed form, and GenerateRequest.token_ids_u32le)."""
    return _u32_le_bytes(tokens, len(tokens))


def salted_seed(salt: str | None = None) -> int:
    """Seed for a cache namespace (e.g. a LoRA name): requests with different salts never share blocks."""
    if not salt:
        return XXH3_SEED
    return (XXH3_SEED + _xxh3(salt.encode())) & 0xFFFF_FFFF_FFFF_FFFF


def local_block_hashes(tokens: Sequence[int] | np.ndarray, block_size: int, seed: int = XXH3_SEED) -> list[int]:
    """Tokens hash of every full block of ``tokens`` (the partial tail is ignored)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_full = len(tokens) // block_size
    if n_full == 0:
        return []
    return u32_block_hashes(_u32_le_bytes(tokens, n_full * block_size), block_size, seed)


def u32_block_hashes(raw: bytes | memoryview, block_size: int, seed: int = XXH3_SEED) -> list[int]:
    """Tokens hash of every full block of ``raw``: token ids already as u32 little-endian bytes.

    For a caller that converts a whole prompt once and hashes parts of it. Plain ``bytes`` hash faster
    than a memoryview of them: copying a 64-256-byte block costs less than making a memoryview slice
    (14k tokens: 90 against 105 µs at 16-token blocks, 29 against 32 µs at 64).
    """
    step = block_size * 4
    return [_xxh3(raw[i : i + step], seed) for i in range(0, len(raw) - step + 1, step)]


def chain_hash(parent: int, local: int, seed: int = XXH3_SEED) -> int:
    """Sequence hash of a block whose predecessor has sequence hash ``parent``."""
    return _xxh3(_pack_pair(parent, local), seed)


def sequence_hashes(local_hashes: Sequence[int], seed: int = XXH3_SEED, parent: int | None = None) -> list[int]:
    """Chained sequence hashes; ``parent`` continues a chain whose last sequence hash is known."""
    out: list[int] = []
    prev = parent
    for local in local_hashes:
        prev = local if prev is None else _xxh3(_pack_pair(prev, local), seed)
        out.append(prev)
    return out


def block_hashes(
    tokens: Sequence[int] | np.ndarray, block_size: int, seed: int = XXH3_SEED
) -> tuple[list[int], list[int]]:
    """(local hashes, sequence hashes) of the full blocks of ``tokens``."""
    local = local_block_hashes(tokens, block_size, seed)
    return local, sequence_hashes(local, seed)
