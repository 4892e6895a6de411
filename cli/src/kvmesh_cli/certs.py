"""``kvmesh certs init DIR``: a development CA and one certificate per daemon role, in one command.

What it writes (directory 0700, keys 0600, EC P-256, valid ``--days``):
``ca.crt``/``ca.key`` (the mesh CA), and for each role ``frontend``, ``router``, ``worker``,
``planner``, ``operator`` (the CLI), ``client`` (a KServe client) and ``etcd`` (its server
certificate): ``<role>.crt``/``<role>.key``.
Each leaf carries the SANs the mesh checks (see ``kvmesh.tls``): the URI
``spiffe://kvmesh/<role>/<name>``, the DNS name ``<role>.kvmesh``, plus ``localhost``, this host's
name, ``IP:127.0.0.1`` and ``IP:::1`` so a local mesh dials plain loopback addresses.
The ``operator`` and ``client`` leaves are for client authentication only (no serverAuth).
For production use your own CA; the SAN layout is what matters (docs/security.md).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import ipaddress
import os
import re
import socket
import stat
import sys
from pathlib import Path

from kvmesh_bench.argtypes import positive_int

ROLES = ("frontend", "router", "worker", "planner", "operator", "client", "etcd")
# Roles that only ever dial: their leaves are for client authentication alone (no serverAuth), so a
# KServe client's or an operator's certificate, which travels further than a daemon's, cannot answer
# as a server to anyone (a client checks serverAuth in the handshake).
CLIENT_ONLY_ROLES = frozenset({"operator", "client"})


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("certs", help="development certificates for mTLS", description=__doc__)
    sub = p.add_subparsers(dest="certs_command", required=True, parser_class=type(p))
    init = sub.add_parser("init", help="make a CA and per-daemon certificates in DIR")
    init.add_argument("dir", metavar="DIR", help="output directory (created 0700)")
    init.add_argument("--days", type=positive_int, default=365, help="validity in days (default: 365)")
    init.add_argument("--name", default="dev", help="instance name in the SPIFFE URIs (default: dev)")
    init.add_argument("--san", action="append", default=[], help="extra DNS name or IP for every leaf (repeatable)")
    init.add_argument("--force", action="store_true", help="overwrite existing files")
    init.set_defaults(func=run_init)


def _bad_argument(args: argparse.Namespace) -> str | None:
    """What ``init`` would fail on half-way (after writing the CA), checked before anything is written."""
    latest = (datetime.date(9999, 12, 31) - datetime.date.today()).days
    if args.days > latest:
        return f"--days {args.days}: a certificate cannot be valid past the year 9999 (at most {latest})"
    if not re.fullmatch(r"[A-Za-z0-9._-]+", args.name):
        return f"--name {args.name!r}: use letters, digits, '.', '_' and '-' (it is a SPIFFE path segment)"
    for san in args.san:
        with contextlib.suppress(ValueError):
            ipaddress.ip_address(san)
            continue
        if not re.fullmatch(r"[A-Za-z0-9*]([A-Za-z0-9.*-]*[A-Za-z0-9])?", san):
            return f"--san {san!r}: not an IP address nor an ASCII DNS name (give an internationalized name as xn--...)"
        if san.lower().rstrip(".").endswith(".kvmesh"):  # on every leaf, it would let any of them pass as that role
            return f"--san {san!r}: names under .kvmesh are the mesh's roles, each on its own certificate only"
    return None


def run_init(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    if problem := _bad_argument(args):
        print(f"kvmesh certs: error: {problem}", file=sys.stderr)
        return 2
    if not args.force and (existing := [f for f in _files() if (out / f).exists()]):
        # not only ca.key: a CA key kept offline (as it should be, and as kvmesh up --tls leaves it) let a
        # re-run silently replace the CA and every key in use
        print(f"kvmesh certs: error: {out / existing[0]} exists (use --force to replace)", file=sys.stderr)
        return 2
    if problem := _unsafe_directory(out):
        print(f"kvmesh certs: error: {problem}", file=sys.stderr)
        return 2
    try:
        init(out, days=args.days, name=args.name, extra_sans=args.san)
    except OSError as exc:
        print(f"kvmesh certs: error: {exc.filename or out}: {exc.strerror}", file=sys.stderr)
        return 2
    print(f"kvmesh certs: CA and certificates for {', '.join(ROLES)} in {out}")
    return 0


def _files() -> list[str]:
    """What ``init`` writes."""
    return ["ca.key", "ca.crt", *(f"{role}.{ext}" for role in ROLES for ext in ("key", "crt"))]


def _unsafe_directory(out: Path) -> str | None:
    """Why another local user could change what ``init`` writes into ``out`` (an existing directory), or
    None: one they own, or may write in, could swap ca.crt for their own CA's."""
    try:
        st = out.lstat()
    except FileNotFoundError:
        return None  # made by init, 0700
    except OSError as exc:
        return f"{out}: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, os.geteuid()):
        return f"{out} is a symlink another user (uid {st.st_uid}) can re-point"
    st = out.stat() if stat.S_ISLNK(st.st_mode) else st
    if stat.S_ISDIR(st.st_mode) and st.st_uid != os.geteuid():
        return f"{out} is owned by uid {st.st_uid}, not by this user ({os.geteuid()})"
    if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o022:
        return f"{out} is group- or world-writable (mode {stat.S_IMODE(st.st_mode):o}): another user could swap ca.crt"
    return None


def init(out: Path, *, days: int = 365, name: str = "dev", extra_sans: list[str] | None = None) -> None:
    """Write the CA and one certificate per role into ``out`` (see the module docstring)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not out.is_dir():  # a directory of the user's (``.``, ``~``) keeps its mode: the keys are 0600 anyway
        out.mkdir(mode=0o700, parents=True)
        os.chmod(out, 0o700)  # whatever the umask
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def write(path: Path, data: bytes, mode: int) -> None:
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvmesh mesh CA ({name})")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # keyCertSign, cRLSign
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    write(out / "ca.key", key_pem(ca_key), 0o600)
    write(out / "ca.crt", ca.public_bytes(serialization.Encoding.PEM), 0o644)

    hosts = {"localhost", socket.gethostname(), *(extra_sans or [])}
    ips = {"127.0.0.1", "::1"}
    dns = sorted(h for h in hosts if not _is_ip(h))
    ips |= {h for h in hosts if _is_ip(h)}
    for role in ROLES:
        key = ec.generate_private_key(ec.SECP256R1())
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        if role not in CLIENT_ONLY_ROLES:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        sans: list[x509.GeneralName] = [
            x509.UniformResourceIdentifier(f"spiffe://kvmesh/{role}/{name}"),
            x509.DNSName(f"{role}.kvmesh"),
            *(x509.DNSName(h) for h in dns),
            *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in sorted(ips)),
        ]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvmesh-{role}-{name}")]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(usages),
                critical=False,
            )
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        write(out / f"{role}.key", key_pem(key), 0o600)
        write(out / f"{role}.crt", cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
