"""The replica's routing settings (from flags; the settings rewrite owns this class's content).

Invariant: immutable once built; :class:`~kvmesh_router.state.RouterState` reads it only at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh_router.cost import MODES

__all__ = ["DEFAULT_COST_POLICY", "RouterSettings"]

# The daemon's kv cost policy: kvmesh's "affinity" beats Dynamo's cost on the Mooncake trace at low and
# high load (docs/benchmarks.md); "dynamo" stays selectable (--cost-policy, or per request).
DEFAULT_COST_POLICY = "affinity"


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """The routing policy of one replica (from flags; see ``kvmesh_router.main``)."""

    mode: str = "kv"
    cost_policy: str = DEFAULT_COST_POLICY
    overlap_weight: float = 1.0
    temperature: float = 0.0
    busy_prefill_tokens: int | None = None
    busy_prefill_frac: float | None = None
    busy_kv_usage: float | None = None
    kv_events: bool = True
    index_max_blocks: int | None = None  # None = unbounded
    approx_ttl_s: float = 120.0
    booking_ttl_s: float = 300.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES or self.mode == "direct":
            raise ValueError(f"router mode must be one of kv, round_robin, random, power_of_two; got {self.mode!r}")
