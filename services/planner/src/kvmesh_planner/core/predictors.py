"""Next-interval predictors for the SLA mode: constant, moving average, Kalman (filterpy).

Each is fed one value per interval (``observe``) and answers the next interval's value (``predict``).
The Kalman filter is filterpy's, not hand-written: a local linear trend (level + slope) with Dynamo's
defaults (q_level 1.0, q_trend 0.1, r 10, at least 5 points before it is trusted). Its noise terms are
in units of the series' own scale (the series is divided by its running mean), so one setting fits a
request rate of 0.5/s and an ISL of 8000 alike.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:  # imported when a filter is built: filterpy pulls in scipy (~0.7 s), and every CLI
    # command that only reads the planner's settings (``kvmesh up``, ``kvmesh bench``) would pay for it
    from filterpy.kalman import KalmanFilter


class Predictor(Protocol):
    name: str

    def observe(self, value: float) -> None: ...

    def predict(self) -> float | None:
        """The next interval's value; None before any observation."""
        ...

    def predict_ahead(self, steps: float) -> float | None:
        """The value ``steps`` intervals ahead (``predict()`` is one step); None before any observation."""
        ...


class ConstantPredictor:
    """The next interval looks like the last one."""

    name = "constant"

    def __init__(self) -> None:
        self._last: float | None = None

    def observe(self, value: float) -> None:
        self._last = value

    def predict(self) -> float | None:
        return self._last

    def predict_ahead(self, steps: float) -> float | None:
        return self._last


class MovingAveragePredictor:
    name = "moving_average"

    def __init__(self, window: int = 5) -> None:
        self._values: deque[float] = deque(maxlen=window)

    def observe(self, value: float) -> None:
        self._values.append(value)

    def predict(self) -> float | None:
        return sum(self._values) / len(self._values) if self._values else None

    def predict_ahead(self, steps: float) -> float | None:
        return self.predict()


class KalmanPredictor:
    """filterpy ``KalmanFilter`` over [level, trend]; one-step-ahead prediction, never below 0."""

    name = "kalman"

    def __init__(self, q_level: float = 1.0, q_trend: float = 0.1, r: float = 10.0, min_points: int = 5) -> None:
        self._q = np.diag([q_level, q_trend]) * 1e-2
        self._r = r * 1e-2
        self._min_points = min_points
        self._kf: KalmanFilter | None = None
        self._scale = 0.0
        self._n = 0
        self._last: float | None = None

    def observe(self, value: float) -> None:
        self._n += 1
        self._last = value
        self._scale += (abs(value) - self._scale) / min(self._n, 20)
        scale = self._scale or 1.0
        z = value / scale
        if self._kf is None:
            from filterpy.kalman import KalmanFilter

            kf = KalmanFilter(dim_x=2, dim_z=1)
            kf.x = np.array([[z], [0.0]])
            kf.F = np.array([[1.0, 1.0], [0.0, 1.0]])
            kf.H = np.array([[1.0, 0.0]])
            kf.P *= 1.0
            kf.Q = self._q
            kf.R = np.array([[self._r]])
            self._kf = kf
            self._kf_scale = scale
            return
        # Rescale the state when the running scale moves, so the noise terms stay relative.
        ratio = self._kf_scale / scale
        self._kf.x = self._kf.x * ratio
        self._kf_scale = scale
        self._kf.predict()
        self._kf.update(np.array([[z]]))

    def predict(self) -> float | None:
        return self.predict_ahead(1.0)

    def predict_ahead(self, steps: float) -> float | None:
        """Level + ``steps`` x trend: the local linear trend extrapolated (the look-ahead over engine start-up)."""
        if self._kf is None or self._n < self._min_points:
            return self._last
        level, trend = float(self._kf.x[0, 0]), float(self._kf.x[1, 0])
        return max(0.0, (level + steps * trend) * self._kf_scale)


def make_predictor(name: str) -> Predictor:
    """``constant``, ``moving_average`` or ``kalman``; ValueError otherwise."""
    if name == "constant":
        return ConstantPredictor()
    if name == "moving_average":
        return MovingAveragePredictor()
    if name == "kalman":
        return KalmanPredictor()
    raise ValueError(f"unknown predictor {name!r} (expected constant, moving_average or kalman)")


PREDICTORS = ("constant", "moving_average", "kalman")
