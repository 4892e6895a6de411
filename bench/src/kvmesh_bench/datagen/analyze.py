"""Trace statistics (``kvmesh datagen analyze``) and the synthesized-vs-source comparison (``--compare``).

A comparison can take several traces (e.g. synthesized with different seeds) and the source replayed in
several within-timestamp orders: each figure is then the median of each side, with the range beside it,
because one replay of a loaded fleet moves more than the 10 % a synthesizer is held to (round robin at x6:
TTFT p99 7-15 s from the same requests in another order).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from kvmesh_bench.datagen.prefix_tree import TreePropertyError, extract_core_tree, request_exits, summarize
from kvmesh_bench.stats import mann_whitney_p
from kvmesh_bench.trace import DEFAULT_BLOCK_SIZE, TraceRequest

__all__ = [
    "REPLAY_LOADS",
    "REPLAY_MODES",
    "analyze",
    "arrival_stats",
    "compare",
    "correlations",
    "format_analysis",
    "format_comparison",
    "prefix_hit_rate",
    "reordered_replays",
    "replay_figures",
]

#: The fidelity bar of a synthesized trace: each compared figure within this fraction of the source's.
FIDELITY_TOLERANCE = 0.10

#: What ``analyze --compare`` replays on both traces (offline, 8 engines): arrival speedups and routing modes
#: (``kv`` = the router's default policy).
REPLAY_LOADS: tuple[float, ...] = (1.0, 6.0)
REPLAY_MODES: tuple[str, ...] = ("round_robin", "kv")


def prefix_hit_rate(requests: Sequence[TraceRequest]) -> dict[str, float]:
    """Infinite-cache block hit rate, in trace order.

    Block ``i`` of a request hits when an earlier request (or an earlier part of the same one) had the same
    prefix path ``hash_ids[: i + 1]``. Paths are keyed in a trie, so a hash id reused under another parent
    does not count as a hit.
    """
    trie: dict[int, dict] = {}
    hits = 0
    blocks = 0
    for request in requests:
        level = trie
        for block in request.hash_ids:
            blocks += 1
            child = level.get(block)
            if child is None:
                child = level[block] = {}
            else:
                hits += 1
            level = child
    return {"hit_blocks": hits, "blocks": blocks, "hit_rate": hits / blocks if blocks else 0.0}


def arrival_stats(requests: Sequence[TraceRequest]) -> dict[str, Any]:
    """Span, request rate, requests per timestamp and inter-arrival gaps (in time order)."""
    timestamps = sorted(request.timestamp_ms for request in requests)
    span_ms = timestamps[-1] - timestamps[0]
    per_timestamp = Counter(timestamps)
    distinct = list(per_timestamp)
    return {
        "span_s": span_ms / 1000.0,
        "request_rate_rps": (len(timestamps) - 1) / (span_ms / 1000.0) if span_ms > 0 else None,
        "distinct_timestamps": len(distinct),
        "requests_per_timestamp": summarize(list(per_timestamp.values())),
        "inter_arrival_ms": summarize([b - a for a, b in pairwise(timestamps)]),
        "timestamp_gap_ms": summarize([b - a for a, b in pairwise(distinct)]),
    }


def analyze(requests: Sequence[TraceRequest], block_size: int = DEFAULT_BLOCK_SIZE) -> dict[str, Any]:
    """All the figures of ``kvmesh datagen analyze`` as a JSON-ready dict."""
    if not requests:
        raise ValueError("cannot analyze an empty trace")
    mismatched = sum(1 for r in requests if len(r.hash_ids) != -(-r.input_length // block_size))
    report: dict[str, Any] = {
        "requests": len(requests),
        "block_size": block_size,
        "rows_with_block_count_mismatch": mismatched,
        "isl": summarize([request.input_length for request in requests]),
        "osl": summarize([request.output_length for request in requests]),
        "cache": prefix_hit_rate(requests),
        "arrivals": arrival_stats(requests),
    }
    try:
        tree = extract_core_tree(requests)
    except TreePropertyError as exc:
        report["prefix_tree"] = {"error": str(exc)}
        report["correlations"] = correlations(requests, None, block_size)
    else:
        report["prefix_tree"] = tree.stats()
        shared = [
            min(covered * block_size, r.input_length)
            for r, (_, covered) in zip(requests, request_exits(tree.graph, requests), strict=True)
        ]
        report["correlations"] = correlations(requests, shared, block_size)
    return report


def correlations(
    requests: Sequence[TraceRequest], shared_prefix: Sequence[int] | None, block_size: int = DEFAULT_BLOCK_SIZE
) -> dict[str, float | None]:
    """Spearman rank correlations of ISL with OSL and with the shared prefix (tokens of a request's core-tree
    path, i.e. of its prefix that some other request shares); None where undefined (a constant column)."""
    from scipy.stats import spearmanr

    isl = [r.input_length for r in requests]

    def rho(other: Sequence[float]) -> float | None:
        if len(isl) < 2 or len(set(isl)) < 2 or len(set(other)) < 2:
            return None
        value = float(spearmanr(isl, other).statistic)
        return value if math.isfinite(value) else None

    return {
        "isl_osl_spearman": rho([r.output_length for r in requests]),
        "isl_shared_prefix_spearman": None if shared_prefix is None else rho(shared_prefix),
    }


def replay_figures(
    requests: Sequence[TraceRequest],
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_requests: int = 2000,
    loads: Sequence[float] = REPLAY_LOADS,
    modes: Sequence[str] = REPLAY_MODES,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Offline replays of the first ``max_requests`` requests (8 engines, block size 64, 16384 blocks: the
    replay's defaults) per load and routing mode: ``{"round_robin x1": {ttft_p50_ms, ttft_p99_ms, hit_rate}}``."""
    from kvmesh_router.policies import DEFAULT_COST_POLICY

    from kvmesh_bench.replay.offline import OfflineConfig, run_offline
    from kvmesh_bench.replay.report import summarize as summarize_run
    from kvmesh_bench.replay.workload import TokenMapper, build_requests

    rows = list(requests[:max_requests])
    out: dict[str, dict[str, float]] = {}
    for load in loads:
        replay, _ = build_requests(rows, arrival_speedup=load, block_tokens=block_size)
        for mode in modes:
            config = OfflineConfig(router_mode=mode, cost_policy=DEFAULT_COST_POLICY, seed=seed)
            run = run_offline(replay, config, TokenMapper(block_tokens=block_size, seed=seed), label=mode)
            s = summarize_run(run)
            out[f"{mode} x{load:g}"] = {
                "ttft_p50_ms": s.ttft_p50_ms,
                "ttft_p99_ms": s.ttft_p99_ms,
                "hit_rate": s.hit_rate,
            }
    return out


