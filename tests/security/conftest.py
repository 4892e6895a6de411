"""A throwaway mesh PKI per test module (``kvmesh certs init``), shared by the TLS tests here and in ``kserve/``."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvmesh_cli import certs as certs_cli


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The mesh CA and certificates; ``pki.parent / "other"`` holds a CA the mesh does not trust."""
    base = tmp_path_factory.mktemp("pki")
    certs_cli.init(base / "certs")
    certs_cli.init(base / "other")  # a CA the mesh does not trust
    return base / "certs"
