"""The one small interface every connector implements.

A connector owns the *actual* side of the planner: it starts engines, drains them, and says how many
exist per pool (ready or starting) and how many are still starting. Targets are absolute pool sizes, so
applying the same decision twice changes nothing (idempotent), and a connector never scales a pool it
was not asked about.

Scale-down drains, never kills: the planner hands ``apply`` the engines ordered least-loaded first; the
connector stops the chosen ones gracefully (SIGTERM: the worker deregisters at once, so no new request
is routed to it, and finishes in-flight requests before it exits).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh_planner.core.model import Pool


@dataclass(frozen=True, slots=True)
class EngineRef:
    """A registered engine as discovery shows it (what a connector needs to stop it)."""

    engine_id: int
    pool: Pool
    pid: int
    hostname: str
    load: float
    """Lower is drained first: KV utilization + queued prefill share + the router's active requests."""


class Connector(Protocol):
    name: str

    async def start(self) -> None:
        """Adopt what already runs (so a restarted or newly elected planner does not start it twice)."""
        ...

    async def apply(self, decision_id: int, target: Mapping[Pool, int], engines: Sequence[EngineRef]) -> bool:
        """Bring each pool in ``target`` to its size; ``engines`` are the registered ones, least loaded first.

        Returns whether the change was carried out (virtual: the targets published; the orchestrator
        acknowledges later)."""
        ...

    def actual(self) -> dict[Pool, int]:
        """Engines per pool that exist or are starting (draining ones excluded)."""
        ...

    def starting(self, registered_pids: set[int]) -> dict[Pool, int]:
        """Engines per pool started but not registered yet."""
        ...

    def draining(self) -> dict[Pool, int]:
        """Engines per pool stopped but still finishing their requests."""
        ...

    async def close(self) -> None:
        """Stop watching; engines keep running (the planner going away never stops the fleet)."""
        ...
