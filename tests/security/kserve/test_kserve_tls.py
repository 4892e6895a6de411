"""KServe clients over TLS with stock tritonclient (``ssl=True``): server TLS, optional client
certificates (``--kserve-client-cert``) and bearer tokens (``--kserve-token-file``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.security.kserve.test_rogue_engine import send_requests
from tests.security.tlsmesh import TlsMesh

pytestmark = pytest.mark.e2e
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def frontends(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    root = tmp_path_factory.mktemp("kserve-tls")
    token_file = root / "token"
    token_file.write_text(TOKEN + "\n")
    mesh = TlsMesh(root, f"file://{root / 'discovery'}", f"k{uuid.uuid4().hex[:8]}", certs=pki)
    try:
        mesh.wait_serving(mesh.start("kvmesh-worker", "worker", "--speedup-ratio", "0"))
        mesh.wait_serving(mesh.start("kvmesh-router", "router"))
        plain_tls = mesh.wait_serving(mesh.start("kvmesh-frontend", "frontend"))
        mutual = mesh.wait_serving(mesh.start("kvmesh-frontend", "frontend", "--kserve-client-cert"))
        token = mesh.wait_serving(mesh.start("kvmesh-frontend", "frontend", "--kserve-token-file", str(token_file)))
        # Health says SERVING as soon as the port is up; a frontend is ready once it has found the
        # router and loaded the engine's model, which on a loaded machine takes a while longer.
        _wait_ready(_client(plain_tls.address, pki))
        _wait_ready(_client(mutual.address, pki, cert="client"))
        _wait_ready(_client(token.address, pki), headers={"authorization": f"Bearer {TOKEN}"})
        yield {"tls": plain_tls.address, "mtls": mutual.address, "token": token.address}
    finally:
        mesh.close()


def _client(address: str, pki: Path, cert: str | None = None) -> grpcclient.InferenceServerClient:
    extra = (
        {} if cert is None else {"private_key": str(pki / f"{cert}.key"), "certificate_chain": str(pki / f"{cert}.crt")}
    )
    return grpcclient.InferenceServerClient(
        address.replace("127.0.0.1", "localhost"), ssl=True, root_certificates=str(pki / "ca.crt"), **extra
    )


def _wait_ready(client: grpcclient.InferenceServerClient, headers: dict[str, str] | None = None) -> None:
    with client:
        deadline = time.monotonic() + 30
        while not client.is_server_ready(headers=headers, client_timeout=5):
            assert time.monotonic() < deadline, "the frontend did not become ready in 30 s"
            time.sleep(0.1)


def test_stock_tritonclient_streams_over_tls(frontends: dict[str, str], pki: Path) -> None:
    done, errors = send_requests(frontends["tls"], pki, n=3)
    assert (done, errors) == (3, [])


def test_plaintext_kserve_clients_are_refused_when_tls_is_on(frontends: dict[str, str]) -> None:
    with grpcclient.InferenceServerClient(frontends["tls"]) as client, pytest.raises(InferenceServerException):
        client.is_server_ready(client_timeout=3)


def test_kserve_client_certificates_when_required(frontends: dict[str, str], pki: Path) -> None:
    with _client(frontends["mtls"], pki, cert="client") as client:
        assert client.is_server_ready(client_timeout=5)
    with _client(frontends["mtls"], pki) as client, pytest.raises(InferenceServerException):
        client.is_server_ready(client_timeout=3)


def test_bearer_token(frontends: dict[str, str], pki: Path) -> None:
    with _client(frontends["token"], pki) as client:
        assert client.is_server_ready(headers={"authorization": f"Bearer {TOKEN}"}, client_timeout=5)
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
            with pytest.raises(InferenceServerException, match=r"UNAUTHENTICATED|bearer"):
                client.is_server_ready(headers=headers, client_timeout=5)
