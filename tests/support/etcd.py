"""A real etcd server for tests: free loopback ports, a private data dir, stop/restart/freeze.

Reusable from any test folder::

    from tests.support.etcd import EtcdServer

    with EtcdServer(tmp_path / "etcd") as etcd:   # started, healthy
        url = etcd.url                            # "etcd://127.0.0.1:PORT"
        etcd.stop(); etcd.start()                 # same data dir, same ports
        etcd.freeze(); etcd.thaw()                # SIGSTOP / SIGCONT

Never uses port 2379; only ever signals its own process. Uses the fast raft timings
(``--heartbeat-interval 10 --election-timeout 100``): healthy in ~0.1 s, and a 1 s lease TTL is kept.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from kvmesh.children import dies_with_parent
from kvmesh.ports import free_port

__all__ = ["EtcdServer", "etcd_available", "free_port"]

ETCD_BIN = os.environ.get("KVMESH_TEST_ETCD", "etcd")


def etcd_available() -> bool:
    return shutil.which(ETCD_BIN) is not None


class EtcdServer:
    """One single-member etcd process; ``start`` after ``stop`` reuses the data dir and the ports."""

    def __init__(self, data_dir: str | Path | None = None, *, name: str = "kvmesh-test") -> None:
        self._own_dir = data_dir is None
        self.base = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp(prefix="kvmesh-etcd-"))
        self.base.mkdir(parents=True, exist_ok=True)
        self.data_dir = self.base / "data"
        self.log_path = self.base / "etcd.log"
        self.name = name
        self.client_port = 0
        self.peer_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = None
        self.starts = 0

    # -- addresses -----------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT``."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        """``etcd://127.0.0.1:PORT`` (the kvmesh discovery URL)."""
        return f"etcd://{self.endpoint}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> EtcdServer:
        """Start (or restart on the same data dir and ports) and wait until /health is true."""
        assert not self.running, "etcd already running"
        first = self.client_port == 0
        for attempt in range(5):
            if first:
                self.client_port, self.peer_port = free_port(), free_port()
            self._spawn()
            try:
                self._wait_healthy(timeout)
                self.starts += 1
                return self
            except RuntimeError:
                log_text = self.log_text()
                self._reap()
                if first and "address already in use" in log_text and attempt < 4:
                    shutil.rmtree(self.data_dir, ignore_errors=True)
                    continue  # a free port was taken meanwhile: pick new ones
                raise
        raise AssertionError("unreachable")

    def _spawn(self) -> None:
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in _reap
        self.proc = subprocess.Popen(
            dies_with_parent([  # a hard-killed test must not leave etcd behind
                ETCD_BIN,
                "--name", self.name,
                "--data-dir", str(self.data_dir),
                "--listen-client-urls", client,
                "--advertise-client-urls", client,
                "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"{self.name}={peer}",
                "--initial-cluster-state", "new",
                "--heartbeat-interval", "10",
                "--election-timeout", "100",
                "--logger", "zap",
                "--log-level", "warn",
            ]),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.client_port}/health"
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log_text()[-2000:]}")
            with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(url, timeout=0.5) as r:
                if json.load(r).get("health") == "true":
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd not healthy within {timeout}s: {self.log_text()[-2000:]}")
            time.sleep(0.02)

    def stop(self) -> None:
        """SIGTERM and wait (data dir kept)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)  # in case it is frozen
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reap()

    def kill(self) -> None:
        """SIGKILL and wait (data dir kept)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reap()

    def restart(self, timeout: float = 10.0) -> EtcdServer:
        self.stop()
        return self.start(timeout)

    def freeze(self) -> None:
        """SIGSTOP: the server stays bound but answers nothing."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def _reap(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def close(self) -> None:
        """Stop and delete the data dir if this object created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.base, ignore_errors=True)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    # -- helpers -------------------------------------------------------------------------------
    def etcdctl(self, *args: str, timeout: float = 10.0) -> str:
        """Run ``etcdctl --endpoints <this> ARGS`` (API v3) and return stdout."""
        out = subprocess.run(
            ["etcdctl", "--endpoints", self.endpoint, *args],
            check=True,
            capture_output=True,
            timeout=timeout,
            env={**os.environ, "ETCDCTL_API": "3"},
        )
        return out.stdout.decode()

    def __enter__(self) -> EtcdServer:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<EtcdServer {self.endpoint} {state} data={self.data_dir}>"
