"""Fixtures for the stock-client acceptance tests: real daemons on the file backend and on etcd."""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kserve_clients.mesh import MODEL, Mesh
from tests.support.etcd import EtcdServer, etcd_available


def _require_daemons() -> None:
    for module in ("kvmesh_worker.main", "kvmesh_router.main", "kvmesh_frontend.main"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not available yet")


@pytest.fixture(scope="module", params=["file", pytest.param("etcd", marks=pytest.mark.etcd)])
def discovery_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if request.param == "file":
        yield f"file://{tmp_path_factory.mktemp('discovery')}"
        return
    if not etcd_available():
        pytest.skip("etcd binary not installed")
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as etcd:
        yield etcd.url


@pytest.fixture(scope="module")
def mesh(discovery_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """One worker process with two engines, one router, one frontend (shared by a test module).

    ``KVMESH_TEST_DISAGG=1`` makes it disaggregated: the two engines decode, and a prefill worker (one
    engine) computes every prompt, so the same unchanged tests check the disaggregated path.
    """
    _require_daemons()
    deployment = Mesh(tmp_path_factory.mktemp("logs"), discovery_url, f"kc{uuid.uuid4().hex[:8]}")
    try:
        if os.environ.get("KVMESH_TEST_DISAGG"):
            deployment.worker("--role", "decode", engines=2)
            deployment.worker("--role", "prefill")
        else:
            deployment.worker(engines=2)
        deployment.router()
        deployment.start_frontend()
        deployment.wait_model(MODEL)
        yield deployment
    finally:
        deployment.close()


@pytest.fixture
def fresh_mesh(tmp_path: Path) -> Iterator[Mesh]:
    """An empty deployment on the file backend for tests that kill or stop daemons."""
    _require_daemons()
    deployment = Mesh(tmp_path, f"file://{tmp_path / 'discovery'}", f"kc{uuid.uuid4().hex[:8]}", lease_ttl=1.0)
    try:
        yield deployment
    finally:
        deployment.close()
