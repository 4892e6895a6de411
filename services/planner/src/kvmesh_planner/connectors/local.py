"""``local`` connector: the planner starts and stops ``kvmesh-worker`` processes itself (``kvmesh up --planner``).

One process per engine (``--num-engines 1``), so an engine is stopped by stopping its process. Scale-down
sends SIGTERM to the least-loaded engine's process: the worker deregisters at once (no new request is
routed to it) and finishes its in-flight requests before it exits (``--drain-timeout``). The processes
are the planner's children: closing the connector drains them too (``kvmesh up`` stops everything on
Ctrl-C), and a planner that dies any other way (kill -9) takes them with it (``kvmesh.children``): a
restarted planner would neither adopt nor stop them. Each worker has one role (its pool): a prefill or
decode worker is started with ``--role prefill`` / ``--role decode``, an aggregated one with no role flag
(the worker's default). Pools are sized apart: a scale-down of one pool drains only that pool's
least-loaded workers.
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

from kvmesh.children import dies_with_parent
from kvmesh.settings import is_setting_variable

from kvmesh_planner.connectors.base import EngineRef
from kvmesh_planner.core.model import Pool

log = logging.getLogger(__name__)

#: What the connector puts on every worker's command line, which ``--worker-args`` may not override.
CONNECTOR_FLAGS = frozenset({"--discovery", "--namespace", "--num-engines", "--drain-timeout", "--role"})


@dataclass(slots=True)
class _Worker:
    number: int
    pool: Pool
    proc: asyncio.subprocess.Process
    started: float
    draining: bool = False
    stopped_at: float = field(default=0.0)
    registered: bool = False  # seen in discovery once: the start-up timeout is over for it


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
        pools: Sequence[Pool] = ("aggregated",),
        startup_timeout: float = 120.0,
    ) -> None:
        command = _split("--worker-command", worker_command)
        extra = _split("--worker-args", worker_args)
        for arg in extra:
            flag = arg.split("=", 1)[0]
            # argparse takes a unique prefix for the whole flag: --num-eng is --num-engines
            if flag.startswith("--") and len(flag) > 2 and any(own.startswith(flag) for own in CONNECTOR_FLAGS):
                raise ValueError(
                    f"--worker-args: {flag} is the local connector's to set (it starts one engine per worker, "
                    "in its pool's role, on the planner's own discovery and namespace)"
                )
        if command and not shutil.which(command[0]):  # e.g. a venv's kvmesh-worker, not on PATH
            beside = Path(sys.executable).parent / command[0]
            if beside.exists():
                command[0] = str(beside)
        if not command or not shutil.which(command[0]):  # fail at start, not at the first scale-up
            raise ValueError(f"--worker-command: {worker_command!r} is not an executable")
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
            *extra,
        ]
        self._pools = tuple(pools)
        self._startup_timeout = startup_timeout
        self._workers: list[_Worker] = []
        self._next = 1
        self._log_dir = log_dir
        self._reapers: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        return None

    def _live(self, pool: Pool | None = None) -> list[_Worker]:
        return [
            w
            for w in self._workers
            if not w.draining and w.proc.returncode is None and (pool is None or w.pool == pool)
        ]

    def actual(self) -> dict[Pool, int]:
        return {p: len(self._live(p)) for p in self._pools}

    def starting(self, registered_pids: set[int]) -> dict[Pool, int]:
        return {p: sum(1 for w in self._live(p) if w.proc.pid not in registered_pids) for p in self._pools}

    def draining(self) -> dict[Pool, int]:
        return {
            p: sum(1 for w in self._workers if w.pool == p and w.draining and w.proc.returncode is None)
            for p in self._pools
        }

    def pids(self) -> set[int]:
        return {w.proc.pid for w in self._workers if w.proc.returncode is None}

    async def apply(self, decision_id: int, target: Mapping[Pool, int], engines: Sequence[EngineRef]) -> bool:
        for pool, want in target.items():
            if pool not in self._pools:
                continue  # never scale a pool this connector was not given
            live = self._live(pool)
            if want > len(live):
                for _ in range(want - len(live)):
                    await self._spawn(pool)
            elif want < len(live):
                await self._stop_some(len(live) - want, live, [e for e in engines if e.pool == pool])
        return True

    def argv(self, pool: Pool) -> list[str]:
        """The command line of a worker of ``pool`` (aggregated: the worker's default role)."""
        return self._argv if pool == "aggregated" else [*self._argv, "--role", pool]

    async def _spawn(self, pool: Pool) -> None:
        number = self._next
        self._next += 1
        argv = self.argv(pool)
        out: int | None = None
        if self._log_dir:
            os.makedirs(self._log_dir, exist_ok=True)
            name = f"worker-{number}.log" if pool == "aggregated" else f"worker-{pool}-{number}.log"
            out = os.open(os.path.join(self._log_dir, name), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            proc = await asyncio.create_subprocess_exec(
                *dies_with_parent(argv), stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, env=_worker_env()
            )
        finally:
            if out is not None:
                os.close(out)
        log.info("local connector: started %s worker %d (pid %d): %s", pool, number, proc.pid, shlex.join(argv))
        self._workers.append(_Worker(number, pool, proc, time.monotonic()))

    async def _stop_some(self, count: int, live: list[_Worker], engines: Sequence[EngineRef]) -> None:
        by_pid = {w.proc.pid: w for w in live}
        registered = {e.pid for e in engines}
        # Engines still starting first (nothing in flight), then registered ones, least loaded first.
        order = [w for w in live if w.proc.pid not in registered]
        order += [by_pid[e.pid] for e in engines if e.pid in by_pid]
        for worker in order[:count]:
            worker.draining = True
            worker.stopped_at = time.monotonic()
            log.info(
                "local connector: draining %s worker %d (pid %d): SIGTERM", worker.pool, worker.number, worker.proc.pid
            )
            with contextlib.suppress(ProcessLookupError):
                worker.proc.send_signal(signal.SIGTERM)
            task = asyncio.get_running_loop().create_task(self._reap(worker))
            self._reapers.add(task)
            task.add_done_callback(self._reapers.discard)

    async def _reap(self, worker: _Worker) -> None:
        code = await worker.proc.wait()
        log.info("local connector: worker %d (pid %d) exited with %d", worker.number, worker.proc.pid, code)
        self._workers.remove(worker)

    def reap_failed(self, registered_pids: set[int]) -> int:
        """Forget workers that died on their own (not drained), and kill those that did not register within
        the startup timeout (counted as starting, they held the pool's scaling forever); returns how many.

        Only a worker that never registered can be stuck: one that registered and is out of discovery for
        a moment (its lease lost to a pause or an etcd outage) serves on and registers again by itself
        (``kvmesh.runtime``); killing it failed what it served."""
        dead = [w for w in self._workers if not w.draining and w.proc.returncode is not None]
        for w in dead:
            if w.proc.returncode == 2:  # every worker started so fails the same way: say so, loudly
                log.error(
                    "local connector: worker %d (pid %d) refused its settings (exit 2; its log says which): "
                    "check --worker-args",
                    w.number,
                    w.proc.pid,
                )
            else:
                log.warning(
                    "local connector: worker %d (pid %d) exited with %s", w.number, w.proc.pid, w.proc.returncode
                )
            self._workers.remove(w)
        now = time.monotonic()
        for w in self._live():
            w.registered = w.registered or w.proc.pid in registered_pids
        stuck = [
            w
            for w in self._live()
            if not w.registered and w.proc.pid not in registered_pids and now - w.started > self._startup_timeout
        ]
        for w in stuck:
            log.warning(
                "local connector: worker %d (pid %d) did not register within --startup-timeout %gs: killing it",
                w.number,
                w.proc.pid,
                self._startup_timeout,
            )
            w.draining, w.stopped_at = True, now  # nothing in flight on an unregistered worker: no drain
            with contextlib.suppress(ProcessLookupError):
                w.proc.kill()
            task = asyncio.get_running_loop().create_task(self._reap(w))
            self._reapers.add(task)
            task.add_done_callback(self._reapers.discard)
        return len(dead) + len(stuck)

    async def drain_all(self) -> int:
        """Drain every live worker (as a scale-down does); returns how many."""
        live = self._live()
        await self._stop_some(len(live), live, [])
        return len(live)

    async def close(self) -> None:
        """Drain every worker this planner started (they are its children) and wait for them.

        Workers already draining got their SIGTERM: a second one would cancel what they still serve."""
        for w in self._workers:
            if w.proc.returncode is None and not w.draining:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(signal.SIGTERM)
        await asyncio.gather(*(w.proc.wait() for w in self._workers), return_exceptions=True)
        self._workers.clear()


def _split(flag: str, value: str) -> list[str]:
    """``value`` as a shell would split it; ValueError naming ``flag`` (an unclosed quote, say)."""
    try:
        return shlex.split(value)
    except ValueError as exc:
        raise ValueError(f"{flag}: {value!r}: {exc}") from None


def _worker_env() -> dict[str, str]:
    """The planner's environment without its ``KVMESH_*`` settings: they are the planner's (its own port,
    pool bounds, certificate), and a worker refuses the ones it does not declare (exit 2, respawned every
    tick) or would bind the planner's port. A worker's settings come from the command line."""
    return {var: value for var, value in os.environ.items() if not is_setting_variable(var)}
