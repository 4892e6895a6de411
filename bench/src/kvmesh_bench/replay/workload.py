"""Trace rows -> what a replay sends: token ids, generation length and arrival time.

The Mooncake traces carry no text, only ``hash_ids``: one id per 512-token block of the prompt, equal
leading ids meaning a shared prefix. A replay needs real token ids (engines and the frontend hash
tokens, not ids), so each hash id ``h`` maps to its **own fixed block of 512 token ids** (a pure
function of ``h`` and the workload seed): equal ids give equal tokens, so prefix sharing survives, and
different ids give unrelated tokens. The prompt is the concatenation of its ids' blocks, the last one
cut so that the prompt has exactly ``input_length`` tokens. The engine then hashes that prompt in its
own block size (64 by default), so one trace block is 8 engine blocks.

(Dynamo's replay repeats the id itself 512 times; both give the same prefix structure. Random-looking
tokens also keep the 8 engine blocks of one trace block distinct, which changes nothing for caching.)

The block of ``h`` is a window of a table of random token ids (drawn once per seed): it starts at
``(h mod 1048573) * 524287 mod 1048573`` (a prime-sized table: ids below 1048573, which covers the
published traces, get distinct starts; ids equal modulo it share a block), which costs
one numpy gather per prompt (~30 us for 12k tokens). Windows of different ids may overlap at other
offsets, which shares nothing: an engine block matches only when its whole prefix matches. Another
seed draws another table: a replay with another seed shares no block with the previous one, which lets
a live comparison start each mode on a cache that holds nothing useful.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvmesh_bench.trace import DEFAULT_BLOCK_SIZE, TraceRequest

__all__ = ["DEFAULT_VOCAB_SIZE", "ReplayRequest", "TokenMapper", "arrival_times_ms", "build_requests"]

#: Vocabulary of the built-in ``kvmesh-mock`` model (the live path checks ids against the model card).
DEFAULT_VOCAB_SIZE = 2048

#: Size of the random token table the blocks are cut from (4 MiB of int32 per mapper).
_TABLE = (1 << 20) - 3
_STRIDE = (1 << 19) - 1


MAX_VOCAB_SIZE = 1 << 31  # token ids are int32


class TokenMapper:
    """Hash ids -> token ids (see the module docstring). Deterministic for a given seed and vocabulary."""

    def __init__(
        self, block_tokens: int = DEFAULT_BLOCK_SIZE, vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0
    ) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        if not 1 <= vocab_size <= MAX_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be in [1, 2**31], got {vocab_size}")
        self.block_tokens = block_tokens
        self.vocab_size = vocab_size
        self.seed = seed
        rng = np.random.default_rng([seed, vocab_size, block_tokens])
        self._table = rng.integers(0, vocab_size, _TABLE + block_tokens, dtype=np.int32)

    def block(self, hash_id: int) -> np.ndarray:
        """The full token block of one hash id (int32)."""
        return self.tokens([hash_id], self.block_tokens)

    def tokens(self, hash_ids: Sequence[int], input_length: int) -> np.ndarray:
        """The prompt of a request: its ids' blocks concatenated, cut to ``input_length`` (int32).

        ``input_length`` beyond ``len(hash_ids) * block_tokens`` is clamped to that capacity (as Dynamo's
        replay does); the published traces never need it.
        """
        bt = self.block_tokens
        n_blocks = min(len(hash_ids), -(-input_length // bt)) if input_length > 0 else 0
        if n_blocks == 0:
            return np.zeros(0, dtype=np.int32)
        # Each block is a contiguous slice of the table (it has block_tokens of slack at the end): slices
        # and one concatenate take half the time of a gather through a per-token index array.
        table = self._table
        out = np.concatenate([table[s : s + bt] for s in [h % _TABLE * _STRIDE % _TABLE for h in hash_ids[:n_blocks]]])
        return out[: min(input_length, n_blocks * bt)]


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One request as a replay sends it (token ids are built on demand: see :meth:`prompt`)."""

    index: int  # position in the trace (0-based)
    request_id: str
    arrival_ms: float  # trace timestamp / arrival speedup
    input_length: int  # prompt tokens actually sent (input_length clamped to the ids' capacity)
    max_tokens: int  # output_length (at least 1: an engine cannot generate 0 tokens)
    hash_ids: tuple[int, ...]

    def prompt(self, mapper: TokenMapper) -> np.ndarray:
        return mapper.tokens(self.hash_ids, self.input_length)


def arrival_times_ms(rows: Sequence[TraceRequest], arrival_speedup: float = 1.0) -> np.ndarray:
    """Arrival time of every row in ms: ``timestamp / arrival_speedup``, relative to the first row."""
    if not arrival_speedup > 0:
        raise ValueError(f"arrival_speedup must be > 0, got {arrival_speedup}")
    ts = np.array([r.timestamp_ms for r in rows], dtype=float)
    if ts.size:
        ts -= ts.min()
    return ts / arrival_speedup


def build_requests(
    rows: Sequence[TraceRequest],
    *,
    arrival_speedup: float = 1.0,
    block_tokens: int = DEFAULT_BLOCK_SIZE,
    id_prefix: str = "r",
) -> tuple[list[ReplayRequest], int]:
    """The replayable requests of a trace, in arrival order, and how many rows were skipped.

    A row with no prompt token (``input_length == 0`` or no ``hash_ids``) cannot be sent and is skipped.
    Rows are stable-sorted by timestamp (the traces are sorted already).
    """
    times = arrival_times_ms(rows, arrival_speedup)
    order = np.argsort(times, kind="stable")
    out: list[ReplayRequest] = []
    skipped = 0
    for i in order.tolist():
        row = rows[i]
        length = min(row.input_length, len(row.hash_ids) * block_tokens)
        if length <= 0:
            skipped += 1
            continue
        out.append(
            ReplayRequest(i, f"{id_prefix}{i}", float(times[i]), length, max(1, row.output_length), row.hash_ids)
        )
    return out, skipped
