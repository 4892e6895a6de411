"""``kvmesh bench planner-sim TRACE``: the planner offline, against static fleets of every size.

Runs ``kvmesh_bench.planner_sim`` once per planner mode and once per static fleet size, prints the table
(SLA attainment, engine-seconds, scaling events, latency percentiles) with the goal check (>= 95 %
attainment with <= 75 % of the engine-seconds of the smallest static fleet that reaches 95 %), writes
``--json PATH`` and a PNG of pool size and latency over time next to it (or ``--plot``).

``--pools prefill,decode`` runs a disaggregated fleet instead (the offline P/D pipeline: prefill -> KV
transfer at ``--kv-transfer-gbps`` -> decode): the planner manages both pools within ``--min/--max-prefill``,
``--min/--max-decode`` and ``--engine-budget``, static fleets are P+D splits (``--statics 1x1-6,2x2-6``),
and engine-seconds are also reported per pool.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from kvmesh_planner.core import PlannerConfig, PoolBounds
from kvmesh_planner.core.predictors import PREDICTORS

from kvmesh_bench.argtypes import (
    CommandParser,
    non_negative_float,
    non_negative_int,
    output_file,
    png_file,
    positive_float,
    positive_int,
    unit_fraction,
)
from kvmesh_bench.planner_sim import SimResult, run_planner_sim, run_planner_sim_disagg
from kvmesh_bench.replay.disagg import DisaggConfig
from kvmesh_bench.replay.offline import OfflineConfig
from kvmesh_bench.replay.workload import build_requests
from kvmesh_bench.tables import write_json
from kvmesh_bench.trace import TraceError, load_trace


def _parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="kvmesh bench planner-sim", description=__doc__)
    p.add_argument("trace", help="Mooncake JSONL trace (e.g. from kvmesh datagen synthesize --rate-profile)")
    p.add_argument("--ttft-ms", type=positive_float, default=600.0)
    p.add_argument("--itl-ms", type=positive_float, default=30.0)
    p.add_argument(
        "--modes",
        type=_modes,
        default="sla:kalman,sla:constant,load:latency",
        help=f"planner runs: sla:PREDICTOR ({', '.join(PREDICTORS)}), load:PROFILE (latency, throughput)",
    )
    p.add_argument(
        "--statics",
        default=None,
        help="static fleet sizes, e.g. 1-8 or 2,4,6 (default 1-8); with --pools prefill,decode PxD splits, "
        "e.g. 1x1-6,2x2-6 (default 1x1-4,2x2-4)",
    )
    p.add_argument(
        "--pools",
        default="aggregated",
        choices=["aggregated", "prefill,decode"],
        metavar="aggregated|prefill,decode",
        help="aggregated engines, or a disaggregated fleet whose prefill and decode pools the planner manages",
    )
    p.add_argument("--min-prefill", type=positive_int, default=1)
    p.add_argument("--max-prefill", type=positive_int, default=4)
    p.add_argument("--min-decode", type=positive_int, default=1)
    p.add_argument("--max-decode", type=positive_int, default=4)
    p.add_argument(
        "--engine-budget", type=non_negative_int, default=0, help="P/D: most engines in all (0: the sum of the maxima)"
    )
    p.add_argument("--kv-transfer-gbps", type=positive_float, default=100.0, help="P/D: KV link GB/s")
    p.add_argument("--max-engines", type=positive_int, default=8)
    p.add_argument("--min-engines", type=positive_int, default=1)
    p.add_argument("--interval", type=positive_float, default=10.0)
    p.add_argument("--engine-startup-s", type=non_negative_float, default=20.0)
    p.add_argument("--scale-down-cooldown", type=non_negative_float, default=30.0)
    p.add_argument("--sla-headroom", type=unit_fraction, default=0.7)
    p.add_argument(
        "--lookahead-s",
        type=non_negative_float,
        default=0.0,
        help="SLA mode: also plan for the rate this many s past the next interval",
    )
    p.add_argument("--profile", default=None, help="engine profile NPZ (default: the shipped mocker profile)")
    p.add_argument("--arrival-speedup", type=positive_float, default=1.0)
    p.add_argument("--max-requests", type=positive_int, default=None)
    p.add_argument("--max-num-seqs", type=positive_int, default=256, help="running sequences per engine (worker flag)")
    p.add_argument("--json", type=output_file, metavar="PATH")
    p.add_argument("--plot", type=png_file, metavar="PNG")
    return p


def _modes(spec: str) -> list[str]:
    """``sla:kalman,load:latency``: each an SLA planner with a predictor or a load planner with a profile."""
    modes = [m for m in spec.split(",") if m]
    known = [*(f"sla:{p}" for p in PREDICTORS), "load:latency", "load:throughput"]
    for mode in modes:
        if mode not in known:
            raise argparse.ArgumentTypeError(f"unknown planner run {mode!r}; expected some of {', '.join(known)}")
    if not modes:
        raise argparse.ArgumentTypeError("no planner run given")
    return modes


def _sizes(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        if "-" in part:
            a, b = part.split("-")
            out += list(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    if not out or min(out) < 1:
        raise ValueError(f"--statics {spec}: static fleets are 1 engine or more")
    return out


def _splits(spec: str) -> list[tuple[int, int]]:
    """``1x1-6,2x2-6`` -> [(1, 1) .. (1, 6), (2, 2) .. (2, 6)]: (prefill, decode) engines."""
    out: list[tuple[int, int]] = []
    for part in spec.split(","):
        if not part:
            continue
        prefill, sep, decode = part.partition("x")
        if not sep:
            raise ValueError(f"--statics {part!r}: a P/D split is PxD, e.g. 1x3 or 1x1-6")
        out += [(a, b) for a in _sizes(prefill) for b in _sizes(decode)]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    disagg = args.pools != "aggregated"
    try:
        rows = load_trace(args.trace, max_requests=args.max_requests)
        requests, _ = build_requests(rows, arrival_speedup=args.arrival_speedup)
        statics: list[int] = [] if disagg else _sizes(args.statics or "1-8")
        splits = _splits(args.statics or "1x1-4,2x2-4") if disagg else []
        if args.profile and not Path(args.profile).is_file():
            raise ValueError(f"--profile {args.profile}: no such file")
        if disagg and (args.min_prefill > args.max_prefill or args.min_decode > args.max_decode):
            raise ValueError("--min-prefill/--min-decode must not exceed --max-prefill/--max-decode")
        if not disagg and args.min_engines > args.max_engines:
            raise ValueError("--min-engines must not exceed --max-engines")
    except (TraceError, ValueError, OSError) as exc:
        print(f"kvmesh bench planner-sim: error: {exc}", file=sys.stderr)
        return 2
    fleet = OfflineConfig(max_num_seqs=args.max_num_seqs)
    pd = DisaggConfig(args.min_prefill, args.min_decode, args.kv_transfer_gbps)
    if disagg:
        pools = {
            "prefill": PoolBounds(args.min_prefill, args.max_prefill),
            "decode": PoolBounds(args.min_decode, args.max_decode),
        }
        budget = args.engine_budget or args.max_prefill + args.max_decode
    else:
        pools = {"aggregated": PoolBounds(args.min_engines, args.max_engines)}
        budget = args.max_engines
    results: list[SimResult] = []
    for mode in args.modes:
        kind, _, variant = mode.partition(":")
        cfg = PlannerConfig(
            mode="sla" if kind == "sla" else "load",
            load_profile="latency" if variant == "latency" else "throughput",
            predictor=variant if kind == "sla" and variant else "kalman",
            pools=pools,  # type: ignore[arg-type]
            max_engines=budget,
            interval_s=args.interval,
            ttft_ms=args.ttft_ms,
            itl_ms=args.itl_ms,
            scale_down_cooldown_s=args.scale_down_cooldown,
            sla_headroom=args.sla_headroom,
            lookahead_s=args.lookahead_s,
        )
        if disagg:
            results.append(
                run_planner_sim_disagg(
                    requests,
                    fleet,
                    pd,
                    cfg,
                    initial=(args.min_prefill, args.min_decode),
                    engine_startup_s=args.engine_startup_s,
                    profile=args.profile,
                    label=f"planner {mode}",
                )
            )
            continue
        results.append(
            run_planner_sim(
                requests,
                fleet,
                cfg,
                engine_startup_s=args.engine_startup_s,
                profile=args.profile,
                label=f"planner {mode}",
            )
        )
    for size in statics:
        results.append(run_planner_sim(requests, fleet, None, static_engines=size))
    for prefill, decode in splits:
        results.append(run_planner_sim_disagg(requests, fleet, pd, None, initial=(prefill, decode)))
    rows_out = [r.summary(args.ttft_ms, args.itl_ms) for r in results]
    static_ok = [s for s in rows_out if str(s["label"]).startswith("static") and float(s["sla_attainment"]) >= 0.95]  # type: ignore[arg-type]
    baseline = min((float(s["engine_seconds"]) for s in static_ok), default=float("nan"))  # type: ignore[arg-type]
    print(
        f"trace {args.trace}: {len(requests)} requests, TTFT <= {args.ttft_ms:g} ms, ITL <= {args.itl_ms:g} ms, "
        f"engine start-up {args.engine_startup_s:g} s"
        + (f", prefill/decode pools, KV link {args.kv_transfer_gbps:g} GB/s" if disagg else "")
    )
    print(
        f"{'run':<24} {'SLA':>7} {'engine-s':>9} {'vs static':>9} {'events':>6} {'TTFT p50':>9} {'TTFT p95':>9} "
        f"{'ITL p95':>8} {'failed':>6}" + (f" {'prefill-s':>9} {'decode-s':>9}" if disagg else "")
    )
    for s in rows_out:
        ratio = float(s["engine_seconds"]) / baseline if baseline == baseline else float("nan")  # type: ignore[arg-type]
        s["engine_seconds_vs_smallest_static_95"] = ratio
        s["goal_met"] = bool(float(s["sla_attainment"]) >= 0.95 and ratio <= 0.75)  # type: ignore[arg-type]
        print(
            f"{s['label']!s:<24} {float(s['sla_attainment']):>7.1%} {float(s['engine_seconds']):>9.0f} {ratio:>9.2f} "  # type: ignore[arg-type]
            f"{s['scaling_events']!s:>6} {float(s['ttft_p50_ms']):>9.0f} {float(s['ttft_p95_ms']):>9.0f} "  # type: ignore[arg-type]
            f"{float(s['itl_p95_ms']):>8.1f} {s['failed']!s:>6}"  # type: ignore[arg-type]
            + (
                f" {s['pool_engine_seconds']['prefill']:>9.0f} {s['pool_engine_seconds']['decode']:>9.0f}"  # type: ignore[index]
                if disagg
                else ""
            )
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        planners = [r for r in results if r.label.startswith("planner")]
        data = {
            "trace": args.trace,
            "settings": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
            "smallest_static_95_engine_seconds": baseline,
            "runs": rows_out,
            "timelines": {r.label: r.timeline for r in planners},
            "pool_timelines": {r.label: r.pool_timelines for r in planners if r.pool_timelines},
            "decisions": {r.label: r.decisions for r in planners},
        }
        write_json(args.json, data, default=float)
    plot = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if plot:
        _plot(results, args, plot)
    return 0


def _plot(results: list[SimResult], args: argparse.Namespace, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    planners = [r for r in results if r.label.startswith("planner")]
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    arrivals = planners[0].arrival_ms / 1000.0 if planners else np.array([])
    if arrivals.size:
        bins = np.arange(0, arrivals.max() + 10, 10)
        counts, _ = np.histogram(arrivals, bins)
        axes[0].plot(bins[:-1], counts / 10.0, color="black")
    axes[0].set_ylabel("arrivals (req/s)")
    w = 50
    for r in planners:
        # A P/D run: one pair of lines per pool (dashed: prefill); aggregated: the whole fleet.
        lines = r.pool_timelines or {"": r.timeline}
        color = None
        for pool, timeline in lines.items():
            t = [x[0] for x in timeline]
            name = f"{r.label} {pool}".rstrip()
            style = "--" if pool == "prefill" else "-"
            line = axes[1].step(
                t, [x[2] for x in timeline], where="post", linestyle=style, color=color, label=f"{name} (asked for)"
            )[0]
            color = line.get_color()
            axes[1].step(t, [x[1] for x in timeline], where="post", linestyle=":", color=color, label=f"{name} (ready)")
        order = np.argsort(r.arrival_ms)
        when = r.arrival_ms[order][w - 1 :] / 1000.0
        for ax, values in ((axes[2], r.ttft_ms), (axes[3], r.itl_ms)):
            v = np.minimum(values[order], 1e5)  # an unserved request (inf) plots as 100 s
            if v.size > w:
                ax.plot(when, np.convolve(v, np.ones(w) / w, mode="valid"), color=line.get_color(), label=r.label)
    axes[1].set_ylabel("engines")
    axes[1].legend(fontsize=7)
    axes[2].axhline(args.ttft_ms, color="red", linestyle="--", label="TTFT target")
    axes[2].set_ylabel(f"TTFT, {w}-request mean (ms)")
    axes[2].set_yscale("log")
    axes[2].legend(fontsize=7)
    axes[3].axhline(args.itl_ms, color="red", linestyle="--", label="ITL target")
    axes[3].set_ylabel(f"ITL, {w}-request mean (ms)")
    axes[3].set_yscale("log")
    axes[3].set_xlabel("time of arrival (s)")
    axes[3].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
