"""What a replay measured, the figures derived from it, and how they are printed, saved and plotted.

Offline and live replays both produce a :class:`RunData` (per-request columns plus the token-gap
distribution), so every figure is computed by the same code:

- **TTFT**: first token delivered - arrival (the trace time ÷ ``--arrival-speedup``; live: the scheduled
  send time, so a client that falls behind is charged for it).
- **ITL**: the distribution of token-to-token gaps over all tokens (Dynamo's replay reports the same);
  stored as values with weights (a gap that several tokens share counts once per token).
- **End-to-end**: last token - arrival.
- **requests/s, output tokens/s**: completed requests and their output tokens ÷ (last finish - first arrival).
- **Prefix hit rate**: cached prompt tokens ÷ prompt tokens = 1 - computed prefill tokens ÷ input tokens.
  Offline the engines' own count (prefix-cache hit at a request's first admission); live the router's
  (``kvmesh.cached_tokens``: overlap x block size on the chosen engine), the only figure a client sees.

JSON (``--json``) holds the summary, the per-engine figures and the configuration; PNG plots: TTFT CDF,
latency over time and per-engine load.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvmesh_bench import tables
from kvmesh_bench.stats import percentile, weighted_percentile

__all__ = [
    "RunData",
    "Summary",
    "format_table",
    "median_summary",
    "plot_compare",
    "plot_run",
    "summarize",
    "weighted_percentile",
    "write_json",
]


@dataclass
class RunData:
    """Everything one replay measured; times in ms on one clock (virtual offline, wall live)."""

    label: str
    kind: str  # "offline" | "live"
    arrival_ms: np.ndarray
    first_token_ms: np.ndarray  # NaN: no token came
    finish_ms: np.ndarray  # NaN: did not complete
    engine: np.ndarray  # engine index (0..E-1), -1 if unknown
    input_tokens: np.ndarray
    output_tokens: np.ndarray  # tokens asked for (max_tokens, ignore_eos)
    cached_tokens: np.ndarray
    itl_ms: np.ndarray  # token gaps ...
    itl_weight: np.ndarray  # ... and how many tokens had that gap
    engines: int
    hit_source: str
    errors: list[str] = field(default_factory=list)
    # Per-engine load samples (offline only): columns t_ms, engine, active blocks, running, waiting, queued prefill.
    load: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def ttft_ms(self) -> np.ndarray:
        return self.first_token_ms - self.arrival_ms

    @property
    def e2e_ms(self) -> np.ndarray:
        return self.finish_ms - self.arrival_ms

    @property
    def completed(self) -> np.ndarray:
        return ~np.isnan(self.finish_ms)


@dataclass(frozen=True)
class Summary:
    label: str
    kind: str
    requests: int
    completed: int
    failed: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    itl_mean_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    requests_per_s: float
    output_tokens_per_s: float
    hit_rate: float
    hit_source: str
    duration_s: float  # first arrival -> last finish

    def as_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in self.__dict__.items()}


def summarize(run: RunData) -> Summary:
    done = run.completed
    ttft, e2e = run.ttft_ms, run.e2e_ms
    first = float(np.nanmin(run.arrival_ms)) if run.arrival_ms.size else 0.0
    last = float(np.nanmax(run.finish_ms)) if done.any() else first
    span_s = max(last - first, 1e-9) / 1000.0
    w = run.itl_weight
    itl_mean = float((run.itl_ms * w).sum() / w.sum()) if w.size and w.sum() > 0 else math.nan
    inputs = run.input_tokens[done].sum()
    return Summary(
        label=run.label,
        kind=run.kind,
        requests=int(run.arrival_ms.size),
        completed=int(done.sum()),
        failed=int(run.arrival_ms.size - done.sum()),
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p90_ms=percentile(ttft, 90),
        ttft_p99_ms=percentile(ttft, 99),
        ttft_mean_ms=float(np.nanmean(ttft)) if (~np.isnan(ttft)).any() else math.nan,
        itl_p50_ms=weighted_percentile(run.itl_ms, w, 50),
        itl_p99_ms=weighted_percentile(run.itl_ms, w, 99),
        itl_mean_ms=itl_mean,
        e2e_p50_ms=percentile(e2e, 50),
        e2e_p99_ms=percentile(e2e, 99),
        requests_per_s=float(done.sum()) / span_s if done.any() else 0.0,
        output_tokens_per_s=float(run.output_tokens[done].sum()) / span_s if done.any() else 0.0,
        hit_rate=float(run.cached_tokens[done].sum() / inputs) if inputs else math.nan,
        hit_source=run.hit_source,
        duration_s=span_s if done.any() else 0.0,
    )


def median_summary(summaries: Sequence[Summary]) -> Summary:
    """Each figure's median over several runs of one setup (Dynamo reports the median of 3 runs)."""
    first = summaries[0]
    if len(summaries) == 1:
        return first
    values: dict[str, Any] = {}
    for key, value in first.__dict__.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            column = np.array([getattr(x, key) for x in summaries], dtype=float)
            median = float(np.nanmedian(column)) if (~np.isnan(column)).any() else math.nan
            values[key] = round(median) if isinstance(value, int) else median
        else:
            values[key] = value
    return Summary(**values)


def per_engine(run: RunData) -> list[dict[str, Any]]:
    """Requests, prompt tokens, cached tokens and TTFT p50 of each engine."""
    out = []
    for e in range(run.engines):
        mask = run.engine == e
        out.append(
            {
                "engine": e,
                "requests": int(mask.sum()),
                "input_tokens": int(run.input_tokens[mask].sum()),
                "cached_tokens": int(run.cached_tokens[mask].sum()),
                "ttft_p50_ms": percentile(run.ttft_ms[mask], 50) if mask.any() else None,
            }
        )
    return out


