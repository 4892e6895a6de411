"""The one interface between the worker's gRPC face and an engine implementation.

``service.py``, ``generate_stream.py`` and ``metrics.py`` see engines only through :class:`Engine`;
an implementation is picked by name from ``engines.registry``. The mocker (``EngineRunner`` driving
the I/O-free ``EngineCore`` in simulated time) is one implementation; a vLLM ``AsyncLLM`` adapter and
the disaggregated prefill/decode roles are meant to be others. So the interface assumes neither a
synchronous in-process core nor simulated time: requests go in, outputs come back through a sink
whenever the engine produces them, KV events go through the shared publisher
(``kvmesh.kv_publisher``), and load is whatever the engine last knew.

The request/output vocabulary is ``kvmesh_worker.engine.api`` (``EngineRequest``, ``RequestOutput``,
``EngineLoad``, ``ForwardPassMetrics`` and the errors): plain dataclasses any engine can build.

Invariants every implementation keeps (all calls come from the worker's event-loop thread):

- ``submit`` either raises (``InvalidRequest``, ``QueueFull``: nothing was queued) or accepts the
  request; an accepted request's outputs reach its sink in order, the last one with ``finished``,
  unless it is aborted first, after which its sink gets nothing more;
- ``abort`` frees the request's KV at once (it stays cached); unknown or finished ids are ignored;
- ``subscribe`` returns the replay or snapshot and registers the subscriber in the same call
  (``KvEventPublisher.subscribe``): no gap, no duplicate;
- observers are called once per forward pass, after its outputs were delivered; an engine whose load
  can change with no pass to report it (vLLM going idle) may also offer
  ``add_load_listener(listener)`` and call ``listener(engine_id)`` then (optional: the service looks
  it up with ``getattr``);
- ``release_kv`` frees what a prefill role holds for a transfer (False: unknown, already released
  or expired); an engine that never holds KV for transfers (aggregated) raises :class:`KvNotHeld`.

Disaggregation (see docs/disaggregation.md). The gRPC side orchestrates, engine-agnostically: a request
with ``hold_kv`` finishes like any other, and its last output carries ``kv_transfer`` (a
``kvmesh.v1.KvTransferParams``: what the engine holds, for how long); a request that comes with a
prefill result is first ``await pull_kv(request, params)`` (the engine pulls what it lacks, verifies it,
and keeps it pinned for this request id), then ``submit``-ted; the worker then tells the source
``ReleaseKv`` whatever the outcome. Invariants: what ``pull_kv`` pinned is unpinned by the request's
``submit`` (accepted or not) or its ``abort``; a cancelled ``pull_kv`` leaves nothing pinned; a
hold lives until ``release_kv`` or its lease (``--kv-hold-timeout``) ends, whichever comes first.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from kvmesh.kv_events import CacheDump, KvEvent
from kvmesh.kv_publisher import KvSubscription
from kvmesh.v1.kv_transfer_pb2 import KvTransferParams, KvTransferReport
from kvmesh.wakeup import Wakeup

from kvmesh_worker.engine.api import EngineError, EngineLoad, EngineRequest, ForwardPassMetrics, RequestOutput

Role = Literal["aggregated", "prefill", "decode"]
# Called after each forward pass: (engine id, the pass's metrics, wall seconds it took).
PassObserver = Callable[[int, ForwardPassMetrics, float], None]


class KvNotHeld(EngineError):
    """``release_kv`` on an engine whose role never holds KV for transfers."""


class KvPullFailed(EngineError):
    """``pull_kv`` failed; ``code`` is the gRPC status name the request ends with.

    ABORTED: the source or the backend failed (nothing was generated: the caller may prefill locally);
    DATA_LOSS: a pulled block failed verification; INVALID_ARGUMENT: the params do not match the prompt;
    RESOURCE_EXHAUSTED: no room for the blocks; FAILED_PRECONDITION: this engine cannot pull.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What discovery advertises about one engine (its model card's engine fields)."""

    kind: str  # ModelCard.capabilities.engine_kind, e.g. "mocker"
    role: Role
    block_size: int
    context_length: int
    total_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting_requests: int = 0  # beyond max_num_seqs; 0 = unbounded (frontends then admit without a bound)
    # Whether the engine moves KV through the worker process's NIXL agent (published in discovery); vLLM's
    # connector runs an agent of its own.
    kv_transfer_agent: bool = True


class OutputSink(Protocol):
    """Where an engine delivers a request's outputs, in order (a GenerateStream session shares one)."""

    def put_nowait(self, item: RequestOutput) -> None: ...


class Engine(Protocol):
    """One routable engine hosted by the worker process."""

    @property
    def engine_id(self) -> int: ...

    @property
    def spec(self) -> EngineSpec: ...

    # Forward passes and tokens so far (Prometheus counters, read at scrape time).
    @property
    def passes(self) -> int: ...

    @property
    def prefill_tokens(self) -> int: ...

    @property
    def decode_tokens(self) -> int: ...

    def start(self) -> None:
        """Start serving (on the running event loop)."""

    async def stop(self) -> None:
        """Stop serving and release what ``start`` acquired; requests still in flight are dropped."""

    def submit(self, request: EngineRequest, sink: OutputSink) -> None:
        """Queue a request whose outputs go to ``sink``; raises InvalidRequest or QueueFull."""

    def abort(self, request_id: str, sink: OutputSink) -> None:
        """Cancel the request ``sink`` submitted as ``request_id`` and free its KV now (and a pull's pins
        for that id). Request ids are unique per stream, not per engine: another sink's request with the
        same id is left alone."""

    def release_kv(self, transfer_id: str) -> bool:
        """Free the KV a prefill role holds for a transfer; False if it holds none for that id."""

    async def pull_kv(self, request: EngineRequest, params: KvTransferParams) -> KvTransferReport:
        """Obtain the prompt KV ``params`` describes (only blocks not cached here); raises KvPullFailed."""

    def subscribe(self, start_event_id: int | None) -> tuple[CacheDump | list[KvEvent], KvSubscription]:
        """Replay from ``start_event_id`` (or a snapshot) plus the live subscription; raises EventIdTooNew."""

    def unsubscribe(self, subscription: KvSubscription) -> None: ...

    def dump_cache(self) -> CacheDump:
        """The whole cached set as of the next event id."""

    def load(self) -> EngineLoad:
        """The engine's current (or last known) load."""

    def add_observer(self, observer: PassObserver) -> None:
        """Call ``observer`` after every forward pass."""


class OutputStream:
    """A sink for one request and its one consumer: a lean unbounded queue of its outputs."""

    __slots__ = ("_items", "_wakeup")

    def __init__(self) -> None:
        self._items: collections.deque[RequestOutput] = collections.deque()
        self._wakeup = Wakeup()

    def put_nowait(self, item: RequestOutput) -> None:
        self._items.append(item)
        self._wakeup.set()

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> RequestOutput:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self) -> RequestOutput:
        while not self._items:
            await self._wakeup.wait()
        return self._items.popleft()
