"""``kvmesh bench replay`` live against a frontend that speaks TLS (``kvmesh up --tls``): it could not reach
one at all ("no answer within 3 s"), so a TLS mesh could not be benchmarked."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvmesh_bench.replay import cli

from tests.security.tlsmesh import TlsMesh

pytestmark = pytest.mark.e2e
TRACE = Path(__file__).resolve().parents[2].parent / "shared/data/mooncake/conversation_trace.jsonl"


@pytest.fixture(scope="module")
def frontend(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("replay-tls")
    mesh = TlsMesh(root, f"file://{root / 'discovery'}", f"r{uuid.uuid4().hex[:8]}", certs=pki)
    try:
        yield mesh.standard().address
    finally:
        mesh.close()


@pytest.mark.skipif(not TRACE.exists(), reason="Mooncake conversation trace not present")
def test_a_live_replay_reaches_a_tls_frontend_with_its_ca(frontend: str, pki: Path, tmp_path: Path) -> None:
    out = tmp_path / "tls.json"
    argv = [str(TRACE), "--frontend", frontend, "--max-requests", "5", "--arrival-speedup", "50", "--no-progress",
            "--no-plot", "--json", str(out)]  # fmt: skip
    assert cli.main([*argv, "--tls-ca", str(pki / "ca.crt")]) == 0
    assert json.loads(out.read_text())["summary"]["completed"] == 5
    assert cli.main(argv) == 2  # plaintext to a TLS port: refused before anything is sent


def test_tls_flags_are_checked_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "not-pem"
    key.write_text("hello")
    with pytest.raises(SystemExit) as exit_:
        cli.main([str(TRACE), "--frontend", "localhost:1", "--tls-ca", str(key)])
    assert exit_.value.code == 2 and "no PEM block" in capsys.readouterr().err
