"""PromptTokens: a prompt held as the u32 LE bytes the mesh hashes and sends, read as ints only on demand."""

from __future__ import annotations

import numpy as np
import pytest
from kvmesh.hashing import block_hashes, u32_le_bytes
from kvmesh_frontend.prompt_tokens import PromptTokens


def test_the_bytes_are_the_worker_form_and_hash_like_the_ids() -> None:
    ids = np.random.default_rng(3).integers(0, 50_000, 1000).tolist()
    prompt = PromptTokens.of(ids)
    assert prompt.u32le == u32_le_bytes(ids)
    assert len(prompt) == 1000 and prompt.max_id() == max(ids)
    assert prompt.tolist() == ids and list(prompt) == ids
    assert prompt[-5:] == ids[-5:] and prompt[7] == ids[7]  # the detokenizer's context is a slice
    for block_size in (16, 64, 333):
        assert prompt.block_hashes(block_size) == block_hashes(ids, block_size)[1]


def test_a_migrated_prompt_is_the_original_followed_by_the_generated_tokens() -> None:
    prompt = PromptTokens.of([1, 2, 3])
    assert prompt.extended([4, 5]).tolist() == [1, 2, 3, 4, 5]
    assert prompt.extended([]) is prompt
    assert prompt.tolist() == [1, 2, 3]  # unchanged


def test_an_array_in_any_integer_dtype_gives_the_same_bytes() -> None:
    ids = [0, 7, 65_535, 4_000_000_000]
    assert PromptTokens.of(np.array(ids, dtype=np.int64)) == PromptTokens.of(ids)
    assert PromptTokens.of(np.array(ids[:3], dtype=np.int32)) == PromptTokens.of(ids[:3])


def test_bytes_that_are_not_whole_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="not whole u32 token ids"):
        PromptTokens(b"\x01\x00\x00")
