"""How long a simulated forward pass takes, in milliseconds (Dynamo's mocker ``PerfModel``).

A pass costs a prefill part (compute-bound: grows with the new prompt tokens of the whole batch)
plus a decode part (memory-bound: grows with the KV cache in use). The scheduler asks for each part
only when the pass has work of that kind, and adds them.

* ``PolynomialPerfModel``: Dynamo's hard-coded fits (the default).
* ``InterpolatedPerfModel``: a profiler sweep from an NPZ file (Dynamo's ``--planner-profile-data``):
  ``prefill_isl`` -> ``prefill_ttft_ms`` (1-D, linear) and ``decode_active_kv_tokens`` x
  ``decode_context_length`` -> ``decode_itl`` (2-D grid, bilinear). Queries outside the profiled
  range are clamped to its edge (no extrapolation beyond the last measured point).

numpy only; a model is a plain object with two methods, chosen with ``load_perf_model(name_or_path)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
from kvmesh import perf_profile


class PerfModel(Protocol):
    def prefill_ms(self, new_tokens: int) -> float:
        """Time to prefill ``new_tokens`` uncached prompt tokens (summed over the batch)."""
        ...

    def decode_ms(self, active_kv_tokens: int, total_kv_tokens: int, mean_context: float) -> float:
        """Time of one decode iteration with ``active_kv_tokens`` of ``total_kv_tokens`` in use."""
        ...


class PolynomialPerfModel:
    """prefill = 4.209989e-07 T^2 + 1.518344e-02 T + 16.50142 (>= 0); decode = -25.74 u^2 + 54.01 u + 5.74 (>= 1).

    ``T`` is the pass's new prompt tokens, ``u = active_kv_tokens / total_kv_tokens``.
    """

    #: The decode time ignores ``mean_context``: a run of quiet passes (same active KV) all take the same
    #: time, which lets ``EngineCore.fast_forward`` evaluate the model once per run instead of per pass.
    decode_uses_context = False

    def prefill_ms(self, new_tokens: int) -> float:
        t = float(new_tokens)
        return max(0.0, 4.209989e-07 * t * t + 1.518344e-02 * t + 16.50142)

    def decode_ms(self, active_kv_tokens: int, total_kv_tokens: int, mean_context: float) -> float:
        u = active_kv_tokens / total_kv_tokens
        return max(1.0, -25.74 * u * u + 54.01 * u + 5.74)


class InterpolatedPerfModel:
    """Piecewise-linear model over profiled points (see module docstring for the NPZ keys)."""

    def __init__(
        self,
        prefill_isl: np.ndarray,
        prefill_ttft_ms: np.ndarray,
        decode_active_kv_tokens: np.ndarray,
        decode_context_length: np.ndarray,
        decode_itl: np.ndarray,
    ) -> None:
        self._isl, self._ttft = _sorted_axis(prefill_isl, np.asarray(prefill_ttft_ms, dtype=float), "prefill_isl")
        self._kv, self._ctx, self._itl = perf_profile.sorted_decode_grid(
            decode_active_kv_tokens, decode_context_length, decode_itl
        )
        for name, axis in (("decode_active_kv_tokens", self._kv), ("decode_context_length", self._ctx)):
            if axis.size == 0 or np.any(np.diff(axis) <= 0):
                raise ValueError(f"{name} must be non-empty with distinct values")

    @classmethod
    def from_npz(cls, path: str | Path) -> InterpolatedPerfModel:
        return cls(*perf_profile.read_npz(path))

    def prefill_ms(self, new_tokens: int) -> float:
        return max(0.0, float(np.interp(new_tokens, self._isl, self._ttft)))

    def decode_ms(self, active_kv_tokens: int, total_kv_tokens: int, mean_context: float) -> float:
        i, fx = _locate(self._kv, active_kv_tokens)
        j, fy = _locate(self._ctx, mean_context)
        z = self._itl
        i1, j1 = min(i + 1, z.shape[0] - 1), min(j + 1, z.shape[1] - 1)
        top = z[i, j] * (1 - fy) + z[i, j1] * fy
        bottom = z[i1, j] * (1 - fy) + z[i1, j1] * fy
        return max(0.0, float(top * (1 - fx) + bottom * fx))


def load_perf_model(spec: str | Path | None = None) -> PerfModel:
    """``None`` / ``"polynomial"``: the default model; a path to an ``.npz`` file: the interpolated model."""
    if spec is None or str(spec) == "polynomial":
        return PolynomialPerfModel()
    path = Path(spec)
    if path.suffix == ".npz" or path.exists():
        return InterpolatedPerfModel.from_npz(path)
    raise ValueError(f"unknown perf model {spec!r}: expected 'polynomial' or a path to an .npz profile")


def _sorted_axis(x: np.ndarray, y: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(x, dtype=float)
    if x.ndim != 1 or x.shape != y.shape or x.size == 0:
        raise ValueError(f"{name} and its values must be 1-D arrays of the same non-zero length")
    order = np.argsort(x)
    x, y = x[order], y[order]
    if np.any(np.diff(x) <= 0):
        raise ValueError(f"{name} has repeated values")
    return x, y


def _locate(axis: np.ndarray, value: float) -> tuple[int, float]:
    """(cell index, fraction in the cell) of ``value`` on a sorted axis, clamped to its ends."""
    if value <= axis[0]:
        return 0, 0.0
    if value >= axis[-1]:
        return axis.size - 1, 0.0
    i = int(np.searchsorted(axis, value, side="right")) - 1
    return i, float((value - axis[i]) / (axis[i + 1] - axis[i]))
