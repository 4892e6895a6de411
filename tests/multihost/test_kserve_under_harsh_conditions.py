"""The stock-tritonclient tests that start workers of their own, under the two harshest link conditions.

``test_model_without_live_engine_is_unavailable`` and ``test_full_engine_is_resource_exhausted`` (from
``tests/kserve_clients/test_kserve_errors.py``, unchanged) take ~12 s each; they run under 10 ms RTT and
1 % loss, the rest of the suite under every condition (``test_kserve_under_conditions.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kvmesh_bench import link_conditions as lc
from kvmesh_bench.multihost import Cluster

from tests.kserve_clients.test_kserve_errors import (  # noqa: F401  (collected here, with this module's mesh)
    test_full_engine_is_resource_exhausted,
    test_model_without_live_engine_is_unavailable,
)
from tests.multihost.conditions_mesh import ClusterMesh, conditioned

pytestmark = pytest.mark.e2e

HARSH = [c for c in lc.CONDITIONS if c.name in ("rtt 10 ms", "loss 1 %")]


@pytest.fixture(scope="module", params=HARSH, ids=lambda c: c.name.replace(" ", ""))
def mesh(request: pytest.FixtureRequest, cluster: Cluster) -> Iterator[ClusterMesh]:
    yield from conditioned(cluster, request.param)
