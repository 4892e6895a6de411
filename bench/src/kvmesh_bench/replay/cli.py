"""``kvmesh bench replay TRACE``: replay a Mooncake trace offline (simulated fleet) or live (a frontend).

Examples::

    kvmesh bench replay conversation_trace.jsonl --offline --max-requests 2000 --router-mode kv:affinity
    kvmesh bench replay conversation_trace.jsonl --frontend 127.0.0.1:8001 --max-requests 600 --json out.json

``--router-mode`` is ``kv`` (the router's default cost policy), ``kv:POLICY`` (``kv:dynamo``,
``kv:affinity``; extra knobs as ``kv:affinity+backlog_weight=0.05``), ``round_robin``, ``random`` or
``power_of_two``. Live, a mode other than plain ``kv`` is sent per request as ``kvmesh.router_mode``
and a policy name as ``kvmesh.router_policy``; policy knobs (``+KEY=VALUE``) are offline only.

``--baseline dynamo`` (offline) runs this replay and Dynamo 1.6.1's ``run_trace_replay`` side by side on
the same rows, kv and round robin, as separate processes taken in turns, and prints their whole-process
CPU time and figures as ratios (Dynamo's interpreter: ``--dynamo-python`` or ``$KVMESH_DYNAMO_PYTHON``;
without it the comparison is skipped with a note)::

    kvmesh bench replay conversation_trace.jsonl --offline --max-requests 4000 --baseline dynamo --repeats 3

Exit status: 0 done (even with failed requests: they are reported), 2 bad input (a malformed trace line
names its line, an empty trace, an unreachable frontend, bad flags).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh_router.cost import MODES, RouterPolicyConfig
from kvmesh_router.policies import DEFAULT_COST_POLICY, POLICIES
from kvmesh_worker.engine import EngineConfig, load_perf_model

from kvmesh_bench.argtypes import (
    CommandParser,
    non_negative_float,
    non_negative_int,
    output_file,
    pem_file,
    png_file,
    positive_float,
    positive_int,
)
from kvmesh_bench.replay.offline import OfflineConfig, run_offline
from kvmesh_bench.replay.report import RunData, format_table, plot_run, run_json, summarize, write_json
from kvmesh_bench.replay.workload import (
    DEFAULT_VOCAB_SIZE,
    MAX_VOCAB_SIZE,
    ReplayRequest,
    TokenMapper,
    build_requests,
)
from kvmesh_bench.trace import DEFAULT_BLOCK_SIZE, TraceError, load_trace

if TYPE_CHECKING:
    import grpc

__all__ = ["ModeSpec", "ReplayError", "add_common_args", "load_requests", "main", "parse_mode", "run_mode"]

PROG = "kvmesh bench replay"


class ReplayError(Exception):
    """A one-line reason to stop with exit status 2."""


@dataclass(frozen=True)
class ModeSpec:
    """A routing setup: mode, cost policy (kv only; None = the router's default) and policy knobs."""

    mode: str
    policy: str | None = None
    params: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.mode != "kv":
            return self.mode
        text = "kv" if self.policy is None else f"kv:{self.policy}"
        return text + "".join(f"+{k}={v:g}" for k, v in sorted(self.params.items()))


def parse_mode(text: str) -> ModeSpec:
    """``kv``, ``kv:POLICY``, ``kv:POLICY+KEY=VALUE+...``, ``round_robin``, ``random``, ``power_of_two``."""
    head, *knobs = text.strip().split("+")
    mode, _, policy = head.partition(":")
    mode = mode.strip()
    if mode not in MODES or mode == "direct":
        raise ReplayError(f"unknown router mode {mode!r}; expected kv[:POLICY], round_robin, random or power_of_two")
    if (policy or knobs) and mode != "kv":
        raise ReplayError(f"router mode {text!r}: only kv takes a cost policy")
    if policy and not POLICIES.has_cost_policy(policy):
        raise ReplayError(f"unknown cost policy {policy!r}; registered: {', '.join(sorted(POLICIES.cost_policies))}")
    params: dict[str, float] = {}
    for knob in knobs:
        key, sep, value = knob.partition("=")
        try:
            params[key.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not key.strip():
            raise ReplayError(f"router mode {text!r}: policy knobs are written +KEY=NUMBER, got {knob!r}")
    if params:  # a misspelled knob must not run the defaults under the misspelled label
        name = policy or DEFAULT_COST_POLICY
        known = sorted(getattr(POLICIES.cost_policy(name), "DEFAULTS", {}))
        for key in params:
            if not known:
                raise ReplayError(f"router mode {text!r}: cost policy {name!r} takes no knobs, got {key!r}")
            if key not in known:
                raise ReplayError(
                    f"router mode {text!r}: cost policy {name!r} has no knob {key!r} (its knobs: {', '.join(known)})"
                )
        try:  # the router's own bounds (finite, within [0, MAX_WEIGHT]), now rather than mid-run
            RouterPolicyConfig(cost_policy=name, params=params)
        except ValueError as exc:
            raise ReplayError(f"router mode {text!r}: {exc}") from None
    return ModeSpec(mode, policy or None, params)


# The P/D-only flags and their defaults: one given with an aggregated fleet is refused, never ignored.
PD_DEFAULTS: dict[str, float] = {"kv_transfer_gbps": 100.0, "disagg_min_tokens": 0, "prefill_backlog_tokens": 65536}


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="Mooncake JSONL trace (timestamp, input_length, output_length, hash_ids)")
    p.add_argument("--offline", action="store_true", help="simulate the fleet in virtual time instead of a frontend")
    p.add_argument("--frontend", metavar="HOST:PORT", help="live: the frontend's KServe gRPC address")
    p.add_argument("--model", default="kvmesh-mock", help="live: model name (default: kvmesh-mock)")
    p.add_argument("--engines", type=positive_int, default=8, help="offline: engines in the fleet (default 8)")
    # --block-size meant this before; it is kept, hidden: datagen's --trace-block-size is another unit.
    p.add_argument(
        "--engine-block-size",
        "--block-size",
        dest="block_size",
        type=positive_int,
        default=64,
        help="offline: tokens per engine KV block (default 64)",
    )
    p.add_argument(
        "--trace-block-size",
        type=positive_int,
        default=DEFAULT_BLOCK_SIZE,
        help=f"tokens per hash id of the trace (default {DEFAULT_BLOCK_SIZE}, the Mooncake traces')",
    )
    p.add_argument("--num-gpu-blocks", type=positive_int, default=16384, help="offline: KV blocks per engine")
    p.add_argument("--max-num-seqs", type=positive_int, default=256, help="offline: running requests per engine")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=8192, help="offline: tokens per pass")
    p.add_argument("--perf-model", default=None, help="offline: 'polynomial' (default) or an .npz profile")
    p.add_argument(
        "--overlap-weight", type=non_negative_float, default=1.0, help="kv: overlap_score_weight (default 1.0)"
    )
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="kv: selection temperature (default 0)")
    p.add_argument(
        "--router-view",
        action="store_true",
        help="offline: feed the router's prefix index in every routing mode, for the router-view hit rates "
        "(round_robin and random do not read it, so by default it is not fed for them)",
    )
    p.add_argument(
        "--arrival-speedup", type=positive_float, default=1.0, help="arrival times / N, engine speed unchanged"
    )
    p.add_argument("--max-requests", type=positive_int, default=None, help="replay only the first N requests")
    p.add_argument("--duration", type=positive_float, default=None, help="live: stop sending after S seconds")
    p.add_argument("--connect-timeout", type=positive_float, default=5.0, help="live: frontend probe timeout (s)")
    p.add_argument(
        "--tls-ca",
        type=pem_file,
        metavar="FILE",
        help="live: the frontend speaks TLS; verify it with this CA (kvmesh up --tls prints where its ca.crt is)",
    )
    p.add_argument("--tls-cert", type=pem_file, metavar="FILE", help="live, with --tls-ca: a client certificate "
                   "(a frontend started with --kserve-client-cert asks for one)")  # fmt: skip
    p.add_argument("--tls-key", type=pem_file, metavar="FILE", help="live: the key of --tls-cert")
    p.add_argument("--drain-timeout", type=positive_float, default=120.0, help="live: wait S s for in-flight ones")
    p.add_argument(
        "--stream-interval",
        type=positive_int,
        default=1,
        help="live: sampling_parameters.stream_interval of every request (tokens per response after the first; "
        "ITL is then a response's gap divided among its tokens)",
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="token mapping and routing tie-breaks (default 0)")
    p.add_argument("--vocab-size", type=positive_int, default=DEFAULT_VOCAB_SIZE, help="token ids drawn below it")
    p.add_argument(
        "--json", type=output_file, metavar="PATH", help="write the figures as JSON (and the plots next to it)"
    )
    p.add_argument(
        "--plot",
        type=_plot_place,
        metavar="PATH",
        help="the PNG (replay: FILE.png or a directory; compare: a directory)",
    )
    p.add_argument("--no-plot", action="store_true", help="no PNG plots (not even next to --json)")
    p.add_argument("--no-progress", action="store_true", help="live: no progress bar")
    # Disaggregated fleet (offline; docs/disaggregation.md): P prefill + D decode engines instead of --engines.
    p.add_argument("--prefill-engines", type=non_negative_int, default=0, help="offline: prefill engines (P/D fleet)")
    p.add_argument("--decode-engines", type=non_negative_int, default=0, help="offline: decode engines (P/D fleet)")
    p.add_argument(
        "--kv-transfer-gbps",
        type=positive_float,
        default=PD_DEFAULTS["kv_transfer_gbps"],
        help="offline P/D: KV link GB/s",
    )
    p.add_argument(
        "--disagg-min-tokens",
        type=non_negative_int,
        default=PD_DEFAULTS["disagg_min_tokens"],
        help="offline P/D: local prefill at or below",
    )
    p.add_argument(
        "--prefill-backlog-tokens",
        type=non_negative_int,
        default=PD_DEFAULTS["prefill_backlog_tokens"],
        help="offline P/D: prefill engine busy bound (0 = none)",
    )


