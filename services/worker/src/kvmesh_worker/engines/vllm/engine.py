"""A vLLM ``AsyncLLM`` behind the worker's ``Engine`` interface (``--engine vllm``).

(About 620 lines: the interface is implemented in one place so that its invariants below can be read
together; the ZMQ event decoding, stat logging, AMX permission and P/D params live in their own modules.)

Token ids in and out: the frontend tokenizes, so vLLM runs with ``skip_tokenizer_init``,
``detokenize=False`` and ``RequestOutputKind.DELTA``; the model's EOS id goes into
``stop_token_ids`` unless ``ignore_eos``. Invariants:

- one vLLM engine per worker process (vLLM's side-channel ports and env vars are per process); it
  is built in the registry's factory step, before the worker joins discovery, because
  ``AsyncLLM`` construction blocks for 13-50 s;
- a request is one asyncio task around ``AsyncLLM.generate``; ``abort`` (a cancel, or the end of
  its GenerateStream) cancels that task and calls ``AsyncLLM.abort``, so vLLM frees its blocks
  within one step; the sink gets nothing after ``abort``;
- ``num_cached_prompt_tokens`` is vLLM's own ``num_cached_tokens`` (its prefix-cache hit);
- KV events come from vLLM's ZMQ publisher (``zmq_events``), re-hashed with kvmesh's hashes and
  journalled on the event-loop thread through ``kvmesh.kv_publisher``: the ``SubscribeKvEvents``
  and ``DumpKvIndex`` guarantees are the mocker's;
- load and per-pass metrics come from an in-process vLLM stat logger (called on the loop thread
  after every engine step);
- if the engine core dies (``EngineDeadError``, or ``AsyncLLM.errored`` while idle),
  :meth:`wait_dead` returns and the worker stops serving at once, so the frontend migrates its
  requests elsewhere;
- vLLM's engine processes never outlive the worker: a guard process started before them
  (``orphan_guard``) SIGKILLs them when the worker dies without shutting them down, and removes the
  worker's directory for vLLM's IPC sockets (``VLLM_RPC_BASE_PATH``, also the engine processes'
  ``TMPDIR``) once they are gone;
- ``--role prefill|decode``: vLLM's NixlConnector moves the KV, kvmesh carries vLLM's
  ``kv_transfer_params`` in ``KvTransferParams.engine_params_json`` (``disagg``);
- vLLM's "error" finish (retryable, e.g. a KV pull that broke) is never passed off as a stop: a decode
  leg that generated nothing ends in-band ABORTED (the frontend prefills it elsewhere), any other
  request UNAVAILABLE (the frontend migrates it); a request vLLM refuses (it raises) ends in-band
  INVALID_ARGUMENT with vLLM's own wording for its client errors, INTERNAL for anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import logging
import os
import re
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from kvmesh.kv_events import CacheDump, KvEvent
from kvmesh.kv_publisher import EventJournal, KvEventPublisher, KvSubscription
from kvmesh.v1 import worker_pb2
from kvmesh.v1.kv_transfer_pb2 import KvTransferParams, KvTransferReport

from kvmesh_worker.engine import (
    DuplicateRequest,
    EngineLoad,
    EngineRequest,
    ForwardPassMetrics,
    InvalidRequest,
    QueueFull,
    RequestOutput,
)
from kvmesh_worker.engine.api import FinishReason
from kvmesh_worker.engines.api import EngineSpec, KvNotHeld, KvPullFailed, OutputSink, PassObserver, Role
from kvmesh_worker.engines.registry import EngineBuildError
from kvmesh_worker.model_files import ModelFiles

from . import disagg, orphan_guard
from .amx import request_amx_permission
from .user_args import parse_engine_args
from .zmq_events import ReHasher, VllmCleared, VllmEvent, ZmqKvSubscriber

log = logging.getLogger(__name__)

KV_TOPIC = "kv"
# How often an idle engine is checked for death (a busy one reports it through its streams at once).
DEATH_POLL_S = 0.5


def _require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise EngineBuildError(
            f"--engine vllm: vLLM cannot be imported ({exc}); install it with `make setup-vllm` and run "
            "the worker from that venv (.venv-vllm/bin/kvmesh-worker)"
        ) from exc


def _event_endpoints() -> tuple[str, str]:
    """(publisher, replay) endpoints of vLLM's KV-event sockets: Unix sockets in the abstract namespace, named
    by a fresh random id.

    Not TCP: a port picked free at start-up was bound by vLLM's engine core seconds later, and on a busy
    machine another process had taken it meanwhile ("Address already in use": the worker failed to start).
    An abstract socket (``ipc://@...``, Linux) cannot be taken by chance and leaves no file behind, even
    when the worker is killed; ``ipc://`` makes vLLM bind, as ``tcp://*`` did.
    """
    name = f"kvmesh-vllm-{uuid.uuid4().hex}"
    return f"ipc://@{name}/kv-events", f"ipc://@{name}/kv-replay"


@dataclass
class _Stats:
    """What the stat logger last saw (read by ``load()``; written on the loop thread)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


def token_logprobs(steps: Any, tokens: tuple[int, ...], top: int) -> list[worker_pb2.TokenLogprobs]:
    """vLLM's per-step ``{token id: Logprob}`` -> main's contract: one TokenLogprobs per sampled token.

    vLLM reports, at each step, the sampled token plus the ``top`` most likely ones (``rank`` 1 = most
    likely); ``TokenLogprobs.top`` lists the latter, most likely first.
    """
    out: list[worker_pb2.TokenLogprobs] = []
    for step, token in zip(steps, tokens, strict=False):
        step = step or {}  # a position vLLM reported nothing for: an entry anyway, so counts match
        sampled = step.get(token)
        entry = worker_pb2.TokenLogprobs(
            logprob=float(sampled.logprob) if sampled is not None else float("-inf"),
            rank=int(sampled.rank or 0) if sampled is not None else 0,
        )
        if top:
            ranked = sorted(step.items(), key=lambda item: item[1].rank or 0)
            for token_id, logprob in ranked:
                if logprob.rank is not None and 0 < logprob.rank <= top:
                    entry.top.add(token_id=int(token_id), logprob=float(logprob.logprob), rank=int(logprob.rank))
        out.append(entry)
    return out


class _Request:
    __slots__ = ("first", "hold", "num_prompt", "pulls", "sink", "task", "top", "total")

    def __init__(
        self, sink: OutputSink, num_prompt: int, top: int | None = None, hold: list[int] | None = None
    ) -> None:
        self.sink = sink
        self.num_prompt = num_prompt
        self.top = top  # SamplingOptions.logprobs (None: no logprobs asked)
        self.hold = hold  # a prefill leg's prompt: its last output says where vLLM holds the KV
        self.total = 0
        self.first = True
        self.pulls = False  # a decode leg: vLLM pulls its prompt's KV from a prefill engine first
        self.task: asyncio.Task[None] | None = None


class VllmEngine:
    """One vLLM engine (an ``Engine``); see the module docstring for its invariants."""

    def __init__(
        self,
        engine_id: int,
        llm: Any,
        spec: EngineSpec,
        *,
        eos_token_id: int,
        vocab_size: int,
        event_buffer_size: int,
        kv_endpoint: str,
        kv_replay_endpoint: str,
        max_waiting_requests: int,
        stat_hub: StatHub,
        hold_timeout_s: float = 30.0,
    ) -> None:
        self.engine_id = engine_id
        self.spec = spec
        self.llm = llm
        self.passes = self.prefill_tokens = self.decode_tokens = 0
        # What vLLM itself says it pulled (a decode role): prompt tokens loaded through its KV connector
        # (PromptTokenStats.external_kv_transfer) and NIXL's bytes (kv_connector_stats).
        self.kv_pulled_tokens = self.kv_pulled_bytes = 0
        self._hold_timeout_s = hold_timeout_s
        self._holds: dict[str, float] = {}  # transfer id -> when vLLM's lease ends (monotonic)
        self._remote: dict[str, dict[str, Any]] = {}  # decode: request id -> vLLM kv_transfer_params
        self._eos = eos_token_id
        self._vocab = vocab_size
        self._max_queued = spec.max_num_seqs + max_waiting_requests if max_waiting_requests else 0
        self._journal = EventJournal(event_buffer_size)
        self._publisher = KvEventPublisher(self._journal, self.dump_cache)
        self._rehasher = ReHasher(spec.block_size)
        self._requests: dict[str, _Request] = {}
        self._observers: list[PassObserver] = []
        self._load_listeners: list[Callable[[int], None]] = []
        self._stats = _Stats()
        self._last_pass = time.monotonic()
        self._dead: asyncio.Future[BaseException] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._kv_endpoint = kv_endpoint
        self._kv_replay_endpoint = kv_replay_endpoint
        self._subscriber: ZmqKvSubscriber | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aborts: set[asyncio.Task[None]] = set()
        stat_hub.engine = self

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        self._dead = loop.create_future()
        self._subscriber = ZmqKvSubscriber(
            self._kv_endpoint,
            self._kv_replay_endpoint,
            KV_TOPIC,
            deliver=lambda events: self._from_thread(events),
            on_lost=lambda first, last: self._from_thread([VllmCleared()]),
        )
        self._subscriber.start()
        self._watchdog = loop.create_task(self._watch(), name=f"vllm-watchdog-{self.engine_id:x}")

    async def stop(self) -> None:
        """Abort what is in flight, stop the subscriber, shut vLLM down (its processes exit)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        tasks = [r.task for r in self._requests.values() if r.task is not None]
        self._requests.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._subscriber is not None:
            self._subscriber.stop()
        self.llm.shutdown()

    async def wait_dead(self) -> BaseException:
        """Returns (with the error) once the engine died; never returns while it is healthy."""
        assert self._dead is not None, "start() first"
        return await asyncio.shield(self._dead)

    def _died(self, error: BaseException) -> None:
        if self._dead is not None and not self._dead.done():
            log.critical("vLLM engine %x died: %s", self.engine_id, error or type(error).__name__)
            self._dead.set_result(error)

    async def _watch(self) -> None:
        while not self.llm.errored:
            await asyncio.sleep(DEATH_POLL_S)
        self._died(self.llm.dead_error)

    # -- requests -------------------------------------------------------------------------------
    def _check(self, request: EngineRequest) -> list[int]:
        prompt = _token_list(request.prompt)
        if not prompt:
            raise InvalidRequest("prompt has no tokens")
        if request.hold_kv and self.spec.role != "prefill":
            raise InvalidRequest(
                f"engine {self.engine_id:x} (vLLM) is {self.spec.role}: only --role prefill holds KV for a transfer"
            )
        if request.request_id in self._requests:
            raise DuplicateRequest(f"request id {request.request_id!r} is already running on this engine")
        bad = next((t for t in prompt if t < 0 or t >= self._vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary (size {self._vocab})")
        if request.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {request.max_tokens}")
        if len(prompt) + request.max_tokens > self.spec.context_length:
            raise InvalidRequest(
                f"prompt ({len(prompt)} tokens) + max_tokens ({request.max_tokens}) exceeds the context "
                f"length {self.spec.context_length}"
            )
        if self._max_queued and len(self._requests) >= self._max_queued:
            raise QueueFull(f"engine {self.engine_id:x} has {len(self._requests)} requests (the limit)")
        if self._dead is not None and self._dead.done():
            raise QueueFull(f"engine {self.engine_id:x} is dead")
        return prompt

    def submit(self, request: EngineRequest, sink: OutputSink) -> None:
        try:
            prompt = self._check(request)
        except BaseException:
            self._remote.pop(request.request_id, None)  # a refused decode leg forgets its pulled params
            raise
        top = request.sampling.logprobs if request.sampling is not None else None
        state = self._requests[request.request_id] = _Request(
            sink, len(prompt), top, prompt if request.hold_kv else None
        )
        state.pulls = request.request_id in self._remote
        loop = asyncio.get_running_loop()
        state.task = loop.create_task(self._generate(request, prompt, state), name=f"vllm-{request.request_id}")

    def sampling_params(self, request: EngineRequest) -> Any:
        """``SamplingOptions`` → vLLM ``SamplingParams`` (token ids out, deltas)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        stop = list(request.stop_token_ids)
        if not request.ignore_eos and self._eos not in stop:
            stop.append(self._eos)  # no tokenizer in vLLM: it cannot know the EOS id by itself
        options = request.sampling
        kwargs: dict[str, Any] = dict(
            max_tokens=request.max_tokens,
            min_tokens=options.min_tokens if options is not None else 0,
            ignore_eos=request.ignore_eos,
            stop_token_ids=stop,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            temperature=options.temperature if options is not None else 0.0,
            top_p=options.top_p if options is not None and 0 < options.top_p < 1 else 1.0,
            top_k=options.top_k if options is not None and options.top_k > 0 else 0,
        )
        if options is not None and options.seeded:
            kwargs["seed"] = request.seed
        if options is not None and options.logprobs is not None:
            kwargs["logprobs"] = options.logprobs
        if options is not None and options.stream_interval > 1:
            kwargs["stream_interval"] = options.stream_interval  # vLLM batches its own outputs: less work here
        if request.hold_kv:
            kwargs["extra_args"] = disagg.prefill_extra_args()
        elif (remote := self._remote.pop(request.request_id, None)) is not None:
            kwargs["extra_args"] = {"kv_transfer_params": remote}  # vLLM's dict, verbatim: the pull
        return SamplingParams(**kwargs)

    async def _generate(self, request: EngineRequest, prompt: list[int], state: _Request) -> None:
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        request_id = request.request_id
        try:
            params = self.sampling_params(request)
            async for out in self.llm.generate({"prompt_token_ids": prompt}, params, request_id):
                if self._requests.get(request_id) is not state:
                    return  # aborted
                self._deliver(request_id, state, out)
                if out.finished:
                    return
        except asyncio.CancelledError:
            raise
        except EngineDeadError as exc:
            self._died(exc)
        except Exception as exc:  # vLLM refused the request: a clear status, never a finish (nor a hang)
            log.error("vLLM request %s failed: %s", request_id, exc)
            if self._requests.get(request_id) is state:
                state.sink.put_nowait(self._refused(request_id, state, exc, isinstance(exc, VLLMClientError)))
        finally:
            if self._requests.get(request_id) is state:
                del self._requests[request_id]
                if not self._requests:
                    self._went_idle()

    def _deliver(self, request_id: str, state: _Request, out: Any) -> None:
        completion = out.outputs[0] if out.outputs else None
        tokens = tuple(completion.token_ids) if completion is not None else ()
        state.total += len(tokens)
        finish: FinishReason | None = None
        if out.finished:
            reason = completion.finish_reason if completion is not None else None
            if reason == "error":  # vLLM: a retryable failure of this request, e.g. its KV pull broke
                state.sink.put_nowait(self._failed(request_id, state))
                return
            finish = "length" if reason == "length" else "abort" if reason == "abort" else "stop"
        output = RequestOutput(request_id, tokens, state.total, bool(out.finished), finish)
        if state.first:
            output.num_cached_prompt_tokens = int(out.num_cached_tokens or 0)
            state.first = False
        if state.top is not None and completion is not None and completion.logprobs is not None:
            output.logprobs = token_logprobs(completion.logprobs, tokens, state.top)
        if out.finished and state.hold is not None and out.kv_transfer_params:
            output.kv_transfer = disagg.held_params(
                self.engine_id,
                request_id,
                state.hold,
                self.spec.block_size,
                out.kv_transfer_params,
                self._hold_timeout_s,
            )
            self._holds[request_id] = time.monotonic() + disagg.lease_seconds(self._hold_timeout_s)
        state.sink.put_nowait(output)

    def _failed(self, request_id: str, state: _Request) -> RequestOutput:
        """vLLM ended the request with its "error" finish (retryable, by vLLM's contract)."""
        if state.pulls and state.total == 0:
            # The pull from the prefill engine broke (its source died mid-READ, say) and vLLM's
            # kv_load_failure_policy "fail" ended it: nothing was generated, so the frontend may prefill
            # it elsewhere (ABORTED, as a failed pull of the mocker's).
            log.warning("vLLM could not pull request %s's KV from its prefill engine", request_id)
            code, message = "ABORTED", "the KV transfer from the prefill engine failed"
        else:
            log.warning("vLLM failed request %s after %d tokens (a retryable error)", request_id, state.total)
            code, message = "UNAVAILABLE", "the engine failed the request"
        return RequestOutput(request_id, (), state.total, True, error_code=code, error_message=message)

    @staticmethod
    def _refused(request_id: str, state: _Request, exc: Exception, client_error: bool) -> RequestOutput:
        """vLLM raised instead of generating. Its client errors (``VLLMClientError``, its 4xx) and
        ``ValueError``s are its validation of the request, worded for the caller (``logprobs`` above
        ``max_logprobs``, say); anything else is internal and stays in the log."""
        if client_error or isinstance(exc, ValueError):
            code, message = "INVALID_ARGUMENT", f"vLLM refused the request: {str(exc)[:300]}"
        else:
            code, message = "INTERNAL", "the engine could not run the request"
        return RequestOutput(request_id, (), state.total, True, error_code=code, error_message=message)

    def abort(self, request_id: str, sink: OutputSink) -> None:
        self._remote.pop(request_id, None)  # a pull's params: only the pulling stream's (generation takes them)
        state = self._requests.get(request_id)
        if state is None or state.sink is not sink:
            return  # not running, or another stream's request of the same id
        del self._requests[request_id]
        if state.task is not None:
            state.task.cancel()  # AsyncLLM.generate aborts on cancellation too
        task = asyncio.get_running_loop().create_task(self._abort(request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, request_id: str) -> None:
        with contextlib.suppress(Exception):
            await self.llm.abort(request_id)

    def release_kv(self, transfer_id: str) -> bool:
        """Ends kvmesh's view of a hold; vLLM frees the blocks on the decode side's read notice or its lease."""
        if self.spec.role != "prefill":
            raise KvNotHeld(
                f"engine {self.engine_id:x} (vLLM) is {self.spec.role}: only --role prefill holds KV for transfers"
            )
        now = time.monotonic()
        for expired in [t for t, until in self._holds.items() if until <= now]:
            del self._holds[expired]
        return self._holds.pop(transfer_id, None) is not None

    async def pull_kv(self, request: EngineRequest, params: KvTransferParams) -> KvTransferReport:
        """Checks vLLM's params and keeps them for ``submit``: vLLM's scheduler does the pull itself."""
        if self.spec.role != "decode":
            raise KvPullFailed(
                "FAILED_PRECONDITION", f"engine {self.engine_id:x} (vLLM) is {self.spec.role}: it cannot pull KV"
            )
        cached = {b.block_hash for b in self._rehasher.blocks.values()} if params.block_ids else set()
        remote, report = disagg.remote_prefill(_token_list(request.prompt), params, self.spec.block_size, cached)
        self._remote[request.request_id] = remote
        return report

    # -- KV journal -----------------------------------------------------------------------------
    def _from_thread(self, events: list[VllmEvent]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._on_vllm_events, events)

    def _on_vllm_events(self, events: list[VllmEvent]) -> None:
        data = self._rehasher.apply(events)
        if data:
            self._publisher.publish([self._journal.append(d) for d in data])

    def subscribe(self, start_event_id: int | None) -> tuple[CacheDump | list[KvEvent], KvSubscription]:
        return self._publisher.subscribe(start_event_id)

    def unsubscribe(self, subscription: KvSubscription) -> None:
        self._publisher.unsubscribe(subscription)

    def dump_cache(self) -> CacheDump:
        return CacheDump(self._rehasher.dump(), self._journal.next_event_id)

    # -- load -----------------------------------------------------------------------------------
    def load(self) -> EngineLoad:
        """vLLM's last step figures, bounded by what is in flight now.

        vLLM's stat logger runs once per engine step, and the last step of a request reports it still
        running with its blocks in use (the stats are taken before it finishes); an idle engine takes
        no further step. Unbounded, that stale load made the router send a request that shares a
        prefix with this engine to an idle mocker instead (the engine-death test's flake).
        """
        total = self.spec.total_kv_blocks
        in_flight = len(self._requests)
        running = min(self._stats.running, in_flight)
        waiting = min(self._stats.waiting, in_flight - running)
        now = time.monotonic()
        held = any(until > now for until in self._holds.values())  # held blocks stay in use
        usage = self._stats.kv_usage if in_flight or held else 0.0
        active = min(total, round(usage * total))
        return EngineLoad(
            active_blocks=active,
            cached_blocks=max(0, len(self._rehasher.blocks) - active),
            total_blocks=total,
            num_waiting=waiting,
            num_running=running,
            queued_prefill_tokens=sum(r.num_prompt for r in self._requests.values() if r.first),
        )

    def add_observer(self, observer: PassObserver) -> None:
        self._observers.append(observer)

    def add_load_listener(self, listener: Callable[[int], None]) -> None:
        """``listener(engine_id)`` when the load changed with no engine step to report it (now idle)."""
        self._load_listeners.append(listener)

    def _went_idle(self) -> None:
        for listener in self._load_listeners:
            listener(self.engine_id)

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        """One engine step, from the stat logger (loop thread)."""
        now = time.monotonic()
        if scheduler_stats is not None:
            self._stats.running = int(scheduler_stats.num_running_reqs)
            self._stats.waiting = int(scheduler_stats.num_waiting_reqs)
            self._stats.kv_usage = float(scheduler_stats.kv_cache_usage)
            self._connector_stats(scheduler_stats.kv_connector_stats)
        if iteration_stats is None:
            return
        prompt = iteration_stats.prompt_token_stats
        self.kv_pulled_tokens += int(getattr(prompt, "external_kv_transfer", 0) or 0)
        prefill = int(getattr(prompt, "computed", 0) or 0)
        decode = int(iteration_stats.num_generation_tokens)
        prefill_reqs = len(iteration_stats.time_to_first_tokens_iter)
        metrics = ForwardPassMetrics(
            num_prefill_requests=prefill_reqs,
            num_decode_requests=max(0, self._stats.running - prefill_reqs),
            prefill_tokens=prefill,
            decode_tokens=max(0, decode - prefill_reqs),
            num_preempted=int(iteration_stats.num_preempted_reqs),
            active_blocks=min(self.spec.total_kv_blocks, round(self._stats.kv_usage * self.spec.total_kv_blocks)),
            duration_ms=0.0,
        )
        self.passes += 1
        self.prefill_tokens += metrics.prefill_tokens
        self.decode_tokens += metrics.decode_tokens
        wall = now - self._last_pass
        self._last_pass = now
        for observer in self._observers:
            observer(self.engine_id, metrics, wall)

    def _connector_stats(self, stats: Any) -> None:
        """NIXL's per-step transfer telemetry (``NixlKVConnectorStats.data``): bytes read."""
        if not stats:
            return
        pulled = stats.get("bytes_transferred") if isinstance(stats, dict) else None
        if isinstance(pulled, list):
            self.kv_pulled_bytes += int(sum(pulled))
            if pulled:
                log.info("vLLM pulled %d bytes of KV in %d NIXL transfer(s)", sum(pulled), len(pulled))


class StatHub:
    """Connects vLLM's stat logger (built inside ``AsyncLLM``) to the engine built after it."""

    engine: VllmEngine | None = None

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if self.engine is not None:
            self.engine.record(scheduler_stats, iteration_stats)


def _stat_logger_factory(hub: StatHub) -> Callable[[Any, int], Any]:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class KvmeshStatLogger(StatLoggerBase):  # type: ignore[misc]  # vLLM is untyped here
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
        ) -> None:
            hub.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return KvmeshStatLogger


def engine_args(settings: Any, model_path: str, kv_endpoint: str, replay_endpoint: str) -> dict[str, Any]:
    """The ``AsyncEngineArgs`` fields: kvmesh's defaults, the user's ``--vllm-engine-args``, then what kvmesh owns."""
    user = parse_engine_args(settings.vllm_engine_args)
    explicit = settings.model_fields_set
    args: dict[str, Any] = {
        "block_size": settings.block_size,
        "enforce_eager": True,  # no graph capture: starts in seconds (override for production GPUs)
        "seed": 0,
    }
    for name in ("max_num_seqs", "max_num_batched_tokens", "stream_interval"):
        if name in explicit:
            args[name] = getattr(settings, name)
    if settings.max_model_len:
        args["max_model_len"] = settings.max_model_len
    if "num_gpu_blocks" in explicit:
        args["num_gpu_blocks_override"] = settings.num_gpu_blocks
    args.update(user)
    args.update(
        model=model_path,
        skip_tokenizer_init=True,  # the frontend tokenizes; token ids in and out
        enable_prefix_caching=True,  # KV events exist only with prefix caching
        disable_log_stats=False,  # the stat logger feeds load() and the pass observers
        kv_events_config={
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": kv_endpoint,
            "replay_endpoint": replay_endpoint,
            "topic": KV_TOPIC,
        },
    )
    return args


def _default_inductor_cache() -> str:
    """Where torch puts its compile cache when TMPDIR is the usual one (``torchinductor_<user>``)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container): torch's own fallback
        user = f"uid_{os.getuid()}"
    return str(Path(tempfile.gettempdir()) / ("torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)))


def build(settings: Any, model: ModelFiles) -> Callable[[int], VllmEngine]:
    """The registry's factory: checks the settings, starts vLLM (13-50 s), returns the one-engine maker."""
    if settings.num_engines != 1:
        raise EngineBuildError("--engine vllm hosts one engine per process: use --num-engines 1 (a worker per engine)")
    if not settings.model_path:
        raise EngineBuildError("--engine vllm needs --model-path DIR (an HF model directory)")
    role: Role = getattr(settings, "role", "aggregated")
    _require_vllm()
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; only read by the CPU build
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads at run time
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    request_amx_permission()
    # vLLM's ZMQ IPC sockets go to the temp dir and stay there after its processes exit; give them a
    # directory of the worker's, which the guard removes (unless the user chose where they go).
    ipc_dir = None
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        ipc_dir = Path(tempfile.mkdtemp(prefix="kvmesh-vllm-ipc-"))
        os.environ["VLLM_RPC_BASE_PATH"] = str(ipc_dir)
        # The engine processes' temp dir too: their rendezvous file (torch's FileStore, vllm_dist_*) is
        # left in it whenever an engine is killed. They are spawned, so they read TMPDIR afresh; torch's
        # compile cache keeps its usual place, so that it outlives the worker as before.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _default_inductor_cache())
        os.environ["TMPDIR"] = str(ipc_dir)
    orphan_guard.start(scratch=ipc_dir)  # vLLM's engine processes would outlive a SIGKILLed worker
    orphan_guard.start_resource_tracker()  # the cleaner of vLLM's shared memory, before vLLM starts
    kv_endpoint, replay_endpoint = _event_endpoints()
    try:
        args = engine_args(settings, settings.model_path, kv_endpoint, replay_endpoint)
    except ValueError as exc:
        raise EngineBuildError(f"--vllm-engine-args: {exc}") from exc
    args["kv_events_config"] = KVEventsConfig(**args["kv_events_config"])
    if role != "aggregated":
        from vllm.platforms import current_platform

        try:
            import nixl._api  # noqa: F401  (a missing NIXL is a one-line startup error, not an engine-core crash)
        except ImportError as exc:
            raise EngineBuildError(f"--role {role} needs NIXL (make setup-vllm installs it): {exc}") from None
        transfer = disagg.kv_transfer_config(
            role, args.get("kv_transfer_config"), settings.kv_hold_timeout, current_platform.is_cpu()
        )
        disagg.side_channel_env(settings.host)
        try:
            args["kv_transfer_config"] = KVTransferConfig(**transfer or {})
        except (TypeError, ValueError) as exc:
            raise EngineBuildError(f"--vllm-engine-args kv_transfer_config: {exc}") from exc
    try:
        engine_args_ = AsyncEngineArgs(**args)
    except TypeError as exc:
        raise EngineBuildError(f"--vllm-engine-args: {exc}") from exc
    hub = StatHub()
    try:
        llm = AsyncLLM.from_engine_args(engine_args_, stat_loggers=[_stat_logger_factory(hub)])
    except Exception as exc:
        raise EngineBuildError(f"--engine vllm: the engine did not start: {exc}") from exc
    config = llm.vllm_config
    spec = EngineSpec(
        kind="vllm",
        role=role,
        block_size=int(config.cache_config.block_size),
        context_length=int(config.model_config.max_model_len),
        total_kv_blocks=int(config.cache_config.num_gpu_blocks or 0),
        max_num_seqs=int(config.scheduler_config.max_num_seqs),
        max_num_batched_tokens=int(config.scheduler_config.max_num_batched_tokens),
        max_waiting_requests=settings.max_waiting_requests,
        kv_transfer_agent=False,  # vLLM's NixlConnector runs its own agent, in its engine core
    )
    log.info("vLLM engine ready: %s", spec)
    made: list[VllmEngine] = []

    def make(engine_id: int) -> VllmEngine:
        if made:
            raise EngineBuildError("one vLLM engine per worker process")
        made.append(
            VllmEngine(
                engine_id,
                llm,
                spec,
                eos_token_id=model.eos_token_id,
                vocab_size=model.vocab_size,
                event_buffer_size=settings.event_buffer_size,
                kv_endpoint=kv_endpoint,
                kv_replay_endpoint=replay_endpoint,
                max_waiting_requests=settings.max_waiting_requests,
                stat_hub=hub,
                hold_timeout_s=settings.kv_hold_timeout,
            )
        )
        return made[0]

    return make


def _token_list(prompt: Sequence[int] | np.ndarray) -> list[int]:
    """The prompt as the list of Python ints vLLM takes (an array converts in C, a sequence item by item)."""
    return prompt.tolist() if isinstance(prompt, np.ndarray) else [int(t) for t in prompt]
