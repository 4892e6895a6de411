"""``systemd`` connector: engines are instances of one template unit per pool.

Pools and their template units (``packaging/systemd``): aggregated ``kvmesh-worker@.service``, prefill
``kvmesh-worker-prefill@.service``, decode ``kvmesh-worker-decode@.service``. The role units are the
aggregated unit plus ``Environment=KVMESH_ROLE=prefill|decode`` (a test keeps them identical otherwise):
a role has to be in the unit, since systemd cannot derive a flag from part of an instance name, and an
instance's environment file (``/etc/kvmesh/worker-%i.env``) is the operator's, not the planner's.
Instance numbers are per template: ``kvmesh-worker-prefill@1`` and ``kvmesh-worker-decode@1`` coexist.

Exact command sequence, per managed pool, with ``kvmesh-worker@`` standing for the pool's template
(``tests/planner/test_connectors.py`` checks it with a ``systemctl`` on PATH that records its argv):

- adopt at start: ``systemctl list-units --plain --no-legend --state=active kvmesh-worker@*.service``;
- scale up by k: ``systemctl start kvmesh-worker@N.service`` for the k lowest free instance numbers;
- map instances to engines: ``systemctl show --property MainPID --value kvmesh-worker@N.service``
  (an engine's discovery record carries its pid);
- scale down by k: ``systemctl stop --no-block kvmesh-worker@N.service`` for the pool's k least-loaded
  engines' units (instances not registered yet first). systemd sends SIGTERM: the worker deregisters at
  once and drains; the unit's ``TimeoutStopSec`` is above the worker's ``--drain-timeout``.
- follow the drain: ``systemctl is-active kvmesh-worker@N.service`` until it is not ``active`` /
  ``deactivating``.

Pools are applied in the order aggregated, prefill, decode. systemctl is run as a subprocess (no D-Bus
binding needed); ``--systemctl 'systemctl --user'`` drives user units. The planner never stops units it
did not see as an instance of a managed pool's template.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shlex
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvmesh_planner.connectors.base import EngineRef
from kvmesh_planner.core.model import Pool

log = logging.getLogger(__name__)


class SystemctlError(RuntimeError):
    pass


DEFAULT_TEMPLATES: dict[Pool, str] = {
    "aggregated": "kvmesh-worker@.service",
    "prefill": "kvmesh-worker-prefill@.service",
    "decode": "kvmesh-worker-decode@.service",
}


@dataclass(slots=True)
class _Unit:
    pool: Pool
    number: int
    pid: int = 0
    draining: bool = False


class SystemdConnector:
    name = "systemd"

    def __init__(
        self,
        systemctl: str = "systemctl",
        template: str = DEFAULT_TEMPLATES["aggregated"],
        templates: Mapping[Pool, str] | None = None,
    ) -> None:
        """``templates`` maps each managed pool to its template unit; default: the aggregated pool on ``template``."""
        templates = dict(templates) if templates is not None else {"aggregated": template}
        for t in templates.values():
            if not t.endswith("@.service"):
                raise ValueError(f"--unit-template: {t!r} is not a template unit (NAME@.service)")
        try:
            self._systemctl = shlex.split(systemctl)
        except ValueError as exc:
            raise ValueError(f"--systemctl: {systemctl!r}: {exc}") from None
        if not self._systemctl or shutil.which(self._systemctl[0]) is None:  # at start, not at every tick
            raise ValueError(f"--systemctl: {systemctl!r} is not an executable")
        self._prefix = {pool: t.removesuffix(".service") for pool, t in templates.items()}  # "kvmesh-worker@"
        self._units: dict[tuple[Pool, int], _Unit] = {}
        self._watchers: set[asyncio.Task[None]] = set()

    def unit(self, number: int, pool: Pool = "aggregated") -> str:
        return f"{self._prefix[pool]}{number}.service"

    def _name(self, u: _Unit) -> str:
        return self.unit(u.number, u.pool)

    async def _run(self, *args: str, check: bool = True) -> str:
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._systemctl,
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as exc:  # systemctl removed (or made unrunnable) since start-up
            raise SystemctlError(f"{shlex.join([*self._systemctl, *args])}: {exc}") from None
        out, err = await proc.communicate()
        if check and proc.returncode != 0:
            raise SystemctlError(f"{shlex.join([*self._systemctl, *args])}: {err.decode().strip() or proc.returncode}")
        return out.decode()

    async def start(self) -> None:
        for pool, prefix in self._prefix.items():
            out = await self._run("list-units", "--plain", "--no-legend", "--state=active", f"{prefix}*.service")
            pattern = re.compile(re.escape(prefix) + r"(\d+)\.service")
            for line in out.splitlines():
                m = pattern.match(line.strip())
                if m:
                    n = int(m.group(1))
                    self._units[(pool, n)] = _Unit(pool, n)
        await self._refresh_pids()
        if self._units:
            log.info("systemd connector: adopted %s", ", ".join(self._name(u) for u in self._sorted()))

    def _sorted(self) -> list[_Unit]:
        order = {p: i for i, p in enumerate(self._prefix)}
        return sorted(self._units.values(), key=lambda u: (order[u.pool], u.number))

    async def _refresh_pids(self, registered: set[int] | None = None) -> None:
        for u in self._sorted():
            if not u.pid or (registered is not None and not u.draining and u.pid not in registered):
                text = (await self._run("show", "--property", "MainPID", "--value", self._name(u))).strip()
                u.pid = int(text) if text.isdigit() else 0

    async def refresh_pids(self, registered: set[int]) -> None:
        """Look again at the main pid of every unit whose pid is unknown or not a registered engine's: a
        unit that systemd restarted (``Restart=on-failure``) has a new one. Cached, it counted as starting
        forever and was drained first as 'unregistered', even when it was the busiest engine."""
        await self._refresh_pids(registered)

    def _live(self, pool: Pool) -> list[_Unit]:
        return [u for u in self._sorted() if u.pool == pool and not u.draining]

    def actual(self) -> dict[Pool, int]:
        return {p: len(self._live(p)) for p in self._prefix}

    def starting(self, registered_pids: set[int]) -> dict[Pool, int]:
        return {p: sum(1 for u in self._live(p) if not u.pid or u.pid not in registered_pids) for p in self._prefix}

    def draining(self) -> dict[Pool, int]:
        return {p: sum(1 for u in self._units.values() if u.pool == p and u.draining) for p in self._prefix}

    async def apply(self, decision_id: int, target: Mapping[Pool, int], engines: Sequence[EngineRef]) -> bool:
        await self._refresh_pids()
        for pool in self._prefix:
            want = target.get(pool)
            if want is None:
                continue
            live = self._live(pool)
            if want > len(live):
                number = 1
                for _ in range(want - len(live)):
                    while (pool, number) in self._units:
                        number += 1
                    await self._run("start", self.unit(number, pool))
                    self._units[(pool, number)] = _Unit(pool, number)
                    log.info("systemd connector: started %s", self.unit(number, pool))
                await self._refresh_pids()
            elif want < len(live):
                by_pid = {u.pid: u for u in live if u.pid}
                mine = [e for e in engines if e.pool == pool]
                registered = {e.pid for e in mine}
                order = [u for u in live if u.pid not in registered]
                order += [by_pid[e.pid] for e in mine if e.pid in by_pid]
                for u in order[: len(live) - want]:
                    await self._run("stop", "--no-block", self._name(u))
                    u.draining = True
                    log.info("systemd connector: draining %s (pid %d)", self._name(u), u.pid)
                    task = asyncio.get_running_loop().create_task(self._follow(u))
                    self._watchers.add(task)
                    task.add_done_callback(self._watchers.discard)
        return True

    async def _follow(self, u: _Unit) -> None:
        """Forget the unit once systemd reports it stopped (its requests drained)."""
        while True:
            state = (await self._run("is-active", self._name(u), check=False)).strip()
            if state not in ("active", "deactivating", "activating", "reloading"):
                self._units.pop((u.pool, u.number), None)
                return
            await asyncio.sleep(0.5)

    async def close(self) -> None:
        for task in list(self._watchers):
            task.cancel()
