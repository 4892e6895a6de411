"""Multi-host harness: every daemon on its own "host" (a network namespace on a private bridge), one box.

Loopback hides a class of bugs (a daemon advertising an address others cannot reach, a partition
that loopback cannot produce, a single etcd member); this module gives the tests and
``kvmesh bench chaos --topology multihost`` hosts with their own addresses, a 3-member etcd
cluster and nftables partitions between hosts. It needs root (``ip netns``, a bridge, veths,
``nft``); :func:`missing_requirements` says in one line what is missing.

Nothing here imports kvmesh's ``inference`` stubs (a process that runs ``tritonclient.grpc`` may use
it; both declare the proto package ``inference``).

API (stable; the link-conditions work builds on it)::

    from kvmesh_bench.multihost import Cluster, Network, missing_requirements

    with Network(["etcd1", "etcd2", "etcd3", "w1"], workdir) as net:   # bridge + one netns per host
        net.hosts["w1"].address            # "10.X.Y.5": its own address on the bridge
        net.hosts["w1"].ns                 # the netns name, for `ip netns exec NS ...`
        net.hosts["w1"].veth               # the host-side (root namespace) end of its veth pair
        net.client_address                 # the bridge's own address: the root namespace, where the
                                           # test process (the client) runs, is a host too
        net.partition("w1", ["etcd1", "etcd2"])   # drop every packet between the two groups
        net.heal()                         # remove every partition
        net.spawn("w1", argv, log_path)    # a process inside host w1 (a Popen)

    with Cluster(workdir) as mesh:         # Network + the issue-18 layout, all started and ready:
        mesh.standard()                    # etcd1-3, router1-2, frontend1-2, worker1-3 (1 engine each)
        mesh.etcd_url                      # "etcd://a1:2379,a2:2379,a3:2379"
        mesh.frontends[0].address          # "10.X.Y.n:7000": what a client dials
        mesh.kill_etcd_member(0)           # kill -9; mesh.restart_etcd_member(0) brings it back
        mesh.etcd_leader(); mesh.move_etcd_leader(0)   # which member leads; make member 0 lead
        mesh.isolate_etcd_member(0)        # partition it from every other host (heal() undoes it);
                                           # clients=False: from the other members only
        mesh.partition("worker1", "router1"); mesh.heal()
        mesh.metric(mesh.routers[0], "kvmesh_router_decisions_total")
        mesh.worker("worker4", engines=2, clock_offset="+7s")   # a new host; its wall clock 7 s ahead
        mesh.router("router3", monotonic_offset=86400)          # its monotonic clock a day ahead
        mesh.remove(daemon)                # SIGTERM, wait, forget it (the host stays)

Names are unique per run: a tag made of this process's pid and a random byte names the bridge
(``kmb<tag>``), the veths (``kmv<tag><i>``) and the namespaces (``kmh-<tag>-<host>``); the subnet is a
random free ``10.X.Y.0/24`` (X in 64..254), checked against the routes in use. Closing (also after an
exception or Ctrl-C) kills every process started in the hosts, deletes the namespaces and the
bridge; :func:`sweep_stale` (run by every new Network) removes what a killed run of a dead pid left.

Partitions are nftables rules in the namespaces (table ``inet kvmesh_mh``): packets to and from
the other side are *dropped*, not refused, as a cut cable or a firewall does; existing TCP
connections stall until their own timeouts (gRPC keepalive, RPC deadlines) notice.
"""

from __future__ import annotations

import contextlib
import glob
import ipaddress
import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh_bench.local_procs import script
from kvmesh_bench.prometheus_text import metric_total

__all__ = [
    "Cluster",
    "Daemon",
    "Host",
    "Network",
    "missing_requirements",
    "sweep_stale",
]

IP = shutil.which("ip") or "/usr/sbin/ip"
NFT = shutil.which("nft") or "/usr/sbin/nft"
GRPC_PORT = 7000
METRICS_PORT = 9100
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
_TABLE = "kvmesh_mh"
MODEL = "kvmesh-mock"


