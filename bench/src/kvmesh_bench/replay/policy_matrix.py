"""``kvmesh bench policy-matrix TRACE...``: the default routing policy against a reference, on every trace and load.

For each trace, each arrival speedup of ``--loads`` and each mode of ``--modes``, ``--seeds`` offline replays
(seeds ``seed .. seed+N-1``, a fresh fleet each); each figure is the median over the seeds. A cell
*holds* when the candidate (``--candidate``, default plain ``kv``: the router's default policy) is no worse
than the reference (``--reference``, default ``kv:dynamo``) on TTFT p50, TTFT p99 and ITL p99 (ratio <=
1 + ``--tolerance``) with a hit rate at least as high (>= reference - ``--tolerance`` x reference). A cell
that does not hold is also judged against seed noise: is each figure it loses worse on the candidate's seeds
than on the reference's, by a one-sided Mann-Whitney U test at :data:`SIGNIFICANCE`? With 5 seeds a side that
takes nearly every candidate seed worse than nearly every reference seed::

    kvmesh bench policy-matrix ../shared/data/mooncake/conversation_trace.jsonl synth/*.jsonl \\
        --loads 1,2,4,6,8 --seeds 5 --max-requests 2000 --jobs 2 --json out/matrix.json

Replays are independent processes' worth of work; ``--jobs N`` runs N at a time (results do not depend
on it: every replay is deterministic for its seed). Exit status 0 whether or not every cell holds (the
table says), 2 for bad input.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from kvmesh_bench import tables
from kvmesh_bench.argtypes import (
    CommandParser,
    non_negative_float,
    non_negative_int,
    output_file,
    positive_float,
    positive_int,
)
from kvmesh_bench.replay.cli import ReplayError, add_common_args, load_requests, parse_mode, run_mode
from kvmesh_bench.replay.report import Summary, median_summary, summarize
from kvmesh_bench.stats import mann_whitney_p

__all__ = ["main"]

PROG = "kvmesh bench policy-matrix"

#: (Summary field, label, lower is better)
FIGURES: tuple[tuple[str, str, bool], ...] = (
    ("ttft_p50_ms", "TTFT p50", True),
    ("ttft_p99_ms", "TTFT p99", True),
    ("itl_p99_ms", "ITL p99", True),
    ("hit_rate", "hit", False),
)


#: A figure the candidate loses is a significant loss when its seeds are worse than the reference's with a
#: one-sided Mann-Whitney p below this.
SIGNIFICANCE = 0.05


def _replay_args(trace: str, load: float, fleet: Sequence[str]) -> argparse.Namespace:
    parser = CommandParser(add_help=False)
    add_common_args(parser)
    return parser.parse_args([trace, "--offline", "--arrival-speedup", repr(load), "--no-plot", *fleet])


def _one(job: tuple[str, float, str, int, tuple[str, ...]]) -> tuple[str, float, str, int, dict[str, Any]]:
    """One offline replay (run in a worker process): its summary as a dict."""
    trace, load, mode, seed, fleet = job
    args = _replay_args(trace, load, fleet)
    requests = load_requests(args)
    run = run_mode(args, parse_mode(mode), requests, seed)
    return trace, load, mode, seed, summarize(run).as_dict()


def _loads(text: str) -> list[float]:
    try:
        loads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated arrival speedups, got {text!r}") from None
    if not loads or any(not (x > 0 and math.isfinite(x)) for x in loads):
        raise argparse.ArgumentTypeError(f"arrival speedups must be positive, got {text!r}")
    return loads


def seed_spread(runs: Sequence[Summary]) -> dict[str, float]:
    """Per figure, (max - min) / median over one setup's seeds: how far the seed alone moves it."""
    out = {}
    for key, _, _ in FIGURES:
        values = sorted(getattr(s, key) for s in runs)
        mid = values[len(values) // 2]
        out[key] = (values[-1] - values[0]) / mid if mid else 0.0
    return out


def worse_p_values(candidate_runs: Sequence[Summary], reference_runs: Sequence[Summary]) -> dict[str, float]:
    """Per figure, the one-sided Mann-Whitney U p-value of the candidate's seeds being worse than the
    reference's (higher where lower is better, lower for the hit rate); 1.0 when every value is the same."""
    return {
        key: mann_whitney_p(
            [getattr(s, key) for s in candidate_runs],
            [getattr(s, key) for s in reference_runs],
            "greater" if lower_better else "less",
        )
        for key, _, lower_better in FIGURES
    }


def cell_verdict(
    candidate: Summary,
    reference: Summary,
    tolerance: float,
    noise: dict[str, float] | None = None,
    p_worse: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Ratios candidate / reference per figure and whether the candidate is no worse on every one.

    ``holds``: no figure worse by more than ``tolerance``. ``within_noise``: every figure that is worse is
    worse by no more than ``noise`` (the reference's own seed-to-seed spread, :func:`seed_spread`).
    ``significantly_worse_on``: the worse figures whose ``p_worse`` (:func:`worse_p_values`) is below
    :data:`SIGNIFICANCE` (every worse figure when no p-values are given)."""
    ratios: dict[str, float] = {}
    worse: list[str] = []
    beyond_noise: list[str] = []
    significant: list[str] = []
    for key, label, lower_better in FIGURES:
        c, r = getattr(candidate, key), getattr(reference, key)
        ratio = c / r if r else (1.0 if c == r else math.inf)
        ratios[key] = ratio
        excess = ratio - 1 if lower_better else 1 - ratio
        if excess > tolerance:
            worse.append(label)
            if noise is None or excess > max(tolerance, noise.get(key, 0.0)):
                beyond_noise.append(label)
            if p_worse is None or p_worse.get(key, 0.0) < SIGNIFICANCE:
                significant.append(label)
    return {
        "ratios": ratios,
        "worse_on": worse,
        "holds": not worse,
        "within_noise": not beyond_noise,
        "significantly_worse_on": significant,
        **({"p_worse": p_worse} if p_worse is not None else {}),
    }


def main(argv: Sequence[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    p = CommandParser(prog=PROG, description=__doc__, formatter_class=raw)
    p.add_argument("traces", nargs="+", help="Mooncake JSONL traces (labelled by file name)")
    p.add_argument("--loads", type=_loads, default=[1.0, 2.0, 4.0, 6.0, 8.0], help="arrival speedups (1,2,4,6,8)")
    p.add_argument(
        "--candidate", default="kv", help="policies that must not lose, comma-separated (default kv: the router's)"
    )
    p.add_argument("--reference", default="kv:dynamo", help="the policy to beat (default kv:dynamo)")
    p.add_argument("--seeds", type=positive_int, default=5, help="replays per cell (median; default 5)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="first seed (default 0)")
    p.add_argument("--max-requests", type=positive_int, default=2000, help="first N requests of each trace")
    p.add_argument(
        "--tolerance", type=non_negative_float, default=0.0, help="relative slack per figure (default 0: strict)"
    )
    p.add_argument("--jobs", type=positive_int, default=1, help="replays run at once (default 1)")
    p.add_argument("--engines", type=positive_int, default=8)
    p.add_argument("--engine-block-size", type=positive_int, default=64)
    p.add_argument("--num-gpu-blocks", type=positive_int, default=16384)
    p.add_argument("--trace-block-size", type=positive_int, default=512)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    p.add_argument("--overlap-weight", type=positive_float, default=1.0)
    p.add_argument(
        "--json", type=output_file, metavar="PATH", help="write every replay's figures and the verdicts as JSON"
    )
    args = p.parse_args(argv)
    fleet = (
        "--engines", str(args.engines), "--engine-block-size", str(args.engine_block_size),
        "--num-gpu-blocks", str(args.num_gpu_blocks), "--trace-block-size", str(args.trace_block_size),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-requests", str(args.max_requests),
        "--overlap-weight", repr(args.overlap_weight),
    )  # fmt: skip
    try:
        candidates = [m.strip() for m in args.candidate.split(",") if m.strip()]
        labels = [parse_mode(m).label for m in (*candidates, args.reference)]
        if not candidates or len(set(labels)) != len(labels):
            raise ReplayError(f"--candidate names no mode, repeats one or names the reference: {args.candidate}")
        for trace in args.traces:  # each trace readable and non-empty before hours of replay
            load_requests(_replay_args(trace, 1.0, fleet))
    except ReplayError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    jobs = [
        (trace, load, mode, args.seed + k, fleet)
        for trace in args.traces
        for load in args.loads
        for mode in (*candidates, args.reference)
        for k in range(args.seeds)
    ]
    print(
        f"{PROG}: {len(args.traces)} traces x {len(args.loads)} loads x {len(candidates) + 1} modes x "
        f"{args.seeds} seeds = {len(jobs)} offline replays of {args.max_requests} requests, {args.jobs} at a time",
        flush=True,
    )
    started = time.perf_counter()
    results: dict[tuple[str, float, str], list[Summary]] = {}
    # spawn, not fork: a process with gRPC threads (a test session, a caller's client) can hang a fork
    pool = ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) if args.jobs > 1 else None
    done: Iterable[tuple[str, float, str, int, dict[str, Any]]] = pool.map(_one, jobs) if pool else map(_one, jobs)
    for trace, load, mode, _seed, summary in done:
        results.setdefault((trace, load, mode), []).append(Summary(**summary))
    if pool is not None:
        pool.shutdown()
    rows: list[dict[str, Any]] = []
    for candidate, label in zip(candidates, labels, strict=False):
        cells = []
        for trace in args.traces:
            for load in args.loads:
                cand_runs = results[(trace, load, candidate)]
                cand = median_summary(cand_runs)
                ref_runs = results[(trace, load, args.reference)]
                ref = median_summary(ref_runs)
                noise = seed_spread(ref_runs)
                p_worse = worse_p_values(cand_runs, ref_runs)
                cells.append(
                    {
                        "candidate_mode": label,
                        "trace": Path(trace).stem,
                        "load": load,
                        "candidate": cand.as_dict(),
                        "reference": ref.as_dict(),
                        "reference_seed_spread": noise,
                        **cell_verdict(cand, ref, args.tolerance, noise, p_worse),
                    }
                )
        print(format_matrix(cells, label, labels[-1]))
        held = sum(r["holds"] for r in cells)
        noisy = sum(r["within_noise"] for r in cells)
        clear = sum(not r["significantly_worse_on"] for r in cells)
        print(
            f"{label} no worse than {labels[-1]} in {held} of {len(cells)} cells (median of {args.seeds} seeds, "
            f"tolerance {args.tolerance:g}); within the reference's seed spread in {noisy} of {len(cells)}; "
            f"not significantly worse (one-sided Mann-Whitney p >= {SIGNIFICANCE:g} on every figure it loses) "
            f"in {clear} of {len(cells)}\n"
        )
        rows += cells
    print(f"{len(jobs)} replays in {time.perf_counter() - started:.0f} s")
    if args.json:
        payload = {
            "candidates": labels[:-1],
            "reference": labels[-1],
            "seeds": args.seeds,
            "max_requests": args.max_requests,
            "tolerance": args.tolerance,
            "cells": rows,
            "trials": [
                {"trace": t, "load": load, "mode": m, "runs": [s.as_dict() for s in runs]}
                for (t, load, m), runs in results.items()
            ],
        }
        tables.write_json(args.json, payload)
        print(f"wrote {args.json}")
    return 0


def format_matrix(rows: Sequence[dict[str, Any]], candidate: str, reference: str) -> str:
    """One line per (trace, load): the candidate's figures, the reference's, and their ratio."""
    out = []
    for r in rows:
        c, ref, ratio = r["candidate"], r["reference"], r["ratios"]
        line = {
            "trace": r["trace"],
            "load": f"x{r['load']:g}",
            "p50": f"{c['ttft_p50_ms']:.0f}/{ref['ttft_p50_ms']:.0f} ({ratio['ttft_p50_ms']:.3f})",
            "p99": f"{c['ttft_p99_ms']:.0f}/{ref['ttft_p99_ms']:.0f} ({ratio['ttft_p99_ms']:.3f})",
            "itl": f"{c['itl_p99_ms']:.2f}/{ref['itl_p99_ms']:.2f} ({ratio['itl_p99_ms']:.3f})",
            "hit": f"{c['hit_rate']:.3f}/{ref['hit_rate']:.3f}",
            "verdict": "holds"
            if r["holds"]
            else ("within noise: " if r["within_noise"] else "worse: ") + ", ".join(_with_p(r)),
        }
        out.append(line)
    columns = [
        ("trace", "trace", "{}"),
        ("load", "load", "{}"),
        ("p50", "TTFT p50 ms (ratio)", "{}"),
        ("p99", "TTFT p99 ms (ratio)", "{}"),
        ("itl", "ITL p99 ms (ratio)", "{}"),
        ("hit", "hit rate", "{}"),
        ("verdict", "verdict", "{}"),
    ]
    return f"{candidate} / {reference}\n" + tables.format_table(out, columns)


def _with_p(cell: dict[str, Any]) -> list[str]:
    """The figures a cell loses, each with its one-sided p-value when there is one."""
    p_worse = cell.get("p_worse")
    if p_worse is None:
        return list(cell["worse_on"])
    keys = {label: key for key, label, _ in FIGURES}
    return [f"{label} (p {p_worse[keys[label]]:.2f})" for label in cell["worse_on"]]
