"""``kvmesh-worker``'s settings, declared once (flags, ``KVMESH_*`` and ``[worker]`` derive from them)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from kvmesh.settings import DaemonSettings, Port
from pydantic import AfterValidator, Field, PositiveInt, model_validator

from kvmesh_worker.engines import registry
from kvmesh_worker.engines.vllm.user_args import parse_engine_args


def _vllm_engine_args(text: str) -> str:
    parse_engine_args(text)
    return text


def _bytes_per_block(value: str) -> str:
    if value != "model" and not (value.isdigit() and int(value) > 0):
        raise ValueError(f"must be a positive number of bytes or 'model', got {value!r}")
    return value


U32_MAX = 2**32 - 1  # model cards and load reports carry these as uint32
Count32 = Annotated[int, Field(ge=1, le=U32_MAX)]
Size32 = Annotated[int, Field(ge=0, le=U32_MAX)]


class Settings(DaemonSettings):
    """The common daemon settings plus the engines this process hosts."""

    engine: Annotated[str, AfterValidator(registry.engine_name)] = "mocker"
    """engine implementation: a registered name (mocker, vllm) or an import path package.module:factory"""
    num_engines: Annotated[int, Field(ge=1, le=10_000)] = 1
    """engines hosted by this process (at most 10000: a typo's 10 million grew memory for minutes, deaf to
    SIGTERM while the engines were built)"""
    grpc_port: Port = 0
    """gRPC port of WorkerService (0 = any free port)"""
    model_path: str | None = None
    """HF-style model directory (tokenizer.json, tokenizer_config.json, config.json); default: the built-in
    kvmesh-mock model"""
    served_model_name: str | None = None
    """model name clients use (default: the model directory's name)"""
    num_gpu_blocks: Count32 = 16384
    """KV cache blocks per engine"""
    block_size: Count32 = 64
    """tokens per KV block"""
    max_num_seqs: Count32 = 256
    """running sequences per engine"""
    max_num_batched_tokens: Count32 = 8192
    """token budget per forward pass"""
    watermark: Annotated[float, Field(ge=0)] = 0.01
    """fraction of KV blocks kept free when admitting"""
    preemption_mode: Literal["lifo", "fifo"] = "lifo"
    """which running request is preempted when blocks run out"""
    enable_chunked_prefill: bool = True
    """split long prompts across passes"""
    max_model_len: Size32 = 0
    """longest prompt + max_tokens accepted (0 = what the cache can hold)"""
    max_waiting_requests: Size32 = 512
    """waiting-queue bound per engine; beyond it RESOURCE_EXHAUSTED at once (default: 2 x max_num_seqs, so
    queueing adds about two batches' worth of latency, never minutes; 0 = unbounded)"""

    @model_validator(mode="before")
    @classmethod
    def _waiting_bound_follows_max_num_seqs(cls, data: Any) -> Any:
        """A production engine sheds load rather than queue without bound (issue 14 item 8)."""
        if isinstance(data, dict) and "max_waiting_requests" not in data and "max_num_seqs" in data:
            try:
                return {**data, "max_waiting_requests": 2 * int(data["max_num_seqs"])}
            except (TypeError, ValueError, OverflowError):  # e.g. TOML's inf
                return data  # the max_num_seqs field reports its own error
        return data

    speedup_ratio: Annotated[float, Field(ge=0)] = 1.0
    """simulated time runs this many times faster than real time (0 = no sleeping)"""
    perf_model: str = "polynomial"
    """'polynomial' (Dynamo's constants) or a path to an NPZ profile"""
    event_buffer_size: PositiveInt = 1024
    """recent KV events kept per engine for subscribers that resume"""
    stream_interval: PositiveInt = 1
    """after a request's first token, send its tokens once at least this many are new (and at its end):
    fewer, larger messages, less CPU per token on every hop, burstier inter-token latency (vLLM's
    --stream-interval; a request's sampling_parameters.stream_interval can raise it, never lower it)"""
    vllm_engine_args: Annotated[str, AfterValidator(_vllm_engine_args)] = "{}"
    """--engine vllm: a JSON object of vLLM engine arguments (AsyncEngineArgs fields, i.e. vllm serve's
    flags with '_' for '-'), e.g. '{"dtype": "float32", "max_model_len": 2048}'; --block-size,
    --max-num-seqs, --max-num-batched-tokens, --stream-interval, --max-model-len and --num-gpu-blocks
    (num_gpu_blocks_override) map to vLLM's own when given; the worker owns model, kv_events_config,
    skip_tokenizer_init, enable_prefix_caching and disable_log_stats (see docs/vllm.md)"""

    # -- disaggregated serving (docs/disaggregation.md); kept together ------------------------------
    role: Literal["aggregated", "prefill", "decode"] = "aggregated"
    """what this worker's engines do: aggregated (prefill + decode), prefill (compute prompts, hold their KV
    for a decode engine), decode (pull prompt KV from prefill engines; prefills locally when told to)"""
    kv_bytes_per_block: Annotated[str, AfterValidator(_bytes_per_block)] = "4096"
    """bytes of one KV block in the host-memory arena (prefill/decode roles): a number, or 'model' for the
    model-true size from config.json (layers x 2 x kv_heads x head_dim x dtype bytes x block_size)"""
    kv_transfer_gbps: Annotated[float, Field(ge=0)] = 0.0
    """modelled KV transfer bandwidth, GB/s: decode starts after max(real NIXL time, model-true bytes / this);
    0 = real time only"""
    kv_hold_timeout: Annotated[float, Field(ge=1, le=86400)] = 30.0
    """seconds a prefill engine holds a prompt's KV for a decode engine that never releases it (at least 1: a
    decode engine starts no pull of a hold with under 0.5 s left, so a shorter one made every pull fail)"""
