"""Key layout, URL parsing and lease timings: pure functions, no backend."""

from __future__ import annotations

import time

import pytest
from kvmesh.discovery import (
    InstanceKey,
    LeasePolicy,
    ModelKey,
    instance_key,
    instance_prefix,
    model_key,
    model_prefix,
    open_discovery,
    parse_instance_key,
    parse_model_key,
)
from kvmesh.discovery_urls import parse_etcd_endpoints


def test_instance_key_layout():
    assert instance_key("dyn", "worker", "generate", 0x1A2B) == "v1/instances/dyn/worker/generate/1a2b"
    assert instance_prefix("dyn") == "v1/instances/dyn/"
    assert instance_prefix("dyn", "worker") == "v1/instances/dyn/worker/"
    assert instance_prefix("dyn", "worker", "generate") == "v1/instances/dyn/worker/generate/"
    assert instance_key("dyn", "worker", "generate", 5).startswith(instance_prefix("dyn", "worker"))
    assert parse_instance_key("v1/instances/dyn/worker/generate/1a2b") == InstanceKey(
        "dyn", "worker", "generate", 0x1A2B
    )


def test_model_key_layout_encodes_slashes():
    key = model_key("dyn", "Qwen/Qwen3-0.6B", 255)
    assert key == "v1/models/dyn/Qwen%2FQwen3-0.6B/ff"
    assert key.startswith(model_prefix("dyn", "Qwen/Qwen3-0.6B")) and key.startswith(model_prefix("dyn"))
    assert parse_model_key(key) == ModelKey("dyn", "Qwen/Qwen3-0.6B", 255)


@pytest.mark.parametrize(
    "call",
    [
        lambda: instance_key("", "w", "e", 1),
        lambda: instance_key("n", "w", "e", -1),
        lambda: instance_prefix("n", None, "e"),
        lambda: parse_instance_key("v1/instances/n/w/1"),
        lambda: parse_instance_key("v1/instances/n/w/e/xyz"),
        lambda: parse_model_key("v1/instances/n/m/1"),
    ],
)
def test_bad_keys_raise_value_error(call):
    with pytest.raises(ValueError):
        call()


def test_etcd_endpoints():
    assert parse_etcd_endpoints("etcd://a:1,b:2") == [("a", 1), ("b", 2)]
    assert parse_etcd_endpoints("etcd://a") == [("a", 2379)]
    assert parse_etcd_endpoints("etcd://[::1]:2380/") == [("::1", 2380)]


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("zk://127.0.0.1:2181", "unsupported scheme"),
        ("127.0.0.1:2379", "expected etcd://"),
        ("etcd://", "needs host:port"),
        ("etcd://h:port", "bad etcd port"),
        ("etcd://h:70000", "out of range"),
        ("file://relative/dir", "absolute path"),
    ],
)
async def test_bad_urls_raise_value_error_quickly(url: str, match: str):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=match) as err:
        await open_discovery(url)
    assert time.monotonic() - t0 < 0.5 and "\n" not in str(err.value)


async def test_bad_ttl_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="ttl"):
        await open_discovery(f"file://{tmp_path}", ttl=0)


def test_lease_policy_timings():
    p = LeasePolicy(10.0)
    assert (p.keepalive_interval, p.margin, p.retry_interval, p.max_regrant_backoff) == pytest.approx(
        (10 / 3, 1.0, 0.5, 1.0)
    )
    p = LeasePolicy(2.0)
    assert (p.keepalive_interval, p.margin, p.retry_interval) == pytest.approx((2 / 3, 0.25, 0.1))
    assert LeasePolicy(0.6).margin == pytest.approx(0.2)
    with pytest.raises(ValueError, match="too long"):
        LeasePolicy(2.0, keepalive_interval=1.0)
    with pytest.raises(ValueError, match="ttl"):
        LeasePolicy(0)
