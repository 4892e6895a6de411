"""``kvmesh planner status`` (the planner's current view), and the ``kvmesh up --planner`` flags.

``status`` finds the planner replicas in discovery, asks each for ``GetStatus`` and prints the leader's
view: pool sizes observed / desired / starting / draining, and its latest decision with the inputs,
the prediction and the reason. ``--json`` prints the replies as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from typing import Any

from kvmesh_bench.argtypes import positive_int, shell_words
from kvmesh_planner.settings import Settings as PlannerSettings

from kvmesh_cli.client_flags import add_mesh_flags, configure_tls, missing_discovery_directory

__all__ = ["PlannerSettings", "add_up_flags", "planner_argv", "register"]

POOLS = ("aggregated", "prefill", "decode")


def add_up_flags(p: argparse.ArgumentParser) -> None:
    """Flags ``kvmesh up`` gets for ``--planner`` (kept here so up.py's edit stays small)."""
    p.add_argument(
        "--planner",
        action="store_true",
        help="run kvmesh-planner (local connector) instead of fixed workers: it starts and stops one "
        "kvmesh-worker per engine between --min-engines and --max-engines; with --decode-workers D "
        "(and --prefill-workers P) it manages the decode (and prefill) pool instead, from D (P) engines "
        "up to --max-engines each",
    )
    p.add_argument(
        "--min-engines", type=positive_int, default=None, help="with --planner: smallest aggregated pool (default: 1)"
    )
    p.add_argument(
        "--max-engines", type=positive_int, default=None, help="with --planner: largest pool, each (default: 4)"
    )
    p.add_argument(
        "--planner-args",
        type=shell_words,
        default="",
        help="with --planner: extra kvmesh-planner flags, e.g. '--ttft-ms 500 --itl-ms 30'",
    )


def planner_argv(args: argparse.Namespace, common: list[str], worker_args: list[str]) -> list[str]:
    """kvmesh-planner's command line: it passes the worker flags on to every worker it starts."""
    own = {"--discovery", "--namespace"}
    extra: list[str] = []
    skip = False
    for a in worker_args:  # the planner gives each worker --discovery/--namespace itself, one engine each
        if skip:
            skip = False
            continue
        if a in own or a == "--num-engines":
            skip = True
            continue
        extra.append(a)
    pools: list[str] = []
    if getattr(args, "decode_workers", 0):  # disaggregated: the planner manages the prefill and decode pools
        for pool, count in (("prefill", args.prefill_workers), ("decode", args.decode_workers)):
            if count:
                pools += [f"--min-{pool}", str(count), f"--max-{pool}", str(max(count, args.max_engines))]
        pools += ["--pools", "prefill,decode" if args.prefill_workers else "decode"]
    else:
        pools += ["--min-engines", str(args.min_engines), "--max-engines", str(args.max_engines)]
    # The operator's own --worker-args (docs/planner.md) add to these: the planner keeps the last
    # --worker-args it is given, so passed on as they were they replaced kvmesh up's (TLS included).
    theirs = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    theirs.add_argument("--worker-args", action="append", default=[])
    known, rest = theirs.parse_known_args(shlex.split(args.planner_args))
    for words in known.worker_args:
        extra += shlex.split(words)
    return [*common, "--connector", "local", *pools, "--worker-args", shlex.join(extra), *rest]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("planner", help="the planner: kvmesh planner status")
    sub = p.add_subparsers(dest="planner_command", required=True)
    s = sub.add_parser("status", help="print the planner's current view and latest decision")
    add_mesh_flags(s)  # kvmesh up's namespace is kvmesh-local: it prints this command with --namespace
    s.add_argument("--address", default=None, help="ask this planner (host:port) instead of looking it up")
    s.add_argument("--json", action="store_true", help="print the replies as JSON")
    s.set_defaults(func=_status)


def _status(args: argparse.Namespace) -> int:
    if (problem := configure_tls(args)) is not None:
        print(f"kvmesh planner status: error: {problem}", file=sys.stderr)
        return 2
    try:
        replies, failures = asyncio.run(_fetch(args))
    except RuntimeError as exc:
        print(f"kvmesh planner status: error: {exc}", file=sys.stderr)
        return 2
    if not replies:  # (a replica that crashed keeps its record for up to a lease TTL: the others still count)
        print(f"kvmesh planner status: error: {'; '.join(failures)}", file=sys.stderr)
        return 2
    for failure in failures:
        print(f"kvmesh planner status: warning: {failure}", file=sys.stderr)
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps([{"address": a, **MessageToDict(r)} for a, r in replies], indent=1))
        return 0
    for address, reply in replies:
        print(_format(address, reply))
    return 0


