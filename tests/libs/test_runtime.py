"""``async with DaemonRuntime(...)`` owns a daemon's lifetime (real file discovery, real gRPC server).

Leaving the block, however it is left, runs one sequence: draining starts and the lease is revoked
(``on_draining`` hooks run meanwhile), in-flight calls drain, then the daemon's ``resources`` close
newest first, then discovery.
"""

import contextlib

import pytest
from kvmesh.discovery import DiscoveryError, instance_prefix, open_discovery
from kvmesh.runtime import DaemonRuntime
from kvmesh.settings import DaemonSettings


def settings(tmp_path):
    return DaemonSettings(discovery=f"file://{tmp_path}", namespace="rt", lease_ttl=2.0, drain_timeout=0.5)


async def records(url):
    async with await open_discovery(url, ttl=2.0) as disc:
        return await disc.get_prefix(instance_prefix("rt"))


@pytest.mark.parametrize("how", ["stop", "error"])
async def test_leaving_the_block_drains_then_closes_resources_newest_first(tmp_path, how):
    cfg = settings(tmp_path)
    events = []
    with pytest.raises(RuntimeError) if how == "error" else contextlib.nullcontext():
        async with DaemonRuntime("kvmesh-test", cfg) as runtime:
            runtime.resources.push_async_callback(_note, events, "first resource closed")
            runtime.resources.push_async_callback(_note, events, "second resource closed")
            runtime.on_draining(lambda: events.append(f"draining hook: serving={runtime.is_serving()}"))
            await runtime.start(0, "127.0.0.1")
            await runtime.register(runtime.instance_record("test", "test"))
            assert runtime.is_serving() and len(await records(cfg.discovery)) == 1
            if how == "error":
                raise RuntimeError("the daemon failed")
    assert events == ["draining hook: serving=False", "second resource closed", "first resource closed"]
    assert await records(cfg.discovery) == {}  # revoked, not left to expire
    with pytest.raises(DiscoveryError):  # closed last
        await runtime.discovery.get_prefix(instance_prefix("rt"))


async def _note(events, text):
    events.append(text)
