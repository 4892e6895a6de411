"""``kvmesh bench kv-transfer``: NIXL READ between two processes against memcpy, per KV block size.

Two spawned processes, each with the worker's own KV machinery (``kvmesh_worker.kv_transfer``: a
``KvArena`` registered with a ``NixlAgent``, UCX over host memory, no progress thread). The source fills
``--total-mib`` of blocks with their hash-derived content and polls for progress. The reader READs them
all, in one transfer of ``total / block size`` descriptors. Each size is repeated ``--repeats`` times,
and the median is reported, with the bytes verified once per size. The baseline is a memcpy
(``np.copyto``) of the same bytes, block by block, in the reader process in the same run. Goal: NIXL
reaches >= 50 % of memcpy throughput at 256 KiB blocks.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvmesh_bench.argtypes import CommandParser, output_file, positive_int
from kvmesh_bench.tables import Column, format_table, write_json

KIB = 1024
DEFAULT_SIZES = "4,16,64,256,1024,2048"
GOAL_BLOCK = 256 * KIB
GOAL_RATIO = 0.5


def _source(conn: Connection, total: int, sizes: list[int]) -> None:
    from kvmesh_worker.kv_transfer.arena import KvArena
    from kvmesh_worker.kv_transfer.content import fill_block
    from kvmesh_worker.kv_transfer.nixl_agent import NixlAgent

    agent = NixlAgent("bench-source")
    arenas = {}
    for size in sizes:
        arena = KvArena(total // size, size)
        for slot in range(arena.num_slots):
            fill_block(arena.view(slot), slot + 1)
        agent.register(arena.address, arena.buffer.nbytes)
        arenas[size] = arena
    conn.send((agent.name, agent.metadata, {size: a.address for size, a in arenas.items()}))
    raw = agent._agent
    while not conn.poll():  # progress for the reader's transfers until told to stop
        raw.get_new_notifs()
    conn.recv()


def _reader(conn: Connection, total: int, sizes: list[int], repeats: int, out: Connection) -> None:
    from kvmesh_worker.kv_transfer.arena import KvArena
    from kvmesh_worker.kv_transfer.content import verify_block
    from kvmesh_worker.kv_transfer.nixl_agent import NixlAgent

    peer, metadata, addresses = conn.recv()
    agent = NixlAgent("bench-reader")
    arenas = {size: KvArena(total // size, size) for size in sizes}
    for arena in arenas.values():
        agent.register(arena.address, arena.buffer.nbytes)
    rows = []
    for size in sizes:
        arena = arenas[size]
        n = arena.num_slots
        local = [(arena.address + i * size, size) for i in range(n)]
        remote = [(addresses[size] + i * size, size) for i in range(n)]
        asyncio.run(agent.read(peer, metadata, local, remote, b"warm", 30.0))  # wire-up, page faults
        assert all(verify_block(arena.view(i), i + 1) for i in range(n)), f"bytes differ at {size} B blocks"
        nixl = [asyncio.run(agent.read(peer, metadata, local, remote, b"x", 30.0)) for _ in range(repeats)]
        src = np.ones(total, dtype=np.uint8)
        dst = np.zeros(total, dtype=np.uint8)
        copies = []
        for _ in range(repeats):
            started = time.perf_counter()
            for i in range(n):
                np.copyto(dst[i * size : (i + 1) * size], src[i * size : (i + 1) * size])
            copies.append(time.perf_counter() - started)
        t_nixl, t_copy = statistics.median(nixl), statistics.median(copies)
        rows.append(
            {
                "block_kib": size // KIB,
                "blocks": n,
                "nixl_ms": t_nixl * 1e3,
                "nixl_gbps": total / t_nixl / 1e9,
                "memcpy_ms": t_copy * 1e3,
                "memcpy_gbps": total / t_copy / 1e9,
                "ratio": t_copy / t_nixl,
            }
        )
    out.send(rows)
    conn.send("stop")


def run(total: int, sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    src_conn, rd_conn = ctx.Pipe()
    res_recv, res_send = ctx.Pipe(duplex=False)
    source = ctx.Process(target=_source, args=(src_conn, total, sizes))
    reader = ctx.Process(target=_reader, args=(rd_conn, total, sizes, repeats, res_send))
    source.start()
    reader.start()
    try:
        if not res_recv.poll(600):
            raise RuntimeError("the reader produced no result")
        rows: list[dict[str, Any]] = res_recv.recv()
    finally:
        reader.join(30)
        source.join(30)
        for proc in (reader, source):
            if proc.is_alive():
                proc.kill()
    return rows


COLUMNS: list[Column] = [
    ("block_kib", "block KiB", "{:d}"),
    ("blocks", "blocks", "{:d}"),
    ("nixl_ms", "NIXL ms", "{:.2f}"),
    ("nixl_gbps", "NIXL GB/s", "{:.2f}"),
    ("memcpy_ms", "memcpy ms", "{:.2f}"),
    ("memcpy_gbps", "memcpy GB/s", "{:.2f}"),
    ("ratio", "NIXL/memcpy", "{:.0%}"),
]


def main(argv: Sequence[str] | None = None) -> int:
    p = CommandParser(prog="kvmesh bench kv-transfer", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-kib", default=DEFAULT_SIZES, help="block sizes in KiB (default: %(default)s)")
    p.add_argument("--total-mib", type=positive_int, default=64, help="bytes moved per transfer (default: %(default)s)")
    p.add_argument(
        "--repeats", type=positive_int, default=5, help="timed transfers per size; median (default: %(default)s)"
    )
    p.add_argument("--json", type=output_file, default=None, help="write the figures as JSON to this path")
    args = p.parse_args(argv)
    sizes = [int(x) * KIB for x in args.sizes_kib.split(",") if x.strip()]
    total = args.total_mib << 20
    if not sizes or any(s <= 0 or total % s for s in sizes) or args.repeats < 1:
        p.error("--sizes-kib must divide --total-mib, and --repeats must be >= 1")
    rows = run(total, sizes, args.repeats)
    print(format_table(rows, COLUMNS))
    goal = next((r for r in rows if r["block_kib"] * KIB == GOAL_BLOCK), None)
    if goal is not None:
        verdict = "met" if goal["ratio"] >= GOAL_RATIO else "NOT met"
        print(f"goal: NIXL >= {GOAL_RATIO:.0%} of memcpy at 256 KiB blocks: {verdict} ({goal['ratio']:.0%})")
    if args.json is not None:
        payload = {"benchmark": "kv-transfer", "params": vars(args) | {"json": str(args.json)}, "rows": rows}
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
