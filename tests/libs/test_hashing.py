"""Block hashing is a wire contract between engines and routers: pin it with vectors."""

import struct

import numpy as np
import pytest
import xxhash
from kvmesh.hashing import (
    XXH3_SEED,
    block_hashes,
    chain_hash,
    local_block_hashes,
    salted_seed,
    sequence_hashes,
)

# Values computed once from the Dynamo-compatible definition (XXH3-64, seed 1337, u32 LE tokens,
# sequence hash chained over (parent u64 LE, local u64 LE)). A change here breaks every router.
VECTOR_TOKENS = list(range(128))
VECTOR_LOCAL = [3480597578098033343, 3318286205056455972]
VECTOR_SEQ = [3480597578098033343, 2575318956255022795]


def test_pinned_vectors_for_two_blocks_of_64():
    assert block_hashes(VECTOR_TOKENS, 64) == (VECTOR_LOCAL, VECTOR_SEQ)


def test_local_hash_is_xxh3_of_little_endian_u32_tokens():
    tokens = [1, 2, 3, 4]
    expected = xxhash.xxh3_64_intdigest(struct.pack("<4I", *tokens), seed=1337)
    assert local_block_hashes(tokens, 4) == [expected] == [14643705804678351452]


def test_sequence_hash_chains_parent_and_local_hash():
    local = local_block_hashes(list(range(12)), 4)
    seq = sequence_hashes(local)
    assert seq[0] == local[0]
    for i in (1, 2):
        assert seq[i] == xxhash.xxh3_64_intdigest(struct.pack("<QQ", seq[i - 1], local[i]), seed=XXH3_SEED)
        assert seq[i] == chain_hash(seq[i - 1], local[i])


def test_only_full_blocks_are_hashed():
    assert local_block_hashes([1, 2, 3], 4) == []
    assert len(local_block_hashes(list(range(9)), 4)) == 2


def test_equal_prefixes_share_hashes_and_diverge_after():
    a = block_hashes([7] * 8 + [1] * 4, 4)[1]
    b = block_hashes([7] * 8 + [2] * 4, 4)[1]
    assert a[:2] == b[:2] and a[2] != b[2]


def test_same_block_content_at_another_position_has_another_sequence_hash():
    seq = block_hashes([5] * 8, 4)[1]
    local = local_block_hashes([5] * 8, 4)
    assert local[0] == local[1] and seq[0] != seq[1]


def test_continuing_a_chain_equals_hashing_the_whole_sequence():
    tokens = list(range(40))
    whole = block_hashes(tokens, 4)[1]
    first = block_hashes(tokens[:16], 4)[1]
    rest = sequence_hashes(local_block_hashes(tokens[16:], 4), parent=first[-1])
    assert first + rest == whole


def test_numpy_and_list_inputs_agree():
    tokens = list(range(1000, 1256))
    assert local_block_hashes(np.array(tokens, dtype=np.int64), 64) == local_block_hashes(tokens, 64)


def test_salt_isolates_cache_namespaces():
    assert salted_seed(None) == salted_seed("") == XXH3_SEED
    assert local_block_hashes([1, 2, 3, 4], 4, salted_seed("lora-a")) == [16997879858665117404]
    assert local_block_hashes([1, 2, 3, 4], 4, salted_seed("lora-a")) != local_block_hashes([1, 2, 3, 4], 4)


def test_a_token_outside_u32_is_refused_from_a_list_as_from_numpy():
    for bad in (-1, 1 << 32):
        with pytest.raises(OverflowError):
            local_block_hashes([1] * 63 + [bad], 64)
