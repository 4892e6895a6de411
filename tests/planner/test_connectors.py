"""Each connector against the real thing it drives: systemctl (a recording executable), worker processes, discovery.

systemd is not PID 1 on these machines, so the unit files are checked with ``systemd-analyze verify`` and the
systemd connector's exact command sequence with a ``systemctl`` executable on PATH that records its argv
and keeps the units' state in a directory.
"""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kvmesh.discovery import Discovery, Lease, instance_prefix, open_discovery
from kvmesh.v1 import discovery_pb2, planner_pb2
from kvmesh_planner.connectors.base import EngineRef
from kvmesh_planner.connectors.local import LocalConnector
from kvmesh_planner.connectors.systemd import SystemdConnector
from kvmesh_planner.connectors.virtual import VirtualConnector, ack_key, pool_sizes, targets_key

from tests.support.etcd import free_port

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "packaging" / "systemd"
BIN = Path(sys.executable).parent

FAKE_SYSTEMCTL = r"""#!/bin/sh
# Records its argv, one call per line, and keeps each unit's state as a file under $STATE.
echo "$*" >> "$STATE/argv.log"
cmd="$1"; shift
case "$cmd" in
  list-units)  # list-units --plain --no-legend --state=active PATTERN: only units matching the glob
    for f in "$STATE"/units/*; do
      [ -e "$f" ] || continue; name=$(basename "$f")
      case "$name" in $4) echo "$name loaded active running kvmesh worker" ;; esac
    done ;;
  start) n=$(cat "$STATE/nextpid" 2>/dev/null || echo 1000)
         echo "$n" > "$STATE/units/$1"; echo $((n+1)) > "$STATE/nextpid" ;;
  show) unit="$4"; if [ -e "$STATE/units/$unit" ]; then cat "$STATE/units/$unit"; else echo 0; fi ;;
  stop) unit="$2"; rm -f "$STATE/units/$unit" ;;
  is-active) if [ -e "$STATE/units/$1" ]; then echo active; else echo inactive; exit 3; fi ;;
  *) echo "unexpected: $cmd" >&2; exit 1 ;;
esac
"""


@pytest.fixture
def fake_systemctl(tmp_path, monkeypatch):
    state = tmp_path / "systemd"
    (state / "units").mkdir(parents=True)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "systemctl"
    exe.write_text(FAKE_SYSTEMCTL)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("STATE", str(state))
    return state


def calls(state: Path) -> list[str]:
    return (state / "argv.log").read_text().splitlines()


async def test_systemd_connector_command_sequence(fake_systemctl):
    state = fake_systemctl
    (state / "units" / "kvmesh-worker@2.service").write_text("900\n")  # already running: adopted, not restarted
    conn = SystemdConnector("systemctl")
    try:
        await _systemd_sequence(conn, state)
    finally:
        await conn.close()


async def _systemd_sequence(conn: SystemdConnector, state: Path) -> None:
    await conn.start()
    assert conn.actual() == {"aggregated": 1}
    assert calls(state) == [
        "list-units --plain --no-legend --state=active kvmesh-worker@*.service",
        "show --property MainPID --value kvmesh-worker@2.service",
    ]
    await conn.apply(1, {"aggregated": 3}, [])
    assert calls(state)[2:] == [
        "start kvmesh-worker@1.service",
        "start kvmesh-worker@3.service",
        "show --property MainPID --value kvmesh-worker@1.service",
        "show --property MainPID --value kvmesh-worker@3.service",
    ]
    assert conn.actual() == {"aggregated": 3}
    assert conn.starting({900}) == {"aggregated": 2}  # 1000 and 1001 are not registered yet
    # Scale down by 2: the least-loaded registered engines' units, in the order given.
    engines = [
        EngineRef(7, "aggregated", 1001, "h", 0.0),  # @3, idle
        EngineRef(5, "aggregated", 900, "h", 0.2),  # @2
        EngineRef(6, "aggregated", 1000, "h", 0.9),  # @1, busiest: kept
    ]
    await conn.apply(2, {"aggregated": 1}, engines)
    stops = [c for c in calls(state)[6:] if not c.startswith("is-active")]  # the drain watch runs meanwhile
    assert stops == ["stop --no-block kvmesh-worker@3.service", "stop --no-block kvmesh-worker@2.service"]
    assert conn.actual() == {"aggregated": 1}
    assert conn.draining()["aggregated"] <= 2  # both stopped units drain; the watch may already have seen them go
    for _ in range(300):
        if conn.draining() == {"aggregated": 0}:
            break
        await asyncio.sleep(0.1)
    assert conn.draining() == {"aggregated": 0}
    assert "is-active kvmesh-worker@3.service" in calls(state)
    assert sorted(os.listdir(state / "units")) == ["kvmesh-worker@1.service"]


