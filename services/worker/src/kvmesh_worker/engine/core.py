"""EngineCore: the mocker engine, one synchronous ``step()`` = one simulated forward pass.

Shaped like vLLM v1's ``EngineCore.step()`` (schedule -> execute -> update), with execution replaced
by the perf model: a step returns what a real pass would have produced and how long it would have
taken, and does no I/O and reads no clock. So the same core runs under a gRPC shell (which sleeps
``duration_ms`` / speedup between steps and publishes ``kv_events``) and under an offline
discrete-event replay (which advances virtual time by ``duration_ms``), and is unit-testable and
replayable: the same calls in the same order give the same outputs and the same events.

Nobody needs to poll: an engine with ``has_unfinished() == False`` has nothing to do until the next
``add_request``, and a step on it returns at once with no outputs and no events. An engine is not
thread-safe: one driver (an event loop or a replay) owns it.

An in-process consumer of the KV events (the offline replay, which applies them to its router index)
can pass a :class:`~.block_manager.KvSink` instead: the block manager then reports each change as
plain hashes to that sink, no ``KvEvent`` is built or journalled, and ``StepOutput.kv_events`` stays
empty (the sink gets the same changes at the same moments, in the same order). The sink's owner holds
the cached set, so such an engine keeps no block metadata: ``dump_cache`` and ``clear_cache`` raise.

Cost: a pass is O(running requests) plus O(blocks that change). A replay that only needs timing
(``emit_token_ids=False``) can also skip the dominant case, runs of decode passes in which nothing
but counters change, with ``fast_forward`` (exactly equivalent to stepping through them).

Disaggregation is done by the engine shell (``kvmesh_worker.kv_transfer.mocker_kv``) with the pin methods
below: a held prompt and a pulled prompt are pinned blocks, nothing else changes in the core. The
original seams (only ``EngineMode.AGGREGATED`` is implemented) stay for an engine that would model it
in the core:

* prefill-only (``EngineMode.PREFILL``): requests run exactly as now with ``max_tokens=1``; at
  finish, instead of deref'ing the blocks, the scheduler would park the request in a ``transferring``
  map (blocks still active, so they count as load and cannot be evicted) until a
  ``release_kv(request_id)`` call, which derefs them like a finish does now.
* decode-only (``EngineMode.DECODE``): requests come with ``kv_source=KvSource.TRANSFER``; at
  admission the scheduler would allocate blocks for the whole prompt, mark it computed
  (``num_computed = num_prompt_tokens - 1``, ``prefill_done=True``) and store the full blocks (their
  KV now exists here, so they are announced) with no prefill tokens charged to the perf model.
  ``add_request`` is the single gate that rejects a kv_source the mode cannot serve.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from kvmesh.hashing import block_hashes, salted_seed
from kvmesh.kv_events import CacheDump, EventData, KvEvent
from kvmesh.kv_publisher import EventJournal

from .api import (
    DuplicateRequest,
    EngineLoad,
    EngineRequest,
    ForwardPassMetrics,
    InvalidRequest,
    KvSource,
    QueueFull,
    StepOutput,
)
from .block_manager import BlockManager, KvSink
from .config import EngineConfig, EngineMode
from .perf_model import PerfModel, PolynomialPerfModel
from .scheduler import Request, Scheduler


class EngineCore:
    """One simulated engine (defaults: Dynamo's mocker config and polynomial perf model)."""

    def __init__(
        self, config: EngineConfig | None = None, perf_model: PerfModel | None = None, kv_sink: KvSink | None = None
    ) -> None:
        """``kv_sink``: report cache changes there instead of journalling KvEvents (see the module docstring)."""
        self.config = config = config or EngineConfig()
        if config.mode is not EngineMode.AGGREGATED:
            raise NotImplementedError(f"engine mode {config.mode.value!r} is not implemented yet (see core.py)")
        self.perf_model = perf_model or PolynomialPerfModel()
        self.journal = EventJournal(config.event_journal_size)
        self._events: list[KvEvent] = []  # events of the step (or call) in progress
        self.block_manager = BlockManager(config.num_gpu_blocks, self._record, kv_sink)
        self.scheduler = Scheduler(config, self.block_manager)
        self._block_size = config.block_size
        self._total_kv_tokens = config.num_gpu_blocks * config.block_size

    # -------------------------------------------------------------------------------------- requests

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; raises InvalidRequest (incl. DuplicateRequest) or QueueFull, never anything else."""
        cfg = self.config
        if request.request_id in self.scheduler.requests:
            raise DuplicateRequest(f"request id {request.request_id!r} is already in the engine")
        if request.kv_source is not KvSource.COMPUTE:
            raise InvalidRequest(f"kv_source={request.kv_source.value!r} needs a decode engine; this one is {cfg.mode}")
        prompt = np.asarray(request.prompt)
        if prompt.size == 0:
            raise InvalidRequest("prompt has no tokens")
        if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
            raise InvalidRequest(
                f"prompt must be a flat sequence of integer token ids, got {prompt.dtype}{prompt.shape}"
            )
        low, high = int(prompt.min()), int(prompt.max())
        if low < 0 or high >= cfg.vocab_size:
            bad = low if low < 0 else high
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, vocab_size={cfg.vocab_size})")
        if request.max_tokens < 1:
            raise InvalidRequest(f"max_tokens={request.max_tokens} must be >= 1")
        total = prompt.size + request.max_tokens
        if total > cfg.context_length:
            raise InvalidRequest(
                f"prompt ({prompt.size} tokens) + max_tokens ({request.max_tokens}) = {total} exceeds "
                f"context_length={cfg.context_length} (max_model_len={cfg.max_model_len}, "
                f"KV capacity above the watermark, and the token budget without chunked prefill)"
            )
        # Running + waiting against max_num_seqs + max_waiting_requests, as the vLLM engine counts and the
        # model card advertises (routers and frontends bound admission by it): counting only the waiting
        # queue would refuse a burst that arrives between two passes while running slots are free.
        bound = cfg.max_waiting_requests
        if bound is not None and len(self.scheduler.waiting) + len(self.scheduler.running) >= cfg.max_num_seqs + bound:
            held = f"max_num_seqs={cfg.max_num_seqs} running + max_waiting_requests={bound} waiting"
            raise QueueFull(f"waiting queue is full ({held})")
        self.scheduler.add(Request(request, prompt.astype("<u4"), cfg))

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request and release its blocks immediately (they stay cached); False if unknown/finished.

        The caller already knows the request ended (with finish reason 'abort'), so no output is produced.
        """
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------- disaggregation (engine shell)
    # Pins are plain block references outside any request: a pinned block is active (it counts as load
    # and is never evicted) until unpinned. The shell pins a prefill's prompt blocks while a decode
    # engine pulls them, and a decode engine's pulled blocks until its request is admitted.

    def prompt_hashes(self, prompt: Sequence[int] | np.ndarray, cache_salt: str | None) -> tuple[list[int], list[int]]:
        """(local, sequence) hashes of the prompt's full blocks, exactly as a request would have them."""
        return block_hashes(np.asarray(prompt).astype("<u4"), self._block_size, salted_seed(cache_salt))

    def pin_cached_prefix(self, seq_hashes: list[int], local_hashes: list[int], limit: int) -> int:
        """Pin the longest cached prefix of ``seq_hashes[:limit]``; returns its length in blocks (no events)."""
        n = self.block_manager.match_prefix(seq_hashes, limit)[0]
        if n:
            self.block_manager.use(seq_hashes, local_hashes, 0, n)
        return n

    def pin_new(self, seq_hashes: list[int], local_hashes: list[int], lo: int, hi: int) -> None:
        """Store and pin blocks ``[lo, hi)`` whose KV arrived from elsewhere (BlocksStored on the next step
        that runs, or from :meth:`take_events` when none will)."""
        bm = self.block_manager
        if bm.num_missing(seq_hashes, lo, hi) > bm.free_slots:
            raise QueueFull(f"no room for {hi - lo} transferred KV blocks ({bm.num_active} of {bm.num_blocks} active)")
        bm.use(seq_hashes, local_hashes, lo, hi)

    def unpin(self, seq_hashes: Sequence[int]) -> None:
        if seq_hashes:
            self.block_manager.deref(list(seq_hashes))

    # ------------------------------------------------------------------------------------------ step

    def step(self) -> StepOutput:
        """Run one scheduler pass and return its outputs, KV events and modelled duration."""
        sched = self.scheduler
        if not sched.requests:
            return StepOutput([], [], ForwardPassMetrics(active_blocks=self.block_manager.num_active))
        scheduled, num_preempted = sched.schedule()
        active_blocks = self.block_manager.num_active  # what the pass runs with (before finishes free blocks)
        outputs, num_prefill, prefill_tokens, num_decode, context_tokens = sched.update(scheduled)
        duration = 0.0
        if prefill_tokens:
            duration = self.perf_model.prefill_ms(prefill_tokens)
        if num_decode:
            duration += self.perf_model.decode_ms(
                active_blocks * self._block_size, self._total_kv_tokens, context_tokens / num_decode
            )
        events, self._events = self._events, []
        metrics = ForwardPassMetrics(
            num_prefill, num_decode, prefill_tokens, num_decode, num_preempted, active_blocks, duration
        )
        return StepOutput(outputs, events, metrics)

    def fast_forward(self, max_passes: int, max_ms: float = math.inf) -> tuple[int, float]:
        """Run up to ``max_passes`` quiet passes at once; returns (passes run, their total duration in ms).

        For callers that only need timing (``emit_token_ids=False``), e.g. an offline replay between
        two arrivals: a quiet pass (see ``Scheduler.quiet_passes``) emits no output and no event, so k
        of them cost O(running requests) here instead of k ``step()`` calls, with exactly the same
        resulting state and time. Stops before the first pass that is not quiet or that would end
        after ``max_ms``; (0, 0.0) means the next pass needs a real ``step()``.
        """
        if self.config.emit_token_ids:
            raise ValueError("fast_forward skips per-token outputs: it needs emit_token_ids=False")
        sched = self.scheduler
        limit = min(max_passes, sched.quiet_passes())
        if limit <= 0:
            return 0, 0.0
        active_kv = self.block_manager.num_active * self._block_size
        num_decode = len(sched.running)
        context = sum(r.num_computed for r in sched.running) + num_decode  # of the first skipped pass
        passes, total = 0, 0.0
        decode_ms = self.perf_model.decode_ms
        if getattr(self.perf_model, "decode_uses_context", True):
            while passes < limit:
                duration = decode_ms(active_kv, self._total_kv_tokens, context / num_decode)
                if total + duration > max_ms:
                    break
                total += duration
                passes += 1
                context += num_decode
        else:  # every pass of the run takes the same time; summed pass by pass all the same (same floats)
            duration = decode_ms(active_kv, self._total_kv_tokens, context / num_decode)
            while passes < limit and total + duration <= max_ms:
                total += duration
                passes += 1
        sched.skip(passes)
        return passes, total

    # ---------------------------------------------------------------------------------- cache, load

    @property
    def next_event_id(self) -> int:
        return self.journal.next_event_id

    def events_since(self, event_id: int) -> list[KvEvent] | None:
        """Journal replay for a subscriber that missed events (None: take ``dump_cache()`` instead)."""
        return self.journal.since(event_id)

    def dump_cache(self) -> CacheDump:
        """The whole cached set (active + inactive full blocks) as of ``next_event_id``."""
        return CacheDump(self.block_manager.dump(), self.journal.next_event_id)

    def take_events(self) -> list[KvEvent]:
        """The events recorded outside a pass (a pull's stored blocks) not yet returned by a step: an idle
        engine runs no step, and a subscriber would not learn of those blocks until some request came."""
        events, self._events = self._events, []
        return events

    def clear_cache(self) -> list[KvEvent]:
        """Drop every cached block that no request is using; returns the events this produced.

        Blocks of running requests cannot be dropped (their KV is in use), so the events are
        AllCleared followed by BlocksStored for those survivors: an index applying them stays exact,
        and on an idle engine it is just AllCleared.
        """
        self.block_manager.clear()
        events, self._events = self._events, []
        return events

    def load(self) -> EngineLoad:
        bm, sched = self.block_manager, self.scheduler
        return EngineLoad(
            active_blocks=bm.num_active,
            cached_blocks=bm.num_inactive,
            total_blocks=bm.num_blocks,
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            queued_prefill_tokens=sched.pending_prefill_tokens,
        )

    def _record(self, data: EventData) -> None:
        self._events.append(self.journal.append(data))
