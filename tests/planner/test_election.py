"""Exactly one planner acts: two real kvmesh-planner processes on a real etcd, the leader kill -9'd."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
from kvmesh.v1 import planner_pb2, planner_pb2_grpc
from kvmesh_planner.election import EtcdElection

from tests.support.daemons import Daemon, running, running_pid
from tests.support.etcd import EtcdServer, etcd_available, free_port

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.etcd,
    pytest.mark.skipif(not etcd_available(), reason="etcd not installed"),
]

TTL = 2.0


def status(d: Daemon) -> planner_pb2.GetStatusResponse | None:
    with grpc.insecure_channel(d.address) as ch:
        try:
            return planner_pb2_grpc.PlannerServiceStub(ch).GetStatus(planner_pb2.GetStatusRequest(), timeout=1.0)
        except grpc.RpcError:
            return None


def planner(etcd: EtcdServer, tmp_path) -> Daemon:
    port = free_port()
    args = [
        "--discovery", etcd.url, "--grpc-port", str(port), "--lease-ttl", str(TTL), "--interval", "0.3",
        "--connector", "virtual", "--ack-timeout", "0.1", "--min-engines", "1", "--log-level", "debug",
    ]  # fmt: skip
    return Daemon("kvmesh-planner", args, tmp_path, port)


@pytest.mark.timeout(120)
def test_standby_takes_over_within_two_ttl_and_no_decision_id_is_reused(tmp_path):
    with EtcdServer(tmp_path / "etcd") as etcd, running(planner(etcd, tmp_path)) as (a,):
        a.wait_serving()
        deadline = time.monotonic() + 10
        while not ((s := status(a)) and s.leader and s.latest.decision_id) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert s is not None and s.leader, a.log_text()
        with running(planner(etcd, tmp_path)) as (b,):
            b.wait_serving()
            time.sleep(3 * 0.3)
            sb = status(b)
            assert sb is not None and not sb.leader and not sb.HasField("latest")  # a standby decides nothing
            last_a = status(a).latest.decision_id  # type: ignore[union-attr]
            a.signal(signal.SIGKILL)
            killed = time.monotonic()
            a.wait(5)
            while time.monotonic() - killed < 4 * TTL:
                sb = status(b)
                if sb is not None and sb.leader:
                    break
                time.sleep(0.05)
            took = time.monotonic() - killed
            assert sb is not None and sb.leader, b.log_text()
            assert took <= 2 * TTL, f"standby led {took:.2f} s after the leader died (2 x TTL = {2 * TTL} s)"
            deadline = time.monotonic() + 5
            while not ((sb := status(b)) and sb.latest.decision_id) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert sb is not None and sb.latest.decision_id > last_a, (sb.latest.decision_id, last_a)
            assert sb.latest.planner_id != 0
            b.wait_log(r"leading: decisions continue from id \d+")


@pytest.mark.timeout(60)
def test_file_backend_runs_one_planner_and_the_second_waits(tmp_path):
    disc = f"file://{tmp_path / 'disc'}"

    def make() -> Daemon:
        port = free_port()
        args = ["--discovery", disc, "--grpc-port", str(port), "--interval", "0.3", "--connector", "virtual"]
        return Daemon("kvmesh-planner", args, tmp_path, port)

    with running(make(), make()) as (a, b):
        a.wait_serving()
        b.wait_serving()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            sa, sb = status(a), status(b)
            if sa and sb and (sa.leader or sb.leader):
                break
            time.sleep(0.1)
        assert sa is not None and sb is not None and sa.leader != sb.leader
        leader, standby = (a, b) if sa.leader else (b, a)
        leader.signal(signal.SIGTERM)
        assert leader.wait(15) == 0
        deadline = time.monotonic() + 5
        while not ((s := status(standby)) and s.leader) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert s is not None and s.leader


@pytest.mark.timeout(60)
async def test_a_planner_that_loses_the_lead_and_wins_it_back_is_in_a_new_term(tmp_path):
    """Between two ticks a planner can lose the lead and win it back (its lease expired while another led
    and decided): its state from before is stale, and only a new term says so. The daemon rebuilt its
    core only when a tick saw it not leading, so it went on with its old next decision id, and the
    decision log went backwards (review: ids A1, B2, B3, then A2)."""
    with EtcdServer(tmp_path / "etcd") as etcd:
        election = EtcdElection(etcd.url, "ns", identity=0xA, ttl=TTL)
        task = asyncio.get_running_loop().create_task(election.run())
        try:
            async with asyncio.timeout(5):
                while not election.is_leader:
                    await asyncio.sleep(0.05)
            assert election.term == 1
            etcd.etcdctl("lease", "revoke", f"{election._lease.id:x}")  # its lease gone behind its back
            async with asyncio.timeout(4 * TTL):
                while not (election.term == 2 and election.is_leader):
                    await asyncio.sleep(0.05)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


@pytest.mark.timeout(180)
def test_a_deposed_leader_drains_the_workers_its_local_connector_started_once_another_leads(tmp_path):
    """Its workers are its own children: the new leader neither counts nor stops them and starts its own.
    Kept, they served on beyond the pool's maximum for good (2 engines in a pool of at most 1)."""

    def local_planner() -> Daemon:
        port = free_port()
        args = [
            "--discovery", etcd.url, "--grpc-port", str(port), "--lease-ttl", str(TTL), "--interval", "0.3",
            "--connector", "local", "--min-engines", "1", "--max-engines", "1",
            "--worker-args", f"--speedup-ratio 0 --lease-ttl {TTL}", "--drain-timeout", "2",
        ]  # fmt: skip
        return Daemon("kvmesh-planner", args, tmp_path, port)

    started = r"started aggregated worker 1 \(pid (\d+)\)"
    with EtcdServer(tmp_path / "etcd") as etcd, running(local_planner()) as (a,):
        a.wait_serving()
        a_worker = int(a.wait_log(started, timeout=60).group(1))  # a leads: b starts only now
        with running(local_planner()) as (b,):
            b.wait_serving()
            a.signal(signal.SIGSTOP)  # a pause past its lease: b leads and starts a worker of its own
            try:
                b_worker = int(b.wait_log(started, timeout=60).group(1))
            finally:
                a.signal(signal.SIGCONT)
            a.wait_log(r"leads now: draining the 1 worker\(s\) this planner started", timeout=30)
            deadline = time.monotonic() + 30
            while running_pid(a_worker):
                assert time.monotonic() < deadline, f"the deposed leader's worker serves on:\n{a.log_text()[-3000:]}"
                time.sleep(0.1)
            assert running_pid(b_worker)
            assert (s := status(b)) is not None and s.leader
