"""Disaggregated prefill/decode: the frontend orchestrates the two engine calls (as Dynamo's frontend does).

For a model served by decode engines, :class:`~kvmesh_frontend.generation.Generator` sends one query with
``RouterConfigOverride.role = DECODE`` and ``RouteQuery.disagg`` set. The router picks the decode engine
(its KV cost credits the decode engine's cached prefix, unlike Dynamo's decode router, which zeroes it)
and, in the same step, decides where the prompt is prefilled (conditional disaggregation, a router policy:
``kvmesh_router/disagg.py``): remotely only if ``prompt - decode-side cached prefix > --disagg-min-tokens``
(a router flag) and a prefill engine is under its busy thresholds (the prefill pool's backlog bound).
:meth:`Disaggregator.prefill` acts on that ``RouteDecision.prefill``:

- REMOTE: the prefill leg runs on the chosen engine, booked by the router as ``<request_id>/prefill``,
  with ``max_tokens=1`` and ``hold_kv_for_transfer``; its last response carries the ``KvTransferParams``,
  which go (with the prefill worker's address) to the decode engine as ``prefill_result``. Its one token
  is dropped: the decode engine generates every client token;
- LOCAL_BUSY (every prefill engine over its bound): local prefill, or RESOURCE_EXHAUSTED with
  ``--disagg-busy reject``; LOCAL_NO_ENGINE: local, or UNAVAILABLE with ``--enforce-disagg``;
  LOCAL_SHORT: local.

Invariants: every prefill leg gets exactly one FINISHED (from a ``finally``) and is cancelled if the
request ends first; a hold the frontend received is released by the frontend too (``ReleaseKv`` is
idempotent; the decode worker normally releases first, the hold lease is the last backstop); a decode
leg whose pull failed with ABORTED (source gone, backend error) produced no token, so the request moves
on with the failed prefill engine excluded (``DisaggQuery.excluded_prefill_engine_ids``) and the decode
engine kept. The decision and its reason land in the final response (``kvmesh.prefill_worker_id``,
``kvmesh.kv_transferred_blocks``, ``kvmesh.disagg``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import grpc
from kvmesh.channels import ChannelPool
from kvmesh.kv_release import RELEASE_CHANNELS, KvReleases
from kvmesh.v1 import discovery_pb2, router_pb2, worker_pb2
from kvmesh.v1.kv_transfer_pb2 import KvTransferParams

from kvmesh_frontend.engine_stream import EngineError, EngineStreams
from kvmesh_frontend.errors import exhausted, invalid, unavailable
from kvmesh_frontend.prompt_tokens import PromptTokens
from kvmesh_frontend.routing import RouterSession

log = logging.getLogger(__name__)

DECODE = discovery_pb2.WORKER_ROLE_DECODE
PREFILL = discovery_pb2.WORKER_ROLE_PREFILL


@dataclass(frozen=True, slots=True)
class DisaggPolicy:
    """What the frontend answers when the router's prefill decision is not remote."""

    busy: Literal["local", "reject"] = "local"
    enforce: bool = False


@dataclass(slots=True)
class DisaggState:
    """What the final response reports about disaggregation."""

    decision: str = ""  # "remote" or "local: <why>"
    prefill_engine_id: int = 0
    prefill_cached_tokens: int = 0  # the prefill engine's own prefix-cache hit
    transferred_blocks: int = 0
    transferred_bytes: int = 0
    pull_everything_bytes: int = 0
    excluded_prefill: list[int] = field(default_factory=list)


