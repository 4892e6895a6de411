"""``kvmesh up --planner --prefill-workers P --decode-workers D``: the planner, not ``kvmesh up``, starts the
prefill and decode workers (local connector, one engine each, ``--role``), and ``kvmesh planner status``
shows both pools at their minimums; the demo request is served disaggregated; Ctrl-C stops everything."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import time

import pytest
from kvmesh.discovery import model_prefix, open_discovery
from kvmesh.v1 import discovery_pb2

from tests.support.daemons import script
from tests.support.etcd import free_port
from tests.support.kvmesh_up import KvmeshUp

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(300)
def test_kvmesh_up_planner_manages_the_prefill_and_decode_pools(tmp_path):
    port, disc = free_port(), f"file://{tmp_path / 'disc'}"
    with KvmeshUp(
        ["--planner", "--prefill-workers", "1", "--decode-workers", "1", "--max-engines", "2",
         "--planner-args", "--interval 1", "--grpc-port", str(port), "--discovery", disc,
         "--log-dir", str(tmp_path / "logs"), "--speedup-ratio", "0"],
    ) as up:  # fmt: skip
        demo = up.wait_for("demo request", 180)  # four daemons and two workers start on a busy machine
        assert "failed" not in demo, up.text
        assert f"Watch the planner: kvmesh planner status --namespace kvmesh-local --discovery {disc}" in up.text
        status = subprocess.run(
            [script("kvmesh"), "planner", "status", "--json"],
            env={**os.environ, "KVMESH_DISCOVERY": disc, "KVMESH_NAMESPACE": "kvmesh-local"},
            capture_output=True, text=True, timeout=60)  # fmt: skip
        assert status.returncode == 0, status.stderr
        (leader,) = json.loads(status.stdout)
        assert leader["connector"] == "local" and leader["leader"] is True
        assert leader["observed"] == {"prefill": 1, "decode": 1}  # no aggregated engine: the roles are the pools
        assert leader["desired"] == {"prefill": 1, "decode": 1}
        assert leader["pools"] == ["prefill", "decode"] and leader["engineBudget"] == 4
        assert leader["minimum"] == {"prefill": 1, "decode": 1} and leader["maximum"] == {"prefill": 2, "decode": 2}
        text = subprocess.run(
            [script("kvmesh"), "planner", "status", "--discovery", disc, "--namespace", "kvmesh-local"],
            capture_output=True, text=True, timeout=60)  # fmt: skip
        assert "pools: prefill [1, 2], decode [1, 2]; budget 4 engines" in text.stdout, text.stdout + text.stderr
        assert up.stop() == 0
    planner_log = (tmp_path / "logs" / "kvmesh-planner.log").read_text()
    assert "pools prefill in [1, 2], decode in [1, 2], budget 4 engines" in planner_log
    assert "--role prefill" in planner_log and "--role decode" in planner_log
    assert "Traceback" not in planner_log


@pytest.mark.timeout(300)
def test_kvmesh_up_planner_under_tls_observes_its_engines_and_the_printed_commands_work(tmp_path):
    """Under --tls the planner got no certificate: its watches of the workers failed the handshake, it saw
    no engine and never scaled, and its own port was plaintext. The commands up prints (the planner status,
    the tokenizer download) carry the operator certificate, and work pasted as they are. The operator's own
    --worker-args (docs/planner.md) add to up's worker flags: they replaced them, TLS included, and no
    worker the planner started could talk to the mesh."""
    port, disc = free_port(), f"file://{tmp_path / 'disc'}"
    with KvmeshUp(
        ["--planner", "--tls", "--max-engines", "2", "--planner-args", "--interval 1 --worker-args '--max-num-seqs 4'",
         "--grpc-port", str(port), "--discovery", disc, "--speedup-ratio", "0", "--no-demo"],
    ) as up:  # fmt: skip
        up.wait_for("kvmesh is up", 180)
        watch = up.wait_for("Watch the planner: ", 30).removeprefix("Watch the planner: ").strip()
        assert "--tls-cert" in watch, watch
        deadline = time.monotonic() + 60
        while True:
            status = subprocess.run([*shlex.split(watch.replace("kvmesh ", f"{script('kvmesh')} ", 1)), "--json"],
                                    capture_output=True, text=True, timeout=60)  # fmt: skip
            assert status.returncode == 0, status.stdout + status.stderr
            (leader,) = json.loads(status.stdout)
            if leader.get("observed") == {"aggregated": 1}:
                break
            assert time.monotonic() < deadline, f"the planner observes no engine: {leader}"
            time.sleep(1)
        cards = [discovery_pb2.ModelCard.FromString(v) for v in asyncio.run(_cards(disc)).values()]
        assert [card.max_num_seqs for card in cards] == [4]  # the operator's worker flag, beside up's TLS
        files = up.wait_for("Benchmark it", 30).split(": ", 1)[1].split(" && ")[0]
        assert "--tls-cert" in files, files
        out = tmp_path / "tok"
        fetched = subprocess.run(
            shlex.split(files.replace("kvmesh ", f"{script('kvmesh')} ", 1).replace("./tok", str(out))),
            capture_output=True, text=True, timeout=60)  # fmt: skip
        assert fetched.returncode == 0 and (out / "tokenizer.json").exists(), fetched.stdout + fetched.stderr
        assert up.stop() == 0


async def _cards(url: str) -> dict[str, bytes]:
    disc = await open_discovery(url, ttl=5.0)
    try:
        return await disc.get_prefix(model_prefix("kvmesh-local"))
    finally:
        await disc.close()
