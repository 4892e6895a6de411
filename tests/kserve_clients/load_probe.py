"""Engine load of kvmesh workers, for the stock-client tests (run as a subprocess).

It uses kvmesh's own stubs, which must not share a process with ``tritonclient.grpc``.

``load_probe.py snapshot ADDRESS [ADDRESS ...]``
    prints ``{address: [{engine_id, active_blocks, running, waiting}, ...]}`` (WatchLoad's first
    message: the current load).
``load_probe.py wait ADDRESS --blocks N [--timeout S]``
    follows WatchLoad; prints ``ready`` once subscribed, then, when every engine of the worker holds
    ``N`` active blocks in total and runs nothing, ``{"at": <unix time>, "load": [...]}``; exits 1
    on timeout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import grpc
from kvmesh.v1 import worker_pb2, worker_pb2_grpc


def _as_dict(load: worker_pb2.EngineLoad) -> dict[str, int]:
    return {"engine_id": load.engine_id, "active_blocks": load.active_blocks, "running": load.running,
            "waiting": load.waiting}  # fmt: skip


def snapshot(address: str) -> list[dict[str, int]]:
    with grpc.insecure_channel(address) as channel:
        call = worker_pb2_grpc.WorkerServiceStub(channel).WatchLoad(worker_pb2.WatchLoadRequest(), timeout=10)
        first = next(call)
        call.cancel()
    return [_as_dict(load) for load in first.loads]


def wait(address: str, blocks: int, timeout: float) -> int:
    loads: dict[int, dict[str, int]] = {}
    with grpc.insecure_channel(address) as channel:
        call = worker_pb2_grpc.WorkerServiceStub(channel).WatchLoad(worker_pb2.WatchLoadRequest(), timeout=timeout)
        try:
            for i, message in enumerate(call):
                for load in message.loads:
                    loads[load.engine_id] = _as_dict(load)
                if i == 0:
                    print("ready", flush=True)
                    continue
                if sum(v["active_blocks"] for v in loads.values()) == blocks and not any(
                    v["running"] for v in loads.values()
                ):
                    print(json.dumps({"at": time.time(), "load": list(loads.values())}), flush=True)
                    call.cancel()
                    return 0
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                print(json.dumps({"error": str(exc.code()), "load": list(loads.values())}), flush=True)
    return 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="load_probe")
    sub = parser.add_subparsers(dest="cmd", required=True)
    snap = sub.add_parser("snapshot")
    snap.add_argument("addresses", nargs="+")
    follow = sub.add_parser("wait")
    follow.add_argument("address")
    follow.add_argument("--blocks", type=int, required=True)
    follow.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    if args.cmd == "snapshot":
        json.dump({address: snapshot(address) for address in args.addresses}, sys.stdout)
        return 0
    return wait(args.address, args.blocks, args.timeout)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
