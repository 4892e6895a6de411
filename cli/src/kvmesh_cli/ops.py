"""Operator commands: ``kvmesh status``, ``kvmesh drain ADDRESS|ENGINE``, ``kvmesh router dump``.

They read the fleet from discovery and call daemons over gRPC, with mTLS under ``--tls-*``
(:mod:`kvmesh_cli.client_flags`; an operator certificate: the only role that may drain, see
``kvmesh.identity``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import grpc
from kvmesh_bench.argtypes import positive_float

from kvmesh_cli.client_flags import add_mesh_flags, configure_tls, missing_discovery_directory


def _common(p: argparse.ArgumentParser) -> None:
    add_mesh_flags(p)
    p.add_argument("--timeout", type=positive_float, default=5.0, help="seconds per call (default: 5)")


def register(subparsers: argparse._SubParsersAction) -> None:
    status = subparsers.add_parser("status", help="the fleet from discovery: daemons, engines, models, load")
    _common(status)
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(func=lambda a: _run(a, _status))
    drain = subparsers.add_parser("drain", help="drain a daemon: stop new routing, finish in-flight work, deregister")
    _common(drain)
    drain.add_argument("target", metavar="ADDRESS|ENGINE", help="host:port of a daemon, or an engine id (hex)")
    drain.add_argument("--reason", default="kvmesh drain", help="for the daemon's log")
    drain.add_argument("--no-wait", action="store_true", help="do not wait until its records are gone")
    drain.set_defaults(func=lambda a: _run(a, _drain))
    router = subparsers.add_parser("router", help="router operations")
    sub = router.add_subparsers(dest="router_command", required=True, parser_class=type(router))
    dump = sub.add_parser("dump", help="a router replica's KV index, per engine")
    _common(dump)
    dump.add_argument("--address", default=None, help="router host:port (default: the first from discovery)")
    dump.add_argument("--hashes", action="store_true", help="include every block hash")
    dump.set_defaults(func=lambda a: _run(a, _dump))


def _fail(message: str) -> int:
    print(f"kvmesh: error: {message}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace, command: Any) -> int:
    if (problem := configure_tls(args)) is not None:
        return _fail(problem)
    try:
        return int(asyncio.run(command(args)))
    except _Problem as exc:
        return _fail(str(exc))


class _Problem(Exception):
    """A one-line error for the operator."""


@dataclass
class _Fleet:
    records: list[Any]
    cards: list[Any]


async def _fleet(args: argparse.Namespace) -> _Fleet:
    from kvmesh.discovery import DiscoveryError, DiscoveryUnavailable, instance_prefix, model_prefix, open_discovery
    from kvmesh.settings import default_discovery_url
    from kvmesh.v1 import discovery_pb2

    url = args.discovery or default_discovery_url()
    if problem := missing_discovery_directory(url):
        raise _Problem(problem)
    try:
        discovery = await open_discovery(url, ttl=10, connect_timeout=args.timeout)
    except (DiscoveryUnavailable, ValueError) as exc:
        raise _Problem(f"--discovery {url}: {exc}") from None
    try:
        raw_records = await discovery.get_prefix(instance_prefix(args.namespace))
        raw_cards = await discovery.get_prefix(model_prefix(args.namespace))
    except DiscoveryError as exc:  # connected, then a read failed (timed out, refused): one line, as above
        raise _Problem(f"--discovery {url}: {exc}") from None
    finally:
        await discovery.close()
    records = [discovery_pb2.InstanceRecord.FromString(v) for v in raw_records.values()]
    cards = [discovery_pb2.ModelCard.FromString(v) for v in raw_cards.values()]
    return _Fleet(sorted(records, key=lambda r: (r.component, r.address, r.instance_id)), cards)


def _role(component: str) -> str | None:
    return component if component in ("worker", "router", "frontend", "planner") else None


async def _router_call(args: argparse.Namespace, address: str, method: str, request: Any) -> Any:
    from kvmesh.channels import open_channel
    from kvmesh.v1 import router_pb2_grpc

    channel = open_channel(address, role="router")
    try:
        return await getattr(router_pb2_grpc.RouterServiceStub(channel), method)(request, timeout=args.timeout)
    finally:
        await channel.close()


async def _status(args: argparse.Namespace) -> int:
    from kvmesh.v1 import discovery_pb2, router_pb2

    fleet = await _fleet(args)
    now_ms = time.time() * 1000
    load: dict[int, Any] = {}
    for record in fleet.records:
        if record.component == "router":
            try:
                reply = await _router_call(args, record.address, "GetActiveLoad", router_pb2.GetActiveLoadRequest())
            except grpc.aio.AioRpcError as exc:
                print(f"kvmesh status: router {record.address}: {exc.code().name}", file=sys.stderr)
                continue
            load.update({e.engine_id: e for e in reply.engines})
            break
    cards = {card.engine_id: card for card in fleet.cards}
    rows = []
    for r in fleet.records:
        card = cards.get(r.instance_id)
        engine_load = load.get(r.instance_id)
        rows.append({
            "component": f"{r.component}/{r.endpoint}",
            "id": f"{r.instance_id:x}",
            "address": r.address,
            "host": f"{r.hostname}:{r.pid}",
            "role": discovery_pb2.WorkerRole.Name(r.role).removeprefix("WORKER_ROLE_").lower() if r.role else "",
            "model": r.model or (card.name if card else ""),
            "kv_blocks": card.total_kv_blocks if card else None,
            "active_requests": engine_load.active_requests if engine_load else None,
            "active_blocks": engine_load.active_blocks if engine_load else None,
            "age_s": round((now_ms - r.started_unix_ms) / 1000, 1) if r.started_unix_ms else None,
            "lease": f"{r.lease_id:x}",
            "version": r.version,
        })  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    columns = ["component", "id", "address", "host", "role", "model", "active_requests", "active_blocks", "age_s"]
    table = [columns] + [["" if row[c] is None else str(row[c]) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
    if not rows:
        print(f"(no daemon registered in namespace {args.namespace!r})")
    return 0


async def _drain(args: argparse.Namespace) -> int:
    from kvmesh.channels import open_channel
    from kvmesh.v1 import admin_pb2, admin_pb2_grpc

    fleet = await _fleet(args)
    target = args.target
    matches = [r for r in fleet.records if r.address == target]
    if not matches:  # an engine id: drain the worker process hosting it
        try:
            engine_id = int(target, 16)
        except ValueError:
            raise _Problem(
                f"{target}: no daemon registered at that address (gone, or draining already?) and not an engine id"
            ) from None
        matches = [r for r in fleet.records if r.instance_id == engine_id]
        if not matches:
            raise _Problem(f"{target}: no such engine or address in namespace {args.namespace!r}")
    address, component = matches[0].address, matches[0].component
    channel = open_channel(address, role=_role(component))
    try:
        reply = await admin_pb2_grpc.AdminServiceStub(channel).Drain(
            admin_pb2.DrainRequest(reason=args.reason), timeout=args.timeout
        )
    except grpc.aio.AioRpcError as exc:
        raise _Problem(f"drain {address}: {exc.code().name}: {exc.details()}") from None
    finally:
        await channel.close()
    print(
        f"draining {component} {address} (instance {reply.instance_id}){'' if reply.started else ': already draining'}"
    )
    if args.no_wait:
        return 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not any(r.address == address for r in (await _fleet(args)).records):
            print(f"{address}: deregistered; in-flight work finishes within its --drain-timeout")
            return 0
        await asyncio.sleep(0.2)
    raise _Problem(f"{address}: still registered after 60 s")


async def _dump(args: argparse.Namespace) -> int:
    from kvmesh.v1 import router_pb2

    if args.address is not None:
        addresses = [args.address]
    else:
        addresses = [r.address for r in (await _fleet(args)).records if r.component == "router"]
        if not addresses:
            raise _Problem(f"no router registered in namespace {args.namespace!r}")
    failures = []
    for address in addresses:  # a replica killed keeps its record for up to a lease TTL: ask the next
        try:
            reply = await _router_call(args, address, "DumpIndex", router_pb2.DumpIndexRequest())
            break
        except grpc.aio.AioRpcError as exc:
            failures.append(f"router {address}: {exc.code().name}: {exc.details()}")
    else:
        raise _Problem("; ".join(failures))
    engines = [
        {"engine_id": f"{e.engine_id:x}", "blocks": len(e.block_hashes), "next_event_id": e.next_event_id}
        | ({"block_hashes": [f"{h:016x}" for h in e.block_hashes]} if args.hashes else {})
        for e in reply.engines
    ]
    print(json.dumps({"router": address, "engines": engines}, indent=2))
    return 0
