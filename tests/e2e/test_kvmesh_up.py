"""``kvmesh up`` (what ``make run`` runs): the whole local mesh, a demo request, a clean Ctrl-C.

Each daemon gets the ``KVMESH_*`` variables it declares (a worker setting in the environment does not
stop the router), and a variable no daemon declares is an error before anything starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.support.daemons import script
from tests.support.etcd import free_port

pytestmark = pytest.mark.e2e


def test_kvmesh_up_serves_a_request_and_stops_cleanly_on_ctrl_c(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [script("kvmesh"), "up", "--grpc-port", str(port), "--discovery", f"file://{tmp_path / 'disc'}",
         "--log-dir", str(tmp_path / "logs"), "--speedup-ratio", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "KVMESH_NUM_GPU_BLOCKS": "4096", "KVMESH_MIGRATION_LIMIT": "2"})  # fmt: skip
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while not any(line.startswith("demo request") for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stdout.readline())
        assert any(f"KServe gRPC on localhost:{port}" in line for line in lines)
        assert any("InferenceServerClient" in line for line in lines), "the tritonclient example is printed"
        demo = next(line for line in lines if line.startswith("demo request"))
        assert "failed" not in demo, "".join(lines)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").iterdir()}
    assert set(logs) == {"kvmesh-frontend.log", "kvmesh-router.log", "kvmesh-worker.log"}
    for name, text in logs.items():
        assert "Traceback" not in text, f"{name}:\n{text}"


def test_kvmesh_up_refuses_a_variable_no_daemon_declares(tmp_path):
    result = subprocess.run(
        [script("kvmesh"), "up", "--log-dir", str(tmp_path / "logs")],
        env={**os.environ, "KVMESH_NUM_ENGINE": "2"}, capture_output=True, text=True, timeout=30)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["kvmesh up: error: KVMESH_NUM_ENGINE: unknown setting (environment)"]
    assert not (tmp_path / "logs").exists(), "nothing was started"
