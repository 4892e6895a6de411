"""Every daemon's ``/metrics`` endpoint (``kvmesh.telemetry.start_metrics_server``).

It must not resolve its own address back to a name when it binds: ``http.server`` does
(``socket.getfqdn``), and where no DNS resolver answers, a host whose DNS is down or a network
namespace, that lookup held every daemon's start-up for the resolver's whole timeout (~10 s).
"""

import socket
import urllib.request

import prometheus_client
import pytest
from kvmesh.telemetry import start_metrics_server


@pytest.fixture
def no_name_lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Calls to the resolver's reverse lookups, which fail as an unreachable resolver would (but at once)."""
    calls: list[str] = []

    def unreachable(name: str = "") -> str:
        calls.append(name)
        raise OSError("no resolver answers")

    monkeypatch.setattr(socket, "getfqdn", unreachable)
    monkeypatch.setattr(socket, "gethostbyaddr", unreachable)
    return calls


def test_the_endpoint_binds_and_serves_without_looking_up_a_name(no_name_lookups: list[str]) -> None:
    served = prometheus_client.Counter("kvmesh_test_scrapes", "A counter this test expects to read back.")
    served.inc(3)
    port = start_metrics_server(0, "127.0.0.1")
    assert port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    assert "kvmesh_test_scrapes_total 3.0" in text
    assert no_name_lookups == [], "neither the bind nor a scrape resolves an address to a name"


def test_a_negative_port_serves_nothing() -> None:
    assert start_metrics_server(-1) is None
