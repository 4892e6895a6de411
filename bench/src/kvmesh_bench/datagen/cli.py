"""``kvmesh datagen analyze|synthesize``: argparse wiring (:func:`register`) and the command handlers."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvmesh_bench.argtypes import CommandParser, non_negative_int, output_file, positive_float, positive_int
from kvmesh_bench.tables import write_json
from kvmesh_bench.trace import DEFAULT_BLOCK_SIZE, TraceError, load_trace, write_trace

__all__ = ["main", "register"]

EXIT_OK = 0
EXIT_ERROR = 2


def _guarded(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn the expected failures into one line on stderr and exit code 2."""

    def run(args: argparse.Namespace) -> int:
        # imported here: numpy and networkx load only when a datagen command runs
        from kvmesh_bench.datagen.prefix_tree import TreePropertyError
        from kvmesh_bench.datagen.synthesize import DatagenError

        try:
            return handler(args)
        except BrokenPipeError:  # e.g. piped into `head`
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's final flush quiet
            return EXIT_OK
        except (TraceError, TreePropertyError, DatagenError, OSError) as exc:
            message = str(exc)
            if isinstance(exc, OSError) and exc.filename:
                message = f"{exc.filename}: {exc.strerror}"
            print(f"kvmesh datagen {args.datagen_command}: error: {message}", file=sys.stderr)
            return EXIT_ERROR

    run.__name__ = handler.__name__
    run.__doc__ = handler.__doc__
    return run


def _analyze(args: argparse.Namespace) -> int:
    from kvmesh_bench.datagen.analyze import (
        analyze,
        compare,
        format_analysis,
        format_comparison,
        reordered_replays,
        replay_figures,
    )

    traces = [load_trace(path, max_requests=args.max_requests) for path in args.trace]
    reports = [analyze(requests, block_size=args.block_size) for requests in traces]
    if args.compare is None:
        print("\n\n".join(format_analysis(r, title=path) for path, r in zip(args.trace, reports, strict=True)))
        if args.json:
            write_json(args.json, reports[0] if len(reports) == 1 else reports)
        return EXIT_OK
    source = load_trace(args.compare, max_requests=args.max_requests)
    source_report = analyze(source, block_size=args.block_size)
    if args.replay_requests:  # the load each trace puts on a simulated fleet, not only its summary
        for requests, figures in [*zip(traces, reports, strict=True), (source, source_report)]:
            figures["replay"] = replay_figures(requests, block_size=args.block_size, max_requests=args.replay_requests)
        if args.replay_shuffles:
            source_report["replay_reordered"] = reordered_replays(
                source, args.replay_shuffles, block_size=args.block_size, max_requests=args.replay_requests
            )
    comparison = compare(reports, source_report)
    name = args.trace[0] if len(args.trace) == 1 else f"{len(args.trace)} traces ({', '.join(args.trace)})"
    print(format_comparison(comparison, trace_name=name, source_name=args.compare))
    if args.json:
        side = {"trace": reports[0]} if len(reports) == 1 else {"traces": reports}
        write_json(args.json, {**side, "source": source_report, "comparison": comparison})
    return EXIT_OK


