"""The fleet: which engines are alive, from discovery.

An engine is routable while both of its discovery records exist (both live under its worker's lease):

- its instance record ``v1/instances/{ns}/worker/engine/{engine_id:x}`` (liveness, address, model);
- its model card ``v1/models/{ns}/{model}/{engine_id:x}`` (block size, KV capacity, whether it publishes
  KV events).

Two ``list_and_watch`` streams feed one join; a Snapshot (the first one, and any after a resync) is
diffed against what the fleet had. The fleet reports changes through two synchronous callbacks,
``on_added(EngineInfo)`` and ``on_removed(engine_id)``, which the daemon wires to the router state
(index, slot tracker, admission) and the ingest (subscribe with a full restore / stop). Engines of
every known worker role join (their caches are indexed); which role a query may use is the router's
role filter (:mod:`kvmesh_router.candidates`): aggregated unless ``RouterConfigOverride.role`` says
otherwise. An engine whose role this build does not know is left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from functools import partial

from kvmesh.discovery import (
    Discovery,
    Snapshot,
    apply_watch_event,
    instance_prefix,
    model_prefix,
    parse_instance_key,
    parse_model_key,
)
from kvmesh.v1 import discovery_pb2

from kvmesh_router.engines import EngineInfo
from kvmesh_router.translate import role_name

__all__ = ["Fleet", "engine_info"]

log = logging.getLogger(__name__)


def engine_info(record: discovery_pb2.InstanceRecord, card: discovery_pb2.ModelCard) -> EngineInfo:
    return EngineInfo(
        engine_id=record.instance_id,
        model=card.name or record.model,
        address=record.address or card.address,
        block_size=card.block_size or 16,
        total_blocks=card.total_kv_blocks or 1,
        max_num_batched_tokens=card.max_num_batched_tokens or None,
        kv_events=card.capabilities.kv_events,
        role=role_name(record.role) or "aggregated",
        max_requests=card.max_num_seqs + card.max_waiting_requests if card.max_waiting_requests else None,
    )


class Fleet:
    """Joins worker instance records and model cards into live engines; see the module docstring."""

    def __init__(
        self,
        discovery: Discovery,
        namespace: str,
        on_added: Callable[[EngineInfo], None],
        on_removed: Callable[[int], None],
    ) -> None:
        self.discovery = discovery
        self.namespace = namespace
        self.on_added = on_added
        self.on_removed = on_removed
        self._records: dict[int, discovery_pb2.InstanceRecord] = {}
        self._cards: dict[int, discovery_pb2.ModelCard] = {}
        self._record_keys: dict[str, int] = {}
        self._card_keys: dict[str, int] = {}
        self.engines: dict[int, EngineInfo] = {}
        self._first = {"records": asyncio.Event(), "cards": asyncio.Event()}
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._watch(instance_prefix(self.namespace, "worker", "engine"), "records")),
            loop.create_task(self._watch(model_prefix(self.namespace), "cards")),
        ]

    async def wait_initial(self, timeout: float) -> bool:
        """Wait for the first snapshot of both watches (the fleet as discovery knows it at start)."""
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in self._first.values())), timeout)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ------------------------------------------------------------------ watches

    async def _watch(self, prefix: str, what: str) -> None:
        async with contextlib.aclosing(self.discovery.list_and_watch(prefix)) as events:
            async for ev in events:
                known = self._record_keys if what == "records" else self._card_keys
                apply_watch_event(ev, known, partial(self._put, what), partial(self._delete, what))
                if isinstance(ev, Snapshot):
                    self._first[what].set()

    def _put(self, what: str, key: str, value: bytes) -> None:
        try:
            if what == "records":
                engine_id = parse_instance_key(key).instance_id
                record = discovery_pb2.InstanceRecord.FromString(value)
                if self._records.get(engine_id) == record:
                    return
                self._records[engine_id] = record
                self._record_keys[key] = engine_id
            else:
                engine_id = parse_model_key(key).instance_id
                card = discovery_pb2.ModelCard.FromString(value)
                if self._cards.get(engine_id) == card:
                    return
                self._cards[engine_id] = card
                self._card_keys[key] = engine_id
        except Exception as exc:  # a corrupt or foreign record must not stop the watch
            log.warning("ignoring discovery record %s: %s", key, exc)
            return
        self._reconcile(engine_id)

    def _delete(self, what: str, key: str) -> None:
        keys = self._record_keys if what == "records" else self._card_keys
        engine_id = keys.pop(key, None)
        if engine_id is None:
            return
        (self._records if what == "records" else self._cards).pop(engine_id, None)
        self._reconcile(engine_id)

    def _reconcile(self, engine_id: int) -> None:
        record = self._records.get(engine_id)
        card = self._cards.get(engine_id)
        live = record is not None and card is not None and role_name(record.role) is not None
        old = self.engines.get(engine_id)
        if not live:
            if old is not None:
                del self.engines[engine_id]
                log.info("engine %x (%s at %s) left the fleet", engine_id, old.model, old.address)
                self.on_removed(engine_id)
            return
        assert record is not None and card is not None
        info = engine_info(record, card)
        if info == old:
            return
        if old is not None and (old.address != info.address or old.block_size != info.block_size):
            # Same id, different process or geometry: forget everything about the old one first.
            del self.engines[engine_id]
            self.on_removed(engine_id)
        self.engines[engine_id] = info
        log.info(
            "engine %x joined the fleet: model %s at %s, %d blocks of %d tokens%s",
            engine_id,
            info.model,
            info.address,
            info.total_blocks,
            info.block_size,
            "" if info.kv_events else " (no KV events)",
        )
        self.on_added(info)
