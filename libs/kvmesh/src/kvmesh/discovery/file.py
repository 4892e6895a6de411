"""Embedded file backend: a directory shared by the processes of one machine, no server.

Layout under the root directory (format version 1)::

    leases/{lease_id:016x}.lease   one file per lease; JSON {"id", "ttl", "pid", "host", "created"};
                                   its mtime is the heartbeat (the owner touches it every TTL/3)
    kv/{seg}/{seg}/.../{seg}.rec   one file per key ("a/b/c" -> kv/a/b/c.rec); content: one JSON
                                   header line {"key": ..., "lease": "<hex id>"} then the raw value

* A record is **live** iff its lease file exists and was beaten within that lease's TTL. Nothing
  else matters: a kill -9'd owner stops beating and its records die after the TTL, without anyone
  deleting anything. "Beaten within the TTL" is judged on each process's monotonic clock, not by
  comparing the file's mtime with the wall clock (:class:`_Freshness`): an mtime that has not moved
  for a TTL is stale, whatever the wall clock did meanwhile. So a wall clock stepped back (NTP) does
  not keep a dead owner's lease live until the clock catches up with its mtime, and a step forward
  does not kill live leases. Only a lease first seen by a process is aged by the wall clock (its
  mtime's age, 0 if in the future).
* Every write is atomic: a temp file (name starting with '.') in the same directory, then
  ``os.replace``. Lease files are created with ``os.link`` (fails if the id exists).
* Key segments are percent-encoded (``quote(seg, safe="")``; '' -> '%', a leading '.' and a
  trailing '.rec' are escaped) so any key maps to one path and never collides with a directory.
* Watching is a scan that only re-reads files whose inode, size or mtime changed, run when inotify
  reports a change under the prefix or to the set of lease files (:mod:`kvmesh.discovery.dir_watch`:
  one inotify instance per event loop for all its watches), when the first lease holding records
  there can go stale, and at least every ``_IDLE_RESCAN_S`` (a net for
  anything inotify could not report); never more often than the poll interval (default 0.1 s).
  Heartbeats (a lease file's mtime) wake nobody. Watchers see a change within the poll interval and
  an expiry within TTL + the poll interval. Where inotify is unavailable (no Linux, watch limits) the
  scan runs every poll interval, as it always did; on a slow 2-core VM that cost an idle router and
  frontend 560 and 450 ms of CPU in 30 s, against 130 and 110 ms with inotify (docs/discovery.md).
  A record directory whose
  own (inode, mtime) is unchanged since a listing made at least ``_SETTLED_S`` after its mtime is
  not listed again, nor its files stat'ed: every change to a record (write, delete, GC) renames or
  unlinks an entry of its directory, which moves the directory's mtime, and the margin covers the
  filesystem's coarse timestamps (a change in the same clock tick as the listing). With a thousand
  engines, a scan of an unchanged fleet is a few directory stats instead of thousands of file stats,
  and it reuses the previous walk's records, grouped by lease: a poll checks each lease's freshness
  once, not each record's.
* Garbage collection: every open FileDiscovery sweeps once per TTL (at most every 5 s, at least
  every 0.5 s): lease files stale for TTL + 1 s, records whose lease is dead or missing, and
  temp files older than 60 s are deleted. A record is removed by renaming it aside first, so a
  concurrent rewrite of the same key by a live lease is restored, never lost.
* Permissions (security): the whole tree is created 0700 and every file 0600, so another local user
  can neither read the registry nor register a rogue engine. The root must be owned by this user and
  not group- or world-writable, and every ancestor must be owned by this user or root and not
  writable by others unless sticky (``/tmp``): anything else is refused (exit 2 in a daemon). This is
  what makes the predictable fallback ``/tmp/kvmesh-$UID`` safe: another user may create it first,
  but then it is theirs and we refuse it.
* Keepalive = ``os.utime`` on the lease file after checking it still exists and is not stale
  (its mtime older than a TTL, or this process's last beat more than a TTL ago on its monotonic
  clock: a stale lease is dead for everyone, it must not come back).
* Lease files that do not parse (a wrong name, a torn or corrupt body) are removed by the GC once
  older than 60 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import secrets
import socket
import stat
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator
from pathlib import Path
from urllib.parse import quote

from kvmesh.discovery.base import (
    Added,
    Discovery,
    Removed,
    Snapshot,
    WatchEvent,
)
from kvmesh.discovery.dir_watch import ChangeSignal
from kvmesh.discovery.errors import (
    DiscoveryRefused,
    DiscoveryUnavailable,
    LeaseNotFound,
    raise_if_cancelling,
)
from kvmesh.discovery_urls import DEFAULT_POLL_INTERVAL, parse_file_url

__all__ = ["FileDiscovery", "default_file_root"]

log = logging.getLogger("kvmesh.discovery.file")

_LEASE_SUFFIX = ".lease"
_RECORD_SUFFIX = ".rec"
_GC_GRACE = 1.0
# A directory listed at least this long after its last change is trusted while its mtime stays put.
_SETTLED_S = 1.0
# A watch scans at least this often even when inotify reported nothing (a net for what it cannot see).
_IDLE_RESCAN_S = 1.0
_EXPIRY_MARGIN_S = 0.02  # wake this long after a lease's deadline, not before it
_TMP_MAX_AGE = 60.0


def default_file_root() -> Path:
    """``$XDG_RUNTIME_DIR/kvmesh-discovery``, else ``/tmp/kvmesh-$UID/kvmesh-discovery``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvmesh-{os.getuid()}"
    return Path(runtime) / "kvmesh-discovery"


