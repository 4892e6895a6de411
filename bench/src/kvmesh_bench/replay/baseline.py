"""``kvmesh bench replay --offline --baseline dynamo``: kvmesh's offline replay beside Dynamo's, in one run.

Dynamo 1.6.1 is a benchmark baseline, never a dependency: it lives in its own venv (see
``docs/benchmarks.md``), named by ``--dynamo-python`` or ``$KVMESH_DYNAMO_PYTHON``. Without it the
comparison is skipped with a note and the exit status stays 0.

What is compared is what a user pays: the **whole-process CPU time** (user + system, from ``wait4``)
of ``kvmesh bench replay --offline`` against a process that calls Dynamo's ``run_trace_replay`` on the
same trace rows (the first ``--max-requests``), the same fleet (engines, block size, KV blocks) and
the same arrival speedup, kv routing and round robin. The two are run alternately, ``--repeats``
times each, so that load on a shared machine hits both alike; the table shows medians and ratios
(kvmesh / Dynamo: below 1 is kvmesh cheaper or lower). The replays' own figures (TTFT, ITL, hit
rate) are shown beside the CPU so a speed-up can never hide a change of behaviour.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh_bench.trace import TraceRequest, write_trace

__all__ = ["DYNAMO_ENV", "SideBySide", "dynamo_python", "format_side_by_side", "run_side_by_side"]

DYNAMO_ENV = "KVMESH_DYNAMO_PYTHON"

#: kvmesh mode -> Dynamo ``router_mode`` (kv: kvmesh's default policy against Dynamo's default KvRouterConfig).
MODES = {"kv": "kv_router", "round_robin": "round_robin"}

_DYNAMO_SCRIPT = """
import json, sys
from dynamo.replay import run_trace_replay
trace, mode, speedup, engines, block_size, blocks = sys.argv[1:7]
r = run_trace_replay([trace], num_workers=int(engines), router_mode=mode, trace_block_size=512,
                     arrival_speedup_ratio=float(speedup),
                     extra_engine_args={"engine": {"block_size": int(block_size), "num_gpu_blocks": int(blocks)}})
s = r.summary
print("KVMESH-BASELINE " + json.dumps({
    "ttft_p50_ms": s.get("median_ttft_ms"), "ttft_p99_ms": s.get("p99_ttft_ms"),
    "itl_p50_ms": s.get("median_itl_ms"), "itl_p99_ms": s.get("p99_itl_ms"),
    "hit_rate": s.get("prefix_cache_reused_ratio"), "completed": s.get("completed_requests")}))
"""

_FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "hit_rate")


def dynamo_python(explicit: str | None = None) -> tuple[str | None, str]:
    """(interpreter that can import ``dynamo.replay``, or None; a note saying which or why not)."""
    candidate = explicit or os.environ.get(DYNAMO_ENV)
    if not candidate:
        return None, f"Dynamo baseline skipped: no --dynamo-python and ${DYNAMO_ENV} is not set"
    try:
        subprocess.run([candidate, "-c", "import dynamo.replay"], check=True, capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"Dynamo baseline skipped: {candidate} cannot import dynamo.replay ({type(exc).__name__})"
    return candidate, f"Dynamo baseline: {candidate}"


def _run_measured(cmd: Sequence[str], env: dict[str, str] | None = None) -> tuple[float, str]:
    """Run ``cmd`` to completion; (its whole-process CPU seconds, its stdout). Raises on failure."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        text = out.read().decode(errors="replace")
        if proc.returncode:
            tail = err.read().decode(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"{cmd[0]} exited {proc.returncode}: {' | '.join(tail)}")
    return usage.ru_utime + usage.ru_stime, text


def _kvmesh_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("kvmesh")
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-c", "import sys; from kvmesh_cli.main import main; sys.exit(main())"]


@dataclass
class SideBySide:
    """Per mode: CPU seconds and figures of every repeat, for kvmesh and for Dynamo."""

    mode: str
    kvmesh_cpu: list[float]
    dynamo_cpu: list[float]
    kvmesh: list[dict[str, float]]
    dynamo: list[dict[str, float]]

    def median(self, side: str, key: str) -> float:
        if key == "cpu_s":
            return statistics.median(self.kvmesh_cpu if side == "kvmesh" else self.dynamo_cpu)
        rows = self.kvmesh if side == "kvmesh" else self.dynamo
        return statistics.median(float(r[key]) for r in rows)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, "kvmesh_cpu_s": self.kvmesh_cpu, "dynamo_cpu_s": self.dynamo_cpu}
        out["kvmesh"] = self.kvmesh
        out["dynamo"] = self.dynamo
        out["cpu_ratio"] = self.median("kvmesh", "cpu_s") / self.median("dynamo", "cpu_s")
        return out


