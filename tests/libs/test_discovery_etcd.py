"""etcd-only discovery behaviour: outage and recovery, watch resync, failover, unreachable servers."""

from __future__ import annotations

import asyncio
import itertools
import socket
import time

import aetcd
import pytest
from kvmesh.discovery import (
    Discovery,
    DiscoveryUnavailable,
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


async def test_etcd_outage_lease_lost_then_regranted_without_restart(etcd_server: EtcdServer, ns: str, tracker):
    """etcd down for 2xTTL, restarted on the same data dir: lost while down, new lease after, watchers converge."""
    daemon = await open_discovery(etcd_server.url, ttl=TTL)
    observer = await open_discovery(etcd_server.url, ttl=TTL)
    lost_at: list[float] = []
    renewed: list[tuple[float, int]] = []
    samples: list[tuple[float, bool]] = []

    async def on_renewed(new_id: int) -> None:
        renewed.append((time.monotonic(), new_id))

    async def sample() -> None:
        while True:
            samples.append((time.monotonic(), lease.alive))
            await asyncio.sleep(0.02)

    sampler = None
    try:
        lease = await daemon.grant_lease(on_lost=lambda: lost_at.append(time.monotonic()), on_renewed=on_renewed)
        old_id = lease.id
        key = instance_key(ns, "worker", "generate", old_id)
        await lease.put(key, b"v1")
        watch = await tracker(observer, instance_prefix(ns))
        sampler = asyncio.get_running_loop().create_task(sample())
        await asyncio.sleep(0.1)
        down = time.monotonic()
        etcd_server.stop()

        # Before the deadline the lease is still trusted, but a write fails loudly and stays remembered.
        early = instance_key(ns, "worker", "early", old_id)
        with pytest.raises(DiscoveryUnavailable):
            await lease.put(early, b"written while etcd was down")

        await asyncio.sleep(2 * TTL)
        assert lease.losses == 1 and len(lost_at) == 1 and not lease.alive
        assert lost_at[0] - down <= TTL, f"loss reported {lost_at[0] - down:.2f}s after etcd went down"
        # While lost, writes are only remembered and published by the re-grant.
        late = instance_key(ns, "worker", "late", old_id)
        await lease.put(late, b"written while lost")

        up = time.monotonic()
        etcd_server.start()
        deadline = time.monotonic() + 10
        while not renewed:
            assert time.monotonic() < deadline, "no re-grant after etcd came back"
            await asyncio.sleep(0.02)
        sampler.cancel()
        t_renewed, new_id = renewed[0]
        assert new_id == lease.id != old_id and lease.alive
        assert t_renewed - up < 3.0, f"re-grant took {t_renewed - up:.2f}s after etcd was back"

        # The daemon-side flag was False for the whole outage window, from loss to re-grant.
        outage = [alive for t, alive in samples if lost_at[0] <= t < up]
        assert outage and not any(outage)
        assert not any(alive for t, alive in samples if t >= lost_at[0] and t < t_renewed - 0.05)
        flips = [a for (_, a), (_, b) in itertools.pairwise(samples) if a != b]
        assert flips == [True, False][: len(flips)] and len(flips) <= 2

        # Watchers converge on the new lease's records; the old lease was revoked by the keeper.
        want = {key: b"v1", early: b"written while etcd was down", late: b"written while lost"}
        await watch.wait_for(lambda s: s == want, 5, "records re-published")
        assert watch.snapshots >= 2, "the watcher must re-list after the reconnect"
        info = await observer._conn.client.get_lease_info(old_id)
        assert info.TTL == -1, "the old lease must be revoked, not left to expire"
        assert await observer.get_prefix(instance_prefix(ns)) == want
    finally:
        if sampler is not None:
            sampler.cancel()
        await daemon.close()
        await observer.close()


async def test_watch_resyncs_after_compaction(etcd_server: EtcdServer, ns: str):
    """A watch whose start revision was compacted away re-lists and yields a fresh Snapshot."""
    disc = await open_discovery(etcd_server.url, ttl=TTL)
    raw = aetcd.Client("127.0.0.1", etcd_server.client_port)
    prefix = instance_prefix(ns)
    try:
        await raw.put(f"{prefix}a".encode(), b"1")
        events = disc.list_and_watch(prefix)
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


async def test_frozen_etcd_counts_as_lost(etcd_server: EtcdServer, ns: str):
    """SIGSTOPped etcd (no errors, just silence): calls time out and the lease is declared lost in time."""
    disc: Discovery = await open_discovery(etcd_server.url, ttl=TTL, connect_timeout=1.0)
    lost_at: list[float] = []
    try:
        lease = await disc.grant_lease(on_lost=lambda: lost_at.append(time.monotonic()))
        await lease.put(instance_key(ns, "worker", "generate", lease.id), b"v")
        frozen = time.monotonic()
        etcd_server.freeze()
        try:
            while not lost_at and time.monotonic() - frozen < TTL + 1:
                await asyncio.sleep(0.02)
            assert lost_at and lost_at[0] - frozen <= TTL, "loss not detected while etcd was frozen"
        finally:
            etcd_server.thaw()
        deadline = time.monotonic() + 5
        while not lease.alive:
            assert time.monotonic() < deadline, "no re-grant after etcd thawed"
            await asyncio.sleep(0.02)
    finally:
        await disc.close()


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
