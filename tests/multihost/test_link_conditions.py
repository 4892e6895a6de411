"""Link conditions hold on the wire: two namespaces on a bridge, each condition measured, not assumed.

Round trips are TCP ping-pongs, loss is counted over 20 000 paced datagrams, the rate cap is bulk TCP
goodput. The delay and the cap are compared with the clear link measured in the same test, so a
loaded machine shifts both sides alike. Needs root (network namespaces); fails in one line without.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kvmesh_bench import link_conditions as lc

PROBE = str(Path(__file__).with_name("netprobe.py"))


def require_netns() -> None:
    """One clear line when this machine cannot make network namespaces (not root, no iproute2/nft)."""
    missing = [tool for tool in ("ip", "tc", "nft") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"multihost tests need iproute2 and nftables (missing: {', '.join(missing)})", pytrace=False)
    if os.geteuid() != 0:
        pytest.fail("multihost tests need root (network namespaces, veths, qdiscs)", pytrace=False)


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@dataclass
class Pair:
    """Hosts a (10.77.0.1) and b (10.77.0.2) on a bridge in a third namespace."""

    a: lc.Link
    b: lc.Link

    def probe(self, server_ns: str, server: list[str], client_ns: str, client: list[str]) -> tuple[dict, dict]:
        srv = subprocess.Popen(["ip", "netns", "exec", server_ns, sys.executable, PROBE, *server],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"
            out = subprocess.run(["ip", "netns", "exec", client_ns, sys.executable, PROBE, *client],
                                 capture_output=True, text=True, timeout=120)  # fmt: skip
            assert out.returncode == 0, out.stderr
            server_out, _ = srv.communicate(timeout=60)
            lines = server_out.strip().splitlines()  # the echo server prints nothing more
            return (json.loads(lines[-1]) if lines else {}), json.loads(out.stdout)
        finally:
            if srv.poll() is None:
                srv.kill()
                srv.wait()

    def rtt_ms(self, n: int = 200) -> float:
        """Median TCP round trip a -> b -> a."""
        _, client = self.probe(self.b.netns, ["echo", "7001"], self.a.netns, ["rtt", "10.77.0.2", "7001", str(n)])
        return statistics.median(client["rtt_ms"])

    def delivered(self, sender: lc.Link, receiver_ip: str, receiver: lc.Link, n: int) -> int:
        server, _ = self.probe(receiver.netns, ["udp-sink", "7002", "60"], sender.netns,
                               ["udp-send", receiver_ip, "7002", str(n)])  # fmt: skip
        return int(server["received"])

    def goodput_mbit(self, sender: lc.Link, receiver_ip: str, receiver: lc.Link, seconds: float = 2.0) -> float:
        server, _ = self.probe(receiver.netns, ["tcp-sink", "7003"], sender.netns,
                               ["tcp-send", receiver_ip, "7003", str(seconds)])  # fmt: skip
        return server["bytes"] * 8 / server["seconds"] / 1e6


@pytest.fixture
def pair() -> Iterator[Pair]:
    require_netns()
    tag = secrets.token_hex(3)
    switch, bridge = f"kvl{tag}s", f"kvl{tag}br"
    links = [lc.Link(f"kvl{tag}{i}", f"kvl{tag}h{i}", f"kvl{tag}p{i}", bridge, switch) for i in (1, 2)]
    made: list[str] = []
    try:
        sh("ip", "netns", "add", switch)
        made.append(switch)
        sh("ip", "-n", switch, "link", "add", bridge, "type", "bridge")
        sh("ip", "-n", switch, "link", "set", bridge, "up")
        for i, link in enumerate(links, 1):
            sh("ip", "netns", "add", link.netns)
            made.append(link.netns)
            sh("ip", "-n", switch, "link", "add", link.peer, "type", "veth", "peer", "name", link.dev,
               "netns", link.netns)  # fmt: skip
            sh("ip", "-n", switch, "link", "set", link.peer, "master", bridge, "up")
            sh("ip", "-n", link.netns, "addr", "add", f"10.77.0.{i}/24", "dev", link.dev)
            sh("ip", "-n", link.netns, "link", "set", link.dev, "up")
            sh("ip", "-n", link.netns, "link", "set", "lo", "up")
        yield Pair(*links)
    finally:
        lc.clear_all()
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def test_the_backend_is_netem_where_the_kernel_has_it() -> None:
    require_netns()
    assert lc.backend() == ("netem" if lc.netem_available() else "fallback")


def test_delay_adds_to_every_round_trip_and_clears(pair: Pair) -> None:
    clear = pair.rtt_ms()
    # 10 ms RTT between the two hosts: 5 ms on each one's egress
    lc.apply(pair.a, delay_ms=5)
    lc.apply(pair.b, delay_ms=5)
    both = pair.rtt_ms(100)
    assert 10.0 <= both - clear <= 12.5, (clear, both)  # the median: a loaded machine adds to the tail
    # one side only: half of it
    lc.clear(pair.b)
    one = pair.rtt_ms(100)
    assert 5.0 <= one - clear <= 6.5, (clear, one)
    lc.clear(pair.a)
    assert lc.applied(pair.a) is None
    assert pair.rtt_ms(100) < clear + 1.5


def test_loss_drops_that_share_of_the_senders_packets(pair: Pair) -> None:
    n = 20_000
    assert pair.delivered(pair.a, "10.77.0.2", pair.b, n) == n  # the clear link loses nothing
    lc.apply(pair.a, loss_pct=1.0)
    lost = n - pair.delivered(pair.a, "10.77.0.2", pair.b, n)
    assert 140 <= lost <= 260, lost  # 1 % of 20 000 is 200, binomial sd 14: +-4 sd
    # the other direction is the receiver's egress: not shaped
    assert pair.delivered(pair.b, "10.77.0.1", pair.a, 5_000) == 5_000
    # TCP gets its data through a lossy link (retransmitted), and clear ends the loss
    assert pair.goodput_mbit(pair.a, "10.77.0.2", pair.b, 1.0) > 0
    lc.clear(pair.a)
    assert pair.delivered(pair.a, "10.77.0.2", pair.b, 5_000) == 5_000


def test_rate_cap_holds_both_ways(pair: Pair) -> None:
    clear = pair.goodput_mbit(pair.a, "10.77.0.2", pair.b, 1.0)
    lc.apply(pair.a, rate_mbit=20)
    out = pair.goodput_mbit(pair.a, "10.77.0.2", pair.b)
    back = pair.goodput_mbit(pair.b, "10.77.0.1", pair.a)
    assert clear > 60, clear  # the bare veth is far above the cap, else the test proves nothing
    for goodput in (out, back):
        assert 12 <= goodput <= 21, (clear, out, back)
