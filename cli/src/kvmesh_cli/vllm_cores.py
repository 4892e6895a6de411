"""Split this machine's cores between the vLLM engines ``kvmesh up`` starts.

vLLM's CPU build binds every engine's OpenMP threads to all the cores it may use
(``VLLM_CPU_OMP_THREADS_BIND=auto``), so two engines on one machine run two spinning thread pools on
the same cores. On 2 cores a prefill and a decode engine then starved every other process: load
average ~30, discovery leases expiring every few seconds, NIXL's handshake timing out. Giving each
engine its own cores (``VLLM_CPU_OMP_THREADS_BIND`` per worker) removed all of it. Invariant: with at
least as many cores as engines, no two engines share a core.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"


def core_binds(engines: int, cores: Sequence[int]) -> list[str]:
    """One ``VLLM_CPU_OMP_THREADS_BIND`` value per engine: contiguous, disjoint slices of ``cores`` as even
    as possible; with fewer cores than engines, engine ``i`` gets core ``i mod len(cores)``."""
    if engines <= 0 or not cores:
        return []
    ordered = sorted(cores)
    if len(ordered) < engines:
        return [str(ordered[i % len(ordered)]) for i in range(engines)]
    base, extra = divmod(len(ordered), engines)
    binds, start = [], 0
    for i in range(engines):
        size = base + (1 if i < extra else 0)
        binds.append(",".join(str(c) for c in ordered[start : start + size]))
        start += size
    return binds


def worker_environments(engines: int) -> list[dict[str, str]]:
    """The extra environment of each of ``engines`` vLLM workers; none if the user chose a binding."""
    if engines < 2 or VARIABLE in os.environ:
        return [{} for _ in range(engines)]
    return [{VARIABLE: bind} for bind in core_binds(engines, sorted(os.sched_getaffinity(0)))]
