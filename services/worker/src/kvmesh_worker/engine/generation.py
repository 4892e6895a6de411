"""Deterministic "sampling" of the simulated model's output tokens.

The rule (stable: changing it changes every generated block hash):

* ``key = XXH3-64(prompt as u32 LE, seed=request seed mod 2**64)``: same seed + same prompt, same tokens;
* output token ``i`` (0-based) is ``splitmix64(key + (i + 1) * 0x9E3779B97F4A7C15) mod vocab_size``,
  i.e. uniform over the vocabulary and counter-based, so any range of positions is computed in one
  vectorised numpy call (the engine materialises up to ``PLAN_CHUNK`` tokens ahead at a time);
* EOS is an ordinary token: a request stops with ``'stop'`` at the first output equal to
  ``eos_token_id`` (unless ``ignore_eos``) or to one of its ``stop_token_ids``; the stop token is
  part of the output (as in vLLM). With a 32k vocabulary that is about one request in 100 for a
  300-token output: rare, but real, and reproducible. ``max_tokens`` wins a tie (``'length'``).

So with ``ignore_eos=True`` and no stop ids a request produces exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import xxhash

_MASK64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)

PLAN_CHUNK = 1024  # output tokens sampled per call


def generation_key(prompt_u32: np.ndarray, seed: int) -> int:
    """Per-request stream key from the prompt (a uint32 array) and the request's seed."""
    return xxhash.xxh3_64_intdigest(prompt_u32.tobytes(), seed & _MASK64)


def sample_tokens(key: int, start: int, count: int, vocab_size: int) -> np.ndarray:
    """Output tokens ``start .. start+count-1`` of the stream ``key`` (int64 array)."""
    x = np.arange(start + 1, start + count + 1, dtype=np.uint64)
    x *= _GOLDEN
    x += np.uint64(key)
    x ^= x >> _S30
    x *= _MIX1
    x ^= x >> _S27
    x *= _MIX2
    x ^= x >> _S31
    return (x % np.uint64(vocab_size)).astype(np.int64)


def first_stop(tokens: np.ndarray, stop_ids: Collection[int]) -> int:
    """Index of the first token in ``stop_ids``, or -1."""
    if not stop_ids:
        return -1
    hits = np.flatnonzero(np.isin(tokens, np.fromiter(stop_ids, dtype=np.int64)))
    return int(hits[0]) if hits.size else -1
