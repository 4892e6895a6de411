"""Disaggregated meshes of real daemons, driven by the stock tritonclient: 1P1D on both discovery backends, 2P2D.

The client sees one ordinary stream with exactly ``max_tokens`` tokens; the final response says where the
prompt was computed (``kvmesh.prefill_worker_id``, ``kvmesh.kv_transferred_blocks``, ``kvmesh.disagg``);
after every test no engine holds a block.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from tests.disagg.support import all_loads
from tests.kserve_clients.mesh import MODEL, Mesh, llm_inputs, param, stream_requests
from tests.support.etcd import EtcdServer, etcd_available

pytestmark = pytest.mark.e2e

LONG = " ".join(f"word{i}" for i in range(120))  # well over a few blocks of 16 tokens


def disagg_mesh(mesh: Mesh, prefill: int, decode: int, *frontend_args: str, router_args: tuple[str, ...] = ()) -> Mesh:
    for _ in range(decode):
        mesh.worker("--role", "decode")
    for _ in range(prefill):
        mesh.worker("--role", "prefill")
    mesh.router(*router_args)
    mesh.start_frontend(*frontend_args)
    mesh.wait_model(MODEL)
    return mesh


def assert_nothing_held(mesh: Mesh, timeout: float = 1.0, since: float | None = None) -> float:
    """0 blocks active on every engine of the mesh (requests, holds, pins) within ``timeout`` of ``since``
    (monotonic; default now); returns when that was seen, relative to ``since``."""
    since = time.monotonic() if since is None else since
    workers = [d.address for d in mesh.daemons if d.name == "kvmesh-worker" and d.proc.poll() is None]
    while True:
        held = {a: [load.active_blocks for load in all_loads(a)] for a in workers}
        seen = time.monotonic() - since
        if all(b == 0 for blocks in held.values() for b in blocks):
            return seen
        assert seen < timeout, f"blocks still held {seen:.2f}s later: {held}"
        time.sleep(0.02)


def request(rid: str, prompt: str, max_tokens: int = 12) -> dict:
    return {"request_id": rid, "inputs": llm_inputs(prompt, max_tokens=max_tokens), "enable_empty_final_response": True}


@pytest.fixture(scope="module", params=["file", pytest.param("etcd", marks=pytest.mark.etcd)])
def mesh_1p1d(request, tmp_path_factory) -> Iterator[Mesh]:
    if request.param == "file":
        url = f"file://{tmp_path_factory.mktemp('discovery')}"
        mesh = disagg_mesh(Mesh(tmp_path_factory.mktemp("logs"), url, f"pd{uuid.uuid4().hex[:8]}"), 1, 1)
        try:
            yield mesh
        finally:
            mesh.close()
        return
    if not etcd_available():
        pytest.skip("etcd binary not installed")
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as etcd:
        mesh = disagg_mesh(Mesh(tmp_path_factory.mktemp("logs"), etcd.url, f"pd{uuid.uuid4().hex[:8]}"), 1, 1)
        try:
            yield mesh
        finally:
            mesh.close()


def test_1p1d_one_ordinary_stream_remote_prefill_then_only_new_blocks(mesh_1p1d):
    prompt = f"{uuid.uuid4().hex} {LONG}"  # in no engine's cache yet
    out = stream_requests(mesh_1p1d.url_frontend, [request("a", prompt)])["a"]
    assert out.num_tokens == 12 and out.finish_reason == "length"
    assert param(out.final, "kvmesh.disagg") == "remote"
    first_blocks = param(out.final, "kvmesh.kv_transferred_blocks")
    assert param(out.final, "kvmesh.prefill_worker_id") != 0 and first_blocks > 0
    # Computed by the prefill engine and pulled: not a prefix-cache hit (the decode engine counts them in).
    assert param(out.final, "kvmesh.cached_tokens") == 0
    # The same prompt again: the decode engine holds its blocks already, so nothing (or nearly) moves.
    again = stream_requests(mesh_1p1d.url_frontend, [request("b", prompt)])["b"]
    assert again.num_tokens == 12
    assert param(again.final, "kvmesh.kv_transferred_blocks") < first_blocks
    assert param(again.final, "kvmesh.cached_tokens") > 0
    moved, everything = (param(again.final, f"kvmesh.kv_{k}_bytes") for k in ("transferred", "pull_everything"))
    assert moved < everything and everything == param(out.final, "kvmesh.kv_pull_everything_bytes")
    assert again.text == out.text  # deterministic mocker: same prompt, same tokens, whichever path
    assert_nothing_held(mesh_1p1d)


def test_1p1d_many_concurrent_requests(mesh_1p1d):
    requests = [request(f"r{i}", f"{i} {LONG}", max_tokens=8) for i in range(16)]
    outcomes = stream_requests(mesh_1p1d.url_frontend, requests)
    assert all(o.num_tokens == 8 for o in outcomes.values())
    assert all(param(o.final, "kvmesh.disagg") == "remote" for o in outcomes.values())
    assert_nothing_held(mesh_1p1d)


def test_conditional_disaggregation_takes_both_branches(tmp_path):
    mesh = Mesh(tmp_path, f"file://{tmp_path / 'disc'}", f"pd{uuid.uuid4().hex[:8]}")
    try:
        disagg_mesh(mesh, 1, 1, router_args=("--disagg-min-tokens", "64"))  # a router policy
        out = stream_requests(mesh.url_frontend, [request("short", "Tell me about KV caches"), request("long", LONG)])
        assert param(out["short"].final, "kvmesh.prefill_worker_id") == 0
        assert param(out["short"].final, "kvmesh.disagg").startswith("local: ")
        assert param(out["short"].final, "kvmesh.kv_transferred_blocks") == 0
        assert param(out["long"].final, "kvmesh.disagg") == "remote"
        assert param(out["long"].final, "kvmesh.prefill_worker_id") != 0
        assert all(o.num_tokens == 12 for o in out.values())
        # The same long prompt again: the decode engine caches it now, so the router (which sees that in its
        # index) counts only the uncached tail and prefills it locally. Its index learns of the new blocks
        # through KV events, a moment after the first request ended: poll, bounded.
        deadline = time.monotonic() + 10
        while True:
            again = stream_requests(mesh.url_frontend, [request(f"again{time.monotonic_ns()}", LONG)])
            decision = param(next(iter(again.values())).final, "kvmesh.disagg")
            if decision != "remote" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert decision.startswith("local: ") and "uncached prompt tokens <= --disagg-min-tokens 64" in decision
        assert_nothing_held(mesh)
    finally:
        mesh.close()


def test_2p2d_spreads_over_both_pools(tmp_path, discovery_url):
    mesh = Mesh(tmp_path, discovery_url, f"pd{uuid.uuid4().hex[:8]}")
    try:
        disagg_mesh(mesh, 2, 2)
        requests = [request(f"r{i}", f"topic {i}: {LONG}", max_tokens=6) for i in range(24)]
        outcomes = stream_requests(mesh.url_frontend, requests)
        assert all(o.num_tokens == 6 for o in outcomes.values())
        prefill_ids = {param(o.final, "kvmesh.prefill_worker_id") for o in outcomes.values()}
        decode_ids = {param(o.final, "kvmesh.worker_id") for o in outcomes.values()}
        assert len(prefill_ids) == 2 and 0 not in prefill_ids, prefill_ids
        assert len(decode_ids) == 2, decode_ids
        assert_nothing_held(mesh)
    finally:
        mesh.close()
