"""Ports picked now for a listener that binds them later (a daemon's gRPC port, vLLM's NIXL side channel).

A port from ``bind(0)`` lies in the ephemeral range, where any outgoing connection on the machine may
take it before the listener binds it (seen twice in the suite as ``Address already in use``).
"""

from __future__ import annotations

import socket

from kvmesh.ports import LOWEST_TRIED, ephemeral_low, free_port


def test_a_picked_port_is_free_and_below_the_ephemeral_range():
    low = ephemeral_low()
    for _ in range(20):
        port = free_port()
        assert LOWEST_TRIED <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free: nothing else holds it


def test_a_port_held_by_a_listener_is_never_picked():
    held = []
    try:
        for _ in range(50):
            s = socket.socket()
            s.bind(("127.0.0.1", free_port()))
            s.listen()
            held.append(s)
        ports = {s.getsockname()[1] for s in held}
        assert len(ports) == 50  # each pick skipped the ports bound before it
    finally:
        for s in held:
            s.close()
