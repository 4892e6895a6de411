"""``kvmesh up`` gives each vLLM engine on the machine its own cores, and keeps the rest of the mesh off them
(``kvmesh_cli.vllm_cores``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from kvmesh_cli.vllm_cores import VARIABLE, core_binds, keep_off_model_cores, model_processes, worker_environments


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


# A parent that starts a "model runner": a child that names itself as vLLM names its model process
# and binds itself to one core, as vLLM's OpenMP set-up does; both then wait to be looked at.
TREE = """
import os, subprocess, sys, threading, time
child = subprocess.Popen([sys.executable, "-c", '''
import os, sys, time
open("/proc/self/comm", "w").write("VLLM::Worker")
os.sched_setaffinity(0, {int(sys.argv[1])})
print("bound", flush=True)
time.sleep(60)
''', sys.argv[1]], stdout=sys.stdout)
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # a second thread to move
child.wait()
"""


@pytest.fixture
def tree() -> Iterator[tuple[subprocess.Popen[str], int]]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores: with one, nothing is left over to move to")
    parent = subprocess.Popen([sys.executable, "-c", TREE, str(cores[0])], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline() == "bound\n"
        yield parent, cores[0]
    finally:
        for pid in model_processes([parent.pid]):
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait()


def test_everything_but_the_model_process_moves_off_its_core(tree: tuple[subprocess.Popen[str], int]) -> None:
    parent, model_core = tree
    (model,) = model_processes([parent.pid])
    rest = frozenset(os.sched_getaffinity(0)) - {model_core}
    assert keep_off_model_cores([parent.pid]) == (frozenset({model_core}), rest)
    threads = os.listdir(f"/proc/{parent.pid}/task")
    assert len(threads) >= 2  # every thread moved, not only the one whose id is the pid
    assert all(os.sched_getaffinity(int(tid)) == rest for tid in threads)
    assert os.sched_getaffinity(model) == {model_core}  # the model keeps its binding


def test_without_a_model_process_nothing_moves() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert keep_off_model_cores([sleeper.pid]) is None
        assert os.sched_getaffinity(sleeper.pid) == os.sched_getaffinity(0)
    finally:
        sleeper.kill()
        sleeper.wait()
