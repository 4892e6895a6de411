"""Engine configuration: one frozen value object, defaults taken from Dynamo's mocker (``MockEngineArgs``).

Frozen so one config can be shared by many engines (a 1000-engine process) and by the replay's
bookkeeping without anyone mutating it underneath the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class EngineMode(StrEnum):
    """What part of a request an engine serves (Dynamo's ``--disaggregation-mode``).

    Only AGGREGATED is implemented. The seams for the other two are documented in ``core.py``:
    PREFILL computes the prompt, emits one token and holds the blocks until the KV transfer is
    released; DECODE receives the prompt's KV by transfer (``KvSource.TRANSFER``) and allocates
    its blocks without prefill compute.
    """

    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"


class PreemptionMode(StrEnum):
    """Which running request gives up its blocks when an allocation fails."""

    LIFO = "lifo"  # the most recently admitted (vLLM v1, Dynamo default)
    FIFO = "fifo"  # the oldest (Dynamo's pre-v1 mocker)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """All engine knobs; every field has Dynamo's mocker default unless noted."""

    num_gpu_blocks: int = 16384
    block_size: int = 64
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # Fraction of the KV cache kept free when admitting a waiting request (blocks = int(watermark * num_gpu_blocks)).
    watermark: float = 0.01
    enable_chunked_prefill: bool = True
    preemption_mode: PreemptionMode = PreemptionMode.LIFO
    # Longest prompt + max_tokens accepted. None: whatever one request can hold alone in the KV cache
    # above the watermark, so an admitted request can always run to completion by itself.
    max_model_len: int | None = None
    # Bound of the waiting queue; add_request raises QueueFull beyond it. None: unbounded.
    max_waiting_requests: int | None = None
    # kvmesh additions: the simulated model's vocabulary (generated ids are drawn from [0, vocab_size)).
    vocab_size: int = 32000
    eos_token_id: int = 2
    mode: EngineMode = EngineMode.AGGREGATED
    # Recent KV events kept for subscribers that resume from an event id (Dynamo: 1024).
    event_journal_size: int = 1024
    # False: StepOutput carries no per-token outputs, only a request's first and final output (with
    # counts); for callers that only need timing (offline replay). Events and timing are identical.
    emit_token_ids: bool = True

    def __post_init__(self) -> None:
        for name in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.vocab_size > 1 << 32:
            raise ValueError(f"vocab_size={self.vocab_size} does not fit token ids in 32 bits")
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(f"eos_token_id={self.eos_token_id} outside vocabulary [0, {self.vocab_size})")
        if self.event_journal_size < 1:
            raise ValueError(f"event_journal_size must be >= 1, got {self.event_journal_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.context_length < 2:
            raise ValueError("the KV cache above the watermark cannot hold even a 2-token request")

    @property
    def watermark_blocks(self) -> int:
        """Blocks that admission keeps free."""
        return int(self.watermark * self.num_gpu_blocks)

    @property
    def context_length(self) -> int:
        """Effective limit on prompt + max_tokens (see ``max_model_len``).

        Capped by what one request can hold alone above the watermark (otherwise it could never be
        admitted or would preempt itself forever) and, without chunked prefill, by the token budget
        (a prompt larger than one pass could never be scheduled).
        """
        limit = (self.num_gpu_blocks - self.watermark_blocks) * self.block_size
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len)
        if not self.enable_chunked_prefill:
            limit = min(limit, self.max_num_batched_tokens)
        return min(limit, 2**32 - 1)  # a uint32 in the model card: 4 billion tokens is no limit anyway