def reordered_replays(
    requests: Sequence[TraceRequest],
    shuffles: int,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_requests: int = 2000,
) -> list[dict[str, dict[str, float]]]:
    """:func:`replay_figures` of ``requests`` replayed ``shuffles`` times, each time with the requests of every
    timestamp in another random order (same arrival times, same contents): how far the replayed figures move
    without any change to the load. A synthesized trace cannot be expected closer to the source than this.
    """
    import random
    from itertools import groupby

    rows = list(requests[:max_requests])
    runs = []
    for k in range(shuffles):
        rng = random.Random(k)
        shuffled: list[TraceRequest] = []
        for _, group in groupby(rows, key=lambda r: r.timestamp_ms):
            batch = list(group)
            rng.shuffle(batch)
            shuffled += batch
        runs.append(replay_figures(shuffled, block_size=block_size, max_requests=max_requests))
    return runs


def _fmt(value: float | None) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) < 1e15):
        return f"{int(value):,}"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:,.2f}" if abs(value) >= 10 else f"{value:.4g}"


def _rho(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.3f}"


def _dist_line(label: str, stats: dict[str, float | None], unit: str = "") -> str:
    keys = ("mean", "p50", "p90", "p99", "min", "max")
    values = "  ".join(f"{key} {_fmt(stats[key])}" for key in keys)
    return f"  {label:<24}{values}{unit}"


