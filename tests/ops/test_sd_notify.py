"""systemd's notify protocol against a real datagram socket (``NOTIFY_SOCKET``), systemd not being PID 1:
READY=1 only once health is SERVING (the frontend: once its port serves, ready or not), STOPPING=1 on
drain, WATCHDOG=1 from the event loop (so the pings stop while the loop is blocked)."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvmesh.runtime import DaemonRuntime
from kvmesh.settings import DaemonSettings

from tests.security.tlsmesh import TlsMesh, health

SERVING, NOT_SERVING = 1, 2


class Listener:
    """What systemd would hear: every datagram on the socket, with its arrival time and, for READY,
    the daemon's health status probed right after it arrived."""

    def __init__(self, path: Path, probe: str | None = None) -> None:
        self.path = path
        self.probe = probe
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, str]] = []
        self.health_at_ready: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            self.messages.append((time.monotonic(), data))
            if "READY=1" in data.splitlines() and self.probe is not None and self.health_at_ready is None:
                self.health_at_ready = health(self.probe, None, timeout=2.0)

    def states(self, key: str) -> list[float]:
        return [t for t, m in self.messages if key in m.splitlines()]

    def wait_for(self, key: str, timeout: float = 30.0) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found := self.states(key):
                return found[0]
            time.sleep(0.02)
        raise AssertionError(f"no {key} within {timeout}s; got {self.messages}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[Listener]:
    lst = Listener(tmp_path / "notify.sock")
    yield lst
    lst.close()


@pytest.mark.e2e
@pytest.mark.parametrize("daemon", ["kvmesh-worker", "kvmesh-router", "kvmesh-frontend"])
def test_ready_after_serving_watchdog_pings_and_stopping_on_drain(tmp_path: Path, daemon: str) -> None:
    mesh = TlsMesh(tmp_path, f"file://{tmp_path / 'discovery'}", "notify", certs=None)
    sock = tmp_path / "notify.sock"
    env = {"NOTIFY_SOCKET": str(sock), "WATCHDOG_USEC": "200000"}
    proc = mesh.start(daemon, daemon.removeprefix("kvmesh-"), env=env)
    lst = Listener(sock, probe=proc.address)
    try:
        lst.wait_for("READY=1")
        time.sleep(0.3)
        if daemon == "kvmesh-frontend":  # up, but not ready without a router and an engine: systemd must
            # not hold its start until they come (its health says NOT_SERVING meanwhile)
            assert lst.health_at_ready == NOT_SERVING
        else:
            assert lst.health_at_ready == SERVING, "READY=1 came before the daemon was SERVING"
        assert len(lst.states("READY=1")) == 1
        pings = len(lst.states("WATCHDOG=1"))
        time.sleep(0.6)
        assert len(lst.states("WATCHDOG=1")) >= pings + 3  # every 0.1 s (half of WATCHDOG_USEC)
        proc.signal(signal.SIGTERM)
        lst.wait_for("STOPPING=1", timeout=10)
        assert proc.wait(15) == 0
    finally:
        lst.close()
        mesh.close()


async def test_watchdog_pings_stop_while_the_event_loop_is_blocked(
    tmp_path: Path, listener: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real runtime on a real loop: blocking the loop (as a wedged handler would) silences the pings."""
    monkeypatch.setenv("NOTIFY_SOCKET", str(listener.path))
    monkeypatch.setenv("WATCHDOG_USEC", "100000")  # a ping every 50 ms
    settings = DaemonSettings(discovery=f"file://{tmp_path / 'discovery'}")
    async with DaemonRuntime("kvmesh-test", settings) as runtime:
        await runtime.start(0)
        await asyncio.sleep(0.5)
        assert len(listener.states("WATCHDOG=1")) >= 5
        blocked_at = time.monotonic()
        time.sleep(1.0)
        unblocked_at = time.monotonic()
        await asyncio.sleep(0.5)
    pings = listener.states("WATCHDOG=1")
    during = [t for t in pings if blocked_at + 0.2 < t < unblocked_at]  # 0.2 s: a ping already in flight
    after = [t for t in pings if t > unblocked_at]
    assert during == [], f"{len(during)} pings while the loop was blocked"
    assert len(after) >= 5, "pings did not resume once the loop was free"
    assert listener.states("READY=1") and listener.states("STOPPING=1")
