"""Test helpers for discovery: a watcher that keeps state, and a lease-owning child process.

``Tracker`` consumes ``list_and_watch`` in a task and applies every event to ``state`` (a Snapshot
replaces it), logging (monotonic time, event). ``Owner`` runs a separate Python process that opens
discovery, takes a lease, publishes one record and prints READY/LOST/RENEWED lines, so tests can
kill -9 it, SIGSTOP it, or watch it recover.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from kvmesh.discovery import Added, Discovery, Removed, Snapshot, WatchEvent

__all__ = ["Owner", "Tracker"]


class Tracker:
    """``async with Tracker(disc, prefix) as t:`` -- waits for the first Snapshot."""

    def __init__(self, disc: Discovery, prefix: str) -> None:
        self.disc = disc
        self.prefix = prefix
        self.state: dict[str, bytes] = {}
        self.log: list[tuple[float, WatchEvent]] = []
        self.snapshots = 0
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.error: BaseException | None = None

    async def __aenter__(self) -> Tracker:
        self._task = asyncio.get_running_loop().create_task(self._run())
        await self.wait_for(lambda _: self.snapshots >= 1, 5.0, "first Snapshot")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            done, _ = await asyncio.wait([self._task], timeout=5)
            assert done, "the list_and_watch consumer ignored cancellation"
            self._task = None

    async def _run(self) -> None:
        try:
            async with contextlib.aclosing(self.disc.list_and_watch(self.prefix)) as events:
                async for ev in events:
                    self.log.append((time.monotonic(), ev))
                    if isinstance(ev, Snapshot):
                        self.snapshots += 1
                        self.state = dict(ev.records)
                    elif isinstance(ev, Added):
                        self.state[ev.key] = ev.value
                    elif isinstance(ev, Removed):
                        self.state.pop(ev.key, None)
                    self._changed.set()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self.error = exc
            self._changed.set()
            raise

    async def wait_for(self, pred: Callable[[dict[str, bytes]], bool], timeout: float, what: str = "") -> float:
        """Wait until ``pred(state)``; return the monotonic time it first held. Fails with the state."""
        deadline = time.monotonic() + timeout
        while True:
            if self.error is not None:
                raise AssertionError(f"watch failed: {self.error!r}")
            if pred(self.state):
                return time.monotonic()
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {timeout}s waiting for {what or pred}; state={self.state}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 0.05))

    def events_since(self, t: float) -> list[WatchEvent]:
        return [ev for ts, ev in self.log if ts >= t]


_OWNER = r"""
import asyncio, sys
from kvmesh.discovery import open_discovery

async def main(url, key, ttl):
    disc = await open_discovery(url, ttl=float(ttl))
    def lost():
        print("LOST", flush=True)
    async def renewed(new_id):
        print("RENEWED %x" % new_id, flush=True)
    lease = await disc.grant_lease(on_lost=lost, on_renewed=renewed)
    await lease.put(key.replace("{id}", "%x" % lease.id), b"owner")
    print("READY %x" % lease.id, flush=True)
    await asyncio.Event().wait()

asyncio.run(main(*sys.argv[1:]))
"""


class Owner:
    """A child process holding a lease and one record (``key`` may contain ``{id}`` = its lease id hex)."""

    def __init__(self, url: str, key: str, ttl: float) -> None:
        self.url, self.key_template, self.ttl = url, key, ttl
        self.proc: asyncio.subprocess.Process | None = None
        self.lease_id = 0
        self.lines: list[str] = []

    @property
    def key(self) -> str:
        return self.key_template.replace("{id}", f"{self.lease_id:x}")

    async def start(self, timeout: float = 15.0) -> Owner:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _OWNER, self.url, self.key_template, str(self.ttl),
            stdout=asyncio.subprocess.PIPE, stderr=None, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        line = await self.expect("READY", timeout)
        self.lease_id = int(line.split()[1], 16)
        return self

    async def expect(self, prefix: str, timeout: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"owner did not print {prefix!r} within {timeout}s; got {self.lines}")
            try:
                raw = await asyncio.wait_for(self.proc.stdout.readline(), left)
            except TimeoutError:
                continue
            if not raw:
                raise AssertionError(f"owner exited ({self.proc.returncode}) before {prefix!r}; got {self.lines}")
            line = raw.decode().strip()
            self.lines.append(line)
            if line.startswith(prefix):
                return line

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.kill()
            await self.proc.wait()

    async def __aenter__(self) -> Owner:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
