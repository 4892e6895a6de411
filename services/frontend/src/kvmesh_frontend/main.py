"""``kvmesh-frontend``: flags and wiring.

Startup: parse flags (exit 2 on bad config) → take the discovery lease (exit 2 if discovery is
unreachable) → serve ``inference.GRPCInferenceService`` on ``--grpc-port`` → watch model cards and
router replicas → register ``InstanceRecord{component="frontend", endpoint="kserve"}``.
SIGTERM/SIGINT: deregister, drain in-flight calls for ``--drain-timeout`` seconds, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, Sequence
from contextlib import aclosing

import uvloop
from inference import grpc_service_pb2, grpc_service_pb2_grpc
from kvmesh import telemetry
from kvmesh.channels import ChannelPool
from kvmesh.config import Config, Flag, non_negative_float, non_negative_int, parse_config, port, positive_int
from kvmesh.discovery.base import Discovery, WatchEvent, instance_prefix, model_prefix
from kvmesh.runtime import VERSION, DaemonRuntime

from kvmesh_frontend.generation import Generator
from kvmesh_frontend.metrics import default_metrics
from kvmesh_frontend.models import ModelRegistry
from kvmesh_frontend.pipeline import DEFAULT_MAX_TOKENS, Frontend
from kvmesh_frontend.routing import RouterClient
from kvmesh_frontend.service import InferenceServicer

PROG = "kvmesh-frontend"
log = logging.getLogger(PROG)

FLAGS: tuple[Flag, ...] = (
    Flag("grpc-port", "KServe v2 gRPC port (Triton's default; 0 picks a free one)", default=8001, type=port),
    Flag("bind-host", "interface the gRPC server listens on", default="0.0.0.0"),
    Flag(
        "migration-limit",
        "times a request may move to another engine when its engine dies mid-stream (0 = off)",
        default=3,
        type=non_negative_int,
    ),
    Flag(
        "route-timeout",
        "seconds to wait for a router decision before answering UNAVAILABLE",
        default=30.0,
        type=non_negative_float,
        metavar="SECONDS",
    ),
    Flag("default-max-tokens", "max_tokens of requests that do not say", default=DEFAULT_MAX_TOKENS, type=positive_int),
    Flag(
        "model-fetch-timeout",
        "seconds to download a model's tokenizer files from a worker",
        default=30.0,
        type=non_negative_float,
        metavar="SECONDS",
    ),
)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(PROG, "KServe v2 / Triton-compatible gRPC frontend of a kvmesh deployment", FLAGS, argv)
    telemetry.setup_logging(PROG, config.log_level, config.log_format)
    telemetry.setup_tracing(PROG, config.otel_exporter, config.otel_endpoint)
    uvloop.run(serve(config))
    return 0


async def _watch(discovery: Discovery, prefix: str, apply: Callable[[WatchEvent], None]) -> None:
    async with aclosing(discovery.list_and_watch(prefix)) as events:
        async for event in events:
            try:
                apply(event)
            except Exception:  # one bad event must not stop the watch
                log.exception("discovery event under %s could not be applied", prefix)


async def serve(config: Config) -> None:
    runtime = DaemonRuntime(PROG, config)
    await runtime.connect()
    assert runtime.discovery is not None
    pool = ChannelPool()
    registry = ModelRegistry(pool, config.namespace, fetch_timeout=config.model_fetch_timeout)
    router = RouterClient(pool, config.namespace, route_timeout=config.route_timeout)
    metrics = default_metrics()
    generator = Generator(
        router,
        pool,
        migration_limit=config.migration_limit,
        on_migration=metrics.migration,
        engine_alive=registry.engine_alive,
        address_live=registry.address_live,
    )
    registry.on_address_gone = generator.engines.retire
    frontend = Frontend(
        registry, generator, metrics, id_prefix=f"{runtime.instance_id:x}", default_max_tokens=config.default_max_tokens
    )
    service_name = grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
    runtime.add_service(
        service_name,
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server,
        InferenceServicer(frontend, VERSION),
    )
    bound = await runtime.start(config.grpc_port, bind_host=config.bind_host)
    watchers = [
        asyncio.create_task(_watch(runtime.discovery, model_prefix(config.namespace), registry.apply)),
        asyncio.create_task(
            _watch(runtime.discovery, instance_prefix(config.namespace, "router", "router"), router.apply)
        ),
    ]
    await runtime.register(runtime.instance_record("frontend", "kserve"))
    log.info(
        "serving KServe v2 gRPC on %s:%d (instance %x, namespace %s, discovery %s)",
        config.bind_host,
        bound,
        runtime.instance_id,
        config.namespace,
        config.discovery,
    )
    try:
        await runtime.wait_for_stop()
    finally:
        log.info("shutting down: draining in-flight requests for up to %gs", config.drain_timeout)
        for task in watchers:  # the registry stays as it is while in-flight requests drain
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        await runtime.shutdown()
        await router.close()
        await generator.engines.close()
        await registry.close()
        await pool.close()
    log.info("stopped")


if __name__ == "__main__":
    sys.exit(main())
