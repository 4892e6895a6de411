"""vLLM's KV events (its ZMQ publisher) turned into kvmesh's KV journal.

Three parts, each usable alone:

- :func:`decode_batch` reads one msgpack payload in either wire form vLLM has used: events as tagged
  arrays (before v0.26) or tagged maps (after), the batch itself as an array or a map. Unknown map
  keys and trailing array fields are ignored. Events that are not the main attention cache are
  skipped: ``group_idx`` other than 0, a ``kv_cache_spec_kind`` other than ``full_attention``, or a
  ``medium`` other than ``GPU`` (vLLM says ``GPU`` for the primary tier even on CPU; other media are
  offload tiers the router does not index).
- :class:`ReHasher` keeps the engine's cached set keyed by vLLM's block hash and gives each block
  kvmesh's chained XXH3 hash, recomputed from the event's ``token_ids`` (``kvmesh.hashing``), so the
  router and the frontend need no vLLM-specific hashing. vLLM's hash is only an opaque id here.
- :class:`ZmqKvSubscriber` is a thread that reads the publisher's 3-frame messages (topic, 8-byte
  big-endian sequence number, payload), detects sequence gaps and fills them from vLLM's replay
  endpoint, and hands decoded batches, in sequence order and each exactly once, to a callback.

Invariants:

- every batch vLLM published is applied once and in order; a gap the replay buffer no longer covers
  is reported as ``lost`` and the cache is cleared (an ``AllCleared``): the index then under-states
  the cache (fewer hits) but never claims a block the engine does not hold;
- a stored block whose parent is unknown (an event was lost before the subscriber existed) is
  dropped with its run, as the router would drop it;
- the rehasher is touched only by the thread that calls it (the worker's event loop).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmesh.hashing import XXH3_SEED, local_block_hashes, sequence_hashes
from kvmesh.kv_events import AllCleared, BlocksRemoved, BlocksStored, EventData, StoredBlock

log = logging.getLogger(__name__)

# Array-form field order (msgspec ``array_like`` structs, tag first), as vllm/distributed/kv_events.py declares them.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_BATCH_FIELDS = ("ts", "events", "data_parallel_rank")
MAIN_KIND = "full_attention"
MAIN_MEDIUM = "GPU"
# Test tooling: sequence numbers the subscriber pretends it never received (to exercise replay).
DROP_SEQS_ENV = "KVMESH_TEST_VLLM_DROP_SEQS"


class WireError(ValueError):
    """A payload that is neither of vLLM's wire forms."""


@dataclass(frozen=True, slots=True)
class VllmStored:
    block_hashes: tuple[Hashable, ...]
    parent_block_hash: Hashable | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class VllmRemoved:
    block_hashes: tuple[Hashable, ...]


@dataclass(frozen=True, slots=True)
class VllmCleared:
    pass


VllmEvent = VllmStored | VllmRemoved | VllmCleared


def _hashable(value: Any) -> Hashable:
    """Block hashes are ints (the default) or 32-byte digests; lists would not be dict keys."""
    return bytes(value) if isinstance(value, (bytearray, memoryview, list)) else value


