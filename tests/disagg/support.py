"""Disaggregated meshes of real processes for the tests in this directory."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from kvmesh.discovery import model_prefix, open_discovery
from kvmesh.v1 import discovery_pb2, worker_pb2, worker_pb2_grpc

from tests.support.daemons import Daemon
from tests.support.etcd import free_port

BLOCK = 4
NUM_BLOCKS = 256


def worker(
    tmp: Path, discovery: str, namespace: str, role: str, *extra: str, env: dict[str, str] | None = None
) -> Daemon:
    port = free_port()
    daemon = Daemon(
        "kvmesh-worker",
        [
            "--discovery", discovery,
            "--namespace", namespace,
            "--lease-ttl", "2",
            "--drain-timeout", "1",
            "--grpc-port", str(port),
            "--block-size", str(BLOCK),
            "--num-gpu-blocks", str(NUM_BLOCKS),
            "--role", role,
            *extra,
        ],
        tmp,
        port,
        env=env,
    )  # fmt: skip
    return daemon


async def cards(discovery: str, namespace: str) -> list[discovery_pb2.ModelCard]:
    disc = await open_discovery(discovery, ttl=2.0)
    try:
        values = await disc.get_prefix(model_prefix(namespace))
    finally:
        await disc.close()
    return [discovery_pb2.ModelCard.FromString(v) for v in values.values()]


def cards_sync(discovery: str, namespace: str, want: int, timeout: float = 20.0) -> list[discovery_pb2.ModelCard]:
    deadline = time.monotonic() + timeout
    while True:
        found = asyncio.run(cards(discovery, namespace))
        if len(found) >= want or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def load(address: str, engine_id: int) -> worker_pb2.EngineLoad:
    import grpc

    with grpc.insecure_channel(address) as channel:
        stream = worker_pb2_grpc.WorkerServiceStub(channel).WatchLoad(
            worker_pb2.WatchLoadRequest(engine_ids=[engine_id]), timeout=5
        )
        first = next(iter(stream))
        stream.cancel()
    return first.loads[0]


def wait_no_active_blocks(address: str, engine_id: int, timeout: float = 1.0) -> worker_pb2.EngineLoad:
    """The engine holds no block (no request, no hold, no pin) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        current = load(address, engine_id)
        if current.active_blocks == 0 or time.monotonic() > deadline:
            return current
        time.sleep(0.02)


def all_loads(address: str) -> list[worker_pb2.EngineLoad]:
    """Every engine's current load at a worker (WatchLoad's first message)."""
    import grpc

    with grpc.insecure_channel(address) as channel:
        stream = worker_pb2_grpc.WorkerServiceStub(channel).WatchLoad(worker_pb2.WatchLoadRequest(), timeout=5)
        first = next(iter(stream))
        stream.cancel()
    return list(first.loads)
