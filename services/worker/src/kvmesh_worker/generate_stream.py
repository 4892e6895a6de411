"""One ``WorkerService.GenerateStream`` call: many generations multiplexed on one stream.

(About 400 lines: one session's batching, KV-pull hand-off and per-request spans share its state.)

A frontend keeps one such stream per worker process instead of one call per request: no call
setup, no per-request trailers, and the outputs of every request that progressed in one
event-loop tick leave as one message. It sees engines only through the ``Engine`` interface.
Invariants:

- the session is the engines' output sink for its requests (``Engine.submit(request, sink)``): each
  output lands in ``_pending`` and wakes the writer, which sends whatever piled up as one message,
  so a request whose engine ran several passes meanwhile gets one merged entry;
- a request ends with exactly one final entry (a finish reason, or an in-band error) and is then
  forgotten (an id sent again while active ends the active request too, with that one error: the
  caller could not tell their outputs apart); a cancelled request gets nothing more; an engine that
  fails a request itself says so with an output carrying an error code (``RequestOutput.error_code``):
  the tokens it produced before still go out, then the in-band error;
- a request's stream interval (the larger of its ``SamplingOptions.stream_interval`` and the worker's
  ``--stream-interval``) holds its outputs back after its first token until at least that many tokens
  are new; its final output (or in-band error) releases everything held, and nothing held outlives the
  request (a cancel or the stream's end drops it with the request);
- when the stream ends for any reason, every request still on it is aborted (blocks freed);
- a caller that does not read is not read either: with ``MAX_UNSENT_ERRORS`` in-band errors unsent, the
  session reads no more requests until the writer sends, so its memory stays bounded;
- while the daemon is not serving (lease lost, draining) new requests fail in-band with
  UNAVAILABLE; a draining worker ends the stream once its last request is done, so a drain does
  not wait for the caller to hang up;
- disaggregation: a request with a ``prefill_result`` is active from the start but reaches its engine
  only after ``Engine.pull_kv``; a cancel (or the stream's end) during the pull cancels it; whatever
  happens, the source is told ``ReleaseKv`` once the pull is over (its hold lease is the backstop); a
  failed pull ends the request in-band with the pull's status (ABORTED, DATA_LOSS, ...). The pull's
  report rides on the request's first response; a held request's KvTransferParams on its last.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc
import numpy as np
from kvmesh import grpc_services, telemetry
from kvmesh.v1 import worker_pb2
from kvmesh.v1.kv_transfer_pb2 import KvTransferParams, KvTransferReport
from kvmesh.wakeup import Wakeup

from kvmesh_worker.engine import (
    EngineRequest,
    ForwardPassMetrics,
    InvalidRequest,
    QueueFull,
    RequestOutput,
    Sampling,
)
from kvmesh_worker.engines import Engine, KvPullFailed
from kvmesh_worker.metrics import request_metrics

log = logging.getLogger(__name__)

SPAN_NAME = "kvmesh.v1.WorkerService/Generate"  # one span per request (the name traces already use)
_FINISH = {
    "length": worker_pb2.FINISH_REASON_LENGTH,
    "stop": worker_pb2.FINISH_REASON_STOP,
    "abort": worker_pb2.FINISH_REASON_CANCELLED,
}

_MALFORMED = grpc_services.malformed_details(worker_pb2.GenerateStreamRequest)
#: In-band errors a stream may have unsent before its requests stop being read (flow control then holds
#: the caller's writes): a caller that sends and never reads cannot grow the worker's memory.
MAX_UNSENT_ERRORS = 4096
#: Outputs a stream may have unsent (tokens of requests that go on) before its new requests stop being read:
#: a caller that sends and never reads grew the worker by 1 GB in 40 s (outputs of the requests it kept adding).
MAX_UNSENT_OUTPUTS = 65536
#: Stop token ids per request: each is checked against every generated token (1M of them stalled the loop).
MAX_STOP_TOKEN_IDS = 1024


def prompt_tokens(request: worker_pb2.GenerateRequest) -> np.ndarray | list[int]:
    """The prompt, from whichever form it came in (``token_ids_u32le`` is read in place, with no copy).

    Raises :class:`InvalidRequest` for a byte length that is not a multiple of 4, or both forms set.
    """
    raw = request.token_ids_u32le
    if not raw:
        return request.token_ids[:]  # a slice copies in C: 2x faster than list() on an 8k-token prompt
    if len(raw) % 4 or request.token_ids:
        why = "both token_ids and token_ids_u32le are set" if request.token_ids else f"{len(raw)} bytes"
        raise InvalidRequest(f"token_ids_u32le must hold the whole prompt as 4-byte little-endian ids ({why})")
    return np.frombuffer(raw, dtype="<u4")


def engine_request(request: worker_pb2.GenerateRequest, request_id: str) -> EngineRequest:
    """The engine's view of ``request``; raises :class:`InvalidRequest` for a malformed prompt or sampling."""
    sampling = request.sampling
    check_sampling(sampling)
    return EngineRequest(
        request_id=request_id,
        prompt=prompt_tokens(request),
        max_tokens=sampling.max_tokens,
        ignore_eos=sampling.ignore_eos,
        stop_token_ids=tuple(sampling.stop_token_ids),
        seed=sampling.seed if sampling.HasField("seed") else 0,
        sampling=Sampling(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_tokens=sampling.min_tokens,
            seeded=sampling.HasField("seed"),
            logprobs=sampling.logprobs if sampling.HasField("logprobs") else None,
            stream_interval=max(1, sampling.stream_interval),
        ),
        hold_kv=request.hold_kv_for_transfer,
    )


