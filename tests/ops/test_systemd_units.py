"""The shipped systemd units verify (``systemd-analyze verify``, no output) and keep their contract."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "packaging" / "systemd"
CONTRACT = (
    *("Type=notify", "NotifyAccess=main", "WatchdogSec=", "Restart=on-failure", "EnvironmentFile=-/etc/kvmesh/"),
    *("NoNewPrivileges=yes", "ProtectSystem=strict", "User=kvmesh", "KillSignal=SIGTERM", "LoadCredential=tls.key:"),
)
EXPECTED = [
    *("kvmesh-frontend.service", "kvmesh-planner.service", "kvmesh-router@.service"),
    *("kvmesh-worker-decode@.service", "kvmesh-worker-prefill@.service", "kvmesh-worker@.service"),
]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_every_unit_verifies() -> None:
    result = subprocess.run([str(REPO / "scripts" / "verify-units.sh")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(EXPECTED)} units verified" in result.stdout


@pytest.mark.parametrize("name", EXPECTED)
def test_unit_contract(name: str) -> None:
    text = (UNITS / name).read_text()
    for line in CONTRACT:
        assert line in text, f"{name} lacks {line}"
    assert sorted(p.name for p in UNITS.glob("*.service")) == EXPECTED
