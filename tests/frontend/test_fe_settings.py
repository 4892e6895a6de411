"""The frontend's own settings: KServe client authentication that cannot work is refused at start (one line, exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvmesh_frontend.main import kserve_auth
from kvmesh_frontend.settings import Settings


def one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvmesh-frontend: error: "), err
    return err


def test_client_certificates_cannot_be_required_without_tls(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --tls-* the port is plaintext: no client certificate could be asked for, so none would be."""
    with pytest.raises(SystemExit) as exc:
        Settings.load("kvmesh-frontend", "test", ["--kserve-client-cert"], environ={})
    assert exc.value.code == 2
    assert "--kserve-client-cert needs --tls-cert, --tls-key and --tls-ca" in one_line_exit_2(capsys)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"\xff\xfe\x00", "--kserve-token-file: the file is not UTF-8 text"),
        (b"  \n", "--kserve-token-file: the file is empty"),
        # no client could send these in a header: every request failed INTERNAL "Invalid metadata"
        (b"line1\nline2\n", "--kserve-token-file: the token must be one line of RFC 6750 characters"),
        ("t\u00f6k\u00e9n".encode(), "--kserve-token-file: the token must be one line of RFC 6750 characters"),
        (None, "--kserve-token-file: cannot read the file (No such file or directory; give the token file's path)"),
    ],
)
def test_an_unusable_token_file_is_refused_without_echoing_the_value(
    tmp_path: Path, content: bytes | None, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The value may be the token itself, given in place of its file's path: it went to the logs."""
    token_file = tmp_path / "s3cr3t-token"
    if content is not None:
        token_file.write_bytes(content)
    settings = Settings.load("kvmesh-frontend", "test", ["--kserve-token-file", str(token_file)], environ={})
    with pytest.raises(SystemExit) as exc:
        kserve_auth(settings)
    assert exc.value.code == 2
    line = one_line_exit_2(capsys)
    assert says in line and "s3cr3t" not in line
