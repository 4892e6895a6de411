"""vLLM's per-step Logprob dicts -> main's TokenLogprobs contract (no engine needed)."""

from __future__ import annotations

import pytest
from kvmesh_worker.engines.vllm.engine import token_logprobs
from vllm.logprobs import Logprob


def test_sampled_token_and_top_alternatives_most_likely_first() -> None:
    steps = [
        {7: Logprob(-0.1, rank=1), 9: Logprob(-2.5, rank=2)},  # sampled = the most likely
        {3: Logprob(-4.0, rank=17), 5: Logprob(-0.2, rank=1), 8: Logprob(-1.9, rank=2)},  # sampled outside top 2
    ]
    out = token_logprobs(steps, (7, 3), top=2)
    assert [(e.logprob, e.rank) for e in out] == [pytest.approx((-0.1, 1)), pytest.approx((-4.0, 17))]
    assert [(t.token_id, t.rank) for t in out[0].top] == [(7, 1), (9, 2)]
    assert [(t.token_id, t.rank) for t in out[1].top] == [(5, 1), (8, 2)]


def test_logprobs_zero_gives_the_sampled_token_only_and_a_missing_step_keeps_counts() -> None:
    out = token_logprobs([{4: Logprob(-0.5, rank=1)}, None], (4, 6), top=0)
    assert len(out) == 2 and out[0].rank == 1 and not out[0].top
    assert out[1].logprob == float("-inf") and out[1].rank == 0
