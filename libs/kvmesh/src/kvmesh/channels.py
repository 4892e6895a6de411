"""Client-side channel pool keyed by instance id.

One HTTP/2 connection per peer instance, shared by every call to it: opening a channel per
request would cost a TCP + HTTP/2 handshake on the hot path. A peer that re-appears at another
address gets a fresh channel; a peer that disappears from discovery is dropped.
Deadlines are per call (``timeout=`` on the stub method), never per channel.
"""

from __future__ import annotations

import grpc

from kvmesh import telemetry
from kvmesh.grpc_options import CLIENT_OPTIONS


class ChannelPool:
    def __init__(self) -> None:
        self._channels: dict[int | str, tuple[str, grpc.aio.Channel]] = {}
        self._stale: list[grpc.aio.Channel] = []  # replaced while calls may still use them

    def get(self, instance_id: int | str, address: str) -> grpc.aio.Channel:
        entry = self._channels.get(instance_id)
        if entry is not None and entry[0] == address:
            return entry[1]
        channel = grpc.aio.insecure_channel(
            address, options=CLIENT_OPTIONS, interceptors=telemetry.client_interceptors() or None
        )
        if entry is not None:
            self._stale.append(entry[1])
        self._channels[instance_id] = (address, channel)
        return channel

    async def drop(self, instance_id: int | str) -> None:
        entry = self._channels.pop(instance_id, None)
        if entry is not None:
            await entry[1].close(grace=None)

    async def close(self) -> None:
        channels = [channel for _, channel in self._channels.values()] + self._stale
        self._channels.clear()
        self._stale.clear()
        for channel in channels:
            await channel.close(grace=None)

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._channels

    def __len__(self) -> int:
        return len(self._channels)
