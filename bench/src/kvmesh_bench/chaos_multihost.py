"""``kvmesh bench chaos --topology multihost``: the fault suite's mesh on the multi-host harness.

:class:`MultiHostMesh` has the interface of ``chaos.Mesh`` (``worker``, ``router``, ``start_frontend``,
``etcd.stop/start/freeze/thaw``, ``metric``, ``rss``, ``check``, ``close``), so every loopback scenario
runs unchanged with each daemon on its own host (``kvmesh_bench.multihost``): workers on ``worker1..``,
routers on ``router1..``, frontends on ``frontend1..``, and etcd is a 3-member cluster (the etcd
scenarios stop, start, freeze and thaw all three). The partition scenarios (``chaos.SCENARIOS``, names
starting ``partition-`` and ``etcd-member-``) need this topology and use :attr:`MultiHostMesh.cluster`.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from pathlib import Path

from kvmesh_bench.local_procs import process_cpu_s
from kvmesh_bench.multihost import Cluster, Daemon


class _EtcdCluster:
    """The chaos scenarios' ``mesh.etcd``: all three members at once."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.started = False

    @property
    def url(self) -> str:
        return self.cluster.etcd_url

    def start(self) -> None:
        if not self.started:
            self.started = True
            self.cluster.net.up()
            self.cluster.start_etcd()
            return
        for member in self.cluster.etcd:
            if not member.alive:
                member.restart()
        self.cluster.wait_etcd_healthy(range(len(self.cluster.etcd)))

    def stop(self) -> None:
        for member in self.cluster.etcd:
            member.stop()

    def freeze(self) -> None:
        for member in self.cluster.etcd:
            member.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        for member in self.cluster.etcd:
            member.signal(signal.SIGCONT)


class MultiHostMesh:
    """``chaos.Mesh`` on the multi-host harness (see the module docstring)."""

    def __init__(
        self, workdir: Path, lease_ttl: float, log_level: str = "info", frontend_flags: Sequence[str] = ()
    ) -> None:
        self.cluster = Cluster(workdir, lease_ttl=lease_ttl, log_level=log_level)
        self.etcd = _EtcdCluster(self.cluster)
        self.frontend: Daemon | None = None
        self.frontend_flags = list(frontend_flags)

    @property
    def procs(self) -> list[Daemon]:
        return self.cluster.daemons

    def _next_host(self, kind: str) -> str:
        return f"{kind}{len(self.cluster.of(kind)) + 1}"

    def worker(self, engines: int, *extra: str) -> Daemon:
        speedup = 4.0
        if "--speedup-ratio" in extra:  # the loopback scenarios pass it as a flag
            i = extra.index("--speedup-ratio")
            speedup, extra = float(extra[i + 1]), extra[:i] + extra[i + 2 :]
        return self.cluster.worker(
            self._next_host("worker"), *extra, engines=engines, speedup=speedup, wait=False
        )  # the scenario waits for its engines

    def router(self, *extra: str) -> Daemon:
        return self.cluster.router(self._next_host("router"), *extra, wait=False)

    def start_frontend(self, *extra: str) -> Daemon:
        daemon = self.cluster.frontend(self._next_host("frontend"), *extra, *self.frontend_flags)
        self.frontend = self.frontend or daemon  # the load goes to the first one
        return daemon

    @property
    def frontend_address(self) -> str:
        assert self.frontend is not None
        return self.frontend.address

    def check(self) -> None:
        self.cluster.check()

    def rss(self) -> dict[str, float]:
        return self.cluster.rss()

    def cpu(self) -> dict[tuple[str, int], float]:
        """As ``chaos.Mesh.cpu``: CPU seconds per live daemon keyed (kind, pid), the load generator ("client", 0)."""
        out = {("client", 0): time.process_time()}
        out.update(((d.kind, d.proc.pid), process_cpu_s(d.proc.pid)) for d in self.cluster.daemons if d.alive)
        return out

    def metric_sum(self, kind: str, name: str) -> float:
        return self.cluster.metric_sum(kind, name)

    @staticmethod
    def metric(proc: Daemon, name: str) -> float:
        return Cluster.metric(proc, name)

    def close(self) -> None:
        self.cluster.close()
