"""The mocker engine core: a deterministic, synchronous, I/O-free simulated vLLM engine.

Drive it with ``add_request`` / ``abort_request`` and ``step()``; see ``core.py`` for the contract
and ``scheduler.py`` / ``block_manager.py`` for the vLLM semantics it reproduces.
"""

from .api import (
    DuplicateRequest,
    EngineError,
    EngineLoad,
    EngineRequest,
    FinishReason,
    ForwardPassMetrics,
    InvalidRequest,
    KvSource,
    QueueFull,
    RequestOutput,
    Sampling,
    StepOutput,
)
from .config import EngineConfig, EngineMode, PreemptionMode
from .core import EngineCore
from .perf_model import InterpolatedPerfModel, PerfModel, PolynomialPerfModel, load_perf_model

__all__ = [
    "DuplicateRequest",
    "EngineConfig",
    "EngineCore",
    "EngineError",
    "EngineLoad",
    "EngineMode",
    "EngineRequest",
    "FinishReason",
    "ForwardPassMetrics",
    "InterpolatedPerfModel",
    "InvalidRequest",
    "KvSource",
    "PerfModel",
    "PolynomialPerfModel",
    "PreemptionMode",
    "QueueFull",
    "RequestOutput",
    "Sampling",
    "StepOutput",
    "load_perf_model",
]