def _fields(raw: Any, names: Sequence[str]) -> tuple[str | None, dict[str, Any]]:
    """(tag, fields) of a tagged map ``{"type": T, ...}`` or a tagged array ``[T, f1, f2, ...]``."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        return (tag if isinstance(tag, str) else None), raw
    if isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        return raw[0], dict(zip(names, raw[1:], strict=False))
    raise WireError(f"an event is neither a tagged map nor a tagged array: {raw!r:.80}")


def _is_main(fields: dict[str, Any]) -> bool:
    group = fields.get("group_idx")
    kind = fields.get("kv_cache_spec_kind")
    medium = fields.get("medium")
    return group in (None, 0) and kind in (None, MAIN_KIND) and medium in (None, MAIN_MEDIUM)


def decode_event(raw: Any) -> VllmEvent | None:
    """One event of either wire form; None for events kvmesh does not index (or does not know)."""
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        tag = raw[0]
    else:
        raise WireError(f"an event is neither a tagged map nor a tagged array: {raw!r:.80}")
    if tag == "BlockStored":
        _, f = _fields(raw, _STORED_FIELDS)
        if not _is_main(f):
            return None
        return VllmStored(
            tuple(_hashable(h) for h in f.get("block_hashes") or ()),
            None if f.get("parent_block_hash") is None else _hashable(f["parent_block_hash"]),
            tuple(int(t) for t in f.get("token_ids") or ()),
            int(f.get("block_size") or 0),
        )
    if tag == "BlockRemoved":
        _, f = _fields(raw, _REMOVED_FIELDS)
        if not _is_main(f):
            return None
        return VllmRemoved(tuple(_hashable(h) for h in f.get("block_hashes") or ()))
    if tag == "AllBlocksCleared":
        return VllmCleared()
    return None  # an event kind this version does not know: not a cache change kvmesh can index


def decode_batch_object(obj: Any) -> list[VllmEvent]:
    """A decoded ``KVEventBatch`` (array ``[ts, events, dp_rank]`` or map) → the events kvmesh indexes."""
    if isinstance(obj, dict):
        events = obj.get("events")
    elif isinstance(obj, (list, tuple)) and len(obj) >= 2:
        events = obj[1]
    else:
        raise WireError(f"a batch is neither [ts, events, dp_rank] nor a map: {obj!r:.80}")
    if not isinstance(events, (list, tuple)):
        raise WireError(f"a batch's events are not a list: {events!r:.80}")
    return [event for raw in events if (event := decode_event(raw)) is not None]


def decode_batch(payload: bytes) -> list[VllmEvent]:
    """One msgpack payload of vLLM's ZMQ publisher → the events kvmesh indexes, in order."""
    import msgspec

    try:
        obj = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"not msgpack: {exc}") from exc
    return decode_batch_object(obj)


@dataclass(slots=True)
class _Block:
    block_hash: int  # kvmesh sequence hash
    parent_hash: int | None
    tokens_hash: int


@dataclass
class ReHasher:
    """The engine's cached set, keyed by vLLM's block hash, with kvmesh's hashes for each block."""

    block_size: int
    seed: int = XXH3_SEED
    blocks: dict[Hashable, _Block] = field(default_factory=dict)  # insertion order: parents first
    dropped_stores: int = 0

    def apply(self, events: Iterable[VllmEvent]) -> list[EventData]:
        """kvmesh events for vLLM's events (possibly fewer: duplicates and orphans produce none)."""
        out: list[EventData] = []
        for event in events:
            if isinstance(event, VllmStored):
                out.extend(self._store(event))
            elif isinstance(event, VllmRemoved):
                removed = tuple(b.block_hash for h in event.block_hashes if (b := self.blocks.pop(h, None)) is not None)
                if removed:
                    out.append(BlocksRemoved(removed))
            else:
                self.blocks.clear()
                out.append(AllCleared())
        return out

    def _store(self, event: VllmStored) -> list[BlocksStored]:
        size = event.block_size or self.block_size
        if size != self.block_size or len(event.token_ids) != size * len(event.block_hashes):
            log.warning(
                "vLLM stored %d blocks with %d tokens at block size %d (expected %d): ignored",
                len(event.block_hashes),
                len(event.token_ids),
                size,
                self.block_size,
            )
            self.dropped_stores += 1
            return []
        parent: int | None = None
        if event.parent_block_hash is not None:
            known = self.blocks.get(event.parent_block_hash)
            if known is None:
                self.dropped_stores += 1
                return []
            parent = known.block_hash
        locals_ = local_block_hashes(event.token_ids, size, self.seed)
        seqs = sequence_hashes(locals_, self.seed, parent)
        runs: list[BlocksStored] = []
        run_parent, run = parent, list[StoredBlock]()
        for vllm_hash, local, seq in zip(event.block_hashes, locals_, seqs, strict=True):
            if vllm_hash in self.blocks:  # already cached (a duplicate store): nothing to say for it
                if run:
                    runs.append(BlocksStored(run_parent, tuple(run)))
                    run = []
                run_parent = seq
            else:
                self.blocks[vllm_hash] = _Block(seq, parent, local)
                run.append(StoredBlock(seq, local))
            parent = seq
        if run:
            runs.append(BlocksStored(run_parent, tuple(run)))
        return runs

    def dump(self) -> list[BlocksStored]:
        """The cached set as single-block stores, parents before children."""
        return [BlocksStored(b.parent_hash, (StoredBlock(b.block_hash, b.tokens_hash),)) for b in self.blocks.values()]


