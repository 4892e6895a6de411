"""The worker process's one NIXL agent (UCX backend over host memory), shared by all its engines.

Created on first use by an engine whose role moves KV (prefill or decode), so an aggregated worker never
loads NIXL. No progress thread (it busy-polls a core): progress happens in our own polling, on the
event-loop thread: the reader polls its transfer, and a holder polls notifications while it holds
blocks (UCX completes small reads faster when the target progresses too).

Peers are loaded lazily: a decode engine adds a prefill agent from the metadata carried in
``KvTransferParams`` the first time it pulls from it (the same bytes are published in discovery).
Failures surface as :class:`TransferFailed` (peer gone, backend error, timeout), never as NIXL's own
exception types.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from typing import Any

log = logging.getLogger(__name__)

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # one machine: keep UCX's TCP lane on loopback
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO lines on stdout otherwise

_POLL_S = 0.0002
_RELEASE_WAIT_S = 0.5


class TransferFailed(Exception):
    """A backend transfer did not complete (peer gone, backend error or timeout)."""


class NixlAgent:
    """One NIXL agent: registered arenas, known peers, READs."""

    _instance: NixlAgent | None = None

    @classmethod
    def process_agent(cls) -> NixlAgent:
        if cls._instance is None:
            cls._instance = cls(f"kvmesh-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        return cls._instance

    def __init__(self, name: str) -> None:
        from nixl._api import nixl_agent, nixl_agent_config  # heavy: only workers that move KV pay for it

        self.name = name
        self._agent: Any = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._peers: set[str] = set()
        self._registered: list[Any] = []
        self._metadata: bytes | None = None
        self._holders = 0
        self._progress_task: asyncio.Task[None] | None = None

    def register(self, address: int, nbytes: int) -> None:
        self._registered.append(self._agent.register_memory([(address, nbytes, 0, "")], "DRAM"))
        self._metadata = None  # registrations change the metadata peers need

    @property
    def metadata(self) -> bytes:
        if self._metadata is None:
            self._metadata = bytes(self._agent.get_agent_metadata())
        return self._metadata

    def _ensure_peer(self, name: str, metadata: bytes) -> None:
        if name in self._peers:
            return
        if not metadata:
            raise TransferFailed(f"no backend metadata for KV source agent {name}")
        try:
            self._agent.add_remote_agent(metadata)
        except Exception as exc:  # the backend's own error names its internals: logged here, not sent back
            log.warning("cannot load KV source agent %s: %r", name, exc)
            raise TransferFailed(f"cannot load KV source agent {name}: its metadata was refused") from None
        self._peers.add(name)

    def forget_peer(self, name: str) -> None:
        """Drop a peer (it died): the next pull from an agent of that name reloads its metadata."""
        if name in self._peers:
            self._peers.discard(name)
            with contextlib.suppress(Exception):  # best effort: the peer is gone either way
                self._agent.remove_remote_agent(name)

    async def read(
        self,
        peer: str,
        metadata: bytes,
        local: list[tuple[int, int]],
        remote: list[tuple[int, int]],
        notif: bytes,
        timeout_s: float,
    ) -> float:
        """READ ``remote`` (peer addresses, lengths) into ``local``; returns wall seconds. Raises TransferFailed.

        Polls on the event-loop thread (yielding between polls), so a cancel takes effect at the next
        poll; the transfer handle is released on every path.
        """
        self._ensure_peer(peer, metadata)
        agent = self._agent
        started = time.perf_counter()
        handle = None
        try:
            local_descs = agent.get_xfer_descs([(a, n, 0) for a, n in local], "DRAM")
            remote_descs = agent.get_xfer_descs([(a, n, 0) for a, n in remote], "DRAM")
            handle = agent.initialize_xfer("READ", local_descs, remote_descs, peer, notif)
            state = agent.transfer(handle)
            deadline = started + timeout_s
            while state == "PROC":
                if time.perf_counter() > deadline:
                    raise TransferFailed(f"KV read from {peer} timed out after {timeout_s:g}s")
                await asyncio.sleep(_POLL_S if time.perf_counter() - started > 0.002 else 0)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferFailed(f"KV read from {peer} failed (backend state {state})")
        except TransferFailed:
            self.forget_peer(peer)
            raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # nixlRemoteDisconnectError & co: the peer is gone or the backend broke
            self.forget_peer(peer)
            log.warning("KV read from %s failed: %r", peer, exc)
            raise TransferFailed(f"KV read from {peer} failed: the source is gone or refused the read") from None
        finally:
            if handle is not None:
                await self._release(handle)
        return time.perf_counter() - started

    async def _release(self, handle: Any) -> None:
        """A handle still in flight (a cancelled or timed-out pull) is polled to an end first, up to
        ``_RELEASE_WAIT_S``: its target slots are freed by the caller right after, and must not be written
        once reused. The event loop runs meanwhile: polled in a busy loop, a cancelled read from a frozen
        source stalled every request of the worker for half a second."""
        deadline = time.perf_counter() + _RELEASE_WAIT_S
        try:
            while self._agent.check_xfer_state(handle) == "PROC" and time.perf_counter() < deadline:
                await asyncio.sleep(_POLL_S)
        except Exception:
            pass
        finally:  # a second cancel ends the wait early; the handle is released all the same
            with contextlib.suppress(Exception):
                handle.release()

    # -- holder-side progress --------------------------------------------------------------------
    def holding(self, delta: int) -> None:
        """Count holds; while any exists, poll notifications so that readers' transfers progress."""
        self._holders += delta
        if self._holders > 0 and (self._progress_task is None or self._progress_task.done()):
            self._progress_task = asyncio.get_running_loop().create_task(self._progress())

    async def _progress(self) -> None:
        while self._holders > 0:
            with contextlib.suppress(Exception):
                self._agent.get_new_notifs()
            await asyncio.sleep(0.001)
