"""The kserve_clients tests' ``mesh``, served by frontend1 of the multi-host cluster under a link condition."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import tritonclient.grpc as grpcclient
from kvmesh_bench import link_conditions as lc
from kvmesh_bench.multihost import Cluster, Daemon

from tests.kserve_clients.mesh import MODEL, wait_metric, wait_model_ready


class _Extra:
    """A worker a test adds (on a host of its own); ``close`` stops it, as ``tests.support.daemons.Daemon``."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def close(self) -> None:
        self.daemon.stop()


class ClusterMesh:
    """What the kserve_clients tests use of their ``Mesh``, served by the multi-host cluster's frontend1."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.frontend = cluster.frontends[0]
        self.extra: list[Daemon] = []

    @property
    def url_frontend(self) -> str:
        return self.frontend.address

    def client(self) -> grpcclient.InferenceServerClient:
        return grpcclient.InferenceServerClient(self.url_frontend)

    def metrics(self) -> str:
        with urllib.request.urlopen(self.frontend.metrics_url, timeout=10) as reply:
            return str(reply.read().decode())

    def router_metric(self, name: str) -> float:
        """The smallest value over the router replicas: either may take the next query."""
        return min(self.cluster.metric(router, name) for router in self.cluster.routers)

    def wait_router_metric(self, name: str, at_least: float, timeout: float = 30.0) -> float:
        return wait_metric(lambda: self.router_metric(name), name, at_least, timeout)

    def worker(self, *extra: str, engines: int = 1, speedup: float = 0.0) -> _Extra:
        host = f"extra{len(self.cluster.hosts)}"  # a new host each time: its ports are free
        daemon = self.cluster.worker(host, *extra, engines=engines, speedup=speedup)
        self.extra.append(daemon)
        return _Extra(daemon)

    def wait_model(self, model: str = MODEL, ready: bool = True, timeout: float = 60.0) -> float:
        return wait_model_ready(self.url_frontend, model, ready, timeout)


def conditioned(cluster: Cluster, condition: lc.Condition) -> Iterator[ClusterMesh]:
    """The body of a module-scoped ``mesh`` fixture: ``condition`` on every link while the module's tests run."""
    cluster.heal()
    cluster.check()
    links = lc.network_links(cluster.net)
    lc.apply_condition(list(links.values()), condition, capped=links[lc.CAPPED_HOST])
    try:
        deployment = ClusterMesh(cluster)
        deployment.wait_model()
        yield deployment
        cluster.check()
        for daemon in deployment.extra:  # the next condition's tests start from the standard layout
            daemon.stop()
    finally:
        lc.clear_all()
