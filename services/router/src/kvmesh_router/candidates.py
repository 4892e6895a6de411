"""Candidate filters: which registered engines may serve one query, as a chain of small composable steps.

:class:`~kvmesh_router.admission.Admission` starts from every registered engine (ascending ids) and runs
its filters in order; busy filtering and the selector see only what is left. A filter is a plain
function, so a new restriction is one more entry in the chain (Ray Serve's composable router mixins):

- :func:`allowed_filter`: the query's ``allowed_engines`` (the model's engines) minus ``excluded_engines``;
- :func:`role_filter`: the worker role the query asks for (``RouterPolicyConfig.role``, aggregated
  unless a ``RouterConfigOverride`` says prefill or decode). Disaggregation asks twice, once per role.

Invariants: a filter is pure (no booking, no rng, no clock), keeps the order of its input, and returns its
input unchanged (the same object) when it removes nothing, so the common case allocates nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvmesh_router.admission import RouteRequest
    from kvmesh_router.cost import RouterPolicyConfig

__all__ = ["DEFAULT_FILTERS", "CandidateFilter", "FleetView", "allowed_filter", "role_filter"]


class FleetView(Protocol):
    """What a filter may read about the registered engines (admission implements it)."""

    def __len__(self) -> int: ...

    def with_role(self, role: str) -> frozenset[int]: ...


class CandidateFilter(Protocol):
    def __call__(
        self, engines: Sequence[int], request: RouteRequest, config: RouterPolicyConfig, fleet: FleetView
    ) -> Sequence[int]: ...


def allowed_filter(
    engines: Sequence[int], request: RouteRequest, config: RouterPolicyConfig, fleet: FleetView
) -> Sequence[int]:
    """Keep ``request.allowed_engines`` (None = all), drop ``request.excluded_engines``."""
    allowed, excluded = request.allowed_engines, request.excluded_engines
    if excluded:
        return [e for e in engines if (allowed is None or e in allowed) and e not in excluded]
    if allowed is None or allowed.issuperset(engines):  # one model serving the whole fleet: a C-level check
        return engines
    return [e for e in engines if e in allowed]


def role_filter(
    engines: Sequence[int], request: RouteRequest, config: RouterPolicyConfig, fleet: FleetView
) -> Sequence[int]:
    """Keep the engines whose worker role is ``config.role``."""
    role = fleet.with_role(config.role)
    return engines if len(role) == len(fleet) else [e for e in engines if e in role]


#: The daemon's chain: the query's engines, then its role.
DEFAULT_FILTERS: tuple[CandidateFilter, ...] = (allowed_filter, role_filter)
