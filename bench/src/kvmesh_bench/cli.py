"""``kvmesh bench NAME ...``: each benchmark is a module with ``main(argv) -> int`` and its own flags.

Every benchmark prints a table and writes its figures with ``--json PATH``; numbers are reported as
ratios against a baseline measured in the same run, because the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS: dict[str, tuple[str, str]] = {
    "mocker-scale": ("kvmesh_bench.mocker_scale", "N mocker engines in one process: timing drift and passes/s"),
    "router": ("kvmesh_bench.router_bench", "indexer and decision throughput/latency on the Mooncake trace"),
    "indexer": ("kvmesh_bench.indexer_microbench", "indexer alone: events/s and find_matches latency"),
    "frontend": ("kvmesh_bench.frontend_bench", "latency the frontend + router add, streams/s"),
    "replay": ("kvmesh_bench.replay.cli", "replay a Mooncake trace offline (simulated) or live (KServe)"),
    "kv-transfer": ("kvmesh_bench.kv_transfer_bench", "NIXL READ between two processes vs memcpy, per KV block size"),
    "disagg-sweep": ("kvmesh_bench.replay.disagg_sweep", "offline: aggregated N engines vs every P+D split of N"),
    "compare": ("kvmesh_bench.replay.compare", "the same replay per router mode, with ratios to round_robin"),
    "multihost-replay": (
        "kvmesh_bench.multihost_replay",
        "a trace slice live on the multi-host mesh under each link condition vs offline + the added RTTs",
    ),
    "policy-matrix": (
        "kvmesh_bench.replay.policy_matrix",
        "offline: the default routing policy vs kv:dynamo on every trace x load (median of seeds)",
    ),
    "chaos": ("kvmesh_bench.chaos", "fault suite: kill workers/routers, stop or freeze etcd, overload, cancel, soak"),
    "vllm-overhead": ("kvmesh_bench.vllm_overhead", "vLLM behind kvmesh against the same vLLM driven directly"),
    "planner-sim": ("kvmesh_bench.planner_bench", "the planner offline vs static fleets (SLA, engine-s)"),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (each prints a table; --json PATH writes figures)")
    names = bench.add_subparsers(dest="benchmark", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        p = names.add_parser(name, help=help_text, add_help=False)
        p.add_argument("args", nargs=argparse.REMAINDER)  # unknown flags are appended by kvmesh_cli.main
        p.set_defaults(func=lambda args, module=module: int(importlib.import_module(module).main(args.args) or 0))
