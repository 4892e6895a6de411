"""``kvmesh model files MODEL --out DIR``: the served model's tokenizer and config files, locally.

Tools that count tokens on the client side (genai-perf's ``--tokenizer``, a ``transformers``
``AutoTokenizer``) need the model's HF files, and kvmesh serves models no hub knows (the built-in
``kvmesh-mock``). The worker that serves a model is the source of truth for its files: this finds
an engine of MODEL in discovery (its model card) and copies every file the card lists over
``WorkerService.GetModelFile``, so the directory is exactly what the frontend tokenizes with.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import grpc
from kvmesh.channels import open_channel
from kvmesh.discovery import DiscoveryError, model_prefix, open_discovery, parse_model_key
from kvmesh.settings import default_discovery_url
from kvmesh.v1 import discovery_pb2, worker_pb2, worker_pb2_grpc
from kvmesh_bench.argtypes import positive_float

from kvmesh_cli.client_flags import add_mesh_flags, configure_tls, missing_discovery_directory


class ModelFilesError(Exception):
    """Why the files could not be fetched: one line for the user (exit 2)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    model = subparsers.add_parser("model", help="inspect the models a mesh serves", description="Models a mesh serves.")
    sub = model.add_subparsers(dest="model_command", required=True, parser_class=type(model))
    p = sub.add_parser(
        "files",
        help="download a served model's tokenizer and config files (e.g. for genai-perf --tokenizer)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="model name, as clients send it (e.g. kvmesh-mock)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write the files to (created if missing)")
    add_mesh_flags(p, namespace="kvmesh-local")  # kvmesh up's: the mesh genai-perf users start with
    p.add_argument(
        "--timeout", type=positive_float, default=10.0, help="seconds for discovery and each download (default: 10)"
    )
    p.set_defaults(func=run)


async def _cards(url: str, namespace: str, timeout: float) -> list[discovery_pb2.ModelCard]:
    discovery = await open_discovery(url, connect_timeout=timeout)
    try:
        records = await discovery.get_prefix(model_prefix(namespace))
    finally:
        await discovery.close()
    cards = []
    for key, value in sorted(records.items()):
        try:
            card = discovery_pb2.ModelCard.FromString(value)
            card.name = card.name or parse_model_key(key).model
        except Exception:  # a corrupt record is somebody else's problem: skip it
            continue
        cards.append(card)
    return cards


async def fetch(url: str, namespace: str, model: str, out: Path, timeout: float) -> list[Path]:
    """Write MODEL's files into ``out``; returns the paths written."""
    if problem := missing_discovery_directory(url):
        raise ModelFilesError(problem)
    try:
        cards = await _cards(url, namespace, timeout)
    except (DiscoveryError, ValueError) as exc:
        raise ModelFilesError(str(exc)) from None
    mine = [card for card in cards if card.name == model]
    if not mine:
        names = ", ".join(sorted({card.name for card in cards})) or "none"
        raise ModelFilesError(
            f"model {model!r} is not served in namespace {namespace!r} of {url} (served models: {names})"
        )
    errors = []
    for card in mine:
        try:
            async with open_channel(card.address, role="worker") as channel:
                stub = worker_pb2_grpc.WorkerServiceStub(channel)
                files: dict[str, bytes] = {}
                for name in card.files:
                    request = worker_pb2.GetModelFileRequest(engine_id=card.engine_id, name=name)
                    chunks = stub.GetModelFile(request, timeout=timeout)
                    files[name] = b"".join([chunk.data async for chunk in chunks])
        except grpc.aio.AioRpcError as exc:
            errors.append(f"engine {card.engine_id:x} at {card.address}: {exc.code().name}: {exc.details()}")
            continue
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for name, data in files.items():
            path = out / Path(name).name  # a card names plain files; never write outside ``out``
            path.write_bytes(data)
            written.append(path)
        return written
    raise ModelFilesError(f"model {model!r}: no engine served its files ({'; '.join(errors)})")


def run(args: argparse.Namespace) -> int:
    if (problem := configure_tls(args)) is not None:
        print(f"kvmesh model files: error: {problem}", file=sys.stderr)
        return 2
    url = args.discovery or default_discovery_url()
    try:
        written = asyncio.run(fetch(url, args.namespace, args.model, Path(args.out), args.timeout))
    except (ModelFilesError, OSError) as exc:
        print(f"kvmesh model files: error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"{path} ({path.stat().st_size} bytes)")
    print(f"use it as: genai-perf profile -m {args.model} --tokenizer {args.out} ...")
    return 0
