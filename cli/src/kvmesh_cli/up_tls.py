"""``kvmesh up --tls [DIR]``: the local mesh with mTLS between every daemon and TLS on the KServe port.

Kept apart from ``up.py`` so the flag is one line there. Without DIR, development certificates
(``kvmesh certs init``) are made in a private directory removed when the run ends; with DIR, that
directory's are used.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import grpc

from kvmesh_cli import certs


def add_tls_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tls",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="mTLS between daemons and TLS for KServe clients; certificates from DIR (default: made fresh)",
    )


def tls_dir_missing(tls_dir: Path) -> str | None:
    """What a certificate directory given to ``--tls`` lacks (the CA and every daemon's pair), or None."""
    if not tls_dir.is_dir():
        return "not a directory"
    needed = [
        "ca.crt",
        *(f"{role}.{ext}" for role in ("frontend", "router", "worker", "planner") for ext in ("crt", "key")),
    ]
    absent = [name for name in needed if not (tls_dir / name).is_file()]
    return f"no {', '.join(absent)} in it" if absent else None


def prepare_tls(args: argparse.Namespace) -> tuple[Path | None, bool]:
    """The certificate directory, and whether it was made for this run (then the caller removes it).

    Made ones go to a private directory of their own, not the log directory (kept after a failed run,
    and shared to report it), and the CA's key is deleted at once: nothing is signed after start-up.
    """
    if args.tls is None:
        return None, False
    if args.tls:
        return Path(args.tls), False
    out = Path(tempfile.mkdtemp(prefix="kvmesh-up-tls-"))
    certs.init(out)
    (out / "ca.key").unlink()
    return out, True


def daemon_tls_args(tls_dir: Path | None, role: str) -> list[str]:
    if tls_dir is None:
        return []
    return [
        *("--tls-cert", str(tls_dir / f"{role}.crt")),
        *("--tls-key", str(tls_dir / f"{role}.key")),
        *("--tls-ca", str(tls_dir / "ca.crt")),
    ]


def kserve_credentials(tls_dir: Path | None) -> grpc.ChannelCredentials | None:
    """What a KServe client needs: the mesh CA (the frontend's port asks no client certificate by default)."""
    if tls_dir is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=(tls_dir / "ca.crt").read_bytes())
