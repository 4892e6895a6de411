"""``systemd`` connector: engines are instances of the template unit ``kvmesh-worker@.service``.

Exact command sequence (``tests/planner/test_connectors.py`` checks it with a ``systemctl`` on PATH that
records its argv):

- adopt at start: ``systemctl list-units --plain --no-legend --state=active kvmesh-worker@*.service``;
- scale up by k: ``systemctl start kvmesh-worker@N.service`` for the k lowest free instance numbers;
- map instances to engines: ``systemctl show --property MainPID --value kvmesh-worker@N.service``
  (an engine's discovery record carries its pid);
- scale down by k: ``systemctl stop --no-block kvmesh-worker@N.service`` for the k least-loaded
  engines' units (instances not registered yet first). systemd sends SIGTERM: the worker deregisters at
  once and drains; the unit's ``TimeoutStopSec`` is above the worker's ``--drain-timeout``.
- follow the drain: ``systemctl is-active kvmesh-worker@N.service`` until it is not ``active`` /
  ``deactivating``.

systemctl is run as a subprocess (no D-Bus binding needed); ``--systemctl 'systemctl --user'`` drives
user units. The planner never stops units it did not see as ``kvmesh-worker@N``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvmesh_planner.connectors.base import EngineRef
from kvmesh_planner.core.model import Pool

log = logging.getLogger(__name__)


class SystemctlError(RuntimeError):
    pass


@dataclass(slots=True)
class _Unit:
    number: int
    pid: int = 0
    draining: bool = False


class SystemdConnector:
    name = "systemd"

    def __init__(self, systemctl: str = "systemctl", template: str = "kvmesh-worker@.service") -> None:
        if not template.endswith("@.service"):
            raise ValueError(f"{template!r} is not a template unit (NAME@.service)")
        self._systemctl = shlex.split(systemctl)
        self._prefix = template.removesuffix(".service")  # "kvmesh-worker@"
        self._units: dict[int, _Unit] = {}
        self._watchers: set[asyncio.Task[None]] = set()

    def unit(self, number: int) -> str:
        return f"{self._prefix}{number}.service"

    async def _run(self, *args: str, check: bool = True) -> str:
        proc = await asyncio.create_subprocess_exec(
            *self._systemctl,
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        if check and proc.returncode != 0:
            raise SystemctlError(f"{shlex.join([*self._systemctl, *args])}: {err.decode().strip() or proc.returncode}")
        return out.decode()

    async def start(self) -> None:
        out = await self._run("list-units", "--plain", "--no-legend", "--state=active", f"{self._prefix}*.service")
        pattern = re.compile(re.escape(self._prefix) + r"(\d+)\.service")
        for line in out.splitlines():
            m = pattern.match(line.strip())
            if m:
                n = int(m.group(1))
                self._units[n] = _Unit(n)
        await self._refresh_pids()
        if self._units:
            log.info("systemd connector: adopted %s", ", ".join(self.unit(n) for n in sorted(self._units)))

    async def _refresh_pids(self) -> None:
        for u in self._units.values():
            if not u.pid:
                text = (await self._run("show", "--property", "MainPID", "--value", self.unit(u.number))).strip()
                u.pid = int(text) if text.isdigit() else 0

    def _live(self) -> list[_Unit]:
        return [u for u in self._units.values() if not u.draining]

    def actual(self) -> dict[Pool, int]:
        return {"aggregated": len(self._live())}

    def starting(self, registered_pids: set[int]) -> dict[Pool, int]:
        return {"aggregated": sum(1 for u in self._live() if not u.pid or u.pid not in registered_pids)}

    def draining(self) -> dict[Pool, int]:
        return {"aggregated": sum(1 for u in self._units.values() if u.draining)}

    async def apply(self, decision_id: int, target: Mapping[Pool, int], engines: Sequence[EngineRef]) -> bool:
        want = target.get("aggregated")
        if want is None:
            return True
        await self._refresh_pids()
        live = self._live()
        if want > len(live):
            number = 1
            for _ in range(want - len(live)):
                while number in self._units:
                    number += 1
                await self._run("start", self.unit(number))
                self._units[number] = _Unit(number)
                log.info("systemd connector: started %s", self.unit(number))
            await self._refresh_pids()
        elif want < len(live):
            by_pid = {u.pid: u for u in live if u.pid}
            registered = {e.pid for e in engines}
            order = [u for u in live if u.pid not in registered]
            order += [by_pid[e.pid] for e in engines if e.pid in by_pid]
            for u in order[: len(live) - want]:
                await self._run("stop", "--no-block", self.unit(u.number))
                u.draining = True
                log.info("systemd connector: draining %s (pid %d)", self.unit(u.number), u.pid)
                task = asyncio.get_running_loop().create_task(self._follow(u))
                self._watchers.add(task)
                task.add_done_callback(self._watchers.discard)
        return True

    async def _follow(self, u: _Unit) -> None:
        """Forget the unit once systemd reports it stopped (its requests drained)."""
        while True:
            state = (await self._run("is-active", self.unit(u.number), check=False)).strip()
            if state not in ("active", "deactivating", "activating", "reloading"):
                self._units.pop(u.number, None)
                return
            await asyncio.sleep(0.5)

    async def close(self) -> None:
        for task in list(self._watchers):
            task.cancel()
