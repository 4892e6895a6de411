"""The engine core's public value types: what goes in (requests), what comes out (steps, loads, dumps), and errors.

Plain dataclasses with no behaviour, so the gRPC shell and the offline replay can translate them
without depending on scheduler internals. The per-step types (RequestOutput, ForwardPassMetrics,
StepOutput) are slotted but not frozen because a frozen dataclass costs about 6x more to construct
and the engine builds one per request per pass: treat them as read-only. The exceptions are typed so
that a shell can map them to status codes: InvalidRequest -> INVALID_ARGUMENT, QueueFull ->
RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

import numpy as np
from kvmesh.kv_events import KvEvent

FinishReason = Literal["length", "stop", "abort"]


class EngineError(Exception):
    """Base of the errors the engine raises at a caller."""


class InvalidRequest(EngineError, ValueError):
    """The request can never be served as given; the message names the limit it breaks."""


class DuplicateRequest(InvalidRequest):
    """A request with this id is already in the engine."""


class QueueFull(EngineError):
    """The waiting queue is at ``EngineConfig.max_waiting_requests``; retry later or elsewhere."""


class KvSource(StrEnum):
    """Where a request's prompt KV comes from (the seam for disaggregated serving)."""

    COMPUTE = "compute"  # prefill it here (aggregated and prefill-only engines)
    TRANSFER = "transfer"  # it arrives from a prefill engine (decode-only engines; not implemented yet)


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling controls beyond what the mocker models (it ignores them but ``min_tokens``, which holds off
    its stop tokens; a real engine honours them all)."""

    temperature: float = 0.0
    top_p: float = 0.0  # 0 or 1: off
    top_k: int = 0  # 0: off
    min_tokens: int = 0
    seeded: bool = False  # the request named a seed (EngineRequest.seed)
    # SamplingOptions.logprobs: report each sampled token's logprob plus this many top alternatives
    logprobs: int | None = None
    # SamplingOptions.stream_interval (1: every pass). The GenerateStream session holds outputs back
    # itself, for any engine; an engine that batches its own outputs (vLLM) may do it first, for less work.
    stream_interval: int = 1


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One generation request. ``prompt`` may be a list of ints or an integer numpy array (cheaper)."""

    request_id: str
    prompt: Sequence[int] | np.ndarray
    max_tokens: int
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # Same seed + same prompt -> same generated tokens (and so the same generated blocks).
    seed: int = 0
    # Cache namespace (e.g. a LoRA name): requests with different salts never share blocks.
    cache_salt: str | None = None
    kv_source: KvSource = KvSource.COMPUTE
    sampling: Sampling | None = None
    # Disaggregation: after finishing, keep the prompt's blocks for a transfer (engines that move KV).
    hold_kv: bool = False
    # (tokens hashes, sequence hashes) of the prompt's full blocks, when the caller already has them (the
    # offline replay's router hashed the prompt in the engine's block size): trusted, not recomputed.
    # Ignored with a cache_salt (the engine hashes salted prompts itself).
    prompt_hashes: tuple[Sequence[int], Sequence[int]] | None = None


@dataclass(slots=True)
class RequestOutput:
    """What one request produced in one step.

    ``num_output_tokens`` is the request's total so far; ``token_ids`` the ids new in this step
    (empty when the engine runs with ``emit_token_ids=False``). ``num_cached_prompt_tokens`` is set
    on the request's first output only: the prompt tokens found in the prefix cache.
    """

    request_id: str
    token_ids: tuple[int, ...]
    num_output_tokens: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_cached_prompt_tokens: int | None = None
    # Last output of a ``hold_kv`` request: where its KV is held (kvmesh.v1.KvTransferParams; set by the
    # engine shell, never by the I/O-free core).
    kv_transfer: object | None = None
    # Engines that sample a real distribution (e.g. vLLM), when the request asked for logprobs: one
    # kvmesh.v1.TokenLogprobs per token id (set by the engine shell). None: the worker fills the mocker's
    # deterministic stand-ins.
    logprobs: Sequence[object] | None = None
    # Set by an engine shell whose engine failed the request itself (vLLM's retryable "error" finish, e.g.
    # its KV pull broke): the gRPC status name the request ends with in-band, instead of a finish reason.
    # Such an output is the request's last and carries no tokens (those before it are still delivered).
    error_code: str | None = None
    error_message: str = ""


@dataclass(slots=True)
class ForwardPassMetrics:
    """One scheduler pass as the perf model saw it (Dynamo's ``ForwardPassMetrics``, trimmed)."""

    num_prefill_requests: int = 0
    num_decode_requests: int = 0
    # Tokens computed in prefill mode (the perf model's T): uncached prompt tokens, plus the output
    # tokens recomputed with them when a preempted request resumes.
    prefill_tokens: int = 0
    decode_tokens: int = 0
    num_preempted: int = 0
    active_blocks: int = 0  # after this pass's allocations (the perf model's u = active / total)
    duration_ms: float = 0.0

    @property
    def batch_size(self) -> int:
        return self.num_prefill_requests + self.num_decode_requests


@dataclass(slots=True)
class StepOutput:
    """One pass: the requests' new tokens, the KV events it caused, and how long it took."""

    outputs: list[RequestOutput]
    kv_events: list[KvEvent]  # in event-id order
    metrics: ForwardPassMetrics


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """A load snapshot for routers and planners."""

    active_blocks: int  # referenced by requests (Dynamo's kv_used_blocks)
    cached_blocks: int  # inactive: cached, unreferenced, evictable
    total_blocks: int
    num_waiting: int
    num_running: int
    queued_prefill_tokens: int  # prompt tokens not computed yet (waiting + partly prefilled)
