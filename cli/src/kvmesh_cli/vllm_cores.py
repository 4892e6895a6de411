"""Split this machine's cores between the vLLM engines ``kvmesh up`` starts, and keep the rest of the mesh
off the cores an engine's model runs on.

vLLM's CPU build binds every engine's OpenMP threads to the same cores, all those it may use but the
last (``VLLM_CPU_OMP_THREADS_BIND=auto``), so two engines on one machine run two spinning thread pools
on the same cores. On 2 cores a prefill and a decode engine then starved every other process: load
average ~30, discovery leases expiring every few seconds, NIXL's handshake timing out. Giving each
engine its own cores (``VLLM_CPU_OMP_THREADS_BIND`` per worker) removed all of it. Invariant: with at
least as many cores as engines, no two engines share a core.

With one engine, vLLM binds its model-runner process (``VLLM::Worker``) to those cores and leaves the
last one (``reserved_cpus``) to "other processes": its scheduler and API server, in the kvmesh worker. Nothing
kept the frontend, the router, the kvmesh worker or a local client off the model's core, and Linux ran
them there too: on 2 cores the model waited for its core behind the mesh (docs/benchmarks.md,
"Overhead of the mesh"). :func:`keep_off_model_cores` moves every thread of the mesh's other processes onto
the cores no model is bound to, once the engines are up (vLLM picks its cores from the affinity it
starts with, so the daemons must start unconfined). Invariant: a model process's own affinity is
never changed, and with no core left over nothing is.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"
MODEL_PROCESS = "VLLM::Worker"  # the name (setproctitle) of vLLM's model-runner processes
_PROC = Path("/proc")


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


def _parents() -> dict[int, int]:
    """pid -> parent pid, for every process now alive."""
    parents: dict[int, int] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # it exited meanwhile
                continue
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    return parents


def _descendants(roots: Iterable[int], parents: dict[int, int]) -> set[int]:
    """``roots`` (those alive) and every process below them."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found: set[int] = set()
    todo = [pid for pid in roots if pid in parents]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


def _is_model_process(pid: int) -> bool:
    try:
        return (_PROC / str(pid) / "comm").read_text().startswith(MODEL_PROCESS)
    except OSError:
        return False


def model_processes(roots: Iterable[int]) -> set[int]:
    """vLLM's model-runner processes among ``roots`` and their descendants."""
    return {pid for pid in _descendants(roots, _parents()) if _is_model_process(pid)}


def confine(pid: int, cores: Iterable[int]) -> None:
    """Every thread of ``pid`` on ``cores`` (``sched_setaffinity`` on a pid moves one thread only)."""
    allowed = set(cores)
    try:
        tids = [int(tid) for tid in os.listdir(_PROC / str(pid) / "task")]
    except OSError:
        return
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(tid, allowed)


def keep_off_model_cores(roots: Iterable[int]) -> tuple[frozenset[int], frozenset[int]] | None:
    """Confine ``roots`` and their descendants, model processes and theirs excepted, to the cores of this
    process's affinity that no model process below ``roots`` is bound to.

    Returns (model cores, serving cores), or None when there is no model process or no core left over
    (several engines that take every core, or ``VLLM_CPU_OMP_THREADS_BIND=nobind``): then nothing moves.
    """
    parents = _parents()
    tree = _descendants(roots, parents)
    models = {pid for pid in tree if _is_model_process(pid)}
    if not models:
        return None
    model_cores: set[int] = set()
    for pid in models:
        try:
            model_cores |= os.sched_getaffinity(pid)
        except ProcessLookupError:
            continue
    serving = os.sched_getaffinity(0) - model_cores
    if not model_cores or not serving:
        return None
    for pid in tree - _descendants(models, parents):
        confine(pid, serving)
    return frozenset(model_cores), frozenset(serving)
