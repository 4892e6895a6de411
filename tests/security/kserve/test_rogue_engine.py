"""Issue 15's fault campaign, as a test: a rogue process copies a real engine's records into discovery
under its own lease and address. Without TLS it receives requests (the attack works); with mTLS it
receives none, whether it serves plaintext, a self-made certificate or a stolen mesh certificate of
another role, and every client request still completes on the real engines.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.security.tlsmesh import TlsMesh

pytestmark = pytest.mark.e2e
ROGUE = Path(__file__).with_name("rogue_engine.py")
REQUESTS = 40


def _inputs(i: int) -> list[grpcclient.InferInput]:
    sampling = b'{"max_tokens": 4, "ignore_eos": true}'
    values = [("text_input", np.array([f"request {i} about KV caches".encode()], dtype=object), "BYTES"),
              ("stream", np.array([True]), "BOOL"),
              ("sampling_parameters", np.array([sampling], dtype=object), "BYTES")]  # fmt: skip
    inputs = []
    for name, value, dtype in values:
        tensor = grpcclient.InferInput(name, [1], dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def send_requests(
    address: str, pki: Path | None, n: int = REQUESTS, migrations: list[int] | None = None
) -> tuple[int, list[str]]:
    """Stream ``n`` requests one after the other; returns (completed, errors); appends each one's migrations."""
    tls = {} if pki is None else {"ssl": True, "root_certificates": str(pki / "ca.crt")}
    results: queue.Queue[tuple[object, object]] = queue.Queue()
    done, errors = 0, []
    with grpcclient.InferenceServerClient(address.replace("127.0.0.1", "localhost"), **tls) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        try:
            for i in range(n):
                client.async_stream_infer(
                    "kvmesh-mock", _inputs(i), request_id=str(i), enable_empty_final_response=True
                )
                while True:
                    result, error = results.get(timeout=30)
                    if error is not None:
                        errors.append(str(error))
                        break
                    params = result.get_response().parameters  # type: ignore[attr-defined]
                    if "triton_final_response" in params and params["triton_final_response"].bool_param:
                        done += 1
                        if migrations is not None and "kvmesh.migrations" in params:
                            migrations.append(params["kvmesh.migrations"].int64_param)
                        break
        finally:
            client.stop_stream()
    return done, errors


@pytest.fixture
def discovery(tmp_path: Path) -> str:
    root = tmp_path / "discovery"
    return f"file://{root}"


def _rogue(discovery: str, namespace: str, count_file: Path, *tls: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, str(ROGUE), discovery, namespace, str(count_file), *tls],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", f"rogue did not start: {line!r}"
    time.sleep(1.0)  # let the router and frontend see its records
    return proc


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        proc.terminate()
        proc.wait(10)


def _count(count_file: Path) -> int:
    return int(count_file.read_text().split()[0])


def test_without_tls_the_rogue_engine_gets_requests(tmp_path: Path, discovery: str, stack: list) -> None:
    """The control: the attack of issue 15 works on a plaintext mesh (so the TLS test below means something)."""
    mesh = TlsMesh(tmp_path, discovery, f"r{uuid.uuid4().hex[:8]}", certs=None)
    try:
        frontend = mesh.standard()
        counter = tmp_path / "rogue-count"
        stack.append(_rogue(discovery, mesh.namespace, counter))
        done, errors = send_requests(frontend.address, None)
        assert _count(counter) > 0, f"the rogue got nothing even without TLS ({done} done, {errors[:3]})"
    finally:
        mesh.close()


@pytest.mark.parametrize("rogue_identity", ["plaintext", "untrusted-ca", "stolen-frontend-cert"])
def test_with_tls_the_rogue_engine_gets_zero_requests(
    tmp_path: Path, discovery: str, pki: Path, stack: list, rogue_identity: str
) -> None:
    mesh = TlsMesh(tmp_path, discovery, f"r{uuid.uuid4().hex[:8]}", certs=pki)
    other = pki.parent / "other"
    tls = {
        "plaintext": [],
        "untrusted-ca": [str(other / "worker.crt"), str(other / "worker.key"), str(other / "ca.crt")],
        "stolen-frontend-cert": [str(pki / "frontend.crt"), str(pki / "frontend.key"), str(pki / "ca.crt")],
    }[rogue_identity]
    try:
        frontend = mesh.standard()
        counter = tmp_path / "rogue-count"
        stack.append(_rogue(discovery, mesh.namespace, counter, *tls))
        migrations: list[int] = []
        done, errors = send_requests(frontend.address, pki, migrations=migrations)
        assert _count(counter) == 0, f"the rogue got {counter.read_text()}"
        assert done == REQUESTS, f"{done}/{REQUESTS} completed; errors: {errors[:3]}\n{mesh.logs()}"
        # The router never chose it (no request had to move off it): its identity was never proven.
        assert sum(migrations) == 0 and len(migrations) == REQUESTS, migrations
        router = next(d for d in mesh.daemons if d.name == "kvmesh-router")
        assert "no worker certificate answered" in router.log_text()
    finally:
        mesh.close()