async def test_systemd_connector_scales_each_pool_through_its_own_template(fake_systemctl):
    """Prefill and decode engines are instances of kvmesh-worker-prefill@ / kvmesh-worker-decode@; a pool's
    scale-down stops only that pool's least-loaded units, whatever the other pool's load."""
    state = fake_systemctl
    (state / "units" / "kvmesh-worker-decode@1.service").write_text("900\n")  # adopted
    (state / "units" / "kvmesh-worker@1.service").write_text("800\n")  # aggregated: not managed here, untouched
    templates = {"prefill": "kvmesh-worker-prefill@.service", "decode": "kvmesh-worker-decode@.service"}
    conn = SystemdConnector("systemctl", templates=templates)  # type: ignore[arg-type]
    try:
        await conn.start()
        assert conn.actual() == {"prefill": 0, "decode": 1}
        assert calls(state) == [
            "list-units --plain --no-legend --state=active kvmesh-worker-prefill@*.service",
            "list-units --plain --no-legend --state=active kvmesh-worker-decode@*.service",
            "show --property MainPID --value kvmesh-worker-decode@1.service",
        ]
        await conn.apply(1, {"prefill": 2, "decode": 2}, [])
        assert calls(state)[3:] == [
            "start kvmesh-worker-prefill@1.service",
            "start kvmesh-worker-prefill@2.service",
            "show --property MainPID --value kvmesh-worker-prefill@1.service",
            "show --property MainPID --value kvmesh-worker-prefill@2.service",
            "start kvmesh-worker-decode@2.service",
            "show --property MainPID --value kvmesh-worker-decode@2.service",
        ]
        assert conn.actual() == {"prefill": 2, "decode": 2}
        assert conn.starting({900, 1000, 1001}) == {"prefill": 0, "decode": 1}  # decode@2 (pid 1002) not registered
        engines = [  # least loaded first, as the planner orders them
            EngineRef(11, "prefill", 1000, "h", 0.0),  # the idlest engine of all, but prefill's pool is not shrinking
            EngineRef(13, "decode", 1002, "h", 0.1),  # decode@2
            EngineRef(12, "prefill", 1001, "h", 0.5),
            EngineRef(10, "decode", 900, "h", 0.7),  # decode@1, busiest decode: kept
        ]
        await conn.apply(2, {"prefill": 2, "decode": 1}, engines)
        stops = [c for c in calls(state)[9:] if not c.startswith("is-active")]
        assert stops == ["stop --no-block kvmesh-worker-decode@2.service"]
        assert conn.actual() == {"prefill": 2, "decode": 1}
        for _ in range(300):
            if conn.draining() == {"prefill": 0, "decode": 0}:
                break
            await asyncio.sleep(0.1)
        assert conn.draining() == {"prefill": 0, "decode": 0}
        assert sorted(os.listdir(state / "units")) == [
            "kvmesh-worker-decode@1.service",
            "kvmesh-worker-prefill@1.service",
            "kvmesh-worker-prefill@2.service",
            "kvmesh-worker@1.service",
        ]
        assert not any("kvmesh-worker@" in c for c in calls(state))  # the aggregated unit was never named
    finally:
        await conn.close()


def test_the_role_units_are_the_worker_unit_plus_their_role():
    """kvmesh-worker-prefill@ / -decode@ differ from kvmesh-worker@ only in the header comment, Description,
    the KVMESH_ROLE line (and its comment) and their instance's env file (prefill@1 and decode@1 run side by
    side: one worker-1.env would give both the same port), so a fix to one unit cannot miss the others."""
    base = (UNITS / "kvmesh-worker@.service").read_text().splitlines()
    for role in ("prefill", "decode"):
        unit = (UNITS / f"kvmesh-worker-{role}@.service").read_text().splitlines()
        assert f"Environment=KVMESH_ROLE={role}" in unit
        rest = [line for line in unit if not line.startswith("#") and not line.startswith("Description=")]
        rest.remove(f"Environment=KVMESH_ROLE={role}")
        own = f"EnvironmentFile=-/etc/kvmesh/worker-{role}-%i.env"
        rest[rest.index(own)] = "EnvironmentFile=-/etc/kvmesh/worker-%i.env"
        assert rest == [line for line in base if not line.startswith("#") and not line.startswith("Description=")]


