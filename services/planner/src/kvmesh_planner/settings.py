"""``kvmesh-planner``'s settings, declared once (flags, ``KVMESH_*`` and ``[planner]`` derive from them)."""

from __future__ import annotations

from typing import Annotated, Literal

from kvmesh.settings import DaemonSettings, Port
from pydantic import AfterValidator, Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from kvmesh_planner.core.predictors import PREDICTORS


def _predictor(name: str) -> str:
    if name not in PREDICTORS:
        raise ValueError(f"unknown predictor {name!r} (expected {', '.join(PREDICTORS)})")
    return name


class Settings(DaemonSettings):
    """The common daemon settings plus what the planner watches, decides and acts through."""

    grpc_port: Port = 0
    """gRPC port of PlannerService (0 = any free port)"""
    connector: Literal["local", "systemd", "virtual"] = "virtual"
    """how decisions are carried out: start/stop kvmesh-worker processes (local), kvmesh-worker@N.service
    units (systemd), or publish the targets for an outside orchestrator (virtual)"""
    mode: Literal["load", "sla"] = "load"
    """load: Dynamo's load thresholds, +-1 steps; sla: predicted traffic through the engine profile
    (implied by --ttft-ms / --itl-ms)"""
    load_profile: Literal["throughput", "latency"] = "throughput"
    """load mode thresholds: throughput (KV 1.0 / 0.6, prefill 1.0 / 0.1) or latency (0.4 / 0.1, 0.1 / 0)"""
    ttft_ms: PositiveFloat | None = None
    """TTFT target in ms (sets --mode sla)"""
    itl_ms: PositiveFloat | None = None
    """ITL target in ms (sets --mode sla)"""
    sla_headroom: Annotated[float, Field(gt=0, le=1)] = 0.7
    """SLA mode plans mean latencies at this fraction of the targets"""
    predictor: Annotated[str, AfterValidator(_predictor)] = "kalman"
    """SLA mode predictor: constant, moving_average or kalman"""
    lookahead: Annotated[float, Field(ge=0)] = 0.0
    """SLA mode: also size the pool for the rate predicted this many seconds past the next interval (the
    predictor's trend; about the engines' start-up time minus one interval)"""
    profile: str = "mocker-polynomial"
    """engine performance profile: mocker-polynomial (built in) or a path to an NPZ profile"""
    interval: PositiveFloat = 10.0
    """seconds between decisions"""
    min_engines: NonNegativeInt = 1
    """smallest aggregated pool"""
    max_engines: PositiveInt = 8
    """largest aggregated pool, and the total engine budget"""
    scale_down_cooldown: Annotated[float, Field(ge=0)] = 60.0
    """seconds from a pool's last change to its next scale-down"""
    scale_up_cooldown: Annotated[float, Field(ge=0)] = 0.0
    """seconds between two scale-ups of a pool"""
    down_confirmations: PositiveInt = 3
    """load mode: consecutive intervals the scale-down condition must hold"""
    worker_args: str = ""
    """local connector: extra arguments for each kvmesh-worker it starts (shell-quoted)"""
    worker_command: str = "kvmesh-worker"
    """local connector: the worker executable"""
    systemctl: str = "systemctl"
    """systemd connector: the systemctl executable (systemctl --user: 'systemctl --user')"""
    unit_template: str = "kvmesh-worker@.service"
    """systemd connector: the template unit whose instances are the engines"""
    startup_timeout: PositiveFloat = 120.0
    """seconds an engine may take from start to registration before it counts as failed"""
    ack_timeout: PositiveFloat = 1800.0
    """virtual connector: seconds to wait for the orchestrator's acknowledgement before deciding again"""

    @model_validator(mode="after")
    def _sla_targets(self) -> Settings:
        if (self.ttft_ms is None) != (self.itl_ms is None):
            raise ValueError("--ttft-ms and --itl-ms go together")
        if self.mode == "sla" and self.ttft_ms is None:
            raise ValueError("--mode sla needs --ttft-ms and --itl-ms")
        if self.min_engines > self.max_engines:
            raise ValueError("--min-engines is above --max-engines")
        return self

    @property
    def effective_mode(self) -> Literal["load", "sla"]:
        return "sla" if self.ttft_ms is not None else self.mode
