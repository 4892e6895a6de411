"""One inference request end to end: contract → model → prompt tokens → generation → responses.

:meth:`Frontend.infer` is what both ModelInfer and ModelStreamInfer run. It raises
:class:`~kvmesh_frontend.errors.FrontendError` for anything a client should see and turns any
other exception into INTERNAL naming the request id (the id also tags every log line of the
request through ``kvmesh.telemetry.request_id_var``), with nothing of the exception's text: that
goes to the log. Metrics and per-model statistics are recorded exactly once per request, whatever
the outcome. A streamed request whose final response was handed to the writer counts as a success
even if the client cancels while that response is being written: the client cancels because it has
what it asked for.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import cast

from inference import grpc_service_pb2 as pb
from kvmesh import telemetry
from kvmesh.telemetry import request_id_var
from kvmesh.v1 import worker_pb2

from kvmesh_frontend.admission import Admission
from kvmesh_frontend.errors import FrontendError, clip, internal, invalid, not_found
from kvmesh_frontend.generation import GenerationState, Generator, PreparedRequest
from kvmesh_frontend.llm_request import PARAM_WORKER_ID, LlmRequest, parse_llm_request
from kvmesh_frontend.metrics import UNKNOWN_MODEL, FrontendMetrics
from kvmesh_frontend.models import MODEL_VERSION, ModelEntry, ModelRegistry
from kvmesh_frontend.prompt_tokens import PromptTokens
from kvmesh_frontend.responses import Response, ResponseWriter
from kvmesh_frontend.tokenization import ChatTemplateError, ModelTokenizer, PromptTooLong

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams default
_THREAD_TOKENIZE_CHARS = 16_384  # longer prompts are tokenized off the event loop


@dataclass(slots=True)
class ModelStats:
    """Cumulative per-model statistics for ModelStatistics (Triton's shape, kvmesh's numbers)."""

    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    last_inference_ms: int = 0
    # Phases of successful requests (Triton's queue / compute_* shape): perf_analyzer picks the model
    # version whose queue count grew during its window, so without them it finds none.
    input_ns: int = 0  # arrival -> prompt tokenized and checked
    queue_ns: int = 0  # prompt ready -> first token (routing, engine queue, prefill)
    infer_ns: int = 0  # first token -> last response


class Frontend:
    """Serves LLM requests over the model registry, the router and the engines."""

    def __init__(
        self,
        registry: ModelRegistry,
        generator: Generator,
        metrics: FrontendMetrics,
        id_prefix: str,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        admission_factor: float = 0.0,
    ) -> None:
        self.registry = registry
        self.generator = generator
        self.metrics = metrics
        self.default_max_tokens = default_max_tokens
        self.admission = Admission(admission_factor)
        self.stats: dict[str, ModelStats] = {}
        self._prefix = id_prefix
        self._ids = itertools.count(1)

    def new_request_id(self) -> str:
        return f"{self._prefix}-{next(self._ids):x}"

    def admit(self, request: pb.ModelInferRequest, *, unary: bool) -> tuple[bool, FrontendError | None]:
        """At the gRPC entry, before the request is even looked at: ``(counted, refusal)``.

        ``refusal`` is the RESOURCE_EXHAUSTED to answer at once when the model is at its in-flight
        bound (:mod:`kvmesh_frontend.admission`); it is recorded here, as a finished request. When
        ``counted``, the caller calls :meth:`release` with the same name once the request ends. A name
        without a live engine is not counted: :meth:`infer` answers it (NOT_FOUND, UNAVAILABLE).
        """
        entry = self.registry.get(request.model_name)
        if entry is None or not entry.cards:
            return False, None
        start = time.perf_counter()
        refusal = self.admission.enter(entry)
        if refusal is None:
            return True, None
        self.metrics.admission_rejected(entry.name)
        end = time.perf_counter()
        self.metrics.finished(entry.name, refusal.code.name.lower(), end - start)
        self._record(entry.name, False, (start, end, end, end))
        _trace_refusal(request, refusal, unary)
        return False, refusal

    def release(self, model_name: str) -> None:
        self.admission.leave(model_name)

    def refused(self, request: pb.ModelInferRequest, error: FrontendError, *, unary: bool) -> None:
        """Count (and trace) a request refused before :meth:`infer` (a draining frontend, bytes that do not
        parse), as every other ends: under its model when known here, else UNKNOWN_MODEL."""
        _trace_refusal(request, error, unary)
        model_name = request.model_name
        known = self.registry.get(model_name) is not None
        self.metrics.finished(model_name if known else UNKNOWN_MODEL, error.code.name.lower(), 0.0)
        if known:
            now = time.perf_counter()
            self._record(model_name, False, (now, now, now, now))

    async def infer(
        self, request: pb.ModelInferRequest, *, unary: bool, deadline_passed: Callable[[], bool] = lambda: False
    ) -> AsyncGenerator[Response, None]:
        """The responses of one request: one ModelInferResponse when ``unary``, else ModelStreamInferResponses.

        ``deadline_passed``: whether the call's deadline is what cancelled it (a ModelInfer's timeout): it
        counts as ``deadline_exceeded``, an error, not as the client's own cancel.
        """
        start = time.perf_counter()
        request_id = self.new_request_id()
        request_id_var.set(request_id)
        # One trace per request: a new root on a stream (many requests share one call), the RPC's
        # span for ModelInfer. Its phases: parse, tokenize, route (generation.py), first_token, finish.
        wall = time.time()
        span = telemetry.start_span(
            "kvmesh.frontend/request",
            root=not unary,
            server=True,
            attributes={
                "kvmesh.request_id": request_id,
                "kvmesh.model": clip(request.model_name),  # client strings, bounded as messages echo them
                "kvmesh.client_request_id": clip(request.id),
                "rpc.method": "ModelInfer" if unary else "ModelStreamInfer",
            },
        )
        telemetry.request_span_var.set(span)
        phase = telemetry.start_span("parse", span)
        # A model known here keeps its label even while it has no live engine (its outage must show on
        # its own series); a name never served is UNKNOWN_MODEL, so labels stay bounded.
        label = request.model_name if self.registry.get(request.model_name) is not None else UNKNOWN_MODEL
        outcome = "success"
        model_metrics = None
        writer: ResponseWriter | None = None
        state: GenerationState | None = None
        first_token_at = 0.0
        prepared_at = 0.0
        final_sent = False
        try:
            # first, like Triton: an unknown model (or version) beats bad tensors
            entry = self.registry.resolve(request.model_name, request.model_version)
            label = entry.name
            model_metrics = self.metrics.model(label)
            model_metrics.inflight.inc()
            llm = parse_llm_request(request, unary=unary, context_length=entry.context_length, model=entry.name)
            telemetry.end_span(phase)
            phase = telemetry.start_span("tokenize", span)
            tokenizer = await self.registry.tokenizer(entry)
            prompt, prompt_text = await self._prompt(llm, entry, tokenizer)
            prepared = self._prepare(request_id, llm, entry, prompt)
            prepared_at = time.perf_counter()
            telemetry.end_span(phase, attributes={"kvmesh.prompt_tokens": len(prompt)})
            phase = telemetry.start_span("first_token", span)
            model_metrics.input_tokens.observe(len(prompt))
            state = GenerationState()
            writer = ResponseWriter(
                llm, tokenizer, prompt, prompt_text, state, model_version=MODEL_VERSION, unary=unary
            )
            # Closing the generation (here, or when the client goes away while a response is being
            # written) cancels its engine request and frees its router booking.
            # generate() is an async generator, annotated AsyncIterator in generation.py (owned by
            # its rewrite): the cast lets aclosing see aclose(), and turns redundant once it says so.
            generation = cast(
                "AsyncGenerator[worker_pb2.GenerateResponse, None]", self.generator.generate(prepared, state)
            )
            async with aclosing(generation) as engine:
                async for engine_response in engine:
                    if not first_token_at and engine_response.token_ids:
                        first_token_at = time.perf_counter()
                        model_metrics.ttft.observe(first_token_at - start)
                        telemetry.end_span(phase, attributes={"kvmesh.engine_id": f"{state.engine_id:x}"})
                        phase = telemetry.start_span("finish", span)
                    responses = writer.on_engine(engine_response)
                    for index, response in enumerate(responses):
                        final_sent = not unary and writer.done and index == len(responses) - 1
                        yield response
                    if writer.done:
                        break
            if not writer.done:  # pragma: no cover - the generator always ends with a final response
                raise internal(f"request {request_id}: the engine stream ended without a final response")
            model_metrics.cached_tokens.observe(state.cached_tokens)
        except FrontendError as exc:
            outcome = exc.code.name.lower()
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "success" if final_sent else "deadline_exceeded" if deadline_passed() else "cancelled"
            raise
        except Exception as exc:
            outcome = "internal"
            log.exception("request %s failed", request_id)
            raise internal(
                f"request {request_id}: internal error ({type(exc).__name__}; details in the frontend log)"
            ) from exc
        finally:
            end = time.perf_counter()
            if span is not None:
                error = None if outcome in ("success", "cancelled") else outcome
                telemetry.end_span(phase, error)
                telemetry.end_span(
                    span,
                    error,
                    {
                        "kvmesh.outcome": outcome,
                        "kvmesh.duration_s": end - start,
                        "kvmesh.output_tokens": writer.num_output_tokens if writer is not None else 0,
                        "kvmesh.engine_id": f"{state.engine_id:x}" if state is not None else "",
                        "kvmesh.cached_tokens": state.cached_tokens if state is not None else 0,
                        "kvmesh.migrations": state.migrations if state is not None else 0,
                    },
                    end_time=wall + (end - start),
                )
            self.metrics.finished(label, outcome, end - start)
            if model_metrics is not None:
                model_metrics.inflight.dec()
                if writer is not None and writer.num_output_tokens:
                    model_metrics.output_tokens.observe(writer.num_output_tokens)
                    if writer.num_output_tokens > 1 and first_token_at:
                        model_metrics.itl.observe((end - first_token_at) / (writer.num_output_tokens - 1))
                phases = (start, prepared_at or end, first_token_at or end, end)
                self._record(label, outcome == "success", phases)

    def _record(self, model: str, success: bool, phases: tuple[float, float, float, float]) -> None:
        start, prepared, first, end = phases
        ns = int((end - start) * 1e9)
        stats = self.stats.get(model)
        if stats is None:
            stats = self.stats[model] = ModelStats()
        if success:
            stats.success_count += 1
            stats.success_ns += ns
            stats.input_ns += int((prepared - start) * 1e9)
            stats.queue_ns += int((max(first, prepared) - prepared) * 1e9)
            stats.infer_ns += int((end - max(first, prepared)) * 1e9)
        else:
            stats.fail_count += 1
            stats.fail_ns += ns
        stats.last_inference_ms = int(time.time() * 1000)

    async def _prompt(
        self, llm: LlmRequest, entry: ModelEntry, tokenizer: ModelTokenizer | None
    ) -> tuple[PromptTokens, str]:
        """Prompt token ids and prompt text (the text only when the output repeats the prompt)."""
        if tokenizer is None and llm.sampling.stop:
            raise invalid(
                f"input 'sampling_parameters': 'stop' strings are matched on text, and model '{entry.name}' serves "
                "no tokenizer; send 'stop_token_ids' instead"
            )
        if llm.input_ids is not None:
            prompt = llm.input_ids
            if entry.vocab_size and prompt.max_id() >= entry.vocab_size:  # the loop only names the culprit
                for i, token in enumerate(prompt):
                    if token >= entry.vocab_size:
                        raise invalid(
                            f"input 'input_ids': token id {token} at index {i} is outside the vocabulary "
                            f"[0, {entry.vocab_size}) of model '{entry.name}'"
                        )
            text = "" if llm.exclude_input or tokenizer is None else tokenizer.decode(prompt.tolist())
            return prompt, text
        if tokenizer is None:
            raise invalid(
                f"input '{llm.prompt_input}': model '{entry.name}' serves no tokenizer; send 'input_ids' instead"
            )
        if llm.messages is not None:
            if not tokenizer.has_chat_template:
                raise invalid(f"input 'messages': model '{entry.name}' has no chat template; send 'text_input'")
            try:
                text = tokenizer.render_chat(llm.messages)
            except ChatTemplateError as exc:
                raise invalid(f"input 'messages': {exc}") from None
            add_special = False  # the template already wrote BOS and friends
        else:
            text = llm.text or ""
            add_special = True
        limit = entry.context_length
        if len(text) > _THREAD_TOKENIZE_CHARS:
            try:
                ids = await asyncio.to_thread(tokenizer.encode, text, add_special, max(limit - 1, 0))
            except PromptTooLong as exc:
                raise invalid(
                    f"input '{llm.prompt_input}': the prompt has {exc.at_least} tokens or more; model "
                    f"'{entry.name}' allows at most {limit - 1} (context length {limit})"
                ) from None
        else:
            ids = tokenizer.encode(text, add_special)
        if not ids:
            raise invalid(f"input '{llm.prompt_input}': the prompt is empty (0 tokens)")
        return PromptTokens.of(ids), text

    def _prepare(self, request_id: str, llm: LlmRequest, entry: ModelEntry, prompt: PromptTokens) -> PreparedRequest:
        sampling = llm.sampling
        num_prompt = len(prompt)
        limit = entry.context_length
        if limit and num_prompt >= limit:
            raise invalid(
                f"input '{llm.prompt_input}': the prompt has {num_prompt} tokens; model '{entry.name}' allows at most "
                f"{limit - 1} (context length {limit})"
            )
        max_tokens = sampling.max_tokens
        if max_tokens is None:
            max_tokens = self.default_max_tokens if not limit else min(self.default_max_tokens, limit - num_prompt)
            if sampling.min_tokens > max_tokens:  # vLLM refuses it too; clamping it would be silent
                raise invalid(
                    f"min_tokens ({sampling.min_tokens}) must not exceed max_tokens ({max_tokens}, the default "
                    "here): set max_tokens"
                )
        elif limit and num_prompt + max_tokens > limit:
            raise invalid(
                f"max_tokens {max_tokens} + prompt of {num_prompt} tokens exceeds the context length {limit} of model "
                f"'{entry.name}' (at most {limit - num_prompt} new tokens)"
            )
        if llm.pinned_engine_id is not None and llm.pinned_engine_id not in entry.cards:
            # hex, as kvmesh status and the router show them; the parameter takes the "0x..." strings back
            engines = ", ".join(f"{e:#x}" for e in sorted(entry.cards))
            raise not_found(
                f"parameter '{PARAM_WORKER_ID}': engine {llm.pinned_engine_id:#x} does not serve model "
                f"'{entry.name}' (its engines: {engines})"
            )
        options = worker_pb2.SamplingOptions(
            max_tokens=max_tokens,
            ignore_eos=sampling.ignore_eos,
            stop_token_ids=sampling.stop_token_ids,
            temperature=1.0 if sampling.temperature is None else sampling.temperature,
            top_p=1.0 if sampling.top_p is None else sampling.top_p,
            top_k=sampling.top_k or 0,
            min_tokens=sampling.min_tokens,
        )
        if sampling.seed is not None:
            options.seed = sampling.seed
        if not llm.stream and not sampling.stop:
            # The client gets one response, when the request ends: the engine's first token (TTFT, the
            # router's prefill mark) and its last output are all the frontend needs. Stop strings are
            # matched on the text as it arrives, so a request with them keeps the per-token stream.
            options.stream_interval = max_tokens
        elif sampling.stream_interval is not None:
            options.stream_interval = sampling.stream_interval
        if llm.wants("logprobs") and sampling.logprobs is not None:
            options.logprobs = sampling.logprobs
        elif llm.wants("cumulative_logprob"):
            options.logprobs = 0  # the sum needs each token's logprob, not the alternatives
        block_size = entry.block_size
        if llm.pinned_engine_id is not None:  # at its own block size, which may not be the model's
            block_size = entry.cards[llm.pinned_engine_id].block_size
        hashes = prompt.block_hashes(block_size) if block_size else []
        return PreparedRequest(
            request_id=request_id,
            model=entry.name,
            prompt=prompt,
            block_hashes=hashes,
            block_size=block_size,
            max_tokens=max_tokens,
            sampling=options,
            pinned_engine_id=llm.pinned_engine_id,
            router_mode=llm.router_mode,
            router_policy=llm.router_policy,
        )


def _trace_refusal(request: pb.ModelInferRequest, error: FrontendError, unary: bool) -> None:
    """A request refused at the entry is a trace too (one span, failed), as every request is: load shed
    at the admission bound showed in the metrics but not in a trace backend."""
    if not telemetry.tracing_enabled():
        return
    span = telemetry.start_span(
        "kvmesh.frontend/request",
        root=not unary,
        server=True,
        attributes={
            "kvmesh.model": clip(request.model_name),
            "kvmesh.client_request_id": clip(request.id),
            "rpc.method": "ModelInfer" if unary else "ModelStreamInfer",
            "rpc.grpc.status_code": error.code.value[0],
        },
    )
    telemetry.end_span(span, error.in_band())
