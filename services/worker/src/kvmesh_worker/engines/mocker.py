"""``--engine mocker``: simulated vLLM engines (``EngineCore``) driven in real time by ``EngineRunner``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvmesh_worker.engine import EngineConfig, EngineCore, PreemptionMode, load_perf_model
from kvmesh_worker.engine_runner import EngineRunner
from kvmesh_worker.model_files import ModelFiles

from .registry import EngineBuildError


def engine_config(settings: Any, model: ModelFiles) -> EngineConfig:
    max_len = settings.max_model_len or (model.max_context or None)
    try:
        return EngineConfig(
            num_gpu_blocks=settings.num_gpu_blocks,
            block_size=settings.block_size,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            watermark=settings.watermark,
            enable_chunked_prefill=settings.enable_chunked_prefill,
            preemption_mode=PreemptionMode(settings.preemption_mode),
            max_model_len=max_len,
            max_waiting_requests=settings.max_waiting_requests or None,
            vocab_size=model.vocab_size,
            eos_token_id=model.eos_token_id,
            event_journal_size=settings.event_buffer_size,
        )
    except ValueError as exc:
        raise EngineBuildError(f"engine configuration: {exc}") from exc


def build(settings: Any, model: ModelFiles) -> Callable[[int], EngineRunner]:
    """Engines with one configuration and perf model (checked and loaded once, shared by all)."""
    config = engine_config(settings, model)
    try:
        perf_model = load_perf_model(settings.perf_model)  # "polynomial" or an .npz path
    except (OSError, ValueError, KeyError) as exc:
        raise EngineBuildError(f"--perf-model {settings.perf_model}: {exc}") from exc
    speedup_ratio = settings.speedup_ratio
    return lambda engine_id: EngineRunner(engine_id, EngineCore(config, perf_model), speedup_ratio)
