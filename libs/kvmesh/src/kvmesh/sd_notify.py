"""systemd's notify protocol (sd_notify(3)) without libsystemd: one datagram per state change.

Why not a library: the protocol is a datagram of ``KEY=VALUE`` lines to ``$NOTIFY_SOCKET``; the
candidates either swallow every error (sdnotify) or need libsystemd to build. Outside systemd
(no ``NOTIFY_SOCKET``) every call is a no-op.

Invariants: ``READY=1`` is sent once, when health first turns SERVING (never earlier), ``STOPPING=1``
when draining starts; ``WATCHDOG=1`` pings come from a task **on the daemon's event loop**, so a
wedged loop stops them and systemd (``WatchdogSec=``) kills and restarts the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

__all__ = ["notify", "watchdog_interval", "watchdog_loop"]

log = logging.getLogger(__name__)


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``"READY=1\\nSTATUS=serving"``); False when not under systemd or on error."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address[0] == "@":  # abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:  # a notify failure must never take the daemon down
        log.warning("sd_notify to %s failed: %s", address, exc)
        return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of ``WATCHDOG_USEC``), or None when no watchdog is asked for."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid.isdigit() and int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6


async def watchdog_loop(interval: float) -> None:
    """Ping forever from the event loop; a blocked loop is a silent one."""
    with contextlib.suppress(asyncio.CancelledError):
        while True:
            notify("WATCHDOG=1")
            await asyncio.sleep(interval)
