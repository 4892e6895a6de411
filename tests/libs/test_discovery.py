"""Discovery behaviour, the same suite on both backends (real etcd, real directory, real processes)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
from kvmesh.discovery import (
    Discovery,
    DiscoveryError,
    Removed,
    Snapshot,
    instance_key,
    instance_prefix,
    model_key,
    model_prefix,
    open_discovery,
)

TTL = 2.0


@pytest.fixture
async def disc(discovery_url: str):
    d = await open_discovery(discovery_url, ttl=TTL)
    yield d
    await d.close()


async def test_register_watch_delete(disc: Discovery, ns: str, tracker):
    lease = await disc.grant_lease()
    assert lease.alive and lease.id > 0
    pre = instance_key(ns, "worker", "generate", lease.id)
    await lease.put(pre, b"pre-existing")
    watch = await tracker(disc, instance_prefix(ns))
    first = watch.log[0][1]
    assert isinstance(first, Snapshot) and first.records == {pre: b"pre-existing"}

    card = model_key(ns, "Qwen/Qwen3-0.6B", lease.id)
    await lease.put(card, b"not under the watched prefix")
    router = instance_key(ns, "router", "route", lease.id)
    await lease.put(router, b"r1")
    await watch.wait_for(lambda s: s.get(router) == b"r1", 2.0, "Added router")
    await lease.put(router, b"r2")  # an update is an Added with the new value
    await watch.wait_for(lambda s: s.get(router) == b"r2", 2.0, "updated router")

    assert await disc.get_prefix(instance_prefix(ns, "router")) == {router: b"r2"}
    assert await disc.get_prefix(model_prefix(ns)) == {card: b"not under the watched prefix"}

    await lease.delete(pre)
    await watch.wait_for(lambda s: pre not in s, 2.0, "Removed pre")
    assert any(isinstance(ev, Removed) and ev.key == pre for _, ev in watch.log)
    assert watch.state == {router: b"r2"}
    assert lease.records == {router: b"r2", card: b"not under the watched prefix"}
    await lease.revoke()


async def test_revoke_removes_every_record_at_once(disc: Discovery, ns: str, tracker):
    lease = await disc.grant_lease()
    keys = [instance_key(ns, "worker", f"ep{i}", lease.id) for i in range(3)]
    for k in keys:
        await lease.put(k, b"x")
    other = await disc.grant_lease()
    survivor = instance_key(ns, "worker", "ep0", other.id)
    await other.put(survivor, b"other lease")
    watch = await tracker(disc, instance_prefix(ns))
    assert set(watch.state) == {*keys, survivor}
    t0 = time.monotonic()
    await lease.revoke()
    assert not lease.alive
    await watch.wait_for(lambda s: set(s) == {survivor}, 2.0, "all three removed")
    removed_at = [ts for ts, ev in watch.log if isinstance(ev, Removed)]
    assert len(removed_at) == 3
    assert max(removed_at) - min(removed_at) < 0.2, "records of one lease must vanish together"
    assert max(removed_at) - t0 < 1.0
    assert await disc.get_prefix(instance_prefix(ns)) == {survivor: b"other lease"}
    with pytest.raises(DiscoveryError):
        await lease.put(keys[0], b"after revoke")
    await lease.revoke()  # idempotent


async def test_kill9_owner_record_removed_within_ttl(disc: Discovery, discovery_url: str, ns: str, tracker, owner):
    watch = await tracker(disc, instance_prefix(ns))
    child = await owner(discovery_url, instance_key(ns, "worker", "generate", 0)[:-1] + "{id}", TTL)
    await watch.wait_for(lambda s: child.key in s, TTL + 1, "owner's record")
    killed = time.monotonic()
    child.signal(signal.SIGKILL)
    gone = await watch.wait_for(lambda s: child.key not in s, TTL + 3, "owner's record gone")
    assert gone - killed <= TTL + 1.0, f"record outlived its owner by {gone - killed:.2f}s"
    assert await disc.get_prefix(instance_prefix(ns)) == {}


async def test_frozen_owner_loses_lease_then_recovers_without_restart(
    disc: Discovery, discovery_url: str, ns: str, tracker, owner
):
    """SIGSTOP the owner for 2xTTL: its record expires; on SIGCONT it reports LOST, re-grants, re-publishes."""
    ttl = 1.0
    watch = await tracker(disc, instance_prefix(ns))
    child = await owner(discovery_url, instance_key(ns, "worker", "generate", 0)[:-1] + "{id}", ttl)
    key = child.key
    await watch.wait_for(lambda s: key in s, ttl + 1, "owner's record")
    child.signal(signal.SIGSTOP)
    frozen = time.monotonic()
    gone = await watch.wait_for(lambda s: key not in s, 2 * ttl + 2, "frozen owner's record gone")
    assert gone - frozen <= ttl + 1.0
    await asyncio.sleep(max(0.0, frozen + 2 * ttl - time.monotonic()))
    child.signal(signal.SIGCONT)
    await child.expect("LOST", 5)
    renewed = await child.expect("RENEWED", 5)
    new_id = int(renewed.split()[1], 16)
    assert new_id != child.lease_id
    assert child.lines[-2:] == ["LOST", renewed], child.lines  # lost exactly once, then renewed
    await watch.wait_for(lambda s: key in s, 3, "record re-published under the new lease")


async def test_lease_revoked_behind_the_keepers_back_is_regranted(discovery_url: str, ns: str, tracker):
    """The backend forgets the lease (etcdctl lease revoke / lease file deleted): lost, then a new lease."""
    d = await open_discovery(discovery_url, ttl=TTL)
    admin = await open_discovery(discovery_url, ttl=TTL)
    lost: list[float] = []
    renewed: list[int] = []
    got_renewed = asyncio.Event()

    async def on_renewed(new_id: int) -> None:
        assert lease.alive and lease.id == new_id
        renewed.append(new_id)
        got_renewed.set()

    try:
        lease = await d.grant_lease(on_lost=lambda: lost.append(time.monotonic()), on_renewed=on_renewed)
        old_id = lease.id
        key = instance_key(ns, "worker", "generate", old_id)  # keys stay; the lease under them changes
        await lease.put(key, b"v")
        # a leader's orders hold only while its lease does: not re-put (a new leader may have given its own)
        orders = instance_key(ns, "planner", "targets", old_id)
        await lease.put(orders, b"old orders", until_lost=True)
        watch = await tracker(admin, instance_prefix(ns))
        await admin._lease_revoke(old_id)
        await watch.wait_for(lambda s: key not in s, 2, "record gone with the lease")
        await asyncio.wait_for(got_renewed.wait(), TTL + 2)
        assert len(lost) == 1 and renewed == [lease.id] and lease.id != old_id
        assert lease.alive and lease.losses == 1
        await watch.wait_for(lambda s: s.get(key) == b"v", 2, "record back under the new lease")
        assert orders not in await admin.get_prefix(instance_prefix(ns)) and orders not in lease.records
        # the new lease really holds it: revoking it removes the record again
        await lease.revoke()
        await watch.wait_for(lambda s: key not in s, 2, "record gone after revoke")
    finally:
        await d.close()
        await admin.close()


async def test_a_put_under_a_lease_the_backend_dropped_is_kept_for_the_new_lease(discovery_url: str, ns: str, tracker):
    """The lease expired or was revoked before the keeper noticed (a frozen or loaded daemon): a put under it
    is no failure (the file backend raised, so a daemon's register() crashed; etcd did not): the record is
    remembered and published with the re-granted lease."""
    d = await open_discovery(discovery_url, ttl=TTL)
    admin = await open_discovery(discovery_url, ttl=TTL)
    try:
        lease = await d.grant_lease()
        first, second = (instance_key(ns, "worker", name, lease.id) for name in ("a", "b"))
        await lease.put(first, b"1")
        await admin._lease_revoke(lease.id)
        await lease.put(second, b"2")  # no exception, whichever moment the keeper notices
        watch = await tracker(admin, instance_prefix(ns))
        await watch.wait_for(lambda s: s == {first: b"1", second: b"2"}, TTL + 3, "both records, new lease")
        async with asyncio.timeout(TTL):  # the keeper says it is alive again once every record is back
            while not lease.alive:
                await asyncio.sleep(0.01)
        assert lease.losses == 1
    finally:
        await d.close()
        await admin.close()


async def test_records_deleted_behind_a_live_lease_are_published_again(discovery_url: str, ns: str):
    """Someone deletes a serving daemon's records (etcdctl del, a wiped record directory) while its lease
    lives: the keeper puts them back within T, under the same lease. Else the daemon serves on, invisible."""
    d = await open_discovery(discovery_url, ttl=TTL)
    admin = await open_discovery(discovery_url, ttl=TTL)
    try:
        lease = await d.grant_lease()
        first_id = lease.id
        records = {
            instance_key(ns, "worker", "generate", first_id): b"instance",
            model_key(ns, "m", 1): b"card 1",  # two keys under one prefix: checked with one read
            model_key(ns, "m", 2): b"card 2",
        }
        for key, value in records.items():
            await lease.put(key, value)
        for key in records:
            await admin._delete(key)

        async def published() -> dict[str, bytes]:
            return {**await admin.get_prefix(instance_prefix(ns)), **await admin.get_prefix(model_prefix(ns))}

        assert await published() == {}
        deadline = time.monotonic() + TTL + 2.0
        while await published() != records:
            assert time.monotonic() < deadline, f"not published again within T + 2 s: {await published()}"
            await asyncio.sleep(0.1)
        assert lease.alive and lease.id == first_id and lease.losses == 0
    finally:
        await d.close()
        await admin.close()


async def test_a_blocked_event_loop_does_not_lose_the_lease(discovery_url: str, ns: str, tracker):
    """Issue 14 item 10: beats come from the keeper's own thread, so a loop blocked for 3xTTL (a daemon
    busy with CPU work on a loaded machine) keeps its lease, its id and its record; no churn."""
    ttl = 1.0
    d = await open_discovery(discovery_url, ttl=ttl)
    admin = await open_discovery(discovery_url, ttl=TTL)
    lost: list[float] = []
    try:
        lease = await d.grant_lease(on_lost=lambda: lost.append(time.monotonic()))
        first_id = lease.id
        key = instance_key(ns, "worker", "generate", first_id)
        await lease.put(key, b"v")
        watch = await tracker(admin, instance_prefix(ns))
        await watch.wait_for(lambda s: key in s, 2, "record")
        beats = lease.beats
        time.sleep(3 * ttl)  # the whole event loop is blocked: no keeper task, no watcher runs
        assert lease.beats > beats, "no keepalive was sent while the loop was blocked"
        await asyncio.sleep(0.3)
        assert not lost and lease.losses == 0 and lease.alive and lease.id == first_id
        assert await admin.get_prefix(instance_prefix(ns)) == {key: b"v"}
        assert not [ev for _, ev in watch.log if isinstance(ev, Removed)], "the record flapped"
    finally:
        await d.close()
        await admin.close()


async def test_close_revokes_leases(discovery_url: str, ns: str):
    d = await open_discovery(discovery_url, ttl=TTL)
    observer = await open_discovery(discovery_url, ttl=TTL)
    try:
        lease = await d.grant_lease()
        await lease.put(instance_key(ns, "frontend", "http", lease.id), b"v")
        assert await observer.get_prefix(instance_prefix(ns))
        await d.close()
        assert not lease.alive
        assert await observer.get_prefix(instance_prefix(ns)) == {}
        with pytest.raises(DiscoveryError):
            await d.get_prefix(instance_prefix(ns))
    finally:
        await d.close()
        await observer.close()
