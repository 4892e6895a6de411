"""Discovery and leases: who is alive, and where.

Two backends pass the same test suite:

* ``etcd://host:port[,host:port]`` - an etcd cluster (client ``aetcd``);
* ``file:///abs/dir`` - a directory shared by the processes of one machine, no server
  (``file://`` alone: :func:`default_file_root`).

Usage::

    disc = await open_discovery("etcd://127.0.0.1:2379", ttl=10)
    lease = await disc.grant_lease(on_lost=stop_taking_work, on_renewed=resume)
    await lease.put(instance_key("ns", "worker", "engine", lease.id), record.SerializeToString())
    async for event in disc.list_and_watch(instance_prefix("ns", "worker")):
        ...  # Snapshot first (and after every resync), then Added / Removed
    await lease.revoke()
    await disc.close()

The lease policy (when a lease counts as lost, how it comes back) is in
:mod:`kvmesh.discovery.lease` and docs/discovery.md.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from kvmesh.discovery.base import (
    INSTANCES_ROOT,
    MODELS_ROOT,
    Added,
    Discovery,
    InstanceKey,
    ModelKey,
    Removed,
    Snapshot,
    WatchEvent,
    apply_watch_event,
    instance_key,
    instance_prefix,
    model_key,
    model_prefix,
    parse_instance_key,
    parse_model_key,
)
from kvmesh.discovery.errors import DiscoveryError, DiscoveryRefused, DiscoveryUnavailable, bounded
from kvmesh.discovery.file import default_file_root
from kvmesh.discovery.lease import Lease, LeasePolicy

__all__ = [
    "INSTANCES_ROOT",
    "MODELS_ROOT",
    "Added",
    "Discovery",
    "DiscoveryError",
    "DiscoveryRefused",
    "DiscoveryUnavailable",
    "InstanceKey",
    "Lease",
    "LeasePolicy",
    "ModelKey",
    "Removed",
    "Snapshot",
    "WatchEvent",
    "apply_watch_event",
    "default_file_root",
    "instance_key",
    "instance_prefix",
    "model_key",
    "model_prefix",
    "open_discovery",
    "parse_instance_key",
    "parse_model_key",
]


async def open_discovery(
    url: str,
    *,
    ttl: float = 10.0,
    connect_timeout: float = 3.0,
    keepalive_interval: float | None = None,
) -> Discovery:
    """Open a discovery backend from its URL.

    ``ttl``: lease TTL in seconds (keepalive every ``keepalive_interval``, default ``ttl / 3``).
    ``connect_timeout``: bound on opening and on every single backend call.
    Raises ValueError for a malformed URL or settings, DiscoveryUnavailable (one actionable line)
    when the backend cannot be reached or used within ``connect_timeout``.
    """
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"discovery URL {url!r}: expected etcd://host:port[,host:port] or file:///abs/dir")
    if not ttl > 0:
        raise ValueError(f"discovery lease ttl must be > 0 seconds, got {ttl!r}")
    if not connect_timeout > 0:
        raise ValueError(f"discovery connect_timeout must be > 0 seconds, got {connect_timeout!r}")
    scheme = url.split("://", 1)[0].lower()
    started = time.monotonic()
    opener: Callable[..., Awaitable[Discovery]]
    if scheme == "etcd":
        from kvmesh.discovery.etcd import EtcdDiscovery

        opener = EtcdDiscovery.open
    elif scheme == "file":
        from kvmesh.discovery.file import FileDiscovery

        opener = FileDiscovery.open
    else:
        raise ValueError(
            f"discovery URL {url!r}: unsupported scheme {scheme!r}; use etcd://host:port[,host:port] or file:///abs/dir"
        )
    try:
        return await bounded(
            opener(url, ttl=ttl, connect_timeout=connect_timeout, keepalive_interval=keepalive_interval),
            connect_timeout + 0.5,
        )
    except TimeoutError:
        raise DiscoveryUnavailable(
            f"discovery {url} did not answer within {time.monotonic() - started:.1f}s; check that it is up"
        ) from None
