"""Kill a vLLM worker's engine processes when the worker dies without shutting them down.

vLLM's ``VLLM::EngineCore`` process, and the ``VLLM::Worker`` model process below it, outlive an
API process that dies without running its shutdown path (SIGKILL, the OOM killer, a crash).
Reparented, they keep the engine's memory and busy-wait on a core forever (vllm-project/vllm#55510,
open upstream). systemd kills a unit's whole cgroup, but ``kvmesh up``, the planner's local connector
and a plain shell do not.

So a vLLM worker starts this guard before its engine (:func:`start`). The guard is a stdlib-only
process, run by file path, so it imports nothing of kvmesh or vLLM. It holds a pidfd on the worker
and takes a snapshot of the worker's descendants: every 0.5 s while the tree changes, backing off to
every 2 s once it is stable (vLLM starts its processes several seconds into its import, and a worker
killed during that start must not leave them). When the worker exits, the guard SIGKILLs every
process it watches that is still alive, removes the worker's scratch directory if it was given one
(vLLM's ZMQ IPC sockets, which vLLM leaves behind even at a clean stop: seven per engine start), then
exits. A clean stop leaves nothing to kill.

Invariants:
- Only processes seen below the worker are signalled (also once an intermediate parent died and they
  were reparented), and only if their start time is unchanged, so a recycled pid is never hit.
- Python's multiprocessing resource tracker is never signalled. vLLM's processes register their
  shared memory (``/dev/shm/psm_*``) and semaphores with it, and it unlinks whatever is left once the
  last of them is gone: killed with them, it leaked those segments at every engine kill or forced stop.
  It exits by itself once the processes holding its pipe are gone.
- The worker starts that tracker itself, before vLLM, with SIGHUP ignored (``start_resource_tracker``;
  the disposition survives its exec), for the reason below: otherwise a frozen engine's group took the
  tracker down with that SIGHUP, and the segments leaked.
- SIGINT, SIGTERM and SIGHUP are ignored. A Ctrl-C or a unit stop reaches the whole process group, and
  the guard must outlive the worker to do its job. SIGHUP: when a worker that leads its process group
  (``kvmesh up``, the tests) dies while a process of that group is stopped (a frozen engine), the
  group is orphaned and the kernel sends every member SIGHUP, whose default is to die: the guard
  did, leaving the engine and the scratch directory behind. It exits once the worker is gone.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path

FIRST_INTERVAL_S = 0.5
MAX_INTERVAL_S = 2.0

Snapshot = dict[int, int]  # pid -> start time (clock ticks since boot)

_started: subprocess.Popen[bytes] | None = None  # held for the worker's lifetime


def start(scratch: Path | None = None) -> int:
    """Start this process's guard (once) and return its pid; call it before the engine starts its processes.

    ``scratch``: a directory of the worker's that the guard removes once the worker and its processes are gone.
    """
    global _started
    if _started is None:
        argv = [sys.executable, "-I", str(Path(__file__).resolve()), str(os.getpid())]
        _started = subprocess.Popen(
            [*argv, str(scratch)] if scratch else argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
    return _started.pid


def start_resource_tracker() -> None:
    """Start this process's multiprocessing resource tracker now, immune to SIGHUP (see the invariants).

    vLLM's processes, started after it, share it. Call from the main thread, before the engine starts.
    """
    from multiprocessing import resource_tracker

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.signal(signal.SIGHUP, previous)


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time), for every process visible in /proc."""
    out: dict[int, tuple[int, int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone since listdir
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()  # after "pid (comm) ": state, ppid, ... starttime
        out[int(name)] = (int(fields[1]), int(fields[19]))
    return out


def descendants(root: int, exclude: int, table: dict[int, tuple[int, int]] | None = None) -> Snapshot:
    """Every process below ``root`` (not ``exclude``), with its start time."""
    if table is None:
        table = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: Snapshot = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child != exclude and child not in found:
                found[child] = table[child][1]
                todo.append(child)
    return found


def is_resource_tracker(pid: int) -> bool:
    """Whether ``pid`` is a multiprocessing resource tracker (the cleaner of what its users leave)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def _spared(pid: int) -> bool:
    """Not to be killed: a resource tracker, or a process already dead (a zombie: no command line left)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] == b"Z" or is_resource_tracker(pid)


def kill_survivors(snapshot: Snapshot) -> list[int]:
    """SIGKILL the snapshot's processes that still run with the same start time; returns their pids.

    Resource trackers are left to finish their cleanup (see the module's invariants).
    """
    now = _processes()
    killed = []
    for pid, started in snapshot.items():
        if pid in now and now[pid][1] == started and not _spared(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append(pid)
    return killed


def guard(worker: int) -> list[int]:
    """Watch ``worker`` until it exits, then kill what it left behind; returns the pids killed."""
    try:
        pidfd = os.pidfd_open(worker)
    except ProcessLookupError:
        return []
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    me = os.getpid()
    watched: Snapshot = {}
    interval = FIRST_INTERVAL_S
    while True:
        table = _processes()
        # Still watched: what was seen below the worker and still runs, although a process whose parent
        # died (an engine core's model process) is no longer below it.
        latest = {pid: started for pid, started in watched.items() if table.get(pid, (0, -1))[1] == started}
        latest.update(descendants(worker, me, table))
        interval = min(interval * 2, MAX_INTERVAL_S) if latest == watched else FIRST_INTERVAL_S
        watched = latest
        if poller.poll(interval * 1000):  # readable: the worker has exited
            break
    os.close(pidfd)
    return kill_survivors(watched)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    worker = int(argv[0])
    killed = guard(worker)
    if len(argv) > 1:  # before the report: a log that cannot be written must not keep the directory
        shutil.rmtree(argv[1], ignore_errors=True)
    if killed:
        print(
            f"kvmesh-worker {worker} exited and left engine processes {killed} running: killed them",
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
