"""Measure a link from inside a network namespace (run as ``ip netns exec NS python netprobe.py ...``).

Servers print ``ready`` once listening, then one JSON line with what they measured; clients print one
JSON line. Stdlib only, so it runs under any interpreter in any namespace.

- ``echo PORT`` / ``rtt HOST PORT N``: TCP (NODELAY) 1-byte ping-pong, N round trips, their times.
- ``udp-sink PORT SECONDS`` / ``udp-send HOST PORT N``: N numbered datagrams, paced; how many arrived.
- ``tcp-sink PORT`` / ``tcp-send HOST PORT SECONDS``: bulk TCP; bytes and seconds seen by the sink.
- ``udp-rate PORT SECONDS`` / ``udp-flood HOST PORT SECONDS``: unpaced 64-byte datagrams; packets/s received.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time


def _listen(kind: int, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, kind)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    if kind == socket.SOCK_STREAM:
        sock.listen(4)
    print("ready", flush=True)
    return sock


def echo(port: int) -> None:
    conn, _ = _listen(socket.SOCK_STREAM, port).accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(64):
        conn.sendall(data)


def rtt(host: str, port: int, n: int) -> None:
    sock = socket.create_connection((host, port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        sock.sendall(b"x")
        sock.recv(1)
        times.append((time.perf_counter() - start) * 1000)
    sock.close()
    print(json.dumps({"rtt_ms": times}), flush=True)


def udp_sink(port: int, seconds: float) -> None:
    sock = _listen(socket.SOCK_DGRAM, port)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    seen: set[int] = set()
    sock.settimeout(seconds)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            data = sock.recv(64)
        except TimeoutError:
            break
        if data == b"end":
            break
        seen.add(int(data))
        sock.settimeout(max(0.01, deadline - time.monotonic()))
    print(json.dumps({"received": len(seen)}), flush=True)


def udp_send(host: str, port: int, n: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for i in range(n):
        sock.sendto(str(i).encode(), (host, port))
        if i % 200 == 199:
            time.sleep(0.002)  # paced: no loss from the receiver's buffer, only from the link
    time.sleep(0.5)
    for _ in range(5):
        sock.sendto(b"end", (host, port))
    print(json.dumps({"sent": n}), flush=True)


def udp_rate(port: int, seconds: float) -> None:
    sock = _listen(socket.SOCK_DGRAM, port)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.settimeout(seconds + 5)
    count, first, last = 0, 0.0, 0.0
    while True:
        try:
            data = sock.recv(64)
        except TimeoutError:
            break
        if data == b"end":
            break
        last = time.perf_counter()
        first = first or last
        count += 1
    print(json.dumps({"received": count, "pps": count / max(last - first, 1e-9)}), flush=True)


def udp_flood(host: str, port: int, seconds: float) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    payload, sent = b"\0" * 64, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(100):
            with contextlib.suppress(OSError):
                sock.sendto(payload, (host, port))
                sent += 1
    time.sleep(0.5)
    for _ in range(5):
        sock.sendto(b"end", (host, port))
    print(json.dumps({"sent": sent, "pps": sent / seconds}), flush=True)


def tcp_sink(port: int) -> None:
    conn, _ = _listen(socket.SOCK_STREAM, port).accept()
    total, first, last = 0, 0.0, 0.0
    while data := conn.recv(1 << 16):
        last = time.perf_counter()
        first = first or last
        total += len(data)
    print(json.dumps({"bytes": total, "seconds": last - first}), flush=True)


def tcp_send(host: str, port: int, seconds: float) -> None:
    sock = socket.create_connection((host, port), timeout=30)
    chunk = b"\0" * (1 << 16)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sock.sendall(chunk)
    sock.close()
    print(json.dumps({"done": True}), flush=True)


def main(argv: list[str]) -> None:
    cmd, *args = argv
    if cmd == "echo":
        echo(int(args[0]))
    elif cmd == "rtt":
        rtt(args[0], int(args[1]), int(args[2]))
    elif cmd == "udp-sink":
        udp_sink(int(args[0]), float(args[1]))
    elif cmd == "udp-send":
        udp_send(args[0], int(args[1]), int(args[2]))
    elif cmd == "udp-rate":
        udp_rate(int(args[0]), float(args[1]))
    elif cmd == "udp-flood":
        udp_flood(args[0], int(args[1]), float(args[2]))
    elif cmd == "tcp-sink":
        tcp_sink(int(args[0]))
    elif cmd == "tcp-send":
        tcp_send(args[0], int(args[1]), float(args[2]))
    else:
        raise SystemExit(f"netprobe: unknown command {cmd!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