def disagg_label(disagg: object) -> str:
    p, d, g = (getattr(disagg, k) for k in ("prefill_engines", "decode_engines", "transfer_gbps"))
    return f"{p}P{d}D@{g:g}GB/s"


def load_requests(args: argparse.Namespace) -> list[ReplayRequest]:
    try:
        rows = load_trace(args.trace, args.max_requests)
    except TraceError as exc:
        raise ReplayError(str(exc)) from None
    requests, skipped = build_requests(rows, arrival_speedup=args.arrival_speedup, block_tokens=args.trace_block_size)
    if not requests:
        raise ReplayError(f"{args.trace}: no replayable request ({skipped} rows have no prompt token)")
    if skipped:
        print(f"{PROG}: skipped {skipped} rows with no prompt token", file=sys.stderr)
    block = args.trace_block_size
    cut = sum(1 for row in rows if row.hash_ids and row.input_length > len(row.hash_ids) * block)
    if cut:  # as Dynamo's replay does, but said: a wrong --trace-block-size shrinks every prompt silently
        print(
            f"{PROG}: note: {cut} of {len(rows)} rows have fewer hash_ids than input_length needs at "
            f"--trace-block-size {block}: their prompts are cut to len(hash_ids) x {block} tokens "
            "(is --trace-block-size right?)",
            file=sys.stderr,
        )
    return requests