_COLUMNS = (
    ("TTFT p50", "ttft_p50_ms", "{:.0f} ms"),
    ("TTFT p99", "ttft_p99_ms", "{:.0f} ms"),
    ("ITL p50", "itl_p50_ms", "{:.2f} ms"),
    ("E2E p50", "e2e_p50_ms", "{:.0f} ms"),
    ("req/s", "requests_per_s", "{:.2f}"),
    ("out tok/s", "output_tokens_per_s", "{:.0f}"),
    ("hit rate", "hit_rate", "{:.3f}"),
    ("done", "completed", "{}"),
)


def _fmt(fmt: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def format_table(summaries: Sequence[Summary], baseline: Summary | None = None) -> str:
    """A fixed-width table, one row per run; with ``baseline``, a ratio row under each run."""
    head = ["run", *(c[0] for c in _COLUMNS)]
    rows = []
    for s in summaries:
        rows.append([s.label, *(_fmt(fmt, getattr(s, key)) for _, key, fmt in _COLUMNS)])
        if baseline is not None and s is not baseline:
            ratio = ["  / " + baseline.label]
            for _, key, _ in _COLUMNS:
                a, b = getattr(s, key), getattr(baseline, key)
                ok = key != "completed" and _finite(a) and _finite(b) and b != 0
                ratio.append(f"x{a / b:.2f}" if ok else "")
            rows.append(ratio)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths, strict=True)))]
    for r in rows:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    return "\n".join(lines)


def run_json(run: RunData) -> dict[str, Any]:
    return {
        "summary": summarize(run).as_dict(),
        "per_engine": per_engine(run),
        "meta": run.meta,
        "errors": run.errors[:100],
    }


def write_json(path: str | Path, payload: Mapping[str, Any]) -> None:
    tables.write_json(path, payload, default=_json_default)  # numpy scalars and arrays, NaN as null


def _json_default(value: Any) -> Any:
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return None if math.isnan(value) else float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


# ----------------------------------------------------------------------------------------- plots


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _in_flight(run: RunData, times_ms: np.ndarray) -> np.ndarray:
    """Requests in flight per engine at each time: shape (engines, len(times))."""
    out = np.zeros((run.engines, times_ms.size))
    end = np.where(np.isnan(run.finish_ms), np.inf, run.finish_ms)
    for e in range(run.engines):
        mask = run.engine == e
        starts = np.sort(run.arrival_ms[mask])
        ends = np.sort(end[mask])
        out[e] = np.searchsorted(starts, times_ms, side="right") - np.searchsorted(ends, times_ms, side="right")
    return out


def plot_run(run: RunData, path: str | Path) -> Path:
    """One PNG with three panels: TTFT CDF, TTFT/E2E over time, per-engine load."""
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    s = summarize(run)
    _cdf(axes[0], [(run.label, run.ttft_ms)])
    axes[0].set_title(f"TTFT CDF (p50 {s.ttft_p50_ms:.0f} ms, p99 {s.ttft_p99_ms:.0f} ms)")

    ax = axes[1]
    t_s = run.arrival_ms / 1000.0
    ax.scatter(t_s, run.ttft_ms, s=2, alpha=0.35, label="TTFT")
    ax.scatter(t_s, run.e2e_ms, s=2, alpha=0.15, label="end-to-end")
    if np.any(np.isfinite(run.ttft_ms) & (run.ttft_ms > 0)):  # a log scale of nothing raises: no request done
        ax.set_yscale("log")
    ax.set_xlabel("arrival (s)")
    ax.set_ylabel("ms")
    ax.set_title("latency over time")
    ax.legend(loc="upper left", markerscale=4)

    ax = axes[2]
    end = np.nanmax(run.finish_ms) if run.completed.any() else float(np.nanmax(run.arrival_ms))
    if run.load is not None and run.load.size:
        for e in range(run.engines):
            rows = run.load[run.load[:, 1] == e]
            ax.plot(rows[:, 0] / 1000.0, rows[:, 2], lw=0.8, label=f"engine {e}")
        ax.set_ylabel("active KV blocks")
    else:
        grid = np.linspace(float(np.nanmin(run.arrival_ms)), float(end), 400)
        for e, series in enumerate(_in_flight(run, grid)):
            ax.plot(grid / 1000.0, series, lw=0.8, label=f"engine {e}")
        ax.set_ylabel("requests in flight")
    ax.set_xlabel("time (s)")
    ax.set_title("per-engine load")
    if run.engines <= 16:
        ax.legend(fontsize=6, ncol=2, loc="upper left")
    fig.suptitle(f"{run.label}: hit rate {s.hit_rate:.3f}, {s.requests_per_s:.2f} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _cdf(ax: Any, series: Sequence[tuple[str, np.ndarray]]) -> None:
    plotted = False
    for label, values in series:
        v = np.sort(values[~np.isnan(values)])
        if v.size:
            ax.plot(v, np.arange(1, v.size + 1) / v.size, label=label)
            plotted = True
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, which="both", alpha=0.3)
    if plotted:  # a log scale of nothing raises, and a legend of nothing warns (no request done)
        ax.set_xscale("log")
        ax.legend(loc="lower right", fontsize=8)


def plot_compare(runs: Sequence[RunData], path: str | Path, title: str = "") -> Path:
    """TTFT CDFs of several runs on one axis, plus their hit rates as bars."""
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    _cdf(ax, [(r.label, r.ttft_ms) for r in runs])
    ax.set_title("TTFT CDF")
    sums = [summarize(r) for r in runs]
    bx.bar([s.label for s in sums], [s.hit_rate for s in sums], color="tab:green")
    bx.set_title("prefix hit rate")
    bx.tick_params(axis="x", labelrotation=20, labelsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
