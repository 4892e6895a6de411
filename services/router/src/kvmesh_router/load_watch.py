"""Engine-reported KV usage for the ``--busy-kv-usage`` threshold: one ``WatchLoad`` stream per worker.

The slot tracker predicts each engine's active blocks from this replica's (and its peers') bookings;
an engine also runs requests nobody here booked (another deployment's router, direct callers), so the
busy check takes the larger of the prediction and the engine's own figure (Dynamo latches the decode
check on the worker-reported ``kv_used_blocks`` the same way). Only started when the threshold is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping

import grpc
from kvmesh.backoff import Backoff
from kvmesh.v1 import worker_pb2, worker_pb2_grpc

from kvmesh_router.engines import EngineInfo
from kvmesh_router.state import RouterState

__all__ = ["LoadWatch"]

log = logging.getLogger(__name__)


class LoadWatch:
    def __init__(self, state: RouterState, channel_for: Callable[[str], grpc.aio.Channel]) -> None:
        self.state = state
        self.channel_for = channel_for
        self._watches: dict[str, tuple[frozenset[int], asyncio.Task[None]]] = {}

    def sync(self, engines: Mapping[int, EngineInfo]) -> None:
        """Watch exactly the worker processes that host ``engines`` (call on every fleet change)."""
        by_address: dict[str, set[int]] = {}
        for info in engines.values():
            by_address.setdefault(info.address, set()).add(info.engine_id)
        for address in [a for a in self._watches if a not in by_address]:
            self._watches.pop(address)[1].cancel()
        loop = asyncio.get_running_loop()
        for address, ids in by_address.items():
            wanted = frozenset(ids)
            current = self._watches.get(address)
            if current is not None and current[0] == wanted:
                continue
            if current is not None:
                current[1].cancel()
            task = loop.create_task(self._watch(address, wanted), name=f"load-watch-{address}")
            self._watches[address] = (wanted, task)

    async def _watch(self, address: str, engine_ids: frozenset[int]) -> None:
        stub = worker_pb2_grpc.WorkerServiceStub(self.channel_for(address))
        report = self.state.admission.report_kv_usage
        backoff = Backoff(0.1, 2.0)
        every_engine = False  # ask for what the worker hosts, not for ``engine_ids``
        while True:
            call = stub.WatchLoad(worker_pb2.WatchLoadRequest(engine_ids=[] if every_engine else sorted(engine_ids)))
            try:
                async for message in call:
                    if backoff.attempts:
                        backoff.reset()
                    for load in message.loads:
                        if load.engine_id in engine_ids and load.engine_id in self.state.engines:
                            report(load.engine_id, load.active_blocks)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND and not every_engine:
                    # Some of them are gone from there (a worker restarted on its address with new engines,
                    # before the old records expired): the others' load must not wait for that expiry.
                    every_engine = True
                log.info("load watch of %s broke (%s); retrying", address, exc.code().name)
            finally:
                call.cancel()
            await backoff.sleep()

    async def close(self) -> None:
        tasks = [task for _, task in self._watches.values()]
        self._watches.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