def test_the_worker_unit_drains_on_stop():
    """A scale-down is `systemctl stop`: SIGTERM (the worker deregisters and drains, 30 s by default) and
    systemd waits longer than the drain before it would SIGKILL. `make lint` verifies every unit
    (scripts/verify-units.sh)."""
    worker = (UNITS / "kvmesh-worker@.service").read_text()
    assert "KillSignal=SIGTERM" in worker and "TimeoutStopSec=45" in worker
    assert "--drain-timeout" not in worker  # the daemon's default, 30 s < 45 s


@dataclass
class Virtual:
    """A virtual connector that leads namespace "ns", and an orchestrator on the same discovery."""

    conn: VirtualConnector
    lease: Lease
    orchestrator: Discovery
    olease: Lease

    async def ack(self, value: bytes) -> None:
        await self.olease.put(ack_key("ns"), value)

    async def acknowledged(self) -> bool:
        for _ in range(50):
            if not self.conn.pending():
                return True
            await asyncio.sleep(0.1)
        return False


@pytest.fixture
async def virtual(tmp_path) -> AsyncIterator[Virtual]:
    url = f"file://{tmp_path / 'disc'}"
    disc = await open_discovery(url, ttl=5.0)
    orchestrator = await open_discovery(url, ttl=5.0)
    try:
        lease = await disc.grant_lease()
        conn = VirtualConnector(disc, lease, "ns", ack_timeout=60)
        await conn.start()
        yield Virtual(conn, lease, orchestrator, await orchestrator.grant_lease())
        await conn.close()
        await lease.revoke()
    finally:
        await disc.close()
        await orchestrator.close()


async def test_virtual_connector_publishes_targets_and_waits_for_the_ack(virtual: Virtual):
    await virtual.conn.apply(4, {"aggregated": 3}, [])
    got = await virtual.orchestrator.get_prefix(targets_key("ns"))
    msg = planner_pb2.PlannerTargets.FromString(got[targets_key("ns")])
    assert msg.decision_id == 4 and msg.target.aggregated == 3
    assert virtual.conn.pending() and virtual.conn.actual() == {"aggregated": 3}
    # The orchestrator could bring up only 2 of the 3: the planner's next decision starts from 2.
    await virtual.ack(
        planner_pb2.PlannerTargetsAck(decision_id=4, actual=pool_sizes({"aggregated": 2})).SerializeToString()
    )
    assert await virtual.acknowledged()
    assert virtual.conn.actual() == {"aggregated": 2}
    await virtual.conn.close()
    await virtual.lease.revoke()
    assert await virtual.orchestrator.get_prefix(targets_key("ns")) == {}  # the targets die with the planner


async def test_a_malformed_ack_is_ignored_and_the_next_one_heard(virtual: Virtual, caplog):
    """Bytes that are no PlannerTargetsAck ended the ack watch: every later ack went unheard and the
    planner held until --ack-timeout (30 min by default)."""
    await virtual.conn.apply(1, {"aggregated": 2}, [])
    await virtual.ack(b"\xff\xff\xff")
    for _ in range(50):
        if "holds no PlannerTargetsAck" in caplog.text:
            break
        await asyncio.sleep(0.1)
    assert "holds no PlannerTargetsAck; ignored" in caplog.text and virtual.conn.pending()
    await virtual.ack(
        planner_pb2.PlannerTargetsAck(decision_id=1, actual=pool_sizes({"aggregated": 2})).SerializeToString()
    )
    assert await virtual.acknowledged() and virtual.conn.actual() == {"aggregated": 2}


async def _engines(url: str) -> list[discovery_pb2.InstanceRecord]:
    disc = await open_discovery(url, ttl=5.0)
    try:
        recs = await disc.get_prefix(instance_prefix("kvmesh", "worker"))
    finally:
        await disc.close()
    return [discovery_pb2.InstanceRecord.FromString(v) for v in recs.values()]


