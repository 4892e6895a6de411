"""Per-engine performance profile, and the capacity of one engine under latency targets.

Format: the mocker's NPZ profile (``kvmesh_worker.engine.perf_model``, Dynamo's ``--planner-profile-data``):
``prefill_isl`` -> ``prefill_ttft_ms`` (1-D) and ``decode_active_kv_tokens`` x ``decode_context_length``
-> ``decode_itl`` (ms, 2-D). The same file drives a mocker engine and the planner, and a profile measured
against a real engine by ``kvmesh profile`` has the same keys. ``profiles/mocker-polynomial.npz`` ships
with the planner: the mocker's default polynomial model sampled on a grid (``tests/planner`` checks it
against the mocker's own model).

Capacity model of one aggregated engine at ``rate`` requests/s (the mocker adds a pass's prefill time to
its decode time, so prefill work stretches every decode step):

- prefill busy share ``rho = rate * P / 1000``, ``P`` = prefill time of one prompt (chunked by
  ``max_num_batched_tokens``);
- ``ITL = D(kv) / (1 - rho)``, ``D`` the decode step at the KV tokens held by ``C`` concurrent requests,
  ``C = rate * (TTFT + OSL * ITL)`` (Little's law, solved by fixed-point iteration);
- ``TTFT = D + P + rho * P / (2 (1 - rho))`` (a pass in flight, the prompt, an M/D/1 queue).

``max_rate`` bisects for the highest rate whose predicted means stay within the (corrected) targets.

Disaggregated pools (Dynamo's SLA planner sizes them apart): a prefill engine's capacity is the highest
rate whose TTFT ``P + rho P / (2 (1 - rho))`` meets the TTFT target (``prefill_rate``); a decode engine's,
the highest rate whose decode step at the KV of ``rate x OSL x ITL`` concurrent requests of context
``ISL + OSL/2`` meets the ITL target (``decode_rate``). The KV transfer between them is not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import numpy as np
from kvmesh import perf_profile

from kvmesh_planner.core.model import EngineShape

BUILTIN = "mocker-polynomial"


class EngineProfile:
    def __init__(
        self,
        prefill_isl: np.ndarray,
        prefill_ttft_ms: np.ndarray,
        decode_active_kv_tokens: np.ndarray,
        decode_context_length: np.ndarray,
        decode_itl: np.ndarray,
    ) -> None:
        order = np.argsort(prefill_isl)
        self.isl = np.asarray(prefill_isl, dtype=float)[order]
        self.ttft = np.asarray(prefill_ttft_ms, dtype=float)[order]
        self.kv, self.ctx, self.itl = perf_profile.sorted_decode_grid(
            decode_active_kv_tokens, decode_context_length, decode_itl
        )

    @classmethod
    def from_npz(cls, path: str | Path) -> EngineProfile:
        return cls(*perf_profile.read_npz(path))

    def prefill_pass_ms(self, tokens: float) -> float:
        return max(0.0, float(np.interp(tokens, self.isl, self.ttft)))

    def prefill_ms(self, isl: float, chunk: int) -> float:
        """Compute time of one prompt of ``isl`` uncached tokens, in passes of at most ``chunk`` tokens."""
        if isl <= 0:
            return 0.0
        full, rest = divmod(isl, chunk)
        return full * self.prefill_pass_ms(chunk) + (self.prefill_pass_ms(rest) if rest else 0.0)

    def decode_ms(self, kv_tokens: float, context: float) -> float:
        """Bilinear on the (KV tokens, context) grid, clamped to its edges."""
        i, fx = _locate(self.kv, kv_tokens)
        j, fy = _locate(self.ctx, context)
        z = self.itl
        i1, j1 = min(i + 1, z.shape[0] - 1), min(j + 1, z.shape[1] - 1)
        top = z[i, j] * (1 - fy) + z[i, j1] * fy
        bottom = z[i1, j] * (1 - fy) + z[i1, j1] * fy
        return max(0.0, float(top * (1 - fx) + bottom * fx))

    def latency(self, rate: float, isl: float, osl: float, shape: EngineShape) -> tuple[float, float, float]:
        """Predicted mean (TTFT ms, ITL ms, concurrency) of one engine at ``rate`` req/s; inf when saturated."""
        p = self.prefill_ms(isl, shape.max_num_batched_tokens)
        rho = rate * p / 1000.0
        if rho >= 0.98:
            return math.inf, math.inf, math.inf
        context = isl + osl / 2.0
        itl = self.decode_ms(0.0, context) / (1 - rho)
        ttft = p
        conc = 0.0
        for _ in range(30):
            conc = rate * (ttft + max(0.0, osl - 1) * itl) / 1000.0
            kv = conc * context
            if kv > shape.total_kv_tokens or conc > shape.max_num_seqs:
                return math.inf, math.inf, conc
            d = self.decode_ms(kv, context)
            new_itl = d / (1 - rho)
            ttft = d + p + rho * p / (2 * (1 - rho))
            if abs(new_itl - itl) < 1e-6:
                itl = new_itl
                break
            itl = new_itl
        return ttft, itl, conc

    def max_rate(self, isl: float, osl: float, ttft_ms: float, itl_ms: float, shape: EngineShape) -> float:
        """Highest request rate one engine serves with mean TTFT <= ``ttft_ms`` and mean ITL <= ``itl_ms``."""

        def ok(rate: float) -> bool:
            ttft, itl, _ = self.latency(rate, isl, osl, shape)
            return ttft <= ttft_ms and itl <= itl_ms

        return _highest(ok)

    # -- disaggregated pools: a prefill engine only prefills, a decode engine only decodes ----------
    def prefill_ttft(self, rate: float, isl: float, shape: EngineShape) -> float:
        """Mean TTFT (ms) of one prefill engine at ``rate`` req/s: the prompt plus an M/D/1 queue; inf if saturated."""
        p = self.prefill_ms(isl, shape.max_num_batched_tokens)
        rho = rate * p / 1000.0
        if rho >= 0.98:
            return math.inf
        return p + rho * p / (2 * (1 - rho))

    def decode_itl(self, rate: float, isl: float, osl: float, shape: EngineShape) -> float:
        """Mean ITL (ms) at one decode engine at ``rate`` req/s: the decode step at the KV held by the
        ``rate x OSL x ITL`` requests it decodes at once (Little's law, fixed point); inf over its KV or seqs."""
        context = isl + osl / 2.0
        itl = self.decode_ms(0.0, context)
        for _ in range(50):
            conc = rate * max(0.0, osl - 1) * itl / 1000.0
            if conc * context > shape.total_kv_tokens or conc > shape.max_num_seqs:
                return math.inf
            new_itl = self.decode_ms(conc * context, context)
            if abs(new_itl - itl) < 1e-6:
                return new_itl
            itl = new_itl
        return itl

    def prefill_rate(self, isl: float, ttft_ms: float, shape: EngineShape) -> float:
        """Highest request rate one prefill engine serves with mean TTFT <= ``ttft_ms`` (Dynamo's
        ``p_thpt_per_gpu`` at the TTFT target, in requests)."""
        return _highest(lambda rate: self.prefill_ttft(rate, isl, shape) <= ttft_ms)

    def decode_rate(self, isl: float, osl: float, itl_ms: float, shape: EngineShape) -> float:
        """Highest request rate one decode engine serves with mean ITL <= ``itl_ms`` (Dynamo's
        ``d_thpt_per_gpu`` at the ITL target and context ISL + OSL/2, in requests)."""
        return _highest(lambda rate: self.decode_itl(rate, isl, osl, shape) <= itl_ms)


def _highest(ok: Callable[[float], bool]) -> float:
    """The highest rate with ``ok(rate)`` (ok is monotone: true up to a point), by doubling then bisection."""
    if not ok(1e-6):
        return 0.0
    lo, hi = 0.0, 1.0
    while ok(hi) and hi < 1e6:
        lo, hi = hi, hi * 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def load_profile(spec: str | None) -> EngineProfile:
    """``None`` or ``mocker-polynomial``: the shipped profile of the mocker's default model; else an NPZ path."""
    if spec is None or spec in (BUILTIN, "polynomial"):
        with resources.as_file(resources.files("kvmesh_planner") / "profiles" / f"{BUILTIN}.npz") as path:
            return EngineProfile.from_npz(path)
    return EngineProfile.from_npz(spec)


def _locate(axis: np.ndarray, value: float) -> tuple[int, float]:
    if value <= axis[0]:
        return 0, 0.0
    if value >= axis[-1]:
        return axis.size - 1, 0.0
    i = int(np.searchsorted(axis, value, side="right")) - 1
    return i, float((value - axis[i]) / (axis[i + 1] - axis[i]))
