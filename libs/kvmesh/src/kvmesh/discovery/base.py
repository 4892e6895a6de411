"""Discovery interface shared by the backends: watch events, key layout, the abstract store.

A backend (etcd, file) implements the small :class:`Discovery` surface plus the four lease
primitives the backend-independent keeper (:mod:`kvmesh.discovery.lease`) drives: grant,
keepalive, revoke and put-under-lease. Everything above this module (daemons, routers, frontends)
only sees :class:`Discovery`, :class:`~kvmesh.discovery.lease.Lease` and the event types.

Key layout (values are opaque bytes; callers store serialized ``kvmesh.v1`` protobuf records)::

    v1/instances/{namespace}/{component}/{endpoint}/{instance_id:x}
    v1/models/{namespace}/{model}/{instance_id:x}

Each name segment is percent-encoded (``urllib.parse.quote(name, safe="")``), so a model name
such as ``Qwen/Qwen3-0.6B`` stays one segment (``Qwen%2FQwen3-0.6B``) and every key parses back.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import quote, unquote

from kvmesh.discovery.errors import DiscoveryError, bounded, stray_cancel
from kvmesh.discovery.lease import Lease, LeasePolicy

_log = logging.getLogger("kvmesh.discovery")


def _awaiting(source: object) -> str:
    """Where a suspended async generator waits: its frame, then each awaited coroutine's, innermost last
    (for the log line of a stalled watch, so that a new kind of stall says where it hangs)."""
    frames = []
    frame, awaited = getattr(source, "ag_frame", None), getattr(source, "ag_await", None)
    for _ in range(32):
        if frame is not None:
            frames.append(f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})")
        if awaited is None:
            break
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "ag_frame", None)
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "ag_await", None)
        if frame is None and awaited is None:
            break
    return " -> ".join(frames) or "an unknown place"


@dataclass(frozen=True, slots=True)
class _Ended:
    """The stream ended without an error the consumer should see (see ``_hold_removals``'s pump)."""

    why: str


@dataclass(frozen=True, slots=True)
class _Listing:
    """A check's read of a watched prefix, queued beside the stream's events (see list_and_watch)."""

    records: dict[str, bytes]


__all__ = [
    "INSTANCES_ROOT",
    "MODELS_ROOT",
    "Added",
    "Discovery",
    "InstanceKey",
    "ModelKey",
    "Removed",
    "Snapshot",
    "WatchEvent",
    "instance_key",
    "instance_prefix",
    "model_key",
    "model_prefix",
    "parse_instance_key",
    "parse_model_key",
]


# -- watch events ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Snapshot:
    """The complete set of live records under the watched prefix.

    Always the first event of :meth:`Discovery.list_and_watch`; yielded again after any resync
    (reconnect, compaction, unreadable directory). Consumers replace their state with it (diff
    it against what they had: keys missing from it are gone).
    """

    records: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Added:
    """A record appeared or its value changed (an upsert)."""

    key: str
    value: bytes


@dataclass(frozen=True, slots=True)
class Removed:
    """A record disappeared: deleted, its lease revoked, or its lease expired."""

    key: str


WatchEvent = Snapshot | Added | Removed


# -- key layout --------------------------------------------------------------------------------
INSTANCES_ROOT = "v1/instances/"
MODELS_ROOT = "v1/models/"


def apply_watch_event(
    event: WatchEvent, known: Iterable[str], put: Callable[[str, bytes], None], delete: Callable[[str], None]
) -> None:
    """Apply one ``list_and_watch`` event as ``put``/``delete`` calls.

    A Snapshot (the first event, and every resync after a reconnect or compaction) is diffed against
    ``known``, the keys the caller currently holds, so whatever vanished meanwhile is deleted.
    """
    if isinstance(event, Snapshot):
        for key in [k for k in known if k not in event.records]:
            delete(key)
        for key, value in event.records.items():
            put(key, value)
    elif isinstance(event, Added):
        put(event.key, event.value)
    else:
        delete(event.key)


def _seg(name: str, what: str) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"discovery key: {what} must be a non-empty string, got {name!r}")
    return quote(name, safe="")


def _id(instance_id: int) -> str:
    if not isinstance(instance_id, int) or instance_id < 0:
        raise ValueError(f"discovery key: instance_id must be a non-negative int, got {instance_id!r}")
    return f"{instance_id:x}"


def instance_prefix(namespace: str, component: str | None = None, endpoint: str | None = None) -> str:
    """Watch prefix for a namespace, a component of it, or one endpoint of a component (ends in '/')."""
    parts = [_seg(namespace, "namespace")]
    if component is not None:
        parts.append(_seg(component, "component"))
        if endpoint is not None:
            parts.append(_seg(endpoint, "endpoint"))
    elif endpoint is not None:
        raise ValueError("discovery key: endpoint given without component")
    return INSTANCES_ROOT + "/".join(parts) + "/"