def _synthesize(args: argparse.Namespace) -> int:
    from kvmesh_bench.datagen.synthesize import DatagenError, SynthesisConfig, Synthesizer

    if args.min_isl is not None and args.max_isl is not None and args.min_isl > args.max_isl:
        raise DatagenError(f"--min-isl ({args.min_isl}) is larger than --max-isl ({args.max_isl})")
    started = time.perf_counter()
    source = load_trace(args.trace, max_requests=args.max_requests)
    config = SynthesisConfig(
        prefix_len_multiplier=args.prefix_len_multiplier,
        prefix_root_multiplier=args.prefix_root_multiplier,
        prompt_len_multiplier=args.prompt_len_multiplier,
        osl_multiplier=args.osl_multiplier,
        speedup_ratio=args.speedup_ratio,
        min_isl=args.min_isl,
        max_isl=args.max_isl,
        block_size=args.block_size,
        seed=args.seed,
        sampling=args.sampling,
        order_jitter_s=args.order_jitter,
    )
    profile = None
    if args.rate_profile:
        from kvmesh_bench.datagen.rate_profile import RateProfile

        try:
            profile = RateProfile.parse(args.rate_profile)
        except ValueError as exc:
            raise DatagenError(str(exc)) from None
        if args.speedup_ratio != 1.0:  # the profile redraws every arrival: the ratio would be ignored
            raise DatagenError("--speedup-ratio and --rate-profile do not go together: scale the profile's rates")
    synthesizer = Synthesizer(source, config)
    requests = synthesizer.generate(args.num_requests)
    if profile is not None:
        from kvmesh_bench.datagen.rate_profile import retime

        requests = retime(requests, profile, seed=args.seed)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)  # as --json does
    write_trace(args.output, requests)
    tree = synthesizer.tree
    core_blocks = sum(data["length"] for _, data in tree.graph.nodes(data=True))
    print(
        f"wrote {len(requests):,} requests to {args.output} (learned from {len(source):,} requests: core radix "
        f"tree {tree.graph.number_of_nodes() - 1:,} nodes / {core_blocks:,} blocks, {len(tree.leaf_lengths):,} "
        f"unique leaves) in {time.perf_counter() - started:.2f} s"
    )
    return EXIT_OK


def _jitter(text: str) -> float | None:
    if text.strip().lower() in ("none", "shuffle"):
        return None
    value = float(text)
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0 or 'none', got {text!r}")
    return value


