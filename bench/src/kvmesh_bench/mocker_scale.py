"""Mocker scale benchmark: N simulated engines in one process, one event loop, real time.

For each fleet size (``--engines 10,100,1000``) a fresh uvloop hosts N ``EngineRunner``s driving N
``EngineCore``s exactly as ``kvmesh-worker`` does (no gRPC: the runners are the part that has to
scale), and measures:

1. **Idle cost.** The runners are started with nothing to do and the process's CPU time (all
   threads) is read over ``--idle-seconds``: an idle engine must cost nothing (no polling).
2. **Timing under a steady load.** A load generator submits, to every engine in turn, a request of
   ``--prompt-tokens`` random tokens and ``--max-tokens`` output tokens (``ignore_eos``) at
   ``--rate`` requests/s per engine, for ``--duration`` seconds. Every pass's wall time is taken
   between delivery points (the previous pass's delivery, or for the first pass of a busy period
   the submit that woke the engine) and compared with its modelled duration ÷ ``--speedup``:
   drift = wall / modelled - 1. Reported: |drift| p50/p99, the mean signed drift, the aggregate
   passes/s, and CPU use. The first ``--warmup`` seconds are not measured.

The goal is 1000 engines with |drift| p99 ≤ 5 % at speedup 1.

Run: ``kvmesh bench mocker-scale --engines 10,100,1000 --duration 10 --json out.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.metadata
import math
import os
import platform
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import uvloop
from kvmesh_worker.engine import (
    EngineConfig,
    EngineCore,
    EngineRequest,
    ForwardPassMetrics,
    PolynomialPerfModel,
    RequestOutput,
)
from kvmesh_worker.engine_runner import EngineRunner

from kvmesh_bench.argtypes import (
    CommandParser,
    non_negative_float,
    non_negative_int,
    output_file,
    positive_float,
    positive_int,
    positive_ints,
)
from kvmesh_bench.stats import percentile
from kvmesh_bench.tables import write_json


class _Discard:
    """The output sink of the load: timing is measured per pass (observers), not per token."""

    def put_nowait(self, item: RequestOutput) -> None:
        pass


_DISCARD = _Discard()

GOAL_ENGINES = 1000
GOAL_DRIFT_P99 = 0.05


@dataclass
class Result:
    engines: int
    idle_cpu_pct: float  # process CPU time / wall time while N engines idle, in %
    idle_wakeups_per_s: float  # voluntary context switches of the loop thread while idle (each = one wakeup)
    floor_p99_pct: float  # |drift| p99 of a plain time.sleep() of the median pass, same machine, same run
    load_seconds: float
    requests: int
    requests_finished: int
    passes: int  # passes measured (after warmup)
    passes_per_s: float
    drift_p50_pct: float  # |wall / modelled - 1|
    drift_p99_pct: float
    drift_mean_pct: float  # signed: > 0 means passes take longer than modelled
    late_p99_ms: float  # |wall - modelled| p99, milliseconds
    modelled_p50_ms: float
    os_delayed_pct: float  # passes during which the loop thread waited for a CPU (see _Probe)
    clean_drift_p99_pct: float  # |drift| p99 over the passes that were not OS-delayed
    runq_wait_pct: float  # time the loop thread was runnable but not running / wall time
    gc_full: int  # full (generation 2) collections during the load
    gc_max_pause_ms: float
    gc_young: int  # generation 0 and 1 collections during the load (each stalls every engine in the loop)
    gc_young_ms: float  # their pauses, summed
    load_cpu_pct: float  # process CPU time / wall time under load, in %
    cpu_us_per_pass: float


class _RunDelay:
    """The loop thread's run-queue wait (ns waited for a CPU), from /proc/thread-self/schedstat."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def __call__(self) -> int:
        return int(os.pread(self._fd, 64, 0).split()[1]) if self._fd is not None else 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)