def run_side_by_side(
    rows: Sequence[TraceRequest],
    *,
    dynamo: str,
    kvmesh_args: Sequence[str],
    arrival_speedup: float,
    engines: int,
    block_size: int,
    num_gpu_blocks: int,
    repeats: int = 3,
    modes: Sequence[str] = ("kv", "round_robin"),
    progress: bool = True,
) -> list[SideBySide]:
    """Alternate kvmesh and Dynamo processes on ``rows`` (``repeats`` each per mode); see the module docstring."""
    results = [SideBySide(m, [], [], [], []) for m in modes]
    with tempfile.TemporaryDirectory(prefix="kvmesh-baseline-") as tmp:
        trace = Path(tmp) / "trace.jsonl"
        write_trace(trace, rows)
        dyn_env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        dyn_env.setdefault("RUST_LOG", "warn")
        dyn_env["RUST_LOG"] = "warn"  # Dynamo's kv router logs every decision at info: not its replay's cost
        for rep in range(repeats):
            for res in results:
                out_json = Path(tmp) / f"kvmesh-{res.mode}-{rep}.json"
                kv_cmd = [*_kvmesh_cmd(), "bench", "replay", str(trace), "--offline", "--router-mode", res.mode]
                kv_cmd += [*kvmesh_args, "--json", str(out_json), "--no-plot"]  # Dynamo's replay plots nothing
                dyn_cmd = [dynamo, "-c", _DYNAMO_SCRIPT, str(trace), MODES[res.mode], repr(arrival_speedup)]
                dyn_cmd += [str(engines), str(block_size), str(num_gpu_blocks)]
                order = ("kvmesh", "dynamo") if rep % 2 == 0 else ("dynamo", "kvmesh")
                for side in order:
                    if side == "kvmesh":
                        cpu, _ = _run_measured(kv_cmd)
                        summary = json.loads(out_json.read_text())["summary"]
                        res.kvmesh_cpu.append(cpu)
                        res.kvmesh.append({k: summary[k] for k in _FIGURES})
                    else:
                        cpu, text = _run_measured(dyn_cmd, env=dyn_env)
                        line = next(ln for ln in text.splitlines() if ln.startswith("KVMESH-BASELINE "))
                        res.dynamo_cpu.append(cpu)
                        res.dynamo.append(json.loads(line.split(" ", 1)[1]))
                if progress:
                    print(
                        f"  {res.mode} repeat {rep + 1}/{repeats}: CPU kvmesh {res.kvmesh_cpu[-1]:.2f} s, "
                        f"Dynamo {res.dynamo_cpu[-1]:.2f} s",
                        file=sys.stderr,
                    )
    return results


def format_side_by_side(results: Sequence[SideBySide]) -> str:
    """Medians and kvmesh / Dynamo ratios, one row per mode."""
    head = (
        f"{'mode':<12} {'CPU kvmesh':>10} {'CPU Dynamo':>10} {'ratio':>6}   "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p99':>8} {'hit':>12}"
    )
    lines = [head]
    for r in results:
        ratios = [r.median("kvmesh", k) / r.median("dynamo", k) for k in _FIGURES[:3]]
        hits = f"{r.median('kvmesh', 'hit_rate'):.3f}/{r.median('dynamo', 'hit_rate'):.3f}"
        lines.append(
            f"{r.mode:<12} {r.median('kvmesh', 'cpu_s'):>9.2f}s {r.median('dynamo', 'cpu_s'):>9.2f}s "
            f"{r.median('kvmesh', 'cpu_s') / r.median('dynamo', 'cpu_s'):>5.2f}x   "
            + " ".join(f"{x:>8.2f}x" for x in ratios[:2])
            + f" {ratios[2]:>7.2f}x {hits:>12}"
        )
    lines.append("(medians over the repeats; ratios are kvmesh / Dynamo; CPU is whole-process user+system)")
    return "\n".join(lines)
