"""The stock-tritonclient suite, unchanged, against a frontend on the multi-host mesh under each link condition.

The tests are those of ``tests/kserve_clients`` (generation and errors), imported here and run with a
``mesh`` whose frontend is ``frontend1`` of the directory's shared :class:`~kvmesh_bench.multihost.Cluster`
(conftest: 3 etcd members, 2 routers, 2 frontends, 3 workers, each on its own host) while one condition of
:data:`~kvmesh_bench.link_conditions.CONDITIONS` holds between every pair of hosts: 1 ms and 10 ms RTT,
0.1 % and 1 % loss, a 20 Mbit/s cap on frontend1's link. Needs root; fails in one line without.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator

import pytest
import tritonclient.grpc as grpcclient
from kvmesh_bench import link_conditions as lc
from kvmesh_bench.multihost import Cluster, Daemon
from tritonclient.utils import InferenceServerException

from tests.kserve_clients.mesh import MODEL
from tests.kserve_clients.test_kserve_errors import (  # noqa: F401  (collected here, with this module's mesh)
    test_full_engine_is_resource_exhausted,
    test_in_band_errors_name_the_status_and_keep_the_stream,
    test_model_without_live_engine_is_unavailable,
    test_other_triton_rpcs_are_unimplemented,
    test_unary_errors,
    test_unknown_model_is_not_found,
)
from tests.kserve_clients.test_kserve_generation import (  # noqa: F401
    test_32_concurrent_requests_on_one_stream,
    test_empty_final_response,
    test_kv_routing_is_visible_and_pinning_works,
    test_model_metadata_and_decoupled_config,
    test_non_streaming_model_infer,
    test_prometheus_metrics,
    test_server_and_model_readiness,
    test_streaming_from_input_ids_and_from_messages,
    test_streaming_from_text_input,
)

pytestmark = pytest.mark.e2e


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

    def worker(self, *extra: str, engines: int = 1, speedup: float = 0.0) -> _Extra:
        host = f"extra{len(self.cluster.hosts)}"  # a new host each time: its ports are free
        daemon = self.cluster.worker(host, *extra, engines=engines, speedup=speedup)
        self.extra.append(daemon)
        return _Extra(daemon)

    def wait_model(self, model: str = MODEL, ready: bool = True, timeout: float = 60.0) -> float:
        start = time.monotonic()
        with self.client() as client:
            while time.monotonic() - start < timeout:
                try:
                    if client.is_model_ready(model) == ready:
                        return time.monotonic() - start
                except InferenceServerException:
                    pass
                time.sleep(0.1)
        raise AssertionError(f"ModelReady({model}) != {ready} within {timeout}s on {self.url_frontend}")


@pytest.fixture(scope="module", params=lc.CONDITIONS, ids=lambda c: c.name.replace(" ", ""))
def mesh(request: pytest.FixtureRequest, cluster: Cluster) -> Iterator[ClusterMesh]:
    condition: lc.Condition = request.param
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
