"""The replay's PNG plots are drawn whatever the run, one where no request completed included."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from kvmesh_bench.replay.report import RunData, plot_compare, plot_run


def _nothing_completed() -> RunData:
    """A live run against a mesh that refused every request (a vocabulary the model does not have)."""
    n, nan = 5, np.full(5, np.nan)
    return RunData(
        label="kv", kind="live", arrival_ms=np.arange(n, dtype=float) * 10, first_token_ms=nan, finish_ms=nan,
        engine=np.full(n, -1), input_tokens=np.full(n, 100), output_tokens=np.full(n, 10), cached_tokens=nan,
        itl_ms=np.array([]), itl_weight=np.array([]), engines=2, hit_source="frontend",
        errors=["INVALID_ARGUMENT: token id 99999999 is outside the vocabulary"] * n,
    )  # fmt: skip


def test_a_run_where_no_request_completed_is_plotted_not_a_traceback(tmp_path: Path) -> None:
    """A log scale of no data raised (ValueError) after the run, so --json and the table were lost."""
    run = _nothing_completed()
    assert plot_run(run, tmp_path / "run.png").stat().st_size > 0
    assert plot_compare([run, _nothing_completed()], tmp_path / "compare.png").stat().st_size > 0
