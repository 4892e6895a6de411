"""``kvmesh up`` (what ``make run`` runs) as a subprocess, for the tests that start the whole local mesh.

Its output is read by a thread to the end, so a full pipe can never stall the mesh or its shutdown, and
every failure message carries everything it printed so far.
"""

from __future__ import annotations

import queue
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from types import TracebackType

from tests.support.daemons import script, stop_process


class KvmeshUp:
    """``with KvmeshUp([...]) as up: up.wait_for("demo request", 120); assert up.stop() == 0``."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.args = [script("kvmesh"), "up", *args]
        self.env = env
        self.lines: list[str] = []
        self._output: queue.Queue[str] = queue.Queue()
        self.proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> KvmeshUp:
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env
        )
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()
        return self

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._output.put(line)

    @property
    def text(self) -> str:
        """Everything printed so far (what a failure message shows)."""
        self._drain()
        return "".join(self.lines)

    def _drain(self) -> None:
        while True:
            try:
                self.lines.append(self._output.get_nowait())
            except queue.Empty:
                return

    def wait_for(self, text: str, timeout: float, *, at_start: bool = True) -> str:
        """The first output line starting with ``text`` (containing it, without ``at_start``); fails if
        ``kvmesh up`` exits or ``timeout`` passes first."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            found = next((line for line in self.lines if (line.startswith(text) if at_start else text in line)), None)
            if found is not None:
                return found
            assert time.monotonic() < deadline, f"no {text!r} line within {timeout:g}s:\n{self.text}"
            assert self.proc.poll() is None, f"kvmesh up exited ({self.proc.returncode}):\n{self.text}"
            try:
                self.lines.append(self._output.get(timeout=1))
            except queue.Empty:
                continue

    def stop(self, timeout: float = 90.0) -> int:
        """Ctrl-C, and the exit status (``kvmesh up`` SIGKILLs a daemon after its drain and 15 s; the rest is
        process exit on a loaded machine)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc is not None:  # a failed test: still stop its daemons (Ctrl-C) before killing
            stop_process(self.proc, signal.SIGINT, 30)
        if self._reader is not None:
            self._reader.join(10)
