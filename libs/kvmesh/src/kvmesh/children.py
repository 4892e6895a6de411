"""Child daemons that do not outlive the daemon that started them (``kvmesh up``, the planner's local connector).

Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``) sends the child SIGHUP when its parent
dies, however it dies (kill -9 too), so the child drains and exits instead of serving on as an orphan
nobody manages. The signal follows the *thread* that forked the child: start children from the main
thread (asyncio's subprocesses are forked from the event loop's thread). A dying parent hands its
children from thread to thread as its threads exit, and the kernel signals them at each hand-over:
a child may get the signal several times. So it is SIGHUP, which ``kvmesh.runtime`` takes as one
request to drain however often it comes, and not SIGTERM, whose second arrival means "cancel what is
in flight" (a killed planner's workers cancelled their requests instead of draining them).

The signal is armed by a small exec shim (this module run as ``python -m kvmesh.children PARENT_PID
PROGRAM ARGS...``), not by a ``preexec_fn``: a ``preexec_fn`` makes Python fork plainly, and the child
of a plain fork runs gRPC's fork handlers while other threads of the parent are inside gRPC. Such a
child was seen to stall or abort ("epoll_wait error: Bad file descriptor") before it could exec, so a
planner scaling up under load got a worker that never started. Without a ``preexec_fn`` Python spawns
with vfork, which runs no fork handlers; the shim, a fresh single-threaded process, arms the signal
and execs the program in its place (same pid). Elsewhere (no ``prctl``) the program runs as it is, and
only the parent's own signal handling stops its children.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable, Sequence

__all__ = ["PARENT_DEATH_SIGNAL", "dies_with_parent"]

_PR_SET_PDEATHSIG = 1
PARENT_DEATH_SIGNAL = signal.SIGHUP


def _resolve_prctl() -> Callable[[int, int], int] | None:
    with contextlib.suppress(OSError, AttributeError):
        prctl: Callable[[int, int], int] = ctypes.CDLL(None, use_errno=True).prctl
        return prctl
    return None


def dies_with_parent(argv: Sequence[str]) -> list[str]:
    """``argv`` as a command line that gets SIGHUP when the calling process dies (spawn it with no
    ``preexec_fn``). The program replaces the shim: the child's pid is the program's."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    # -P: not the working directory first on sys.path, where a "kvmesh" directory would shadow this package
    return [sys.executable, "-P", "-m", "kvmesh.children", str(os.getpid()), *argv]


def _exec(args: list[str]) -> int:
    """The shim: arm the parent-death signal, then exec the program (returns only on failure)."""
    if len(args) < 2 or not args[0].isdigit():
        print("usage: python -m kvmesh.children PARENT_PID PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    parent, argv = int(args[0]), args[1:]
    prctl = _resolve_prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL)
    if os.getppid() != parent:  # the parent died before the prctl: no signal will come
        return 128 + PARENT_DEATH_SIGNAL
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"cannot start {argv[0]}: {exc.strerror or exc}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(_exec(sys.argv[1:]))