def check_sampling(sampling: worker_pb2.SamplingOptions) -> None:
    """SamplingOptions no engine can honour are INVALID_ARGUMENT for every engine, as vLLM refuses them
    (the mocker, which samples no distribution, took them silently)."""
    if not 0 <= sampling.temperature < math.inf:
        raise InvalidRequest(f"temperature must be finite and >= 0, got {sampling.temperature}")
    if not 0 <= sampling.top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1] (0: disabled), got {sampling.top_p}")
    if sampling.top_k < -1:
        raise InvalidRequest(f"top_k must be -1 or 0 (disabled) or a positive integer, got {sampling.top_k}")
    if sampling.min_tokens > sampling.max_tokens:
        raise InvalidRequest(f"min_tokens ({sampling.min_tokens}) must not exceed max_tokens ({sampling.max_tokens})")
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"{len(sampling.stop_token_ids)} stop_token_ids; at most {MAX_STOP_TOKEN_IDS} are accepted"
        )


def mock_logprob(token_id: int, position: int) -> float:
    """A deterministic stand-in log probability in (-4, 0] for engines that sample no distribution.

    The mocker draws token ids, not logits: the same token at the same output position always gets
    the same value, so tests and clients see stable, plausible numbers.
    """
    mixed = (token_id * 2654435761 + (position + 1) * 40503) & 0xFFFF
    return -4.0 * mixed / 65536.0


def fill_logprobs(response: worker_pb2.GenerateResponse, outputs: list[RequestOutput], top: int) -> None:
    """One TokenLogprobs per new token: the engine's (``output.logprobs``) or the mock stand-in."""
    for output in outputs:
        reported = output.logprobs
        if reported is not None:  # an engine that samples a real distribution
            response.logprobs.extend(reported)  # type: ignore[arg-type]  # TokenLogprobs
            continue
        position = output.num_output_tokens - len(output.token_ids)
        for offset, token in enumerate(output.token_ids):
            value = mock_logprob(token, position + offset)
            entry = response.logprobs.add(logprob=value, rank=1)
            if top:
                entry.top.add(token_id=token, logprob=value, rank=1)


def fill_response(
    response: worker_pb2.GenerateResponse, outputs: list[RequestOutput], num_prompt: int, logprobs: int | None = None
) -> bool:
    """Merge one request's outputs into ``response``; True when the request finished."""
    finished = False
    if len(outputs) == 1:
        response.token_ids.extend(outputs[0].token_ids)
    else:
        response.token_ids.extend([token for output in outputs for token in output.token_ids])
    if logprobs is not None:
        fill_logprobs(response, outputs, logprobs)
    for output in outputs:
        if output.num_cached_prompt_tokens is not None:
            response.num_cached_tokens = output.num_cached_prompt_tokens
            response.num_prompt_tokens = num_prompt
        if output.finished:
            finished = True
            response.finish_reason = _FINISH.get(output.finish_reason or "stop", worker_pb2.FINISH_REASON_STOP)
            if output.kv_transfer is not None:
                response.kv_transfer.CopyFrom(output.kv_transfer)  # type: ignore[arg-type]  # KvTransferParams
    return finished


