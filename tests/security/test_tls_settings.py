"""TLS files are checked when the settings load (one line naming the file, exit 2, before any port opens), and
``kvmesh certs init`` reports a directory it cannot make in one line."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from kvmesh.settings import DaemonSettings

from tests.support.daemons import run_cli


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        DaemonSettings.load("kvmesh-router", "test", argv, environ={})
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_a_matching_certificate_key_and_ca_load(pki: Path) -> None:
    settings = DaemonSettings.load(
        "kvmesh-router", "test", ["--tls-cert", str(pki / "router.crt"), "--tls-key", str(pki / "router.key"),
                                  "--tls-ca", str(pki / "ca.crt")], environ={},
    )  # fmt: skip
    assert settings.tls_enabled


def test_a_certificate_and_key_in_the_environment_give_way_to_the_pair_in_the_flags(pki: Path) -> None:
    """Each overridden value is checked alone: the environment's certificate is not paired with the flags'
    key (a pair nobody configured, refused as KEY_VALUES_MISMATCH)."""
    env = {"KVMESH_TLS_CERT": str(pki / "frontend.crt"), "KVMESH_TLS_KEY": str(pki / "frontend.key")}
    ca = str(pki / "ca.crt")
    argv = ["--tls-cert", str(pki / "router.crt"), "--tls-key", str(pki / "router.key"), "--tls-ca", ca]
    settings = DaemonSettings.load("kvmesh-router", "test", argv, environ=env)
    assert settings.tls_cert == str(pki / "router.crt")


def test_another_daemons_key_is_refused(pki: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cert, key = pki / "router.crt", pki / "worker.key"
    err = refused(["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(pki / "ca.crt")], capsys)
    assert f"--tls-cert {cert} / --tls-key {key}: not a PEM certificate and its key" in err
    assert "KEY_VALUES_MISMATCH" in err


def test_a_ca_file_that_holds_no_certificate_is_refused(pki: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ca = pki / "router.key"  # a key where the CA certificate should be
    err = refused(["--tls-cert", str(pki / "router.crt"), "--tls-key", str(pki / "router.key"), "--tls-ca", str(ca)],
                  capsys)  # fmt: skip
    assert f"--tls-ca {ca}: not a PEM CA certificate" in err


@pytest.mark.parametrize(
    ("where", "says"),
    [("{tmp}/a-file", "{tmp}/a-file: File exists"), ("{tmp}/a-file/certs", "{tmp}/a-file/certs: Not a directory")],
)
def test_certs_init_into_a_place_that_cannot_be_a_directory_is_one_line(tmp_path: Path, where: str, says: str) -> None:
    (tmp_path / "a-file").write_text("")
    result = run_cli("kvmesh", "certs", "init", where.format(tmp=tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip() == f"kvmesh certs: error: {says.format(tmp=tmp_path)}"


def test_certs_init_into_an_existing_directory_leaves_its_mode_and_keeps_the_keys_private(tmp_path: Path) -> None:
    """``kvmesh certs init .`` (or ``~``) made the user's own directory 0700."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    result = run_cli("kvmesh", "certs", "init", str(shared))
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755
    assert stat.S_IMODE((shared / "ca.key").stat().st_mode) == 0o600
    fresh = tmp_path / "fresh" / "pki"
    assert run_cli("kvmesh", "certs", "init", str(fresh)).returncode == 0
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700  # one it made is private


def test_a_private_key_given_instead_of_its_path_is_not_echoed(pki: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """KVMESH_TLS_KEY="$(cat worker.key)" printed the key to stderr, so to journald, over several lines."""
    key = (pki / "worker.key").read_text()
    err = refused(["--tls-cert", str(pki / "worker.crt"), "--tls-key", key, "--tls-ca", str(pki / "ca.crt")], capsys)
    assert "--tls-key: not a readable file (give the file's path)" in err
    assert "PRIVATE KEY" not in err and "\n" not in err.strip()


def test_certs_init_replaces_nothing_without_force_even_with_the_ca_key_kept_offline(tmp_path: Path) -> None:
    """Only ca.key was looked for: with the CA key moved offline (as it should be), a re-run silently
    issued a new CA and replaced every key in use."""
    pki = tmp_path / "pki"
    assert run_cli("kvmesh", "certs", "init", str(pki)).returncode == 0
    (pki / "ca.key").unlink()
    before = (pki / "worker.key").read_bytes()
    result = run_cli("kvmesh", "certs", "init", str(pki))
    assert result.returncode == 2 and result.stderr.strip() == (
        f"kvmesh certs: error: {pki / 'ca.crt'} exists (use --force to replace)"
    )
    assert (pki / "worker.key").read_bytes() == before
    assert run_cli("kvmesh", "certs", "init", str(pki), "--force").returncode == 0
    assert (pki / "worker.key").read_bytes() != before


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_certs_init_refuses_a_directory_another_user_may_change(tmp_path: Path) -> None:
    """Another user's (or a world-writable) directory: they could swap ca.crt for their own CA's."""
    writable = tmp_path / "writable"
    writable.mkdir()
    writable.chmod(0o777)
    result = run_cli("kvmesh", "certs", "init", str(writable))
    assert result.returncode == 2 and "is group- or world-writable (mode 777)" in result.stderr
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    result = run_cli("kvmesh", "certs", "init", str(theirs))
    assert result.returncode == 2 and "is owned by uid 65534" in result.stderr
    assert not list(writable.iterdir()) and not list(theirs.iterdir())
