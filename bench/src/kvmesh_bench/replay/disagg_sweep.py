"""``kvmesh bench disagg-sweep TRACE``: aggregated N engines against every P+D split of N, offline.

For every load (``--loads``, as arrival speedups) and KV link bandwidth (``--gbps``), it replays the same
requests through an aggregated fleet of N engines and through every split P prefill + (N-P) decode
engines (:mod:`kvmesh_bench.replay.disagg`: the same engine and router cores). It reports TTFT p50/p99,
ITL p50/p99 and output throughput per engine, prints a table and writes ``--json`` plus a PNG of TTFT
p50/p99, ITL p50/p99 and throughput per split (next to the JSON, or ``--plot``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvmesh_bench.argtypes import CommandParser, non_negative_int, output_file, png_file, positive_floats, positive_int
from kvmesh_bench.replay.cli import ReplayError, load_requests
from kvmesh_bench.replay.disagg import DisaggConfig, run_offline_disagg
from kvmesh_bench.replay.offline import OfflineConfig, run_offline
from kvmesh_bench.replay.report import summarize
from kvmesh_bench.replay.workload import TokenMapper
from kvmesh_bench.tables import Column, format_table, write_json
from kvmesh_bench.trace import DEFAULT_BLOCK_SIZE

COLUMNS: list[Column] = [
    ("load", "load", "x{:g}"),
    ("fleet", "fleet", "{}"),
    ("gbps", "GB/s", "{}"),
    ("ttft_p50", "TTFT p50", "{:.0f}"),
    ("ttft_p99", "TTFT p99", "{:.0f}"),
    ("itl_p50", "ITL p50", "{:.2f}"),
    ("itl_p99", "ITL p99", "{:.2f}"),
    ("tok_s_per_engine", "tok/s/engine", "{:.0f}"),
    ("remote", "remote", "{:.0%}"),
    ("done", "done", "{:d}"),
]


def _row(load: float, fleet: str, gbps: str, run: Any, engines: int) -> dict[str, Any]:
    s = summarize(run)
    return {
        "load": load,
        "fleet": fleet,
        "gbps": gbps,
        "ttft_p50": s.ttft_p50_ms,
        "ttft_p99": s.ttft_p99_ms,
        "itl_p50": s.itl_p50_ms,
        "itl_p99": s.itl_p99_ms,
        "tok_s_per_engine": s.output_tokens_per_s / engines,
        "remote": run.meta.get("disagg", {}).get("remote_prefill_fraction", 0.0),
        "done": s.completed,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = CommandParser(prog="kvmesh bench disagg-sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="Mooncake JSONL trace")
    p.add_argument("--engines", type=positive_int, default=8, help="engines per fleet, N (default: %(default)s)")
    p.add_argument("--loads", type=positive_floats, default="1,2,4,8", help="arrival speedups (default: %(default)s)")
    p.add_argument(
        "--gbps", type=positive_floats, default="25,100,400", help="KV link bandwidths, GB/s (default: %(default)s)"
    )
    p.add_argument("--max-requests", type=positive_int, default=600, help="requests per replay (default: %(default)s)")
    p.add_argument(
        "--trace-block-size",
        type=positive_int,
        default=DEFAULT_BLOCK_SIZE,
        help="tokens per hash id of the trace (default: %(default)s, the Mooncake traces')",
    )
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--json", type=output_file, default=None, help="write the rows as JSON (and the plot next to it)")
    p.add_argument("--plot", type=png_file, default=None, help="PNG path (default: next to --json)")
    args = p.parse_args(argv)
    loads, bandwidths = args.loads, args.gbps
    n = args.engines
    if n < 2:
        p.error("--engines must be >= 2")
    rows: list[dict[str, Any]] = []
    for load in loads:
        try:
            requests = load_requests(
                argparse.Namespace(
                    trace=args.trace,
                    max_requests=args.max_requests,
                    arrival_speedup=load,
                    trace_block_size=args.trace_block_size,
                )
            )
        except ReplayError as exc:
            print(f"{p.prog}: error: {exc}", file=sys.stderr)
            return 2
        config = OfflineConfig(engines=n, seed=args.seed)
        mapper = TokenMapper(block_tokens=args.trace_block_size, seed=args.seed)
        rows.append(_row(load, f"{n} agg", "-", run_offline(requests, config, mapper), n))
        print(format_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
        for gbps in bandwidths:
            for prefill in range(1, n):
                disagg = DisaggConfig(prefill, n - prefill, gbps)
                mapper = TokenMapper(block_tokens=args.trace_block_size, seed=args.seed)
                run = run_offline_disagg(requests, config, disagg, mapper)
                rows.append(_row(load, f"{prefill}P{n - prefill}D", f"{gbps:g}", run, n))
                print(format_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
        if args.json is not None:  # after every load: a long sweep that is stopped keeps what it measured
            write_json(args.json, {"benchmark": "disagg-sweep", "rows": rows})
    print()
    print(format_table(rows, COLUMNS))
    print("TTFT and ITL in ms; tok/s/engine: output tokens per second per engine of the fleet (P + D = N)")
    plot = args.plot or (args.json.with_suffix(".png") if args.json else None)
    if args.json is not None:
        params = vars(args) | {"json": str(args.json), "plot": str(plot)}
        write_json(args.json, {"benchmark": "disagg-sweep", "params": params, "rows": rows})
    if plot is not None:
        _plot(rows, loads, bandwidths, n, plot)
        print(f"wrote {plot}")
    return 0


def _plot(rows: list[dict[str, Any]], loads: list[float], bandwidths: list[float], n: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [
        ("ttft_p50", "TTFT p50 (ms)"),
        ("ttft_p99", "TTFT p99 (ms)"),
        ("itl_p50", "ITL p50 (ms)"),
        ("itl_p99", "ITL p99 (ms)"),
        ("tok_s_per_engine", "tok/s per engine"),
    ]
    fig, axes = plt.subplots(len(metrics), len(loads), figsize=(4 * len(loads), 3.2 * len(metrics)), squeeze=False)
    splits = list(range(1, n))
    for col, load in enumerate(loads):
        agg = next(r for r in rows if r["load"] == load and r["gbps"] == "-")
        for row, (key, title) in enumerate(metrics):
            ax = axes[row][col]
            for gbps in bandwidths:
                ys = [next(r[key] for r in rows if r["load"] == load and r["fleet"] == f"{p}P{n - p}D"
                           and r["gbps"] == f"{gbps:g}") for p in splits]  # fmt: skip
                ax.plot(splits, ys, marker="o", label=f"P/D @ {gbps:g} GB/s")
            ax.axhline(agg[key], color="black", linestyle="--", label=f"{n} aggregated")
            ax.set_xlabel(f"prefill engines P (decode = {n} - P)")
            ax.set_title(f"{title}, load x{load:g}")
            if key != "tok_s_per_engine":
                ax.set_yscale("log")
            if row == 0 and col == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
