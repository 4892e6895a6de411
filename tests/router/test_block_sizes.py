"""A model whose engines differ in block size (a fleet in the middle of a ``--block-size`` change): a
query's block hashes are matched, and its blocks booked, only on engines of the block size it was hashed
with (``RouteQuery.block_size``). Before, one hash list was matched against every engine: the engines of
the other size never showed a cache hit, and were judged busy by blocks of the wrong size."""

from __future__ import annotations

from kvmesh.kv_events import BlocksStored, StoredBlock
from kvmesh.v1 import router_pb2
from kvmesh_router.engines import EngineInfo
from kvmesh_router.metrics import RouterMetrics
from kvmesh_router.state import RouterState

from tests.router.test_router_e2e_harness import ROUTED, prompt, seq_hashes

NO_ENGINE = router_pb2.DECISION_OUTCOME_NO_ENGINE
SMALL, LARGE_1, LARGE_2 = 0x16, 0x32, 0x33


def mixed_fleet() -> RouterState:
    state = RouterState(metrics=RouterMetrics())
    state.add_engine(EngineInfo(SMALL, "m", "w16", 16, 1000))
    for engine in (LARGE_1, LARGE_2):
        state.add_engine(EngineInfo(engine, "m", "w32", 32, 500))
    return state


def route(state: RouterState, rid: str, tokens: list[int], block_size: int) -> router_pb2.RouteDecision:
    query = router_pb2.RouteQuery(
        request_id=rid,
        model="m",
        block_hashes=seq_hashes(tokens, block_size) if block_size else [],
        block_size=block_size,
        num_tokens=len(tokens),
    )
    out = router_pb2.RouteDecision()
    state.route(rid, query, out)
    return out


def test_a_query_goes_to_an_engine_of_its_block_size_and_finds_that_engines_cache() -> None:
    state = mixed_fleet()
    tokens = prompt(*"ABCDEFGH", block_size=32)  # 256 tokens: 8 blocks of 32, 16 of 16
    assert state.kv_index is not None
    state.kv_index.apply(LARGE_2, BlocksStored(None, tuple(StoredBlock(h, 0) for h in seq_hashes(tokens, 32))))
    at_32 = route(state, "r32", tokens, 32)
    assert at_32.outcome == ROUTED and at_32.engine_id == LARGE_2 and at_32.overlap_blocks == 8
    at_16 = route(state, "r16", tokens, 16)
    assert at_16.outcome == ROUTED and at_16.engine_id == SMALL and at_16.block_size == 16
    # each booked in its own engine's blocks: 8 of 32 tokens, 16 of 16
    booked = {engine: blocks for engine, blocks, *_ in state.active_load()}
    assert booked[SMALL] == 16 and booked[LARGE_2] == 8 and booked[LARGE_1] == 0


def test_no_engine_of_the_querys_block_size_says_which_sizes_there_are() -> None:
    out = route(mixed_fleet(), "r", prompt(*"AB", block_size=64), 64)
    assert out.outcome == NO_ENGINE
    assert out.message == "no live engine of model 'm' has block size 64 (its engines have 16, 32)"


def test_a_query_without_a_block_size_may_go_to_any_engine_of_the_model() -> None:
    state = mixed_fleet()
    state.remove_engine(SMALL)
    out = route(state, "r", prompt("A", block_size=16), 0)  # no hashes: nothing to match, any size will do
    assert out.outcome == ROUTED and out.engine_id in (LARGE_1, LARGE_2)