def format_analysis(report: dict[str, Any], title: str = "") -> str:
    """Human-readable text of :func:`analyze`'s figures."""
    arrivals = report["arrivals"]
    cache = report["cache"]
    lines = [
        f"{title or 'trace'}: {report['requests']:,} requests over {arrivals['span_s']:,.1f} s "
        f"({_fmt(arrivals['request_rate_rps'])} req/s), block size {report['block_size']}",
        _dist_line("ISL (tokens)", report["isl"]),
        _dist_line("OSL (tokens)", report["osl"]),
        f"  {'rank correlations':<24}ISL-OSL {_rho(report['correlations']['isl_osl_spearman'])}, ISL-shared "
        f"prefix {_rho(report['correlations']['isl_shared_prefix_spearman'])} (Spearman)",
        f"  {'prefix hit rate':<24}{cache['hit_rate']:.2%} "
        f"({cache['hit_blocks']:,} of {cache['blocks']:,} blocks seen before, infinite cache)",
        _dist_line("inter-arrival (ms)", arrivals["inter_arrival_ms"]),
        _dist_line("gap between stamps (ms)", arrivals["timestamp_gap_ms"]),
        _dist_line("requests per timestamp", arrivals["requests_per_timestamp"]),
    ]
    if report["rows_with_block_count_mismatch"]:
        lines.append(
            f"  note: {report['rows_with_block_count_mismatch']:,} rows have len(hash_ids) != "
            f"ceil(input_length / {report['block_size']})"
        )
    tree = report["prefix_tree"]
    if "error" in tree:
        lines.append(f"  prefix tree: {tree['error']}")
    else:
        lines += [
            f"  {'prefix tree':<24}{tree['distinct_blocks']:,} distinct blocks; core radix tree "
            f"{tree['core_nodes']:,} nodes / {tree['core_blocks']:,} blocks, depth {tree['core_depth_nodes']} nodes "
            f"/ {tree['core_depth_blocks']} blocks",
            f"  {'branching':<24}root children {tree['root_children']:,}; {tree['internal_nodes']:,} internal "
            f"nodes, mean {tree['branching_mean']:.2f} / max {tree['branching_max']:,} children",
            _dist_line("core node len (blocks)", tree["node_length_blocks"]),
            _dist_line("leaf len (blocks)", tree["leaf_length_blocks"]),
            f"  {'unique leaves':<24}{tree['unique_leaves']:,} ({tree['requests_with_unique_leaf']:.1%} of "
            f"requests; {tree['requests_ending_in_core']:.1%} end inside the core tree)",
        ]
    return "\n".join(lines)


_COMPARED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("requests", ("requests",)),
    ("ISL mean", ("isl", "mean")),
    ("ISL p50", ("isl", "p50")),
    ("ISL p90", ("isl", "p90")),
    ("ISL p99", ("isl", "p99")),
    ("OSL mean", ("osl", "mean")),
    ("OSL p50", ("osl", "p50")),
    ("OSL p90", ("osl", "p90")),
    ("OSL p99", ("osl", "p99")),
    ("ISL-OSL rank corr.", ("correlations", "isl_osl_spearman")),
    ("ISL-shared-prefix corr.", ("correlations", "isl_shared_prefix_spearman")),
    ("hit rate", ("cache", "hit_rate")),
    ("request rate (req/s)", ("arrivals", "request_rate_rps")),
    ("inter-arrival mean (ms)", ("arrivals", "inter_arrival_ms", "mean")),
    ("inter-arrival p50 (ms)", ("arrivals", "inter_arrival_ms", "p50")),
    ("inter-arrival p99 (ms)", ("arrivals", "inter_arrival_ms", "p99")),
    ("stamp gap mean (ms)", ("arrivals", "timestamp_gap_ms", "mean")),
    ("requests/stamp mean", ("arrivals", "requests_per_timestamp", "mean")),
)


def _at(report: Any, path: Sequence[str]) -> Any:
    for key in path:
        report = report.get(key) if isinstance(report, dict) else None
    return report


def _median(values: Sequence[Any]) -> Any:
    known = [v for v in values if v is not None]
    if not known:
        return None
    return known[0] if len(known) == 1 else statistics.median(known)


