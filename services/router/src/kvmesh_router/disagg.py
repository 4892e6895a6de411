"""Conditional disaggregation as a router policy: where a request's prompt is prefilled (issue 12 item 5).

A disaggregated request asks once (``RouteQuery.disagg`` with role DECODE). The router picks and books
the decode engine as for any query, then decides the prefill in the same synchronous step, knowing what
only it knows: the decode engine's cached prefix (from the index) and the prefill pool's load (the
bookings, the busy thresholds). Dynamo's prefill router decides remote prefill there too.

The rule: prefill remotely only when both hold,

- ``uncached = prompt tokens - decode-side cached prefix x block size > min_tokens``
  (``--disagg-min-tokens``): a prompt the decode engine mostly holds is cheaper to finish in place than
  to transfer;
- some eligible prefill engine is under its busy thresholds (``--prefill-backlog-tokens`` bounds the
  prefill queue).

Otherwise the decode engine prefills. A remote prefill is booked on the prefill engine under its own
key (``<key>/prefill``) with one expected output token, so its backlog counts at once for the next
decision. Pure: no I/O, no clock (``now`` comes in), like :mod:`kvmesh_router.admission`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from kvmesh_router.admission import Admission, Decision, Rejection, RejectReason, RouteRequest
from kvmesh_router.cost import RouterConfigOverride

__all__ = ["PREFILL_SUFFIX", "PrefillPlace", "PrefillPlan", "plan_prefill"]

PREFILL_SUFFIX = "/prefill"


class PrefillPlace(enum.Enum):
    REMOTE = "remote"
    LOCAL_SHORT = "local_short"
    LOCAL_BUSY = "local_busy"
    LOCAL_NO_ENGINE = "local_no_engine"


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """The prefill half of a decision: where, why (the client's ``kvmesh.disagg``), and the booking if remote."""

    place: PrefillPlace
    uncached_tokens: int
    reason: str
    decision: Decision | None = None


def plan_prefill(
    admission: Admission,
    decode: RouteRequest,
    decode_decision: Decision,
    block_size: int,
    min_tokens: int,
    excluded_prefill: frozenset[int],
    now: float,
) -> PrefillPlan:
    """Decide (and, if remote, book) the prefill of ``decode``, already booked as ``decode_decision``."""
    uncached = max(0, decode.isl_tokens - decode_decision.overlap_blocks * block_size)
    if uncached <= min_tokens:
        why = f"local: {uncached} uncached prompt tokens <= --disagg-min-tokens {min_tokens}"
        return PrefillPlan(PrefillPlace.LOCAL_SHORT, uncached, why)
    # the client's choices (mode, cost policy) carry over; the decode leg's own weights do not (a Dynamo-style
    # decode override zeroes the overlap credit, which a prefill engine must keep), nor its pin: "direct"
    # is the mode of a request pinned to a decode engine, and any prefill engine may compute its prompt
    asked = decode.override or RouterConfigOverride()
    mode = None if asked.mode == "direct" else asked.mode
    override = RouterConfigOverride(mode=mode, role="prefill", cost_policy=asked.cost_policy)
    prefill = replace(
        decode,
        request_id=decode.request_id + PREFILL_SUFFIX,
        expected_output_tokens=1,
        pinned_engine=None,
        excluded_engines=excluded_prefill,
        override=override,
    )
    result = admission.decide(prefill, now)
    if isinstance(result, Rejection):
        if result.reason is RejectReason.ALL_BUSY:
            return PrefillPlan(PrefillPlace.LOCAL_BUSY, uncached, "local: every prefill engine is busy")
        why = "local: no other prefill engine after a failed one" if excluded_prefill else "local: no prefill engine"
        return PrefillPlan(PrefillPlace.LOCAL_NO_ENGINE, uncached, why)
    return PrefillPlan(PrefillPlace.REMOTE, uncached, "remote", result)
