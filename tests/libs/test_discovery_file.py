"""File-backend specifics: on-disk layout, garbage collection, stale heartbeats, unusable directories."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from pathlib import Path

import pytest
from kvmesh.discovery import DiscoveryUnavailable, default_file_root, instance_key, instance_prefix, open_discovery
from kvmesh.discovery import file as file_backend
from kvmesh.discovery.base import Added, Removed, Snapshot
from kvmesh.discovery.dir_watch import ChangeSignal
from kvmesh.discovery.file import FileDiscovery, _Scanner, _Store


async def test_layout_is_atomic_and_readable(tmp_path: Path, ns: str):
    d = await open_discovery(f"file://{tmp_path}", ttl=2)
    try:
        lease = await d.grant_lease()
        key = instance_key(ns, "worker", "generate", lease.id)
        await lease.put(key, b"\x00binary\nvalue")
        lease_file = tmp_path / "leases" / f"{lease.id:016x}.lease"
        meta = json.loads(lease_file.read_text())
        assert meta["id"] == f"{lease.id:x}" and meta["ttl"] == 2 and meta["pid"] == os.getpid()
        record = tmp_path / "kv" / "v1" / "instances" / ns / "worker" / "generate" / f"{lease.id:x}.rec"
        head, _, value = record.read_bytes().partition(b"\n")
        assert json.loads(head) == {"key": key, "lease": f"{lease.id:x}"} and value == b"\x00binary\nvalue"
        assert not [p for p in tmp_path.rglob(".*")], "no temp files left behind"
        before = lease_file.stat().st_mtime
        await asyncio.sleep(2 / 3 + 0.2)
        assert lease_file.stat().st_mtime > before, "the owner beats its lease file every TTL/3"
    finally:
        await d.close()


async def test_awkward_keys_map_to_distinct_files(tmp_path: Path):
    d = await open_discovery(f"file://{tmp_path}", ttl=2)
    keys = ["a/b", "a/b/c", "a/b.rec", "a/b.rec/c", "a//c", "a/./c", "a/../c", "a/.hidden", "a/" + "x" * 300, "a/%"]
    try:
        lease = await d.grant_lease()
        for i, k in enumerate(keys):
            await lease.put(k, str(i).encode())
        assert await d.get_prefix("a/") == {k: str(i).encode() for i, k in enumerate(keys)}
        assert await d.get_prefix("a/b") == {k: str(i).encode() for i, k in enumerate(keys) if k.startswith("a/b")}
        for p in (tmp_path / "kv").rglob("*"):
            assert p.resolve().is_relative_to((tmp_path / "kv").resolve()) and len(p.name) < 256
    finally:
        await d.close()


async def test_gc_removes_files_of_dead_owners_only(tmp_path: Path, ns: str):
    d = await open_discovery(f"file://{tmp_path}", ttl=0.5)
    assert isinstance(d, FileDiscovery)
    try:
        dead = await d.grant_lease()
        live = await d.grant_lease()
        dead_key = instance_key(ns, "worker", "generate", dead.id)
        live_key = instance_key(ns, "worker", "generate", live.id)
        await dead.put(dead_key, b"d")
        await live.put(live_key, b"l")
        dead._task.cancel()  # the owner "crashed": nobody beats its lease any more,
        dead._heart_stop.set()  # not even its heartbeat thread
        stale_tmp = tmp_path / "kv" / ".left-over.tmp"
        stale_tmp.write_bytes(b"x")
        os.utime(stale_tmp, (time.time() - 120, time.time() - 120))
        await asyncio.sleep(0.6)
        assert await d.get_prefix(instance_prefix(ns)) == {live_key: b"l"}, "dead after TTL, before any GC"
        await asyncio.sleep(1.0)  # past TTL + GC grace
        await asyncio.to_thread(d._store.gc)
        assert not (tmp_path / "leases" / f"{dead.id:016x}.lease").exists()
        assert (tmp_path / "leases" / f"{live.id:016x}.lease").exists()
        assert not d._store.record_path(dead_key).exists()
        assert d._store.record_path(live_key).exists()
        assert not stale_tmp.exists()
        assert await d.get_prefix(instance_prefix(ns)) == {live_key: b"l"}
    finally:
        await d.close()


async def test_stale_heartbeat_is_lost_and_never_resurrected(tmp_path: Path, ns: str):
    """A lease file not beaten within its TTL is dead for everyone: the owner re-grants instead of touching it."""
    d = await open_discovery(f"file://{tmp_path}", ttl=2)
    lost = asyncio.Event()
    renewed: list[int] = []

    async def on_renewed(new_id: int) -> None:
        renewed.append(new_id)

    try:
        lease = await d.grant_lease(on_lost=lost.set, on_renewed=on_renewed)
        old = lease.id
        key = instance_key(ns, "worker", "generate", 7)
        await lease.put(key, b"v")
        path = tmp_path / "leases" / f"{old:016x}.lease"
        os.utime(path, (time.time() - 10, time.time() - 10))
        await asyncio.wait_for(lost.wait(), 2)
        for _ in range(100):
            if renewed:
                break
            await asyncio.sleep(0.02)
        assert renewed == [lease.id] and lease.id != old and lease.alive
        assert not path.exists(), "the old lease is revoked after the re-grant"
        assert await d.get_prefix(instance_prefix(ns)) == {key: b"v"}
    finally:
        await d.close()


async def test_a_dead_lease_whose_mtime_is_in_the_future_still_dies_within_its_ttl(tmp_path: Path, ns: str):
    """A wall clock stepped back (NTP) leaves a killed owner's lease file with an mtime in the future.
    Watchers and the GC age a lease on their monotonic clocks from the last change of its mtime, so it
    dies a TTL later, not when the wall clock catches up with the mtime (an hour here)."""
    d = await open_discovery(f"file://{tmp_path}", ttl=1)
    store: _Store = d._store
    dead = store.grant(1.0)  # nobody beats it: its owner was killed right after the put
    key = instance_key(ns, "worker", "generate", 9)
    store.put(key, b"v", dead)
    future = time.time() + 3600
    os.utime(store.lease_path(dead), (future, future))
    events: asyncio.Queue[object] = asyncio.Queue()

    async def consume() -> None:
        async with contextlib.aclosing(d.list_and_watch(instance_prefix(ns))) as stream:
            async for event in stream:
                events.put_nowait(event)

    consumer = asyncio.create_task(consume())
    try:
        assert await asyncio.wait_for(events.get(), 5) == Snapshot({key: b"v"})
        started = time.monotonic()
        assert await asyncio.wait_for(events.get(), 5) == Removed(key)
        assert time.monotonic() - started < 3
        deadline = time.monotonic() + 6  # the GC: TTL + 1 s grace, swept every second
        while store.lease_path(dead).exists():
            assert time.monotonic() < deadline, "the GC kept a dead lease with a future mtime"
            await asyncio.sleep(0.1)
    finally:
        consumer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consumer
        await d.close()


async def test_lease_files_that_do_not_parse_or_never_expire_are_collected(tmp_path: Path):
    d = await open_discovery(f"file://{tmp_path}", ttl=1)
    try:
        junk = [tmp_path / "leases" / "notalease.lease", tmp_path / "leases" / f"{0xFF:016x}.lease"]
        for path in junk:
            path.write_text("xx")
        # A TTL that no expiry check can fail (NaN, Infinity, as Python's json writes them): it lived for good.
        for lease_id, ttl in ((0xFC, "NaN"), (0xFD, "Infinity")):
            junk.append(tmp_path / "leases" / f"{lease_id:016x}.lease")
            junk[-1].write_text(f'{{"ttl": {ttl}}}')
        fresh = tmp_path / "leases" / f"{0xFE:016x}.lease"  # as torn as the others, but maybe being written
        fresh.write_text("{")
        old = time.time() - 120
        for path in junk:
            os.utime(path, (old, old))
        deadline = time.monotonic() + 5
        while any(path.exists() for path in junk):
            assert time.monotonic() < deadline, "unparseable lease files outlived the GC"
            await asyncio.sleep(0.1)
        assert fresh.exists()
    finally:
        await d.close()


async def test_unusable_directory_is_reported_in_one_line(tmp_path: Path):
    not_a_dir = tmp_path / "plain-file"
    not_a_dir.write_text("x")
    t0 = time.monotonic()
    with pytest.raises(DiscoveryUnavailable) as err:
        await open_discovery(f"file://{not_a_dir}/sub")
    assert time.monotonic() - t0 < 1
    assert "\n" not in str(err.value) and str(not_a_dir) in str(err.value)


async def test_default_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_file_root() == tmp_path / "kvmesh-discovery"
    d = await open_discovery("file://", ttl=2)
    try:
        assert isinstance(d, FileDiscovery) and d.root == tmp_path / "kvmesh-discovery"
        assert (tmp_path / "kvmesh-discovery" / "leases").is_dir()
    finally:
        await d.close()


async def test_poll_interval_from_url(tmp_path: Path):
    d = await open_discovery(f"file://{tmp_path}?poll=0.25", ttl=2)
    try:
        assert isinstance(d, FileDiscovery) and d.poll_interval == 0.25
    finally:
        await d.close()
    with pytest.raises(ValueError, match="poll"):
        await open_discovery(f"file://{tmp_path}?poll=abc")


def _settle(directory: Path) -> None:
    """Backdate a record directory's mtime, as if nothing had changed in it for a while."""
    old = time.time() - 10
    os.utime(directory, (old, old))