def check_live_args(args: argparse.Namespace) -> None:
    """What the flags cannot say alone, checked before any replay (one line, exit 2)."""
    if not args.offline and not args.frontend:
        raise ReplayError("give --frontend HOST:PORT for a live replay, or --offline to simulate")
    try:  # the simulated model's own rules (its EOS id must be a token), and the trace's token mapping's
        EngineConfig(vocab_size=args.vocab_size)
        if args.vocab_size > MAX_VOCAB_SIZE:
            raise ValueError(f"at most {MAX_VOCAB_SIZE} (token ids are 32-bit)")
    except ValueError as exc:
        raise ReplayError(f"--vocab-size {args.vocab_size}: {exc}") from None
    try:
        RouterPolicyConfig(overlap_score_weight=args.overlap_weight)
    except ValueError as exc:
        raise ReplayError(f"--overlap-weight: {exc}") from None
    if args.offline and getattr(args, "duration", None) is not None:
        raise ReplayError("--duration bounds a live replay; offline, cut the trace (--max-requests)")
    prefill, decode = getattr(args, "prefill_engines", 0), getattr(args, "decode_engines", 0)
    if (prefill or decode) and not (prefill and decode):
        raise ReplayError("a P/D fleet needs both --prefill-engines and --decode-engines (1 or more each)")
    if not decode:
        given = [
            "--" + key.replace("_", "-")
            for key, default in PD_DEFAULTS.items()
            if getattr(args, key, default) != default
        ]
        if given:  # they would be ignored: the replay is aggregated
            raise ReplayError(f"{', '.join(given)} apply to a P/D fleet: give --prefill-engines and --decode-engines")
    tls = [flag for flag in ("--tls-ca", "--tls-cert", "--tls-key") if getattr(args, flag[2:].replace("-", "_"))]
    if tls and args.offline:
        raise ReplayError(f"{tls[0]} is for a live replay (a frontend with TLS), not --offline")
    if (args.tls_cert is None) != (args.tls_key is None) or (args.tls_cert is not None and args.tls_ca is None):
        raise ReplayError("a client certificate takes --tls-cert, --tls-key and --tls-ca together")
    if args.offline and args.perf_model not in (None, "polynomial"):
        try:  # now, in one line, rather than as a traceback from inside the simulation
            load_perf_model(args.perf_model)
        except (OSError, ValueError, KeyError) as exc:
            raise ReplayError(f"--perf-model {args.perf_model}: {exc}") from None