class PassClock:
    """When one engine's latest forward pass ended and how long it took (its pass observer).

    Engines deliver a pass's outputs, then report the pass: by the time the session's writer handles
    a request's first token, the clock holds the pass that produced it. That pass's start splits the
    request's wait into queue (before) and prefill (the pass).
    """

    __slots__ = ("end", "wall")

    def __init__(self) -> None:
        self.end = 0.0
        self.wall = 0.0

    def __call__(self, engine_id: int, metrics: ForwardPassMetrics, wall_s: float) -> None:
        self.end = time.time()
        self.wall = wall_s


# Weak: the engines are the daemon's, and a process-wide table must not keep them (and through their
# observers the whole daemon, gRPC server included) alive after the daemon has stopped.
_CLOCKS: weakref.WeakKeyDictionary[Engine, PassClock] = weakref.WeakKeyDictionary()


def pass_clock(engine: Engine) -> PassClock:
    """The engine's PassClock, registered as its observer on first use."""
    clock = _CLOCKS.get(engine)
    if clock is None:
        clock = _CLOCKS[engine] = PassClock()
        engine.add_observer(clock)
    return clock


class _Active:
    __slots__ = ("clock", "engine", "first_at", "labels", "logprobs", "num_output", "num_prompt", "span", "submitted")

    def __init__(
        self, engine: Engine, num_prompt: int, span: Any, logprobs: int | None = None, model: str = ""
    ) -> None:
        self.engine = engine
        self.num_prompt = num_prompt
        self.span = span
        self.logprobs = logprobs
        self.clock = pass_clock(engine)
        self.submitted = time.time()
        self.first_at = 0.0
        self.num_output = 0
        self.labels = (model, f"{engine.engine_id:x}")

    def first_token(self) -> None:
        """Queue and prefill, from the pass that produced the first token (see PassClock)."""
        now = time.time()
        clock = self.clock
        end = clock.end if self.submitted <= clock.end <= now else now
        start = max(self.submitted, end - clock.wall)
        self.first_at = end
        metrics = request_metrics()
        metrics.queue_time.labels(*self.labels).observe(start - self.submitted)
        metrics.prefill_time.labels(*self.labels).observe(end - start)
        if self.span is not None:
            telemetry.end_span(telemetry.start_span("queue", self.span, start_time=self.submitted), end_time=start)
            telemetry.end_span(telemetry.start_span("prefill", self.span, start_time=start), end_time=end)

    def finished(self, response: worker_pb2.GenerateResponse) -> None:
        """Decode time and time per output token; ends the request's span."""
        now = time.time()
        if self.first_at and self.num_output > 1:
            per_token = (now - self.first_at) / (self.num_output - 1)
            request_metrics().time_per_output_token.labels(*self.labels).observe(per_token)
        if self.span is not None:
            if self.first_at:
                decode = telemetry.start_span("decode", self.span, start_time=self.first_at)
                telemetry.end_span(decode, attributes={"kvmesh.output_tokens": self.num_output}, end_time=now)
            attributes = {"kvmesh.output_tokens": self.num_output, "kvmesh.finish_reason": response.finish_reason}
            telemetry.end_span(self.span, None, attributes)


def _ends(output: RequestOutput) -> bool:
    """The request's last output: a finish reason, or an in-band error."""
    return output.finished or output.error_code is not None


class _Hold:
    """A request's outputs held back by its stream interval (vLLM's rule: the first token, then every
    ``interval`` new tokens, and the end, go out at once)."""

    __slots__ = ("interval", "outputs", "sent")

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.outputs: list[RequestOutput] = []
        self.sent = 0  # the request's tokens already released

    def take(self, output: RequestOutput) -> list[RequestOutput] | None:
        """Everything held plus ``output`` when it is time to send them, else None (still held)."""
        self.outputs.append(output)
        total = output.num_output_tokens
        if not (_ends(output) or (self.sent == 0 and total > 0) or total - self.sent >= self.interval):
            return None
        self.sent = total
        outputs, self.outputs = self.outputs, []
        return outputs


