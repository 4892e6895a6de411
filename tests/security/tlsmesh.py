"""A mesh of real daemons with mTLS (certificates from ``kvmesh certs init``) for the security tests.

Imports no ``inference.*`` stubs: these tests use stock tritonclient, which declares the same proto package.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.daemons import Daemon
from tests.support.etcd import free_port


def tls_args(certs: Path | None, role: str) -> list[str]:
    if certs is None:
        return []
    return ["--tls-cert", str(certs / f"{role}.crt"), "--tls-key", str(certs / f"{role}.key"),
            "--tls-ca", str(certs / "ca.crt")]  # fmt: skip


def credentials(certs: Path, role: str | None = "operator") -> grpc.ChannelCredentials:
    if role is None:  # no client certificate
        return grpc.ssl_channel_credentials(root_certificates=(certs / "ca.crt").read_bytes())
    return grpc.ssl_channel_credentials(
        root_certificates=(certs / "ca.crt").read_bytes(),
        private_key=(certs / f"{role}.key").read_bytes(),
        certificate_chain=(certs / f"{role}.crt").read_bytes(),
    )


def channel(address: str, certs: Path | None, role: str | None = "operator") -> grpc.Channel:
    if certs is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, credentials(certs, role))


def health(address: str, certs: Path | None, role: str | None = "operator", timeout: float = 1.0) -> int | None:
    with channel(address, certs, role) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status
        except grpc.RpcError:
            return None


class TlsMesh:
    """Daemons on one discovery URL; TLS when ``certs`` is a directory from ``kvmesh certs init``."""

    def __init__(self, log_dir: Path, url: str, namespace: str, certs: Path | None) -> None:
        self.log_dir, self.url, self.namespace, self.certs = log_dir, url, namespace, certs
        self.daemons: list[Daemon] = []

    def start(self, name: str, role: str, *extra: str, env: dict[str, str] | None = None) -> Daemon:
        port = free_port()
        args = ["--discovery", self.url, "--namespace", self.namespace, "--grpc-port", str(port),
                "--lease-ttl", "2", "--drain-timeout", "2", *tls_args(self.certs, role), *extra]  # fmt: skip
        daemon = Daemon(name, args, self.log_dir, port, env=env)
        self.daemons.append(daemon)
        return daemon

    def wait_serving(self, daemon: Daemon, timeout: float = 30.0) -> Daemon:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if daemon.proc.poll() is not None:
                raise AssertionError(f"{daemon.name} exited {daemon.proc.returncode}:\n{daemon.log_text()}")
            if health(daemon.address, self.certs) == health_pb2.HealthCheckResponse.SERVING:
                return daemon
            time.sleep(0.05)
        raise AssertionError(f"{daemon.name} not SERVING:\n{daemon.log_text()}")

    def standard(self, engines: int = 2) -> Daemon:
        """worker (``engines`` mocker engines) + router + frontend; returns the frontend."""
        self.wait_serving(self.start("kvmesh-worker", "worker", "--num-engines", str(engines),
                                     "--speedup-ratio", "0", "--block-size", "16"))  # fmt: skip
        self.wait_serving(self.start("kvmesh-router", "router", "--router-mode", "kv"))
        return self.wait_serving(self.start("kvmesh-frontend", "frontend"))

    def logs(self) -> str:
        return "\n".join(f"--- {d.name}:{d.port}\n{d.log_text()[-3000:]}" for d in self.daemons)

    def close(self) -> None:
        for daemon in reversed(self.daemons):
            daemon.close()
        self.daemons.clear()