def _trace_block_size(parser: argparse.ArgumentParser) -> None:
    """``--trace-block-size``: tokens per hash id, the trace's unit (not an engine's KV block size).

    ``--block-size`` still works, but is hidden: ``kvmesh bench`` used it for the engine's block.
    """
    parser.add_argument(
        "--trace-block-size",
        "--block-size",
        dest="block_size",
        metavar="TOKENS",
        type=positive_int,
        default=DEFAULT_BLOCK_SIZE,
        help=f"tokens per hash id of the trace (default: {DEFAULT_BLOCK_SIZE}, the Mooncake traces')",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``datagen`` command (sub-commands ``analyze`` and ``synthesize``) to a CLI."""
    datagen = subparsers.add_parser(
        "datagen",
        help="analyze a Mooncake trace or synthesize a new one from it",
        description="Analyze Mooncake-format request traces and synthesize new ones with the same prefix structure.",
    )
    commands = datagen.add_subparsers(dest="datagen_command", metavar="{analyze,synthesize}", required=True)

    analyze_parser = commands.add_parser(
        "analyze",
        help="ISL/OSL, arrival and prefix-cache statistics of a trace",
        description="ISL/OSL statistics, arrival rate, infinite-cache prefix hit rate and prefix-tree statistics. "
        "With --compare SOURCE: this trace (e.g. a synthesized one), or the median of several, next to SOURCE, with "
        "relative differences and whether each is within 10 %.",
    )
    analyze_parser.add_argument(
        "trace",
        nargs="+",
        help="Mooncake JSONL trace; with --compare, several (e.g. synthesized with different seeds) are compared "
        "by the median of each figure",
    )
    analyze_parser.add_argument("--compare", metavar="SOURCE", help="compare against this trace")
    analyze_parser.add_argument(
        "--json", type=output_file, metavar="PATH", help="also write the figures as JSON to PATH"
    )
    analyze_parser.add_argument(
        "--replay-requests",
        metavar="N",
        type=non_negative_int,
        default=2000,
        help="--compare: replay the first N requests of both traces offline (8 engines; round robin and the "
        "router's default policy at arrivals x1 and x6) and compare TTFT and hit rate (default 2000; 0 = skip)",
    )
    _trace_block_size(analyze_parser)
    analyze_parser.add_argument(
        "--max-requests", metavar="N", type=positive_int, help="read only the first N requests (of each trace)"
    )
    analyze_parser.add_argument(
        "--replay-shuffles",
        metavar="K",
        type=non_negative_int,
        default=0,
        help="--compare: also replay SOURCE K times with each timestamp's requests in another order, compare "
        "with the median of its K + 1 orders and print their range: how far the replayed figures move without "
        "any change to the load (default 0)",
    )
    analyze_parser.set_defaults(func=_guarded(_analyze))

    synth = commands.add_parser(
        "synthesize",
        help="synthesize a trace with the prefix structure of TRACE",
        description="Learn TRACE's core radix tree of shared prefixes, unique-prompt lengths, ISL/OSL and arrival "
        "statistics, and sample a new Mooncake-format trace from them (same seed: byte-identical output).",
    )
    synth.add_argument("trace", help="source Mooncake JSONL trace")
    synth.add_argument("-o", "--output", required=True, metavar="OUT", help="output JSONL path")
    synth.add_argument(
        "--num-requests",
        metavar="N",
        type=positive_int,
        help="requests to synthesize (default: as many as the source)",
    )
    synth.add_argument(
        "--prefix-len-multiplier",
        metavar="X",
        type=positive_float,
        default=1.0,
        help="stretch shared-prefix nodes (default: 1)",
    )
    synth.add_argument(
        "--prefix-root-multiplier",
        metavar="K",
        type=positive_int,
        default=1,
        help="k disjoint copies of the prefix tree, one picked at random per request (default: 1)",
    )
    synth.add_argument(
        "--prompt-len-multiplier",
        metavar="X",
        type=positive_float,
        default=1.0,
        help="scale unique-prompt lengths (default: 1)",
    )
    synth.add_argument(
        "--osl-multiplier", metavar="X", type=positive_float, default=1.0, help="scale output lengths (default: 1)"
    )
    synth.add_argument(
        "--speedup-ratio",
        metavar="X",
        type=positive_float,
        default=1.0,
        help="divide inter-arrival gaps by this (default: 1)",
    )
    synth.add_argument("--min-isl", metavar="TOKENS", type=non_negative_int, help="drop requests with a shorter input")
    synth.add_argument("--max-isl", metavar="TOKENS", type=non_negative_int, help="drop requests with a longer input")
    _trace_block_size(synth)
    synth.add_argument("--seed", metavar="SEED", type=non_negative_int, default=0, help="random seed (default: 0)")
    synth.add_argument(
        "--sampling",
        choices=("stratified", "iid"),
        default="stratified",
        help="stratified (default): draw every empirical distribution (tree transitions, lengths, arrivals) from "
        "a shuffled deck of the source's values, reshuffled when used up; iid: independent draws",
    )
    synth.add_argument(
        "--order-jitter",
        metavar="SECONDS",
        type=_jitter,
        default=15.0,
        help="stratified: deal each distribution in the source's time order, each value's time moved by "
        "N(0, SECONDS) (default 15: conversations keep their turn order and time locality, which is what "
        "a finite cache sees); 'none': in random order (no time structure)",
    )
    synth.add_argument(
        "--max-requests", metavar="N", type=positive_int, help="learn from the first N source requests only"
    )
    synth.add_argument(
        "--rate-profile",
        metavar="SPEC",
        help="redraw the arrival times as a Poisson process with this time-varying rate (req/s): "
        "points:T=R,... | ramp:R0:R1:S | diurnal:LOW:HIGH:PERIOD:S | spike:BASE:PEAK:AT:WIDTH:S "
        "(kvmesh_bench.datagen.rate_profile); --num-requests caps the count, the profile's length ends it",
    )
    synth.set_defaults(func=_guarded(_synthesize))


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point (``python -m kvmesh_bench.datagen``): ``datagen`` as the only command."""
    parser = CommandParser(prog="kvmesh")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))
