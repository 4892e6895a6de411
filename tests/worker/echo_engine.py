"""A second engine behind the worker's ``Engine`` interface: it echoes the prompt back.

It exists to show that an engine is added without touching ``service.py``, ``generate_stream.py``
or ``metrics.py``: ``kvmesh-worker --engine tests.worker.echo_engine:build`` serves it over real
gRPC (the registry imports ``module:factory`` paths). Unlike the mocker it has no synchronous core
and no simulated time: one asyncio task per engine runs "passes" as fast as the loop lets it, the
shape an adapter around an asynchronous engine (vLLM's ``AsyncLLM``) has.

What it does, so tests can predict every figure:

- a request's tokens are its prompt repeated, ``max_tokens`` of them, one per pass (finish
  reason ``length``); ``num_cached_prompt_tokens`` is how many prompt tokens were cached already;
- its cache is the set of full prompt blocks it has seen (chained ``kvmesh.hashing`` hashes, like
  every engine's); a request's new blocks are journalled and published through
  ``kvmesh.kv_publisher`` at admission, as one ``BlocksStored``; nothing is ever evicted;
- ``InvalidRequest`` for an empty prompt, ``QueueFull`` beyond ``--max-num-seqs`` requests;
- a prompt that starts with token 0 streams one token, then the engine fails it itself (as vLLM's
  retryable "error" finish does): its last output carries ``error_code`` UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvmesh.hashing import block_hashes
from kvmesh.kv_events import BlocksStored, CacheDump, KvEvent, StoredBlock
from kvmesh.kv_publisher import EventJournal, KvEventPublisher, KvSubscription
from kvmesh.wakeup import Wakeup
from kvmesh_worker.engine import (
    EngineLoad,
    EngineRequest,
    ForwardPassMetrics,
    InvalidRequest,
    QueueFull,
    RequestOutput,
)
from kvmesh_worker.engines import EngineSpec, KvNotHeld, OutputSink, PassObserver
from kvmesh_worker.model_files import ModelFiles

FAILS = 0  # a prompt starting with this token is failed by the engine after one token


@dataclass
class _Request:
    request: EngineRequest
    sink: OutputSink
    cached_tokens: int
    sent: int = 0


class EchoEngine:
    def __init__(self, engine_id: int, spec: EngineSpec, event_buffer_size: int) -> None:
        self.engine_id = engine_id
        self.spec = spec
        self.passes = self.prefill_tokens = self.decode_tokens = 0
        self._cached: dict[int, tuple[int | None, int]] = {}  # sequence hash -> (parent, tokens hash), in order
        self._journal = EventJournal(event_buffer_size)
        self._publisher = KvEventPublisher(self._journal, self.dump_cache)
        self._running: dict[str, _Request] = {}
        self._observers: list[PassObserver] = []
        self._wakeup = Wakeup()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"echo-{self.engine_id:x}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def submit(self, request: EngineRequest, sink: OutputSink) -> None:
        prompt = [int(t) for t in request.prompt]
        if not prompt:
            raise InvalidRequest("prompt has no tokens")
        if len(self._running) >= self.spec.max_num_seqs:
            raise QueueFull(f"echo engine is full (max_num_seqs={self.spec.max_num_seqs})")
        local, sequence = block_hashes(prompt, self.spec.block_size)
        hits = next((i for i, h in enumerate(sequence) if h not in self._cached), len(sequence))
        if hits < len(sequence):
            parent = sequence[hits - 1] if hits else None
            new = tuple(map(StoredBlock, sequence[hits:], local[hits:]))
            for i, block in enumerate(new, hits):
                self._cached[block.block_hash] = (sequence[i - 1] if i else None, block.tokens_hash)
            self._publisher.publish([self._journal.append(BlocksStored(parent, new))])
        self._running[request.request_id] = _Request(request, sink, hits * self.spec.block_size)
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        self._running.pop(request_id, None)

    def release_kv(self, transfer_id: str) -> bool:
        raise KvNotHeld(f"engine {self.engine_id:x} echoes: it holds no KV for transfers")

    def subscribe(self, start_event_id: int | None) -> tuple[CacheDump | list[KvEvent], KvSubscription]:
        return self._publisher.subscribe(start_event_id)

    def unsubscribe(self, subscription: KvSubscription) -> None:
        self._publisher.unsubscribe(subscription)

    def dump_cache(self) -> CacheDump:
        stored = [BlocksStored(parent, (StoredBlock(h, tokens),)) for h, (parent, tokens) in self._cached.items()]
        return CacheDump(stored, self._journal.next_event_id)

    def load(self) -> EngineLoad:
        return EngineLoad(
            active_blocks=0,
            cached_blocks=len(self._cached),
            total_blocks=self.spec.total_kv_blocks,
            num_waiting=0,
            num_running=len(self._running),
            queued_prefill_tokens=0,
        )

    def add_observer(self, observer: PassObserver) -> None:
        self._observers.append(observer)

    async def _run(self) -> None:
        while True:
            while not self._running:
                await self._wakeup.wait()
            started = time.monotonic()
            batch = list(self._running.values())
            prefill = [r for r in batch if r.sent == 0]
            for r in batch:
                prompt = r.request.prompt
                if r.sent and int(prompt[0]) == FAILS:
                    del self._running[r.request.request_id]
                    r.sink.put_nowait(
                        RequestOutput(r.request.request_id, (), r.sent, True, error_code="UNAVAILABLE",
                                      error_message="echo: the engine failed the request")
                    )  # fmt: skip
                    continue
                token = int(prompt[r.sent % len(prompt)])
                r.sent += 1
                done = r.sent >= r.request.max_tokens
                first = r.sent == 1
                if done:
                    del self._running[r.request.request_id]
                r.sink.put_nowait(
                    RequestOutput(
                        r.request.request_id,
                        (token,),
                        r.sent,
                        finished=done,
                        finish_reason="length" if done else None,
                        num_cached_prompt_tokens=r.cached_tokens if first else None,
                    )
                )
            metrics = ForwardPassMetrics(
                num_prefill_requests=len(prefill),
                num_decode_requests=len(batch) - len(prefill),
                prefill_tokens=sum(len(r.request.prompt) for r in prefill),
                decode_tokens=len(batch) - len(prefill),
                num_preempted=0,
                active_blocks=0,
                duration_ms=0.0,
            )
            self.passes += 1
            self.prefill_tokens += metrics.prefill_tokens
            self.decode_tokens += metrics.decode_tokens
            for observer in self._observers:
                observer(self.engine_id, metrics, time.monotonic() - started)
            await asyncio.sleep(0.001)  # one pass per loop tick or so: outputs of a pass leave together


def build(settings: Any, model: ModelFiles) -> Callable[[int], EchoEngine]:
    """The registry's factory: ``--engine tests.worker.echo_engine:build``."""
    spec = EngineSpec(
        kind="echo",
        role="aggregated",
        block_size=settings.block_size,
        context_length=settings.max_model_len or model.max_context,
        total_kv_blocks=settings.num_gpu_blocks,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
    )
    return lambda engine_id: EchoEngine(engine_id, spec, settings.event_buffer_size)
