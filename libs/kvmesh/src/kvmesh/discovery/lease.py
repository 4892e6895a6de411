"""The lease keeper: one background task (plus one heartbeat thread) per :class:`Lease`, on every backend.

Lease policy (the contract daemons rely on; docs/discovery.md repeats it)
------------------------------------------------------------------------
Let ``T`` be the lease TTL (default 10 s), ``K`` the keepalive interval (default ``T/3``) and
``M`` the safety margin ``min(max(0.1*T, 0.25 s), T/3)`` (1 s for T=10, 0.25 s for T=2).

* **Liveness is not serving.** The lease says "others may route to me". Losing contact with the
  backend says nothing about this process's health, so it never stops a daemon from serving: while
  discovery is unreachable, every daemon keeps serving on the membership it last saw. Whether a
  process is dead is decided by the *others*: when its records vanish while the backend is up,
  watchers (routers, frontends) drop it.
* **Heartbeats off the event loop.** Beats run in a dedicated thread with a blocking backend call
  (``Discovery._lease_keepalive_blocking``), so a loaded or blocked event loop cannot starve them
  (issue 14 item 10); a backend without one is beaten from the keeper task. A beat every ``K``;
  after a failed beat, a retry every ``R = clamp(T/20, 0.1 s, 1 s)``; each bounded by
  ``min(op_timeout, K)``.
* **Proof.** A grant or keepalive *sent* at monotonic time ``s`` and answered with a TTL > 0
  proves the lease is held until ``s + T'`` (``T'`` = min(requested, granted TTL)).
  ``proven`` is False once ``T' - M`` passed without a proof: the keeper logs once that discovery is
  unreachable and that it keeps serving; it logs again when an answer comes.
* **Lost** means only that the backend *said* the lease is gone (etcd keepalive TTL 0 / lease not
  found; file backend: lease file deleted or not beaten within its TTL) - e.g. this process was
  frozen or cut off longer than ``T``. Then ``alive`` becomes False and ``on_lost()`` is called
  synchronously, once per loss.
* **Re-registration (no zombie).** The keeper never gives up (Dynamo issue #3493 is the bug it
  avoids). After a loss it grants a new lease with a jittered backoff of 0.1 s doubling up to
  ``min(1 s, K)`` and re-puts every remembered record (same key, same value: the instance ids in
  the keys are the old ones) under the new lease id, sets ``alive`` True, revokes the old lease
  (best effort) and starts ``on_renewed(new_id)`` as a task. So a process that comes back (after a
  freeze, a partition, an etcd restart) is either registered again within about a second of the
  backend answering, or it has exited: it never serves unregistered for longer than that.
* **Records.** ``put``/``delete`` are remembered (the desired state) and written at once while
  alive. A write that fails raises DiscoveryUnavailable, stays remembered and is retried after the
  next successful beat; until then a later put is queued behind it at once (and raises too), without a
  write of its own. While lost, writes are only remembered (published by the re-grant).
* **Records are checked.** Every ``T`` while the lease is proven, the keeper reads its remembered
  records back and puts any the backend no longer holds (or holds with another value): a record
  deleted behind a live lease (``etcdctl del``, a wiped record directory) would otherwise leave a
  serving daemon invisible for as long as its lease lives, which is for ever (``Discovery._get_many``).
* **Revoke** (graceful exit) stops the keeper and the heartbeat and revokes the lease: every record
  disappears at once. ``on_lost`` is not called. If the backend is down it only logs: records
  expire within T.

What callers must do: treat ``on_lost`` as "others now consider me gone; I am re-registering"
(keep it cheap, it runs inside the keeper), refresh anything that embeds the lease id in
``on_renewed``. Never stop serving because of the lease: only a drain does that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Protocol

from kvmesh.backoff import Backoff
from kvmesh.discovery.errors import (
    DiscoveryError,
    DiscoveryUnavailable,
    LeaseNotFound,
    bounded,
    raise_if_cancelling,
)

__all__ = ["Lease", "LeasePolicy", "LeaseStore"]


class LeaseStore(Protocol):
    """The backend primitives the keeper drives (:class:`kvmesh.discovery.base.Discovery` implements them)."""

    async def _lease_grant(self, ttl: float) -> tuple[int, float]: ...
    async def _lease_keepalive(self, lease_id: int) -> float: ...

    _blocking_keepalive: bool

    def _lease_keepalive_blocking(self, lease_id: int, timeout: float) -> float: ...
    async def _lease_revoke(self, lease_id: int) -> None: ...
    async def _put(self, key: str, value: bytes, lease_id: int) -> None: ...
    async def _delete(self, key: str) -> None: ...
    async def _get_many(self, keys: Iterable[str]) -> dict[str, bytes | None]: ...
    def _forget_lease(self, lease: Lease) -> None: ...
    def _note_unreachable(self) -> None: ...


log = logging.getLogger("kvmesh.discovery.lease")


class LeasePolicy:
    """The timings derived from a TTL (see the module docstring)."""

    __slots__ = ("keepalive_interval", "margin", "max_regrant_backoff", "retry_interval", "ttl")

    def __init__(self, ttl: float, keepalive_interval: float | None = None) -> None:
        if not ttl > 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl!r}")
        self.ttl = float(ttl)
        self.keepalive_interval = float(keepalive_interval) if keepalive_interval else self.ttl / 3
        self.margin = min(max(0.1 * self.ttl, 0.25), self.ttl / 3)
        if not 0 < self.keepalive_interval <= (self.ttl - self.margin) / 2 + 1e-9:
            raise ValueError(
                f"keepalive interval {self.keepalive_interval:g}s is too long for a {self.ttl:g}s lease: "
                f"at most (ttl - margin) / 2 = {(self.ttl - self.margin) / 2:.3g}s, so one failed beat is survivable"
            )
        self.retry_interval = min(max(self.ttl / 20, 0.1), 1.0)
        self.max_regrant_backoff = min(1.0, self.keepalive_interval)

    def __repr__(self) -> str:
        return (
            f"LeasePolicy(ttl={self.ttl:g}, keepalive={self.keepalive_interval:.3g}, margin={self.margin:.3g}, "
            f"retry={self.retry_interval:.3g}, regrant_backoff<={self.max_regrant_backoff:.3g})"
        )


class Lease:
    """Registration of one daemon process: records put through it live exactly as long as it does.

    ``id`` is the lease id (it changes after a re-grant; the record keys do not); ``alive`` is False
    only between the backend saying the lease is gone and the re-grant; ``proven`` is False while
    no beat succeeded for ``T' - M`` (discovery unreachable, or this process frozen). Neither ever
    means "stop serving" (see the module docstring). Create it with ``Discovery.grant_lease``.
    """

    def __init__(
        self,
        discovery: LeaseStore,
        *,
        ttl: float,
        keepalive_interval: float | None,
        op_timeout: float,
        on_lost: Callable[[], None] | None,
        on_renewed: Callable[[int], Awaitable[None]] | None,
    ) -> None:
        self._disc = discovery
        self.policy = LeasePolicy(ttl, keepalive_interval)
        self._op_timeout = op_timeout
        self._beat_timeout = max(0.05, min(op_timeout, self.policy.keepalive_interval))
        self._on_lost = on_lost
        self._on_renewed = on_renewed
        self._id = 0
        self._alive = False
        self._revoked = False
        self._effective_ttl = self.policy.ttl
        # Written by the heartbeat thread and read by the keeper task: single attribute stores are
        # atomic under the GIL, and every reader tolerates a value one beat old.
        self._last_proof = 0.0  # monotonic send time of the last successful grant/keepalive
        self._next_beat = 0.0
        self._next_check = 0.0  # monotonic time of the next check of the records (see the module docstring)
        self._gone = 0  # a lease id the backend reported gone
        self._unproven_logged = False
        self._records: dict[str, bytes] = {}
        self._until_lost: set[str] = set()  # records forgotten when the lease is lost (see ``put``)
        self._dirty_puts: set[str] = set()
        self._dirty_deletes: set[str] = set()
        self._lock = asyncio.Lock()  # serializes record writes with re-grants
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._heart: threading.Thread | None = None
        self._heart_stop = threading.Event()
        self._side_tasks: set[asyncio.Task[None]] = set()
        self._flush_task: asyncio.Task[None] | None = None
        self.losses = 0  # how many times the backend dropped the lease (for metrics and tests)
        self.beats = 0  # successful keepalives (for tests)

    # -- public surface ------------------------------------------------------------------------
    @property
    def id(self) -> int:
        return self._id

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def proven(self) -> bool:
        """A beat succeeded within the last ``T' - M`` seconds."""
        return self._alive and time.monotonic() < self._deadline()

    @property
    def ttl(self) -> float:
        return self.policy.ttl

    @property
    def records(self) -> dict[str, bytes]:
        """A copy of the remembered records (what is re-put after a re-grant)."""
        return dict(self._records)

    def __repr__(self) -> str:
        state = "revoked" if self._revoked else ("alive" if self._alive else "lost")
        return f"<Lease {self._id:x} {state} ttl={self.policy.ttl:g}s records={len(self._records)}>"

    async def put(self, key: str, value: bytes, *, until_lost: bool = False) -> None:
        """Publish ``key`` under this lease and remember it, so it is re-put after a re-grant.

        ``until_lost``: remembered (a failed write redone, someone else's value replaced) only while this
        lease lives: not re-put after a re-grant. For what holds only while the lease does: a leader's
        orders, since a holder that lost its lease leads no more.
        """
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"discovery values are bytes, got {type(value).__name__}")
        self._check_usable()
        value = bytes(value)
        async with self._lock:
            if until_lost:
                self._until_lost.add(key)
            else:
                self._until_lost.discard(key)
            self._records[key] = value
            self._dirty_deletes.discard(key)
            if not self._alive:
                self._dirty_puts.discard(key)  # published by the re-grant
                return
            if self._dirty_puts or self._dirty_deletes:
                # An earlier write failed and the keeper has not redone it: discovery is not taking writes.
                # Queued behind it rather than waiting out a timeout of its own (a worker publishing 3000
                # records into a frozen etcd waited 5 s for each).
                self._dirty_puts.add(key)
                raise DiscoveryUnavailable(f"put {key!r} deferred: an earlier write is still to be redone")
            await self._write("put", key, self._disc._put(key, value, self._id), self._dirty_puts)

    async def delete(self, key: str) -> None:
        """Delete ``key`` and forget it (it will not be re-put)."""
        self._check_usable()
        async with self._lock:
            self._records.pop(key, None)
            self._until_lost.discard(key)
            self._dirty_puts.discard(key)
            if not self._alive:
                self._dirty_deletes.add(key)  # a key not re-put dies with the old lease anyway
                return
            await self._write("delete", key, self._disc._delete(key), self._dirty_deletes)

    async def _write(self, what: str, key: str, op: Awaitable[None], dirty: set[str]) -> None:
        """Await one backend write of ``key``; if it fails, ``key`` stays in ``dirty`` for the keeper to redo."""
        try:
            await bounded(op, self._op_timeout)
        except LeaseNotFound:
            # the lease is gone: the keeper re-grants and re-puts every remembered record (this one too)
            dirty.discard(key)
            if self._gone != self._id:
                log.warning("discovery lease %x: %s refused, the lease is gone; re-registering", self._id, what)
                self._gone = self._id
                self._wake()
            return
        except DiscoveryError:
            dirty.add(key)
            raise
        except Exception as exc:
            dirty.add(key)
            raise _unavailable(f"{what} {key!r}", exc) from exc
        dirty.discard(key)

    async def revoke(self) -> None:
        """Graceful exit: stop the keeper and revoke the lease (every record gone at once).

        Never raises for an unreachable backend (records then expire within the TTL); idempotent.
        """
        if self._revoked:
            return
        self._revoked = True
        self._alive = False
        await self._cancel_tasks()
        self._disc._forget_lease(self)
        # The revoke does not wait for a beat in flight to end: with the backend hung, the two timeouts
        # one after the other overran a daemon's --drain-timeout by up to 6 s. A beat answered late is moot.
        await asyncio.gather(self._join_heart(), self._revoke_on_backend())

    async def _revoke_on_backend(self) -> None:
        if not self._id:
            return
        try:
            await bounded(self._disc._lease_revoke(self._id), self._op_timeout)
        except Exception as exc:
            reason = str(exc) or type(exc).__name__  # a timeout's text is empty
            log.warning("could not revoke lease %x (%s); its records expire within %gs", self._id, reason, self.ttl)

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.revoke()

    # -- keeper --------------------------------------------------------------------------------
    async def _start(self) -> None:
        sent = time.monotonic()
        try:
            lease_id, granted = await bounded(self._disc._lease_grant(self.policy.ttl), self._op_timeout)
        except DiscoveryError:
            raise
        except Exception as exc:
            raise _unavailable("lease grant", exc) from exc
        self._adopt(lease_id, granted, sent)
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(), name=f"lease-keeper-{lease_id:x}")
        if self._disc._blocking_keepalive:
            self._heart = threading.Thread(target=self._heartbeat, name=f"lease-heartbeat-{lease_id:x}", daemon=True)
            self._heart.start()
        log.debug("lease %x granted (%r, heartbeat %s)", lease_id, self.policy, "thread" if self._heart else "task")

    def _adopt(self, lease_id: int, granted: float, sent: float) -> None:
        self._effective_ttl = min(self.policy.ttl, granted) if granted > 0 else self.policy.ttl
        self._last_proof = sent
        self._next_beat = sent + self.policy.keepalive_interval
        self._next_check = sent + self.policy.ttl
        self._gone = 0
        self._unproven_logged = False
        self._id = lease_id
        self._alive = True

    def _deadline(self) -> float:
        return self._last_proof + self._effective_ttl - self.policy.margin

    def _beat_answered(self, lease_id: int, sent: float, remaining: float) -> None:
        """A keepalive of ``lease_id`` sent at ``sent`` was answered (any thread; no awaits, no locks)."""
        if lease_id != self._id:
            return  # a beat of a lease already replaced
        if remaining <= 0:
            self._gone = lease_id
            self._next_beat = math.inf  # nothing to beat until the keeper re-grants
            self._wake()
            return
        self.beats += 1
        if sent > self._last_proof:
            self._last_proof = sent
            self._effective_ttl = min(self.policy.ttl, remaining)
        self._next_beat = sent + self.policy.keepalive_interval
        if self._unproven_logged or self._dirty_puts or self._dirty_deletes:
            self._wake()

    def _beat_failed(self, exc: BaseException) -> None:
        log.debug("keepalive of lease %x failed: %s", self._id, exc)
        self._disc._note_unreachable()
        self._next_beat = time.monotonic() + self.policy.retry_interval

    def _wake(self) -> None:
        loop = self._loop
        if loop is None:
            return
        if _running_loop() is loop:
            self._wakeup.set()
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody to wake
                loop.call_soon_threadsafe(self._wakeup.set)

    def _heartbeat(self) -> None:
        """The heartbeat thread: beat every K (R after a failure), whatever the event loop is doing."""
        while not self._heart_stop.is_set():
            wait = self._next_beat - time.monotonic()
            if wait > 0:
                self._heart_stop.wait(min(wait, self.policy.keepalive_interval))
                continue
            lease_id = self._id
            sent = time.monotonic()
            try:
                remaining = self._disc._lease_keepalive_blocking(lease_id, self._beat_timeout)
            except Exception as exc:
                self._beat_failed(exc)
                continue
            self._beat_answered(lease_id, sent, remaining)

    async def _run(self) -> None:
        while not self._revoked:
            raise_if_cancelling()
            try:
                if self._alive:
                    await self._keep()
                else:
                    await self._recover()
            except Exception:  # a bug here must not leave the process unregistered for good
                log.exception("lease keeper of %x failed; re-registering", self._id)
                self._lose("keeper error")
                await asyncio.sleep(self.policy.max_regrant_backoff)

    async def _keep(self) -> None:
        """Watch the beats until the backend says the lease is gone (returns) or the task is cancelled."""
        while True:
            if self._gone and self._gone == self._id:
                self._lose("the backend reports the lease expired or revoked")
                return
            now = time.monotonic()
            deadline = self._deadline()
            if now >= deadline and not self._unproven_logged:
                self._unproven_logged = True
                log.warning(
                    "discovery lease %x: no successful keepalive for %.1fs (ttl %gs); discovery unreachable? "
                    "serving on with the membership last seen, re-registering if the lease is gone when it answers",
                    self._id,
                    now - self._last_proof,
                    self._effective_ttl,
                )
            elif now < deadline and self._unproven_logged:
                self._unproven_logged = False
                log.warning("discovery lease %x: keepalive answered again; still registered", self._id)
            if self._heart is None and now >= self._next_beat:
                await self._beat_in_loop()
                continue
            if now < deadline and self._flush_task is None:
                # in its own task: a write stuck on the lock must never delay noticing a loss
                if self._dirty_puts or self._dirty_deletes:
                    self._start_flush(self._flush_dirty())
                elif now >= self._next_check:
                    self._next_check = now + self.policy.ttl
                    self._start_flush(self._check_records())
            beat_at = self._next_beat if self._heart is None else math.inf
            wake_at = min(beat_at, deadline if now < deadline else math.inf, self._next_check)
            self._wakeup.clear()
            timeout = min(max(0.0, wake_at - time.monotonic()), self.policy.keepalive_interval)
            with contextlib.suppress(TimeoutError):
                await bounded(self._wakeup.wait(), timeout)

    async def _beat_in_loop(self) -> None:
        """The heartbeat of a backend without a blocking keepalive (beats from the event loop)."""
        lease_id = self._id
        sent = time.monotonic()
        try:
            remaining = await bounded(self._disc._lease_keepalive(lease_id), self._beat_timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._beat_failed(exc)
            return
        self._beat_answered(lease_id, sent, remaining)

    def _lose(self, reason: str) -> None:
        if not self._alive:
            return
        self._alive = False
        self.losses += 1
        for key in self._until_lost:  # dead with the lease, and not to be re-put by the re-grant
            self._records.pop(key, None)
            self._dirty_puts.discard(key)
        self._until_lost.clear()
        log.warning("discovery lease %x lost: %s; re-registering (still serving)", self._id, reason)
        if self._on_lost is not None:
            try:
                self._on_lost()
            except Exception:
                log.exception("on_lost callback failed")

    async def _recover(self) -> None:
        backoff = Backoff(min(0.1, self.policy.max_regrant_backoff), self.policy.max_regrant_backoff)
        while not self._revoked:
            try:
                await bounded(self._regrant(), self._op_timeout)
                return
            except Exception as exc:  # a timeout is a TimeoutError; a real cancel propagates
                log.debug("re-grant of a lease failed: %s", exc)
            await backoff.sleep()

    async def _regrant(self) -> None:
        async with self._lock:
            sent = time.monotonic()
            new_id, granted = await self._disc._lease_grant(self.policy.ttl)
            try:
                for key, value in list(self._records.items()):
                    await self._disc._put(key, value, new_id)
            except BaseException:
                self._spawn(self._revoke_quietly(new_id))
                raise
            old_id = self._id
            self._dirty_puts.clear()
            self._dirty_deletes.clear()
            self._adopt(new_id, granted, sent)
        log.warning(
            "discovery lease re-granted as %x (was %x); %d record(s) re-published under their old keys",
            new_id,
            old_id,
            len(self._records),
        )
        if old_id and old_id != new_id:
            await self._revoke_quietly(old_id)
        if self._on_renewed is not None:
            self._spawn(self._call_renewed(new_id))

    async def _call_renewed(self, new_id: int) -> None:
        assert self._on_renewed is not None
        try:
            await self._on_renewed(new_id)
        except Exception:
            log.exception("on_renewed callback failed")

    async def _revoke_quietly(self, lease_id: int) -> None:
        with contextlib.suppress(Exception):
            await bounded(self._disc._lease_revoke(lease_id), min(self._op_timeout, 1.0))

    def _start_flush(self, work: Coroutine[object, object, None]) -> None:
        self._flush_task = asyncio.get_running_loop().create_task(work)
        self._side_tasks.add(self._flush_task)
        self._flush_task.add_done_callback(self._flush_done)

    def _flush_done(self, task: asyncio.Task[None]) -> None:
        self._side_tasks.discard(task)
        self._flush_task = None

    async def _flush_dirty(self) -> None:
        async with self._lock:
            if not self._alive:
                return
            try:
                for key in list(self._dirty_deletes):
                    await bounded(self._disc._delete(key), self._op_timeout)
                    self._dirty_deletes.discard(key)
                for key in list(self._dirty_puts):
                    if key in self._records:
                        await bounded(self._disc._put(key, self._records[key], self._id), self._op_timeout)
                    self._dirty_puts.discard(key)
            except Exception as exc:
                log.debug("retrying failed record writes later: %s", exc)

    async def _check_records(self) -> None:
        """Put back every remembered record the backend lost while the lease held (see the module docstring)."""
        async with self._lock:
            if not self._alive or not self._records:
                return
            try:
                live = await bounded(self._disc._get_many(list(self._records)), self._op_timeout)
                for key, value in self._records.items():
                    if live.get(key) != value:
                        await bounded(self._disc._put(key, value, self._id), self._op_timeout)
                        log.warning(
                            "discovery record %r was gone while lease %x held (deleted behind its back?); "
                            "published it again",
                            key,
                            self._id,
                        )
            except Exception as exc:  # a lost lease is the keeper's business; anything else waits for the next check
                log.debug("checking the records of lease %x failed: %s", self._id, exc)

    # -- helpers -------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._revoked:
            raise DiscoveryError(f"lease {self._id:x} was revoked")

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _cancel_tasks(self) -> None:
        self._heart_stop.set()
        tasks = [t for t in (self._task, *self._side_tasks) if t is not None and t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(1.0, self._op_timeout))
            if pending:
                log.error("lease %x: %d keeper task(s) ignored cancellation", self._id, len(pending))
        self._task = None

    async def _join_heart(self) -> None:
        heart, self._heart = self._heart, None
        if heart is not None:  # a beat in flight ends within its timeout; never block the loop on it
            await asyncio.to_thread(heart.join, self._beat_timeout + 1.0)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _unavailable(what: str, exc: BaseException) -> DiscoveryUnavailable:
    if isinstance(exc, TimeoutError):
        return DiscoveryUnavailable(f"discovery {what} timed out")
    return DiscoveryUnavailable(f"discovery {what} failed: {exc}")