def instance_key(namespace: str, component: str, endpoint: str, instance_id: int) -> str:
    """``v1/instances/{namespace}/{component}/{endpoint}/{instance_id:x}``."""
    return instance_prefix(namespace, component, endpoint) + _id(instance_id)


def model_prefix(namespace: str, model: str | None = None) -> str:
    """Watch prefix for every model card of a namespace, or of one model (ends in '/')."""
    parts = [_seg(namespace, "namespace")]
    if model is not None:
        parts.append(_seg(model, "model"))
    return MODELS_ROOT + "/".join(parts) + "/"


def model_key(namespace: str, model: str, instance_id: int) -> str:
    """``v1/models/{namespace}/{model}/{instance_id:x}`` (model percent-encoded)."""
    return model_prefix(namespace, model) + _id(instance_id)


@dataclass(frozen=True, slots=True)
class InstanceKey:
    namespace: str
    component: str
    endpoint: str
    instance_id: int


@dataclass(frozen=True, slots=True)
class ModelKey:
    namespace: str
    model: str
    instance_id: int


def _split(key: str, root: str, n: int) -> list[str]:
    if not key.startswith(root):
        raise ValueError(f"not a {root}* key: {key!r}")
    parts = key[len(root) :].split("/")
    if len(parts) != n or not all(parts):
        raise ValueError(f"malformed discovery key {key!r}")
    return parts


def parse_instance_key(key: str) -> InstanceKey:
    """Inverse of :func:`instance_key`; raises ValueError on anything else."""
    ns, comp, ep, iid = _split(key, INSTANCES_ROOT, 4)
    try:
        instance_id = int(iid, 16)
    except ValueError:
        raise ValueError(f"malformed instance id in discovery key {key!r}") from None
    return InstanceKey(unquote(ns), unquote(comp), unquote(ep), instance_id)


def parse_model_key(key: str) -> ModelKey:
    """Inverse of :func:`model_key`; raises ValueError on anything else."""
    ns, model, iid = _split(key, MODELS_ROOT, 3)
    try:
        instance_id = int(iid, 16)
    except ValueError:
        raise ValueError(f"malformed instance id in discovery key {key!r}") from None
    return ModelKey(unquote(ns), unquote(model), instance_id)


