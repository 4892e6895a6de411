"""The engine registry: every routable engine as discovery describes it, and the engines of each model.

:mod:`kvmesh_router.fleet` turns discovery records into :class:`EngineInfo`; :class:`RouterState` keeps
this registry, admission and the index in step (it is the only caller of :meth:`EngineRegistry.put` /
:meth:`EngineRegistry.remove`).

Invariants: an engine serves exactly one model, at one block size; :meth:`EngineRegistry.for_model`
returns frozensets that are replaced, never mutated (a decision in flight holds its model's set as
``allowed_engines``); a model (or a model's block size) with no engine has no entry.

**Block sizes.** A query's block hashes match only engines of the block size they were computed with,
and its booked blocks only mean something there: ``for_model(model, block_size)`` is the model's engines
of that size (a fleet in the middle of a ``--block-size`` change serves each query from one size).

**Unroutable engines.** Discovery is the slow, authoritative signal of a dead worker (its lease
expires after up to a TTL). The fast one is the KV-event ingest (:mod:`kvmesh_router.ingest`): the
engines it finds dead leave ``for_model`` at once, until their own KV-event stream works again or
discovery removes them. If that would leave a model with no engine, ``for_model`` returns them all (a
maybe-dead engine beats a certain NO_ENGINE; the frontend migrates on its failure).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["EngineInfo", "EngineRegistry"]


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """A routable engine as discovery describes it (instance record + model card)."""

    engine_id: int
    model: str
    address: str
    block_size: int
    total_blocks: int
    max_num_batched_tokens: int | None = None
    kv_events: bool = True
    role: str = "aggregated"  # cost.ROLES; discovery's WORKER_ROLE_UNSPECIFIED counts as aggregated
    max_requests: int | None = None  # max_num_seqs + max_waiting_requests; None: the engine's queue is unbounded


class EngineRegistry(dict[int, EngineInfo]):
    """``{engine id: EngineInfo}`` plus the engines of each model."""

    __slots__ = ("_by_model", "_routable", "unroutable")

    def __init__(self) -> None:
        super().__init__()
        # model -> its engines, and (model, block size) -> its engines of that size
        self._by_model: dict[str | tuple[str, int], frozenset[int]] = {}
        # for_model's answers while an engine is unroutable
        self._routable: dict[str | tuple[str, int], frozenset[int]] = {}
        self.unroutable: set[int] = set()

    def set_routable(self, engine_ids: Iterable[int], routable: bool) -> None:
        """The KV-event ingest's verdict on these engines (see the module docstring)."""
        if routable:
            self.unroutable.difference_update(engine_ids)
        else:
            self.unroutable.update(engine_ids)
        self._routable.clear()

    def put(self, info: EngineInfo) -> EngineInfo | None:
        """Register or update ``info``; returns what was registered under its id before."""
        old = self.get(info.engine_id)
        self[info.engine_id] = info
        self._routable.clear()
        if old is None or old.model != info.model or old.block_size != info.block_size:
            if old is not None:
                self._unlist(old)
            self._list(info)
        return old

    def remove(self, engine_id: int) -> EngineInfo | None:
        info = super().pop(engine_id, None)
        if info is not None:
            self._unlist(info)
            self.unroutable.discard(engine_id)
            self._routable.clear()
        return info

    def block_sizes(self, model: str) -> list[int]:
        """The block sizes of ``model``'s engines (for a message: a pass over them)."""
        return sorted({self[e].block_size for e in self._by_model.get(model, ())})

    def for_model(self, model: str, block_size: int = 0) -> frozenset[int] | None:
        """The routable engines serving ``model`` (of ``block_size``, unless 0); None if none does. See the
        module docstring."""
        key: str | tuple[str, int] = (model, block_size) if block_size else model
        engines = self._by_model.get(key)
        if not self.unroutable or engines is None:
            return engines
        routable = self._routable.get(key)
        if routable is None:
            routable = self._routable[key] = (engines - self.unroutable) or engines
        return routable

    def _list(self, info: EngineInfo) -> None:
        for key in (info.model, (info.model, info.block_size)):
            self._by_model[key] = self._by_model.get(key, frozenset()) | {info.engine_id}

    def _unlist(self, info: EngineInfo) -> None:
        for key in (info.model, (info.model, info.block_size)):
            rest = self._by_model.get(key, frozenset()) - {info.engine_id}
            if rest:
                self._by_model[key] = rest
            else:
                self._by_model.pop(key, None)
