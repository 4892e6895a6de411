"""The wire contract -> the router core: a RouteQuery and its RouterConfigOverride become a RouteRequest."""

from __future__ import annotations

import pytest
from kvmesh.v1 import discovery_pb2, router_pb2
from kvmesh_router.translate import INVALID, QueryError, route_request

ALLOWED = frozenset({1, 2})


def query(**overrides) -> router_pb2.RouteQuery:
    q = router_pb2.RouteQuery(request_id="r", model="m", block_hashes=[7, 8], num_tokens=32, excluded_engine_ids=[2])
    if overrides:
        q.overrides.CopyFrom(router_pb2.RouterConfigOverride(**overrides))
    return q


def test_a_plain_query_keeps_the_replica_config():
    req = route_request("s1/r", query(), ALLOWED)
    assert (req.request_id, list(req.seq_hashes), req.isl_tokens) == ("s1/r", [7, 8], 32)
    assert req.allowed_engines == ALLOWED and req.excluded_engines == {2}
    assert req.pinned_engine is None and req.override is None


def test_mode_role_and_cost_knobs_are_one_override():
    req = route_request(
        "k",
        query(mode=router_pb2.ROUTER_MODE_POWER_OF_TWO, role=discovery_pb2.WORKER_ROLE_PREFILL, policy="dynamo"),
        ALLOWED,
    )
    assert req.override is not None
    assert (req.override.mode, req.override.role, req.override.cost_policy) == ("power_of_two", "prefill", "dynamo")
    assert req.override.temperature is None  # unset fields keep the replica's value
    aggregated = route_request("k", query(role=discovery_pb2.WORKER_ROLE_AGGREGATED), ALLOWED)
    assert aggregated.override is not None and aggregated.override.role == "aggregated"


def test_unknown_enum_values_are_invalid_queries():
    for bad in ({"mode": 99}, {"role": 99}):
        with pytest.raises(QueryError) as err:
            route_request("k", query(**bad), ALLOWED)
        assert err.value.outcome == INVALID
