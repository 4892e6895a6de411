"""The lease keeper: one background task per :class:`Lease`, the same on every backend.

Lease policy (the contract daemons rely on; docs/discovery.md repeats it)
------------------------------------------------------------------------
Let ``T`` be the lease TTL (default 10 s), ``K`` the keepalive interval (default ``T/3``) and
``M`` the safety margin ``min(max(0.1*T, 0.25 s), T/3)`` (1 s for T=10, 0.25 s for T=2).

* **Proof.** A grant or keepalive *sent* at monotonic time ``s`` and answered with a TTL > 0
  proves the lease is held until ``s + T'`` (``T'`` = min(requested, granted TTL)); the backend
  can only expire it later than that. The keeper beats every ``K`` after the last proof; after a
  failed beat it retries every ``R = clamp(T/20, 0.1 s, 1 s)``. Each beat is bounded in time by
  the deadline below, so a hung backend cannot delay the verdict.
* **Lost** means: (a) no proof for ``T' - M`` seconds (the backend is unreachable, or this
  process was frozen / its event loop blocked), checked before trusting any late answer; or
  (b) the backend says the lease is gone (etcd keepalive TTL 0 / lease not found; file backend:
  lease file deleted or not beaten within its TTL). At that moment ``alive`` becomes False and
  ``on_lost()`` is called synchronously, once per loss, *before* the backend can expire the
  lease and its records, so the daemon stops taking new work while its records still exist:
  nothing ever serves without a live record (no zombie).
* **Recovery.** The keeper never gives up (Dynamo issue #3493 is the bug it avoids). It retries a
  grant with a jittered backoff (:class:`kvmesh.backoff.Backoff`) of 0.1 s doubling up to
  ``min(1 s, K)``. When one succeeds it re-puts every remembered record (same key, same value)
  under the **new** lease id, sets ``alive`` True, then revokes the old lease (best effort, so a
  lease etcd kept across its restart cannot leave stale records behind) and starts
  ``on_renewed(new_id)`` as a task. Keys and values are re-put verbatim: a caller whose value
  embeds the lease id rewrites it in ``on_renewed``.
* **Records.** ``put``/``delete`` are remembered (the desired state) and written at once while
  alive. A write that fails raises DiscoveryUnavailable, stays remembered and is retried after
  the next successful beat. While not alive, writes are only remembered (published at re-grant).
* **Revoke** (graceful exit) stops the keeper and revokes the lease: every record disappears at
  once. ``on_lost`` is not called. If the backend is down it only logs: records expire within T.

What callers must do: treat ``on_lost`` as "stop accepting new work now" (keep it cheap and
non-blocking; it runs inside the keeper), resume in ``on_renewed``, and check ``alive`` before
advertising readiness.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from kvmesh.backoff import Backoff
from kvmesh.discovery.errors import DiscoveryError, DiscoveryUnavailable, bounded, raise_if_cancelling

__all__ = ["Lease", "LeasePolicy", "LeaseStore"]


class LeaseStore(Protocol):
    """The backend primitives the keeper drives (:class:`kvmesh.discovery.base.Discovery` implements them)."""

    async def _lease_grant(self, ttl: float) -> tuple[int, float]: ...
    async def _lease_keepalive(self, lease_id: int) -> float: ...
    async def _lease_revoke(self, lease_id: int) -> None: ...
    async def _put(self, key: str, value: bytes, lease_id: int) -> None: ...
    async def _delete(self, key: str) -> None: ...
    def _forget_lease(self, lease: Lease) -> None: ...


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
    """Liveness of one daemon process: records put through it live exactly as long as it does.

    ``id`` is the instance/lease id (it changes after a re-grant); ``alive`` is False from the
    moment the keeper cannot prove the lease is held. Create it with ``Discovery.grant_lease``.
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
        self._on_lost = on_lost
        self._on_renewed = on_renewed
        self._id = 0
        self._alive = False
        self._revoked = False
        self._effective_ttl = self.policy.ttl
        self._last_proof = 0.0  # monotonic send time of the last successful grant/keepalive
        self._next_beat = 0.0
        self._records: dict[str, bytes] = {}
        self._dirty_puts: set[str] = set()
        self._dirty_deletes: set[str] = set()
        self._lock = asyncio.Lock()  # serializes record writes with re-grants
        self._task: asyncio.Task[None] | None = None
        self._side_tasks: set[asyncio.Task[None]] = set()
        self._flush_task: asyncio.Task[None] | None = None
        self.losses = 0  # how many times the lease was lost (for metrics and tests)

    # -- public surface ------------------------------------------------------------------------
    @property
    def id(self) -> int:
        return self._id

    @property
    def alive(self) -> bool:
        return self._alive

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

    async def put(self, key: str, value: bytes) -> None:
        """Publish ``key`` under this lease and remember it, so it is re-put after a re-grant."""
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"discovery values are bytes, got {type(value).__name__}")
        self._check_usable()
        value = bytes(value)
        async with self._lock:
            self._records[key] = value
            self._dirty_deletes.discard(key)
            if not self._alive:
                self._dirty_puts.discard(key)  # published by the re-grant
                return
            await self._write("put", key, self._disc._put(key, value, self._id), self._dirty_puts)

    async def delete(self, key: str) -> None:
        """Delete ``key`` and forget it (it will not be re-put)."""
        self._check_usable()
        async with self._lock:
            self._records.pop(key, None)
            self._dirty_puts.discard(key)
            if not self._alive:
                self._dirty_deletes.add(key)  # a key not re-put dies with the old lease anyway
                return
            await self._write("delete", key, self._disc._delete(key), self._dirty_deletes)

    async def _write(self, what: str, key: str, op: Awaitable[None], dirty: set[str]) -> None:
        """Await one backend write of ``key``; if it fails, ``key`` stays in ``dirty`` for the keeper to redo."""
        try:
            await bounded(op, self._op_timeout)
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
        if not self._id:
            return
        try:
            await bounded(self._disc._lease_revoke(self._id), self._op_timeout)
        except Exception as exc:
            log.warning("could not revoke lease %x (%s); its records expire within %gs", self._id, exc, self.ttl)

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
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"lease-keeper-{lease_id:x}")
        log.debug("lease %x granted (%r)", lease_id, self.policy)

    def _adopt(self, lease_id: int, granted: float, sent: float) -> None:
        self._id = lease_id
        self._effective_ttl = min(self.policy.ttl, granted) if granted > 0 else self.policy.ttl
        self._last_proof = sent
        self._next_beat = sent + self.policy.keepalive_interval
        self._alive = True

    def _deadline(self) -> float:
        return self._last_proof + self._effective_ttl - self.policy.margin

    async def _run(self) -> None:
        while not self._revoked:
            raise_if_cancelling()
            try:
                if self._alive:
                    await self._keep()
                else:
                    await self._recover()
            except Exception:  # a bug here must not leave a zombie nor end the keeping for good
                log.exception("lease keeper of %x failed; treating the lease as lost and starting over", self._id)
                self._lose("keeper error")
                await asyncio.sleep(self.policy.max_regrant_backoff)

    async def _keep(self) -> None:
        """Beat until the lease is lost (returns) or the task is cancelled."""
        p = self.policy
        while True:
            now = time.monotonic()
            deadline = self._deadline()
            if now >= deadline:
                self._lose(f"no successful keepalive for {now - self._last_proof:.2f}s (ttl {self._effective_ttl:g}s)")
                return
            if now < self._next_beat:
                await asyncio.sleep(min(self._next_beat, deadline) - now)
                continue
            sent = time.monotonic()
            try:
                remaining = await bounded(
                    self._disc._lease_keepalive(self._id), max(0.01, min(self._op_timeout, deadline - sent))
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("keepalive of lease %x failed: %s", self._id, exc)
                self._next_beat = time.monotonic() + p.retry_interval
                continue
            if remaining <= 0:
                self._lose("the backend reports the lease expired or revoked")
                return
            # A late answer must not resurrect a lease whose deadline already passed: the top of the
            # loop re-checks against the proof (the send time), so a frozen process still sees loss.
            if sent < deadline:
                self._last_proof = sent
                self._effective_ttl = min(p.ttl, remaining)
                self._next_beat = sent + p.keepalive_interval
            if (self._dirty_puts or self._dirty_deletes) and self._flush_task is None:
                # in its own task: a write stuck on the lock must never delay the loss verdict
                self._flush_task = asyncio.get_running_loop().create_task(self._flush_dirty())
                self._side_tasks.add(self._flush_task)
                self._flush_task.add_done_callback(self._flush_done)

    def _lose(self, reason: str) -> None:
        if not self._alive:
            return
        self._alive = False
        self.losses += 1
        log.warning("discovery lease %x lost: %s; not serving until a new lease is granted", self._id, reason)
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
            "discovery lease re-granted as %x (was %x); %d record(s) re-published", new_id, old_id, len(self._records)
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

    # -- helpers -------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._revoked:
            raise DiscoveryError(f"lease {self._id:x} was revoked")

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _cancel_tasks(self) -> None:
        tasks = [t for t in (self._task, *self._side_tasks) if t is not None and t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(1.0, self._op_timeout))
            if pending:
                log.error("lease %x: %d keeper task(s) ignored cancellation", self._id, len(pending))
        self._task = None


def _unavailable(what: str, exc: BaseException) -> DiscoveryUnavailable:
    if isinstance(exc, TimeoutError):
        return DiscoveryUnavailable(f"discovery {what} timed out")
    return DiscoveryUnavailable(f"discovery {what} failed: {exc}")
