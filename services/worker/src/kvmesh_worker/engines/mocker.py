"""``--engine mocker``: simulated vLLM engines (``EngineCore``) driven in real time by ``EngineRunner``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from kvmesh_worker.engine import EngineConfig, EngineCore, PreemptionMode, load_perf_model
from kvmesh_worker.engine_runner import EngineRunner
from kvmesh_worker.engines.api import Role
from kvmesh_worker.kv_transfer.mocker_kv import KvConfig, MockerKv
from kvmesh_worker.kv_transfer.sizing import model_bytes_per_block
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
    role: Role = getattr(settings, "role", "aggregated")
    if role == "aggregated":
        return lambda engine_id: EngineRunner(engine_id, EngineCore(config, perf_model), speedup_ratio)
    kv_config = _kv_config(settings, model, config.block_size)

    def make(engine_id: int) -> EngineRunner:
        core = EngineCore(config, perf_model)
        return EngineRunner(engine_id, core, speedup_ratio, role, MockerKv(engine_id, core, kv_config))

    return make


def _kv_config(settings: Any, model: ModelFiles, block_size: int) -> KvConfig:
    """Arena block size (flag or model-true) and the model-true size the transfer time is modelled with."""
    try:
        config = json.loads(model.files.get("config.json", b"{}"))
    except ValueError:
        config = {}
    true_size = model_bytes_per_block(config if isinstance(config, dict) else {}, block_size)
    if settings.kv_bytes_per_block == "model":
        if true_size is None:
            raise EngineBuildError("--kv-bytes-per-block model: config.json lacks num_hidden_layers/heads/hidden_size")
        stored = true_size
    else:
        stored = int(settings.kv_bytes_per_block)
    arena = stored * settings.num_gpu_blocks * settings.num_engines  # host memory, allocated per engine
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if arena > memory:
        raise EngineBuildError(
            f"--kv-bytes-per-block {stored} x --num-gpu-blocks {settings.num_gpu_blocks} x --num-engines "
            f"{settings.num_engines}: {arena / 2**30:.3g} GiB of KV arena, more than this machine's "
            f"{memory / 2**30:.3g} GiB"
        )
    try:
        import nixl._api  # noqa: F401  (checked here: a missing NIXL is a one-line startup error)
    except ImportError as exc:
        raise EngineBuildError(f"--role {settings.role} needs NIXL (make setup installs it): {exc}") from None
    return KvConfig(
        bytes_per_block=stored,
        model_bytes_per_block=true_size or stored,
        transfer_gbps=settings.kv_transfer_gbps,
        hold_timeout_s=settings.kv_hold_timeout,
        speedup_ratio=settings.speedup_ratio,
    )
