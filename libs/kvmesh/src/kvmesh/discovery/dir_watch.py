"""Directory change signals for the file discovery backend, all on one inotify instance per event loop.

A file-discovery watch only needs to know *that* something changed under its directories (it then
scans); which entry changed does not matter. The kernel caps inotify instances per user
(``fs.inotify.max_user_instances``, 128 by default) while watches are cheap (8192+), and the daemons of a
one-machine mesh run as one user, several watches each: an instance per watch ran out on a busy host,
and each watch past the cap fell back to polling. So every :class:`ChangeSignal` of a process (of an
event loop) subscribes to directories of one shared :class:`_SharedInotify`, which reads the events as
they come and wakes the signals subscribed to each event's watch descriptor.

Invariants:

- The kernel gives one watch descriptor per (instance, inode): two signals watching one directory
  share it. Subscriptions are counted per descriptor, masks are added (``IN_MASK_ADD``), and the kernel
  watch is removed with its last subscriber. A broader mask left behind by a subscriber that went away
  only causes spurious wake-ups (a scan that finds nothing), never a missed change.
- A descriptor the kernel dropped (its directory was deleted: ``IN_IGNORED``) leaves the subscription
  table at once; the deletion itself woke the watchers of the parent directory.
- A queue overflow (``IN_Q_OVERFLOW``) wakes every signal: events were lost, every watch scans.
- The instance lives while a signal uses it, and is closed with the last one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["ChangeSignal"]

log = logging.getLogger("kvmesh.discovery.file")


class _SharedInotify:
    """One inotify instance on one event loop, shared by every :class:`ChangeSignal` there."""

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _SharedInotify] = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        from asyncinotify import Inotify, Mask

        # sync_timeout 0: sync_get returns None once nothing is pending, instead of blocking.
        self._ino = Inotify(sync_timeout=0)
        self._mask_add, self._ignored, self._overflow = Mask.MASK_ADD, Mask.IGNORED, Mask.Q_OVERFLOW
        self._loop = weakref.ref(loop)  # not the loop itself: it is this instance's key in _by_loop
        self._users = 0
        self._subscribers: dict[int, dict[ChangeSignal, int]] = {}  # wd -> {signal: subscriptions}
        self._watches: dict[int, Any] = {}  # wd -> asyncinotify Watch
        loop.add_reader(self._ino.fd, self.dispatch)

    @classmethod
    def acquire(cls) -> _SharedInotify:
        """The running loop's instance, made on first use; raises ImportError / OSError where there is none."""
        loop = asyncio.get_running_loop()
        shared = cls._by_loop.get(loop)
        if shared is None:
            shared = cls._by_loop[loop] = cls(loop)
        shared._users += 1
        return shared

    def release(self) -> None:
        self._users -= 1
        if self._users > 0:
            return
        loop = self._loop()
        if loop is not None:
            self._by_loop.pop(loop, None)
            with contextlib.suppress(RuntimeError, ValueError):  # the loop is already closed
                loop.remove_reader(self._ino.fd)
        self._ino.close()

    def subscribe(self, signal: ChangeSignal, path: str | Path, mask: Any) -> int:
        """Watch ``path`` for ``signal``; its watch descriptor. Raises OSError (gone, limits)."""
        watch = self._ino.add_watch(path, mask | self._mask_add)
        wd: int = watch.wd
        self._watches[wd] = watch
        subscribers = self._subscribers.setdefault(wd, {})
        subscribers[signal] = subscribers.get(signal, 0) + 1
        return wd

    def unsubscribe(self, signal: ChangeSignal, wd: int) -> None:
        subscribers = self._subscribers.get(wd)
        if subscribers is None or signal not in subscribers:
            return  # the kernel dropped this watch already (IN_IGNORED)
        subscribers[signal] -= 1
        if subscribers[signal] == 0:
            del subscribers[signal]
        if not subscribers:
            del self._subscribers[wd]
            with contextlib.suppress(OSError):  # the directory is gone, and its watch with it
                self._ino.rm_watch(self._watches.pop(wd))

    def dispatch(self) -> None:
        """Read every pending event and wake the signals subscribed to its watch (all, on an overflow)."""
        while (event := self._ino.sync_get()) is not None:
            if self._overflow in event.mask:
                for subscribers in list(self._subscribers.values()):
                    for signal in subscribers:
                        signal.changed.set()
                continue
            watch = event.watch() if isinstance(event.watch, weakref.ref) else event.watch
            if watch is None:
                continue
            for signal in self._subscribers.get(watch.wd, ()):
                signal.changed.set()
            if self._ignored in event.mask:  # the kernel removed the watch: its directory was deleted
                self._subscribers.pop(watch.wd, None)
                self._watches.pop(watch.wd, None)

    @property
    def watch_count(self) -> int:
        """Kernel watches held (for tests and diagnostics)."""
        return len(self._subscribers)


