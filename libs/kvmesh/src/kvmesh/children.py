"""Child daemons that do not outlive the daemon that started them (``kvmesh up``, the planner's local connector).

Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``) sends the child SIGTERM when its parent
dies, however it dies (kill -9 too), so the child drains and exits instead of serving on as an orphan
nobody manages. The signal follows the *thread* that forked the child: start children from the main
thread (asyncio's subprocesses are forked from the event loop's thread). Elsewhere (no ``prctl``) the
hook does nothing, and only the parent's own signal handling stops its children.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def _resolve_prctl() -> Callable[[int, int], int] | None:
    with contextlib.suppress(OSError, AttributeError):
        prctl: Callable[[int, int], int] = ctypes.CDLL(None, use_errno=True).prctl
        return prctl
    return None


# Resolved here, in the parent: a child forked from a threaded process must not load libraries.
_prctl = _resolve_prctl()


def die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` (it runs in the child, before exec): SIGTERM when the calling process dies."""
    parent = os.getpid()

    def arm() -> None:
        if _prctl is None:
            return
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the prctl: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)

    return arm
