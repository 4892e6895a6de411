"""The router's settings, declared once: the routing policy (:class:`RouterSettings`, what the core and
the benches construct) and the daemon's settings derived from it (:class:`Settings`: flags,
``KVMESH_*`` variables and the ``[router]`` TOML table, see :mod:`kvmesh.settings`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from kvmesh.settings import DaemonSettings, Port, Seconds
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PositiveFloat, PositiveInt

from kvmesh_router.admission import BusyThresholds
from kvmesh_router.cost import MAX_WEIGHT
from kvmesh_router.indexer import DEFAULT_MAX_ENTRIES
from kvmesh_router.policies import DEFAULT_COST_POLICY, POLICIES


def _off_is_none(value: Any) -> Any:
    """'none'/'off'/'' turn a threshold off (flags and env are text)."""
    return None if isinstance(value, str) and value.strip().lower() in {"", "none", "off"} else value


def _registered_cost_policy(name: str) -> str:
    """A cost policy of the registry (built-ins and any registered plug-in)."""
    if not POLICIES.has_cost_policy(name):
        raise ValueError(f"unknown cost policy {name!r}: choose {', '.join(POLICIES.cost_policies)}")
    return name


def _zero_is_none(value: Any) -> Any:
    return None if value in (0, "0") else _off_is_none(value)


MaxBlocks = Annotated[PositiveInt | None, BeforeValidator(_zero_is_none)]
OptionalFraction = Annotated[Annotated[float, Field(ge=0)] | None, BeforeValidator(_off_is_none)]
OptionalPositiveFraction = Annotated[Annotated[float, Field(gt=0)] | None, BeforeValidator(_off_is_none)]


class RouterSettings(BaseModel):
    """The routing policy of one replica; constructing it reads nothing (benches build it directly)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, validate_by_name=True)

    mode: Literal["kv", "round_robin", "random", "power_of_two"] = Field(default="kv", alias="router_mode")
    """how engines are picked when a query does not pin one"""
    cost_policy: Annotated[str, AfterValidator(_registered_cost_policy)] = DEFAULT_COST_POLICY
    """kv cost function: 'affinity' (kvmesh's, backlog-discounted prefix affinity) or 'dynamo' (Dynamo's
    overlap-weighted prefill + decode blocks); see docs/benchmarks.md for the measured difference"""
    overlap_weight: Annotated[float, Field(ge=0, le=MAX_WEIGHT)] = 1.0
    """weight of prefill blocks against decode blocks in the kv cost"""
    temperature: Annotated[float, Field(ge=0)] = 0.0
    """softmax temperature of kv selection (0 = cheapest engine)"""
    busy_prefill_tokens: Annotated[Annotated[int, Field(ge=0)] | None, BeforeValidator(_off_is_none)] = None
    """an engine with more booked prefill tokens is busy ('none' = off)"""
    busy_prefill_frac: OptionalFraction = None
    """busy with more booked, not yet prefilled prompt tokens than this many forward passes hold (x the
    engine's max_num_batched_tokens; 'none' = off: long-context bursts would trip any fixed value, and the
    engine's bounded waiting queue already sheds by count)"""
    busy_kv_usage: OptionalFraction = 0.95
    """busy above this fraction of the engine's KV blocks in use ('none' = off); a query is REJECTED
    (RESOURCE_EXHAUSTED, at once) only when every eligible engine is busy"""
    busy_requests: OptionalPositiveFraction = 1.0
    """busy when the engine's booked requests reach this fraction of what it holds (max_num_seqs +
    max_waiting_requests, from its card; engines with an unbounded queue never are; 'none' = off; above 0:
    at 0 every engine, idle or not, would be busy): at 1.0 no request is sent to an engine whose waiting
    queue would refuse it"""
    kv_events: bool = True
    """follow the engines' KV events (--no-kv-events: approximate mode, the router's own decisions become
    predicted cached blocks with a TTL)"""
    index_max_blocks: MaxBlocks = None
    """cap on (engine, block) entries in the prefix index (0 or 'none' = unbounded)"""
    approx_ttl_s: PositiveFloat = Field(default=120.0, alias="approx_ttl")
    """approximate mode: seconds a predicted block lives"""
    booking_ttl_s: PositiveFloat = Field(default=300.0, alias="booking_ttl")
    """seconds after which a booking with no FINISHED is dropped (lost-update backstop)"""
    seed: int | None = None
    """seed of the router's random choices (tie-breaks, random modes); default: random"""
    disagg_min_tokens: Annotated[int, Field(ge=0)] = 0
    """conditional disaggregation: prefill remotely only when the prompt minus the decode engine's cached
    prefix exceeds this many tokens; shorter ones are prefilled on the decode engine"""
    prefill_backlog_tokens: Annotated[Annotated[int, Field(ge=0)] | None, BeforeValidator(_off_is_none)] = 65536
    """disaggregation: a prefill engine with more booked, not yet computed prompt tokens is busy; when every
    prefill engine is, requests prefill on their decode engine (or are refused, frontend --disagg-busy reject)
    ('none' = unbounded)"""

    def busy_thresholds(self) -> BusyThresholds:
        """The busy filter's thresholds these settings declare."""
        return BusyThresholds(
            self.busy_prefill_tokens,
            self.busy_prefill_frac,
            self.busy_kv_usage,
            self.prefill_backlog_tokens,
            self.busy_requests,
        )


class Settings(DaemonSettings, RouterSettings):
    """``kvmesh-router``: the common daemon settings, the routing policy, and these."""

    index_max_blocks: MaxBlocks = DEFAULT_MAX_ENTRIES
    """cap on (engine, block) entries in the prefix index (0 or 'none' = unbounded); a daemon is bounded
    by default, the core (benches) is not"""
    grpc_port: Port = 0
    """gRPC port of RouterService (0 = any free port)"""
    replica_sync: bool = True
    """exchange active-load bookings with the other router replicas"""
    sync_queue_size: PositiveInt = 10_000
    """booking events queued per replica link before the link is cut and re-synced"""
    warmup_timeout: Seconds = 10.0
    """longest wait, per phase, for engines' snapshots and peers' bookings before SERVING"""