class ChangeSignal:
    """Wakes a watch when inotify reports a change in its record directories or in the set of lease files.

    Record directories are watched for entries appearing, leaving or being rewritten; the lease
    directory only for lease files appearing or leaving, not for heartbeats. What to watch follows the
    scanner (:meth:`cover`), keyed by (path, inode) so that a directory removed and made again is
    watched again. Invariants: every directory a scan listed is watched before the watch yields that
    scan's result (when ``cover`` had to add a watch, the caller scans again, so nothing written before
    the watch existed is missed); and what inotify reported is discarded only right before a scan
    (:meth:`drain`).
    """

    def __init__(self, shared: _SharedInotify, lease_dir: Path) -> None:
        from asyncinotify import Mask

        entries = Mask.CREATE | Mask.DELETE | Mask.MOVED_FROM | Mask.MOVED_TO  # appearing or leaving
        self._shared = shared
        self._record_mask = entries | Mask.CLOSE_WRITE  # records may also be rewritten in place
        self._watches: dict[tuple[str, int], int] = {}  # (path, inode) -> watch descriptor
        self.changed = asyncio.Event()
        self.failed = False  # a watch could not be added: the caller polls instead
        self._lease_wd = shared.subscribe(self, lease_dir, entries)

    @classmethod
    def open(cls, lease_dir: Path) -> ChangeSignal | None:
        """A signal, or None where inotify is not available (the watch then polls)."""
        try:
            shared = _SharedInotify.acquire()
        except (ImportError, OSError, AttributeError) as exc:  # not Linux, or out of inotify instances
            log.info("file discovery: no inotify (%s); scanning every poll interval", exc)
            return None
        try:
            return cls(shared, lease_dir)
        except OSError as exc:
            shared.release()
            log.info("file discovery: cannot watch %s (%s); scanning every poll interval", lease_dir, exc)
            return None

    def cover(self, directories: Iterable[tuple[str, int]]) -> bool:
        """Watch exactly ``directories``; True if a watch had to be added (the caller scans again)."""
        wanted = set(directories)
        for key in self._watches.keys() - wanted:
            self._shared.unsubscribe(self, self._watches.pop(key))
        added = False
        for key in wanted - self._watches.keys():
            try:
                self._watches[key] = self._shared.subscribe(self, key[0], self._record_mask)
            except (FileNotFoundError, NotADirectoryError):
                continue  # removed since the scan: the next scan drops it
            except OSError as exc:  # e.g. fs.inotify.max_user_watches reached
                log.warning("file discovery: cannot watch %s (%s); scanning every poll interval", key[0], exc)
                self.failed = True
                return False
            added = True
        return added

    async def wait(self, timeout: float) -> None:
        """Until inotify has reported something since the last :meth:`drain`, or ``timeout`` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(), timeout)

    def drain(self) -> None:
        """Forget what inotify reported so far (the scan about to run sees it), reading what is pending first."""
        self._shared.dispatch()
        self.changed.clear()

    def close(self) -> None:
        for wd in self._watches.values():
            self._shared.unsubscribe(self, wd)
        self._watches.clear()
        self._shared.unsubscribe(self, self._lease_wd)
        self._shared.release()
