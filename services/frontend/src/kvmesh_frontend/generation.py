"""The generation flow of one request: decide, generate, report, migrate.

:meth:`Generator.generate` is an async generator of the engine's ``GenerateResponse`` messages:

1. ask a router replica for an engine (``RouteQuery`` with the prompt's sequence hashes);
2. start the request on that engine over its worker's ``GenerateStream`` (:mod:`.engine_stream`)
   and pass its responses through unchanged (one response may carry several tokens);
3. report the first token (prefill done) and the end of the attempt (``FINISHED``: finished,
   failed or cancelled) to the replica that booked it;
4. if the engine dies mid-stream (UNAVAILABLE, a broken or truncated stream, an engine that is gone),
   re-route the prompt plus the tokens generated so far to another engine (the failed ones are
   excluded) with the remaining ``max_tokens``, up to ``migration_limit`` times. The caller sees
   one uninterrupted stream. When the worker's whole stream failed (the process died), every engine
   at that address is excluded at once, and so are they for new requests while the address is down
   (:mod:`.engine_stream`): killing a 4-engine worker costs a request one migration, not four.
   Engines that left this frontend's discovery view lately are excluded too (the router replicas
   watch discovery on their own and may lag).

Cleanup is structural: every attempt's engine call is cancelled and its booking freed in a
``finally``, so closing the generator (client cancel or disconnect, a stop string, an error) leaks
nothing. Callers must close it (``contextlib.aclosing``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from kvmesh import telemetry
from kvmesh.backoff import Backoff
from kvmesh.channels import ChannelPool
from kvmesh.v1 import router_pb2, worker_pb2

from kvmesh_frontend.disagg import DECODE, DisaggPolicy, Disaggregator, DisaggState
from kvmesh_frontend.engine_stream import EngineError, EngineStreams
from kvmesh_frontend.errors import FrontendError, exhausted, internal, invalid, unavailable
from kvmesh_frontend.prompt_tokens import PromptTokens
from kvmesh_frontend.routing import RouterClient, RouterSession

log = logging.getLogger(__name__)

# Engine failures that mean "this engine cannot finish the request", not "the request is bad".
MIGRATABLE = frozenset(
    [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED]
)
_LENGTH = worker_pb2.FINISH_REASON_LENGTH

# (model, pinned engine or None, excluded engines) -> whether discovery shows an eligible live engine
EngineAlive = Callable[[str, int | None, Sequence[int]], bool]


@dataclass(slots=True)
class PreparedRequest:
    """A request ready to route: tokenized, hashed, with final sampling options."""

    request_id: str
    model: str
    prompt: PromptTokens
    block_hashes: list[int]
    block_size: int
    max_tokens: int
    sampling: worker_pb2.SamplingOptions
    pinned_engine_id: int | None = None
    router_mode: int = router_pb2.ROUTER_MODE_UNSPECIFIED
    router_policy: str | None = None


@dataclass(slots=True)
class GenerationState:
    """What the flow learned, for the final response and metrics."""

    engine_id: int = 0
    address: str = ""
    cached_tokens: int = 0  # the engine's own count (its first response); the router's overlap until then
    migrations: int = 0
    failures: list[str] = field(default_factory=list)
    disagg: DisaggState = field(default_factory=DisaggState)


class Generator:
    """Runs requests: router decision, engine stream, lifecycle, migration."""

    def __init__(
        self,
        router: RouterClient,
        pool: ChannelPool,
        migration_limit: int = 3,
        on_migration: Callable[[str], None] | None = None,
        engine_alive: EngineAlive | None = None,
        no_engine_grace: float = 2.0,
        address_live: Callable[[str], bool] = lambda _address: True,
        disagg_policy: DisaggPolicy | None = None,
        model_roles: Callable[[str], frozenset[int]] = lambda _model: frozenset(),
        engine_addresses: Callable[[str], Mapping[int, str]] = lambda _model: {},
        down_s: float = 11.0,
        departed_engines: Callable[[str], Sequence[int]] = lambda _model: (),
    ) -> None:
        self._router = router
        self.engines = EngineStreams(pool, address_live, down_s)
        self._engine_addresses = engine_addresses
        self._departed_engines = departed_engines
        self.disagg = Disaggregator(self.engines, disagg_policy or DisaggPolicy(), model_roles)
        self.migration_limit = migration_limit
        self._on_migration = on_migration
        self._engine_alive = engine_alive
        self.no_engine_grace = no_engine_grace

    async def generate(
        self, req: PreparedRequest, state: GenerationState
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        prompt = req.prompt
        hashes = req.block_hashes
        generated: list[int] = []
        excluded: list[int] = self._down_engines(req.model) if self.engines.any_down else []
        # engines this frontend saw leave discovery: a router replica may not have seen it yet
        excluded.extend(e for e in self._departed_engines(req.model) if e != req.pinned_engine_id)
        attempt = 0
        while True:
            request_id = req.request_id if attempt == 0 else f"{req.request_id}~m{attempt}"
            remaining = req.max_tokens - len(generated)
            tokens = prompt.extended(generated)
            if generated:
                hashes = tokens.block_hashes(req.block_size)
            query = router_pb2.RouteQuery(
                request_id=request_id,
                model=req.model,
                block_hashes=hashes,
                block_size=req.block_size,
                num_tokens=len(tokens),
                expected_output_tokens=remaining,
                excluded_engine_ids=excluded,
            )
            if req.router_mode:
                query.overrides.mode = router_pb2.RouterMode.ValueType(req.router_mode)
            if req.router_policy:
                query.overrides.policy = req.router_policy
            if req.pinned_engine_id is not None:
                query.pinned_engine_id = req.pinned_engine_id
            disaggregated = self.disagg.applies(req.model)
            if disaggregated:  # the router decides the prefill too (RouteDecision.prefill)
                query.overrides.role = DECODE
                query.disagg.excluded_prefill_engine_ids.extend(state.disagg.excluded_prefill)
            span = telemetry.start_span(
                "route", attributes={"kvmesh.request_id": request_id, "kvmesh.attempt": attempt}
            )
            telemetry.inject_trace_context(query.trace_context, span)  # the router's decision span joins it
            try:
                decision, session = await self._route(query, req)
            except BaseException as exc:
                telemetry.end_span(span, type(exc).__name__)
                raise
            telemetry.end_span(span, None, _route_attributes(decision))
            if decision.outcome != router_pb2.DECISION_OUTCOME_ROUTED:  # the router booked nothing
                raise self._refused(req, decision, state)
            state.engine_id = decision.engine_id
            state.address = decision.address
            state.cached_tokens = decision.overlap_blocks * decision.block_size

            sampling = req.sampling
            if generated:
                sampling = worker_pb2.SamplingOptions()
                sampling.CopyFrom(req.sampling)
                sampling.max_tokens = remaining
                sampling.min_tokens = max(0, req.sampling.min_tokens - len(generated))
            kv = None
            if disaggregated:
                try:
                    kv = await self.disagg.prefill(decision, session, tokens, sampling, state.disagg)
                except BaseException:
                    session.finished(request_id)
                    raise
            call = self.engines.start(
                decision.address,
                worker_pb2.GenerateRequest(
                    request_id=request_id,
                    engine_id=decision.engine_id,
                    token_ids_u32le=tokens.u32le,
                    sampling=sampling,
                    prefill_result=kv,
                ),
            )
            finished = False
            first = True
            transfer_failed = False
            try:
                async for response in call:
                    if response.num_prompt_tokens:  # the first response: the engine's real prefix-cache hit
                        state.cached_tokens = response.num_cached_tokens
                    if first and kv is not None:
                        self.disagg.observe(response, state.disagg)
                        if response.HasField("kv_report") and not response.kv_report.recomputed_because:
                            # pulled blocks were computed, not found in a cache
                            state.cached_tokens = max(
                                state.disagg.prefill_cached_tokens, response.kv_report.local_hit_blocks * req.block_size
                            )
                    if response.token_ids:
                        if first:
                            first = False
                            session.first_token(request_id)
                        generated.extend(response.token_ids)
                    if response.finish_reason:
                        finished = True
                    yield response
                    if finished:
                        return
                failure = "the engine ended the stream before the request finished"
            except EngineError as exc:
                transfer_failed = self.disagg.transfer_failed(exc, kv, state.disagg)
                if exc.code not in MIGRATABLE and not transfer_failed:
                    raise self._engine_error(req, decision, exc) from None
                failure = f"{exc.code.name}: {exc.details}"  # for the log: may carry a peer's gRPC debug text
            finally:
                if not finished:
                    call.cancel()
                session.finished(request_id)
                if kv is not None:
                    self.disagg.release(kv)

            # The engine failed mid-stream (or before its first token): migrate.
            state.failures.append(f"engine {decision.engine_id:x}: {failure}")
            if len(generated) >= req.max_tokens:  # everything arrived but the final flag
                yield worker_pb2.GenerateResponse(finish_reason=_LENGTH)
                return
            if req.pinned_engine_id is not None or attempt >= self.migration_limit:
                # The client gets what happened; the engine's error text goes to the log only.
                log.warning("request %s: engine %x failed: %s", req.request_id, decision.engine_id, failure)
            if req.pinned_engine_id is not None:
                raise unavailable(
                    f"request {req.request_id}: pinned engine {decision.engine_id:x} failed after "
                    f"{len(generated)} tokens; pinned requests are not migrated"
                )
            if attempt >= self.migration_limit:
                raise unavailable(
                    f"request {req.request_id}: engine {decision.engine_id:x} failed after {len(generated)} tokens "
                    f"and the migration limit ({self.migration_limit}) is reached"
                )
            attempt += 1
            state.migrations = attempt
            if not transfer_failed:  # a failed KV pull is the prefill side's failure: keep the decode engine
                excluded.append(decision.engine_id)
                if self.engines.is_down(decision.address):  # the worker, not only this engine, failed
                    at = self._engine_addresses(req.model)
                    excluded.extend(e for e, a in at.items() if a == decision.address and e not in excluded)
            log.warning(
                "request %s: engine %x failed after %d tokens (%s); migrating (%d/%d)",
                req.request_id,
                decision.engine_id,
                len(generated),
                failure,
                attempt,
                self.migration_limit,
            )
            if self._on_migration is not None:
                self._on_migration(req.model)

    def _down_engines(self, model: str) -> list[int]:
        """Engines of ``model`` at addresses whose stream just failed; none if that would be all of them."""
        engines = self._engine_addresses(model)
        down = [e for e, address in engines.items() if self.engines.is_down(address)]
        return down if len(down) < len(engines) else []

    async def _route(
        self, query: router_pb2.RouteQuery, req: PreparedRequest
    ) -> tuple[router_pb2.RouteDecision, RouterSession]:
        """The router's decision; NO_ENGINE is retried while discovery says an eligible engine lives.

        The frontend and the router watch discovery independently: for a moment after an engine
        appears, the frontend may know it (and report the model ready) while the router does not.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.no_engine_grace
        backoff: Backoff | None = None  # made on the first NO_ENGINE only: the hot path never needs it
        while True:
            decision, session = await self._router.route(query)
            if (
                decision.outcome != router_pb2.DECISION_OUTCOME_NO_ENGINE
                or self._engine_alive is None
                or not self._engine_alive(req.model, req.pinned_engine_id, query.excluded_engine_ids)
            ):
                return decision, session
            if backoff is None:
                # 20, 40, 80, 160, 250, 250 ... ms without jitter: a short wait bounded by the grace.
                backoff = Backoff(0.02, 0.25, jitter=0.0)
            delay = backoff.next_delay()
            if loop.time() + delay > deadline:
                return decision, session
            await asyncio.sleep(delay)

    @staticmethod
    def _refused(req: PreparedRequest, decision: router_pb2.RouteDecision, state: GenerationState) -> FrontendError:
        why = decision.message or router_pb2.DecisionOutcome.Name(decision.outcome)
        if decision.outcome == router_pb2.DECISION_OUTCOME_REJECTED:
            return exhausted(f"model '{req.model}': every engine is busy, retry later (router: {why})")
        if decision.outcome == router_pb2.DECISION_OUTCOME_NO_ENGINE:
            if state.failures:
                log.warning("request %s: no engine left to migrate to after %s", req.request_id, state.failures)
                return unavailable(
                    f"request {req.request_id}: no engine left to migrate to after {len(state.failures)} failed "
                    f"engine(s) (router: {why})"
                )
            return unavailable(f"model '{req.model}': no live engine can take the request (router: {why})")
        if decision.outcome == router_pb2.DECISION_OUTCOME_INVALID:
            return invalid(f"the router refused the request: {why}")
        if decision.outcome == router_pb2.DECISION_OUTCOME_ERROR:  # the router's bug, not the client's mistake
            log.error("request %s: the router failed to decide: %s", req.request_id, why)
            return internal(f"request {req.request_id}: the router failed to decide (an internal error, logged)")
        return internal(f"request {req.request_id}: the router answered outcome {decision.outcome} ({why})")

    @staticmethod
    def _engine_error(req: PreparedRequest, decision: router_pb2.RouteDecision, exc: EngineError) -> FrontendError:
        code = exc.code
        details = exc.details or code.name
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return invalid(f"engine {decision.engine_id:x} rejected the request: {details}")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return exhausted(f"engine {decision.engine_id:x} is full, retry later: {details}")
        log.error("request %s: engine %x failed: %s: %s", req.request_id, decision.engine_id, code.name, details)
        return internal(f"request {req.request_id}: engine {decision.engine_id:x} failed ({code.name})")


def _route_attributes(decision: router_pb2.RouteDecision) -> dict[str, str | int]:
    """What a trace shows of a decision (the router's own span adds cost and runner-up)."""
    return {
        "kvmesh.outcome": router_pb2.DecisionOutcome.Name(decision.outcome),
        "kvmesh.engine_id": f"{decision.engine_id:x}",
        "kvmesh.overlap_blocks": decision.overlap_blocks,
        "kvmesh.best_overlap_blocks": decision.best_overlap_blocks,
    }