async def _wait_engines(url: str, n: int, timeout: float = 60.0) -> list[discovery_pb2.InstanceRecord]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        recs = await _engines(url)
        if len(recs) == n:
            return recs
        await asyncio.sleep(0.2)
    raise AssertionError(f"expected {n} engines, have {len(await _engines(url))}")


@pytest.mark.e2e
@pytest.mark.timeout(180)
async def test_local_connector_starts_workers_and_drains_the_least_loaded_with_no_failed_request(tmp_path):
    """Scale 0 -> 2 -> 1 with real kvmesh-worker processes; the drained engine finishes its in-flight request."""
    import grpc
    from kvmesh.v1 import worker_pb2, worker_pb2_grpc

    url = f"file://{tmp_path / 'disc'}"
    conn = LocalConnector("kvmesh-worker", url, "kvmesh", "--speedup-ratio 1", drain_timeout=30, log_dir=str(tmp_path))
    try:
        await conn.apply(1, {"aggregated": 2}, [])
        assert conn.actual() == {"aggregated": 2} and conn.starting(set()) == {"aggregated": 2}
        recs = await _wait_engines(url, 2)
        assert conn.starting({r.pid for r in recs}) == {"aggregated": 0}
        busy, idle = recs
        # A long request on `busy`; then ask for one engine fewer, naming `busy` as least loaded so the drain
        # has in-flight work to finish (the order is the planner's to choose; the connector follows it).
        channel = grpc.aio.insecure_channel(busy.address)
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        call = stub.GenerateStream(timeout=60)
        req = worker_pb2.GenerateRequest(
            request_id="long",
            engine_id=busy.instance_id,
            token_ids=list(range(1, 200)),
            sampling=worker_pb2.SamplingOptions(max_tokens=300, ignore_eos=True),
        )
        await call.write(worker_pb2.GenerateStreamRequest(requests=[req]))
        await call.done_writing()
        first = await call.read()
        assert first.outputs
        refs = [
            EngineRef(busy.instance_id, "aggregated", busy.pid, busy.hostname, 0.0),
            EngineRef(idle.instance_id, "aggregated", idle.pid, idle.hostname, 1.0),
        ]
        await conn.apply(2, {"aggregated": 1}, refs)
        assert conn.actual() == {"aggregated": 1} and conn.draining() == {"aggregated": 1}
        # Deregistered at once: no new request is routed there.
        left = await _wait_engines(url, 1, timeout=5)
        assert left[0].instance_id == idle.instance_id
        tokens = sum(len(o.response.token_ids) for o in first.outputs)
        finish = None
        while (msg := await call.read()) is not grpc.aio.EOF:
            for o in msg.outputs:
                assert not o.error_code, o.error_message
                tokens += len(o.response.token_ids)
                if o.response.finish_reason:
                    finish = o.response.finish_reason
        assert tokens == 300 and finish == worker_pb2.FINISH_REASON_LENGTH  # finished, not failed
        await channel.close()
        for _ in range(100):
            if conn.draining() == {"aggregated": 0}:
                break
            await asyncio.sleep(0.1)
        assert conn.draining() == {"aggregated": 0}
    finally:
        await conn.close()
    assert conn.actual() == {"aggregated": 0}


