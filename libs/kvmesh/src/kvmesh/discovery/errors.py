"""Discovery errors and the two asyncio helpers every discovery module uses (no other imports,
so the store (:mod:`kvmesh.discovery.base`) and the lease keeper (:mod:`kvmesh.discovery.lease`) both
depend on this module and never on each other's internals in a cycle)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["DiscoveryError", "DiscoveryUnavailable", "LeaseNotFound", "bounded", "raise_if_cancelling", "stray_cancel"]

T = TypeVar("T")


async def bounded(aw: Awaitable[T], timeout: float) -> T:
    """``await aw`` for at most ``timeout`` seconds (TimeoutError after).

    Uses ``asyncio.timeout`` rather than ``asyncio.wait_for``: on Python 3.11 ``wait_for`` can swallow
    a cancellation that races with the inner call's completion, which turns ``task.cancel()`` into a
    no-op and hangs whoever awaits the cancelled task.
    """
    async with asyncio.timeout(timeout):
        return await aw


def stray_cancel(exc: BaseException) -> bool:
    """A CancelledError that nobody asked for: this task is not being cancelled.

    grpc.aio ends every call of a channel that is being closed with ``asyncio.CancelledError``, so an
    etcd call on a client that a failover just replaced raises it in a task nobody cancelled. Left to
    propagate, it ended a discovery watch without a word (its consumer then waited forever: frontends
    with a frozen model view, issue 18). Such a cancel is a connectivity failure, not a cancellation.
    """
    task = asyncio.current_task()
    return isinstance(exc, asyncio.CancelledError) and task is not None and not task.cancelling()


def raise_if_cancelling() -> None:
    """Re-raise a cancellation some library swallowed (see :func:`bounded`), so loops still stop."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


# -- errors ------------------------------------------------------------------------------------
class DiscoveryError(Exception):
    """A discovery operation failed (bad request, lease revoked, corrupt record...)."""


class DiscoveryUnavailable(DiscoveryError):
    """The backend cannot be reached or used right now (etcd down, directory unusable).

    The message is one actionable line, fit to print as a daemon's exit reason.
    """


class DiscoveryRefused(DiscoveryUnavailable):
    """The backend is there but this use of it is refused for good (an unsafe or unusable discovery
    directory): a daemon exits 2 on it, as on a bad setting, where a backend that does not answer is 69."""


class LeaseNotFound(DiscoveryError):
    """The backend refused a write because the lease it names is gone (expired or revoked).

    Not a failure of the write for the lease keeper: the record is remembered and the re-grant that
    follows publishes it (a daemon starting on a loaded machine could see its first lease expire
    before its first put; that must re-register, not crash it).
    """
