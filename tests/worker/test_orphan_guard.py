"""The vLLM worker's orphan guard, with real processes: what a worker started dies with it.

vLLM's engine processes outlive a SIGKILLed API process (vllm-project/vllm#55510). These tests stand
a small Python process in for the worker: it starts the guard, then a child and a grandchild that
ignore SIGTERM (as a busy-waiting engine core effectively does), in the order ``--engine vllm`` does.
``tests/vllm/test_vllm_disagg.py`` checks the same with vLLM's own processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvmesh_worker.engines.vllm import orphan_guard

# The stand-in worker, in vLLM's order: the guard first (given the scratch directory named by argv[1]),
# then a child that starts a grandchild, both immune to SIGTERM and SIGINT. It exits cleanly, stopping
# only its child, when told "exit" on stdin.
WORKER = textwrap.dedent(
    """
    import json, signal, subprocess, sys, time
    from pathlib import Path
    from kvmesh_worker.engines.vllm import orphan_guard

    guard = orphan_guard.start(scratch=Path(sys.argv[1]))
    STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \\
        "signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)"
    grandparent = (
        "import subprocess, sys, time; "
        f"g = subprocess.Popen([sys.executable, '-c', {STUBBORN!r}]); "
        "print(g.pid, flush=True); " + STUBBORN.replace("import signal, time; ", "import signal; ")
    )
    child = subprocess.Popen([sys.executable, "-c", grandparent], stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    print(json.dumps({"child": child.pid, "grandchild": grandchild, "guard": guard}), flush=True)
    if sys.stdin.readline().strip() == "exit":
        child.kill()
        child.wait()
    """
)


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] != b"Z"


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """The worker's scratch directory (vLLM's IPC sockets), with a file in it."""
    directory = tmp_path / "ipc"
    directory.mkdir()
    (directory / "3f1c9a52-socket").touch()
    return directory


@pytest.fixture
def worker(scratch: Path) -> Iterator[tuple[subprocess.Popen[str], dict[str, int]]]:
    """The stand-in worker, leading its own process group as under ``kvmesh up``."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(scratch)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        process_group=0,
    )
    assert proc.stdout is not None
    pids = json.loads(proc.stdout.readline())
    deadline = time.monotonic() + 30
    while "orphan_guard" not in Path(f"/proc/{pids['guard']}/cmdline").read_text():
        assert time.monotonic() < deadline, "the guard never started"
        time.sleep(0.05)
    # The processes started after the guard: it sees them at its next snapshot, at most MAX_INTERVAL_S away.
    time.sleep(2 * orphan_guard.MAX_INTERVAL_S)
    yield proc, pids
    for pid in (proc.pid, *pids.values()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def test_a_sigkilled_worker_takes_its_engine_processes_and_scratch_directory_with_it(
    worker: tuple[subprocess.Popen[str], dict[str, int]], scratch: Path
) -> None:
    proc, pids = worker
    assert alive(pids["child"]) and alive(pids["grandchild"])
    proc.kill()  # no shutdown path runs: what vLLM's processes survive
    proc.wait()
    assert wait_gone([pids["child"], pids["grandchild"]], timeout=15) == []
    assert wait_gone([pids["guard"]], timeout=15) == [], "the guard outlived its job"
    assert not scratch.exists()


def test_the_guard_survives_the_stop_signals_a_process_group_gets(
    worker: tuple[subprocess.Popen[str], dict[str, int]],
) -> None:
    """A Ctrl-C or a unit stop signals the whole group: the guard must still be there when the worker dies."""
    proc, pids = worker
    os.kill(pids["guard"], signal.SIGTERM)
    os.kill(pids["guard"], signal.SIGINT)
    os.kill(pids["guard"], signal.SIGHUP)
    time.sleep(0.5)
    assert alive(pids["guard"])
    proc.kill()
    proc.wait()
    assert wait_gone([pids["child"], pids["grandchild"]], timeout=15) == []


def test_a_worker_killed_while_its_engine_is_frozen_still_takes_it_down(
    worker: tuple[subprocess.Popen[str], dict[str, int]], scratch: Path
) -> None:
    """With a stopped process in it, the dead worker's process group is orphaned: the kernel sends each of
    its members SIGHUP (and SIGCONT). The guard must outlive that too."""
    proc, pids = worker
    os.kill(pids["child"], signal.SIGSTOP)
    proc.kill()
    proc.wait()
    assert wait_gone([pids["child"], pids["grandchild"]], timeout=15) == []
    assert wait_gone([pids["guard"]], timeout=15) == []
    assert not scratch.exists()


def test_a_clean_exit_leaves_the_guard_nothing_to_do_but_leave(
    worker: tuple[subprocess.Popen[str], dict[str, int]], scratch: Path
) -> None:
    proc, pids = worker
    assert proc.stdin is not None
    assert scratch.exists(), "removed while the worker runs"
    proc.stdin.write("exit\n")
    proc.stdin.flush()
    assert proc.wait(30) == 0
    assert wait_gone([pids["guard"]], timeout=15) == []
    assert not scratch.exists(), "vLLM leaves its IPC sockets even at a clean stop"
    # The worker stopped its child, not the grandchild: the guard's sweep took that one.
    assert wait_gone([pids["grandchild"]], timeout=15) == []


# A stand-in worker whose engine process, forked after the worker started its multiprocessing resource
# tracker as --engine vllm does, holds a shared-memory segment (what vLLM's engine core does with its
# message queues) and ignores SIGTERM.
TRACKED_WORKER = textwrap.dedent(
    """
    import json, multiprocessing, signal, sys, time
    from multiprocessing import resource_tracker, shared_memory
    from kvmesh_worker.engines.vllm import orphan_guard

    def engine(names):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        shm = shared_memory.SharedMemory(create=True, size=4096)
        names.put(shm.name)
        time.sleep(600)

    guard = orphan_guard.start()
    orphan_guard.start_resource_tracker()
    fork = multiprocessing.get_context("fork")
    names = fork.Queue()
    child = fork.Process(target=engine, args=(names,))
    child.start()
    info = {"child": child.pid, "guard": guard, "tracker": resource_tracker._resource_tracker._pid}
    print(json.dumps({**info, "shm": names.get(timeout=30)}), flush=True)
    sys.stdin.readline()
    """
)


@pytest.mark.parametrize("frozen", [False, True], ids=["running", "frozen"])
def test_a_killed_engines_shared_memory_is_unlinked_by_its_resource_tracker(frozen: bool) -> None:
    """The guard kills the engine, not the tracker, which then unlinks the segment the engine left. Frozen:
    the engine is stopped when its worker (leading its process group) dies, so the kernel SIGHUPs the
    orphaned group, tracker included."""
    proc = subprocess.Popen(
        [sys.executable, "-c", TRACKED_WORKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        process_group=0,
    )
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    segment = Path("/dev/shm") / info["shm"]
    try:
        assert segment.exists() and orphan_guard.is_resource_tracker(info["tracker"])
        time.sleep(2 * orphan_guard.MAX_INTERVAL_S)  # the guard's next snapshots see the engine and tracker
        if frozen:
            os.kill(info["child"], signal.SIGSTOP)
        proc.kill()
        proc.wait()
        assert wait_gone([info["child"]], timeout=15) == []
        assert wait_gone([info["tracker"]], timeout=15) == [], "the tracker did not finish once its users were gone"
        assert not segment.exists(), "the engine's shared memory leaked"
        assert wait_gone([info["guard"]], timeout=15) == []
    finally:
        for pid in info.values():
            if isinstance(pid, int):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        segment.unlink(missing_ok=True)


def test_a_process_outside_the_workers_tree_is_never_signalled() -> None:
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        snapshot = orphan_guard.descendants(worker.pid, exclude=-1)
        assert bystander.pid not in snapshot and snapshot == {}
        assert bystander.pid in orphan_guard.descendants(os.getpid(), exclude=-1)
        # A pid whose start time changed (recycled) is left alone.
        assert orphan_guard.kill_survivors({bystander.pid: 1}) == []
        assert alive(bystander.pid)
        worker.kill()
        worker.wait()
    finally:
        bystander.kill()
        bystander.wait()
