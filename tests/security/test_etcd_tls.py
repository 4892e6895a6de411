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

    def __init__(self, data_dir: Path, pki: Path, server_pki: Path | None = None) -> None:
        super().__init__(data_dir)
        self.pki = pki  # the CA clients' certificates come from
        self.server_pki = server_pki or pki  # where etcd's own certificate comes from ("its own CA")

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
             "--cert-file", str(self.server_pki / "etcd.crt"), "--key-file", str(self.server_pki / "etcd.key")]),
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def _wait_healthy(self, timeout: float) -> None:
        context = ssl.create_default_context(cafile=str(self.server_pki / "ca.crt"))
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


def test_the_operator_cli_reaches_an_etcd_with_its_own_ca(pki: Path, tmp_path: Path) -> None:
    """The daemons took --etcd-ca; the operator's commands had no way to trust an etcd whose certificate
    another CA issued, and read KVMESH_ETCD_TLS=yes (which the daemons take) as off."""
    etcd_ca = pki.parent / "other"  # etcd's certificate from another CA; it trusts the mesh's clients
    with TlsEtcd(tmp_path / "etcd", pki, server_pki=etcd_ca) as server:
        argv = ["status", "--discovery", server.url, *tls_args(pki, "operator")]
        env = {"KVMESH_ETCD_TLS": "yes"}
        result = run_cli("kvmesh", *argv, "--etcd-ca", str(etcd_ca / "ca.crt"), env=env, timeout=60)
        assert result.returncode == 0, result.stderr
        result = run_cli("kvmesh", *argv, env={**env, "KVMESH_ETCD_CA": str(etcd_ca / "ca.crt")}, timeout=60)
        assert result.returncode == 0, result.stderr
        result = run_cli("kvmesh", *argv, env=env, timeout=60)  # the mesh CA does not vouch for etcd
        assert result.returncode != 0
