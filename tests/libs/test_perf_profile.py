"""An NPZ performance profile (the mocker's --perf-model, the planner's --profile) is checked when read.

Each flaw here was a traceback at start-up, or a profile that loaded and then failed every planner tick
(empty arrays) or sized pools on nonsense (a NaN latency).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from kvmesh.perf_profile import read_npz

GOOD = {
    "prefill_isl": [128, 1024],
    "prefill_ttft_ms": [10.0, 60.0],
    "decode_active_kv_tokens": [0, 4096],
    "decode_context_length": [128, 2048],
    "decode_itl": [[5.0, 6.0], [7.0, 9.0]],
}


def test_a_good_profile_reads_as_floats(tmp_path: Path) -> None:
    path = tmp_path / "p.npz"
    np.savez(path, **GOOD)
    arrays = read_npz(path)
    assert [a.dtype for a in arrays] == [np.float64] * 5 and arrays[4].shape == (2, 2)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"prefill_ttft_ms": [10.0]}, "prefill_isl and prefill_ttft_ms must be 1-D of one length"),
        ({"prefill_isl": [], "prefill_ttft_ms": []}, "prefill_isl is empty"),
        ({"prefill_ttft_ms": [np.nan, 60.0]}, "prefill_ttft_ms holds a value that is no finite number"),
        ({"decode_itl": [[5.0, np.inf], [7.0, 9.0]]}, "decode_itl holds a value that is no finite number"),
        ({"prefill_isl": ["a", "b"]}, "prefill_isl holds something that is no number"),
        ({"decode_context_length": [[128, 2048]]}, "must be 1-D"),
    ],
    ids=["lengths differ", "empty", "NaN", "infinite", "text", "2-D axis"],
)
def test_a_flawed_profile_is_refused_saying_what_is_wrong(tmp_path: Path, change: dict, says: str) -> None:
    path = tmp_path / "p.npz"
    np.savez(path, **{**GOOD, **change})
    with pytest.raises(ValueError, match=says):
        read_npz(path)


@pytest.mark.parametrize(
    ("content", "says"),
    [(b"", "No data left in file"), (b"hello", "pickled"), (b"PK\x03\x04torn", "File is not a zip file")],
    ids=["empty", "text", "torn archive"],
)
def test_a_file_that_is_no_npz_is_refused(tmp_path: Path, content: bytes, says: str) -> None:
    path = tmp_path / "p.npz"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"not an NPZ profile .*{says}"):
        read_npz(path)
