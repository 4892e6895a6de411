"""``kvmesh up`` gives each vLLM engine on the machine its own cores (``kvmesh_cli.vllm_cores``)."""

from __future__ import annotations

import pytest
from kvmesh_cli.vllm_cores import VARIABLE, core_binds, worker_environments


def test_engines_get_disjoint_contiguous_slices_of_the_cores() -> None:
    assert core_binds(2, [0, 1]) == ["0", "1"]  # this machine: one core per engine of a 1P1D mesh
    assert core_binds(3, range(8)) == ["0,1,2", "3,4,5", "6,7"]
    assert core_binds(2, [5, 3, 4, 2]) == ["2,3", "4,5"]  # an affinity mask, in any order
    assert core_binds(1, [0, 1]) == ["0,1"]


def test_more_engines_than_cores_share_round_robin() -> None:
    assert core_binds(3, [0, 1]) == ["0", "1", "0"]
    assert core_binds(0, [0, 1]) == [] and core_binds(2, []) == []


def test_one_engine_or_a_binding_the_user_chose_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    assert worker_environments(1) == [{}]
    split = worker_environments(2)
    assert len(split) == 2 and all(set(env) == {VARIABLE} for env in split)
    monkeypatch.setenv(VARIABLE, "nobind")
    assert worker_environments(2) == [{}, {}]
