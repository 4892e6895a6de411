"""Children that die with the process that started them (``kvmesh.children``), started without a
``preexec_fn`` (a plain fork from a process with gRPC threads runs gRPC's fork handlers in the child)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvmesh.children import dies_with_parent


def running_pid(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not running_pid(pid):
            return True
        time.sleep(0.05)
    return False


def test_the_program_replaces_the_shim_so_its_pid_is_the_childs() -> None:
    """A connector tracks its workers by the pid it spawned: the program must run under that pid."""
    with subprocess.Popen(dies_with_parent(["sh", "-c", "echo $$"]), stdout=subprocess.PIPE, text=True) as child:
        out, _ = child.communicate(timeout=10)
    assert int(out) == child.pid
    assert child.returncode == 0


def test_the_program_gets_sighup_when_its_parent_is_killed(tmp_path: Path) -> None:
    """kill -9 of the parent (no handler runs): the child is signalled by the kernel."""
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time; from kvmesh.children import dies_with_parent; "
        f"subprocess.Popen(dies_with_parent(['sh', '-c', 'echo $$ > {pid_file}; exec sleep 60'])); time.sleep(60)"
    )])  # fmt: skip
    try:
        deadline = time.monotonic() + 15
        while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert running_pid(child)
        parent.kill()
        parent.wait()
        assert _wait_gone(child), "the child outlived its parent"
    finally:
        parent.kill()
        parent.wait()


def test_a_parent_that_died_before_the_shim_armed_the_signal_means_the_program_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    not_my_parent = 1  # the shim's parent is this test process, so PARENT_PID names a parent already gone
    done = subprocess.run(
        [sys.executable, "-m", "kvmesh.children", str(not_my_parent), "touch", str(marker)], capture_output=True
    )
    assert done.returncode == 128 + signal.SIGHUP
    assert not marker.exists()


def test_a_program_that_cannot_start_is_one_line_and_exit_127() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvmesh.children", str(os.getpid()), "kvmesh-no-such-program"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 127
    assert done.stderr.strip().splitlines() == ["cannot start kvmesh-no-such-program: No such file or directory"]


def test_a_kvmesh_directory_in_the_working_directory_does_not_shadow_the_shim(tmp_path: Path) -> None:
    (tmp_path / "kvmesh").mkdir()
    (tmp_path / "kvmesh" / "__init__.py").write_text("raise SystemExit('the wrong kvmesh')\n")
    done = subprocess.run(dies_with_parent(["echo", "ran"]), cwd=tmp_path, capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "ran\n"), done.stderr
