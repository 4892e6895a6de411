"""``kvmesh up`` (what ``make run`` runs): the whole local mesh, a demo request, a clean Ctrl-C.

Each daemon gets the ``KVMESH_*`` variables it declares (a worker setting in the environment does not
stop the router), and a variable no daemon declares is an error before anything starts.

Load-proof (issue 14 item 12): the bounds are what a shared 2-core CI box busy with other work needs
(three Python daemons start and stop; ``kvmesh up`` itself gives them 15 s before SIGKILL), and
``kvmesh up``'s output is read by a thread to the end, so a full pipe can never stall its shutdown.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
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
        env={**os.environ, "KVMESH_NUM_GPU_BLOCKS": "4096", "KVMESH_MIGRATION_LIMIT": "2",
             "KVMESH_DRAIN_TIMEOUT": "5"})  # fmt: skip
    lines: list[str] = []
    output: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.put(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120  # three daemons and a tokenizer start on a busy machine
        while not any(line.startswith("demo request") for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            try:
                lines.append(output.get(timeout=1))
            except queue.Empty:
                continue
        assert any(f"KServe gRPC on localhost:{port}" in line for line in lines)
        assert any("InferenceServerClient" in line for line in lines), "the tritonclient example is printed"
        demo = next(line for line in lines if line.startswith("demo request"))
        assert "failed" not in demo, "".join(lines)
        proc.send_signal(signal.SIGINT)
        # kvmesh up SIGKILLs a daemon after 15 s; the rest is process exit on a loaded machine
        assert proc.wait(90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").iterdir()}
    assert set(logs) == {"kvmesh-frontend.log", "kvmesh-router.log", "kvmesh-worker.log"}
    for name, text in logs.items():
        assert "Traceback" not in text, f"{name}:\n{text}"


def test_kvmesh_up_refuses_a_variable_no_daemon_declares(tmp_path):
    result = subprocess.run(
        [script("kvmesh"), "up", "--log-dir", str(tmp_path / "logs")],
        env={**os.environ, "KVMESH_NUM_ENGINE": "2"}, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["kvmesh up: error: KVMESH_NUM_ENGINE: unknown setting (environment)"]
    assert not (tmp_path / "logs").exists(), "nothing was started"
