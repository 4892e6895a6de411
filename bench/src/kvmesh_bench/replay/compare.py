"""``kvmesh bench compare TRACE --modes kv,round_robin,random [--offline]``: one replay per routing mode.

Each mode gets a fresh fleet: offline a new simulation; live the same running mesh, but with a
different token seed per mode, so no mode finds the previous one's prompts in the engines' caches
(stale blocks only take free-able space, exactly like an empty cache). Modes may name cost policies,
``--modes kv:dynamo,kv:affinity,round_robin``, to compare policies side by side (offline; live the
frontend can only switch modes). Prints each mode's figures and its ratio to round_robin (or to the
first mode when round_robin is not among them); ``--json`` writes all of them, plus one PNG per mode
and a combined TTFT-CDF plot.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvmesh_bench.argtypes import CommandParser
from kvmesh_bench.replay.cli import (
    ModeSpec,
    ReplayError,
    add_common_args,
    check_live_args,
    load_requests,
    parse_mode,
    run_mode,
)
from kvmesh_bench.replay.report import (
    format_table,
    median_summary,
    plot_compare,
    plot_run,
    run_json,
    summarize,
    write_json,
)

__all__ = ["main"]

PROG = "kvmesh bench compare"


def main(argv: Sequence[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = CommandParser(prog=PROG, description=__doc__, formatter_class=raw)
    add_common_args(parser)
    parser.add_argument("--modes", default="kv,round_robin,random", help="comma-separated, e.g. kv:dynamo,kv:affinity")
    parser.add_argument("--seeds", type=int, default=1, help="offline: runs per mode (seeds seed..seed+N-1); median")
    args = parser.parse_args(argv)
    try:
        specs: list[ModeSpec] = [parse_mode(m) for m in args.modes.split(",") if m.strip()]
        if not specs:
            raise ReplayError("--modes names no mode")
        labels = [s.label for s in specs]
        if len(set(labels)) != len(labels):
            raise ReplayError(f"--modes repeats a mode: {args.modes}")
        check_live_args(args)
        if args.seeds < 1:
            raise ReplayError(f"--seeds must be >= 1, got {args.seeds}")
        if args.seeds > 1 and not args.offline:
            raise ReplayError("--seeds N > 1 is for --offline runs")
        args.send_mode = True
        requests = load_requests(args)
        where = "offline (simulated)" if args.offline else f"live against {args.frontend}"
        print(f"{PROG}: {len(requests)} requests from {args.trace}, arrivals x{args.arrival_speedup:g}, {where}")
        runs = []
        per_mode = []
        for i, spec in enumerate(specs):
            trials = []
            for k in range(args.seeds):
                seed = args.seed + k if args.offline else args.seed + 1000 * i
                trials.append(run_mode(args, spec, requests, seed))
            trials.sort(key=lambda r: summarize(r).ttft_p50_ms)
            runs.append(trials[len(trials) // 2])  # the run with the median TTFT p50 (plotted)
            per_mode.append(trials)
            for t in trials:
                s = summarize(t)
                print(
                    f"  {spec.label} (seed {t.meta['seed']}): TTFT p50 {s.ttft_p50_ms:.0f} ms, "
                    f"p99 {s.ttft_p99_ms:.0f} ms, hit {s.hit_rate:.3f}"
                    + (f"; {len(t.errors)} requests failed, first: {t.errors[0]}" if t.errors else "")
                )
    except ReplayError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    summaries = [median_summary([summarize(t) for t in trials]) for trials in per_mode]
    base = next((s for s in summaries if s.label == "round_robin"), summaries[0])
    print(format_table(summaries, baseline=base))
    if args.seeds > 1:
        print(f"(each figure: the median over {args.seeds} seeds)")
    print(f"prefix hit rate source: {summaries[0].hit_source}")
    json_path = Path(args.json) if args.json else None
    if json_path is not None:
        payload = {
            "trace": str(args.trace),
            "arrival_speedup": args.arrival_speedup,
            "requests": len(requests),
            "kind": "offline" if args.offline else "live",
            "baseline": base.label,
            "modes": {
                r.label: {**run_json(r), "median": m.as_dict(), "trials": [summarize(t).as_dict() for t in trials]}
                for r, m, trials in zip(runs, summaries, per_mode, strict=True)
            },
        }
        write_json(json_path, payload)
        print(f"wrote {json_path}")
    plot_dir = None if args.no_plot else args.plot.parent if args.plot and not args.plot.is_dir() else args.plot
    if plot_dir is None and not args.no_plot and json_path is not None:
        plot_dir = json_path.parent
    if plot_dir is not None:
        stem = json_path.stem if json_path else "compare"
        title = f"{len(requests)} requests, arrivals x{args.arrival_speedup:g}"
        print(f"wrote {plot_compare(runs, plot_dir / f'{stem}_ttft.png', title)}")
        for r in runs:
            safe = r.label.replace(":", "_").replace("+", "_").replace("=", "")
            plot_run(r, plot_dir / f"{stem}_{safe}.png")
    return 0
