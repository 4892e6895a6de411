"""One real vLLM worker per pytest session (engine start is 13-50 s and ~2.8 GiB), plus a router and a
frontend on the file discovery backend.

These tests run in the vLLM venv (``make test-vllm``: ``.venv-vllm/bin/python -m pytest tests/vllm``).
Without vLLM they fail at once with one message saying how to install it; they never skip silently.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.daemons import Daemon
from tests.support.etcd import free_port

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = ROOT / "services/worker/src/kvmesh_worker/models/tiny-llama"
MODEL = "tiny-llama"
BLOCK_SIZE = 32
NUM_BLOCKS = 48  # small on purpose: eviction-heavy traffic (num_gpu_blocks_override)
# The session's worker pretends it never received these ZMQ batches: vLLM's replay must fill them.
DROPPED_SEQS = "1,2"


def pytest_configure(config: pytest.Config) -> None:
    if importlib.util.find_spec("vllm") is None:
        raise pytest.UsageError(
            "tests/vllm need vLLM: run `make setup-vllm`, then `.venv-vllm/bin/python -m pytest tests/vllm` "
            "(or `make test-vllm`)"
        )


@pytest.fixture(scope="session", autouse=True)
def no_ipc_directory_outlives_its_worker() -> Iterator[None]:
    """Every vLLM worker's directory for vLLM's IPC sockets is gone once the session's workers are (the
    orphan guard removes it, whether the worker stopped or was killed): checked after the last test."""
    pattern = "kvmesh-vllm-ipc-*"
    before = set(Path(tempfile.gettempdir()).glob(pattern))
    yield
    deadline = time.monotonic() + 15  # a guard notices its worker's exit within its poll
    while (left := set(Path(tempfile.gettempdir()).glob(pattern)) - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"vLLM IPC directories outlived their workers: {sorted(map(str, left))}"


@dataclass
class VllmMesh:
    log_dir: Path
    url: str
    namespace: str
    daemons: list[Daemon] = field(default_factory=list)
    worker: Daemon | None = None
    router: Daemon | None = None
    frontend: Daemon | None = None

    def common(self, port: int) -> list[str]:
        return [
            "--discovery",
            self.url,
            "--namespace",
            self.namespace,
            "--grpc-port",
            str(port),
            "--lease-ttl",
            "2",
            "--drain-timeout",
            "2",
        ]

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None, timeout: float = 20) -> Daemon:
        port = free_port()
        daemon = Daemon(name, [*self.common(port), *args], self.log_dir, port, env=env)
        self.daemons.append(daemon)
        # a frontend is SERVING once it knows a router and a loaded model: the tests wait for the model
        return daemon.wait_started(timeout) if name == "kvmesh-frontend" else daemon.wait_serving(timeout)

    def mocker(self) -> Daemon:
        return self.start(
            "kvmesh-worker",
            [
                "--engine",
                "mocker",
                "--model-path",
                str(TINY_LLAMA),
                "--block-size",
                str(BLOCK_SIZE),
                "--speedup-ratio",
                "10",
            ],
        )

    def logs(self) -> str:
        return "\n".join(f"--- {d.name}:{d.port}\n{d.log_text()[-3000:]}" for d in self.daemons)

    def close(self) -> None:
        for daemon in reversed(self.daemons):
            daemon.close()


@pytest.fixture(scope="session")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmMesh]:
    """A vLLM worker (dummy weights, 48 blocks of 32), a KV router and a frontend."""
    yield from _vllm_mesh(tmp_path_factory)


@pytest.fixture
def fresh_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmMesh]:
    """The same mesh, started for one test: for a test that kills the engine or needs its first state."""
    yield from _vllm_mesh(tmp_path_factory)


def _vllm_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmMesh]:
    log_dir = tmp_path_factory.mktemp("logs")
    deployment = VllmMesh(log_dir, f"file://{tmp_path_factory.mktemp('discovery')}", f"vl{uuid.uuid4().hex[:8]}")
    try:
        deployment.worker = deployment.start(
            "kvmesh-worker",
            [
                "--engine",
                "vllm",
                "--model-path",
                str(TINY_LLAMA),
                "--block-size",
                str(BLOCK_SIZE),
                "--num-gpu-blocks",
                str(NUM_BLOCKS),
                "--max-model-len",
                str((NUM_BLOCKS - 1) * BLOCK_SIZE),
                "--vllm-engine-args",
                '{"load_format": "dummy"}',
            ],
            env={"KVMESH_TEST_VLLM_DROP_SEQS": DROPPED_SEQS},
            timeout=180,
        )
        # --busy-kv-usage none: the eviction test floods 12 x 11 blocks into 48 at once on purpose (vLLM
        # queues them); main's router would otherwise refuse them at 95 % KV usage (its admission default).
        deployment.router = deployment.start("kvmesh-router", ["--router-mode", "kv", "--busy-kv-usage", "none"])
        deployment.frontend = deployment.start("kvmesh-frontend", [])
        yield deployment
    finally:
        deployment.close()
