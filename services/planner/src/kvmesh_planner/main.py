"""``kvmesh-planner``: scales the worker pools to meet latency targets with as few engines as possible.

Every ``--interval`` seconds the leader (see :mod:`kvmesh_planner.election`) builds an observation
(:mod:`kvmesh_planner.observe`), asks the I/O-free :class:`~kvmesh_planner.core.PlannerCore` for a
decision, commits it to the decision log (only a planner that still leads can), then has the connector
carry it out. Each decision goes out on ``WatchDecisions``, into the metrics and as one log line.
Standbys serve ``GetStatus`` (``leader: false``) and decide nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Iterable, Sequence

import aetcd.exceptions
from kvmesh.discovery import DiscoveryError
from kvmesh.runtime import DaemonRuntime, run_daemon
from kvmesh.settings import fail
from kvmesh.v1 import planner_pb2

from kvmesh_planner.connectors.base import Connector
from kvmesh_planner.connectors.local import LocalConnector
from kvmesh_planner.connectors.systemd import SystemctlError, SystemdConnector
from kvmesh_planner.connectors.virtual import VirtualConnector, pool_sizes
from kvmesh_planner.core import EngineProfile, Observation, PlannerConfig, PlannerCore, PoolBounds, load_profile
from kvmesh_planner.core.model import EngineShape, Pool
from kvmesh_planner.election import Election, EtcdElection, FileElection
from kvmesh_planner.metrics import PlannerMetrics
from kvmesh_planner.observe import Observer
from kvmesh_planner.service import PlannerServicer, decision_message
from kvmesh_planner.settings import Settings

log = logging.getLogger("kvmesh_planner")

PROG = "kvmesh-planner"
LOG_READ_TIMEOUT_S = 5.0
UNREACHABLE = (DiscoveryError, aetcd.exceptions.ClientError, TimeoutError)


def core_config(cfg: Settings, shape: EngineShape | None = None) -> PlannerConfig:
    return PlannerConfig(
        mode=cfg.effective_mode,
        load_profile=cfg.load_profile,
        pools={p: PoolBounds(*cfg.pool_bounds(p)) for p in cfg.managed_pools},
        max_engines=cfg.budget,
        interval_s=cfg.interval,
        scale_up_cooldown_s=cfg.scale_up_cooldown,
        scale_down_cooldown_s=cfg.scale_down_cooldown,
        down_confirmations=cfg.down_confirmations,
        ttft_ms=cfg.ttft_ms or 500.0,
        itl_ms=cfg.itl_ms or 50.0,
        sla_headroom=cfg.sla_headroom,
        predictor=cfg.predictor,
        lookahead_s=cfg.lookahead,
        shape=shape or EngineShape(),
    )


class Planner:
    """The daemon's loop around the core: observe, decide, commit, apply, publish."""

    def __init__(
        self,
        cfg: Settings,
        runtime: DaemonRuntime,
        observer: Observer,
        connector: Connector,
        election: Election,
        profile: EngineProfile | None,
    ) -> None:
        self.cfg, self.runtime, self.observer, self.connector = cfg, runtime, observer, connector
        self.election, self.profile = election, profile
        self.metrics = PlannerMetrics()
        self.servicer = PlannerServicer(self.status)
        self.core: PlannerCore | None = None
        self._core_term = 0  # the election term the core was built in
        self._desired: dict[Pool, int] = {}

    def _starting(self, pids: set[int]) -> dict[Pool, int]:
        """Engines per pool started but not registered yet. The virtual connector starts none itself: the
        engines its targets ask for, or the orchestrator says it runs, that have not registered are."""
        if isinstance(self.connector, VirtualConnector):
            return self.connector.awaited(_count(o.pool for o in self.observer.engine_observations()))
        return self.connector.starting(pids)

    def status(self) -> planner_pb2.GetStatusResponse:
        reply = planner_pb2.GetStatusResponse(
            observed=pool_sizes(_count(o.pool for o in self.observer.engine_observations())),
            connector=self.connector.name,
            leader=self.election.is_leader,
            mode=self.cfg.effective_mode,
            desired=pool_sizes(self._desired),
            starting=pool_sizes(self._starting(self.observer.registered_pids())),
            draining=pool_sizes(self.connector.draining()),
            pools=list(self.cfg.managed_pools),
            minimum=pool_sizes({p: self.cfg.pool_bounds(p)[0] for p in self.cfg.managed_pools}),
            maximum=pool_sizes({p: self.cfg.pool_bounds(p)[1] for p in self.cfg.managed_pools}),
            engine_budget=self.cfg.budget,
        )
        if self.servicer.latest is not None:
            reply.latest.CopyFrom(self.servicer.latest)
        return reply

    async def _yield_to_another_leader(self) -> None:
        """The local connector's workers are this process's children: another leader neither counts nor
        stops them, and starts its own. Once another planner has committed a decision, ours are drained
        (as a scale-down drains: what they serve finishes), not left serving beyond every pool's maximum
        for good. A planner that stepped down for a moment while nobody else led keeps them."""
        if not isinstance(self.connector, LocalConnector) or not any(self.connector.actual().values()):
            return
        last = await asyncio.wait_for(self.election.last_decision(), LOG_READ_TIMEOUT_S)
        if last is not None and last.planner_id != self.runtime.instance_id:
            drained = await self.connector.drain_all()
            log.warning(
                "planner %x leads now: draining the %d worker(s) this planner started (it starts its own)",
                last.planner_id,
                drained,
            )

    def _shape(self) -> EngineShape:
        for e in self.observer.engines.values():
            if e.card is not None and e.card.total_kv_blocks:
                return EngineShape(
                    total_kv_tokens=e.card.total_kv_blocks * e.card.block_size,
                    max_num_seqs=e.card.max_num_seqs or 256,
                    max_num_batched_tokens=e.card.max_num_batched_tokens or 8192,
                    context_length=e.card.context_length or e.card.total_kv_blocks * e.card.block_size,
                )
        return EngineShape()

    async def run(self) -> None:
        interval = self.cfg.interval
        next_tick = time.monotonic()
        while True:
            next_tick += interval
            await asyncio.sleep(max(0.0, next_tick - time.monotonic()))
            self.metrics.leader.set(1 if self.election.is_leader else 0)
            try:
                await self.tick(interval)
            except SystemctlError as exc:
                log.error("connector failed: %s", exc)
            except UNREACHABLE as exc:  # an etcd outage: the next tick tries again, no traceback each time
                log.warning("planner tick skipped: discovery unreachable (%s: %s)", type(exc).__name__, exc)
            except Exception:
                log.exception("planner tick failed")

    async def tick(self, interval: float) -> None:
        if not self.election.is_leader:
            self.core = None  # a future leadership starts from the decision log, not from stale state
            await self._yield_to_another_leader()
            return
        if self.core is not None and self._core_term != self.election.term:
            self.core = None  # lost and won again since the last tick: others may have decided meanwhile
        if self.core is None:
            last = await self.election.last_decision()
            first = last.decision_id + 1 if last is not None else 1
            core = PlannerCore(core_config(self.cfg, self._shape()), self.profile, first_decision_id=first)
            await self.connector.start()  # adopts what runs; if it fails, the next tick tries again
            self.core, self._core_term = core, self.election.term
            log.info("leading: decisions continue from id %d", first)
        shape = self._shape()  # engines register after the core is built: follow their model cards
        if shape != self.core.config.shape:
            self.core.config = dataclasses.replace(self.core.config, shape=shape)
        if isinstance(self.connector, VirtualConnector) and self.connector.pending():
            log.info("waiting for the orchestrator to acknowledge the latest decision")
            return
        pids = self.observer.registered_pids()
        if isinstance(self.connector, LocalConnector):
            self.connector.reap_failed(pids)
        elif isinstance(self.connector, SystemdConnector):
            await self.connector.refresh_pids(pids)
        await self.observer.poll_router()
        traffic = await self.observer.scrape_frontends(interval)
        engines = self.observer.engine_observations()
        actual = self.connector.actual()
        if isinstance(self.connector, VirtualConnector) and not self.connector.heard_from_orchestrator():
            # "start adopts what runs": before any acknowledgement the orchestrator's engines are the ones
            # registered, not none (a first decision from 0 asked a running pool of 4 for its minimum)
            actual = {**actual, **_count(e.pool for e in engines)}
        obs = Observation(
            now=time.monotonic(),
            engines=engines,
            actual=actual,
            starting=self._starting(pids),
            traffic=traffic,
        )
        decision = self.core.decide(obs)
        entry = planner_pb2.PlannerDecisionLog(
            decision_id=decision.decision_id, target=pool_sizes(decision.target), planner_id=self.runtime.instance_id
        )
        try:
            committed = await self.election.commit(entry)
        except Exception:
            self.core = None  # its state ran ahead of the log: rebuild from the log next tick
            raise
        if not committed:
            log.warning("decision %d not committed: no longer the leader; not applying it", decision.decision_id)
            self.core = None
            return
        applied = False
        if decision.changed:
            applied = await self.connector.apply(
                decision.decision_id, decision.target, self.observer.engine_refs(engines)
            )
        self._desired = dict(decision.target)
        msg = decision_message(decision, self.runtime.instance_id, applied, int(time.time() * 1000))
        self.servicer.publish(msg)
        self.metrics.observe(decision, dict(obs.starting), self.connector.draining())
        (log.info if decision.changed else log.debug)("%s applied=%s", decision.log_line(), applied)


