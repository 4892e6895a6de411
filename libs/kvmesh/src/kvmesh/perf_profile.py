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