def _drop_seqs_from_env() -> set[int]:
    text = os.environ.get(DROP_SEQS_ENV, "")
    return {int(part) for part in text.split(",") if part.strip()}


@dataclass
class SubscriberStats:
    batches: int = 0
    gaps: int = 0
    replayed: int = 0
    lost: int = 0


class ZmqKvSubscriber:
    """Reads one vLLM publisher in a thread; ``deliver(events)`` gets each batch once, in order.

    ``deliver`` is called from the subscriber thread: the caller hands it over to its own loop
    (``loop.call_soon_threadsafe``). ``on_lost(first, last)`` is called (from the thread) when a gap
    cannot be replayed; the caller then clears its cache.
    """

    POLL_MS = 100
    REPLAY_TIMEOUT_MS = 2000

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        deliver: Callable[[list[VllmEvent]], None],
        on_lost: Callable[[int, int], None],
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._deliver = deliver
        self._on_lost = on_lost
        self.next_seq = 0
        self.stats = SubscriberStats()
        self._drop = _drop_seqs_from_env()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            while not self._stop.is_set():
                if not sub.poll(self.POLL_MS):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3:
                    log.warning("vLLM KV event message with %d frames ignored", len(frames))
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq in self._drop:
                    self._drop.discard(seq)
                    continue
                if seq < self.next_seq:
                    continue  # already applied (from a replay)
                if seq > self.next_seq:
                    self._recover(ctx, seq)
                    if seq < self.next_seq:
                        continue
                self._apply(seq, frames[2])
        except Exception:
            log.exception("the vLLM KV event subscriber failed")
        finally:
            sub.close(0)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            events = decode_batch(payload)
        except WireError as exc:
            log.error("vLLM KV event batch %d unreadable (%s): skipped", seq, exc)
            events = []
        self.next_seq = seq + 1
        self.stats.batches += 1
        if events:
            self._deliver(events)

    def _recover(self, ctx: Any, seen: int) -> None:
        """Fill ``next_seq .. seen-1`` from the replay endpoint (which answers from ``next_seq`` on)."""
        import zmq

        first = self.next_seq
        self.stats.gaps += 1
        if self.replay_endpoint is not None:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.replay_endpoint)
            try:
                dealer.send_multipart([b"", first.to_bytes(8, "big")])
                while dealer.poll(self.REPLAY_TIMEOUT_MS):
                    frames = dealer.recv_multipart()
                    seq = int.from_bytes(frames[-2], "big", signed=True)
                    if seq < 0:
                        break  # end of the replay
                    if seq == self.next_seq:
                        self._apply(seq, frames[-1])
                        self.stats.replayed += 1
            finally:
                dealer.close(0)
        if self.next_seq < seen:
            log.error("vLLM KV events %d..%d are lost (not in the replay buffer): clearing the index", first, seen - 1)
            self.stats.lost += seen - self.next_seq
            self._on_lost(self.next_seq, seen - 1)
            self.next_seq = seen
        else:
            log.warning("vLLM KV events %d..%d recovered from the replay endpoint", first, seen - 1)