def _run(*argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {out.returncode}: {(out.stderr or out.stdout).strip()}")
    return out


def missing_requirements() -> str | None:
    """One line saying what this machine lacks for the multi-host harness, or None if nothing."""
    if os.geteuid() != 0:
        return "the multi-host harness needs root (network namespaces, a bridge, nftables); run as root"
    for tool, package in ((IP, "iproute2"), (NFT, "nftables")):
        if not os.access(tool, os.X_OK):
            return f"the multi-host harness needs {Path(tool).name} (Debian: apt-get install {package}; make setup-dev)"
    etcd = os.environ.get("KVMESH_TEST_ETCD", "etcd")
    for tool, package in ((etcd, "etcd-server"), ("etcdctl", "etcd-client"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"the multi-host harness needs {tool} (Debian: apt-get install {package}; make setup-dev)"
    if not glob.glob("/usr/lib/*/faketime/libfaketime.so.1"):
        return "the multi-host harness needs libfaketime (Debian: apt-get install faketime; make setup-dev)"
    probe = f"kmprobe{os.getpid():x}"
    made = _run(IP, "netns", "add", probe, check=False)
    try:
        if made.returncode != 0:
            return f"cannot create a network namespace (ip netns add): {made.stderr.strip()}"
        nft = _run(IP, "netns", "exec", probe, NFT, "add", "table", "inet", "probe", check=False)
        if nft.returncode != 0:
            return f"nftables does not work in a network namespace: {nft.stderr.strip()}"
    finally:
        _run(IP, "netns", "del", probe, check=False)
    return None


def sweep_stale() -> None:
    """Delete namespaces and bridges that a run of a process no longer alive left behind (kill -9'd test)."""
    listed = _run(IP, "netns", "list", check=False).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(r"kmh-([0-9a-f]+)[0-9a-f]{2}-.+", name)
        if match and not _pid_alive(int(match.group(1), 16)):
            _delete_ns(name)
    links = _run(IP, "-o", "link", "show", "type", "bridge", check=False).stdout
    for match in re.finditer(r"^\d+: (kmb([0-9a-f]+)[0-9a-f]{2})[:@]", links, re.M):
        if not _pid_alive(int(match.group(2), 16)):
            _run(IP, "link", "del", match.group(1), check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_ns(ns: str) -> None:
    """Kill every process still inside ``ns`` (they outlive the name otherwise), then delete it."""
    pids = _run(IP, "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _run(IP, "netns", "del", ns, check=False)


def _pick_subnet() -> ipaddress.IPv4Network:
    used = [
        ipaddress.ip_network(m.group(1), strict=False)
        for m in re.finditer(
            r"^(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", _run(IP, "-4", "route", "show", "table", "all").stdout, re.M
        )
    ]
    for _ in range(200):
        net = ipaddress.IPv4Network(f"10.{random.randint(64, 254)}.{random.randint(0, 255)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.X.Y.0/24 subnet for the multi-host bridge")


class Host:
    """One "host": a network namespace with one veth on the bridge and its own address."""

    def __init__(self, name: str, ns: str, address: str, veth: str) -> None:
        self.name = name
        self.ns = ns
        self.address = address
        self.veth = veth

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host."""
        return [IP, "netns", "exec", self.ns, *argv]

    def __repr__(self) -> str:
        return f"<Host {self.name} {self.address} ns={self.ns}>"


class Network:
    """A private bridge, one namespace per host name, nftables partitions; a context manager."""

    def __init__(self, names: Iterable[str], workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.tag = f"{os.getpid():x}{random.randrange(256):02x}"
        self.bridge = f"kmb{self.tag}"
        self.subnet: ipaddress.IPv4Network | None = None
        self.client_address = ""
        self.hosts: dict[str, Host] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        self._names = list(names)
        self._cuts: set[tuple[str, str]] = set()

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> Network:
        try:
            self.up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def up(self) -> None:
        problem = missing_requirements()
        if problem:
            raise RuntimeError(problem)
        sweep_stale()
        self.subnet = _pick_subnet()
        addresses = self.subnet.hosts()
        self.client_address = str(next(addresses))
        _run(IP, "link", "add", self.bridge, "type", "bridge")
        _run(IP, "addr", "add", f"{self.client_address}/24", "dev", self.bridge)
        _run(IP, "link", "set", self.bridge, "up")
        for name in self._names:
            self.add_host(name, str(next(addresses)))

    def add_host(self, name: str, address: str | None = None) -> Host:
        """A new namespace on the bridge (``address`` defaults to the next free one)."""
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        assert self.subnet is not None, "Network not up"
        if address is None:
            taken = {self.client_address, *(h.address for h in self.hosts.values())}
            address = next(str(a) for a in self.subnet.hosts() if str(a) not in taken)
        index = len(self.hosts)
        ns, veth = f"kmh-{self.tag}-{name}", f"kmv{self.tag}{index:x}"
        if len(veth) > 15:
            raise RuntimeError(f"interface name {veth!r} is over 15 characters")
        _run(IP, "netns", "add", ns)
        host = Host(name, ns, address, veth)
        self.hosts[name] = host
        _run(IP, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run(IP, "link", "set", veth, "master", self.bridge, "up")
        inside = host.argv([IP])
        _run(*inside, "addr", "add", f"{address}/24", "dev", "eth0")
        _run(*inside, "link", "set", "eth0", "up")
        _run(*inside, "link", "set", "lo", "up")
        _run(*inside, "route", "add", "default", "via", self.client_address)
        nft = f"""table inet {_TABLE} {{
            chain input {{ type filter hook input priority 0; policy accept; }}
            chain output {{ type filter hook output priority 0; policy accept; }}
        }}"""
        subprocess.run(host.argv([NFT, "-f", "-"]), input=nft, text=True, check=True, capture_output=True)
        return host

    def close(self) -> None:
        """Kill every process started in the hosts, delete the namespaces and the bridge (idempotent)."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGCONT)
                    proc.terminate()
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for host in list(self.hosts.values()):
            _delete_ns(host.ns)
        self.hosts.clear()
        _run(IP, "link", "del", self.bridge, check=False)

    # -- processes ---------------------------------------------------------------------------------
    def spawn(
        self, host: str, argv: Sequence[str], log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside ``host``, output appended to ``log``; closed with the network."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                self.hosts[host].argv(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )  # fmt: skip
        self.procs.append(proc)
        return proc

    # -- partitions --------------------------------------------------------------------------------
    def partition(self, side_a: str | Iterable[str], side_b: str | Iterable[str]) -> None:
        """Drop every packet between each host of ``side_a`` and each of ``side_b`` (both directions).

        A name may be ``"client"``: the root namespace (the bridge's address), whose rules go in the
        other side's namespace. Rules accumulate until :meth:`heal`.
        """
        group_a = [side_a] if isinstance(side_a, str) else list(side_a)
        group_b = [side_b] if isinstance(side_b, str) else list(side_b)
        for a in group_a:
            for b in group_b:
                if a == b:
                    raise ValueError(f"cannot partition {a!r} from itself")
                self._cut(a, b) if a != "client" else self._cut(b, a)

    def _address(self, name: str) -> str:
        return self.client_address if name == "client" else self.hosts[name].address

    def _cut(self, inside: str, other: str) -> None:
        host, peer = self.hosts[inside], self._address(other)
        rules = (f"add rule inet {_TABLE} input ip saddr {peer} drop\n"
                 f"add rule inet {_TABLE} output ip daddr {peer} drop\n")  # fmt: skip
        subprocess.run(host.argv([NFT, "-f", "-"]), input=rules, text=True, check=True, capture_output=True)
        self._cuts.add((inside, other))

    def heal(self) -> None:
        """Remove every partition (the namespaces' drop rules); connections resume by themselves."""
        for name in {inside for inside, _ in self._cuts}:
            host = self.hosts.get(name)
            if host is not None:
                for chain in ("input", "output"):
                    _run(*host.argv([NFT, "flush", "chain", "inet", _TABLE, chain]))
        self._cuts.clear()


class Daemon:
    """A kvmesh daemon (or etcd member) inside one host; ``address`` is what others dial."""

    def __init__(self, kind: str, host: Host, argv: list[str], log: Path, net: Network, env: dict[str, str]) -> None:
        self.kind = kind
        self.host = host
        self.argv = argv
        self.log = log
        self.env = env
        self._net = net
        self.proc = net.spawn(host.name, argv, log, env)

    @property
    def name(self) -> str:
        return self.host.name

    @property
    def address(self) -> str:
        return f"{self.host.address}:{ETCD_CLIENT_PORT if self.kind == 'etcd' else GRPC_PORT}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host.address}:{METRICS_PORT}/metrics"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def pid(self) -> int:
        """The daemon's own pid: under ``unshare --fork`` (a time namespace) its child, since unshare
        ignores SIGTERM and SIGINT while it waits."""
        if self.argv[0] == "unshare":
            with contextlib.suppress(OSError, ValueError, IndexError):
                return int(Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()[0])
        return self.proc.pid

    def signal(self, sig: int) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (the daemon deregisters and drains), SIGKILL after ``timeout``."""
        if self.alive:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """kill -9 (the daemon itself, not a wrapper)."""
        if self.alive:
            self.signal(signal.SIGKILL)
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        """Start the same command again in the same host (after stop/kill)."""
        self.stop()
        self.proc = self._net.spawn(self.host.name, self.argv, self.log, self.env)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def serving(self, timeout: float = 1.0) -> bool:
        """grpc.health.v1 says SERVING (the operators' signal)."""
        with grpc.insecure_channel(self.address) as channel:
            try:
                stub = health_pb2_grpc.HealthStub(channel)
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)  # type: ignore[attr-defined]
            except grpc.RpcError:
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def __repr__(self) -> str:
        return f"<{self.kind} on {self.host.name} {self.address} {'alive' if self.alive else 'dead'}>"


class Cluster:
    """The issue-18 layout on a :class:`Network`: a 3-member etcd, routers, frontends, workers.

    Every daemon binds and advertises its host's address (``--host`` = ``--bind-host``), gRPC on
    port 7000 and /metrics on 9100 of its own host (no port races: every host has its own ports).
    """

    def __init__(
        self,
        workdir: Path,
        *,
        lease_ttl: float = 2.0,
        namespace: str = "mh",
        etcd_members: int = 3,
        log_level: str = "info",
        extra_hosts: Iterable[str] = (),
    ) -> None:
        self.workdir = Path(workdir)
        self.lease_ttl = lease_ttl
        self.namespace = namespace
        self.log_level = log_level
        self.etcd_names = [f"etcd{i + 1}" for i in range(etcd_members)]
        names = [*self.etcd_names, "router1", "router2", "frontend1", "frontend2", "worker1", "worker2", "worker3"]
        self.net = Network([*names, *(h for h in extra_hosts if h not in names)], self.workdir)
        self.etcd: list[Daemon] = []
        self.daemons: list[Daemon] = []

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        try:
            self.net.up()
            self.start_etcd()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        for daemon in reversed(self.daemons):
            daemon.signal(signal.SIGTERM)
        for daemon in reversed(self.daemons):
            daemon.stop()
        self.net.close()

    @property
    def hosts(self) -> dict[str, Host]:
        return self.net.hosts

    def host(self, name: str) -> Host:
        if name not in self.net.hosts:
            self.net.add_host(name)
        return self.net.hosts[name]

    # -- etcd --------------------------------------------------------------------------------------
    @property
    def etcd_url(self) -> str:
        return "etcd://" + ",".join(f"{self.hosts[n].address}:{ETCD_CLIENT_PORT}" for n in self.etcd_names)

    def start_etcd(self, timeout: float = 30.0) -> None:
        cluster = ",".join(f"{n}=http://{self.hosts[n].address}:{ETCD_PEER_PORT}" for n in self.etcd_names)
        for name in self.etcd_names:
            addr = self.hosts[name].address
            client, peer = f"http://{addr}:{ETCD_CLIENT_PORT}", f"http://{addr}:{ETCD_PEER_PORT}"
            # heartbeat 50 ms / election 500 ms: a leader is re-elected within ~1 s, and a busy 2-core
            # box does not trigger spurious elections (the single-member tests use 10/100).
            argv = [os.environ.get("KVMESH_TEST_ETCD", "etcd"), "--name", name,
                    "--data-dir", str(self.workdir / f"{name}.data"),
                    "--listen-client-urls", client, "--advertise-client-urls", client,
                    "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", cluster, "--initial-cluster-state", "new",
                    "--initial-cluster-token", f"kvmesh-mh-{self.net.tag}",
                    "--heartbeat-interval", "50", "--election-timeout", "500",
                    "--log-level", "warn"]  # fmt: skip
            self.etcd.append(Daemon("etcd", self.hosts[name], argv, self.workdir / f"{name}.log", self.net, {}))
        self.wait_etcd_healthy(range(len(self.etcd_names)), timeout)

    def wait_etcd_healthy(self, members: Iterable[int], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for i in members:
            member = self.etcd[i]
            while True:
                if not member.alive:
                    raise RuntimeError(f"etcd {member.name} exited:\n{member.log_text()[-2000:]}")
                url = f"http://{member.address}/health"
                with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(url, timeout=1) as reply:
                    if json.load(reply).get("health") == "true":
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"etcd {member.name} not healthy within {timeout:g} s:\n{member.log_text()[-2000:]}"
                    )
                time.sleep(0.1)

    def kill_etcd_member(self, index: int) -> Daemon:
        """kill -9 member ``index`` (data dir kept: :meth:`restart_etcd_member` rejoins it)."""
        self.etcd[index].kill()
        return self.etcd[index]

    def restart_etcd_member(self, index: int, timeout: float = 30.0) -> None:
        self.etcd[index].restart()
        self.wait_etcd_healthy([index], timeout)

    def isolate_etcd_member(self, index: int, *, clients: bool = True) -> None:
        """Cut etcd member ``index`` off from the other members, and with ``clients`` (default) from every
        host and the client too (a black hole); ``clients=False`` is the classic minority partition: the
        daemons still reach a member that has no leader. Until :meth:`heal`."""
        name = self.etcd_names[index]
        others = [n for n in self.etcd_names if n != name]
        if clients:
            others = [h for h in self.hosts if h != name] + ["client"]
        self.partition(name, others)

    def etcd_leader(self) -> int | None:
        """Index of the member that is leader now (from each member's /metrics), None if none answers."""
        for i, member in enumerate(self.etcd):
            if member.alive and self._etcd_gauge(member, "etcd_server_is_leader") == 1:
                return i
        return None

    def move_etcd_leader(self, index: int, timeout: float = 30.0) -> None:
        """Make member ``index`` the leader (``etcdctl move-leader``, through the current leader)."""
        deadline = time.monotonic() + timeout
        while self.etcd_leader() != index:
            leader = self.etcd_leader()
            if leader is not None:
                status = _run("etcdctl", "--endpoints", self.etcd[index].address, "endpoint", "status", "-w", "json",
                              check=False)  # fmt: skip
                if status.returncode == 0:
                    member = json.loads(status.stdout)[0]["Status"]["header"]["member_id"]
                    _run("etcdctl", "--endpoints", self.etcd[leader].address, "move-leader", f"{member:x}", check=False)
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd member {index} did not become leader within {timeout:g} s")
            time.sleep(0.2)

    @staticmethod
    def _etcd_gauge(member: Daemon, name: str) -> float | None:
        with contextlib.suppress(OSError), urllib.request.urlopen(f"http://{member.address}/metrics", timeout=2) as r:
            match = re.search(rf"^{name} ([0-9.e+-]+)$", r.read().decode(), re.M)
            return float(match.group(1)) if match else None
        return None

    # -- daemons -----------------------------------------------------------------------------------
    def _spawn(
        self,
        kind: str,
        host: str,
        args: Sequence[str],
        clock_offset: str | None = None,
        wait: bool = True,
        monotonic_offset: int = 0,
    ) -> Daemon:
        """``clock_offset`` (libfaketime, e.g. ``"+7s"``, ``"-30s"``): the daemon's wall clock is that far
        off; its monotonic clock is left alone (``FAKETIME_DONT_FAKE_MONOTONIC``), as on a host whose NTP
        is wrong. ``monotonic_offset`` (seconds, a time namespace: ``unshare --time``): its monotonic and
        boot-time clocks start elsewhere, as on a host booted at another time (every namespace here
        shares the kernel's clocks otherwise). Its Popen is then ``unshare`` (``--kill-child``: the daemon
        dies with it); :class:`Daemon` signals the daemon itself (:attr:`Daemon.pid`)."""
        h = self.host(host)
        argv = [script(f"kvmesh-{kind}"), "--discovery", self.etcd_url, "--namespace", self.namespace,
                "--host", h.address, "--bind-host", h.address, "--grpc-port", str(GRPC_PORT),
                "--metrics-port", str(METRICS_PORT), "--lease-ttl", f"{self.lease_ttl:g}",
                "--drain-timeout", "2", "--log-level", self.log_level, *args]  # fmt: skip
        env: dict[str, str] = {}
        if clock_offset:
            # the library itself, not the `faketime` wrapper: that one forks, and signals would reach it only
            libs = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
            if not libs:
                raise RuntimeError("clock_offset needs libfaketime (Debian: apt-get install faketime; make setup-dev)")
            env.update(LD_PRELOAD=libs[0], FAKETIME=clock_offset, FAKETIME_DONT_FAKE_MONOTONIC="1")
        if monotonic_offset:
            offset = str(monotonic_offset)
            # libfaketime goes to the daemon alone (`env` after unshare): preloaded into unshare too, it made
            # a /dev/shm segment and semaphore there that nothing removed once unshare was stopped.
            preload = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
            env = {}
            argv = ["unshare", "--time", "--fork", "--kill-child", "--monotonic", offset,
                    "--boottime", offset, *preload, *argv]  # fmt: skip
        daemon = Daemon(kind, h, argv, self.workdir / f"{kind}-{host}.log", self.net, env)
        self.daemons.append(daemon)
        if wait:
            self.wait_serving(daemon)
        return daemon

    def wait_serving(self, daemon: Daemon, timeout: float = 90.0) -> Daemon:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not daemon.alive:
                raise RuntimeError(f"{daemon.kind} on {daemon.name} exited {daemon.proc.returncode}:\n"
                                   f"{daemon.log_text()[-3000:]}")  # fmt: skip
            if daemon.serving():
                return daemon
            time.sleep(0.1)
        raise RuntimeError(
            f"{daemon.kind} on {daemon.name} not SERVING within {timeout:g} s:\n{daemon.log_text()[-3000:]}"
        )

    def worker(
        self, host: str, *extra: str, engines: int = 1, speedup: float = 4.0, clock_offset: str | None = None,
        wait: bool = True, monotonic_offset: int = 0,
    ) -> Daemon:  # fmt: skip
        """A worker of ``engines`` mocker engines in ``host`` (created if new); see :meth:`_spawn` for the clocks."""
        args = ["--num-engines", str(engines), "--num-gpu-blocks", "2048", "--block-size", "16",
                "--speedup-ratio", f"{speedup:g}", *extra]  # fmt: skip
        return self._spawn("worker", host, args, clock_offset, wait, monotonic_offset)

    def router(
        self, host: str, *extra: str, clock_offset: str | None = None, wait: bool = True, monotonic_offset: int = 0
    ) -> Daemon:
        return self._spawn("router", host, ["--router-mode", "kv", *extra], clock_offset, wait, monotonic_offset)

    def frontend(
        self, host: str, *extra: str, clock_offset: str | None = None, wait: bool = True, monotonic_offset: int = 0
    ) -> Daemon:
        return self._spawn("frontend", host, list(extra), clock_offset, wait, monotonic_offset)

    def remove(self, daemon: Daemon) -> None:
        """Stop ``daemon`` (SIGTERM: it deregisters and drains) and forget it; its host stays."""
        daemon.stop()
        self.daemons.remove(daemon)

    def standard(self, *, engines: int = 1, speedup: float = 4.0) -> Cluster:
        """The issue-18 layout (etcd is already up): 3 workers, 2 router replicas, 2 frontends."""
        for i in (1, 2, 3):
            self.worker(f"worker{i}", engines=engines, speedup=speedup, wait=False)
        for i in (1, 2):
            self.router(f"router{i}", wait=False)
        for i in (1, 2):
            self.frontend(f"frontend{i}", wait=False)
        for daemon in self.daemons:
            self.wait_serving(daemon)
        return self

    def of(self, kind: str) -> list[Daemon]:
        return [d for d in self.daemons if d.kind == kind]

    @property
    def workers(self) -> list[Daemon]:
        return self.of("worker")

    @property
    def routers(self) -> list[Daemon]:
        return self.of("router")

    @property
    def frontends(self) -> list[Daemon]:
        return self.of("frontend")

    def daemon(self, host: str) -> Daemon:
        return next(d for d in self.daemons if d.host.name == host)

    def check(self) -> None:
        """Raise if a daemon died that nobody killed on purpose."""
        for d in self.daemons:
            if not d.alive and d.proc.returncode not in (0, -signal.SIGKILL, -signal.SIGTERM):
                raise RuntimeError(f"{d.kind} on {d.name} exited {d.proc.returncode}:\n{d.log_text()[-3000:]}")

    # -- observation -------------------------------------------------------------------------------
    def partition(self, side_a: str | Iterable[str], side_b: str | Iterable[str]) -> None:
        self.net.partition(side_a, side_b)

    def heal(self) -> None:
        self.net.heal()

    @staticmethod
    def metric(daemon: Daemon, name: str, labels: Mapping[str, str] | None = None) -> float:
        """Sum of a Prometheus metric's samples on one daemon whose labels include ``labels`` (0 if none, or if
        the daemon does not answer)."""
        with contextlib.suppress(OSError):
            return metric_total(daemon.metrics_url, name, labels, timeout=3)
        return 0.0

    def metric_sum(self, kind: str, name: str) -> float:
        return sum(self.metric(d, name) for d in self.of(kind) if d.alive)

    def rss(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for d in self.daemons:
            with contextlib.suppress(OSError), open(f"/proc/{d.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        out[d.kind] = round(out.get(d.kind, 0.0) + int(line.split()[1]) / 1024, 1)
        return out
