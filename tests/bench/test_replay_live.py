"""Live replay end to end: 50 requests of the Mooncake conversation trace against a real local mesh.

One worker process (2 engines, block size 64, 16384 blocks, ``--speedup-ratio 100``), one kv router and
one frontend, on the file discovery backend. Arrivals x50 and engines x100 keep it to a few seconds.
"""

import asyncio
import importlib.util
import json
import time
import uuid
from pathlib import Path

import grpc
import pytest
from kvmesh_bench.replay import cli
from kvmesh_bench.replay.live import FrontendUnreachable, probe_frontend

from tests.support.daemons import Daemon
from tests.support.etcd import free_port

pytestmark = pytest.mark.e2e

# shared/ lies beside the checkout (as in CI)
TRACE = Path(__file__).resolve().parents[2].parent / "shared/data/mooncake/conversation_trace.jsonl"


def _ready(address: str) -> bool:
    async def probe() -> bool:
        async with grpc.aio.insecure_channel(address) as channel:
            try:
                await probe_frontend(channel, "kvmesh-mock", 1.0)
            except FrontendUnreachable:
                return False
            return True

    return asyncio.run(probe())


@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    for module in ("kvmesh_worker.main", "kvmesh_router.main", "kvmesh_frontend.main"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not available")
    logs = tmp_path_factory.mktemp("logs")
    url = f"file://{tmp_path_factory.mktemp('discovery')}"
    ns = f"rp{uuid.uuid4().hex[:8]}"
    daemons = []

    def start(name, *extra):
        port = free_port()
        common = ["--discovery", url, "--namespace", ns, "--grpc-port", str(port), "--lease-ttl", "2",
                  "--drain-timeout", "2"]  # fmt: skip
        daemon = Daemon(name, [*common, *extra], logs, port)
        daemons.append(daemon)
        return daemon.wait_serving()

    try:
        start("kvmesh-worker", "--num-engines", "2", "--block-size", "64", "--num-gpu-blocks", "16384",
              "--speedup-ratio", "100")  # fmt: skip
        start("kvmesh-router", "--router-mode", "kv")
        fe = start("kvmesh-frontend")
        deadline = time.monotonic() + 20
        while not _ready(fe.address):
            if time.monotonic() > deadline:
                raise AssertionError("the model never became ready:\n" + fe.log_text()[-3000:])
            time.sleep(0.1)
        yield fe.address
    finally:
        for daemon in reversed(daemons):
            daemon.close()


@pytest.mark.skipif(not TRACE.exists(), reason="Mooncake conversation trace not present")
def test_live_replay_of_50_requests(frontend, tmp_path, capsys):
    out = tmp_path / "live.json"
    argv = [str(TRACE), "--frontend", frontend, "--max-requests", "50", "--arrival-speedup", "50",
            "--drain-timeout", "60", "--no-progress", "--json", str(out)]  # fmt: skip
    rc = cli.main(argv)
    text = capsys.readouterr().out
    assert rc == 0, text
    data = json.loads(out.read_text())
    s = data["summary"]
    assert s["completed"] == 50, data["errors"]
    assert s["failed"] == 0
    assert 0 < s["ttft_p50_ms"] <= s["ttft_p99_ms"] < 60_000
    assert s["itl_p50_ms"] > 0 and s["e2e_p50_ms"] > s["ttft_p50_ms"]
    assert s["hit_rate"] > 0  # the first 50 requests share a system prompt and some conversations
    assert sum(e["requests"] for e in data["per_engine"]) == 50
    assert len(data["meta"]["engine_ids"]) == 2
    # The client's own lag (scheduled time -> gRPC took the message), charged to TTFT, is reported.
    meta = data["meta"]
    assert 0 <= meta["send_lag_p50_ms"] <= meta["send_lag_p99_ms"] <= meta["max_send_lag_ms"]
    assert "send lag p50" in text
    assert (tmp_path / "live.png").exists()
    # The same slice against the same mesh per mode, with fresh token seeds: compare runs live too.
    from kvmesh_bench.replay import compare

    rc = compare.main([str(TRACE), "--frontend", frontend, "--max-requests", "20", "--arrival-speedup", "50",
                       "--modes", "kv,round_robin", "--no-progress"])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "/ round_robin" in text
    # --duration stops sending: 50 requests spread over 3 s, only the first second of them goes out.
    out = tmp_path / "short.json"
    rc = cli.main([str(TRACE), "--frontend", frontend, "--max-requests", "50", "--arrival-speedup", "5",
                   "--duration", "1", "--no-progress", "--seed", "3", "--json", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert 0 < data["meta"]["sent"] < 50
    assert data["summary"]["completed"] == data["meta"]["sent"]
    assert any("not sent" in e for e in data["errors"])
    # --stream-interval: every request asks for vLLM's chunked streaming; each chunk's gap is shared among
    # its tokens, so the ITL stays a per-token figure.
    out = tmp_path / "chunked.json"
    rc = cli.main([str(TRACE), "--frontend", frontend, "--max-requests", "20", "--arrival-speedup", "50",
                   "--stream-interval", "8", "--no-progress", "--seed", "4", "--json", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["meta"]["stream_interval"] == 8
    assert data["summary"]["completed"] == 20 and data["summary"]["failed"] == 0
    assert 0 < data["summary"]["itl_p50_ms"] < 1000
