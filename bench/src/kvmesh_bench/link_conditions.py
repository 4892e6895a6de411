"""Network conditions on the link of one "host" (a network namespace on a bridge): delay, loss, a rate cap.

``apply(link, delay_ms=..., loss_pct=..., rate_mbit=...)`` shapes what the host sends, as
``tc qdisc add dev <host veth> root netem delay D loss P% rate R`` would: a round trip between two
hosts both given ``delay_ms = rtt / 2`` takes ``rtt`` longer, and a packet between two hosts both
given ``loss_pct`` is lost with that probability (once, at the sender's link). The rate cap holds
both ways on the link (a link's capacity, whatever the direction). ``clear(link)`` undoes it all.

**Two backends.** With ``sch_netem`` in the kernel (``netem_available()``), everything is one netem
qdisc on the host's veth (plus a netem rate on the bridge end for the reverse direction). Kernels
built without netem (``CONFIG_NET_SCH_NETEM`` unset, no module to load) get the *fallback*, each
part still applied to packets in the kernel's path, never as an application sleep:

- **delay**: a tc ``mirred`` action on the ingress of the bridge end of the host's veth redirects
  every frame the host sends (gRPC, etcd, ARP: all of it) to a userspace wire
  (:mod:`kvmesh_bench.link_wire`) that hands it to the bridge ``delay_ms`` later through a port of
  its own; frames to the host stay in the kernel (a static FDB entry keeps them on the old port).
- **loss**: an nftables ``netdev`` ingress chain on the bridge port that carries the host's frames
  drops ``numgen random mod 10000 < loss*100`` of them, one MTU packet each (``gso_max_segs 1`` on the
  host's veth while loss is on: a 64 KiB GSO frame is not lost as a whole). The drop is after the sender's stack let
  the packet go, so TCP sees a real loss (a drop in the sender's own output hook would be reported
  back to TCP as a local error and retried, which is not what a lossy link does).
- **rate**: a ``tbf`` qdisc on both ends of the veth.

``KVMESH_LINK_BACKEND=fallback`` forces the fallback where netem exists (to test it there).
Everything created is named after the link's random suffix, so parallel runs never collide.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import subprocess
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmesh_bench.multihost import Network

__all__ = [
    "CAPPED_HOST",
    "CONDITIONS",
    "Condition",
    "Link",
    "LinkError",
    "applied",
    "apply",
    "apply_condition",
    "backend",
    "clear",
    "clear_all",
    "netem_available",
    "network_links",
    "rate_burst_bytes",
]


class LinkError(RuntimeError):
    """A shaping command failed (one line: the command and what it said)."""


@dataclass(frozen=True, slots=True)
class Link:
    """A host's veth: ``dev`` inside ``netns``, its peer ``peer`` a port of ``bridge`` in ``switch_netns``."""

    netns: str
    dev: str
    peer: str
    bridge: str
    switch_netns: str | None = None  # None: the bridge is in the namespace this process runs in


@dataclass(frozen=True, slots=True)
class Condition:
    """A network condition between every pair of hosts (rate: on one chosen link)."""

    name: str
    rtt_ms: float = 0.0
    loss_pct: float = 0.0
    rate_mbit: float = 0.0


@dataclass
class _State:
    backend: str
    delay_ms: float
    loss_pct: float
    rate_mbit: float
    wire: subprocess.Popen[str] | None = None
    wire_devs: tuple[str, str, str] | None = None  # (redirect target, wire's output, host MAC)
    nft_table: str | None = None
    qdiscs: list[tuple[str | None, str]] = field(default_factory=list)  # (netns, dev) with a root qdisc
    gso_max_segs: int | None = None  # the host veth's value before loss set it to 1


#: The issue-18 conditions: each holds between every pair of hosts, the cap on one link (``CAPPED_HOST``).
CONDITIONS: tuple[Condition, ...] = (
    Condition("rtt 1 ms", rtt_ms=1.0),
    Condition("rtt 10 ms", rtt_ms=10.0),
    Condition("loss 0.1 %", loss_pct=0.1),
    Condition("loss 1 %", loss_pct=1.0),
    Condition("cap 20 Mbit/s", rate_mbit=20.0),
)
CAPPED_HOST = "frontend1"  # the client's frontend: every request and response crosses its link

_applied: dict[Link, _State] = {}


def _run(argv: list[str], netns: str | None = None, stdin: str | None = None) -> str:
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise LinkError(f"{' '.join(argv)}: {(done.stderr or done.stdout).strip()}")
    return done.stdout