async def _fetch(args: argparse.Namespace) -> tuple[list[tuple[str, Any]], list[str]]:
    """Each planner's status (the leader first), and why each that did not answer did not."""
    import grpc
    from kvmesh.channels import open_channel
    from kvmesh.discovery import DiscoveryUnavailable, instance_prefix, open_discovery
    from kvmesh.settings import default_discovery_url
    from kvmesh.v1 import discovery_pb2, planner_pb2, planner_pb2_grpc

    addresses = [args.address] if args.address else []
    if not addresses:
        url = args.discovery or default_discovery_url()
        if problem := missing_discovery_directory(url):
            raise RuntimeError(problem)
        try:
            disc = await open_discovery(url, ttl=10.0, connect_timeout=3.0)
        except (ValueError, DiscoveryUnavailable) as exc:
            raise RuntimeError(f"--discovery: {exc}") from None
        try:
            recs = await disc.get_prefix(instance_prefix(args.namespace, "planner"))
        finally:
            await disc.close()
        addresses = sorted(discovery_pb2.InstanceRecord.FromString(v).address for v in recs.values())
    if not addresses:
        raise RuntimeError(f"no planner registered in namespace {args.namespace!r}")
    out = []
    failures = []
    for address in addresses:
        async with open_channel(address, role="planner") as channel:
            try:
                reply = await planner_pb2_grpc.PlannerServiceStub(channel).GetStatus(
                    planner_pb2.GetStatusRequest(), timeout=3.0
                )
            except grpc.aio.AioRpcError as exc:
                failures.append(f"planner {address}: {exc.code().name}: {exc.details()}")
                continue
        out.append((address, reply))
    out.sort(key=lambda item: not item[1].leader)
    return out, failures


def _sizes(msg: Any) -> str:
    return " ".join(f"{p}={getattr(msg, p)}" for p in POOLS if getattr(msg, p)) or "none"


def _format(address: str, r: Any) -> str:
    lines = [
        f"planner {address}: {'LEADER' if r.leader else 'standby'}, mode {r.mode}, connector {r.connector}",
        f"  engines observed: {_sizes(r.observed)}; desired: {_sizes(r.desired)}; "
        f"starting: {_sizes(r.starting)}; draining: {_sizes(r.draining)}",
    ]
    if r.pools:
        bounds = ", ".join(f"{p} [{getattr(r.minimum, p)}, {getattr(r.maximum, p)}]" for p in r.pools)
        lines.append(f"  pools: {bounds}; budget {r.engine_budget} engines")
    if r.HasField("latest"):
        d = r.latest
        lines.append(
            f"  latest decision {d.decision_id}: {_sizes(d.previous)} -> {_sizes(d.target)}"
            f" (applied: {d.applied}) reason: {d.reason}"
        )
        if d.inputs:
            lines.append("  inputs: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(d.inputs.items())))
        if d.HasField("prediction"):
            q = d.prediction
            rates = sorted(q.engine_request_rates.items())
            per_engine = ", ".join(f"{p} {v:.3g}" for p, v in rates) if rates else f"{q.engine_request_rate:.3g}"
            lines.append(
                f"  prediction ({q.predictor}): {q.request_rate:.3g} req/s, ISL {q.isl:.0f}, OSL {q.osl:.0f}; "
                f"{per_engine} req/s per engine; corrections TTFT x{q.ttft_correction:.2f}, "
                f"ITL x{q.itl_correction:.2f}"
            )
    return "\n".join(lines)