@pytest.mark.e2e
@pytest.mark.timeout(240)
async def test_local_connector_runs_a_prefill_and_a_decode_pool_and_drains_one_with_no_failed_request(tmp_path):
    """Prefill 1 + decode 2 real workers, each registered with its role; decode 2 -> 1 drains the decode engine
    it is told is least loaded (it has a request in flight, which finishes), and leaves the prefill pool alone."""
    import grpc
    from kvmesh.v1 import worker_pb2, worker_pb2_grpc

    url = f"file://{tmp_path / 'disc'}"
    conn = LocalConnector(
        "kvmesh-worker",
        url,
        "kvmesh",
        "--speedup-ratio 1",
        drain_timeout=30,
        log_dir=str(tmp_path),
        pools=("prefill", "decode"),
    )
    try:
        await conn.apply(1, {"prefill": 1, "decode": 2}, [])
        assert conn.actual() == {"prefill": 1, "decode": 2}
        assert conn.argv("decode")[-2:] == ["--role", "decode"]
        recs = await _wait_engines(url, 3, timeout=120)
        roles = sorted(discovery_pb2.WorkerRole.Name(r.role) for r in recs)
        assert roles == ["WORKER_ROLE_DECODE", "WORKER_ROLE_DECODE", "WORKER_ROLE_PREFILL"]
        assert conn.starting({r.pid for r in recs}) == {"prefill": 0, "decode": 0}
        prefill = next(r for r in recs if r.role == discovery_pb2.WORKER_ROLE_PREFILL)
        busy, idle = (r for r in recs if r.role == discovery_pb2.WORKER_ROLE_DECODE)
        # A long request on `busy` (a decode engine prefills locally when no prefill result comes with it).
        channel = grpc.aio.insecure_channel(busy.address)
        call = worker_pb2_grpc.WorkerServiceStub(channel).GenerateStream(timeout=90)
        req = worker_pb2.GenerateRequest(
            request_id="long",
            engine_id=busy.instance_id,
            token_ids=list(range(1, 200)),
            sampling=worker_pb2.SamplingOptions(max_tokens=300, ignore_eos=True),
        )
        await call.write(worker_pb2.GenerateStreamRequest(requests=[req]))
        await call.done_writing()
        first = await call.read()
        assert first.outputs
        refs = [  # least loaded first: the prefill engine, idlest of all, is in another pool and stays
            EngineRef(prefill.instance_id, "prefill", prefill.pid, prefill.hostname, 0.0),
            EngineRef(busy.instance_id, "decode", busy.pid, busy.hostname, 0.1),
            EngineRef(idle.instance_id, "decode", idle.pid, idle.hostname, 1.0),
        ]
        await conn.apply(2, {"prefill": 1, "decode": 1}, refs)
        assert conn.actual() == {"prefill": 1, "decode": 1}
        assert conn.draining() == {"prefill": 0, "decode": 1}
        left = await _wait_engines(url, 2, timeout=10)  # deregistered at once: nothing new is routed there
        assert sorted(r.instance_id for r in left) == sorted([prefill.instance_id, idle.instance_id])
        tokens = sum(len(o.response.token_ids) for o in first.outputs)
        finish = None
        while (msg := await call.read()) is not grpc.aio.EOF:
            for o in msg.outputs:
                assert not o.error_code, o.error_message
                tokens += len(o.response.token_ids)
                if o.response.finish_reason:
                    finish = o.response.finish_reason
        assert tokens == 300 and finish == worker_pb2.FINISH_REASON_LENGTH  # finished, not failed
        await channel.close()
        for _ in range(200):
            if conn.draining() == {"prefill": 0, "decode": 0}:
                break
            await asyncio.sleep(0.1)
        assert conn.draining() == {"prefill": 0, "decode": 0}
    finally:
        await conn.close()
    assert conn.actual() == {"prefill": 0, "decode": 0}


async def test_local_connector_kills_a_worker_that_never_registers_within_the_startup_timeout(tmp_path):
    """A worker stuck before it registers (a model that never loads) counted as 'starting' forever, and the
    planner holds a pool while any of its engines is starting: --startup-timeout was read but never used."""
    stuck = tmp_path / "stuck-worker"
    stuck.write_text("#!/bin/sh\nexec sleep 600\n")  # takes the worker's flags, never registers
    stuck.chmod(0o755)
    conn = LocalConnector(str(stuck), f"file://{tmp_path / 'disc'}", "kvmesh", startup_timeout=0.5)
    try:
        await conn.apply(1, {"aggregated": 1}, [])
        (pid,) = conn.pids()
        assert conn.reap_failed(set()) == 0 and conn.starting(set()) == {"aggregated": 1}
        await asyncio.sleep(0.7)
        assert conn.reap_failed(set()) == 1
        assert conn.starting(set()) == {"aggregated": 0} and conn.actual() == {"aggregated": 0}
        async with asyncio.timeout(5):
            while conn.pids():
                await asyncio.sleep(0.02)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        await conn.close()


async def test_local_connector_leaves_alone_a_worker_that_registered_and_is_out_of_discovery_for_a_while(tmp_path):
    """A registered worker whose lease was lost (a pause, an etcd outage) serves on and registers again by
    itself: the start-up timeout, meant for a worker that never came up, killed it and what it served."""
    worker = tmp_path / "a-worker"
    worker.write_text("#!/bin/sh\nexec sleep 600\n")
    worker.chmod(0o755)
    conn = LocalConnector(str(worker), f"file://{tmp_path / 'disc'}", "kvmesh", startup_timeout=0.5)
    try:
        await conn.apply(1, {"aggregated": 1}, [])
        (pid,) = conn.pids()
        assert conn.reap_failed({pid}) == 0  # registered
        await asyncio.sleep(0.7)
        assert conn.reap_failed(set()) == 0  # out of discovery, past the start-up timeout: still its own
        assert conn.pids() == {pid} and conn.actual() == {"aggregated": 1}
    finally:
        await conn.close()


