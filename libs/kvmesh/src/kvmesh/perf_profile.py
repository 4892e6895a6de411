"""The NPZ performance-profile format (Dynamo's ``--planner-profile-data``), read by the mocker and the planner.

``prefill_isl`` -> ``prefill_ttft_ms`` (1-D) and ``decode_active_kv_tokens`` x ``decode_context_length``
-> ``decode_itl`` (ms, 2-D). ``kvmesh profile`` writes the same keys.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

KEYS = ("prefill_isl", "prefill_ttft_ms", "decode_active_kv_tokens", "decode_context_length", "decode_itl")


def read_npz(path: str | Path) -> tuple[np.ndarray, ...]:
    """The profile's arrays in ``KEYS`` order, as stored (unsorted, unchecked beyond their presence)."""
    with np.load(path) as data:
        missing = set(KEYS) - set(data.files)
        if missing:
            raise ValueError(f"{path}: missing arrays {sorted(missing)}")
        return tuple(data[k] for k in KEYS)


def sorted_decode_grid(
    decode_active_kv_tokens: np.ndarray, decode_context_length: np.ndarray, decode_itl: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(KV tokens, context, ITL) as floats with both axes sorted ascending; ``decode_itl`` must be (kv x context)."""
    kv = np.asarray(decode_active_kv_tokens, dtype=float)
    ctx = np.asarray(decode_context_length, dtype=float)
    itl = np.asarray(decode_itl, dtype=float)
    if itl.shape != (kv.size, ctx.size):
        raise ValueError(f"decode_itl has shape {itl.shape}, expected ({kv.size}, {ctx.size})")
    kv_order, ctx_order = np.argsort(kv), np.argsort(ctx)
    return kv[kv_order], ctx[ctx_order], itl[kv_order][:, ctx_order]
