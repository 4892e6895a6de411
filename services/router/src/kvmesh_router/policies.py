"""One registry of routing policies: selectors (one per routing mode) and cost policies (what ``kv`` ranks by).

The shape of Ray Serve's pluggable request routers: a routing decision is a fixed pipeline (candidate
filters -> busy filter -> selector -> booking, :mod:`kvmesh_router.admission`) whose pluggable parts are
looked up here by name, so a new selector or cost policy runs side by side with the built-ins and is
picked globally (``RouterSettings``) or per query (``RouterConfigOverride``) without touching the pipeline.

Invariants:

- a name is registered once per kind; replacing needs ``replace=True`` (no silent shadowing);
- selectors are registered as factories: every :class:`~kvmesh_router.admission.Admission` builds its own
  (round robin keeps a cursor); cost policies are pure and shared;
- the built-ins register themselves when :mod:`kvmesh_router.cost` and :mod:`kvmesh_router.selection` are
  imported; a lookup that misses imports them once before it fails, so the registry is never seen empty.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from kvmesh_router.cost import CostPolicy
    from kvmesh_router.selection import Selector

__all__ = ["DEFAULT_COST_POLICY", "POLICIES", "PolicyRegistry"]

#: What plain ``kv`` ranks by unless the settings or a query say otherwise (the router daemon's default):
#: kvmesh's "affinity" beats Dynamo's cost on the Mooncake trace at low and high load (docs/benchmarks.md);
#: "dynamo" stays selectable (--cost-policy, or per request). Here, not in the settings, so that offline
#: replays need not import the daemon's settings (pydantic, gRPC) to know it.
DEFAULT_COST_POLICY = "affinity"

_T = TypeVar("_T")


class PolicyRegistry:
    """Selectors and cost policies by name; see the module docstring."""

    __slots__ = ("_costs", "_selectors")

    def __init__(self) -> None:
        self._selectors: dict[str, Callable[[], Selector]] = {}
        self._costs: dict[str, CostPolicy] = {}

    # ------------------------------------------------------------------ selectors

    def register_selector(self, name: str, factory: Callable[[], Selector], *, replace: bool = False) -> None:
        """Make ``factory()`` the selector of routing mode ``name``."""
        if name in self._selectors and not replace:
            raise ValueError(f"selector {name!r} is already registered")
        self._selectors[name] = factory

    def make_selector(self, mode: str) -> Selector:
        """A fresh selector for ``mode``."""
        factory = self._selectors.get(mode) or _builtins(self._selectors).get(mode)
        if factory is None:
            raise ValueError(f"unknown routing mode {mode!r}; expected one of {', '.join(self.modes)}")
        return factory()

    def unregister_selector(self, name: str) -> None:
        del self._selectors[name]

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(_builtins(self._selectors))

    # ------------------------------------------------------------------ cost policies

    def register_cost_policy(self, policy: CostPolicy, *, replace: bool = False) -> None:
        """Make ``policy`` selectable as ``cost_policy=policy.name``."""
        if policy.name in self._costs and not replace:
            raise ValueError(f"cost policy {policy.name!r} is already registered")
        self._costs[policy.name] = policy

    def unregister_cost_policy(self, name: str) -> None:
        del self._costs[name]

    def has_cost_policy(self, name: str) -> bool:
        return name in self._costs or name in _builtins(self._costs)

    def cost_policy(self, name: str) -> CostPolicy:
        policy = self._costs.get(name) or _builtins(self._costs).get(name)
        if policy is None:
            raise ValueError(f"unknown cost policy {name!r}; registered: {', '.join(sorted(self._costs))}")
        return policy

    @property
    def cost_policies(self) -> Mapping[str, CostPolicy]:
        """Read-only view of the registered cost policies."""
        return MappingProxyType(_builtins(self._costs))


def _builtins(table: _T) -> _T:
    """``table`` after the built-in policies have registered themselves (a no-op once imported)."""
    import kvmesh_router.cost
    import kvmesh_router.selection  # noqa: F401

    return table


#: The process-wide registry the router daemon, the benches and the tests use.
POLICIES = PolicyRegistry()
