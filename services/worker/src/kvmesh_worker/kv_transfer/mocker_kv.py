"""The mocker's half of disaggregation: holds on the prefill side, verified pulls on the decode side.

One :class:`MockerKv` per mocker engine whose role moves KV, driven by ``EngineRunner`` on the loop
thread. The core keeps the bookkeeping (pins are block references: held blocks count as load and are
never evicted); the arena keeps the bytes; the process's NIXL agent moves them.

Invariants of the transfer protocol, mocker side:

- a hold pins the prompt's cached full blocks in the core and materialises their bytes in the arena
  *before* its params leave the engine; it ends exactly once: ``release`` or the lease timer;
- a pull takes only blocks ``[have, n)`` where ``have`` is this engine's cached prefix (pinned first, so
  it cannot be evicted while the rest arrives); it lands them in private arena slots, verifies every one
  against its hash, and only then stores them in the core: bad bytes never become cache;
- decode starts no earlier than max(real transfer, modelled transfer): modelled = missing blocks x
  model-true bytes / ``--kv-transfer-gbps``, in simulated time (÷ speedup);
- every exit path of a pull (error, cancel) gives back its landing slots and its pins.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.v1.kv_transfer_pb2 import KvTransferParams, KvTransferReport

from kvmesh_worker.engine import EngineCore, EngineRequest, QueueFull
from kvmesh_worker.engines.api import KvPullFailed
from kvmesh_worker.kv_transfer.arena import ArenaFull, KvArena
from kvmesh_worker.kv_transfer.content import verify_block
from kvmesh_worker.kv_transfer.nixl_agent import NixlAgent, TransferFailed

log = logging.getLogger(__name__)

# Test hook (real processes only): a prefill worker started with this set corrupts one byte of the last
# block of every hold, so the decode side's verification must fail the request with DATA_LOSS.
CORRUPT_ENV = "KVMESH_TEST_CORRUPT_KV"
# Test hook: a decode worker started with this waits so many seconds before each NIXL read, so that a
# test can kill the prefill worker between its hold and the pull (the "mid-transfer" fault).
PULL_DELAY_ENV = "KVMESH_TEST_PULL_DELAY_S"
PULL_TIMEOUT_S = 10.0
# A pull starts only while the source's hold has at least this long to run (counted on this host's monotonic
# clock from receipt); --kv-hold-timeout is at least twice this (the worker's settings), else every hold is
# born expired.
HOLD_EXPIRY_MARGIN_S = 0.5


@dataclass(frozen=True, slots=True)
class KvConfig:
    bytes_per_block: int
    model_bytes_per_block: int
    transfer_gbps: float
    hold_timeout_s: float
    speedup_ratio: float


@dataclass(slots=True)
class _Hold:
    hashes: list[int]
    timer: asyncio.TimerHandle


class MockerKv:
    def __init__(self, engine_id: int, core: EngineCore, config: KvConfig) -> None:
        self.engine_id = engine_id
        self.core = core
        self.config = config
        self.arena = KvArena(core.config.num_gpu_blocks, config.bytes_per_block)
        self.agent = NixlAgent.process_agent()
        self.agent.register(self.arena.address, self.arena.buffer.nbytes)
        self._holds: dict[str, _Hold] = {}
        self._pins: dict[str, list[int]] = {}  # request id -> blocks pinned by its pull
        self._ids = itertools.count()
        self._corrupt = bool(os.environ.get(CORRUPT_ENV))
        self._pull_delay_s = float(os.environ.get(PULL_DELAY_ENV) or 0)
        self.reading_blocks = 0  # blocks of NIXL reads in flight now (a gauge: a stuck pull shows)
        self.on_unpinned: Callable[[], None] = lambda: None  # blocks were unpinned (the engine's runner pokes)

    @property
    def held_blocks(self) -> int:
        return sum(len(h.hashes) for h in self._holds.values())

    # -- prefill side -----------------------------------------------------------------------------
    def hold(self, request: EngineRequest) -> KvTransferParams | None:
        """Pin and materialise the finished request's prompt blocks; None if there is no room."""
        core = self.core
        local, seq = core.prompt_hashes(request.prompt, request.cache_salt)
        n = core.pin_cached_prefix(seq, local, len(seq))
        hashes = seq[:n]
        try:
            slots = self.arena.hold(hashes)
        except ArenaFull as exc:
            core.unpin(hashes)
            log.warning("engine %x: cannot hold KV of %s: %s", self.engine_id, request.request_id, exc)
            return None
        if self._corrupt and hashes:
            self.arena.corrupt(hashes[-1])
        transfer_id = f"{self.engine_id:x}-{next(self._ids)}"
        timeout = self.config.hold_timeout_s
        timer = asyncio.get_running_loop().call_later(timeout, self._expire, transfer_id)
        self._holds[transfer_id] = _Hold(hashes, timer)
        self.agent.holding(+1)
        cfg = self.config
        return KvTransferParams(
            backend="nixl",
            source_engine_id=self.engine_id,
            agent_name=self.agent.name,
            agent_metadata=self.agent.metadata,
            block_ids=slots,
            num_tokens=n * core.config.block_size,
            transfer_id=transfer_id,
            block_hashes=hashes,
            block_size=core.config.block_size,
            bytes_per_block=cfg.bytes_per_block,
            model_bytes_per_block=cfg.model_bytes_per_block,
            arena_address=self.arena.address,
            hold_expires_unix_ms=int((time.time() + timeout) * 1000),
            hold_remaining_ms=int(timeout * 1000),
        )

    def release(self, transfer_id: str) -> bool:
        hold = self._holds.pop(transfer_id, None)
        if hold is None:
            return False
        hold.timer.cancel()
        self.arena.unhold(hold.hashes)
        self.core.unpin(hold.hashes)
        self.agent.holding(-1)
        self.on_unpinned()
        return True

    def _expire(self, transfer_id: str) -> None:
        if self.release(transfer_id):
            log.warning("engine %x: KV hold %s expired unreleased (--kv-hold-timeout)", self.engine_id, transfer_id)

    def release_all(self) -> None:
        for transfer_id in list(self._holds):
            self.release(transfer_id)
        for request_id in list(self._pins):
            self.unpin_request(request_id)

    # -- decode side ------------------------------------------------------------------------------
    async def pull(self, request: EngineRequest, params: KvTransferParams) -> KvTransferReport:
        hold_ends = _hold_ends(params)
        core, arena, cfg = self.core, self.arena, self.config
        source = params.source_engine_id
        local, seq = core.prompt_hashes(request.prompt, request.cache_salt)
        offered = list(params.block_hashes)
        n = len(offered)
        block_size = core.config.block_size
        if n and params.block_size != block_size:  # the hashes cannot match: say what to align
            raise KvPullFailed(
                "FAILED_PRECONDITION",
                f"KV block size differs: prefill engine {source:x} has {params.block_size} tokens per block, this "
                f"engine {block_size} (--block-size must match between prefill and decode engines of a model)",
            )
        if n > len(seq) or seq[:n] != offered or len(params.block_ids) != n:
            raise KvPullFailed("INVALID_ARGUMENT", "prefill_result does not describe this request's prompt blocks")
        if n and params.bytes_per_block != arena.bytes_per_block:
            raise KvPullFailed(
                "FAILED_PRECONDITION",
                f"KV block size differs: prefill engine {source:x} has {params.bytes_per_block} bytes per block, "
                f"this engine {arena.bytes_per_block} (--kv-bytes-per-block must match across the mesh)",
            )
        if request.request_id in self._pins:
            raise KvPullFailed("INVALID_ARGUMENT", f"request {request.request_id!r} already pulled KV")
        if _expired(hold_ends):  # its blocks may hold another prompt's KV by now: a local prefill, at once
            raise KvPullFailed("ABORTED", f"the KV hold of prefill engine {source:x} expired (--kv-hold-timeout)")
        have = core.pin_cached_prefix(seq, local, n)
        pinned = have
        slots: list[int] = []
        missing = n - have
        real_s = 0.0
        try:
            if missing:
                try:
                    slots = arena.take(missing)
                except ArenaFull as exc:
                    raise KvPullFailed("RESOURCE_EXHAUSTED", str(exc)) from None
                if self._pull_delay_s:
                    await asyncio.sleep(self._pull_delay_s)
                bpb = arena.bytes_per_block
                local_descs = [(arena.address + slot * bpb, bpb) for slot in slots]
                remote_descs = [(params.arena_address + params.block_ids[i] * bpb, bpb) for i in range(have, n)]
                self.reading_blocks += missing
                try:
                    real_s = await self.agent.read(
                        params.agent_name,
                        params.agent_metadata,
                        local_descs,
                        remote_descs,
                        params.transfer_id.encode(),
                        PULL_TIMEOUT_S,
                    )
                except TransferFailed as exc:
                    raise KvPullFailed("ABORTED", f"KV transfer from prefill engine {source:x} failed: {exc}") from None
                finally:
                    self.reading_blocks -= missing
                for k, slot in enumerate(slots):
                    if not verify_block(arena.view(slot), seq[have + k]):
                        if _expired(hold_ends):  # the source reused the blocks as the read ran: no corruption
                            raise KvPullFailed(
                                "ABORTED", f"the KV hold of prefill engine {source:x} expired during the read"
                            )
                        raise KvPullFailed(
                            "DATA_LOSS",
                            f"KV block {have + k} of {n} pulled from prefill engine {source:x} failed verification "
                            f"(corrupted or torn); the request is failed rather than decoded from bad KV",
                        )
                try:
                    core.pin_new(seq, local, have, n)
                except QueueFull as exc:
                    raise KvPullFailed("RESOURCE_EXHAUSTED", str(exc)) from None
                pinned = n
            modelled_s = 0.0
            if cfg.transfer_gbps:
                modelled_s = missing * params.model_bytes_per_block / (cfg.transfer_gbps * 1e9)
            if cfg.speedup_ratio > 0:
                wait = modelled_s / cfg.speedup_ratio - real_s
                if wait > 0:
                    await asyncio.sleep(wait)
            self._pins[request.request_id] = seq[:pinned]
        except BaseException:  # failed or cancelled: its blocks go back, and a request queued behind them may run
            if pinned:
                core.unpin(seq[:pinned])
                self.on_unpinned()
            raise
        finally:
            arena.give_back(slots)
        bpb = params.bytes_per_block
        return KvTransferReport(
            source_engine_id=source,
            offered_blocks=n,
            local_hit_blocks=have,
            transferred_blocks=missing,
            transferred_bytes=missing * bpb,
            pull_everything_bytes=n * bpb,
            real_ms=real_s * 1000,
            modelled_ms=modelled_s * 1000,
        )

    def unpin_request(self, request_id: str) -> None:
        pinned = self._pins.pop(request_id, None)
        if pinned is not None:
            self.core.unpin(pinned)
            self.on_unpinned()


def _hold_ends(params: KvTransferParams) -> float | None:
    """When the source's hold ends on this host's monotonic clock, counted from now (None: no timeout given).
    Never the source's wall clock (``hold_expires_unix_ms``): a decode host 30 s ahead refused every pull,
    and one behind read blocks the source had already reused."""
    return time.monotonic() + params.hold_remaining_ms / 1000 if params.HasField("hold_remaining_ms") else None


def _expired(hold_ends: float | None, margin_s: float = HOLD_EXPIRY_MARGIN_S) -> bool:
    """Whether the source's hold ends within ``margin_s`` (then it may free and reuse its blocks)."""
    return hold_ends is not None and time.monotonic() > hold_ends - margin_s
