"""The flags every command that calls a mesh shares (``kvmesh status``, ``drain``, ``router dump``,
``planner status``, ``model files``): where the fleet is (``--discovery``, ``--namespace``, or
``KVMESH_DISCOVERY`` / ``KVMESH_NAMESPACE``) and how to reach it. With ``--tls-cert/--tls-key/--tls-ca``
(or ``KVMESH_TLS_*``) every channel the command opens through ``kvmesh.channels`` speaks mTLS with that
certificate (an operator's: the role ``kvmesh.identity`` lets drain and read), and ``--etcd-tls`` opens
etcd with it too. Without them the command speaks plaintext, as to a mesh without TLS."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

__all__ = ["add_mesh_flags", "configure_tls"]


def add_mesh_flags(p: argparse.ArgumentParser, namespace: str = "kvmesh") -> None:
    """``namespace``: the default where ``KVMESH_NAMESPACE`` is unset (the daemons' ``kvmesh``; a command
    meant for ``kvmesh up``'s mesh gives ``kvmesh-local``)."""
    env = os.environ.get
    p.add_argument(
        "--discovery",
        default=env("KVMESH_DISCOVERY"),
        help="discovery URL (default: KVMESH_DISCOVERY, else the per-user file backend)",
    )
    p.add_argument(
        "--namespace",
        default=env("KVMESH_NAMESPACE", namespace),
        help=f"discovery namespace (default: KVMESH_NAMESPACE, else {namespace})",
    )
    p.add_argument("--tls-cert", default=env("KVMESH_TLS_CERT", ""), help="operator certificate (env KVMESH_TLS_CERT)")
    p.add_argument("--tls-key", default=env("KVMESH_TLS_KEY", ""), help="its key (env KVMESH_TLS_KEY)")
    p.add_argument("--tls-ca", default=env("KVMESH_TLS_CA", ""), help="mesh CA (env KVMESH_TLS_CA)")
    p.add_argument(
        "--etcd-tls",
        action="store_true",
        default=env("KVMESH_ETCD_TLS", "").strip().lower() in _TRUE,
        help="mTLS to etcd (env KVMESH_ETCD_TLS)",
    )
    p.add_argument(
        "--etcd-ca", default=env("KVMESH_ETCD_CA", ""), help="etcd's CA, if not the mesh CA (env KVMESH_ETCD_CA)"
    )


_TRUE = frozenset({"1", "true", "t", "yes", "y", "on"})  # what the daemons' settings read as true


def configure_tls(args: argparse.Namespace) -> str | None:
    """Make this process's channels (and etcd's, with ``--etcd-tls``) mTLS; a one-line error, or None."""
    from kvmesh import tls

    given = [args.tls_cert, args.tls_key, args.tls_ca]
    if not any(given):
        return None
    if not all(given):
        return "TLS needs --tls-cert, --tls-key and --tls-ca together"
    from kvmesh.settings import check_pem

    try:  # as a daemon checks its own: else gRPC logs a screen of C-core lines and every call fails UNAVAILABLE
        check_pem(args.tls_cert, args.tls_key, args.tls_ca, args.etcd_ca)
        material = tls.load(*given)
        etcd_ca = Path(args.etcd_ca).read_bytes() if args.etcd_ca else material.ca
    except ValueError as exc:
        return str(exc)
    except OSError as exc:
        return f"cannot read {exc.filename}: {exc.strerror}"
    tls.configure_client(material)
    if args.etcd_tls:
        tls.configure_etcd(tls.TlsMaterial(material.cert, material.key, etcd_ca))
    return None


def missing_discovery_directory(url: str) -> str | None:
    """The one-line problem with a ``file://`` discovery URL whose directory does not exist, else None.

    Opening it would create it: a typo would read as an empty mesh and leave a directory behind."""
    if url.startswith("file://") and not os.path.isdir(url.removeprefix("file://").split("?", 1)[0]):
        return f"--discovery {url}: no such directory: no daemon on this machine uses it"
    return None