class _GcPauses:
    """Collections (generation, start, end) while installed."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float, float]] = []
        self._start = 0.0

    def __enter__(self) -> _GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], self._start, time.perf_counter()))


class _Probe:
    """Times every pass of every engine between delivery points (a pass observer + the submit hook).

    A pass starts at the previous pass's delivery (the runner steps again at once when the engine
    has unfinished work) or, for the first pass of a busy period, at the submit that woke the
    engine; it ends at its own delivery. It is *OS-delayed* if the loop thread waited for a CPU
    for more than 2 % of the pass's modelled time during it, or during the previous pass (whose
    late delivery shortens this one): that delay is the machine's, not the runner's.
    """

    def __init__(self, runners: Sequence[EngineRunner], speedup: float, run_delay: _RunDelay) -> None:
        self.runners = runners
        self.index = {r.engine_id: i for i, r in enumerate(runners)}
        self.speedup = speedup
        self.run_delay = run_delay
        n = len(runners)
        self.start: list[float | None] = [None] * n  # when engine i's next pass started
        self.start_delay = [0] * n  # run-queue wait (ns) at that moment
        self.prev_delayed = [False] * n
        self.measure_from = float("inf")
        self.measure_to = float("inf")
        self.modelled: list[float] = []
        self.wall: list[float] = []
        self.end: list[float] = []
        self.delayed: list[bool] = []
        for runner in runners:
            runner.add_observer(self.on_pass)

    def on_submit(self, i: int, now: float) -> None:
        if self.start[i] is None:  # the engine was idle: this submit wakes it, its first pass starts now
            self.start[i] = now
            self.start_delay[i] = self.run_delay()
            self.prev_delayed[i] = False

    def on_pass(self, engine_id: int, metrics: ForwardPassMetrics, wall_s: float) -> None:
        now = time.perf_counter()
        delay = self.run_delay()
        i = self.index[engine_id]
        started = self.start[i]
        modelled = metrics.duration_ms / 1000.0 / self.speedup
        delayed = (delay - self.start_delay[i]) * 1e-9 > 0.02 * modelled
        if started is not None and modelled > 0 and self.measure_from <= started and now <= self.measure_to:
            self.modelled.append(modelled)
            self.wall.append(now - started)
            self.end.append(now)
            self.delayed.append(delayed or self.prev_delayed[i])
        # The runner steps again right after this callback iff the engine has unfinished work.
        if self.runners[i].core.has_unfinished():
            self.start[i], self.start_delay[i], self.prev_delayed[i] = now, delay, delayed
        else:
            self.start[i] = None


def _sleep_floor(seconds: float, duration: float) -> float:
    """|drift| p99 of plain ``time.sleep(duration)`` calls: what the machine itself allows right now."""
    drift = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        time.sleep(duration)
        drift.append(abs((time.perf_counter() - t) / duration - 1.0))
    return 100.0 * percentile(np.asarray(drift), 99)


def _voluntary_switches() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


async def _measure(n: int, args: argparse.Namespace) -> Result:
    config = EngineConfig(
        num_gpu_blocks=args.num_gpu_blocks, block_size=args.block_size, vocab_size=args.vocab_size, eos_token_id=2
    )
    perf_model = PolynomialPerfModel()
    runners = [EngineRunner(i + 1, EngineCore(config, perf_model), args.speedup) for i in range(n)]
    run_delay = _RunDelay()
    probe = _Probe(runners, args.speedup, run_delay)
    for runner in runners:
        runner.start()
    gc.collect()
    gc.freeze()  # as kvmesh-worker does once its engines exist
    await asyncio.sleep(0.2)  # let every runner park on its wake event

    # -- idle ----------------------------------------------------------------------------------
    switches0, cpu0, wall0 = _voluntary_switches(), time.process_time(), time.perf_counter()
    await asyncio.sleep(args.idle_seconds)
    idle_wall = time.perf_counter() - wall0
    idle_cpu = (time.process_time() - cpu0) / idle_wall
    idle_wakeups = (_voluntary_switches() - switches0) / idle_wall

    # -- what a plain sleeping thread gets from this machine right now ---------------------------
    decode_ms = perf_model.decode_ms(0, args.num_gpu_blocks * args.block_size, args.prompt_tokens)
    floor = _sleep_floor(args.floor_seconds, decode_ms / 1000.0 / args.speedup) if args.floor_seconds > 0 else math.nan

    # -- steady load ---------------------------------------------------------------------------
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(3, args.vocab_size, size=(4096, args.prompt_tokens), dtype=np.int64)
    gap = 1.0 / (n * args.rate)  # arrivals round-robin over the engines, evenly spaced
    t0 = time.perf_counter()
    probe.measure_from = t0 + args.warmup
    end = t0 + args.duration
    submitted = 0
    measured: tuple[float, float, int, int] | None = None  # wall, cpu, passes, run delay at measure_from
    with _GcPauses() as gc_pauses:
        while True:
            now = time.perf_counter()
            if measured is None and now >= probe.measure_from:
                measured = (now, time.process_time(), sum(r.passes for r in runners), run_delay())
            if now >= end:
                break
            due = int((now - t0) / gap) + 1
            while submitted < due:
                i = submitted % n
                probe.on_submit(i, time.perf_counter())
                runners[i].submit(
                    EngineRequest(
                        request_id=f"r{submitted}",
                        prompt=prompts[submitted % len(prompts)],
                        max_tokens=args.max_tokens,
                        ignore_eos=True,
                    ),
                    _DISCARD,
                )
                submitted += 1
            await asyncio.sleep(max(gap, 0.002))
        probe.measure_to = end
        assert measured is not None
        load_wall = time.perf_counter() - measured[0]
        load_cpu = time.process_time() - measured[1]
        passes = sum(r.passes for r in runners) - measured[2]
        runq_wait = (run_delay() - measured[3]) * 1e-9
    finished = submitted - sum(len(r.core.scheduler.requests) for r in runners)
    for runner in runners:
        await runner.stop()
    run_delay.close()
    gc.unfreeze()

    modelled = np.asarray(probe.modelled)
    wall = np.asarray(probe.wall)
    drift = np.abs(wall / modelled - 1.0) if modelled.size else np.asarray([])
    delayed = np.asarray(probe.delayed, dtype=bool)
    measured_gc = [(gen, t0_, t1_) for gen, t0_, t1_ in gc_pauses.pauses if t0_ >= probe.measure_from]
    full = [(t0_, t1_) for gen, t0_, t1_ in measured_gc if gen == 2]
    young = [t1_ - t0_ for gen, t0_, t1_ in measured_gc if gen < 2]
    return Result(
        engines=n,
        idle_cpu_pct=100.0 * idle_cpu,
        idle_wakeups_per_s=idle_wakeups,
        floor_p99_pct=floor,
        load_seconds=load_wall,
        requests=submitted,
        requests_finished=finished,
        passes=int(modelled.size),
        passes_per_s=passes / load_wall,
        drift_p50_pct=100.0 * percentile(drift, 50),
        drift_p99_pct=100.0 * percentile(drift, 99),
        drift_mean_pct=100.0 * float(np.mean(wall / modelled - 1.0)) if modelled.size else math.nan,
        late_p99_ms=1000.0 * percentile(np.abs(wall - modelled), 99),
        modelled_p50_ms=1000.0 * percentile(modelled, 50),
        os_delayed_pct=100.0 * float(delayed.mean()) if delayed.size else math.nan,
        clean_drift_p99_pct=100.0 * percentile(drift[~delayed], 99),
        runq_wait_pct=100.0 * runq_wait / load_wall,
        gc_full=len(full),
        gc_max_pause_ms=1000.0 * max((b - a for a, b in full), default=0.0),
        gc_young=len(young),
        gc_young_ms=1000.0 * sum(young),
        load_cpu_pct=100.0 * load_cpu / load_wall,
        cpu_us_per_pass=1e6 * load_cpu / passes if passes else math.nan,
    )


_COLUMNS = (
    # header, width, format of one Result
    ("engines", 7, lambda r: f"{r.engines}"),
    ("idle CPU", 8, lambda r: f"{r.idle_cpu_pct:.2f}%"),
    ("idle wk/s", 9, lambda r: f"{r.idle_wakeups_per_s:.1f}"),
    ("passes/s", 8, lambda r: f"{r.passes_per_s:.0f}"),
    ("pass p50", 8, lambda r: f"{r.modelled_p50_ms:.2f}ms"),
    ("drift p50", 9, lambda r: f"{r.drift_p50_pct:.2f}%"),
    ("drift p99", 9, lambda r: f"{r.drift_p99_pct:.1f}%"),
    ("mean", 7, lambda r: f"{r.drift_mean_pct:+.2f}%"),
    ("p99 no-OS", 9, lambda r: f"{r.clean_drift_p99_pct:.1f}%"),
    ("OS-delayed", 10, lambda r: f"{r.os_delayed_pct:.1f}%"),
    ("runq wait", 9, lambda r: f"{r.runq_wait_pct:.1f}%"),
    ("floor p99", 9, lambda r: f"{r.floor_p99_pct:.1f}%"),
    ("full GC", 12, lambda r: f"{r.gc_full} ({r.gc_max_pause_ms:.0f}ms)"),
    ("young GC", 12, lambda r: f"{r.gc_young} ({r.gc_young_ms:.0f}ms)"),
    ("load CPU", 8, lambda r: f"{r.load_cpu_pct:.1f}%"),
    ("CPU/pass", 8, lambda r: f"{r.cpu_us_per_pass:.0f}us"),
)


def _header() -> str:
    text = " ".join(f"{name:>{width}}" for name, width, _ in _COLUMNS)
    return f"{text}\n{'-' * len(text)}"


def _row(r: Result) -> str:
    return " ".join(f"{fmt(r):>{width}}" for _, width, fmt in _COLUMNS)


LEGEND = """\
drift = wall / modelled - 1 per pass (wall between delivery points, modelled = perf model ÷ speedup);
p50/p99 of |drift|, mean signed. p99 no-OS: over the passes during which the loop thread did not wait
for a CPU (OS-delayed: waited > 2 % of the pass); runq wait: share of the time it waited for a CPU;
floor p99: a plain time.sleep() of the median pass on this machine in the same run. idle wk/s:
wakeups of the loop thread per second with every engine idle. full GC: count (longest pause); young
GC: generation 0-1 collections (their pauses summed), all while the load was measured."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = CommandParser(prog="kvmesh bench mocker-scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="10,100,1000", help="comma-separated engine counts (default: %(default)s)")
    p.add_argument(
        "--duration", type=positive_float, default=10.0, help="seconds of load per engine count (default: %(default)s)"
    )
    p.add_argument(
        "--warmup",
        type=non_negative_float,
        default=1.0,
        help="first seconds of load not measured (default: %(default)s)",
    )
    p.add_argument(
        "--idle-seconds", type=positive_float, default=3.0, help="idle CPU measurement window (default: %(default)s)"
    )
    p.add_argument(
        "--floor-seconds",
        type=non_negative_float,
        default=2.0,
        help="time.sleep() precision baseline, 0 = skip (default: %(default)s)",
    )
    p.add_argument(
        "--speedup", type=positive_float, default=1.0, help="simulated/real time ratio, > 0 (default: %(default)s)"
    )
    p.add_argument("--rate", type=positive_float, default=1.0, help="requests/s per engine (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=positive_int, default=128, help="prompt length (default: %(default)s)")
    p.add_argument(
        "--max-tokens", type=positive_int, default=8, help="output tokens per request (default: %(default)s)"
    )
    p.add_argument("--block-size", type=positive_int, default=64, help="tokens per KV block (default: %(default)s)")
    p.add_argument(
        "--num-gpu-blocks", type=positive_int, default=16384, help="KV blocks per engine (default: %(default)s)"
    )
    p.add_argument("--vocab-size", type=positive_int, default=2048, help="vocabulary of the simulated model")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--json", type=output_file, default=None, help="write the figures as JSON to this path")
    args = p.parse_args(argv)
    try:
        args.engine_counts = positive_ints(args.engines)
    except argparse.ArgumentTypeError as exc:
        p.error(f"--engines: {exc}")
    if args.speedup <= 0:
        p.error("--speedup must be > 0 (drift is measured against modelled time ÷ speedup)")
    if args.duration <= args.warmup:
        p.error("--duration must be longer than --warmup")
    if args.rate <= 0 or args.prompt_tokens < 1 or args.max_tokens < 1:
        p.error("--rate, --prompt-tokens and --max-tokens must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    results: list[Result] = []
    print(_header(), flush=True)
    for n in args.engine_counts:
        results.append(uvloop.run(_measure(n, args)))
        print(_row(results[-1]), flush=True)
        gc.collect()
    print()
    print(LEGEND)
    at_goal = [r for r in results if r.engines >= GOAL_ENGINES]
    if at_goal:
        ok = all(r.drift_p99_pct <= 100 * GOAL_DRIFT_P99 for r in at_goal)
        print(
            f"goal: {GOAL_ENGINES} engines with drift p99 <= {100 * GOAL_DRIFT_P99:.0f}%: {'met' if ok else 'NOT met'}"
        )
    if args.json is not None:
        payload: dict[str, Any] = {
            "benchmark": "mocker-scale",
            "params": {k: v for k, v in vars(args).items() if k not in {"json", "engine_counts"} and not callable(v)},
            "host": {
                "python": sys.version.split()[0],
                "machine": platform.machine(),
                "uvloop": importlib.metadata.version("uvloop"),
            },
            "goal": {"engines": GOAL_ENGINES, "drift_p99_pct": 100 * GOAL_DRIFT_P99},
            "results": [asdict(r) for r in results],
        }
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
