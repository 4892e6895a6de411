"""``kvmesh status``, ``router dump``, ``drain``, ``planner status`` and ``model files`` against a real mesh
with mTLS: only an operator certificate may drain; a drained worker deregisters and exits 0."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvmesh.discovery import instance_key, open_discovery
from kvmesh.v1 import discovery_pb2
from kvmesh_cli import certs as certs_cli

from tests.security.tlsmesh import TlsMesh, tls_args
from tests.support.daemons import run_cli
from tests.support.faulty_etcd import FaultyEtcd

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pki") / "certs"
    certs_cli.init(out)
    return out


@pytest.fixture
def mesh(pki: Path, tmp_path: Path) -> Iterator[TlsMesh]:
    deployment = TlsMesh(tmp_path, f"file://{tmp_path / 'discovery'}", f"o{uuid.uuid4().hex[:8]}", certs=pki)
    try:
        deployment.standard(engines=2)
        yield deployment
    finally:
        deployment.close()


def kvmesh(mesh: TlsMesh, *args: str, role: str = "operator") -> tuple[int, str, str]:
    assert mesh.certs is not None
    common = ["--discovery", mesh.url, "--namespace", mesh.namespace, *tls_args(mesh.certs, role)]
    result = run_cli("kvmesh", *args, *common, timeout=90)
    return result.returncode, result.stdout, result.stderr


def test_status_and_router_dump(mesh: TlsMesh) -> None:
    rc, out, err = kvmesh(mesh, "status", "--json")
    assert rc == 0, err
    rows = json.loads(out)
    components = sorted(row["component"] for row in rows)
    assert components.count("worker/engine") == 2 and "router/router" in components, components
    engines = [row for row in rows if row["component"] == "worker/engine"]
    assert all(row["model"] == "kvmesh-mock" and row["active_requests"] is not None for row in engines), engines
    rc, out, err = kvmesh(mesh, "status")
    assert rc == 0 and "worker/engine" in out, err
    rc, out, err = kvmesh(mesh, "router", "dump")
    assert rc == 0, err
    assert len(json.loads(out)["engines"]) == 2


def test_drain_needs_an_operator_certificate_then_deregisters_and_exits_0(mesh: TlsMesh) -> None:
    rc, out, _ = kvmesh(mesh, "status", "--json")
    engine = next(row for row in json.loads(out) if row["component"] == "worker/engine")
    rc, _, err = kvmesh(mesh, "drain", engine["id"], role="frontend")
    assert rc == 2 and "PERMISSION_DENIED" in err, err
    rc, out, err = kvmesh(mesh, "drain", engine["id"])
    assert rc == 0 and "deregistered" in out, out + err
    worker = next(d for d in mesh.daemons if d.name == "kvmesh-worker")
    assert worker.wait(15) == 0
    rc, out, _ = kvmesh(mesh, "status", "--json")
    assert not [row for row in json.loads(out) if row["component"] == "worker/engine"]


def test_planner_status_and_model_files_speak_mtls_with_an_operator_certificate(mesh: TlsMesh, tmp_path: Path) -> None:
    planner = mesh.wait_serving(mesh.start("kvmesh-planner", "planner", "--connector", "virtual", "--interval", "0.2"))
    rc, out, err = kvmesh(mesh, "planner", "status", "--json")
    assert rc == 0, err
    (reply,) = json.loads(out)
    assert reply["address"] == planner.address and reply["leader"] and reply["connector"] == "virtual"
    rc, out, err = kvmesh(mesh, "model", "files", "kvmesh-mock", "--out", str(tmp_path / "files"))
    assert rc == 0, err
    assert (tmp_path / "files" / "tokenizer.json").is_file()
    plaintext = run_cli("kvmesh", "planner", "status", "--discovery", mesh.url, "--namespace", mesh.namespace)
    assert plaintext.returncode == 2 and plaintext.stderr.count("\n") == 1, plaintext.stderr
    assert plaintext.stderr.startswith(f"kvmesh planner status: error: planner {planner.address}: UNAVAILABLE")


def test_operator_cli_refuses_half_a_tls_config(tmp_path: Path) -> None:
    for command in (["status"], ["planner", "status"], ["model", "files", "m", "--out", str(tmp_path / "o")]):
        result = run_cli("kvmesh", *command, "--discovery", f"file://{tmp_path}/d", "--tls-cert", "x")
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.endswith("error: TLS needs --tls-cert, --tls-key and --tls-ca together\n")


def test_operator_cli_refuses_a_key_that_is_not_its_certificates(pki: Path, tmp_path: Path) -> None:
    """Checked as a daemon checks its own: the CLI printed a screen of gRPC lines, then exited 0."""
    key = str(pki / "worker.key")
    tls = ["--tls-cert", str(pki / "operator.crt"), "--tls-key", key, "--tls-ca", str(pki / "ca.crt")]
    result = run_cli("kvmesh", "status", "--discovery", f"file://{tmp_path}/d", *tls)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "not a PEM certificate and its key" in result.stderr


@pytest.mark.parametrize(
    ("command", "prog"),
    [
        (["status"], "kvmesh"),
        (["planner", "status"], "kvmesh planner status"),
        (["model", "files", "m"], "kvmesh model files"),
    ],
)
def test_a_file_discovery_directory_that_does_not_exist_is_an_error_not_an_empty_fleet(
    tmp_path: Path, command: list[str], prog: str
) -> None:
    """A typo in the path must not read as 'no daemon registered' (or 'no planner', 'no model'), nor leave
    a directory behind: planner status and model files opened it, which made it."""
    out = ["--out", str(tmp_path / "o")] if command[0] == "model" else []
    result = run_cli("kvmesh", *command, *out, "--discovery", f"file://{tmp_path}/typo")
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"{prog}: error: --discovery file://{tmp_path}/typo: no such directory: no daemon on this machine uses it"
    )
    assert not (tmp_path / "typo").exists() and not (tmp_path / "o").exists()


def test_a_discovery_listing_that_fails_after_connecting_is_one_line() -> None:
    """etcd answered the connect probe, then refused the listing (a response over the client's limit): kvmesh
    status printed a traceback instead of what it prints when the connection itself fails."""
    with FaultyEtcd() as etcd:
        result = run_cli("kvmesh", "status", "--discovery", etcd.url, "--timeout", "3")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"kvmesh: error: --discovery {etcd.url}: etcd get_prefix failed: grpc: received message larger than max"
    ]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--san", "ü.example"], "--san 'ü.example': not an IP address nor an ASCII DNS name"),
        (["--days", "3000000"], "--days 3000000: a certificate cannot be valid past the year 9999"),
        (["--name", "a/b"], "--name 'a/b': use letters, digits, '.', '_' and '-'"),
        # On every leaf, the client certificate included, it let any of them pass for that role.
        (["--san", "router.kvmesh"], "--san 'router.kvmesh': names under .kvmesh are the mesh's roles"),
    ],
)
def test_certs_init_checks_its_arguments_before_it_writes_anything(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    """These failed half-way, with a traceback, after the CA was written (a rerun then said ca.key exists)."""
    result = run_cli("kvmesh", "certs", "init", str(tmp_path / "certs"), *flags)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"kvmesh certs: error: {message}")
    assert not (tmp_path / "certs").exists()


async def test_a_stale_record_of_a_dead_replica_does_not_hide_the_live_ones(mesh: TlsMesh) -> None:
    """A replica killed keeps its record for up to a lease TTL: router dump asked only the first router (by
    address), and planner status gave up on the first planner that did not answer, the leader's reply too."""
    planner = mesh.wait_serving(mesh.start("kvmesh-planner", "planner", "--connector", "virtual"))
    discovery = await open_discovery(mesh.url, ttl=30)
    try:
        lease = await discovery.grant_lease()
        for component in ("router", "planner"):  # at 127.0.0.1:1, first by address, where nothing listens
            record = discovery_pb2.InstanceRecord(
                namespace=mesh.namespace, component=component, endpoint=component, instance_id=1, address="127.0.0.1:1"
            )
            await lease.put(instance_key(mesh.namespace, component, component, 1), record.SerializeToString())
        rc, out, err = await asyncio.to_thread(kvmesh, mesh, "router", "dump")
        assert rc == 0, err
        assert len(json.loads(out)["engines"]) == 2
        rc, out, err = await asyncio.to_thread(kvmesh, mesh, "planner", "status", "--json")
        assert rc == 0 and [reply["address"] for reply in json.loads(out)] == [planner.address], err
        assert err.startswith("kvmesh planner status: warning: planner 127.0.0.1:1: UNAVAILABLE"), err
    finally:
        await discovery.close()
