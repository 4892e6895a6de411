"""mTLS between daemons, on real daemons and real TLS: no certificate, a foreign CA or plaintext is
refused at the handshake; a mesh certificate of the wrong role is refused by the role policy
(``kvmesh.identity``); binds default to loopback; half a TLS configuration exits 2 with one line.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvmesh.v1 import planner_pb2, planner_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh_cli import certs as certs_cli

from tests.security.tlsmesh import TlsMesh, channel, credentials, health
from tests.support.daemons import Daemon, run_cli
from tests.support.etcd import free_port

pytestmark = pytest.mark.e2e
SERVING = 1


@pytest.fixture(scope="module")
def mesh(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsMesh]:
    root = tmp_path_factory.mktemp("mtls")
    deployment = TlsMesh(root, f"file://{root / 'discovery'}", f"m{uuid.uuid4().hex[:8]}", certs=pki)
    try:
        deployment.standard()
        yield deployment
    finally:
        deployment.close()


def _daemon(mesh: TlsMesh, name: str) -> Daemon:
    return next(d for d in mesh.daemons if d.name == name)


@pytest.mark.parametrize("daemon", ["kvmesh-worker", "kvmesh-router"])
def test_a_client_without_a_mesh_certificate_is_refused(mesh: TlsMesh, pki: Path, daemon: str) -> None:
    address = _daemon(mesh, daemon).address
    assert health(address, pki, "operator") == SERVING  # the mesh certificate works
    assert health(address, pki, role=None) is None  # TLS, but no client certificate
    assert health(address, None) is None  # plaintext
    assert health(address, pki.parent / "other", "operator") is None  # a certificate from another CA


def test_a_client_that_checks_the_server_refuses_an_impostor(mesh: TlsMesh, pki: Path) -> None:
    """Role pinning: dialling a worker's address as if it were a router fails the handshake."""
    address = _daemon(mesh, "kvmesh-worker").address
    options = [("grpc.ssl_target_name_override", "router.kvmesh")]
    with grpc.secure_channel(address, credentials(pki), options=options) as ch, pytest.raises(grpc.RpcError) as err:
        worker_pb2_grpc.WorkerServiceStub(ch).GetModelCard(worker_pb2.GetModelCardRequest(), timeout=3)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_role_policy_refuses_mesh_certificates_of_other_roles(mesh: TlsMesh, pki: Path) -> None:
    worker, router = _daemon(mesh, "kvmesh-worker").address, _daemon(mesh, "kvmesh-router").address
    with channel(worker, pki, "client") as ch:  # a KServe client certificate is no daemon
        with pytest.raises(grpc.RpcError) as err:
            worker_pb2_grpc.WorkerServiceStub(ch).GetModelCard(worker_pb2.GetModelCardRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with channel(router, pki, "frontend") as ch:  # a frontend may not pose as a router replica
        call = router_pb2_grpc.RouterServiceStub(ch).ReplicaSync(iter([router_pb2.ReplicaSyncRequest()]), timeout=5)
        with pytest.raises(grpc.RpcError) as err:
            next(iter(call))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with channel(router, pki, "worker") as ch:  # a worker may not open a routing session
        call = router_pb2_grpc.RouterServiceStub(ch).Session(iter([router_pb2.SessionRequest()]), timeout=5)
        with pytest.raises(grpc.RpcError) as err:
            next(iter(call))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with channel(router, pki, "operator") as ch:  # the operator may dump the index
        router_pb2_grpc.RouterServiceStub(ch).DumpIndex(router_pb2.DumpIndexRequest(), timeout=5)


def test_the_planner_observes_the_engines_over_mtls(mesh: TlsMesh, pki: Path) -> None:
    """The planner watches each worker's load (``WatchLoad``) and asks a router replica for its bookings
    with its own mesh certificate: over plaintext, or without the planner role in the policy, every engine
    was invisible to it (no load, so not counted as ready: it saw an empty fleet)."""
    planner = mesh.wait_serving(mesh.start("kvmesh-planner", "planner", "--connector", "virtual", "--interval", "0.2"))
    try:
        with channel(planner.address, pki) as ch:
            stub = planner_pb2_grpc.PlannerServiceStub(ch)
            deadline = time.monotonic() + 15
            ready = 0.0
            while time.monotonic() < deadline and ready < 2:
                latest = stub.GetStatus(planner_pb2.GetStatusRequest(), timeout=5).latest
                ready = latest.inputs.get("aggregated.ready", 0.0)
                time.sleep(0.1)
        assert ready == 2, planner.log_text()[-3000:]  # the standard mesh's worker serves 2 engines
        assert "PERMISSION_DENIED" not in planner.log_text()
    finally:
        planner.close()
        mesh.daemons.remove(planner)


def test_a_router_that_cannot_complete_the_handshake_says_why_it_does_not_route(pki: Path, tmp_path: Path) -> None:
    """A router whose CA does not trust the worker's certificate cannot prove the worker's identity. gRPC
    reports that as UNAVAILABLE, like a worker that is down; the router's warning carries gRPC's reason,
    the failed certificate check, which is what the operator has to fix."""
    url, namespace = f"file://{tmp_path / 'discovery'}", f"m{uuid.uuid4().hex[:8]}"
    ours = TlsMesh(tmp_path, url, namespace, certs=pki)
    foreign = TlsMesh(tmp_path, url, namespace, certs=pki.parent / "other")
    try:
        worker = ours.wait_serving(ours.start("kvmesh-worker", "worker", "--num-engines", "1", "--speedup-ratio", "0"))
        router = foreign.wait_serving(foreign.start("kvmesh-router", "router", "--router-mode", "kv"))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "not routable" not in router.log_text():
            time.sleep(0.1)
        lines = [line for line in router.log_text().splitlines() if "not routable" in line]
        assert lines, router.log_text()[-3000:]
        assert f":{worker.port}: no worker certificate answered (UNAVAILABLE: " in lines[0]
        assert "CERTIFICATE_VERIFY_FAILED" in lines[0]
    finally:
        foreign.close()
        ours.close()


def test_a_frontend_is_not_ready_while_its_router_fails_the_handshake(pki: Path, tmp_path: Path) -> None:
    """A router restarted with another role's certificate stays in discovery, and every request through it
    would fail UNAVAILABLE at the handshake: the frontend's health stays NOT_SERVING (a load balancer
    sends it nothing) until a replica it can verify comes."""
    mesh = TlsMesh(tmp_path, f"file://{tmp_path / 'discovery'}", f"m{uuid.uuid4().hex[:8]}", certs=pki)
    try:
        mesh.wait_serving(mesh.start("kvmesh-worker", "worker", "--num-engines", "1", "--speedup-ratio", "0"))
        mesh.wait_serving(mesh.start("kvmesh-router", "worker"))  # the worker's certificate: no router identity
        frontend = mesh.start("kvmesh-frontend", "frontend")
        frontend.wait_log("router replica .* appeared", 30)
        frontend.wait_log("tokenizer loaded", 30)  # the model is ready: only the router keeps it NOT_SERVING
        seen = set()
        for _ in range(30):  # 3 s: no flapping to SERVING on a handshake that keeps failing
            seen.add(health(frontend.address, pki))
            time.sleep(0.1)
        assert seen == {health_pb2.HealthCheckResponse.NOT_SERVING}, mesh.logs()
        mesh.wait_serving(mesh.start("kvmesh-router", "router"))
        mesh.wait_serving(frontend)
    finally:
        mesh.close()


def _listening_hosts(port: int) -> set[str]:
    """Local addresses listening on ``port`` (from /proc/net/tcp{,6}: no tool needed)."""
    hosts = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, port_hex = local.rsplit(":", 1)
            if state == "0A" and int(port_hex, 16) == port:
                hosts.add(addr)
    return hosts


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::ffff:127.0.0.1


def test_every_daemon_binds_loopback_by_default(mesh: TlsMesh) -> None:
    for daemon in mesh.daemons:
        assert _listening_hosts(daemon.port) <= LOOPBACK and _listening_hosts(daemon.port), daemon.name


def test_bind_host_moves_grpc_and_metrics(tmp_path: Path) -> None:
    plain = TlsMesh(tmp_path, f"file://{tmp_path / 'discovery'}", "bind", certs=None)
    metrics = free_port()
    try:
        worker = plain.start("kvmesh-worker", "worker", "--metrics-port", str(metrics))
        plain.wait_serving(worker)
        assert _listening_hosts(metrics) == {"0100007F"}
        other = plain.start("kvmesh-worker", "worker", "--bind-host", "0.0.0.0", "--metrics-port", str(free_port()))
        plain.wait_serving(other)
        assert _listening_hosts(other.port) & {"00000000", "00000000000000000000000000000000"}
    finally:
        plain.close()


def test_half_a_tls_configuration_exits_2_with_one_line(pki: Path, tmp_path: Path) -> None:
    for name in ("kvmesh-worker", "kvmesh-router", "kvmesh-frontend"):
        result = run_cli(name, "--discovery", f"file://{tmp_path}/d", "--tls-cert", str(pki / "worker.crt"))
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1 and "--tls-key" in result.stderr, result.stderr
    result = run_cli("kvmesh-worker", "--discovery", f"file://{tmp_path}/d", "--tls-cert", "/nonexistent",
                     "--tls-key", str(pki / "worker.key"), "--tls-ca", str(pki / "ca.crt"))  # fmt: skip
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "/nonexistent" in result.stderr


def test_certs_init_makes_private_keys_and_verifiable_certificates(pki: Path) -> None:
    assert pki.stat().st_mode & 0o777 == 0o700
    for role in certs_cli.ROLES:
        assert (pki / f"{role}.key").stat().st_mode & 0o777 == 0o600
        verify = subprocess.run(["openssl", "verify", "-CAfile", str(pki / "ca.crt"), str(pki / f"{role}.crt")],
                                capture_output=True, text=True)  # fmt: skip
        assert verify.returncode == 0, verify.stdout + verify.stderr
        sans = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(pki / f"{role}.crt")],
                              capture_output=True, text=True).stdout  # fmt: skip
        assert f"URI:spiffe://kvmesh/{role}/" in sans and f"DNS:{role}.kvmesh" in sans
        assert "IP Address:127.0.0.1" in sans


@pytest.mark.parametrize("role", certs_cli.ROLES)
def test_only_the_roles_that_serve_have_certificates_that_can_serve(pki: Path, role: str) -> None:
    """A KServe client's or an operator's certificate travels further than a daemon's: whoever holds
    one must not be able to answer as a server, e.g. as the frontend at ``localhost`` to another client."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = grpc_health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    key_pair = ((pki / f"{role}.key").read_bytes(), (pki / f"{role}.crt").read_bytes())
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([key_pair]))
    server.start()
    try:
        client = grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes())
        with grpc.secure_channel(f"localhost:{port}", client) as ch:
            check = health_pb2_grpc.HealthStub(ch).Check
            if role in certs_cli.CLIENT_ONLY_ROLES:
                with pytest.raises(grpc.RpcError) as err:
                    check(health_pb2.HealthCheckRequest(), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # refused in the handshake
            else:
                assert check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING
    finally:
        server.stop(0)
