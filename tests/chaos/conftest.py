"""The fault suite's tests: each runs one ``kvmesh bench chaos`` scenario, short, and asserts its report."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.etcd import etcd_available


@pytest.fixture
def chaos(tmp_path: Path) -> Callable[..., Any]:
    """``chaos("etcd-outage", outage=8)`` runs the scenario in ``tmp_path`` and returns its Report."""
    if not etcd_available():
        pytest.skip("etcd binary not installed")
    from kvmesh_bench.chaos import options, run_scenario

    def run(scenario: str, **overrides: Any) -> Any:
        report = asyncio.run(run_scenario(options(scenario, **overrides), tmp_path))
        print(report.table())
        return report

    return run
