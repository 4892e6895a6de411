"""Picking a TCP port now for a listener that binds it later.

A daemon, or vLLM's engine core, may bind a port tens of seconds after it was picked (a vLLM worker
binds its gRPC port once its engine is up). A port the kernel hands out for ``bind(0)`` lies in the
ephemeral range, which every outgoing connection on the machine draws its source port from meanwhile;
one took such a port twice in the suite (``Address already in use`` in vLLM's NIXL handshake listener,
then in a restarted vLLM worker's gRPC port). Below that range only another listener can take it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST_TRIED = 10000  # below: the well-known and commonly configured ports


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (``ip_local_port_range``)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, below the ephemeral range when one can be found there."""
    address = "127.0.0.1" if host == "localhost" else host
    rng = random.SystemRandom()
    low = ephemeral_low()
    for _ in range(64 if low > LOWEST_TRIED else 0):
        port = rng.randrange(LOWEST_TRIED, low)
        with socket.socket() as s:
            try:
                s.bind((address, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])
