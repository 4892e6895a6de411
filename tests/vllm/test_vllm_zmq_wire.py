"""vLLM's ZMQ KV-event wire forms, decoded and re-hashed (hand-made msgpack payloads; no engine).

vLLM sent events as tagged arrays before v0.26 and as tagged maps since; both must decode to the
same kvmesh events, unknown keys ignored, and only the main attention cache indexed.
"""

from __future__ import annotations

import msgspec
import pytest
from kvmesh.hashing import block_hashes
from kvmesh.kv_events import AllCleared, BlocksRemoved, BlocksStored, StoredBlock
from kvmesh_worker.engines.vllm.zmq_events import (
    ReHasher,
    VllmCleared,
    VllmRemoved,
    VllmStored,
    WireError,
    decode_batch,
)

BS = 4
TOKENS = list(range(100, 112))  # three blocks of 4


def as_map(tag: str, **fields: object) -> dict[str, object]:
    return {"type": tag, **fields}


def stored_map(hashes: list[int], parent: int | None, tokens: list[int], **extra: object) -> dict[str, object]:
    fields: dict[str, object] = {"block_hashes": hashes, "token_ids": tokens, "block_size": BS, "medium": "GPU"}
    if parent is not None:
        fields["parent_block_hash"] = parent
    return as_map("BlockStored", **fields, **extra)


def test_map_and_array_forms_decode_to_the_same_events() -> None:
    maps = [
        stored_map([1, 2], None, TOKENS[:8], group_idx=0, kv_cache_spec_kind="full_attention", a_future_key=[1]),
        as_map("BlockRemoved", block_hashes=[2], medium="GPU"),
        as_map("AllBlocksCleared"),
    ]
    arrays = [
        ["BlockStored", [1, 2], None, TOKENS[:8], BS, None, "GPU", None, None, 0, "full_attention", None, "x", "y"],
        ["BlockRemoved", [2], "GPU"],
        ["AllBlocksCleared"],
    ]
    expected = [VllmStored((1, 2), None, tuple(TOKENS[:8]), BS), VllmRemoved((2,)), VllmCleared()]
    assert decode_batch(msgspec.msgpack.encode([1.5, maps, 0])) == expected
    assert decode_batch(msgspec.msgpack.encode([1.5, arrays])) == expected
    assert decode_batch(msgspec.msgpack.encode({"ts": 1.5, "events": maps, "data_parallel_rank": None})) == expected


@pytest.mark.parametrize(
    "extra",
    [{"group_idx": 1}, {"kv_cache_spec_kind": "sliding_window"}, {"medium": "CPU"}],
    ids=["another group", "another cache kind", "an offload tier"],
)
def test_events_that_are_not_the_main_attention_cache_are_skipped(extra: dict[str, object]) -> None:
    event = {**stored_map([1], None, TOKENS[:4]), **extra}
    assert decode_batch(msgspec.msgpack.encode([0.0, [event, as_map("SomethingNew", x=1)]])) == []


def test_garbage_is_a_wire_error() -> None:
    with pytest.raises(WireError):
        decode_batch(b"\xc1")
    with pytest.raises(WireError):
        decode_batch(msgspec.msgpack.encode([0.0, [42]]))


def test_rehashing_gives_kvmeshs_chained_hashes_and_maps_removals_back() -> None:
    local, sequence = block_hashes(TOKENS, BS)
    rehasher = ReHasher(BS)
    first = rehasher.apply([VllmStored((7, 8), None, tuple(TOKENS[:8]), BS)])
    second = rehasher.apply([VllmStored((9,), 8, tuple(TOKENS[8:]), BS)])
    assert first == [BlocksStored(None, (StoredBlock(sequence[0], local[0]), StoredBlock(sequence[1], local[1])))]
    assert second == [BlocksStored(sequence[1], (StoredBlock(sequence[2], local[2]),))]
    assert rehasher.apply([VllmRemoved((9, 12345))]) == [BlocksRemoved((sequence[2],))]
    assert [s.blocks[0].block_hash for s in rehasher.dump()] == sequence[:2]
    assert rehasher.apply([VllmCleared()]) == [AllCleared()] and rehasher.dump() == []


def test_a_store_whose_parent_is_unknown_is_dropped_and_a_duplicate_is_silent() -> None:
    rehasher = ReHasher(BS)
    assert rehasher.apply([VllmStored((9,), 8, tuple(TOKENS[8:]), BS)]) == []
    assert rehasher.dropped_stores == 1
    rehasher.apply([VllmStored((7,), None, tuple(TOKENS[:4]), BS)])
    assert rehasher.apply([VllmStored((7,), None, tuple(TOKENS[:4]), BS)]) == []