def _enc(segment: str) -> str:
    q = quote(segment, safe="")
    if not q:
        return "%"
    if q.startswith("."):
        q = "%2E" + q[1:]
    if q.endswith(_RECORD_SUFFIX):
        q = q[: -len(_RECORD_SUFFIX)] + "%2E" + _RECORD_SUFFIX[1:]
    if len(q) > 200:  # file names are limited to 255 bytes; "%%" never appears in quote() output
        q = q[:100] + "%%" + hashlib.sha256(segment.encode()).hexdigest()
    return q


def _mkdirs(path: Path) -> None:
    """``mkdir -p`` where every directory created is 0700 (``Path.mkdir`` gives parents 0777 & umask)."""
    missing: list[Path] = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)


def _write_private(path: Path, data: bytes) -> None:
    """Create ``path`` (which must not exist) 0600 and write ``data``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def check_root_safe(root: Path) -> None:
    """Refuse a root another local user could write to (see the module docstring); raises DiscoveryRefused."""
    uid = os.geteuid()
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise DiscoveryRefused(f"discovery directory {root} is not a directory (symlinks are refused)")
    if st.st_uid != uid:
        raise DiscoveryRefused(f"discovery directory {root} is owned by uid {st.st_uid}, not by this user ({uid})")
    if st.st_mode & 0o022:
        raise DiscoveryRefused(
            f"discovery directory {root} is group- or world-writable (mode {stat.S_IMODE(st.st_mode):o}); chmod 700 it"
        )
    linked = False
    for parent in root.parents:
        pst = os.lstat(parent)  # not stat: a symlink another user owns can be re-pointed at any time
        if stat.S_ISLNK(pst.st_mode):
            if pst.st_uid not in (0, uid):
                raise DiscoveryRefused(
                    f"discovery directory {root}: its ancestor {parent} is a symlink another user "
                    f"(uid {pst.st_uid}) can re-point"
                )
            linked = True  # root's or ours: where it points is checked below
            continue
        if pst.st_uid not in (0, uid) or (pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX):
            raise DiscoveryRefused(
                f"discovery directory {root}: its ancestor {parent} can be changed by another user "
                f"(owner uid {pst.st_uid}, mode {stat.S_IMODE(pst.st_mode):o})"
            )
    if linked:  # the directories the symlinks lead through must be as safe as the path that names them
        check_root_safe(root.resolve())


def _tmp_name(name: str) -> str:
    return f".{name[:80]}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


class _Store:
    """Synchronous file operations (run in the event loop for single files, in a thread for scans)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.leases = root / "leases"
        self.kv = root / "kv"
        self._gc_ttls: dict[tuple[int, int], float] = {}
        self._gc_fresh = _Freshness()
        self._beaten: dict[int, float] = {}  # lease id -> monotonic time this process last beat it
        self._gc_scanner: _Scanner | None = None  # every record's lease, kept up to date cheaply
        # key -> (inode, size, mtime_ns) of the record file this process last wrote, and its lease and value:
        # a lease's check of its own records stats them instead of reading them back
        self.written: dict[str, tuple[tuple[int, int, int], int, bytes]] = {}

    # -- paths ---------------------------------------------------------------------------------
    def lease_path(self, lease_id: int) -> Path:
        return self.leases / f"{lease_id:016x}{_LEASE_SUFFIX}"

    def record_path(self, key: str) -> Path:
        parts = key.split("/")
        return self.kv.joinpath(*(_enc(p) for p in parts[:-1]), _enc(parts[-1]) + _RECORD_SUFFIX)

    def scan_dir(self, prefix: str) -> Path:
        """Directory holding every record under ``prefix`` (the last, partial segment is filtered)."""
        return self.kv.joinpath(*(_enc(p) for p in prefix.split("/")[:-1]))

    # -- setup ---------------------------------------------------------------------------------
    def prepare(self) -> None:
        _mkdirs(self.root)
        check_root_safe(self.root)
        for d in (self.leases, self.kv):
            _mkdirs(d)
        probe = self.root / _tmp_name("probe")
        _write_private(probe, b"ok")
        probe.unlink()

    # -- leases --------------------------------------------------------------------------------
    def grant(self, ttl: float) -> int:
        body = {"id": None, "ttl": ttl, "pid": os.getpid(), "host": socket.gethostname(), "created": time.time()}
        _mkdirs(self.leases)  # the directory may have been wiped
        while True:
            lease_id = secrets.randbits(63) or 1
            body["id"] = f"{lease_id:x}"
            tmp = self.leases / _tmp_name("lease")
            _write_private(tmp, json.dumps(body).encode())
            try:
                os.link(tmp, self.lease_path(lease_id))
            except FileExistsError:
                continue
            finally:
                tmp.unlink(missing_ok=True)
            self._beaten[lease_id] = time.monotonic()
            return lease_id

    def keepalive(self, lease_id: int, ttl: float) -> float:
        path = self.lease_path(lease_id)
        sent = time.monotonic()
        try:
            st = path.stat()
        except FileNotFoundError:
            return 0.0
        beaten = self._beaten.get(lease_id, sent)
        if time.time() - st.st_mtime > ttl or sent - beaten > ttl:
            return 0.0  # watchers already consider it dead; it must not come back
        try:
            os.utime(path)
        except FileNotFoundError:
            return 0.0
        self._beaten[lease_id] = sent
        return ttl

    def revoke(self, lease_id: int) -> None:
        self._beaten.pop(lease_id, None)
        self.lease_path(lease_id).unlink(missing_ok=True)  # every record of it is dead from now on
        for path in self._walk(self.kv):
            self._remove_record_if(path, lambda lid: lid == lease_id)

    def lease_table(
        self, ttls: dict[tuple[int, int], float], corrupt: list[os.DirEntry[str]] | None = None
    ) -> dict[int, tuple[float, float]]:
        """lease id -> (mtime, ttl) for every lease file; ``ttls`` caches (inode, id) -> ttl per caller.

        Lease files that do not parse go to ``corrupt`` (for the GC), or are skipped.
        """
        out: dict[int, tuple[float, float]] = {}
        seen: set[tuple[int, int]] = set()
        try:
            entries = list(os.scandir(self.leases))
        except FileNotFoundError:
            return out
        for entry in entries:
            name = entry.name
            if not name.endswith(_LEASE_SUFFIX) or name.startswith("."):
                continue
            try:
                lease_id = int(name[: -len(_LEASE_SUFFIX)], 16)
            except ValueError:
                if corrupt is not None:
                    corrupt.append(entry)
                continue
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            cache_key = (st.st_ino, lease_id)
            ttl = ttls.get(cache_key)
            if ttl is None:
                try:
                    ttl = float(json.loads(Path(entry.path).read_bytes())["ttl"])
                    if not (math.isfinite(ttl) and ttl > 0):  # NaN, inf: every expiry check says "alive"
                        raise ValueError(f"ttl {ttl}")
                except (OSError, ValueError, KeyError, TypeError):
                    if corrupt is not None:
                        corrupt.append(entry)
                    continue  # being created or corrupt: treat as absent
                ttls[cache_key] = ttl
            seen.add(cache_key)
            out[lease_id] = (st.st_mtime, ttl)
        for k in ttls.keys() - seen:
            del ttls[k]
        return out

    # -- records -------------------------------------------------------------------------------
    def put(self, key: str, value: bytes, lease_id: int) -> None:
        if not self.lease_path(lease_id).exists():  # expired or revoked: what etcd answers too
            raise LeaseNotFound(f"lease {lease_id:x} not found")
        path = self.record_path(key)
        header = json.dumps({"key": key, "lease": f"{lease_id:x}"}, ensure_ascii=True).encode() + b"\n"
        for attempt in range(2):
            try:
                _mkdirs(path.parent)
                tmp = path.parent / _tmp_name(path.name)
                _write_private(tmp, header + value)
                os.replace(tmp, path)
                st = path.stat()
                self.written[key] = ((st.st_ino, st.st_size, st.st_mtime_ns), lease_id, value)
                return
            except FileNotFoundError:  # directory removed under us: recreate once
                if attempt:
                    raise

    def delete(self, key: str) -> None:
        self.written.pop(key, None)
        self.record_path(key).unlink(missing_ok=True)

    def get(self, key: str) -> bytes | None:
        """The live value of ``key``: a stat if it is still the file this process wrote, else a read."""
        path = self.record_path(key)
        try:
            st = path.stat()
            mine = self.written.get(key)
            if mine is not None and mine[0] == (st.st_ino, st.st_size, st.st_mtime_ns):
                _, lease_id, value = mine
            else:
                _, lease_id, value = self.read_record(path)
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError):
            return None  # torn or corrupt: as good as absent
        return value if self.lease_path(lease_id).exists() else None

    @staticmethod
    def read_record(path: str | Path) -> tuple[str, int, bytes]:
        data = Path(path).read_bytes()
        head, sep, value = data.partition(b"\n")
        if not sep:
            raise ValueError("no header")
        meta = json.loads(head)
        return str(meta["key"]), int(meta["lease"], 16), value

    def _remove_record_if(self, path: str, dead: Callable[[int], bool]) -> None:
        """Remove ``path`` if ``dead(lease_id)``; safe against a concurrent rewrite by a live lease."""
        try:
            _, lease_id, _ = self.read_record(path)
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError):
            lease_id = -1
        if not dead(lease_id):
            return
        aside = os.path.join(os.path.dirname(path), _tmp_name(os.path.basename(path)))
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return
        try:
            _, now_lease, _ = self.read_record(aside)
        except (OSError, ValueError, KeyError, TypeError):
            now_lease = -1
        if not dead(now_lease):
            with contextlib.suppress(FileExistsError):  # unless an even newer write took its place
                os.link(aside, path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)

    @staticmethod
    def _files(top: Path, *, hidden: bool) -> Iterator[os.DirEntry[str]]:
        """Every non-directory entry below ``top``, tolerating concurrent removals; dot-names only if ``hidden``."""
        stack = [str(top)]
        while stack:
            d = stack.pop()
            try:
                entries = list(os.scandir(d))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for e in entries:
                if not hidden and e.name.startswith("."):
                    continue
                try:
                    is_dir = e.is_dir(follow_symlinks=False)
                except OSError:
                    continue
                if is_dir:
                    stack.append(e.path)
                else:
                    yield e

    @classmethod
    def _walk(cls, top: Path) -> list[str]:
        return [e.path for e in cls._files(top, hidden=False) if e.name.endswith(_RECORD_SUFFIX)]

    def gc(self) -> None:
        now = time.time()
        fresh = self._gc_fresh
        corrupt: list[os.DirEntry[str]] = []
        table = self.lease_table(self._gc_ttls, corrupt)
        fresh.keep(table)
        for lease_id, (mtime, ttl) in table.items():
            if fresh.age(lease_id, mtime, now) > ttl + _GC_GRACE:
                path = self.lease_path(lease_id)
                with contextlib.suppress(FileNotFoundError):
                    if path.stat().st_mtime == mtime:  # re-check: not beaten since
                        path.unlink()
                        log.info("file discovery: removed expired lease %x", lease_id)
        for entry in corrupt:
            with contextlib.suppress(FileNotFoundError):
                if now - entry.stat().st_mtime > _TMP_MAX_AGE:  # not a lease being written: garbage
                    os.unlink(entry.path)
                    log.info("file discovery: removed unreadable lease file %s", entry.name)
        leases = self.lease_table(self._gc_ttls)

        def dead(lease_id: int) -> bool:
            entry = leases.get(lease_id)
            if entry is None:  # unknown to the table: maybe granted after it was read
                return lease_id <= 0 or not self.lease_path(lease_id).exists()
            mtime, ttl = entry
            return fresh.age(lease_id, mtime, time.time()) > ttl + _GC_GRACE

        if self._gc_scanner is None:
            self._gc_scanner = _Scanner(self, "")
        for record, _, lease_id, _ in self._gc_scanner.records():
            if dead(lease_id):
                self._remove_record_if(record, dead)  # re-reads it: the record may have been rewritten since
        self._sweep_tmp(now)

    def _sweep_tmp(self, now: float) -> None:
        for e in self._files(self.root, hidden=True):
            if e.name.startswith(".") and e.name.endswith(".tmp"):
                try:
                    if now - e.stat().st_mtime > _TMP_MAX_AGE:
                        os.unlink(e.path)
                except OSError:
                    continue


