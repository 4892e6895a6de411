"""Protobuf <-> domain translation for the router contract (``protos/kvmesh/v1/router.proto``).

The only module that knows both the wire types and the router core's types: a ``RouteQuery`` becomes a
:class:`~kvmesh_router.admission.RouteRequest` (its ``RouterConfigOverride`` a
:class:`~kvmesh_router.cost.RouterConfigOverride`), a decision fills a ``RouteDecision``, a booking becomes
an ``ActiveBooking``.

Invariants: pure functions, no state; a malformed query never raises anything but :class:`QueryError`,
which carries the outcome (INVALID) and message the frontend sees.
"""

from __future__ import annotations

from kvmesh.v1 import discovery_pb2, router_pb2

from kvmesh_router.admission import RouteRequest
from kvmesh_router.cost import RouterConfigOverride
from kvmesh_router.slot_tracker import Booking

__all__ = [
    "INVALID",
    "MAX_QUERY_BLOCKS",
    "NO_ENGINE",
    "OUTCOME_NAMES",
    "REJECTED",
    "ROUTED",
    "QueryError",
    "booking_to_proto",
    "fail",
    "role_name",
    "route_request",
]

ROUTED = router_pb2.DECISION_OUTCOME_ROUTED
REJECTED = router_pb2.DECISION_OUTCOME_REJECTED
NO_ENGINE = router_pb2.DECISION_OUTCOME_NO_ENGINE
INVALID = router_pb2.DECISION_OUTCOME_INVALID
OUTCOME_NAMES: dict[int, str] = {ROUTED: "routed", REJECTED: "rejected", NO_ENGINE: "no_engine", INVALID: "invalid"}

_MODES: dict[int, str] = {
    router_pb2.ROUTER_MODE_KV: "kv",
    router_pb2.ROUTER_MODE_ROUND_ROBIN: "round_robin",
    router_pb2.ROUTER_MODE_RANDOM: "random",
    router_pb2.ROUTER_MODE_POWER_OF_TWO: "power_of_two",
    router_pb2.ROUTER_MODE_DIRECT: "direct",
}
_ROLES: dict[int, str] = {
    discovery_pb2.WORKER_ROLE_UNSPECIFIED: "aggregated",
    discovery_pb2.WORKER_ROLE_AGGREGATED: "aggregated",
    discovery_pb2.WORKER_ROLE_PREFILL: "prefill",
    discovery_pb2.WORKER_ROLE_DECODE: "decode",
}


class QueryError(Exception):
    """A query the contract cannot accept; ``outcome`` is its DecisionOutcome."""

    def __init__(self, outcome: int, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message


#: Block hashes one query may carry: a 2M-token prompt at block size 16, far past any context window.
#: Deciding and booking are O(blocks) and serialized across sessions: 6.5M hashes in one query held
#: every other session's decisions for seconds.
MAX_QUERY_BLOCKS = 1 << 17


def role_name(role: int) -> str | None:
    """A ``WorkerRole`` as a ``cost.ROLES`` name (None for a value this build does not know)."""
    return _ROLES.get(role)


def route_request(key: str, query: router_pb2.RouteQuery, allowed: frozenset[int]) -> RouteRequest:
    """The core's request for ``query``, booked under ``key``, restricted to ``allowed`` engines."""
    if len(query.block_hashes) > MAX_QUERY_BLOCKS:
        raise QueryError(
            INVALID, f"{len(query.block_hashes)} block hashes in one query; at most {MAX_QUERY_BLOCKS} are accepted"
        )
    hashes = list(query.block_hashes)
    if len(hashes) > query.num_tokens:  # else the cache credit is for blocks the prompt does not have
        raise QueryError(
            INVALID, f"{len(hashes)} block hashes for a prompt of {query.num_tokens} tokens (a block has one or more)"
        )
    override: RouterConfigOverride | None = None
    if query.HasField("overrides"):
        ov = query.overrides
        mode = role = None
        if ov.mode:
            mode = _MODES.get(ov.mode)
            if mode is None:
                raise QueryError(INVALID, f"unknown routing mode {ov.mode}")
        if ov.role:
            role = role_name(ov.role)
            if role is None:
                raise QueryError(INVALID, f"unknown worker role {ov.role}")
        override = RouterConfigOverride(
            mode=mode,
            role=role,
            cost_policy=ov.policy if ov.HasField("policy") else None,
            overlap_score_weight=ov.overlap_weight if ov.HasField("overlap_weight") else None,
            temperature=ov.temperature if ov.HasField("temperature") else None,
        )
    return RouteRequest(
        key,
        hashes,
        query.num_tokens,
        query.expected_output_tokens or None,
        query.pinned_engine_id if query.HasField("pinned_engine_id") else None,
        allowed,
        frozenset(query.excluded_engine_ids),
        override,
    )


def booking_to_proto(key: str, booking: Booking, now: float) -> router_pb2.ActiveBooking:
    return router_pb2.ActiveBooking(
        request_id=key,
        engine_id=booking.engine_id,
        block_hashes=booking.seq_hashes,
        num_tokens=booking.isl_tokens,
        overlap_blocks=booking.overlap_blocks,
        expected_output_tokens=booking.expected_output_tokens or 0,
        prefill_completed=booking.prefill_tokens == 0,
        age_ms=max(0, int((now - booking.started_at) * 1000)),
    )


def fail(out: router_pb2.RouteDecision, outcome: int, message: str) -> None:
    out.outcome = outcome  # type: ignore[assignment]  # DecisionOutcome values are ints
    out.message = message
