"""kvmesh processes start gRPC core with the EventEngine experiments off, unless the user says otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from kvmesh.grpc_core import EXPERIMENTS_ENV, TUNED_EXPERIMENTS


def _experiments_after_import(module: str, env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != EXPERIMENTS_ENV}
    if env_value is not None:
        env[EXPERIMENTS_ENV] = env_value
    code = f"import os, {module}; print(os.environ.get({EXPERIMENTS_ENV!r}, '<unset>'))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


ENTRY_POINTS = [
    "kvmesh_frontend.main",
    "kvmesh_router.main",
    "kvmesh_worker.main",
    "kvmesh_planner.main",
    "kvmesh_cli.main",
    "kvmesh_bench.cli",
]


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_entry_point_applies_the_tuned_experiments(module: str) -> None:
    assert _experiments_after_import(module, None) == TUNED_EXPERIMENTS


def test_a_users_own_setting_wins_even_when_empty() -> None:
    assert _experiments_after_import("kvmesh_frontend.main", "") == ""
    assert _experiments_after_import("kvmesh_frontend.main", "-event_engine_dns") == "-event_engine_dns"


def test_too_late_once_grpc_is_imported() -> None:
    env = {k: v for k, v in os.environ.items() if k != EXPERIMENTS_ENV}
    code = (
        "import grpc, os; from kvmesh.grpc_core import apply_defaults; "
        "print(apply_defaults(), os.environ.get('GRPC_EXPERIMENTS'))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "None"]