class Disaggregator:
    def __init__(
        self,
        engines: EngineStreams,
        policy: DisaggPolicy,
        model_roles: Callable[[str], frozenset[int]],
    ) -> None:
        self._engines = engines
        self.policy = policy
        self._model_roles = model_roles
        self._pool = ChannelPool(RELEASE_CHANNELS)  # keyed by the sources' addresses
        self._releases = KvReleases(self._pool, log, logging.DEBUG)

    def applies(self, model: str) -> bool:
        """The model has decode engines: requests go to one of them (with or without a remote prefill)."""
        return DECODE in self._model_roles(model)

    async def prefill(
        self,
        decision: router_pb2.RouteDecision,
        session: RouterSession,
        tokens: PromptTokens,
        sampling: worker_pb2.SamplingOptions,
        state: DisaggState,
    ) -> KvTransferParams | None:
        """Run the remote prefill the router chose beside the decode ``decision``; None means prefill locally
        (state says why). ``session`` booked both: every prefill leg gets its FINISHED there."""
        policy = self.policy
        plan = decision.prefill
        if plan.place != router_pb2.PREFILL_PLACE_REMOTE:
            if plan.place == router_pb2.PREFILL_PLACE_LOCAL_BUSY and policy.busy == "reject":
                raise exhausted("every prefill engine is over its busy threshold, retry later")
            if plan.place == router_pb2.PREFILL_PLACE_LOCAL_NO_ENGINE and policy.enforce:
                raise unavailable(
                    "no prefill engine can take the request and the frontend enforces disaggregation "
                    f"(--enforce-disagg): {plan.reason.removeprefix('local: ') or 'no prefill engine is live'}"
                )
            state.decision = (
                plan.reason or "local: the router decided no prefill (it predates conditional disaggregation)"
            )
            return None
        prefill_id = plan.request_id
        psampling = worker_pb2.SamplingOptions()
        psampling.CopyFrom(sampling)
        psampling.max_tokens = 1
        psampling.min_tokens = 0
        params: KvTransferParams | None = None
        finished = False
        call = None
        try:  # from here on, the router's prefill booking gets its FINISHED whatever happens
            call = self._engines.start(
                plan.address,
                worker_pb2.GenerateRequest(
                    request_id=prefill_id,
                    engine_id=plan.engine_id,
                    token_ids_u32le=tokens.u32le,
                    sampling=psampling,
                    hold_kv_for_transfer=True,
                ),
            )
            async for response in call:
                if response.num_prompt_tokens:
                    state.prefill_cached_tokens = response.num_cached_tokens
                if response.finish_reason:
                    finished = True
                    session.first_token(prefill_id)
                    if response.HasField("kv_transfer"):
                        params = KvTransferParams()
                        params.CopyFrom(response.kv_transfer)
                        params.source_address = plan.address
                    break
        except EngineError as exc:
            if exc.code == grpc.StatusCode.INVALID_ARGUMENT:  # the request itself is bad: no fallback fixes it
                raise invalid(f"prefill engine {plan.engine_id:x} rejected the request: {exc.details}") from None
            log.warning("prefill engine %x failed (%s): prefilling locally", plan.engine_id, exc)
            state.excluded_prefill.append(plan.engine_id)
            state.decision = "local: the prefill engine failed"
            return None
        finally:
            if call is not None and not finished:
                call.cancel()
            session.finished(prefill_id)
        if params is None:
            state.decision = "local: the prefill engine held no KV"
            return None
        state.decision = "remote"
        state.prefill_engine_id = plan.engine_id
        return params

    @staticmethod
    def observe(response: worker_pb2.GenerateResponse, state: DisaggState) -> None:
        if response.HasField("kv_report"):
            report = response.kv_report
            if report.recomputed_because:  # the decode engine computes the prompt itself: nothing came
                state.decision = f"local: {report.recomputed_because}"
                state.prefill_engine_id = 0
                return
            state.transferred_blocks = report.transferred_blocks
            state.transferred_bytes = report.transferred_bytes
            state.pull_everything_bytes = report.pull_everything_bytes

    @staticmethod
    def transfer_failed(exc: EngineError, params: KvTransferParams | None, state: DisaggState) -> bool:
        """A decode leg whose pull failed: retry with a local prefill, same engine, that prefill engine excluded.

        ABORTED: the source is gone or the backend failed. FAILED_PRECONDITION: the two engines cannot
        share KV (block sizes or bytes per block differ, a mesh misconfiguration, logged as an error each
        time): every disaggregated request failed INTERNAL; served with a local prefill it does not."""
        if params is None or exc.code not in (grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION):
            return False
        if exc.code == grpc.StatusCode.FAILED_PRECONDITION:
            log.error("prefill engine %x: its KV cannot be used: %s; prefilling locally", params.source_engine_id, exc)
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
