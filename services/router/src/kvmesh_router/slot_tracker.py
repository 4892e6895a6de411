"""Active load per engine, predicted from the request lifecycle (Dynamo's ``ActiveSequences``).

The router does not wait for engines to report load: it knows when it booked a request, when the first
token came back (prefill done) and when the request ended. Per engine it keeps

- **active blocks**: the prompt blocks of its running requests, refcounted by sequence hash, so a prefix
  shared by several running requests counts once (the decode-cost proxy: memory held);
- **active prefill tokens**: ``isl - overlap_blocks * block_size`` of every request not yet past its first
  token (the prefill-cost proxy: compute queued).

Lifecycle: :meth:`SlotTracker.add_request` -> :meth:`~SlotTracker.mark_prefill_completed` (first token) ->
:meth:`~SlotTracker.free` (end, error, cancel). Duplicate adds and marks/frees of unknown ids are no-ops
that return False (replica-sync tolerance). Bookings older than ``expiry_s`` (default 300 s) are freed
lazily, at most every ``expiry_check_interval_s`` (default 30 s), from calls that pass ``now``: a
backstop for lost frees. Time is always injected; there is no clock, thread or I/O here.

Projection for a candidate request (:meth:`~SlotTracker.potential_loads`):
``decode_blocks = active_blocks + blocks of the request not already active there`` and
``prefill_tokens = active_prefill_tokens + isl - overlap * block_size``. Because sequence hashes are
chained and every booking holds its whole prompt chain, each engine's active set is *prefix-closed*, so
"blocks already active" is the length of the request's leading run active on that engine. A
``hash -> engine bitmask`` map answers it for every engine in one walk (O(depth + engines)), the same walk
as the indexer's ``find_matches``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import NamedTuple

from kvmesh_router.indexer import EngineSlots, match_prefix

__all__ = [
    "DEFAULT_EXPIRY_CHECK_INTERVAL_S",
    "DEFAULT_EXPIRY_S",
    "Booking",
    "EngineLoad",
    "PotentialLoad",
    "SlotTracker",
]

DEFAULT_EXPIRY_S = 300.0
DEFAULT_EXPIRY_CHECK_INTERVAL_S = 30.0


class PotentialLoad(NamedTuple):
    """An engine's load if the request were booked there."""

    decode_blocks: int
    prefill_tokens: int


class EngineLoad(NamedTuple):
    """An engine's current (booked) load."""

    active_blocks: int
    active_prefill_tokens: int
    active_requests: int


@dataclass(slots=True)
class Booking:
    """One booked request."""

    request_id: str
    engine_id: int
    seq_hashes: tuple[int, ...]
    isl_tokens: int
    overlap_blocks: int
    prefill_tokens: int  # outstanding; 0 once prefill completed
    started_at: float
    expected_output_tokens: int | None = None


class _Engine:
    __slots__ = ("block_size", "blocks", "bookings", "prefill_tokens", "slot")

    def __init__(self, slot: int, block_size: int) -> None:
        self.slot = slot
        self.block_size = block_size
        self.blocks: dict[int, int] = {}  # seq hash -> refcount
        self.prefill_tokens = 0
        self.bookings: set[str] = set()