def test_a_settled_directory_is_not_listed_again_yet_every_change_in_it_is_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A scan of an unchanged fleet costs directory stats, not file stats; any write still shows at once."""
    store = _Store(tmp_path)
    store.prepare()
    lease = store.grant(ttl=30)
    for i in range(3):
        store.put(f"fleet/engine/{i}", b"v0", lease)
    directory = store.scan_dir("fleet/engine/")
    scanner = _Scanner(store, "fleet/engine/")
    assert scanner.scan() == {f"fleet/engine/{i}": b"v0" for i in range(3)}

    listed: list[str] = []
    real_scandir = os.scandir

    def counting_scandir(path: str) -> object:
        listed.append(str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", counting_scandir)
    _settle(directory)
    scanner.scan()  # the directory's mtime moved (backdated): listed once more, now settled
    listed.clear()
    assert scanner.scan() == {f"fleet/engine/{i}": b"v0" for i in range(3)}
    assert str(directory) not in listed, "a settled, unchanged directory is not listed again"

    store.put("fleet/engine/1", b"v1", lease)  # a rewrite renames over the record: the directory changes
    store.delete("fleet/engine/2")
    store.put("fleet/engine/3", b"new", lease)
    assert scanner.scan() == {"fleet/engine/0": b"v0", "fleet/engine/1": b"v1", "fleet/engine/3": b"new"}
    assert str(directory) in listed

    store.put("fleet/engine/0", b"v2", lease)  # changed again within the settling margin: still seen
    assert scanner.scan()["fleet/engine/0"] == b"v2"


def test_an_unchanged_fleet_is_scanned_per_lease_yet_an_expired_lease_drops_its_records_at_once(tmp_path: Path):
    """With every directory settled and unchanged, a scan reuses the previous walk (the same list) and
    checks each lease once, not each record; a lease going stale still removes its records from the
    next scan, though no directory changed."""
    store = _Store(tmp_path)
    store.prepare()
    alive, dying = store.grant(ttl=30), store.grant(ttl=30)
    for i in range(3):
        store.put(f"fleet/engine/a{i}", b"a", alive)
        store.put(f"fleet/engine/d{i}", b"d", dying)
    scanner = _Scanner(store, "fleet/engine/")
    _settle(store.scan_dir("fleet/engine/"))
    scanner.scan()  # listed once more after the backdating, now settled
    walked = scanner.records()
    assert scanner.records() is walked, "an unchanged fleet is not walked record by record again"
    assert set(scanner.scan()) == {f"fleet/engine/{p}{i}" for p in "ad" for i in range(3)}

    stale = time.time() - 60  # the dying lease's owner stopped beating a minute ago (TTL 30 s)
    os.utime(tmp_path / "leases" / f"{dying:016x}.lease", (stale, stale))
    assert set(scanner.scan()) == {f"fleet/engine/a{i}" for i in range(3)}
    assert scanner.records() is walked, "the directory did not change: the walk is still reused"

    store.put("fleet/engine/a1", b"a2", alive)  # any change in the directory: walked again, and seen
    assert scanner.scan()["fleet/engine/a1"] == b"a2"
    assert scanner.records() is not walked


def test_the_gc_finds_dead_records_through_its_scanner_and_removes_unreadable_ones(tmp_path: Path):
    store = _Store(tmp_path)
    store.prepare()
    live, dead = store.grant(ttl=30), store.grant(ttl=0.1)
    store.put("fleet/engine/live", b"l", live)
    store.put("fleet/engine/dead", b"d", dead)
    junk = store.record_path("fleet/engine/junk")
    junk.write_bytes(b"no header line")
    store.gc()  # the dead lease has not expired yet: nothing goes
    assert {p.name for p in junk.parent.iterdir()} == {"live.rec", "dead.rec"}
    time.sleep(0.1 + 1.2)  # the dead lease's TTL and the GC's grace
    _settle(junk.parent)
    store.gc()
    assert {p.name for p in junk.parent.iterdir()} == {"live.rec"}


async def test_a_watched_unchanged_fleet_is_not_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A watch reads each record once. The etcd backend's periodic check of a watched view (every T/2)
    does not run here: it re-read every record of the prefix from a cold cache, and this backend's poll
    is itself the scan, with nothing in between to stall."""
    d = await open_discovery(f"file://{tmp_path}", ttl=2)  # an etcd watch would be checked every 1 s
    try:
        lease = await d.grant_lease()
        for i in range(20):
            await lease.put(f"fleet/engine/{i}", b"v")
        reads: list[str] = []
        real_read = _Store.read_record

        def counting_read(path: str) -> tuple[str, int, bytes]:
            reads.append(path)
            return real_read(path)

        monkeypatch.setattr(_Store, "read_record", staticmethod(counting_read))
        events: asyncio.Queue[object] = asyncio.Queue()

        async def consume() -> None:  # a consumer always waiting for the next event, as a router's is
            async with contextlib.aclosing(d.list_and_watch("fleet/engine/")) as stream:
                async for event in stream:
                    events.put_nowait(event)

        consumer = asyncio.create_task(consume())
        try:
            snapshot = await asyncio.wait_for(events.get(), 5)
            assert isinstance(snapshot, Snapshot) and len(snapshot.records) == 20
            await asyncio.sleep(2.5)  # two check intervals of an etcd watch; 25 polls; the GC's first pass
            watch_reads = [p for p in reads if "/fleet/engine/" in p]
            # the watch's first scan (20) and the GC's own first pass (20): nothing read twice by either
            assert len(watch_reads) <= 40 and len(set(watch_reads)) == 20, f"{len(watch_reads)} reads of 20 records"
            before = len(reads)
            await lease.put("fleet/engine/3", b"w")  # a change is still seen
            assert await asyncio.wait_for(events.get(), 5) == Added("fleet/engine/3", b"w")
            assert len(reads) - before <= 2, "only the changed record is read again (by the watch, maybe the GC)"
        finally:
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer
    finally:
        await d.close()


def _inotify_instances_watching(directory: Path) -> int:
    """inotify instances of this process with a watch on ``directory`` (from ``/proc/self/fdinfo``)."""
    inode = f" ino:{os.stat(directory).st_ino:x} "
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify":
                count += inode in Path(f"/proc/self/fdinfo/{fd}").read_text()
    return count


async def test_every_watch_of_a_process_shares_one_inotify_instance_and_the_last_closes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The kernel allows 128 inotify instances per user by default, and a mesh's daemons run as one user
    with several watches each. 140 watches of one process hold one instance between them, each is still
    woken by inotify (an idle second costs no scans, a change is seen), and the last one to close closes
    the instance."""
    monkeypatch.setattr(file_backend, "_IDLE_RESCAN_S", 60.0)  # no safety-net scan within this test
    scans: list[str] = []
    real_scan = _Scanner.scan

    def counted_scan(self: _Scanner) -> dict[str, bytes]:
        scans.append(self.prefix)
        return real_scan(self)

    monkeypatch.setattr(_Scanner, "scan", counted_scan)
    d = await open_discovery(f"file://{tmp_path}", ttl=30)
    store: _Store = d._store
    live = store.grant(30.0)
    prefixes = [f"pool{i}/" for i in range(140)]
    for prefix in prefixes:
        store.put(f"{prefix}engine/0", b"v", live)
    events: dict[str, asyncio.Queue[object]] = {prefix: asyncio.Queue() for prefix in prefixes}

    async def consume(prefix: str) -> None:
        async with contextlib.aclosing(d.list_and_watch(prefix)) as stream:
            async for event in stream:
                events[prefix].put_nowait(event)

    consumers = [asyncio.create_task(consume(prefix)) for prefix in prefixes]
    try:
        for prefix in prefixes:
            assert await asyncio.wait_for(events[prefix].get(), 30) == Snapshot({f"{prefix}engine/0": b"v"})
        assert _inotify_instances_watching(store.leases) == 1  # every watch watches the lease directory
        idle_from = len(scans)
        await asyncio.sleep(1.0)
        assert len(scans) - idle_from <= 10, f"{len(scans) - idle_from} scans by 140 idle watches in 1 s"
        store.put("pool77/engine/1", b"w", live)
        assert await asyncio.wait_for(events["pool77/"].get(), 5) == Added("pool77/engine/1", b"w")
        assert all(events[prefix].empty() for prefix in prefixes)
    finally:
        for consumer in consumers:
            consumer.cancel()
        await asyncio.gather(*consumers, return_exceptions=True)
        await d.close()
    assert _inotify_instances_watching(store.leases) == 0


async def test_a_watched_directory_that_is_deleted_leaves_no_watch_behind(tmp_path: Path):
    """The kernel drops the watch of a deleted directory; the shared instance forgets it too, so a
    long-lived daemon whose record directories come and go does not accumulate dead watches."""
    leases, records = tmp_path / "leases", tmp_path / "kv" / "engine"
    leases.mkdir()
    records.mkdir(parents=True)
    signal = ChangeSignal.open(leases)
    assert signal is not None
    shared = signal._shared
    try:
        assert signal.cover([(str(records), records.stat().st_ino)]) is True
        assert shared.watch_count == 2  # the lease directory and the record directory
        records.rmdir()
        await signal.wait(5)  # woken by the deletion itself
        signal.drain()
        assert shared.watch_count == 1
        assert signal.cover([]) is False  # forgetting it is a no-op now
    finally:
        signal.close()
    assert shared.watch_count == 0 and _inotify_instances_watching(leases) == 0


@pytest.mark.parametrize("notified", [True, False], ids=["inotify", "polling"])
async def test_a_watch_is_woken_by_changes_and_by_expiry_not_by_the_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, notified: bool
):
    """An idle watch does not scan every poll interval: inotify wakes it for a new record (in a
    directory made after the watch started, too) and for a revoked lease, and it wakes by itself when a
    lease holding records can first go stale. Heartbeats wake nobody. Where inotify is missing, the
    scan runs every poll interval instead, and sees the same."""
    monkeypatch.setattr(file_backend, "_IDLE_RESCAN_S", 60.0)  # no safety-net scan within this test
    if not notified:
        monkeypatch.setattr(file_backend.ChangeSignal, "open", classmethod(lambda cls, lease_dir: None))
    scans: list[float] = []
    real_scan = _Scanner.scan

    def counted_scan(self: _Scanner) -> dict[str, bytes]:
        scans.append(time.monotonic())
        return real_scan(self)

    monkeypatch.setattr(_Scanner, "scan", counted_scan)
    d = await open_discovery(f"file://{tmp_path}", ttl=30)
    store: _Store = d._store
    live = store.grant(30.0)
    store.put("fleet/engine/0", b"v", live)
    events: asyncio.Queue[object] = asyncio.Queue()

    async def consume() -> None:
        async with contextlib.aclosing(d.list_and_watch("fleet/")) as stream:
            async for event in stream:
                events.put_nowait(event)

    consumer = asyncio.create_task(consume())
    try:
        assert await asyncio.wait_for(events.get(), 5) == Snapshot({"fleet/engine/0": b"v"})
        before = len(scans)
        for _ in range(4):  # 2 s of heartbeats
            store.keepalive(live, 30.0)
            await asyncio.sleep(0.5)
        idle_scans = len(scans) - before
        if notified:
            assert idle_scans <= 1, f"{idle_scans} scans in 2 idle seconds"
        else:
            assert idle_scans >= 5, f"polling every 0.1 s, yet {idle_scans} scans in 2 s"  # ~20 when not loaded

        store.put("fleet/router/sub/1", b"r", live)  # new directories under the prefix
        assert await asyncio.wait_for(events.get(), 5) == Added("fleet/router/sub/1", b"r")

        short = store.grant(1.0)  # nobody beats it: its owner died after the put
        store.put("fleet/engine/9", b"x", short)
        assert await asyncio.wait_for(events.get(), 5) == Added("fleet/engine/9", b"x")
        assert await asyncio.wait_for(events.get(), 5) == Removed("fleet/engine/9")  # 1 s later, by expiry

        store.revoke(live)
        gone = {await asyncio.wait_for(events.get(), 5), await asyncio.wait_for(events.get(), 5)}
        assert gone == {Removed("fleet/engine/0"), Removed("fleet/router/sub/1")}
    finally:
        consumer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consumer
        await d.close()
