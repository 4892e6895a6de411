"""Fixtures for the runtime-library tests: a real etcd, and a discovery URL for every backend."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # make `tests.support` importable however pytest was started
    sys.path.insert(0, str(_REPO))

from tests.support.etcd import EtcdServer, etcd_available  # noqa: E402


@pytest.fixture(scope="session")
def shared_etcd(tmp_path_factory: pytest.TempPathFactory):
    """One etcd for the whole session, for tests that do not stop it (isolate by key prefix)."""
    if not etcd_available():
        pytest.skip("etcd binary not installed")
    server = EtcdServer(tmp_path_factory.mktemp("etcd-shared"))
    server.start()
    yield server
    server.close()


@pytest.fixture
def etcd_server(tmp_path: Path):
    """A private etcd on free loopback ports; ``stop()``/``start()`` keep its data dir and ports."""
    if not etcd_available():
        pytest.skip("etcd binary not installed")
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    yield server
    server.close()


@pytest.fixture(params=["etcd", "file"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def discovery_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """``etcd://127.0.0.1:PORT`` (the shared etcd) or ``file:///<tmp>/discovery``: every test runs on both."""
    if backend == "etcd":
        return request.getfixturevalue("shared_etcd").url
    return f"file://{tmp_path / 'discovery'}"


@pytest.fixture
def ns() -> str:
    """A namespace unique to the test, so tests sharing one etcd never see each other's keys."""
    return f"t{uuid.uuid4().hex[:12]}"