class SlotTracker:
    """Per-engine active blocks and outstanding prefill tokens. See the module docstring."""

    def __init__(
        self,
        block_size: int,
        *,
        expiry_s: float = DEFAULT_EXPIRY_S,
        expiry_check_interval_s: float = DEFAULT_EXPIRY_CHECK_INTERVAL_S,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.expiry_s = expiry_s
        self.expiry_check_interval_s = expiry_check_interval_s
        self._next_check = float("-inf")
        self.on_expired: Callable[[list[str]], None] | None = None
        """Told the ids each :meth:`expire` freed (replication tells peers, and forgets theirs)."""
        self._slots = EngineSlots()
        self._engines: dict[int, _Engine] = {}
        self._active: dict[int, int] = {}  # seq hash -> mask of engines where it is active
        self._bookings: dict[str, Booking] = {}

    # ------------------------------------------------------------------ engines

    def add_engine(self, engine_id: int, block_size: int | None = None) -> None:
        """Register an engine (idempotent; updates its block size). Bookings also register engines."""
        eng = self._engines.get(engine_id)
        if eng is None:
            self._engines[engine_id] = _Engine(self._slots.acquire(engine_id), block_size or self.block_size)
        elif block_size:
            eng.block_size = block_size

    def remove_engine(self, engine_id: int) -> list[str]:
        """Forget an engine and drop its bookings; returns the dropped request ids."""
        eng = self._engines.get(engine_id)
        if eng is None:
            return []
        dropped = sorted(eng.bookings)
        for request_id in dropped:
            self.free(request_id)
        del self._engines[engine_id]
        self._slots.release(engine_id)
        return dropped

    def engines(self) -> list[int]:
        return sorted(self._engines)

    # ------------------------------------------------------------------ lifecycle

    def add_request(
        self,
        request_id: str,
        engine_id: int,
        seq_hashes: Sequence[int],
        isl_tokens: int,
        overlap_blocks: int,
        expected_output_tokens: int | None = None,
        *,
        now: float,
    ) -> bool:
        """Book a request on an engine; False (no-op) if the id is already booked."""
        self.expire(now)
        if request_id in self._bookings:
            return False
        eng = self._engines.get(engine_id)
        if eng is None:
            self.add_engine(engine_id)
            eng = self._engines[engine_id]
        prefill = max(0, isl_tokens - overlap_blocks * eng.block_size)
        hashes = tuple(seq_hashes)
        self._bookings[request_id] = Booking(
            request_id, engine_id, hashes, isl_tokens, overlap_blocks, prefill, now, expected_output_tokens
        )
        eng.bookings.add(request_id)
        eng.prefill_tokens += prefill
        blocks = eng.blocks
        active = self._active
        bit = 1 << eng.slot
        for h in hashes:
            rc = blocks.get(h)
            if rc is None:
                blocks[h] = 1
                active[h] = active.get(h, 0) | bit
            else:
                blocks[h] = rc + 1
        return True

    def mark_prefill_completed(self, request_id: str) -> bool:
        """The request's first token arrived: its prefill tokens stop counting. False if unknown."""
        booking = self._bookings.get(request_id)
        if booking is None:
            return False
        if booking.prefill_tokens:
            self._engines[booking.engine_id].prefill_tokens -= booking.prefill_tokens
            booking.prefill_tokens = 0
        return True

    def free(self, request_id: str, engine_id: int | None = None) -> bool:
        """The request ended: release its blocks (and prefill). False if unknown, or booked on another engine
        than ``engine_id`` when given (Dynamo's ``free_if_worker``)."""
        booking = self._bookings.get(request_id)
        if booking is None or (engine_id is not None and booking.engine_id != engine_id):
            return False
        del self._bookings[request_id]
        eng = self._engines[booking.engine_id]
        eng.prefill_tokens -= booking.prefill_tokens
        eng.bookings.discard(request_id)
        blocks = eng.blocks
        active = self._active
        keep = ~(1 << eng.slot)
        for h in booking.seq_hashes:
            rc = blocks[h] - 1
            if rc:
                blocks[h] = rc
            else:
                del blocks[h]
                mask = active[h] & keep
                if mask:
                    active[h] = mask
                else:
                    del active[h]
        return True

    def expire(self, now: float, force: bool = False) -> list[str]:
        """Free bookings started ``expiry_s`` or more before ``now``; runs at most every check interval
        unless ``force``. Returns the expired request ids."""
        if not force and now < self._next_check:
            return []
        self._next_check = now + self.expiry_check_interval_s
        deadline = now - self.expiry_s
        stale = [rid for rid, b in self._bookings.items() if b.started_at <= deadline]
        for rid in stale:
            self.free(rid)
        if stale and self.on_expired is not None:
            self.on_expired(stale)
        return stale

    # ------------------------------------------------------------------ queries

    def booked_engines(self) -> set[int]:
        """Engines holding at least one booking (a new set; O(bookings), not O(engines))."""
        return {b.engine_id for b in self._bookings.values()}

    def has_request(self, request_id: str) -> bool:
        return request_id in self._bookings

    def booking(self, request_id: str) -> Booking | None:
        return self._bookings.get(request_id)

    def __len__(self) -> int:
        """Active bookings."""
        return len(self._bookings)

    def load(self, engine_id: int) -> EngineLoad:
        eng = self._engines.get(engine_id)
        if eng is None:
            return EngineLoad(0, 0, 0)
        return EngineLoad(len(eng.blocks), eng.prefill_tokens, len(eng.bookings))

    def active_blocks(self, engine_id: int) -> int:
        eng = self._engines.get(engine_id)
        return 0 if eng is None else len(eng.blocks)

    def active_prefill_tokens(self, engine_id: int) -> int:
        eng = self._engines.get(engine_id)
        return 0 if eng is None else eng.prefill_tokens

    def active_requests(self, engine_id: int) -> int:
        eng = self._engines.get(engine_id)
        return 0 if eng is None else len(eng.bookings)

    def potential_load(
        self, engine_id: int, seq_hashes: Sequence[int], isl_tokens: int, overlap_blocks: int
    ) -> PotentialLoad:
        """Load of one engine if this request were booked there (exact set difference for new blocks)."""
        eng = self._engines.get(engine_id)
        if eng is None:
            return PotentialLoad(len(seq_hashes), max(0, isl_tokens - overlap_blocks * self.block_size))
        blocks = eng.blocks
        new = sum(1 for h in seq_hashes if h not in blocks)
        return PotentialLoad(
            len(blocks) + new, eng.prefill_tokens + max(0, isl_tokens - overlap_blocks * eng.block_size)
        )

    def active_prefix(self, seq_hashes: Sequence[int]) -> dict[int, int]:
        """``{engine: leading blocks of seq_hashes already active there}`` (engines with at least one)."""
        return match_prefix(self._active.get, self._slots, seq_hashes)[0]

    def candidate_columns(
        self, seq_hashes: Sequence[int], engines: Sequence[int]
    ) -> tuple[list[int], list[int], list[int], list[int]]:
        """Per engine of ``engines`` (in order): active blocks, active prefill tokens, active requests, and
        leading blocks of ``seq_hashes`` already active there. Column-wise, for scoring many candidates."""
        already = self.active_prefix(seq_hashes)
        engs = list(map(self._engines.get, engines))
        return (
            [0 if x is None else len(x.blocks) for x in engs],
            [0 if x is None else x.prefill_tokens for x in engs],
            [0 if x is None else len(x.bookings) for x in engs],
            list(map(already.get, engines, repeat(0))) if already else [0] * len(engines),
        )

    def potential_loads(
        self,
        seq_hashes: Sequence[int],
        isl_tokens: int,
        overlaps: Mapping[int, int],
        engines: Iterable[int] | None = None,
    ) -> dict[int, PotentialLoad]:
        """:meth:`potential_load` for every engine in ``engines`` (default: all registered), in one walk.

        ``overlaps`` gives cached prefix blocks per engine (missing = 0).
        """
        already = self.active_prefix(seq_hashes)
        n = len(seq_hashes)
        out: dict[int, PotentialLoad] = {}
        get_eng = self._engines.get
        for e in self._engines if engines is None else engines:
            eng = get_eng(e)
            overlap = overlaps.get(e, 0)
            if eng is None:
                out[e] = PotentialLoad(n, max(0, isl_tokens - overlap * self.block_size))
            else:
                prefill = isl_tokens - overlap * eng.block_size
                out[e] = PotentialLoad(
                    len(eng.blocks) + n - already.get(e, 0), eng.prefill_tokens + (prefill if prefill > 0 else 0)
                )
        return out
