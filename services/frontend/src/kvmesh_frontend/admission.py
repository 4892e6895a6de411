"""Admission at the gRPC entry: a per-model bound on the requests in flight at this frontend.

Why here: a request the fleet has no room for used to be parsed, tokenized, hashed, routed, booked,
sent to an engine and refused there by its waiting queue; under overload every hop's event loop is
busy, so that refusal took seconds (issue 14 item 8). The bound is checked on the raw request, before
any of that, so a refused request never reaches a router or a worker.

The bound is ``factor x capacity`` of the model, where capacity is what its serving engines hold at
most: ``sum(max_num_seqs + max_waiting_requests)`` over the live decode (or aggregated) engines, from
their model cards. It follows the fleet as engines come and go. No bound when an engine's queue is
unbounded (``--max-waiting-requests 0``), when a card predates the field, or with ``factor 0``.

Each frontend counts only its own requests: with several frontends the engines' queue bounds and the
router's busy thresholds stay the shared last line (their refusals are slower, not wrong).
"""

from __future__ import annotations

import math

from kvmesh_frontend.errors import FrontendError, exhausted
from kvmesh_frontend.models import ModelEntry


class Admission:
    """Counts the requests in flight per model; :meth:`enter` refuses past the bound, :meth:`leave` frees."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self._inflight: dict[str, int] = {}

    def bound(self, entry: ModelEntry) -> int:
        """The model's in-flight bound at this frontend (0 = none)."""
        if not self.factor or not entry.capacity:
            return 0
        return max(1, math.ceil(self.factor * entry.capacity))

    def enter(self, entry: ModelEntry) -> FrontendError | None:
        """Count one request of ``entry``'s model in, or the RESOURCE_EXHAUSTED to answer instead."""
        name = entry.name
        inflight = self._inflight.get(name, 0)
        bound = self.bound(entry)
        if bound and inflight >= bound:
            return exhausted(
                f"model '{name}' is at capacity: {inflight} requests in flight at this frontend, the bound "
                f"for its {len(entry.cards)} engines (running + waiting slots); retry later"
            )
        self._inflight[name] = inflight + 1
        return None

    def leave(self, name: str) -> None:
        left = self._inflight.get(name, 0) - 1
        if left > 0:
            self._inflight[name] = left
        else:
            self._inflight.pop(name, None)

    def inflight(self, name: str) -> int:
        return self._inflight.get(name, 0)
