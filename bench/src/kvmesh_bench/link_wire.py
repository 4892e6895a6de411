"""A userspace wire that delays frames: the link emulator used where the kernel has no netem.

``python -m kvmesh_bench.link_wire IN OUT --delay-ms D`` sends every frame that arrives on ``IN``
out of ``OUT`` ``D`` ms later. :mod:`kvmesh_bench.link_conditions` redirects a host's frames (tc
``mirred`` on the ingress of the bridge end of its veth) into ``IN``, and ``OUT``'s veth peer is a
bridge port: only what the host sends crosses userspace, the reverse direction stays in the kernel.
That is ``tc qdisc add dev <host veth> root netem delay D ms``: delay on the host's egress.

``IN`` is an ``AF_PACKET`` socket with ``PACKET_VNET_HDR``: the kernel hands over the virtio header
of every frame (pending checksum offsets, GSO size) and ``OUT`` takes it back, so frames keep their
offloads and a 64 KiB TSO segment crosses as one frame, untouched. A constant delay keeps the order:
one FIFO. The process runs SCHED_FIFO where allowed, so an idle wire wakes on time on a loaded
machine. Prints ``ready`` once both sockets are bound; exits on SIGTERM.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import select
import signal
import socket
import struct
import sys
import time

__all__ = ["main"]

_ETH_P_ALL = 0x0003
_SOL_PACKET = 263
_PACKET_ADD_MEMBERSHIP = 1
_PACKET_MR_PROMISC = 1
_PACKET_VNET_HDR = 15
_PACKET_OUTGOING = 4
_MAX_FRAME = 65536 + 64


def _open(ifname: str, receive: bool) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL) if receive else 0)
    sock.setsockopt(_SOL_PACKET, _PACKET_VNET_HDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF if receive else socket.SO_SNDBUF, 8 << 20)
    sock.bind((ifname, 0))  # 0: keep the socket's protocol (ETH_P_ALL to receive, none to only send)
    if receive:
        mreq = struct.pack("iHH8s", socket.if_nametoindex(ifname), _PACKET_MR_PROMISC, 0, b"")
        sock.setsockopt(_SOL_PACKET, _PACKET_ADD_MEMBERSHIP, mreq)
    sock.setblocking(False)
    return sock


def run(inbound: str, outbound: str, delay_s: float) -> None:
    source, sink = _open(inbound, receive=True), _open(outbound, receive=False)
    with contextlib.suppress(OSError):  # real-time: an idle wire wakes at once on a loaded machine
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    queue: collections.deque[tuple[float, bytes]] = collections.deque()
    stop = False

    def _term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, _term)
    print("ready", flush=True)
    while not stop:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            frame = queue.popleft()[1]
            with contextlib.suppress(OSError):  # ENOBUFS and the like: dropped, as by a full NIC queue
                sink.send(frame)
        timeout = max(0.0, queue[0][0] - time.monotonic()) if queue else 0.5
        try:
            readable, _, _ = select.select([source], [], [], timeout)
        except InterruptedError:
            continue
        if not readable:
            continue
        due = time.monotonic() + delay_s
        while True:
            try:
                frame, address = source.recvfrom(_MAX_FRAME)
            except BlockingIOError:
                break
            if address[2] != _PACKET_OUTGOING:
                queue.append((due, frame))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmesh_bench.link_wire", description=__doc__)
    parser.add_argument("inbound", help="interface the host's frames arrive on")
    parser.add_argument("outbound", help="interface whose veth peer is a bridge port")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="delay of every frame")
    args = parser.parse_args(argv)
    if args.delay_ms < 0:
        print(f"link_wire: --delay-ms must be >= 0, got {args.delay_ms}", file=sys.stderr)
        return 2
    run(args.inbound, args.outbound, args.delay_ms / 1000.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