# -- the store ---------------------------------------------------------------------------------
class Discovery(abc.ABC):
    """One connection to a discovery backend, shared by everything in a process.

    Open it with :func:`kvmesh.discovery.open_discovery`. ``ttl`` is the default lease TTL,
    ``keepalive_interval`` the default keepalive period (``ttl / 3``), ``op_timeout`` bounds
    every single backend call (it is the ``connect_timeout`` given to ``open_discovery``).
    """

    url: str
    ttl: float
    keepalive_interval: float
    op_timeout: float

    def __init__(self, url: str, *, ttl: float, keepalive_interval: float | None, op_timeout: float) -> None:
        policy = LeasePolicy(ttl, keepalive_interval)  # validates both
        self.url = url
        self.ttl = policy.ttl
        self.keepalive_interval = policy.keepalive_interval
        self.op_timeout = float(op_timeout)
        self._leases: set[Lease] = set()
        self._closed = False
        self._unreachable_at = -1e9  # monotonic time a backend call last failed for want of an answer
        retry = min(max(policy.ttl / 20, 0.1), 1.0)
        self.removal_grace = min(policy.ttl, policy.keepalive_interval + max(1.0, 3 * retry))
        """How long a removal is held after this process lost contact with the backend (see list_and_watch):
        an owner learns that its lease is gone at its next keepalive, up to ``K`` after the backend is back
        (an etcd restarted empty between two keepalives), then re-registers within about ``R``."""
        self.watch_check_interval = min(max(policy.ttl / 2, 1.0), 30.0)
        """How often a watched prefix is read again to check the view (see list_and_watch)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url} ttl={self.ttl:g}s>"

    # -- public API ----------------------------------------------------------------------------
    async def grant_lease(
        self,
        on_lost: Callable[[], None] | None = None,
        on_renewed: Callable[[int], Awaitable[None]] | None = None,
        *,
        ttl: float | None = None,
    ) -> Lease:
        """Grant a lease and start its keeper; raises DiscoveryUnavailable if the first grant fails.

        ``on_lost()`` is called synchronously (from the keeper task) the moment the lease cannot be
        proven alive; ``on_renewed(new_id)`` runs as a task after a re-grant has re-put every record.
        See :mod:`kvmesh.discovery.lease` for the exact policy.
        """
        self._check_open()
        lease = Lease(
            self,
            ttl=self.ttl if ttl is None else ttl,
            keepalive_interval=self.keepalive_interval if ttl is None else None,
            op_timeout=self.op_timeout,
            on_lost=on_lost,
            on_renewed=on_renewed,
        )
        await lease._start()
        self._leases.add(lease)
        return lease

    def list_and_watch(self, prefix: str) -> AsyncGenerator[WatchEvent, None]:
        """Yield Snapshot first, then Added/Removed; after any resync, a fresh Snapshot.

        It never ends by itself and never goes silently stale: backend errors are retried with a
        short capped backoff and followed by a new Snapshot. Close it with ``aclose()`` (or use
        ``contextlib.aclosing``) when done.

        **Removals after an outage are held.** A removal seen within ``ttl + removal_grace`` of this
        process failing to reach the backend is delayed by ``removal_grace`` (``K`` + 1-1.5 s), and dropped
        if the key comes back meanwhile: a frozen etcd may expire every lease at once when it resumes, one
        restarted empty has none, and their owners, all alive, re-register within that time. A removal while the
        backend was reachable all along (a kill -9'd owner, a graceful exit) is passed on at once.

        **The view is checked** (etcd; the file backend's watch is a scan with nothing to stall, and
        checks nothing). Every :attr:`watch_check_interval` (T/2, 1-30 s) the prefix is read
        again (``get_prefix``) and compared with what the consumer was given (held removals aside). A
        difference still there at the next check means the backend's stream stalled without an error
        (aetcd drops the server's ``canceled`` replies, which leaves an etcd stream open and silent): the
        stream is dropped, unawaited, and a new one starts with a fresh Snapshot. A stream that ends
        (it never should) is restarted too, with a warning. So a view is never staler than about ``T``
        plus a read, whatever stalls the stream. A read that fails is skipped.
        """
        return self._hold_removals(prefix)

    @abc.abstractmethod
    def _watch(self, prefix: str) -> AsyncIterator[WatchEvent]:
        """The backend's raw list-and-watch stream (see :meth:`list_and_watch`)."""

    def _note_unreachable(self) -> None:
        """A backend call got no answer (any thread): removals seen soon after are held."""
        self._unreachable_at = time.monotonic()

    def _holding(self) -> bool:
        return time.monotonic() - self._unreachable_at < self.ttl + self.removal_grace

    async def _hold_removals(self, prefix: str) -> AsyncGenerator[WatchEvent, None]:
        queue: asyncio.Queue[WatchEvent | BaseException | _Listing | _Ended] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def pump(source: AsyncIterator[WatchEvent]) -> None:
            try:
                async for event in source:
                    queue.put_nowait(event)
            except asyncio.CancelledError as exc:
                if not stray_cancel(exc):
                    raise
                queue.put_nowait(_Ended("a cancellation nobody asked for (a closed gRPC channel?)"))
            except BaseException as exc:  # handed to the consumer, which raises it
                queue.put_nowait(exc)
            else:
                queue.put_nowait(_Ended("the stream ended by itself"))

        async def check() -> None:
            with contextlib.suppress(Exception):  # no answer: nothing to compare, the stream retries itself
                queue.put_nowait(_Listing(await bounded(self.get_prefix(prefix), self.op_timeout)))

        source: AsyncIterator[WatchEvent] | None = None

        def start() -> asyncio.Task[None]:
            nonlocal source
            source = self._watch(prefix)
            return loop.create_task(pump(source), name=f"discovery-watch {prefix}")

        task = start()
        checking: asyncio.Task[None] | None = None
        next_check = time.monotonic() + self.watch_check_interval
        suspect: set[tuple[str, bytes | None]] = set()
        state: dict[str, bytes] = {}  # what the consumer believes exists
        held: dict[str, float] = {}  # key -> monotonic time its removal is passed on
        try:
            while True:
                now = time.monotonic()
                for key, due in list(held.items()):
                    if due <= now:
                        del held[key]
                        if state.pop(key, None) is not None:
                            yield Removed(key)
                if now >= next_check and (checking is None or checking.done()):
                    checking = loop.create_task(check(), name=f"discovery-check {prefix}")
                    next_check = now + self.watch_check_interval
                wake = min([next_check, *held.values()])
                try:
                    async with asyncio.timeout(None if math.isinf(wake) else max(0.0, wake - now)):
                        item = await queue.get()
                except TimeoutError:
                    continue
                if isinstance(item, _Listing):
                    listed = item.records
                    differs = {(k, listed.get(k)) for k in (listed.keys() | state.keys()) - held.keys()
                               if listed.get(k) != state.get(k)}  # fmt: skip
                    stale = differs & suspect
                    suspect = differs
                    if stale:
                        _log.warning(
                            "discovery watch on %r stalled: %d change(s) not delivered for %gs (e.g. %s); "
                            "restarting it; it was waiting in %s",
                            prefix,
                            len(stale),
                            self.watch_check_interval,
                            min(stale)[0],
                            _awaiting(source),
                        )
                        task.cancel()  # not awaited: a stalled stream may never finish cancelling
                        task, suspect = start(), set()
                    continue
                if isinstance(item, _Ended):  # never silently: the consumer would wait forever
                    _log.warning("discovery watch on %r ended (%s); restarting it", prefix, item.why)
                    task, suspect = start(), set()
                    continue
                if isinstance(item, BaseException):
                    raise item
                now = time.monotonic()  # the wait may have lasted long: due times count from now
                if isinstance(item, Snapshot):
                    records = dict(item.records)
                    for key in state.keys() - records.keys():
                        if self._holding() or key in held:
                            held.setdefault(key, now + self.removal_grace)
                            records[key] = state[key]  # the consumer keeps it for now
                    for key in [k for k in held if k in item.records]:
                        del held[key]
                    state = dict(records)
                    yield Snapshot(records)
                elif isinstance(item, Added):
                    held.pop(item.key, None)
                    state[item.key] = item.value
                    yield item
                elif item.key in state:
                    if self._holding():
                        held.setdefault(item.key, now + self.removal_grace)
                        _log.debug(
                            "holding the removal of %s for %.1fs (discovery was unreachable lately)",
                            item.key,
                            self.removal_grace,
                        )
                    else:
                        held.pop(item.key, None)
                        del state[item.key]
                        yield item
        finally:
            for pending in (task, checking):
                if pending is not None:
                    pending.cancel()
            # bounded: a stream that swallows its cancellation must not hang whoever closes the watch
            await asyncio.wait([t for t in (task, checking) if t is not None], timeout=1.0)

    @abc.abstractmethod
    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every live record under ``prefix``; raises DiscoveryUnavailable if the backend is down."""

    async def close(self) -> None:
        """Revoke every lease still held (best effort) and release the backend connection."""
        if self._closed:
            return
        for lease in list(self._leases):
            await lease.revoke()
        self._closed = True
        await self._close_backend()

    async def __aenter__(self) -> Discovery:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise DiscoveryError(f"{self!r} is closed")

    # -- lease primitives the keeper drives (bounded by op_timeout by the caller) --------------
    @abc.abstractmethod
    async def _lease_grant(self, ttl: float) -> tuple[int, float]:
        """Create a lease; return (lease id, TTL the backend granted in seconds)."""

    @abc.abstractmethod
    async def _lease_keepalive(self, lease_id: int) -> float:
        """Renew the lease; return its TTL in seconds, or <= 0 if it no longer exists.

        Raises DiscoveryUnavailable (or any exception) when the backend cannot answer.
        """

    _blocking_keepalive = False
    """True if :meth:`_lease_keepalive_blocking` is implemented: the keeper then beats from a thread."""

    def _lease_keepalive_blocking(self, lease_id: int, timeout: float) -> float:
        """:meth:`_lease_keepalive` as a blocking call safe to run in another thread, within ``timeout``.

        Lets the heartbeat run off the event loop, so a loaded loop cannot starve it.
        """
        raise NotImplementedError

    @abc.abstractmethod
    async def _lease_revoke(self, lease_id: int) -> None:
        """Delete the lease and every record attached to it; a missing lease is not an error."""

    @abc.abstractmethod
    async def _put(self, key: str, value: bytes, lease_id: int) -> None:
        """Write ``key`` attached to ``lease_id``; raise DiscoveryError if the lease does not exist."""

    @abc.abstractmethod
    async def _delete(self, key: str) -> None:
        """Delete ``key`` (missing is fine)."""

    @abc.abstractmethod
    async def _get(self, key: str) -> bytes | None:
        """The live value of ``key``, None if there is none."""

    async def _get_many(self, keys: Iterable[str]) -> dict[str, bytes | None]:
        """The live values of ``keys`` (None: absent), for the keeper's check of its own records.

        One read per key, or one per key prefix holding several keys (a worker's model cards).
        """
        by_prefix: dict[str, list[str]] = {}
        for key in keys:
            by_prefix.setdefault(key.rpartition("/")[0] + "/", []).append(key)
        out: dict[str, bytes | None] = {}
        for prefix, group in by_prefix.items():
            if len(group) == 1:
                out[group[0]] = await self._get(group[0])
            else:
                live = await self.get_prefix(prefix)
                out.update((key, live.get(key)) for key in group)
        return out

    @abc.abstractmethod
    async def _close_backend(self) -> None:
        """Release connections and background tasks."""

    def _forget_lease(self, lease: Lease) -> None:
        self._leases.discard(lease)
