"""Fixtures for the runtime-library tests: a real etcd, a discovery URL for every backend, a watcher
that keeps state (``tracker``) and a lease-owning child process (``owner``).

The helpers live here, not in a module, because Bazel runs each tests/libs file with only this
conftest beside it. ``tests.support.etcd`` is imported lazily for the same reason: under Bazel the
etcd tests are deselected (``-m "not etcd"``) and tests/support is not in the runfiles.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kvmesh.discovery import Added, Discovery, Removed, Snapshot, WatchEvent

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # make `tests.support` importable however pytest was started
    sys.path.insert(0, str(_REPO))


def _etcd_support() -> Any:
    try:
        from tests.support import etcd
    except ImportError:
        pytest.skip("tests/support is not available here (Bazel runs tests/libs without it)")
    if not etcd.etcd_available():
        pytest.skip("etcd binary not installed (apt-get install etcd-server)")
    return etcd


@pytest.fixture(scope="session")
def shared_etcd(tmp_path_factory: pytest.TempPathFactory):
    """One etcd for the whole session, for tests that do not stop it (isolate by key prefix)."""
    server = _etcd_support().EtcdServer(tmp_path_factory.mktemp("etcd-shared"))
    server.start()
    yield server
    server.close()


@pytest.fixture
def etcd_server(tmp_path: Path):
    """A private etcd on free loopback ports; ``stop()``/``start()`` keep its data dir and ports."""
    server = _etcd_support().EtcdServer(tmp_path / "etcd")
    server.start()
    yield server
    server.close()


@pytest.fixture(params=[pytest.param("etcd", marks=pytest.mark.etcd), "file"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def discovery_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """``etcd://127.0.0.1:PORT`` (the shared etcd) or ``file:///<tmp>/discovery``: every test runs on both."""
    if backend == "etcd":
        return request.getfixturevalue("shared_etcd").url
    return f"file://{tmp_path / 'discovery'}"


@pytest.fixture
def ns() -> str:
    """A namespace unique to the test, so tests sharing one etcd never see each other's keys."""
    return f"t{uuid.uuid4().hex[:12]}"


# -- watch and owner helpers -------------------------------------------------------------------


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
        except Exception as exc:  # e.g. DiscoveryError once the discovery is closed: reported by wait_for
            self.error = exc
            self._changed.set()

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


@pytest.fixture
async def tracker():
    """``watch = await tracker(disc, prefix)``: a started Tracker (first Snapshot seen), stopped at teardown."""
    started: list[Tracker] = []

    async def make(disc: Discovery, prefix: str) -> Tracker:
        t = await Tracker(disc, prefix).__aenter__()
        started.append(t)
        return t

    yield make
    for t in started:
        await t.stop()


@pytest.fixture
async def owner():
    """``o = await owner(url, key_template, ttl)``: a child process holding a lease; killed at teardown."""
    started: list[Owner] = []

    async def make(url: str, key: str, ttl: float) -> Owner:
        o = Owner(url, key, ttl)
        started.append(o)
        return await o.start()

    yield make
    for o in started:
        await o.close()
