"""etcd over mTLS (aetcd has no TLS: ``kvmesh.discovery.etcd.TlsClient``) against a real etcd started
with ``--client-cert-auth``: the mesh's certificate works, no certificate is refused, and a daemon with
``--etcd-tls`` serves while one without exits 2 with one line."""

from __future__ import annotations

import contextlib
import json
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvmesh import tls
from kvmesh.children import dies_with_parent
from kvmesh.discovery import DiscoveryUnavailable, open_discovery

from tests.security.tlsmesh import TlsMesh, tls_args
from tests.support.daemons import run_cli
from tests.support.etcd import ETCD_BIN, EtcdServer, etcd_available

pytestmark = [pytest.mark.etcd, pytest.mark.skipif(not etcd_available(), reason="etcd not installed")]


class TlsEtcd(EtcdServer):
    """``EtcdServer`` with https client URLs and ``--client-cert-auth`` (certificates from ``kvmesh certs init``)."""

    def __init__(self, data_dir: Path, pki: Path) -> None:
        super().__init__(data_dir)
        self.pki = pki

    def _spawn(self) -> None:
        client, peer = f"https://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in _reap
        self.proc = subprocess.Popen(
            dies_with_parent([ETCD_BIN, "--name", self.name, "--data-dir", str(self.data_dir),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"{self.name}={peer}", "--initial-cluster-state", "new",
             "--heartbeat-interval", "10", "--election-timeout", "100", "--logger", "zap", "--log-level", "warn",
             "--client-cert-auth", "--trusted-ca-file", str(self.pki / "ca.crt"),
             "--cert-file", str(self.pki / "etcd.crt"), "--key-file", str(self.pki / "etcd.key")]),
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def _wait_healthy(self, timeout: float) -> None:
        context = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        context.load_cert_chain(self.pki / "operator.crt", self.pki / "operator.key")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited: {self.log_text()[-2000:]}")
            with contextlib.suppress(OSError, ValueError):
                url = f"https://127.0.0.1:{self.client_port}/health"
                with urllib.request.urlopen(url, timeout=0.5, context=context) as reply:
                    if json.load(reply).get("health") == "true":
                        return
            time.sleep(0.05)
        raise RuntimeError(f"etcd not healthy within {timeout}s: {self.log_text()[-2000:]}")


@pytest.fixture(scope="module")
def etcd(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsEtcd]:
    with TlsEtcd(tmp_path_factory.mktemp("etcd-tls"), pki) as server:
        yield server


@pytest.fixture
def etcd_identity(pki: Path) -> Iterator[None]:
    tls.configure_etcd(tls.load(pki / "worker.crt", pki / "worker.key", pki / "ca.crt"))
    yield
    tls.configure_etcd(None)


async def test_the_mesh_certificate_opens_etcd(etcd: TlsEtcd, etcd_identity: None) -> None:
    discovery = await open_discovery(etcd.url, ttl=2)
    try:
        lease = await discovery.grant_lease()
        await lease.put("v1/test/key", b"value")
        assert await discovery.get_prefix("v1/test/") == {"v1/test/key": b"value"}
        await lease.revoke()
        assert await discovery.get_prefix("v1/test/") == {}
    finally:
        await discovery.close()


async def test_no_certificate_is_refused(etcd: TlsEtcd) -> None:
    with pytest.raises(DiscoveryUnavailable):
        await open_discovery(etcd.url, ttl=2, connect_timeout=2)


def test_a_daemon_with_etcd_tls_serves_and_one_without_exits(etcd: TlsEtcd, pki: Path, tmp_path: Path) -> None:
    mesh = TlsMesh(tmp_path, etcd.url, "etcdtls", certs=pki)
    try:
        mesh.wait_serving(mesh.start("kvmesh-worker", "worker", "--etcd-tls"))
    finally:
        mesh.close()
    # plain gRPC to a TLS etcd reads as an etcd that does not answer: 69, one line (a unit retries it)
    result = run_cli("kvmesh-worker", "--discovery", etcd.url, *tls_args(pki, "worker"), timeout=60)
    assert result.returncode == 69 and result.stderr.count("\n") == 1, result.stderr
    result = run_cli("kvmesh-worker", "--discovery", etcd.url, "--etcd-tls")
    assert result.returncode == 2 and "--etcd-tls needs" in result.stderr, result.stderr
