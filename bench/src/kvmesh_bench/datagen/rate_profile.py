"""Time-varying arrival rates for synthesized traces (``kvmesh datagen synthesize --rate-profile SPEC``).

The request contents (prefix structure, ISL, OSL) come from the synthesizer unchanged; only the
timestamps are redrawn, as an inhomogeneous Poisson process whose rate follows the profile
(the arrivals are ``Lambda^-1`` of the cumulative sums of unit exponentials, ``Lambda`` the integral of
the rate). Specs (rates in requests/s, times in s):

- ``points:T0=R0,T1=R1,...``   piecewise linear through the points (constant after the last one);
- ``ramp:R0:R1:DURATION``      R0 rising linearly to R1 over DURATION, then back down to R0 over DURATION;
- ``diurnal:LOW:HIGH:PERIOD:DURATION``  LOW + (HIGH-LOW) (1 - cos(2 pi t / PERIOD)) / 2;
- ``spike:BASE:PEAK:AT:WIDTH:DURATION`` BASE, a PEAK plateau of WIDTH seconds starting at AT (10 s edges).

The trace ends at the profile's duration or when the requests run out, whichever comes first.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvmesh_bench.trace import TraceRequest

__all__ = ["RateProfile", "retime"]


MAX_DURATION_S = 7 * 86400.0  # the arrival grid has 20 points a second


@dataclass(frozen=True)
class RateProfile:
    times_s: tuple[float, ...]
    rates: tuple[float, ...]

    @property
    def duration_s(self) -> float:
        return self.times_s[-1]

    def rate(self, t: float | np.ndarray) -> np.ndarray:
        return np.asarray(np.interp(t, self.times_s, self.rates))

    @classmethod
    def parse(cls, spec: str) -> RateProfile:
        kind, _, rest = spec.partition(":")
        try:
            if kind == "points":
                pts = [p.split("=") for p in rest.split(",") if p]
                times, rates = [float(t) for t, _ in pts], [float(r) for _, r in pts]
            elif kind == "ramp":
                r0, r1, d = (float(x) for x in rest.split(":"))
                times, rates = [0.0, d, 2 * d], [r0, r1, r0]
            elif kind == "diurnal":
                low, high, period, d = (float(x) for x in rest.split(":"))
                times = list(np.linspace(0.0, d, max(2, int(d / 5) + 1)))
                rates = [low + (high - low) * (1 - math.cos(2 * math.pi * t / period)) / 2 for t in times]
            elif kind == "spike":
                base, peak, at, width, d = (float(x) for x in rest.split(":"))
                times = [0.0, at, at + 10, at + 10 + width, at + 20 + width, d]
                rates = [base, base, peak, peak, base, base]
            else:
                raise ValueError(f"unknown kind {kind!r}")
        except ValueError as exc:
            raise ValueError(
                f"--rate-profile {spec!r}: {exc} (expected points:T=R,..., ramp:R0:R1:S, diurnal:LOW:HIGH:PERIOD:S"
                ", spike:BASE:PEAK:AT:WIDTH:S)"
            ) from None
        finite = all(math.isfinite(x) for x in (*times, *rates))
        if not finite or len(times) < 2 or any(b <= a for a, b in itertools.pairwise(times)) or min(rates) < 0:
            raise ValueError(f"--rate-profile {spec!r}: needs increasing finite times and finite non-negative rates")
        if times[-1] - times[0] > MAX_DURATION_S:
            raise ValueError(f"--rate-profile {spec!r}: at most {MAX_DURATION_S:g} s (a week) of arrivals")
        profile = cls(tuple(float(t) for t in times), tuple(float(r) for r in rates))
        if profile.expected_requests() <= 0:
            raise ValueError(f"--rate-profile {spec!r}: its rates are all 0: no request would arrive")
        return profile

    def expected_requests(self) -> float:
        """The integral of the rate over the profile: how many requests it would bring, on average."""
        return float(np.trapezoid(self.rates, self.times_s))

    def arrivals(self, n: int, seed: int = 0) -> np.ndarray:
        """Up to ``n`` arrival times (s) within the profile's duration."""
        grid = np.linspace(0.0, self.duration_s, max(1000, int(self.duration_s * 20)))
        rate = self.rate(grid)
        cum = np.concatenate([[0.0], np.cumsum((rate[1:] + rate[:-1]) / 2 * np.diff(grid))])
        rng = np.random.default_rng(seed)
        marks = np.cumsum(rng.exponential(1.0, n))
        marks = marks[marks <= cum[-1]]
        return np.interp(marks, cum, grid)


def retime(rows: Sequence[TraceRequest], profile: RateProfile, seed: int = 0) -> list[TraceRequest]:
    """``rows`` in order with timestamps (ms) redrawn from ``profile``; rows beyond its duration are dropped."""
    times = profile.arrivals(len(rows), seed)
    return [dataclasses.replace(row, timestamp_ms=float(t * 1000.0)) for row, t in zip(rows, times, strict=False)]
