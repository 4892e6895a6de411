"""``local`` connector: the planner starts and stops ``kvmesh-worker`` processes itself (``kvmesh up --planner``).

One process per engine (``--num-engines 1``), so an engine is stopped by stopping its process. Scale-down
sends SIGTERM to the least-loaded engine's process: the worker deregisters at once (no new request is
routed to it) and finishes its in-flight requests before it exits (``--drain-timeout``). The processes
are the planner's children: closing the connector drains them too (``kvmesh up`` stops everything on
Ctrl-C). Only aggregated engines are managed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh_planner.connectors.base import EngineRef
from kvmesh_planner.core.model import Pool

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Worker:
    number: int
    proc: asyncio.subprocess.Process
    started: float
    draining: bool = False
    stopped_at: float = field(default=0.0)


class LocalConnector:
    name = "local"

    def __init__(
        self,
        worker_command: str,
        discovery: str,
        namespace: str,
        worker_args: str = "",
        drain_timeout: float = 30.0,
        log_dir: str | None = None,
    ) -> None:
        command = shlex.split(worker_command)
        if command and not shutil.which(command[0]):  # e.g. a venv's kvmesh-worker, not on PATH
            beside = Path(sys.executable).parent / command[0]
            if beside.exists():
                command[0] = str(beside)
        if not command or not shutil.which(command[0]):  # fail at start, not at the first scale-up
            raise ValueError(f"{worker_command!r} is not an executable")
        self._argv = [
            *command,
            "--discovery",
            discovery,
            "--namespace",
            namespace,
            "--num-engines",
            "1",
            "--drain-timeout",
            str(drain_timeout),
            *shlex.split(worker_args),
        ]
        self._workers: list[_Worker] = []
        self._next = 1
        self._log_dir = log_dir
        self._reapers: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        return None

    def _live(self) -> list[_Worker]:
        return [w for w in self._workers if not w.draining and w.proc.returncode is None]

    def actual(self) -> dict[Pool, int]:
        return {"aggregated": len(self._live())}

    def starting(self, registered_pids: set[int]) -> dict[Pool, int]:
        return {"aggregated": sum(1 for w in self._live() if w.proc.pid not in registered_pids)}

    def draining(self) -> dict[Pool, int]:
        return {"aggregated": sum(1 for w in self._workers if w.draining and w.proc.returncode is None)}

    def pids(self) -> set[int]:
        return {w.proc.pid for w in self._workers if w.proc.returncode is None}

    async def apply(self, decision_id: int, target: Mapping[Pool, int], engines: Sequence[EngineRef]) -> bool:
        want = target.get("aggregated")
        if want is None:
            return True
        live = self._live()
        if want > len(live):
            for _ in range(want - len(live)):
                await self._spawn()
        elif want < len(live):
            await self._stop_some(len(live) - want, live, engines)
        return True

    async def _spawn(self) -> None:
        number = self._next
        self._next += 1
        out: int | None = None
        if self._log_dir:
            os.makedirs(self._log_dir, exist_ok=True)
            out = os.open(os.path.join(self._log_dir, f"worker-{number}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out
            )
        finally:
            if out is not None:
                os.close(out)
        log.info("local connector: started worker %d (pid %d): %s", number, proc.pid, shlex.join(self._argv))
        self._workers.append(_Worker(number, proc, time.monotonic()))

    async def _stop_some(self, count: int, live: list[_Worker], engines: Sequence[EngineRef]) -> None:
        by_pid = {w.proc.pid: w for w in live}
        registered = {e.pid for e in engines}
        # Engines still starting first (nothing in flight), then registered ones, least loaded first.
        order = [w for w in live if w.proc.pid not in registered]
        order += [by_pid[e.pid] for e in engines if e.pid in by_pid]
        for worker in order[:count]:
            worker.draining = True
            worker.stopped_at = time.monotonic()
            log.info("local connector: draining worker %d (pid %d): SIGTERM", worker.number, worker.proc.pid)
            with contextlib.suppress(ProcessLookupError):
                worker.proc.send_signal(signal.SIGTERM)
            task = asyncio.get_running_loop().create_task(self._reap(worker))
            self._reapers.add(task)
            task.add_done_callback(self._reapers.discard)

    async def _reap(self, worker: _Worker) -> None:
        code = await worker.proc.wait()
        log.info("local connector: worker %d (pid %d) exited with %d", worker.number, worker.proc.pid, code)
        self._workers.remove(worker)

    def reap_failed(self) -> int:
        """Forget workers that died on their own (not drained); returns how many."""
        dead = [w for w in self._workers if not w.draining and w.proc.returncode is not None]
        for w in dead:
            log.warning("local connector: worker %d (pid %d) exited with %s", w.number, w.proc.pid, w.proc.returncode)
            self._workers.remove(w)
        return len(dead)

    async def close(self) -> None:
        """Drain every worker this planner started (they are its children) and wait for them."""
        for w in self._workers:
            if w.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(signal.SIGTERM)
        await asyncio.gather(*(w.proc.wait() for w in self._workers), return_exceptions=True)
        self._workers.clear()