async def test_local_connector_closing_does_not_signal_a_draining_worker_again(tmp_path):
    """A second SIGTERM tells a worker to cancel what it still serves: stopping the planner while a
    scaled-down worker drained made that worker fail its requests."""
    marks = tmp_path / "signals"
    worker = tmp_path / "a-worker"
    worker.write_text(
        f"#!{sys.executable}\n"
        "import signal, time\n"
        f"marks = {str(marks)!r}\n"
        "signal.signal(signal.SIGTERM, lambda *_: open(marks, 'a').write('TERM\\n'))\n"
        "open(marks, 'a').write('up\\n')\n"
        "while 'TERM' not in open(marks).read():\n"
        "    time.sleep(0.02)\n"
        "time.sleep(1.0)  # draining\n"
    )
    worker.chmod(0o755)
    conn = LocalConnector(str(worker), f"file://{tmp_path / 'disc'}", "kvmesh")
    try:
        await conn.apply(1, {"aggregated": 1}, [])
        async with asyncio.timeout(20):
            while not (marks.exists() and "up" in marks.read_text()):
                await asyncio.sleep(0.02)
        await conn.apply(2, {"aggregated": 0}, [])  # scale-down: SIGTERM, drains for a second
        assert conn.draining() == {"aggregated": 1}
    finally:
        await conn.close()
    assert marks.read_text().split() == ["up", "TERM"]


@pytest.mark.parametrize("extra", ["--num-engines 2", "--num-eng=2", "--role decode", "--namespace other"])
def test_local_connector_refuses_worker_args_that_override_its_own_flags(tmp_path, extra):
    with pytest.raises(ValueError, match=r"^--worker-args: --[a-z-]+ is the local connector's to set"):
        LocalConnector(sys.executable, f"file://{tmp_path / 'disc'}", "kvmesh", worker_args=extra)


async def test_systemd_connector_follows_a_unit_that_systemd_restarted_with_a_new_main_pid(fake_systemctl):
    """The units restart on failure: a unit's engine comes back under a new pid. Cached, the old pid made it
    count as starting forever, and a scale-down drained it first as 'unregistered', busiest or not."""
    conn = SystemdConnector("systemctl")
    try:
        await conn.start()
        await conn.apply(1, {"aggregated": 2}, [])
        assert conn.starting({1000, 1001}) == {"aggregated": 0}
        (fake_systemctl / "units" / "kvmesh-worker@1.service").write_text("2000\n")  # restarted by systemd
        registered = {2000, 1001}
        await conn.refresh_pids(registered)
        assert conn.starting(registered) == {"aggregated": 0}
        engines = [EngineRef(8, "aggregated", 1001, "h", 0.0), EngineRef(9, "aggregated", 2000, "h", 0.9)]
        await conn.apply(2, {"aggregated": 1}, engines)  # the idle one goes, not the restarted busy one
        assert "stop --no-block kvmesh-worker@2.service" in calls(fake_systemctl)
        assert "stop --no-block kvmesh-worker@1.service" not in calls(fake_systemctl)
    finally:
        await conn.close()


async def test_a_local_worker_does_not_inherit_the_planners_settings(tmp_path, monkeypatch):
    """A planner configured by environment (as a systemd unit's Environment= does) passed its KVMESH_*
    to every worker: the worker refused the planner's own (exit 2) and was respawned every tick, or would
    have bound the planner's port."""
    monkeypatch.setenv("KVMESH_MIN_ENGINES", "1")  # the planner's: unknown to a worker
    monkeypatch.setenv("KVMESH_GRPC_PORT", str(free_port()))  # the planner's own port
    url = f"file://{tmp_path / 'disc'}"
    conn = LocalConnector("kvmesh-worker", url, "kvmesh", log_dir=str(tmp_path))
    try:
        await conn.apply(1, {"aggregated": 1}, [])
        (record,) = await _wait_engines(url, 1)
        assert not record.address.endswith(f":{os.environ['KVMESH_GRPC_PORT']}")
    finally:
        await conn.close()