class _Freshness:
    """How long each lease has gone without a beat, on this process's monotonic clock.

    A lease's mtime is a token, not a time: the age counts from when this observer saw the mtime
    change. A lease seen for the first time is aged by its mtime's wall-clock age, 0 if that is in
    the future (see the module docstring). An mtime that moved is aged the same way, but one that moved
    forward (a beat) never as older than this observer's previous look at that lease, which the beat
    came after: a watch that looks seldom depends no more on the wall clock than one that looks every poll.
    """

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        # lease id -> (mtime, monotonic time of that beat, monotonic time of the last look)
        self._seen: dict[int, tuple[float, float, float]] = {}

    def age(self, lease_id: int, mtime: float, now: float) -> float:
        mono = time.monotonic()
        seen = self._seen.get(lease_id)
        if seen is not None and seen[0] == mtime:
            beat = seen[1]
        elif seen is not None and mtime > seen[0]:  # a beat, which came after the last look
            beat = mono - min(max(now - mtime, 0.0), mono - seen[2])
        else:
            beat = mono - max(now - mtime, 0.0)
        self._seen[lease_id] = (mtime, beat, mono)
        return mono - beat

    def keep(self, lease_ids: Iterable[int]) -> None:
        """Forget leases that are gone (their files are)."""
        self._seen = {lease_id: self._seen[lease_id] for lease_id in lease_ids if lease_id in self._seen}


