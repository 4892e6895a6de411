"""Real kvmesh daemons as subprocesses for end-to-end tests.

A ``Daemon`` is started with its console script (exactly what a systemd unit runs), its output
captured to a log file, and waited on through grpc.health.v1 — the same signal operators use.
Only our own child processes are ever signalled.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.etcd import free_port

BIN = Path(sys.executable).parent


def script(name: str) -> str:
    path = BIN / name
    return str(path) if path.exists() else (shutil.which(name) or name)


class Daemon:
    """One daemon process; ``port`` is the gRPC port it was told to bind."""

    def __init__(self, name: str, args: Sequence[str], log_dir: Path, port: int, env: dict[str, str] | None = None):
        self.name = name
        self.args = list(args)
        self.port = port
        self.log_path = log_dir / f"{name}-{port}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in close()
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [script(name), *self.args],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
            process_group=0,  # not a session of its own: see kvmesh_cli.up._spawn
        )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self, service: str = "", timeout: float = 1.0) -> int | None:
        """The health status enum, or None if the daemon does not answer."""
        with grpc.insecure_channel(self.address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=timeout
                )
            except grpc.RpcError:
                return None
        return reply.status

    def wait_serving(self, timeout: float = 60.0) -> Daemon:  # a Python daemon starting on a busy 2-core box
        return self.wait_health((health_pb2.HealthCheckResponse.SERVING,), timeout)

    def wait_started(self, timeout: float = 60.0) -> Daemon:
        """Until its port answers health, ready or not (a frontend is NOT_SERVING until it knows a router
        replica and a model with a live engine)."""
        statuses = (health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING)
        return self.wait_health(statuses, timeout)

    def wait_health(self, statuses: tuple[int, ...], timeout: float = 60.0) -> Daemon:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_text()}")
            if self.health() in statuses:
                return self
            time.sleep(0.05)
        names = " or ".join(health_pb2.HealthCheckResponse.ServingStatus.Name(s) for s in statuses)
        raise AssertionError(f"{self.name} not {names} within {timeout} s:\n{self.log_text()}")

    def wait_log(self, pattern: str, timeout: float = 10.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.log_text())
            if match:
                return match
            time.sleep(0.05)
        raise AssertionError(f"{pattern!r} not in {self.name}'s log within {timeout} s:\n{self.log_text()}")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        stop_process(self.proc, signal.SIGTERM, 10)
        self._log.close()


def running_pid(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (an exited child not reaped yet is a zombie: no)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def stop_process(proc: subprocess.Popen[Any], sig: int, timeout: float) -> None:
    """Signal ``proc`` if it still runs, and SIGKILL it if it has not exited ``timeout`` seconds later."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def running(*daemons: Daemon) -> Iterator[tuple[Daemon, ...]]:
    try:
        yield daemons
    finally:
        for daemon in reversed(daemons):
            daemon.close()


@contextlib.contextmanager
def file_worker(log_dir: Path, namespace: str, *flags: str) -> Iterator[Daemon]:
    """A serving ``kvmesh-worker`` on a free port and a file discovery in ``log_dir``, closed with the block."""
    port = free_port()
    common = ["--discovery", f"file://{log_dir / 'discovery'}", "--namespace", namespace, "--lease-ttl", "2"]
    daemon = Daemon("kvmesh-worker", [*common, "--grpc-port", str(port), *flags], log_dir, port)
    try:
        yield daemon.wait_serving()
    finally:
        daemon.close()


def run_cli(
    name: str, *args: str, timeout: float = 30.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [script(name), *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )
