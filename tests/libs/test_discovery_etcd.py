"""etcd-only discovery behaviour: outage and recovery, watch resync, failover, unreachable servers."""

from __future__ import annotations

import asyncio
import shutil
import socket
import time

import aetcd
import grpc
import pytest
from kvmesh.discovery import (
    Discovery,
    DiscoveryUnavailable,
    Removed,
    Snapshot,
    instance_key,
    instance_prefix,
    open_discovery,
)

try:
    from tests.support.etcd import EtcdServer, free_port
except ImportError:  # Bazel runs tests/libs without tests/support; every test here is deselected there
    EtcdServer = free_port = None

pytestmark = pytest.mark.etcd

TTL = 2.0


async def test_etcd_outage_keeps_the_registration_and_publishes_writes_when_back(
    etcd_server: EtcdServer, ns: str, tracker
):
    """Issue 14 item 1: etcd down for 3xTTL. The lease is never declared lost by the daemon's own clock
    (it only stops being ``proven``); writes made meanwhile fail loudly, stay remembered and land once
    etcd is back; the record keeps its key, so watchers see the same instance."""
    daemon = await open_discovery(etcd_server.url, ttl=TTL)
    observer = await open_discovery(etcd_server.url, ttl=TTL)
    lost_at: list[float] = []
    try:
        lease = await daemon.grant_lease(on_lost=lambda: lost_at.append(time.monotonic()))
        key = instance_key(ns, "worker", "generate", lease.id)
        await lease.put(key, b"v1")
        watch = await tracker(observer, instance_prefix(ns))
        await watch.wait_for(lambda s: key in s, 2, "record")
        etcd_server.stop()
        early = instance_key(ns, "worker", "early", lease.id)
        with pytest.raises(DiscoveryUnavailable):
            await lease.put(early, b"written while etcd was down")
        await asyncio.sleep(3 * TTL)
        assert not lease.proven, "no keepalive can have succeeded"
        assert not lost_at and lease.alive, "the daemon's clock alone must never drop the registration"
        assert watch.state.get(key) == b"v1", "watchers keep the membership they last saw"
        up = time.monotonic()
        etcd_server.start()
        want = {key: b"v1", early: b"written while etcd was down"}
        await watch.wait_for(lambda s: s == want, 10, "records back, with the write made during the outage")
        deadline = time.monotonic() + 5
        while not lease.proven:
            assert time.monotonic() < deadline, "keepalive did not resume after etcd came back"
            await asyncio.sleep(0.05)
        assert time.monotonic() - up < 8
        # etcd restores leases on restart, so here the same lease simply goes on; had it expired, the
        # keeper would re-register the same keys (test_lease_revoked_behind_the_keepers_back_is_regranted)
        assert await observer.get_prefix(instance_prefix(ns)) == want
    finally:
        await daemon.close()
        await observer.close()


async def test_watch_resyncs_after_compaction(etcd_server: EtcdServer, ns: str):
    """A watch whose start revision was compacted away re-lists and yields a fresh Snapshot."""
    disc = await open_discovery(etcd_server.url, ttl=TTL)
    raw = aetcd.Client("127.0.0.1", etcd_server.client_port)
    prefix = instance_prefix(ns)
    try:
        await raw.put(f"{prefix}a".encode(), b"1")
        events = disc._watch(prefix)  # the backend's own stream: it is lazy, list_and_watch reads ahead
        first = await events.__anext__()
        assert first == Snapshot({f"{prefix}a": b"1"})
        # The generator is parked after the Snapshot: no watch exists yet. Change things, then compact.
        await raw.put(f"{prefix}b".encode(), b"2")
        await raw.delete(f"{prefix}a".encode())
        rev = (await raw.put(f"{prefix}c".encode(), b"3")).header.revision
        await raw.compact(rev)
        nxt = await asyncio.wait_for(events.__anext__(), 5)
        assert nxt == Snapshot({f"{prefix}b": b"2", f"{prefix}c": b"3"})
        await raw.put(f"{prefix}d".encode(), b"4")
        added = await asyncio.wait_for(events.__anext__(), 5)
        assert (added.key, added.value) == (f"{prefix}d", b"4")
        await events.aclose()
    finally:
        await raw.close()
        await disc.close()


async def test_watch_resyncs_after_reconnect(etcd_server: EtcdServer, ns: str, tracker):
    disc = await open_discovery(etcd_server.url, ttl=TTL)
    prefix = instance_prefix(ns)
    try:
        watch = await tracker(disc, prefix)
        etcd_server.stop()
        await asyncio.sleep(0.3)
        etcd_server.start()
        writer = await open_discovery(etcd_server.url, ttl=TTL)
        try:
            lease = await writer.grant_lease()
            await lease.put(f"{prefix}x", b"after restart")
            await watch.wait_for(lambda s: s == {f"{prefix}x": b"after restart"}, 5, "post-restart record")
            assert watch.snapshots >= 2
            await lease.revoke()
            await watch.wait_for(lambda s: s == {}, 3, "record revoked")
        finally:
            await writer.close()
    finally:
        await disc.close()


async def test_failover_to_next_endpoint(tmp_path, ns: str, tracker):
    """etcd://A,B: uses A; when A dies the keeper and the watchers move to B (lease re-granted there)."""
    with EtcdServer(tmp_path / "a") as a, EtcdServer(tmp_path / "b") as b:
        disc = await open_discovery(f"etcd://{a.endpoint},{b.endpoint}", ttl=TTL)
        on_b = await open_discovery(b.url, ttl=TTL)
        renewed = asyncio.Event()

        async def on_renewed(new_id: int) -> None:
            renewed.set()

        try:
            assert disc.endpoint == a.endpoint
            lease = await disc.grant_lease(on_renewed=on_renewed)
            key = instance_key(ns, "router", "route", lease.id)
            await lease.put(key, b"r")
            watch = await tracker(disc, instance_prefix(ns))
            a.stop()
            await asyncio.wait_for(renewed.wait(), TTL + 5)
            assert disc.endpoint == b.endpoint
            assert await on_b.get_prefix(instance_prefix(ns)) == {key: b"r"}
            await watch.wait_for(lambda s: s == {key: b"r"}, 3, "watcher re-listed on B")
        finally:
            await disc.close()
            await on_b.close()


async def test_a_prefix_over_grpcs_default_4_mib_is_listed_and_watched(shared_etcd: EtcdServer, ns: str):
    """A prefix is listed in one etcd response: 5000 records of 1 KB (a worker's 5000 engines' model cards)
    went past gRPC's default 4 MiB receive limit, get_prefix failed and a watch never gave its Snapshot."""
    prefix = instance_prefix(ns)
    value = b"x" * 1024
    raw = aetcd.Client("127.0.0.1", shared_etcd.client_port)
    disc = await open_discovery(shared_etcd.url, ttl=TTL)
    try:
        for start in range(0, 5000, 500):
            await asyncio.gather(*(raw.put(f"{prefix}{i:05d}".encode(), value) for i in range(start, start + 500)))
        listed = await disc.get_prefix(prefix)
        assert len(listed) == 5000 and set(listed.values()) == {value}
        events = disc.list_and_watch(prefix)
        first = await asyncio.wait_for(events.__anext__(), 10)
        assert isinstance(first, Snapshot) and len(first.records) == 5000
        await events.aclose()
    finally:
        await raw.delete_prefix(prefix.encode())
        await raw.close()
        await disc.close()


async def test_first_reachable_endpoint_is_used(shared_etcd: EtcdServer):
    dead = free_port()
    disc = await open_discovery(f"etcd://127.0.0.1:{dead},{shared_etcd.endpoint}", connect_timeout=2)
    try:
        assert disc.endpoint == shared_etcd.endpoint
        assert isinstance(await disc.get_prefix("v1/nothing/"), dict)
    finally:
        await disc.close()


async def test_unreachable_etcd_fails_fast_with_one_line():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(DiscoveryUnavailable) as err:
        await open_discovery(f"etcd://127.0.0.1:{port}", connect_timeout=1.0)
    assert time.monotonic() - t0 < 2.0
    msg = str(err.value)
    assert "\n" not in msg and f"127.0.0.1:{port}" in msg and "etcd" in msg


async def test_silent_etcd_times_out_within_connect_timeout():
    """A port that accepts TCP but never speaks HTTP/2 (a hung server): bounded by connect_timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        port = s.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(DiscoveryUnavailable) as err:
            await open_discovery(f"etcd://127.0.0.1:{port}", connect_timeout=1.0)
        assert time.monotonic() - t0 < 2.0
        assert "\n" not in str(err.value)


async def test_frozen_etcd_is_survived_and_the_record_comes_back_under_its_key(etcd_server: EtcdServer, ns: str):
    """SIGSTOPped etcd for 2xTTL (no errors, just silence): beats time out, the lease is not proven but the
    daemon keeps its registration; after SIGCONT it is registered again under the same key within a few
    seconds, whether etcd kept the lease or expired it (then the keeper re-grants)."""
    disc: Discovery = await open_discovery(etcd_server.url, ttl=TTL, connect_timeout=1.0)
    try:
        lease = await disc.grant_lease()
        key = instance_key(ns, "worker", "generate", lease.id)
        await lease.put(key, b"v")
        etcd_server.freeze()
        try:
            await asyncio.sleep(2 * TTL)
            assert not lease.proven
        finally:
            etcd_server.thaw()
        deadline = time.monotonic() + 8
        while not (lease.proven and (await _get_or_none(disc, instance_prefix(ns))) == {key: b"v"}):
            assert time.monotonic() < deadline, f"not registered again after etcd thawed: {lease!r}"
            await asyncio.sleep(0.05)
        assert lease.losses <= 1
    finally:
        await disc.close()


async def test_a_revoke_with_etcd_frozen_waits_one_call_timeout_not_a_beats_too(etcd_server: EtcdServer):
    """A daemon's drain revokes its lease: with etcd hung and a keepalive in flight, the revoke waited for
    the beat to time out first, then timed out itself, overrunning --drain-timeout by both (6 s here)."""
    disc = await open_discovery(etcd_server.url, ttl=9.0, connect_timeout=3.0)  # a beat every 3 s, 3 s timeout
    try:
        lease = await disc.grant_lease()
        granted = time.monotonic()
        etcd_server.freeze()
        try:
            await asyncio.sleep(granted + 3.5 - time.monotonic())  # the first beat is in flight, unanswered
            started = time.monotonic()
            await lease.revoke()  # never raises: the records then expire within the TTL
            assert time.monotonic() - started < 4.0  # the revoke's own 3 s (it was 4.5-6 s)
        finally:
            etcd_server.thaw()
    finally:
        await disc.close()


async def test_mass_expiry_after_a_frozen_etcd_is_invisible_to_watchers(etcd_server: EtcdServer, ns: str, tracker):
    """A SIGSTOPped etcd expires every lease at once when it resumes; the owners, all alive, re-register
    within a second. A watcher that lost contact meanwhile holds those removals for ``removal_grace``:
    it never sees the key vanish. A removal while etcd is reachable (an owner's revoke) passes at once."""
    daemon = await open_discovery(etcd_server.url, ttl=TTL, connect_timeout=1.0)
    observer = await open_discovery(etcd_server.url, ttl=TTL, connect_timeout=1.0)
    try:
        lease = await daemon.grant_lease()
        await observer.grant_lease()  # every daemon holds one: it is how a watcher notices the outage
        key = instance_key(ns, "worker", "generate", lease.id)
        await lease.put(key, b"v")
        watch = await tracker(observer, instance_prefix(ns))
        await watch.wait_for(lambda s: key in s, 2, "record")
        etcd_server.freeze()
        try:
            await asyncio.sleep(2 * TTL)
        finally:
            etcd_server.thaw()
        deadline = time.monotonic() + 8
        while not lease.proven:
            assert time.monotonic() < deadline, f"owner not registered again: {lease!r}"
            await asyncio.sleep(0.05)
        await asyncio.sleep(observer.removal_grace + 0.5)
        assert not [ev for _, ev in watch.log if isinstance(ev, Removed)], "watchers saw the live owner vanish"
        assert watch.state == {key: b"v"}
        # reachable again for longer than TTL + grace: a real departure is seen at once
        await asyncio.sleep(TTL + observer.removal_grace)
        revoked = time.monotonic()
        await lease.revoke()
        gone = await watch.wait_for(lambda s: key not in s, 2, "record gone after revoke")
        assert gone - revoked < observer.removal_grace
    finally:
        await daemon.close()
        await observer.close()


async def test_short_blip_keeps_the_lease_and_retries_failed_writes(etcd_server: EtcdServer, ns: str):
    """etcd restarts well within the TTL: no loss, same lease id, and a write that failed meanwhile lands."""
    ttl = 5.0
    disc = await open_discovery(etcd_server.url, ttl=ttl, keepalive_interval=0.5)
    lost: list[float] = []
    try:
        lease = await disc.grant_lease(on_lost=lambda: lost.append(time.monotonic()))
        first_id = lease.id
        etcd_server.stop()
        key = instance_key(ns, "worker", "generate", first_id)
        with pytest.raises(DiscoveryUnavailable):
            await lease.put(key, b"v")
        etcd_server.start()
        deadline = time.monotonic() + 4
        while (await _get_or_none(disc, instance_prefix(ns))) != {key: b"v"}:
            assert time.monotonic() < deadline, "the failed write was not retried"
            await asyncio.sleep(0.05)
        assert not lost and lease.alive and lease.id == first_id and lease.losses == 0
    finally:
        await disc.close()


async def _get_or_none(disc: Discovery, prefix: str) -> dict[str, bytes] | None:
    try:
        return await disc.get_prefix(prefix)
    except DiscoveryUnavailable:
        return None


async def test_a_put_refused_for_a_vanished_lease_re_registers_instead_of_raising(etcd_server: EtcdServer, ns: str):
    """Issue 18: a daemon starting on a loaded machine saw its first lease expire before its first put;
    etcd answered "requested lease not found" and the daemon crashed. Now the put is remembered, the
    keeper re-grants at once and publishes it under the new lease."""
    disc = await open_discovery(etcd_server.url, ttl=10.0)  # no beat before the put: keepalive every 3.3 s
    admin = await open_discovery(etcd_server.url, ttl=TTL)
    renewed = asyncio.Event()

    async def on_renewed(new_id: int) -> None:
        renewed.set()

    try:
        lease = await disc.grant_lease(on_renewed=on_renewed)
        old_id = lease.id
        await admin._lease_revoke(old_id)  # the lease vanishes behind the keeper's back
        key = instance_key(ns, "frontend", "kserve", old_id)
        await lease.put(key, b"registered")  # refused by etcd, not raised
        await asyncio.wait_for(renewed.wait(), 5)
        assert lease.id != old_id and lease.losses == 1
        assert await admin.get_prefix(instance_prefix(ns)) == {key: b"registered"}
    finally:
        await disc.close()
        await admin.close()


async def test_a_watch_that_stalls_without_an_error_is_listed_again(
    etcd_server: EtcdServer, ns: str, tracker, caplog: pytest.LogCaptureFixture
):
    """etcd cancels the watch on its side and aetcd drops the ``canceled`` reply (it never tells the
    iterator): the stream is open and silent. The periodic check sees a write the watch never
    delivered, twice in a row, and restarts the cycle: the write arrives within about two intervals."""
    disc = await open_discovery(etcd_server.url, ttl=TTL)
    prefix = instance_prefix(ns)
    try:
        watch = await tracker(disc, prefix)
        client = disc._conn.client
        await asyncio.sleep(0.2)  # the watch is created after the first Snapshot
        watch_ids = list(client._watcher._callbacks)
        assert watch_ids, "the tracker's watch is registered"
        for watch_id in watch_ids:  # cancelled on the server only: aetcd keeps waiting on it
            await client._watcher._enqueue_watch_cancel(watch_id=watch_id)
        snapshots = watch.snapshots
        writer = await open_discovery(etcd_server.url, ttl=TTL)
        try:
            lease = await writer.grant_lease()
            await lease.put(f"{prefix}late", b"written while the watch was silent")
            interval = disc.watch_check_interval
            await watch.wait_for(lambda s: f"{prefix}late" in s, 2 * interval + 3, "the write, after a re-list")
            assert watch.snapshots > snapshots
            # the log line says where the stalled stream waited: in the etcd watch's event loop
            assert "stalled" in caplog.text and "_watch (etcd.py:" in caplog.text, caplog.text
        finally:
            await writer.close()
    finally:
        await disc.close()


async def test_a_call_whose_channel_is_closed_under_it_raises_a_stray_cancel_not_a_cancellation():
    """What froze frontends' model views after an etcd failover: grpc.aio ends a call in flight on a channel
    being closed (the client a failover replaced) with CancelledError, in a task nobody cancelled. Discovery
    tells it from a real cancellation (``stray_cancel``) and treats it as a connectivity failure."""
    from aetcd.rpc import rpc_pb2, rpc_pb2_grpc
    from kvmesh.discovery.errors import stray_cancel

    listener = socket.socket()  # accepts and never answers: the call stays in flight
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{listener.getsockname()[1]}")
    call = asyncio.ensure_future(rpc_pb2_grpc.KVStub(channel).Range(rpc_pb2.RangeRequest(key=b"k"), timeout=10))
    await asyncio.sleep(0.3)
    await channel.close()
    with pytest.raises(asyncio.CancelledError) as raised:
        await call
    assert stray_cancel(raised.value)
    listener.close()

    async def cancelled_for_real() -> bool:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError as exc:
            return stray_cancel(exc)
        return True

    task = asyncio.ensure_future(cancelled_for_real())
    await asyncio.sleep(0)
    task.cancel()
    assert await task is False


class _ResettingProxy:
    """A loopback TCP proxy to etcd whose connections can all be reset at once (a network blip, or an etcd
    restarted in no time): clients reconnect at once, on new streams."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self.port = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> _ResettingProxy:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer, up_writer)
        self.pairs.add(pair)

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                for end in pair:
                    end.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self.pairs.discard(pair)

    def reset(self) -> None:
        for pair in list(self.pairs):
            for end in pair:
                end.transport.abort()

    async def close(self) -> None:
        self.reset()
        if self.server is not None:
            self.server.close()


async def test_a_blip_leaves_every_watch_of_a_process_alive(etcd_server: EtcdServer, ns: str, tracker):
    """Several watches share one etcd stream (a router watches routers, engines and model cards). A blip
    ends the stream and each watch re-lists and watches anew on the next one, where etcd numbers watches
    from 0 again: a watch that then cancelled its old one by id cancelled a sibling's new watch, which
    then heard nothing until the stall check listed it again, T/2 to T later."""
    proxy = await _ResettingProxy(etcd_server.client_port).start()
    disc = await open_discovery(f"etcd://127.0.0.1:{proxy.port}", ttl=10.0)  # stall check: every 5 s
    writer = await open_discovery(etcd_server.url, ttl=TTL)
    prefixes = [instance_prefix(ns, component) for component in ("router", "worker", "frontend")]
    try:
        watches = [await tracker(disc, prefix) for prefix in prefixes]
        lease = await writer.grant_lease()
        for blip in range(6):
            proxy.reset()
            await asyncio.sleep(1.0)  # every watch is back on the new stream
            for prefix, watch in zip(prefixes, watches, strict=True):
                await lease.put(f"{prefix}k{blip}", b"x")
                await watch.wait_for(lambda s, k=f"{prefix}k{blip}": k in s, 2, f"blip {blip}: {prefix}")
    finally:
        await writer.close()
        await disc.close()
        await proxy.close()


async def test_an_etcd_restarted_empty_between_two_keepalives_is_invisible_to_watchers(
    etcd_server: EtcdServer, ns: str, tracker
):
    """An etcd restarted with its data lost, and back before the owners' next keepalive: nothing failed
    for them, so they learn that their leases are gone only then, up to ``K`` later, and re-register.
    Watchers re-list at once and must hold those removals until then (they held them for 1.5 s, and
    a router dropped every engine and the frontend every router for a moment: requests failed)."""
    ttl = 10.0  # K = 3.3 s: a restart of ~1 s falls between two keepalives
    owner = await open_discovery(etcd_server.url, ttl=ttl, connect_timeout=1.0)
    observer = await open_discovery(etcd_server.url, ttl=ttl, connect_timeout=1.0)
    try:
        lease = await owner.grant_lease()
        key = instance_key(ns, "worker", "generate", lease.id)
        await lease.put(key, b"v")
        watch = await tracker(observer, instance_prefix(ns))
        await watch.wait_for(lambda s: key in s, 2, "record")
        etcd_server.kill()
        shutil.rmtree(etcd_server.data_dir)
        etcd_server.start()
        snapshots = watch.snapshots
        deadline = time.monotonic() + 3 * ttl
        while not (lease.proven and await _get_or_none(owner, instance_prefix(ns))):
            assert time.monotonic() < deadline, f"the owner did not register again: {lease!r}"
            await asyncio.sleep(0.05)
        await watch.wait_for(lambda _s: watch.snapshots > snapshots, 5, "the watcher listed the empty etcd")
        await asyncio.sleep(0.5)
        assert not [ev for _, ev in watch.log if isinstance(ev, Removed)], "watchers saw the live owner vanish"
        assert list(watch.state.values()) == [b"v"]
    finally:
        await owner.close()
        await observer.close()
