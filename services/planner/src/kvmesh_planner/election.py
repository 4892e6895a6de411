"""Exactly one planner acts: leader election, and a decision log the leader commits before it acts.

etcd (``EtcdElection``, aetcd's lease and transaction primitives, on a connection of its own):

- **Campaign.** Grant a lease of TTL ``T`` and, in one transaction, create ``v1/planner/{ns}/leader`` =
  this planner's id under it if the key does not exist (``create_revision == 0``). Whoever creates it
  leads; the key lives exactly as long as the leader's lease.
- **Keep.** The leader refreshes the lease every ``T/3``. Without a proof of the lease for ``T - M`` seconds
  (``M`` as in ``kvmesh.discovery``'s lease policy) it steps down at once: it stops acting before etcd can
  let a standby take over, so two planners never act together.
- **Take over.** A standby re-campaigns every ``T/4``: a dead leader's key expires ``T`` (+0.5 s, etcd's
  lessor) after its last keepalive, so a standby leads within ``1.25 T + 0.5 s < 2 T`` (for ``T >= 1 s``).
- **No decision applied twice.** Before applying a decision the leader writes it to
  ``v1/planner/{ns}/decision`` in a transaction guarded by ``value(leader) == its id``: a deposed leader's
  commit fails and it does not act. A new leader reads the log and continues from the next id; targets
  are absolute and connectors adopt what runs, so the last committed decision is never re-executed.

File backend (``FileElection``): one planner per discovery directory and namespace, an ``flock`` on
``<dir>/planner-{ns}.lock``; a second planner waits as a standby and takes over when the first exits
(the kernel releases the lock, even on kill -9). The decision log is a file beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Protocol

import aetcd
from kvmesh.discovery_urls import parse_etcd_endpoints
from kvmesh.v1 import planner_pb2

log = logging.getLogger(__name__)


def leader_key(namespace: str) -> str:
    return f"v1/planner/{namespace}/leader"


def decision_key(namespace: str) -> str:
    return f"v1/planner/{namespace}/decision"


class Election(Protocol):
    @property
    def is_leader(self) -> bool: ...

    @property
    def term(self) -> int:
        """How many times this planner has won leadership: a new term means other leaders may have
        decided in between, so state built in an earlier term is stale."""
        ...

    async def run(self) -> None:
        """Campaign and keep leadership until cancelled."""
        ...

    async def last_decision(self) -> planner_pb2.PlannerDecisionLog | None: ...

    async def commit(self, entry: planner_pb2.PlannerDecisionLog) -> bool:
        """Record the decision iff this planner still leads; only then may it be applied."""
        ...

    async def resign(self) -> None: ...


class EtcdElection:
    def __init__(self, url: str, namespace: str, identity: int, ttl: float) -> None:
        host, port = parse_etcd_endpoints(url)[0]
        self._client = aetcd.Client(host=host, port=port, timeout=max(1, math.ceil(ttl / 2)))
        self._key = leader_key(namespace).encode()
        self._log_key = decision_key(namespace).encode()
        self._me = str(identity).encode()
        self._ttl = ttl
        self._margin = min(max(0.1 * ttl, 0.25), ttl / 3)
        self._lease: Any = None
        self._proof = 0.0
        self._leader = False
        self._term = 0
        self.changes = asyncio.Event()

    @property
    def term(self) -> int:
        return self._term

    @property
    def is_leader(self) -> bool:
        if self._leader and time.monotonic() - self._proof > self._ttl - self._margin:
            self._step_down("no proof of the lease")
        return self._leader

    def _step_down(self, why: str) -> None:
        if self._leader:
            log.warning("planner election: stepping down (%s)", why)
        self._leader = False
        self.changes.set()

    async def run(self) -> None:
        try:
            while True:
                try:
                    if not self._leader:
                        await self._campaign()
                    else:
                        await self._keepalive()
                except Exception as exc:  # etcd down or slow: retry; a leader without proof steps down
                    log.debug("planner election: %s", exc)
                    _ = self.is_leader
                await asyncio.sleep(self._ttl / 3 if self._leader else self._ttl / 4)
        finally:
            await self.resign()

    async def _campaign(self) -> None:
        sent = time.monotonic()
        lease = await self._client.lease(max(1, math.ceil(self._ttl)))
        t = self._client.transactions
        ok, _ = await self._client.transaction(
            compare=[t.create(self._key) == 0], success=[t.put(self._key, self._me, lease=lease)], failure=[]
        )
        if ok:
            self._lease, self._proof, self._leader = lease, sent, True
            self._term += 1
            log.info("planner election: leading (lease %x)", lease.id)
            self.changes.set()
        else:
            with contextlib.suppress(Exception):
                await self._client.revoke_lease(lease.id)

    async def _keepalive(self) -> None:
        sent = time.monotonic()
        reply = await self._client.refresh_lease(self._lease.id)
        if reply is None or reply.TTL <= 0:
            self._step_down("lease expired")
            return
        self._proof = sent

    async def last_decision(self) -> planner_pb2.PlannerDecisionLog | None:
        result = await self._client.get(self._log_key)
        return planner_pb2.PlannerDecisionLog.FromString(result.value) if result is not None else None

    async def commit(self, entry: planner_pb2.PlannerDecisionLog) -> bool:
        if not self.is_leader:
            return False
        t = self._client.transactions
        ok, _ = await self._client.transaction(
            compare=[t.value(self._key) == self._me],
            success=[t.put(self._log_key, entry.SerializeToString())],
            failure=[],
        )
        if not ok:
            self._step_down("the leader key is someone else's")
        return bool(ok)

    async def resign(self) -> None:
        lease, self._lease = self._lease, None
        self._step_down("resigning")
        if lease is not None:
            with contextlib.suppress(Exception):
                await self._client.revoke_lease(lease.id)
        with contextlib.suppress(Exception):
            await self._client.close()


class FileElection:
    """One planner per directory and namespace (an flock); the others wait as standbys."""

    def __init__(self, directory: str, namespace: str, poll_s: float = 0.5) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._lock_path = os.path.join(directory, f"planner-{namespace}.lock")
        self._log_path = os.path.join(directory, f"planner-{namespace}.decision")
        self._poll = poll_s
        self._fd: int | None = None
        self._term = 0
        self.changes = asyncio.Event()

    @property
    def term(self) -> int:
        return self._term

    @property
    def is_leader(self) -> bool:
        return self._fd is not None

    async def run(self) -> None:
        try:
            while self._fd is None:
                fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    await asyncio.sleep(self._poll)
                    continue
                self._fd = fd
                self._term += 1
                log.info("planner election (file backend): leading")
                self.changes.set()
            await asyncio.Event().wait()
        finally:
            await self.resign()

    async def last_decision(self) -> planner_pb2.PlannerDecisionLog | None:
        try:
            data = Path(self._log_path).read_bytes()
        except FileNotFoundError:
            return None
        return planner_pb2.PlannerDecisionLog.FromString(data)

    async def commit(self, entry: planner_pb2.PlannerDecisionLog) -> bool:
        if self._fd is None:
            return False
        tmp = f"{self._log_path}.tmp"
        Path(tmp).write_bytes(entry.SerializeToString())
        os.replace(tmp, self._log_path)
        return True

    async def resign(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # releases the flock
