"""The percentiles every benchmark reports, computed in one place (numpy) so that a p99 means the same
thing in every table, and the rank test that says whether two sets of runs differ beyond their scatter.

Two definitions are in use, on purpose: ``linear`` (numpy's default, interpolating) for latency
distributions of replays and the mocker, and ``nearest`` (an observed sample, rounding half to even)
for the router and indexer micro-benchmarks, whose µs figures must be times that were measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np

__all__ = ["mann_whitney_p", "percentile", "weighted_percentile"]


def percentile(
    values: Sequence[float] | np.ndarray,
    q: float,
    *,
    method: Literal["linear", "nearest"] = "linear",
    empty: float = math.nan,
) -> float:
    """The ``q``-th percentile (0-100) of ``values``, NaNs skipped; ``empty`` when nothing is left.

    NaNs are skipped because they mark requests that never finished (replays), which have no latency.
    ``empty`` lets a JSON-writing bench say 0.0 instead of NaN, which JSON cannot hold.
    """
    array = np.asarray(values, dtype=float)
    array = array[~np.isnan(array)]
    return float(np.percentile(array, q, method=method)) if array.size else empty


def weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The smallest value with at least q % of the total weight at or below it (NaN when empty)."""
    if values.size == 0 or not weights.sum() > 0:
        return math.nan
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    i = int(np.searchsorted(cum, cum[-1] * q / 100.0, side="left"))
    return float(values[order][min(i, values.size - 1)])


def mann_whitney_p(
    a: Sequence[float], b: Sequence[float], alternative: Literal["two-sided", "greater", "less"] = "two-sided"
) -> float:
    """Mann-Whitney U p-value (scipy) of ``a`` against ``b``: how often two samples of one distribution differ
    at least this much (in the direction of ``alternative``: ``greater``, ``a`` above ``b``). A small p says
    the two sets of runs differ beyond their scatter; a large one, that these samples cannot tell them apart
    (not that they are equal). 1.0 when every value on both sides is the same."""
    if len(set(a) | set(b)) < 2:
        return 1.0
    from scipy.stats import mannwhitneyu

    return float(mannwhitneyu(a, b, alternative=alternative).pvalue)
