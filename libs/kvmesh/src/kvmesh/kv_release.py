"""Fire-and-forget ``ReleaseKv`` to a KV transfer's source worker.

Both the frontend (after a failed or finished disaggregated request) and a decode worker (after
its pull) tell the prefill side to drop its hold. The call is best effort: the source's lease is
the backstop, so a failure is only logged.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from kvmesh import telemetry
from kvmesh.channels import ChannelPool
from kvmesh.v1 import worker_pb2, worker_pb2_grpc
from kvmesh.v1.kv_transfer_pb2 import KvTransferParams

RELEASE_CHANNELS = 64  # prefill workers kept a channel to (the pool of a KvReleases is keyed by their addresses)


class KvReleases:
    """Starts ``ReleaseKv`` calls in the background; ``wait`` lets the ones under way finish."""

    def __init__(self, pool: ChannelPool, log: logging.Logger, level: int) -> None:
        self._pool = pool
        self._log = log
        self._level = level  # how loud a failed release is logged
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, params: KvTransferParams, span: Any = None) -> None:
        """Release in the background, in the trace of ``span`` (else of the request being served)."""
        task = asyncio.get_running_loop().create_task(self._release(params, span))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, params: KvTransferParams, span: Any) -> None:
        try:
            with telemetry.current_span(span):
                await self._call(params)
        except grpc.aio.AioRpcError as exc:
            self._log.log(
                self._level, "ReleaseKv %s at %s: %s", params.transfer_id, params.source_address, exc.code().name
            )

    async def _call(self, params: KvTransferParams) -> None:
        channel = self._pool.get(params.source_address, params.source_address, role="worker")
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        await stub.ReleaseKv(
            worker_pb2.ReleaseKvRequest(engine_id=params.source_engine_id, transfer_id=params.transfer_id),
            timeout=2.0,
        )

    async def wait(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)
