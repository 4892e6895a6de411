"""Fixtures of the disaggregated-mesh tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.etcd import EtcdServer, etcd_available


@pytest.fixture(params=["file", pytest.param("etcd", marks=pytest.mark.etcd)])
def discovery_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """A discovery URL on each backend: the tests discovery takes part in (a worker dies or joins, a pool
    empties, two pools of two) run on the file backend and on a real etcd."""
    if request.param == "file":
        yield f"file://{tmp_path / 'disc'}"
        return
    if not etcd_available():
        pytest.skip("etcd binary not installed")
    with EtcdServer(tmp_path / "etcd") as etcd:
        yield etcd.url
