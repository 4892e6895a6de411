"""The vLLM worker's NIXL side-channel port: picked free, below the range outgoing connections draw from.

vLLM binds the port seconds after the worker picks it; a port from ``bind(0)`` lies in the ephemeral
range, where any outgoing connection on the machine may take it meanwhile (seen once in the suite as
``Address already in use`` in vLLM's handshake listener). No vLLM is needed for this.
"""

from __future__ import annotations

import socket

from kvmesh_worker.engines.vllm.disagg import _ephemeral_low, _free_listen_port


def test_the_side_channel_port_is_free_and_below_the_ephemeral_range():
    low = _ephemeral_low()
    for _ in range(20):
        port = _free_listen_port("127.0.0.1")
        assert 10000 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free: nothing else holds it