def compare(traces: dict[str, Any] | Sequence[dict[str, Any]], source: dict[str, Any]) -> list[dict[str, Any]]:
    """Side by side: each metric of :func:`analyze` reports with ``(trace - source) / source``.

    ``traces``: one report, or several (the median of each figure is compared, and ``trace_range`` gives their
    min and max). A source with ``replay_reordered`` (:func:`reordered_replays`) is compared by the median of its
    replays in every order, its own and the reordered ones, and ``source_range`` gives their min and max.
    ``within_tolerance``: the relative difference is at most :data:`FIDELITY_TOLERANCE`. ``p_value`` (replayed
    figures, several traces against several source orders): the two-sided
    :func:`~kvmesh_bench.stats.mann_whitney_p` of the two samples: below 0.05 they differ beyond the replay's noise.
    """
    reports = [traces] if isinstance(traces, dict) else list(traces)
    # (label, path in a report, the source's replays of that figure or None: read the source at the path)
    compared: list[tuple[str, tuple[str, ...], list[Any] | None]] = [(label, path, None) for label, path in _COMPARED]
    source_replays = [source.get("replay", {}), *source.get("replay_reordered", [])]
    for run in reports[0].get("replay", {}):
        if run in source.get("replay", {}):
            for key, name in (
                ("ttft_p50_ms", "TTFT p50 (ms)"),
                ("ttft_p99_ms", "TTFT p99 (ms)"),
                ("hit_rate", "hit rate"),
            ):
                samples = [replays.get(run, {}).get(key) for replays in source_replays]
                compared.append((f"replay {run} {name}", ("replay", run, key), samples))
    rows = []
    for label, path, source_samples in compared:
        values = [_at(report, path) for report in reports]
        value = _median(values)
        reference = _median(source_samples) if source_samples else _at(source, path)
        if value is not None and value == reference:
            relative: float | None = 0.0  # equal, zero included
        else:
            relative = (value - reference) / abs(reference) if value is not None and reference else None
        row: dict[str, Any] = {"metric": label, "trace": value, "source": reference, "relative_diff": relative}
        traced = [v for v in values if v is not None]
        if len(reports) > 1 and traced:
            row["trace_range"] = [min(traced), max(traced)]
        replayed = [v for v in source_samples or () if v is not None]
        if len(replayed) > 1:  # the source's own spread under within-timestamp reordering
            row["source_range"] = [min(replayed), max(replayed)]
            if len(traced) > 1:
                row["p_value"] = mann_whitney_p(traced, replayed)
        row["within_tolerance"] = relative is not None and abs(relative) <= FIDELITY_TOLERANCE
        rows.append(row)
    return rows


def format_comparison(rows: list[dict[str, Any]], trace_name: str = "trace", source_name: str = "source") -> str:
    """The comparison as a text table (``trace_name`` and ``source_name`` head the lines above it)."""

    def cell(metric: str, value: float | None) -> str:
        if value is not None and (metric.endswith("hit rate") or metric.endswith("corr.")):
            return f"{value:.2%}" if metric.endswith("hit rate") else f"{value:+.3f}"
        return _fmt(value)

    def span(row: dict[str, Any], key: str) -> str:
        lo, hi = row[key]
        return f"{cell(row['metric'], lo)} - {cell(row['metric'], hi)}"

    several = any("trace_range" in row for row in rows)
    noisy = any("source_range" in row for row in rows)
    header = f"{'metric':<36}{'trace':>14}{'source':>14}{'rel. diff':>11}  {f'<= {FIDELITY_TOLERANCE:.0%}':>6}"
    if several:
        header += f"  {'traces, min - max':>25}"
    if noisy:
        header += f"  {'source, reordered within stamps':>31}"
    tested = any("p_value" in row for row in rows)
    if tested:
        header += f"  {'p':>5}"
    lines = [f"trace:  {trace_name}", f"source: {source_name}"]
    if several:
        lines.append("trace column: the median of the traces")
    if noisy:
        lines.append("source column, replays: the median of the source's orders (its own and the reordered ones)")
    if tested:
        lines.append(
            "p: Mann-Whitney U (two-sided) of the traces' replays against the source's orders; below 0.05 they "
            "differ beyond the replay's own noise"
        )
    lines += [header, "-" * len(header)]
    for row in rows:
        relative = "n/a" if row["relative_diff"] is None else f"{row['relative_diff']:+.1%}"
        line = (
            f"{row['metric']:<36}{cell(row['metric'], row['trace']):>14}"
            f"{cell(row['metric'], row['source']):>14}{relative:>11}  {'yes' if row['within_tolerance'] else 'no':>6}"
        )
        if several:
            line += f"  {span(row, 'trace_range') if 'trace_range' in row else '':>25}"
        if noisy:
            line += f"  {span(row, 'source_range') if 'source_range' in row else '':>31}"
        if tested:
            line += f"  {format(row['p_value'], '.2f') if 'p_value' in row else '':>5}"
        lines.append(line.rstrip())
    return "\n".join(lines)
