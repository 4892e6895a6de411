"""``kvmesh-planner``'s settings, declared once (flags, ``KVMESH_*`` and ``[planner]`` derive from them)."""

from __future__ import annotations

from typing import Annotated, Literal

from kvmesh.settings import DaemonSettings, Port
from pydantic import AfterValidator, Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from kvmesh_planner.core.model import POOLS, Pool
from kvmesh_planner.core.predictors import PREDICTORS


def _pools(text: str) -> str:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in POOLS]
    if not names or unknown:
        raise ValueError(f"unknown pool {unknown[0] if unknown else text!r} (expected a list of {', '.join(POOLS)})")
    if "prefill" in names and "decode" not in names:
        raise ValueError("the prefill pool needs the decode pool (a prefill engine serves decode engines)")
    return ",".join(p for p in POOLS if p in names)


def _template(unit: str) -> str:
    if not unit.endswith("@.service"):
        raise ValueError(f"{unit!r} is not a template unit (NAME@.service)")
    return unit


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
    pools: Annotated[str, AfterValidator(_pools)] = "aggregated"
    """the pools the planner manages, comma-separated: aggregated, prefill, decode (disaggregated serving:
    'prefill,decode'); engines of other roles are left alone"""
    min_engines: PositiveInt = 1
    """smallest aggregated pool (at least 1: a pool of none has no load to observe, so it never grows)"""
    max_engines: PositiveInt = 8
    """largest aggregated pool"""
    min_prefill: PositiveInt = 1
    """smallest prefill pool (at least 1: a pool of none has no load to observe, so it never grows)"""
    max_prefill: PositiveInt = 4
    """largest prefill pool"""
    min_decode: PositiveInt = 1
    """smallest decode pool (at least 1: a pool of none has no load to observe, so it never grows)"""
    max_decode: PositiveInt = 4
    """largest decode pool"""
    engine_budget: NonNegativeInt = 0
    """most engines over every managed pool together; 0 = the sum of their maxima"""
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
    unit_template: Annotated[str, AfterValidator(_template)] = "kvmesh-worker@.service"
    """systemd connector: the template unit whose instances are the aggregated engines"""
    prefill_unit_template: Annotated[str, AfterValidator(_template)] = "kvmesh-worker-prefill@.service"
    """systemd connector: the template unit whose instances are the prefill engines"""
    decode_unit_template: Annotated[str, AfterValidator(_template)] = "kvmesh-worker-decode@.service"
    """systemd connector: the template unit whose instances are the decode engines"""
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
        for pool in self.managed_pools:
            lo, hi = self.pool_bounds(pool)
            if lo > hi:
                flags = (
                    ("--min-engines", "--max-engines") if pool == "aggregated" else (f"--min-{pool}", f"--max-{pool}")
                )
                raise ValueError(f"{flags[0]} is above {flags[1]}")
        if self.engine_budget and self.engine_budget < sum(self.pool_bounds(p)[0] for p in self.managed_pools):
            raise ValueError("--engine-budget is below the sum of the managed pools' minimums")
        return self

    @property
    def managed_pools(self) -> tuple[Pool, ...]:
        return tuple(p for p in POOLS if p in self.pools.split(","))

    def unit_template_of(self, pool: Pool) -> str:
        if pool == "prefill":
            return self.prefill_unit_template
        if pool == "decode":
            return self.decode_unit_template
        return self.unit_template

    def pool_bounds(self, pool: Pool) -> tuple[int, int]:
        """(min, max) engines of one pool."""
        if pool == "prefill":
            return self.min_prefill, self.max_prefill
        if pool == "decode":
            return self.min_decode, self.max_decode
        return self.min_engines, self.max_engines

    @property
    def budget(self) -> int:
        return self.engine_budget or sum(self.pool_bounds(p)[1] for p in self.managed_pools)

    @property
    def effective_mode(self) -> Literal["load", "sla"]:
        return "sla" if self.ttft_ms is not None else self.mode
