"""The NPZ performance-profile format (Dynamo's ``--planner-profile-data``), read by the mocker and the planner.

``prefill_isl`` -> ``prefill_ttft_ms`` (1-D) and ``decode_active_kv_tokens`` x ``decode_context_length``
-> ``decode_itl`` (ms, 2-D). ``kvmesh profile`` writes the same keys.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

KEYS = ("prefill_isl", "prefill_ttft_ms", "decode_active_kv_tokens", "decode_context_length", "decode_itl")


def read_npz(path: str | Path) -> tuple[np.ndarray, ...]:
    """The profile's arrays in ``KEYS`` order, as floats (unsorted); ValueError saying what is wrong in it.

    Checked here, once for the mocker and the planner: a file that is no NPZ, an array missing, empty or
    holding a value that is no finite number, and prefill arrays of different lengths. Each of these was
    a traceback at start-up, or worse, a profile that loaded and failed (or answered nonsense) later.
    """
    try:
        data = np.load(path, allow_pickle=False)
    except (EOFError, ValueError, zipfile.BadZipFile) as exc:  # an empty file, a pickle, a torn archive
        raise ValueError(f"not an NPZ profile ({str(exc).split('.')[0] or type(exc).__name__})") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ValueError("not an NPZ profile (one .npy array)")
    with data:
        missing = set(KEYS) - set(data.files)
        if missing:
            raise ValueError(f"missing arrays {sorted(missing)}")
        arrays = tuple(_floats(key, data[key]) for key in KEYS)
    for key, array in zip(KEYS, arrays, strict=True):
        if array.size == 0:
            raise ValueError(f"{key} is empty")
        if not np.isfinite(array).all():
            raise ValueError(f"{key} holds a value that is no finite number")
    isl, ttft, kv, ctx, _ = arrays
    if isl.ndim != 1 or ttft.shape != isl.shape:
        raise ValueError(f"prefill_isl and prefill_ttft_ms must be 1-D of one length, got {isl.shape}, {ttft.shape}")
    if kv.ndim != 1 or ctx.ndim != 1:
        raise ValueError("decode_active_kv_tokens and decode_context_length must be 1-D")
    return arrays


def _floats(key: str, array: np.ndarray) -> np.ndarray:
    try:
        return np.asarray(array, dtype=float)
    except (TypeError, ValueError):
        raise ValueError(f"{key} holds something that is no number") from None


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