class _Scanner:
    """Live records under one prefix: re-lists only directories, and re-reads only files, that changed.

    A file is re-read when its (inode, size, mtime) changed; a directory is re-listed unless its own
    (inode, mtime) is the one seen at a listing made ``_SETTLED_S`` or more after that mtime (see
    the module docstring for why that is safe).
    """

    def __init__(self, store: _Store, prefix: str) -> None:
        self.store = store
        self.prefix = prefix
        self.top = store.scan_dir(prefix)
        # record path -> (signature, key, lease id, value); an unreadable record is cached as lease -1
        self._cache: dict[str, tuple[tuple[int, int, int], str, int, bytes]] = {}
        # directory -> ((inode, mtime_ns), settled, its record paths, its subdirectories) at its last listing
        self._dirs: dict[str, tuple[tuple[int, int], bool, list[str], list[str]]] = {}
        self._ttls: dict[tuple[int, int], float] = {}
        self._fresh = _Freshness()
        # What the last walk returned, while no directory is listed again: the same list, the same records
        self._records: list[tuple[str, str, int, bytes]] | None = None
        # ... and those under the prefix grouped by lease id, so a scan checks a lease, not every record
        self._by_lease: dict[int, dict[str, bytes]] = {}
        self._grouped: list[tuple[str, str, int, bytes]] | None = None
        #: seconds, at the last scan, until the first lease holding live records under the prefix goes stale
        self.expiry = math.inf

    def records(self) -> list[tuple[str, str, int, bytes]]:
        """``(path, key, lease id, value)`` of every record below the top, live or not (unreadable: lease -1).

        While every directory is settled and unchanged, the previous walk's list is returned as it is (the
        caller must not change it): no file could have changed without moving its directory's mtime.
        """
        cache = self._cache
        listings: list[list[str]] = []
        relisted = self._records is None
        seen_dirs: set[str] = set()
        stack = [str(self.top)]
        while stack:
            d = stack.pop()
            try:
                st = os.stat(d)
            except (FileNotFoundError, NotADirectoryError):
                continue
            seen_dirs.add(d)
            sig = (st.st_ino, st.st_mtime_ns)
            last = self._dirs.get(d)
            if last is not None and last[1] and last[0] == sig:
                paths, subdirs = last[2], last[3]
            else:
                relisted = True
                listed_at = time.time()
                paths, subdirs = self._list(d)
                if last is not None:
                    for gone in set(last[2]).difference(paths):
                        cache.pop(gone, None)
                self._dirs[d] = (sig, listed_at - st.st_mtime >= _SETTLED_S, paths, subdirs)
            stack.extend(subdirs)
            listings.append(paths)
        for d in self._dirs.keys() - seen_dirs:  # removed directories: forget them and their records
            relisted = True
            for gone in self._dirs.pop(d)[2]:
                cache.pop(gone, None)
        if not relisted and self._records is not None:
            return self._records
        out: list[tuple[str, str, int, bytes]] = []
        for paths in listings:
            for path in paths:
                cached = cache.get(path)
                if cached is not None:
                    out.append((path, cached[1], cached[2], cached[3]))
        self._records = out
        return out

    def _list(self, d: str) -> tuple[list[str], list[str]]:
        """List ``d`` (not settled): its record paths, each refreshed in the file cache, and its subdirectories."""
        try:
            entries = list(os.scandir(d))
        except (FileNotFoundError, NotADirectoryError):
            return [], []
        cache = self._cache
        paths: list[str] = []
        subdirs: list[str] = []
        for e in entries:
            name = e.name
            if name.startswith("."):
                continue
            try:
                if e.is_dir(follow_symlinks=False):
                    subdirs.append(e.path)
                    continue
            except OSError:
                continue
            if not name.endswith(_RECORD_SUFFIX):
                continue
            path = e.path
            try:
                st = os.stat(path)
            except FileNotFoundError:
                cache.pop(path, None)
                continue
            sig = (st.st_ino, st.st_size, st.st_mtime_ns)
            cached = cache.get(path)
            if cached is None or cached[0] != sig:
                try:
                    key, lease_id, value = self.store.read_record(path)
                except FileNotFoundError:
                    cache.pop(path, None)
                    continue
                except (OSError, ValueError, KeyError, TypeError):
                    log.debug("file discovery: skipping unreadable record %s", path)
                    key, lease_id, value = "", -1, b""  # never live; the GC removes it
                cache[path] = (sig, key, lease_id, value)
            paths.append(path)
        return paths, subdirs

    def scan(self) -> dict[str, bytes]:
        """The live records under the prefix: those whose lease is fresh."""
        leases = self.store.lease_table(self._ttls)
        fresh = self._fresh
        fresh.keep(leases)
        now = time.time()
        records = self.records()
        if records is not self._grouped:
            by_lease: dict[int, dict[str, bytes]] = {}
            prefix = self.prefix
            for _, key, lease_id, value in records:
                if key.startswith(prefix):
                    by_lease.setdefault(lease_id, {})[key] = value
            self._by_lease, self._grouped = by_lease, records
        out: dict[str, bytes] = {}
        expiry = math.inf
        for lease_id, group in self._by_lease.items():
            lease = leases.get(lease_id)
            if lease is None:
                continue
            left = lease[1] - fresh.age(lease_id, lease[0], now)
            if left < 0:
                continue
            expiry = min(expiry, left)
            out.update(group)
        self.expiry = expiry
        return out

    def directories(self) -> list[tuple[str, int]]:
        """``(path, inode)`` of the directories a change under the prefix can appear in: those the last scan
        listed, and the existing ones from the record tree's root down to the top (where the top will be)."""
        dirs = [(d, entry[0][0]) for d, entry in self._dirs.items()]
        path = self.store.kv
        for part in (None, *self.top.relative_to(self.store.kv).parts):
            if part is not None:
                path = path / part
            if str(path) in self._dirs:
                break
            try:
                dirs.append((str(path), os.stat(path).st_ino))
            except (FileNotFoundError, NotADirectoryError):
                break
        return dirs


