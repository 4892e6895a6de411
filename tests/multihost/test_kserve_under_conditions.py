"""The stock-tritonclient suite, unchanged, against a frontend on the multi-host mesh under each link condition.

The tests are those of ``tests/kserve_clients`` (generation and errors), imported here and run with a
``mesh`` whose frontend is ``frontend1`` of the directory's shared :class:`~kvmesh_bench.multihost.Cluster`
(conftest: 3 etcd members, 2 routers, 2 frontends, 3 workers, each on its own host) while one condition of
:data:`~kvmesh_bench.link_conditions.CONDITIONS` holds between every pair of hosts: 1 ms and 10 ms RTT,
0.1 % and 1 % loss, a 20 Mbit/s cap on frontend1's link. The two tests that start workers of their own
do so on new hosts, whose traffic crosses the conditioned links of the others. Needs root; fails in one
line without.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kvmesh_bench import link_conditions as lc
from kvmesh_bench.multihost import Cluster

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
from tests.multihost.conditions_mesh import ClusterMesh, conditioned

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=lc.CONDITIONS, ids=lambda c: c.name.replace(" ", ""))
def mesh(request: pytest.FixtureRequest, cluster: Cluster) -> Iterator[ClusterMesh]:
    yield from conditioned(cluster, request.param)