def _count(pools: Iterable[Pool]) -> dict[Pool, int]:
    out: dict[Pool, int] = {}
    for p in pools:
        out[p] = out.get(p, 0) + 1
    return out


async def serve(cfg: Settings) -> int:
    profile: EngineProfile | None = None
    if cfg.effective_mode == "sla":
        try:
            profile = load_profile(cfg.profile)
        except (OSError, ValueError) as exc:
            fail(PROG, f"--profile {cfg.profile}: {exc}")
    async with DaemonRuntime(PROG, cfg) as runtime:
        observer = Observer(runtime.discovery, cfg.namespace)
        await observer.start()
        runtime.resources.push_async_callback(observer.close)
        connector: Connector
        if cfg.connector == "local":
            try:
                connector = LocalConnector(
                    cfg.worker_command,
                    cfg.discovery,
                    cfg.namespace,
                    cfg.worker_args,
                    drain_timeout=cfg.drain_timeout,
                    pools=cfg.managed_pools,
                    startup_timeout=cfg.startup_timeout,
                )
            except ValueError as exc:  # its message names the flag
                fail(PROG, str(exc))
        elif cfg.connector == "systemd":
            try:
                connector = SystemdConnector(
                    cfg.systemctl, templates={p: cfg.unit_template_of(p) for p in cfg.managed_pools}
                )
            except ValueError as exc:  # its message names the flag
                fail(PROG, str(exc))
        else:
            connector = VirtualConnector(runtime.discovery, runtime.lease, cfg.namespace, cfg.ack_timeout)
        runtime.resources.push_async_callback(connector.close)
        election: Election
        if cfg.discovery.startswith("etcd://"):
            election = EtcdElection(cfg.discovery, cfg.namespace, runtime.instance_id, cfg.lease_ttl)
        else:
            election = FileElection(cfg.discovery.removeprefix("file://"), cfg.namespace)
        planner = Planner(cfg, runtime, observer, connector, election, profile)
        runtime.add_service(planner_pb2.DESCRIPTOR.services_by_name["PlannerService"], planner.servicer)
        runtime.on_draining(planner.servicer.close)
        await runtime.start(cfg.grpc_port)
        await runtime.register(runtime.instance_record("planner", "planner"))
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(election.run()), loop.create_task(planner.run())]

        async def stop_tasks() -> None:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

        runtime.resources.push_async_callback(stop_tasks)
        log.info(
            "planner on %s: mode %s, connector %s, pools %s, budget %d engines, every %gs (instance %x)",
            runtime.address,
            cfg.effective_mode,
            connector.name,
            ", ".join(f"{p} in [{cfg.pool_bounds(p)[0]}, {cfg.pool_bounds(p)[1]}]" for p in cfg.managed_pools),
            cfg.budget,
            cfg.interval,
            runtime.instance_id,
        )
        await runtime.wait_for_stop()
        log.info("stopping: resigning leadership, deregistering")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    cfg = Settings.load(PROG, "kvmesh planner: scales the worker pools to meet latency targets", argv)
    return run_daemon(PROG, cfg, serve)


if __name__ == "__main__":
    sys.exit(main())