class FileDiscovery(Discovery):
    """Discovery in a local directory (see the module docstring)."""

    def __init__(
        self,
        url: str,
        root: Path,
        *,
        ttl: float,
        keepalive_interval: float | None,
        op_timeout: float,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
    ) -> None:
        super().__init__(url, ttl=ttl, keepalive_interval=keepalive_interval, op_timeout=op_timeout)
        # The periodic check of a watched view (``list_and_watch``) guards against an etcd stream that
        # stalls without an error. This backend's watch is itself a scan of the directory, with nothing
        # in between to stall; the check only re-read every record of the prefix from a cold cache, every
        # T/2 per watch (a fifth to a quarter of an idle router's CPU with 1000 engines, measured).
        self.watch_check_interval = math.inf
        self.root = root
        self.poll_interval = poll_interval
        self._store = _Store(root)
        self._lease_ttl: dict[int, float] = {}
        self._gc_task: asyncio.Task[None] | None = None

    @classmethod
    async def open(
        cls, url: str, *, ttl: float, connect_timeout: float, keepalive_interval: float | None = None
    ) -> FileDiscovery:
        root, poll = parse_file_url(url)
        root = root or default_file_root()
        self = cls(
            url, root, ttl=ttl, keepalive_interval=keepalive_interval, op_timeout=connect_timeout, poll_interval=poll
        )
        try:
            self._store.prepare()
        except OSError as exc:
            raise DiscoveryRefused(
                f"discovery directory {root} is not usable ({exc.strerror or exc}); "
                "pass a writable directory, e.g. --discovery file:///tmp/kvmesh"
            ) from None
        self._gc_task = asyncio.get_running_loop().create_task(self._gc_loop(), name=f"file-discovery-gc {root}")
        return self

    # -- public API ----------------------------------------------------------------------------
    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        self._check_open()
        try:
            return await asyncio.to_thread(_Scanner(self._store, prefix).scan)
        except OSError as exc:
            raise DiscoveryUnavailable(f"discovery directory {self.root}: {exc}") from exc

    async def _watch(self, prefix: str) -> AsyncGenerator[WatchEvent, None]:
        scanner = _Scanner(self._store, prefix)
        signal = ChangeSignal.open(self._store.leases)
        try:
            async for event in self._scan_forever(scanner, signal):
                yield event
        finally:
            if signal is not None:
                signal.close()

    async def _scan_forever(self, scanner: _Scanner, signal: ChangeSignal | None) -> AsyncGenerator[WatchEvent, None]:
        state: dict[str, bytes] | None = None
        while True:
            raise_if_cancelling()
            self._check_open()
            scanned_at = time.monotonic()
            try:
                current = await asyncio.to_thread(scanner.scan)
                while signal is not None and not signal.failed and signal.cover(scanner.directories()):
                    current = await asyncio.to_thread(scanner.scan)  # what the new watches could have missed
            except OSError as exc:
                self._note_unreachable()
                if state is not None:
                    log.warning("file discovery: cannot scan %s (%s); will resync", self.root, exc)
                state = None  # after recovery, a fresh Snapshot
                await asyncio.sleep(max(self.poll_interval, 0.5))
                continue
            if state is None:
                state = current
                yield Snapshot(dict(current))
            else:
                previous, state = state, current
                for key in previous.keys() - current.keys():
                    yield Removed(key)
                for key, value in current.items():
                    if previous.get(key) != value:
                        yield Added(key, value)
            if signal is None or signal.failed:
                await asyncio.sleep(self.poll_interval)
                continue
            await signal.wait(min(scanner.expiry + _EXPIRY_MARGIN_S, _IDLE_RESCAN_S))
            await asyncio.sleep(max(0.0, scanned_at + self.poll_interval - time.monotonic()))
            signal.drain()

    async def _close_backend(self) -> None:
        if self._gc_task is not None:
            self._gc_task.cancel()
            await asyncio.wait([self._gc_task], timeout=2.0)
            self._gc_task = None

    async def _gc_loop(self) -> None:
        period = min(max(self.ttl, 0.5), 5.0)
        while True:
            await asyncio.sleep(period)
            try:
                await asyncio.to_thread(self._store.gc)
            except Exception:
                log.warning("file discovery: garbage collection failed", exc_info=True)

    # -- lease primitives ----------------------------------------------------------------------
    def _io(self, what: str, exc: OSError) -> DiscoveryUnavailable:
        return DiscoveryUnavailable(f"discovery directory {self.root}: {what} failed: {exc.strerror or exc}")

    async def _lease_grant(self, ttl: float) -> tuple[int, float]:
        self._check_open()
        try:
            lease_id = self._store.grant(ttl)
        except OSError as exc:
            raise self._io("lease grant", exc) from exc
        self._lease_ttl[lease_id] = ttl
        return lease_id, ttl

    async def _lease_keepalive(self, lease_id: int) -> float:
        return self._lease_keepalive_blocking(lease_id, self.op_timeout)

    _blocking_keepalive = True

    def _lease_keepalive_blocking(self, lease_id: int, timeout: float) -> float:
        """A stat and a utime: thread-safe (the TTL map is only read here)."""
        try:
            return self._store.keepalive(lease_id, self._lease_ttl.get(lease_id, self.ttl))
        except OSError as exc:
            raise self._io("lease keepalive", exc) from exc

    async def _lease_revoke(self, lease_id: int) -> None:
        try:
            await asyncio.to_thread(self._store.revoke, lease_id)
        except OSError as exc:
            raise self._io("lease revoke", exc) from exc
        self._lease_ttl.pop(lease_id, None)

    async def _put(self, key: str, value: bytes, lease_id: int) -> None:
        self._check_open()
        try:
            self._store.put(key, value, lease_id)
        except OSError as exc:
            raise self._io(f"put {key!r}", exc) from exc

    async def _delete(self, key: str) -> None:
        self._check_open()
        try:
            self._store.delete(key)
        except OSError as exc:
            raise self._io(f"delete {key!r}", exc) from exc

    async def _get(self, key: str) -> bytes | None:
        self._check_open()
        try:
            return self._store.get(key)
        except OSError as exc:
            raise self._io(f"get {key!r}", exc) from exc

    async def _get_many(self, keys: Iterable[str]) -> dict[str, bytes | None]:
        """A stat or two per key (see ``_Store.get``): cheaper than a scan of the keys' directories."""
        return {key: await self._get(key) for key in keys}