def _credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS to the frontend (``--tls-ca``, and a client certificate with ``--tls-cert``/``--tls-key``)."""
    if args.tls_ca is None:
        return None
    import grpc  # not at the top: an offline replay's start-up is part of what it measures

    return grpc.ssl_channel_credentials(args.tls_ca, args.tls_key, args.tls_cert)


def run_mode(args: argparse.Namespace, spec: ModeSpec, requests: list[ReplayRequest], seed: int) -> RunData:
    """One replay of ``requests`` with routing ``spec`` (offline: a fresh fleet)."""
    mapper = TokenMapper(block_tokens=args.trace_block_size, vocab_size=args.vocab_size, seed=seed)
    if args.offline:
        params = dict(spec.params)
        config = OfflineConfig(
            engines=args.engines,
            block_size=args.block_size,
            num_gpu_blocks=args.num_gpu_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            perf_model=args.perf_model,
            router_mode=spec.mode,
            cost_policy=spec.policy or DEFAULT_COST_POLICY,  # plain kv: the router daemon's default
            overlap_weight=args.overlap_weight,
            temperature=args.temperature,
            policy_params=params,
            seed=seed,
            vocab_size=args.vocab_size,
            router_view=getattr(args, "router_view", False),
        )
        if getattr(args, "decode_engines", 0):
            from kvmesh_bench.replay.disagg import DisaggConfig, run_offline_disagg

            disagg = DisaggConfig(
                args.prefill_engines,
                args.decode_engines,
                args.kv_transfer_gbps,
                args.disagg_min_tokens,
                prefill_backlog_tokens=args.prefill_backlog_tokens or None,
            )
            run = run_offline_disagg(requests, config, disagg, mapper, label=f"{spec.label} {disagg_label(disagg)}")
        else:
            run = run_offline(requests, config, mapper, label=spec.label)
    else:
        from kvmesh_bench.replay.live import FrontendUnreachable, LiveOptions, run_live

        if spec.params:
            raise ReplayError(
                f"live replay cannot send policy knobs ({spec.label!r}) per request; the request parameter "
                "kvmesh.router_policy carries the policy name only: configure knobs on the router"
            )
        options = LiveOptions(
            frontend=args.frontend,
            model=args.model,
            router_mode=spec.mode if getattr(args, "send_mode", True) else None,
            router_policy=spec.policy,
            duration_s=args.duration,
            drain_timeout_s=args.drain_timeout,
            connect_timeout_s=args.connect_timeout,
            stream_interval=args.stream_interval,
            progress=not args.no_progress,
            engines_hint=0,
            credentials=_credentials(args),
        )
        try:
            run = asyncio.run(run_live(requests, mapper, options, label=spec.label))
        except FrontendUnreachable as exc:
            raise ReplayError(f"cannot replay against frontend {args.frontend}: {exc}") from None
        run.meta["stream_interval"] = args.stream_interval
    run.meta.update(
        {
            "trace": str(args.trace),
            "arrival_speedup": args.arrival_speedup,
            "max_requests": args.max_requests,
            "seed": seed,
            "mode": spec.label,
        }
    )
    return run


def _plot_place(text: str) -> Path:
    """--plot: a directory (the plots go in it) or a ``*.png`` file to write."""
    return Path(text) if Path(text).is_dir() else png_file(text)


def _outputs(args: argparse.Namespace, stem_suffix: str = "") -> tuple[Path | None, Path | None]:
    json_path = Path(args.json) if args.json else None
    plot_path: Path | None = args.plot
    if getattr(args, "no_plot", False):
        return json_path, None
    if plot_path is not None and plot_path.is_dir():
        plot_path = plot_path / f"{json_path.stem if json_path else 'replay'}{stem_suffix}.png"
    if plot_path is None and json_path is not None:
        plot_path = json_path.with_name(json_path.stem + stem_suffix + ".png")
    return json_path, plot_path


def main(argv: Sequence[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = CommandParser(prog=PROG, description=__doc__, formatter_class=raw)
    add_common_args(parser)
    parser.add_argument("--router-mode", default="kv", help="kv[:POLICY[+KEY=VALUE...]], round_robin, random, ...")
    parser.add_argument(
        "--baseline", choices=["dynamo"], help="offline: compare with Dynamo's replay (kv, round robin)"
    )
    parser.add_argument("--dynamo-python", help="--baseline: Dynamo's venv interpreter (default $KVMESH_DYNAMO_PYTHON)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="--baseline: runs per side and mode")
    args = parser.parse_args(argv)
    if args.baseline:
        return _baseline(args)
    try:
        spec = parse_mode(args.router_mode)
        check_live_args(args)
        json_path, plot_path = _outputs(args)
        if plot_path is not None and plot_path != args.plot:  # made beside --json: not checked by its flag
            try:
                png_file(str(plot_path))
            except argparse.ArgumentTypeError as exc:
                raise ReplayError(f"the plot beside --json: {exc}") from None
        # Live with a plain "kv" leaves the router its own mode; anything else is sent per request.
        args.send_mode = args.offline or args.router_mode.strip() != "kv"
        requests = load_requests(args)
        run = run_mode(args, spec, requests, args.seed)
    except ReplayError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    summary = summarize(run)
    where = "offline (simulated)" if args.offline else f"live against {args.frontend}"
    print(f"{PROG}: {len(requests)} requests from {args.trace}, arrivals x{args.arrival_speedup:g}, {where}")
    print(format_table([summary]))
    print(f"prefix hit rate source: {summary.hit_source}")
    _print_meta(run)
    try:  # checked before the run; a disk that fills meanwhile is still one line
        if json_path is not None:
            write_json(json_path, run_json(run))
            print(f"wrote {json_path}")
        if plot_path is not None:
            print(f"wrote {plot_run(run, plot_path)}")
    except OSError as exc:
        print(f"{PROG}: error: cannot write {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return 0


def _baseline(args: argparse.Namespace) -> int:
    from kvmesh_bench.replay.baseline import dynamo_python, format_side_by_side, run_side_by_side

    if not args.offline:
        print(f"{PROG}: error: --baseline compares offline replays: add --offline", file=sys.stderr)
        return 2
    try:
        rows = load_trace(args.trace, args.max_requests)
    except TraceError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    python, note = dynamo_python(args.dynamo_python)
    print(note)
    if python is None:
        return 0
    kvmesh_args = [
        "--engines", str(args.engines), "--block-size", str(args.block_size),
        "--num-gpu-blocks", str(args.num_gpu_blocks), "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--arrival-speedup", repr(args.arrival_speedup),
        "--seed", str(args.seed), "--no-progress",
    ]  # fmt: skip
    results = run_side_by_side(
        rows,
        dynamo=python,
        kvmesh_args=kvmesh_args,
        arrival_speedup=args.arrival_speedup,
        engines=args.engines,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        repeats=args.repeats,
    )
    print(f"{PROG}: {len(rows)} rows of {args.trace}, arrivals x{args.arrival_speedup:g}, kvmesh vs Dynamo 1.6.1")
    print(format_side_by_side(results))
    if args.json:
        write_json(args.json, {"trace": str(args.trace), "rows": len(rows), "runs": [r.as_dict() for r in results]})
        print(f"wrote {args.json}")
    return 0


def _print_meta(run: RunData) -> None:
    m = run.meta
    if "disagg" in m:
        dm = m["disagg"]
        print(
            f"disaggregated: {dm['remote_prefill_fraction']:.1%} prefilled remotely; {dm['transferred_blocks']} blocks "
            f"transferred vs {dm['pull_everything_blocks']} to pull everything; {m['cpu_s']:.1f} s CPU"
        )
    elif run.kind == "offline":
        if m["router_hit_rate"] is None:
            view = f"router view: not kept ({m['mode']} reads no index; --router-view keeps it)"
        else:
            view = f"router view: hit {m['router_hit_rate']:.3f}, best offered {m['best_offered_hit_rate']:.3f}"
        print(
            f"simulation: {m['passes']} passes stepped, {m['skipped_quiet_passes']} quiet passes skipped, "
            f"{m['cpu_s']:.1f} s CPU ({m['wall_s']:.1f} s wall); {view}"
        )
    else:
        print(
            f"client: {m['sent']} sent, send lag p50 {m['send_lag_p50_ms']:.1f} / p99 {m['send_lag_p99_ms']:.1f} / "
            f"max {m['max_send_lag_ms']:.1f} ms, {m['client_cpu_s']:.1f} s CPU"
        )
    if run.errors:
        print(f"{len(run.errors)} requests failed; first: {run.errors[0]}")