@functools.cache
def netem_available() -> bool:
    """Whether this kernel has sch_netem: a netem qdisc is tried on ``lo`` of a throwaway namespace."""
    ns = f"kvmnetem{secrets.token_hex(3)}"
    try:
        _run(["ip", "netns", "add", ns])
    except LinkError:
        return False
    try:
        _run(["ip", "link", "set", "lo", "up"], ns)
        _run(["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], ns)
        return True
    except LinkError:
        return False
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def backend() -> str:
    """``netem`` or ``fallback`` (userspace delay wire + nftables loss + tbf), as ``apply`` will use."""
    forced = os.environ.get("KVMESH_LINK_BACKEND", "")
    if forced not in ("", "netem", "fallback"):
        raise LinkError(f"KVMESH_LINK_BACKEND must be 'netem' or 'fallback', got {forced!r}")
    if forced == "netem" and not netem_available():
        raise LinkError("KVMESH_LINK_BACKEND=netem but this kernel has no sch_netem (CONFIG_NET_SCH_NETEM)")
    return forced or ("netem" if netem_available() else "fallback")


def applied(link: Link) -> Condition | None:
    """What ``apply`` put on the link (as a one-link condition), None when it is clear."""
    state = _applied.get(link)
    if state is None:
        return None
    return Condition(state.backend, rtt_ms=2 * state.delay_ms, loss_pct=state.loss_pct, rate_mbit=state.rate_mbit)


def apply(link: Link, *, delay_ms: float = 0.0, loss_pct: float = 0.0, rate_mbit: float = 0.0) -> None:
    """Shape the link (replacing what was on it): ``delay_ms`` and ``loss_pct`` on what the host sends."""
    if delay_ms < 0 or not 0 <= loss_pct < 100 or rate_mbit < 0:
        raise LinkError(f"bad link condition: delay {delay_ms} ms, loss {loss_pct} %, rate {rate_mbit} Mbit/s")
    clear(link)
    state = _State(backend(), delay_ms, loss_pct, rate_mbit)
    _applied[link] = state
    try:
        if state.backend == "netem":
            _apply_netem(link, state)
        else:
            _apply_fallback(link, state)
    except BaseException:
        clear(link)
        raise


def rate_burst_bytes(rate_mbit: float) -> int:
    """The fallback's ``tbf`` bucket: 2 ms of traffic, at least a TSO segment's worth (netem's rate has none)."""
    return max(32 * 1024, int(rate_mbit * 1e6 / 8 * 0.002))


def _tbf(rate_mbit: float) -> list[str]:
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(rate_burst_bytes(rate_mbit)), "latency", "100ms"]


def _apply_netem(link: Link, state: _State) -> None:
    egress = ["netem", "limit", "100000"]
    if state.delay_ms:
        egress += ["delay", f"{state.delay_ms}ms"]
    if state.loss_pct:
        egress += ["loss", f"{state.loss_pct}%"]
    if state.rate_mbit:
        egress += ["rate", f"{state.rate_mbit}mbit"]
    _run(["tc", "qdisc", "replace", "dev", link.dev, "root", *egress], link.netns)
    state.qdiscs.append((link.netns, link.dev))
    if state.rate_mbit:
        reverse = ["netem", "limit", "100000", "rate", f"{state.rate_mbit}mbit"]
        _run(["tc", "qdisc", "replace", "dev", link.peer, "root", *reverse], link.switch_netns)
        state.qdiscs.append((link.switch_netns, link.peer))


def _apply_fallback(link: Link, state: _State) -> None:
    port = link.peer
    if state.delay_ms:
        port = _insert_wire(link, state)
    if state.loss_pct:
        # One frame is one MTU packet, as on a wire: a 64 KiB GSO frame would be lost whole (44 segments).
        # The device limit segments at transmit time, so connections made before this count too.
        shown = json.loads(_run(["ip", "-d", "-j", "link", "show", "dev", link.dev], link.netns))[0]
        state.gso_max_segs = int(shown.get("gso_max_segs", 65535))
        _run(["ip", "link", "set", "dev", link.dev, "gso_max_segs", "1"], link.netns)
        table = f"kvmloss{secrets.token_hex(4)}"
        threshold = round(state.loss_pct * 100)  # out of 10000: 0.01 % resolution
        ruleset = (
            f"table netdev {table} {{\n"
            f'  chain lossy {{ type filter hook ingress device "{port}" priority 0; policy accept;\n'
            f"    numgen random mod 10000 < {threshold} drop\n  }}\n}}\n"
        )
        _run(["nft", "-f", "-"], link.switch_netns, stdin=ruleset)
        state.nft_table = table
    if state.rate_mbit:
        _run(["tc", "qdisc", "replace", "dev", link.dev, "root", *_tbf(state.rate_mbit)], link.netns)
        state.qdiscs.append((link.netns, link.dev))
        _run(["tc", "qdisc", "replace", "dev", link.peer, "root", *_tbf(state.rate_mbit)], link.switch_netns)
        state.qdiscs.append((link.switch_netns, link.peer))


def _insert_wire(link: Link, state: _State) -> str:
    """Send the host's frames through the userspace delay wire; returns the bridge port they enter by.

    The bridge end of the host's veth stays a port (frames *to* the host go straight to it, by a static
    FDB entry), but a tc ``mirred`` on its ingress takes every frame *from* the host to the wire, which
    hands it to a new port (learning off) after the delay.
    """
    tag = secrets.token_hex(3)
    w_in, w_tap, w_out, port = (f"kvw{tag}{c}" for c in "abcd")  # 10 characters, under IFNAMSIZ
    sw = link.switch_netns
    mac = json.loads(_run(["ip", "-j", "link", "show", "dev", link.dev], link.netns))[0]["address"]
    _run(["ip", "link", "add", w_in, "type", "veth", "peer", "name", w_tap], sw)
    _run(["ip", "link", "add", w_out, "type", "veth", "peer", "name", port], sw)
    state.wire_devs = (w_in, w_out, mac)
    for dev in (w_in, w_tap, w_out, port):
        _run(["sysctl", "-q", "-w", f"net.ipv6.conf.{dev}.disable_ipv6=1"], sw)
        _run(["ip", "link", "set", dev, "up"], sw)
    _run(["ip", "link", "set", port, "master", link.bridge], sw)
    _run(["bridge", "link", "set", "dev", port, "learning", "off"], sw)
    _run(["bridge", "fdb", "replace", mac, "dev", link.peer, "master", "static"], sw)
    argv = [sys.executable, "-m", "kvmesh_bench.link_wire", w_tap, w_out, "--delay-ms", str(state.delay_ms)]
    if sw is not None:
        argv = ["ip", "netns", "exec", sw, *argv]
    wire = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    state.wire = wire
    assert wire.stdout is not None
    line = wire.stdout.readline().strip()
    if line != "ready":
        wire.kill()
        err = wire.stderr.read() if wire.stderr else ""
        raise LinkError(f"link wire did not start: {line!r} {err.strip()[-300:]}")
    _run(["tc", "qdisc", "add", "dev", link.peer, "handle", "ffff:", "ingress"], sw)
    _run(["tc", "filter", "add", "dev", link.peer, "parent", "ffff:", "protocol", "all", "prio", "1", "u32",
          "match", "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", w_in], sw)  # fmt: skip
    return port


def clear(link: Link) -> None:
    """Remove whatever ``apply`` put on the link; the link is as the harness made it."""
    state = _applied.pop(link, None)
    if state is None:
        return
    for netns, dev in state.qdiscs:
        with contextlib.suppress(LinkError):
            _run(["tc", "qdisc", "del", "dev", dev, "root"], netns)
    if state.gso_max_segs is not None:
        with contextlib.suppress(LinkError):
            _run(["ip", "link", "set", "dev", link.dev, "gso_max_segs", str(state.gso_max_segs)], link.netns)
    if state.nft_table is not None:
        with contextlib.suppress(LinkError):
            _run(["nft", "delete", "table", "netdev", state.nft_table], link.switch_netns)
    if state.wire_devs is not None:
        w_in, w_out, mac = state.wire_devs
        sw = link.switch_netns
        for argv in (["tc", "qdisc", "del", "dev", link.peer, "ingress"],
                     ["bridge", "fdb", "del", mac, "dev", link.peer, "master", "static"],
                     ["ip", "link", "del", w_in], ["ip", "link", "del", w_out]):  # fmt: skip
            with contextlib.suppress(LinkError):
                _run(argv, sw)  # a veth goes with its peer
    if state.wire is not None:
        state.wire.terminate()
        try:
            state.wire.wait(5)
        except subprocess.TimeoutExpired:
            state.wire.kill()
            state.wire.wait()


def clear_all() -> None:
    """Clear every link this process shaped (a finally of a test or a bench)."""
    for link in list(_applied):
        clear(link)


def apply_condition(links: list[Link], condition: Condition, capped: Link | None = None) -> None:
    """The condition between every pair of ``links``' hosts; its rate cap on ``capped`` only."""
    for link in links:
        rate = condition.rate_mbit if link == capped else 0.0
        if condition.rtt_ms or condition.loss_pct or rate:
            apply(link, delay_ms=condition.rtt_ms / 2, loss_pct=condition.loss_pct, rate_mbit=rate)
        else:
            clear(link)


def network_links(network: Network) -> dict[str, Link]:
    """The link of every host of a :class:`kvmesh_bench.multihost.Network`, by host name."""
    return {
        name: Link(host.ns, "eth0", host.veth, network.bridge, None)  # the harness names the inside end eth0
        for name, host in network.hosts.items()
    }