class GenerateStreamSession:
    """Serves one GenerateStream call until the caller hangs up (or the worker drains)."""

    def __init__(
        self,
        engines: Mapping[int, Engine],
        refusal: Callable[[], str | None],
        on_aborted: Callable[[Engine], None],
        context: grpc.aio.ServicerContext[worker_pb2.GenerateStreamRequest, worker_pb2.GenerateStreamResponse],
        model: str = "",
        release_remote: Callable[[KvTransferParams, Any], None] = lambda _params, _span: None,
        stream_interval: int = 1,
    ) -> None:
        self._model = model  # the metrics' model label
        self._stream_interval = stream_interval  # the worker's --stream-interval: every request's floor
        self._engines = engines
        self._release_remote = release_remote
        self._pulls: dict[str, asyncio.Task[None]] = {}
        self._reports: dict[str, KvTransferReport] = {}
        self._refusal = refusal
        self._on_aborted = on_aborted
        self._context = context
        self._loop = asyncio.get_running_loop()
        self._active: dict[str, _Active] = {}
        self._pending: dict[str, list[RequestOutput]] = {}
        self._unsent = 0  # outputs in ``_pending``
        self._holds: dict[str, _Hold] = {}  # requests whose stream interval is above 1
        self._failed: list[worker_pb2.GenerateStreamOutput] = []
        self._wakeup = Wakeup()
        self._written = asyncio.Event()  # set after each message the writer sends
        self._input_done = False
        self._stopping = False

    # -- the engines' sink ------------------------------------------------------------------------
    def put_nowait(self, output: RequestOutput) -> None:
        if self._holds:
            hold = self._holds.get(output.request_id)
            if hold is not None:
                self._release(hold, output)
                return
        self._queue(output)

    def _queue(self, output: RequestOutput) -> None:
        """``output`` to the writer (woken for a request with nothing queued yet)."""
        self._unsent += 1
        outputs = self._pending.get(output.request_id)
        if outputs is None:
            self._pending[output.request_id] = [output]
            self._wakeup.set()
        else:
            outputs.append(output)

    def _release(self, hold: _Hold, output: RequestOutput) -> None:
        released = hold.take(output)
        if released is None:
            return
        if _ends(output):
            del self._holds[output.request_id]
        for held in released:
            self._queue(held)

    # -- the call -----------------------------------------------------------------------------------
    async def serve(self, requests: AsyncIterator[worker_pb2.GenerateStreamRequest]) -> None:
        writer = self._loop.create_task(self._write_loop())
        reader = self._loop.create_task(self._read(requests))
        try:
            done, _ = await asyncio.wait([reader, writer], return_when=asyncio.FIRST_COMPLETED)
            if reader in done:
                reader.result()  # a broken request stream raises here
                await writer  # the caller half-closed: finish what is in flight
            else:
                writer.result()  # drained (returns) or a failed write (raises)
        finally:
            for task in (reader, writer):
                task.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)
            self._abort_all()

    def stop_when_idle(self) -> None:
        """The worker is draining: end the stream once no request is left on it."""
        self._stopping = True
        self._wakeup.set()

    async def _read(self, requests: AsyncIterator[worker_pb2.GenerateStreamRequest]) -> None:
        async for message in requests:
            if grpc_services.is_malformed(message):  # in band: the stream's other requests go on
                self._fail("", grpc.StatusCode.INVALID_ARGUMENT, _MALFORMED)
                continue
            for request_id in message.cancel_request_ids:
                self._cancel(request_id)
            for request in message.requests:
                self._start(request)
            # A caller that does not read: stop reading it too (its writes then stall on flow control).
            while len(self._failed) >= MAX_UNSENT_ERRORS or self._unsent >= MAX_UNSENT_OUTPUTS:
                self._written.clear()
                await self._written.wait()
        self._input_done = True  # the caller half-closed: finish what is in flight, then end
        self._wakeup.set()

    def _start(self, request: worker_pb2.GenerateRequest) -> None:
        request_id = request.request_id
        if not request_id:
            self._fail("", grpc.StatusCode.INVALID_ARGUMENT, "request_id is required on a GenerateStream")
            return
        if request_id in self._active:  # its outputs could no longer be told apart: both end, with one error
            self._cancel(request_id)
            self._refuse(
                request,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request id {request_id!r} was sent again while active; both requests are ended",
            )
            return
        refusal = self._refusal()
        if refusal is not None:
            self._refuse(request, grpc.StatusCode.UNAVAILABLE, refusal)
            return
        engine = self._engines.get(request.engine_id)
        if engine is None:
            hosted = ", ".join(f"{e:x}" for e in self._engines)
            message = f"engine {request.engine_id:x} is not hosted by this worker (it hosts {hosted})"
            self._refuse(request, grpc.StatusCode.NOT_FOUND, message)
            return
        span = telemetry.start_request_span(SPAN_NAME, request.trace_context)
        if span is not None:
            span.set_attributes(
                {
                    "kvmesh.request_id": request_id,
                    "kvmesh.model": self._model,
                    "kvmesh.engine_id": f"{request.engine_id:x}",
                }
            )
        logprobs = request.sampling.logprobs if request.sampling.HasField("logprobs") else None
        try:
            ereq = engine_request(request, request_id)
        except InvalidRequest as exc:
            self._refuse(request, grpc.StatusCode.INVALID_ARGUMENT, str(exc), span)
            return
        if span is not None:
            span.set_attribute("kvmesh.prompt_tokens", len(ereq.prompt))
        interval = max(self._stream_interval, request.sampling.stream_interval)
        if interval > 1:  # before submit: an engine may deliver from inside it
            self._holds[request_id] = _Hold(interval)
        if request.HasField("prefill_result"):
            self._active[request_id] = _Active(engine, len(ereq.prompt), span, logprobs, self._model)
            self._pulls[request_id] = self._loop.create_task(self._pull_then_submit(engine, request, ereq))
            return
        try:
            engine.submit(ereq, self)
        except InvalidRequest as exc:
            self._holds.pop(request_id, None)
            self._fail(request_id, grpc.StatusCode.INVALID_ARGUMENT, str(exc), span)
        except QueueFull as exc:
            self._holds.pop(request_id, None)
            self._fail(request_id, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), span)
        else:
            self._active[request_id] = _Active(engine, len(ereq.prompt), span, logprobs, self._model)

    async def _pull_then_submit(self, engine: Engine, request: worker_pb2.GenerateRequest, ereq: EngineRequest) -> None:
        """Pull the prompt's KV, then submit; the source is released whatever happens.

        The request may be cancelled meanwhile and its id sent again (a retry): what this pull finds under
        the id is then the retry's, which it must neither submit for nor take off the books.
        """
        request_id = request.request_id
        params = request.prefill_result
        mine = self._active.get(request_id)
        try:
            report = await engine.pull_kv(ereq, params)
        except KvPullFailed as exc:
            if exc.code == "RESOURCE_EXHAUSTED":  # no room for the blocks now: computed here, queued for room
                log.info("request %s: %s; computing its prompt here", request_id, exc)
                report = KvTransferReport(
                    source_engine_id=params.source_engine_id,
                    offered_blocks=len(params.block_hashes),
                    recomputed_because="the decode engine had no room for the pulled KV",
                )
            else:
                if self._active.get(request_id) is mine:
                    self._fail_active(request_id, grpc.StatusCode[exc.code], str(exc))
                return
        except Exception:  # never leave the request hanging; the client sees no internals
            log.exception("KV pull for %s failed", request_id)
            if self._active.get(request_id) is mine:
                self._fail_active(
                    request_id, grpc.StatusCode.INTERNAL, "KV pull failed (an internal error, logged by the worker)"
                )
            return
        finally:
            if self._pulls.get(request_id) is asyncio.current_task():
                del self._pulls[request_id]
            self._release_remote(params, mine.span if mine is not None else None)
        if self._active.get(request_id) is not mine:  # cancelled right as the pull ended (and maybe resent)
            engine.abort(request_id, self)
            return
        try:
            engine.submit(ereq, self)
        except InvalidRequest as exc:
            self._fail_active(request_id, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFull as exc:
            self._fail_active(request_id, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        else:
            self._reports[request_id] = report

    def _refuse(
        self, request: worker_pb2.GenerateRequest, code: grpc.StatusCode, message: str, span: Any = None
    ) -> None:
        """End a request that never reached its engine; a decode leg's source hold is released, not left to
        its lease (nobody else will pull that KV)."""
        if request.HasField("prefill_result"):
            self._release_remote(request.prefill_result, span)
        self._fail(request.request_id, code, message, span)

    def _release_unsent_hold(self, engine: Engine, outputs: list[RequestOutput] | None) -> None:
        """A prefill's last output, queued but not sent when its request was cancelled or its stream ended:
        its KV hold would wait for its lease, since nobody learns where it is."""
        held = outputs[-1].kv_transfer if outputs else None
        if isinstance(held, KvTransferParams):
            engine.release_kv(held.transfer_id)

    def _fail_active(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        self._holds.pop(request_id, None)
        active = self._active.pop(request_id, None)
        if active is not None:
            self._fail(request_id, code, message, active.span)

    def _cancel(self, request_id: str) -> None:
        pull = self._pulls.pop(request_id, None)
        if pull is not None:
            pull.cancel()
        self._reports.pop(request_id, None)
        active = self._active.pop(request_id, None)
        unsent = self._pending.pop(request_id, None)
        if unsent:
            self._unsent -= len(unsent)
        self._holds.pop(request_id, None)
        if active is not None:
            self._release_unsent_hold(active.engine, unsent)
            active.engine.abort(request_id, self)
            self._on_aborted(active.engine)
            if active.span is not None:  # a cancel is the client's choice (a stop string matched, say): no error
                active.span.set_attributes({"kvmesh.cancelled": True, "kvmesh.output_tokens": active.num_output})
            telemetry.end_request_span(active.span, None)

    def _fail(self, request_id: str, code: grpc.StatusCode, message: str, span: Any = None) -> None:
        self._failed.append(
            worker_pb2.GenerateStreamOutput(request_id=request_id, error_code=code.value[0], error_message=message)
        )
        telemetry.end_request_span(span, message)
        self._wakeup.set()

    def _abort_all(self) -> None:
        pulls, self._pulls = self._pulls, {}
        for pull in pulls.values():
            pull.cancel()
        self._reports.clear()
        active, self._active = self._active, {}
        unsent, self._pending = self._pending, {}
        self._unsent = 0
        self._holds.clear()
        for request_id, entry in active.items():
            self._release_unsent_hold(entry.engine, unsent.get(request_id))
            entry.engine.abort(request_id, self)
            self._on_aborted(entry.engine)
            telemetry.end_request_span(entry.span, "the stream ended")

    async def _write_loop(self) -> None:
        write = self._context.write
        while True:
            if not self._pending and not self._failed:
                if (self._input_done or self._stopping) and not self._active:
                    return
                await self._wakeup.wait()
                continue
            pending, self._pending = self._pending, {}
            self._unsent = 0
            message = worker_pb2.GenerateStreamResponse()
            if self._failed:
                message.outputs.extend(self._failed)
                self._failed = []
            active = self._active
            for request_id, outputs in pending.items():
                entry = active.get(request_id)
                if entry is None:  # cancelled while its outputs waited
                    continue
                error_code = outputs[-1].error_code
                if error_code is not None:  # the engine failed it: its tokens, then the status
                    failure = outputs.pop()
                    del active[request_id]
                    self._reports.pop(request_id, None)
                    if outputs:
                        fill_response(message.outputs.add(request_id=request_id).response, outputs,
                                      entry.num_prompt, entry.logprobs)  # fmt: skip
                    code = grpc.StatusCode[error_code]
                    message.outputs.add(
                        request_id=request_id, error_code=code.value[0], error_message=failure.error_message
                    )
                    telemetry.end_request_span(entry.span, failure.error_message)
                    continue
                item = message.outputs.add(request_id=request_id)
                entry.num_output = outputs[-1].num_output_tokens
                if not entry.first_at and entry.num_output:
                    entry.first_token()
                if self._reports:
                    report = self._reports.pop(request_id, None)
                    if report is not None:
                        item.response.kv_report.CopyFrom(report)
                if fill_response(item.response, outputs, entry.num_prompt, entry.logprobs):
                    del active[request_id]
                    entry.finished(item.response)
            if message.outputs:
                await write(message)
                self._written.set()
