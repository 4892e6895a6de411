"""Mesh TLS: one CA, one certificate per daemon naming its role, mutual authentication everywhere.

Security invariants (see docs/security.md):
- With ``--tls-cert/--tls-key/--tls-ca`` set, every gRPC server of the mesh listens with TLS and
  **requires** a client certificate that chains to the mesh CA (the frontend's KServe port is the
  one exception: client certificates there are optional, see ``--kserve-client-cert``).
- A certificate's role is the path of its SPIFFE URI SAN, ``spiffe://kvmesh/<role>/<name>``, and the
  DNS SAN ``<role>.kvmesh``. Only the mesh CA issues them, so a role is a claim the CA made.
- A client that dials a peer of a known role (a worker, a router) verifies the server certificate
  against ``<role>.kvmesh`` instead of the dialled host (``grpc.ssl_target_name_override``): the
  handshake succeeds only with a mesh certificate *of that role*. This is what binds a discovery
  record to an identity: whoever registered an address, only a process holding a worker
  certificate can answer on it, so a rogue process that copied a model card gets no request.
- Client TLS material is process-wide (one daemon = one identity): ``configure_client`` is called
  once by ``DaemonRuntime`` and every ``ChannelPool`` uses it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

__all__ = [
    "ROLES",
    "TlsMaterial",
    "channel_credentials",
    "client_material",
    "configure_client",
    "configure_etcd",
    "etcd_material",
    "load",
    "peer_role",
    "role_dns",
    "server_credentials",
    "spiffe_id",
    "target_options",
]

SPIFFE_PREFIX = "spiffe://kvmesh/"
ROLES = ("frontend", "router", "worker", "planner", "operator", "client")


def spiffe_id(role: str, name: str) -> str:
    return f"{SPIFFE_PREFIX}{role}/{name}"


def role_dns(role: str) -> str:
    """The DNS SAN every certificate of ``role`` carries; clients pin a peer's role with it."""
    return f"{role}.kvmesh"


@dataclass(frozen=True)
class TlsMaterial:
    """PEM bytes of this process's certificate chain, private key and the mesh CA."""

    cert: bytes
    key: bytes
    ca: bytes


def load(cert: str | Path, key: str | Path, ca: str | Path) -> TlsMaterial:
    """Read the three PEM files; ``OSError`` propagates (callers turn it into a one-line exit 2)."""
    return TlsMaterial(Path(cert).read_bytes(), Path(key).read_bytes(), Path(ca).read_bytes())


def server_credentials(material: TlsMaterial, *, require_client_cert: bool = True) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
        [(material.key, material.cert)], root_certificates=material.ca, require_client_auth=require_client_cert
    )


def channel_credentials(material: TlsMaterial) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=material.ca, private_key=material.key, certificate_chain=material.cert
    )


def target_options(role: str | None) -> list[tuple[str, str]]:
    """Channel options pinning the server's role (see the module docstring); none verifies the host."""
    return [("grpc.ssl_target_name_override", role_dns(role))] if role else []


_client: TlsMaterial | None = None


def configure_client(material: TlsMaterial | None) -> None:
    """Set this process's client identity (``None``: plaintext channels)."""
    global _client
    _client = material


def client_material() -> TlsMaterial | None:
    return _client


_etcd: TlsMaterial | None = None


def configure_etcd(material: TlsMaterial | None) -> None:
    """Set the identity this process presents to etcd (``None``: plaintext etcd)."""
    global _etcd
    _etcd = material


def etcd_material() -> TlsMaterial | None:
    return _etcd


def peer_role(auth_context: Mapping[str, Iterable[bytes]]) -> str | None:
    """The role a verified peer certificate names (``spiffe://kvmesh/<role>/...``), else None."""
    for uri in [*auth_context.get("peer_spiffe_id", ()), *auth_context.get("peer_uri", ())]:
        text = uri.decode(errors="replace")
        if text.startswith(SPIFFE_PREFIX):
            role = text.removeprefix(SPIFFE_PREFIX).split("/", 1)[0]
            if role in ROLES:
                return role
    return None
