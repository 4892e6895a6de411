"""Client-side channel pool keyed by instance id.

One HTTP/2 connection per peer instance, shared by every call to it: opening a channel per
request would cost a TCP + HTTP/2 handshake on the hot path. A peer that re-appears at another
address gets a fresh channel; a peer that disappears from discovery is dropped.
Deadlines are per call (``timeout=`` on the stub method), never per channel.

Security: with the process's mesh identity configured (``kvmesh.tls.configure_client``, done by
``DaemonRuntime`` under ``--tls-*``) every channel is mTLS. ``role=`` pins the peer's role: the
server must present a mesh certificate for ``<role>.kvmesh`` (a worker's, a router's), whatever
address discovery advertised for it.
"""

from __future__ import annotations

import asyncio

import grpc

from kvmesh import telemetry, tls
from kvmesh.grpc_options import CLIENT_OPTIONS

RETIRE_GRACE_S = 10.0  # an evicted channel's calls get this long to finish before it closes


class ChannelPool:
    def __init__(self, max_channels: int | None = None) -> None:
        """``max_channels``: keep at most this many, closing the least recently used (once its calls end,
        at most ``RETIRE_GRACE_S``). For a pool keyed by addresses a peer hands over (a KV transfer's
        source): unbounded, every address ever named cost a channel and a file descriptor for good."""
        self._channels: dict[int | str, tuple[str, grpc.aio.Channel]] = {}
        self._stale: list[grpc.aio.Channel] = []  # replaced while calls may still use them
        self._max = max_channels
        self._retiring: dict[asyncio.Task[None], grpc.aio.Channel] = {}

    def get(self, instance_id: int | str, address: str, *, role: str | None = None) -> grpc.aio.Channel:
        """The channel to ``instance_id`` at ``address``; ``role`` (e.g. "worker") pins the peer's certificate role."""
        entry = self._channels.get(instance_id)
        if entry is not None and entry[0] == address:
            if self._max is not None:  # the most recently used go last
                self._channels[instance_id] = self._channels.pop(instance_id)
            return entry[1]
        channel = open_channel(address, role=role)
        if entry is not None:
            self._stale.append(entry[1])
        self._channels[instance_id] = (address, channel)
        if self._max is not None and len(self._channels) > self._max:
            _, evicted = self._channels.pop(next(iter(self._channels)))
            self._retire(evicted)
        return channel

    def _retire(self, channel: grpc.aio.Channel) -> None:
        task = asyncio.get_running_loop().create_task(channel.close(grace=RETIRE_GRACE_S))
        self._retiring[task] = channel
        task.add_done_callback(self._retiring.pop)

    def release(self, instance_id: int | str) -> None:
        """Forget the channel to a peer that left: it closes once its calls end (at most ``RETIRE_GRACE_S``).
        A peer that comes back gets a new one."""
        entry = self._channels.pop(instance_id, None)
        if entry is not None:
            self._retire(entry[1])

    async def drop(self, instance_id: int | str) -> None:
        entry = self._channels.pop(instance_id, None)
        if entry is not None:
            await entry[1].close(grace=None)

    async def close(self) -> None:
        channels = [channel for _, channel in self._channels.values()] + self._stale + list(self._retiring.values())
        self._channels.clear()
        self._stale.clear()
        for task in list(self._retiring):
            task.cancel()
        for channel in channels:
            await channel.close(grace=None)

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._channels

    def __len__(self) -> int:
        return len(self._channels)


def open_channel(address: str, *, role: str | None = None) -> grpc.aio.Channel:
    """One channel with the mesh options: mTLS when this process has an identity, else plaintext."""
    interceptors = telemetry.client_interceptors() or None
    material = tls.client_material()
    if material is None:
        return grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS, interceptors=interceptors)
    options: list[tuple[str, int | str]] = [*CLIENT_OPTIONS, *tls.target_options(role)]
    return grpc.aio.secure_channel(
        address, tls.channel_credentials(material), options=options, interceptors=interceptors
    )
