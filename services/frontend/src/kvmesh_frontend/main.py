"""``kvmesh-frontend``: flags and wiring.

Startup: parse flags (exit 2 on bad config) → take the discovery lease (exit 2 if discovery is
unreachable) → serve ``inference.GRPCInferenceService`` on ``--grpc-port`` → watch model cards and
router replicas → register ``InstanceRecord{component="frontend", endpoint="kserve"}``.
SIGTERM/SIGINT: deregister, drain in-flight calls for ``--drain-timeout`` seconds, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
from collections.abc import Callable, Sequence
from contextlib import aclosing
from pathlib import Path

from kvmesh.channels import ChannelPool
from kvmesh.discovery.base import Discovery, WatchEvent, instance_prefix, model_prefix
from kvmesh.grpc_options import FRONTEND_SERVER_OPTIONS
from kvmesh.identity import BearerTokenGate
from kvmesh.runtime import VERSION, DaemonRuntime, run_daemon
from kvmesh.settings import fail

from kvmesh_frontend.disagg import DisaggPolicy
from kvmesh_frontend.generation import Generator
from kvmesh_frontend.metrics import default_metrics
from kvmesh_frontend.models import ModelRegistry
from kvmesh_frontend.pipeline import Frontend
from kvmesh_frontend.routing import RouterClient
from kvmesh_frontend.service import IN_BAND, SERVICE, InferenceServicer
from kvmesh_frontend.settings import Settings

PROG = "kvmesh-frontend"
log = logging.getLogger(PROG)


READINESS_POLL_S = 0.2
READY = "ready: a router replica is reachable and a model has a live engine; health SERVING"
NOT_READY = "not ready: no reachable router replica or no model with a live engine; health NOT_SERVING"


def main(argv: Sequence[str] | None = None) -> int:
    config = Settings.load(PROG, "KServe v2 / Triton-compatible gRPC frontend of a kvmesh deployment", argv)
    return run_daemon(PROG, config, serve)


async def _watch(discovery: Discovery, prefix: str, apply: Callable[[WatchEvent], None]) -> None:
    async with aclosing(discovery.list_and_watch(prefix)) as events:
        async for event in events:
            try:
                apply(event)
            except Exception:  # one bad event must not stop the watch
                log.exception("discovery event under %s could not be applied", prefix)


async def _follow_readiness(runtime: DaemonRuntime, server_ready: Callable[[], bool]) -> None:
    """grpc.health.v1 says what ServerReady says, as Triton's does: NOT_SERVING while no router replica
    is reachable or no model has a live engine, so a load balancer probing health sends nothing to a
    frontend whose every request would fail. Polled: readiness moves with discovery, with tokenizers
    that finish loading and with router channels, and a check is a few dictionary lookups and a channel
    state per replica."""
    ready: bool | None = None
    while True:
        now = server_ready()
        if now != ready:
            log.log(logging.WARNING if ready and not now else logging.INFO, "%s", READY if now else NOT_READY)
            await runtime.set_ready(now)
            ready = now
        await asyncio.sleep(READINESS_POLL_S)


def kserve_auth(config: Settings) -> tuple[BearerTokenGate, ...]:
    """KServe client authentication by bearer token, when --kserve-token-file is set; one line, exit 2 if unreadable."""
    if not config.kserve_token_file:
        return ()
    # The value is never echoed: a token given in place of its file's path would go to the logs.
    try:
        token = Path(config.kserve_token_file).read_text(encoding="utf-8").strip()
    except OSError as exc:
        fail(PROG, f"--kserve-token-file: cannot read the file ({exc.strerror}; give the token file's path)")
    except UnicodeDecodeError:
        fail(PROG, "--kserve-token-file: the file is not UTF-8 text")
    if not token:
        fail(PROG, "--kserve-token-file: the file is empty")
    if not _TOKEN_CHARS.fullmatch(token):  # else no client could send it: gRPC refuses such header bytes
        fail(PROG, "--kserve-token-file: the token must be one line of RFC 6750 characters (A-Z a-z 0-9 -._~+/=)")
    return (BearerTokenGate(token),)


_TOKEN_CHARS = re.compile(r"[A-Za-z0-9\-._~+/]+=*")  # RFC 6750 b64token


async def serve(config: Settings) -> None:
    async with DaemonRuntime(
        PROG, config, server_options=FRONTEND_SERVER_OPTIONS, interceptors=kserve_auth(config)
    ) as runtime:
        await _serve(runtime, config)
    log.info("stopped")


async def _serve(runtime: DaemonRuntime, config: Settings) -> None:
    """Build the frontend on ``runtime``; what it opens closes, after the drain, in reverse order."""
    pool = ChannelPool()
    runtime.resources.push_async_callback(pool.close)
    registry = ModelRegistry(pool, config.namespace, fetch_timeout=config.model_fetch_timeout)
    runtime.resources.push_async_callback(registry.close)
    router = RouterClient(pool, config.namespace, route_timeout=config.route_timeout, route_hedge=config.route_hedge)
    metrics = default_metrics()
    generator = Generator(
        router,
        pool,
        migration_limit=config.migration_limit,
        on_migration=metrics.migration,
        engine_alive=registry.engine_alive,
        address_live=registry.address_live,
        disagg_policy=DisaggPolicy(config.disagg_busy, config.enforce_disagg),
        model_roles=registry.roles,
        engine_addresses=registry.engine_addresses,
        down_s=config.lease_ttl + 1.0,  # by then discovery has dropped a dead worker
        departed_engines=registry.departed,
    )
    runtime.resources.push_async_callback(generator.disagg.close)
    runtime.resources.push_async_callback(generator.engines.close)
    runtime.resources.push_async_callback(router.close)
    registry.on_address_gone = generator.engines.retire
    registry.on_engine_joined = generator.engines.revive
    frontend = Frontend(
        registry,
        generator,
        metrics,
        id_prefix=f"{runtime.instance_id:x}",
        default_max_tokens=config.default_max_tokens,
        admission_factor=config.admission_factor,
    )
    servicer = InferenceServicer(frontend, VERSION, router.has_reachable_replica)
    runtime.add_service(SERVICE, servicer, in_band=IN_BAND)
    bound = await runtime.start(
        config.grpc_port, ready=False, require_client_cert=config.kserve_client_cert, notify_before_ready=True
    )
    watchers = [
        asyncio.create_task(_follow_readiness(runtime, servicer.server_ready)),
        asyncio.create_task(_watch(runtime.discovery, model_prefix(config.namespace), registry.apply)),
        asyncio.create_task(
            _watch(runtime.discovery, instance_prefix(config.namespace, "router", "router"), router.apply)
        ),
    ]

    async def stop_watching() -> None:  # the registry stays as it is while in-flight requests drain
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)

    runtime.on_draining(stop_watching)
    runtime.on_draining(servicer.drain)
    await runtime.register(runtime.instance_record("frontend", "kserve"))
    log.info(
        "serving KServe v2 gRPC on %s:%d (instance %x, namespace %s, discovery %s)",
        config.bind_host,
        bound,
        runtime.instance_id,
        config.namespace,
        config.discovery,
    )
    await runtime.wait_for_stop()
    log.info("shutting down: draining in-flight requests for up to %gs", config.drain_timeout)


if __name__ == "__main__":
    sys.exit(main())
