"""Disaggregated prefill/decode: the frontend orchestrates the two engine calls (as Dynamo's frontend does).

For a model served by decode engines, :class:`~kvmesh_frontend.generation.Generator` asks the router for a
**decode** engine first (``RouterConfigOverride.role = DECODE``; the router's KV cost credits the decode
engine's cached prefix, unlike Dynamo's decode router, which zeroes it). Then :meth:`Disaggregator.prefill`
decides, per request (conditional disaggregation):

- remote prefill only if ``prompt - decode-side cached prefix > --disagg-min-tokens``, else local;
- a **prefill** engine from the router (``role = PREFILL``); the router's busy thresholds bound the
  prefill pool's backlog: REJECTED (every prefill engine over its bound) means local prefill, or
  RESOURCE_EXHAUSTED with ``--disagg-busy reject``; NO_ENGINE (no prefill engine live) means local, or
  UNAVAILABLE with ``--enforce-disagg``;
- the prefill leg runs with ``max_tokens=1`` and ``hold_kv_for_transfer``; its last response carries the
  ``KvTransferParams``, which go (with the prefill worker's address) to the decode engine as
  ``prefill_result``. Its one token is dropped: the decode engine generates every client token.

Invariants: every prefill leg gets exactly one FINISHED (from a ``finally``) and is cancelled if the
request ends first; a hold the frontend received is released by the frontend too (``ReleaseKv`` is
idempotent; the decode worker normally releases first, the hold lease is the last backstop); a decode
leg whose pull failed with ABORTED (source gone, backend error) produced no token, so the request moves
on with a local prefill on the same decode engine and the failed prefill engine excluded. The decision
and its reason land in the final response (``kvmesh.prefill_worker_id``, ``kvmesh.kv_transferred_blocks``,
``kvmesh.disagg``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import grpc
from kvmesh.channels import ChannelPool
from kvmesh.kv_release import KvReleases
from kvmesh.v1 import discovery_pb2, router_pb2, worker_pb2
from kvmesh.v1.kv_transfer_pb2 import KvTransferParams

from kvmesh_frontend.engine_stream import EngineError, EngineStreams
from kvmesh_frontend.errors import exhausted, invalid, unavailable
from kvmesh_frontend.routing import RouterClient

log = logging.getLogger(__name__)

DECODE = discovery_pb2.WORKER_ROLE_DECODE
PREFILL = discovery_pb2.WORKER_ROLE_PREFILL


@dataclass(frozen=True, slots=True)
class DisaggPolicy:
    min_tokens: int = 0
    busy: Literal["local", "reject"] = "local"
    enforce: bool = False


@dataclass(slots=True)
class DisaggState:
    """What the final response reports about disaggregation."""

    decision: str = ""  # "remote" or "local: <why>"
    prefill_engine_id: int = 0
    transferred_blocks: int = 0
    transferred_bytes: int = 0
    pull_everything_bytes: int = 0
    excluded_prefill: list[int] = field(default_factory=list)


class Disaggregator:
    def __init__(
        self,
        router: RouterClient,
        engines: EngineStreams,
        policy: DisaggPolicy,
        model_roles: Callable[[str], set[int]],
    ) -> None:
        self._router = router
        self._engines = engines
        self.policy = policy
        self._model_roles = model_roles
        self._pool = ChannelPool()
        self._releases = KvReleases(self._pool, log, logging.DEBUG)

    def applies(self, model: str) -> bool:
        """The model has decode engines: requests go to one of them (with or without a remote prefill)."""
        return DECODE in self._model_roles(model)

    async def prefill(
        self,
        decision: router_pb2.RouteDecision,
        query: router_pb2.RouteQuery,
        tokens: list[int],
        sampling: worker_pb2.SamplingOptions,
        state: DisaggState,
    ) -> KvTransferParams | None:
        """Run the remote prefill for the decode ``decision``; None means prefill locally (state says why)."""
        policy = self.policy
        uncached = len(tokens) - decision.overlap_blocks * decision.block_size
        if uncached <= policy.min_tokens:
            state.decision = f"local: {uncached} uncached prompt tokens <= --disagg-min-tokens {policy.min_tokens}"
            return None
        prefill_id = f"{query.request_id}/prefill"
        pquery = router_pb2.RouteQuery()
        pquery.CopyFrom(query)
        pquery.request_id = prefill_id
        pquery.expected_output_tokens = 1
        pquery.ClearField("pinned_engine_id")
        del pquery.excluded_engine_ids[:]
        pquery.excluded_engine_ids.extend(state.excluded_prefill)
        pquery.overrides.role = PREFILL
        pdecision, session = await self._router.route(pquery)
        if pdecision.outcome != router_pb2.DECISION_OUTCOME_ROUTED:
            session.finished(prefill_id)
            if pdecision.outcome == router_pb2.DECISION_OUTCOME_REJECTED:
                if policy.busy == "reject":
                    raise exhausted(
                        f"every prefill engine is over its busy threshold, retry later ({pdecision.message})"
                    )
                state.decision = "local: every prefill engine is busy"
                return None
            if policy.enforce:
                raise unavailable(
                    "no prefill engine can take the request and the frontend enforces disaggregation "
                    f"(--enforce-disagg): {pdecision.message or 'no prefill engine is live'}"
                )
            state.decision = (
                "local: no other prefill engine after a failed one"
                if state.excluded_prefill
                else "local: no prefill engine"
            )
            return None
        psampling = worker_pb2.SamplingOptions()
        psampling.CopyFrom(sampling)
        psampling.max_tokens = 1
        psampling.min_tokens = 0
        call = self._engines.start(
            pdecision.address,
            worker_pb2.GenerateRequest(
                request_id=prefill_id,
                engine_id=pdecision.engine_id,
                token_ids=tokens,
                sampling=psampling,
                hold_kv_for_transfer=True,
            ),
        )
        params: KvTransferParams | None = None
        finished = False
        try:
            async for response in call:
                if response.finish_reason:
                    finished = True
                    session.first_token(prefill_id)
                    if response.HasField("kv_transfer"):
                        params = KvTransferParams()
                        params.CopyFrom(response.kv_transfer)
                        params.source_address = pdecision.address
                    break
        except EngineError as exc:
            if exc.code == grpc.StatusCode.INVALID_ARGUMENT:  # the request itself is bad: no fallback fixes it
                raise invalid(f"prefill engine {pdecision.engine_id:x} rejected the request: {exc.details}") from None
            log.warning("prefill engine %x failed (%s): prefilling locally", pdecision.engine_id, exc)
            state.excluded_prefill.append(pdecision.engine_id)
            state.decision = "local: the prefill engine failed"
            return None
        finally:
            if not finished:
                call.cancel()
            session.finished(prefill_id)
        if params is None:
            state.decision = "local: the prefill engine held no KV"
            return None
        state.decision = "remote"
        state.prefill_engine_id = pdecision.engine_id
        return params

    @staticmethod
    def observe(response: worker_pb2.GenerateResponse, state: DisaggState) -> None:
        if response.HasField("kv_report"):
            report = response.kv_report
            state.transferred_blocks = report.transferred_blocks
            state.transferred_bytes = report.transferred_bytes
            state.pull_everything_bytes = report.pull_everything_bytes

    @staticmethod
    def transfer_failed(exc: EngineError, params: KvTransferParams | None, state: DisaggState) -> bool:
        """A decode leg whose pull failed (ABORTED: source gone or backend error): retry locally, same engine."""
        if params is None or exc.code != grpc.StatusCode.ABORTED:
            return False
        state.excluded_prefill.append(params.source_engine_id)
        state.prefill_engine_id = 0
        state.decision = "local: the KV transfer failed"
        return True

    def release(self, params: KvTransferParams) -> None:
        """Drop the prefill side's hold (idempotent; usually the decode worker did already)."""
        self._releases.start(params)

    async def close(self) -> None:
        await self._releases.wait()
        await self._pool.close()
