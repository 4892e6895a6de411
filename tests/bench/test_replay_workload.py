"""Trace rows -> token ids: equal hash ids give equal tokens, the last block is cut, arrivals are scaled."""

import numpy as np
import pytest
from kvmesh.hashing import block_hashes
from kvmesh_bench.replay.workload import TokenMapper, arrival_times_ms, build_requests
from kvmesh_bench.trace import TraceRequest


def test_equal_ids_give_equal_blocks_and_different_ids_do_not():
    m = TokenMapper()
    a = m.tokens([7, 8, 9], 3 * 512)
    b = m.tokens([7, 8, 5], 3 * 512)
    assert a.dtype == np.int32 and a.size == 1536
    assert np.array_equal(a[:1024], b[:1024])  # ids 7, 8 shared
    assert np.mean(a[1024:] == b[1024:]) < 0.05  # 9 vs 5: unrelated tokens
    assert np.array_equal(m.block(8), a[512:1024])  # a block does not depend on its position


def test_last_block_is_cut_to_input_length_and_keeps_the_prefix():
    m = TokenMapper()
    short = m.tokens([1, 2, 3], 1100)
    full = m.tokens([1, 2, 3], 1536)
    assert short.size == 1100
    assert np.array_equal(short, full[:1100])
    # Extra ids beyond the input length are never used; a length beyond the ids' capacity is clamped.
    assert np.array_equal(m.tokens([1, 2, 3, 4], 1100), short)
    assert m.tokens([1], 5000).size == 512
    assert m.tokens([1], 0).size == 0


def test_prefix_sharing_survives_engine_hashing():
    m = TokenMapper()
    a = m.tokens([1, 2, 3], 1500)
    b = m.tokens([1, 2, 4], 1500)
    ha, hb = block_hashes(a, 64)[1], block_hashes(b, 64)[1]
    shared = next(i for i, (x, y) in enumerate(zip(ha, hb, strict=True)) if x != y)
    assert shared == 16  # 2 trace blocks of 512 = 16 engine blocks of 64


def test_tokens_stay_in_the_vocabulary_and_depend_on_the_seed():
    a = TokenMapper(vocab_size=100, seed=1).tokens(list(range(20)), 20 * 512)
    assert a.min() >= 0 and a.max() < 100
    b = TokenMapper(vocab_size=100, seed=2).tokens(list(range(20)), 20 * 512)
    assert np.mean(a == b) < 0.05
    with pytest.raises(ValueError):
        TokenMapper(vocab_size=0)


def test_arrivals_are_divided_by_the_speedup_and_rows_without_prompt_are_skipped():
    rows = [
        TraceRequest(0, 1000, 10, (0, 1)),
        TraceRequest(3000, 0, 5, ()),  # nothing to send
        TraceRequest(6000, 600, 0, (0, 2)),  # output 0 -> at least 1 token
    ]
    assert arrival_times_ms(rows, 3.0).tolist() == [0.0, 1000.0, 2000.0]
    requests, skipped = build_requests(rows, arrival_speedup=2.0)
    assert skipped == 1
    assert [(r.index, r.arrival_ms, r.input_length, r.max_tokens) for r in requests] == [
        (0, 0.0, 1000, 10),
        (2, 3000.0, 600, 1),
    ]
    assert requests[1].request_id == "r2"
    with pytest.raises(ValueError):
        arrival_times_ms(rows, 0)
