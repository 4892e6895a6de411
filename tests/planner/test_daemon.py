"""kvmesh-planner follows the runtime rules of every daemon: settings, health, reflection, metrics, SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from kvmesh.v1 import planner_pb2, planner_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh_bench.prometheus_text import metric_total, metrics_url

from tests.support.daemons import Daemon, file_worker, run_cli, running, running_pid
from tests.support.etcd import free_port

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ttft-ms", "100"], "--ttft-ms and --itl-ms go together"),
        (["--predictor", "prophet"], "--predictor (from flag): unknown predictor 'prophet'"),
        (["--connector", "k8s"], "--connector"),
        (["--min-engines", "5", "--max-engines", "2"], "--min-engines is above --max-engines"),
        (["--connector", "local", "--worker-command", "/nonexistent/kvmesh-worker"], "--worker-command"),
        (["--pools", "prefill"], "the prefill pool needs the decode pool"),
        (["--pools", "decode,encode"], "unknown pool 'encode'"),
        (["--pools", "prefill,decode", "--min-decode", "5", "--max-decode", "2"], "--min-decode is above --max-decode"),
        (["--pools", "prefill,decode", "--engine-budget", "1"], "--engine-budget is below the sum of the managed"),
        (
            ["--pools", "decode", "--connector", "systemd", "--decode-unit-template", "x.service"],
            "--decode-unit-template (from flag): 'x.service' is not a template",
        ),
        # Each flag's own mistake named (the shell words of --systemctl were blamed on --unit-template) and
        # found at start (a missing systemctl was a traceback at every tick).
        (["--connector", "systemd", "--systemctl", "'x"], '--systemctl: "\'x": No closing quotation'),
        (["--connector", "systemd", "--systemctl", "/nonexistent/systemctl"], "'/nonexistent/systemctl' is not an"),
        (["--connector", "local", "--worker-args", "'x"], '--worker-args: "\'x": No closing quotation'),
        # A pool of none has no load to observe, so it never grew: every request failed "no live engine".
        (["--min-engines", "0"], "--min-engines (from flag): Input should be greater than 0"),
        (["--pools", "prefill,decode", "--min-decode", "0"], "--min-decode (from flag): Input should be greater"),
        (["--connector", "local", "--worker-args", "--num-engines 2"], "--worker-args: --num-engines is the local"),
    ],
)
def test_bad_settings_exit_2_with_one_line(args, message):
    result = run_cli("kvmesh-planner", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_a_profile_that_is_no_npz_exits_2_with_one_line(tmp_path):
    """It was an EOFError traceback (an empty file); the profile's other flaws: tests/libs/test_perf_profile.py."""
    empty = tmp_path / "profile.npz"
    empty.touch()
    result = run_cli("kvmesh-planner", "--profile", str(empty), "--ttft-ms", "500", "--itl-ms", "50")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"kvmesh-planner: error: --profile {empty}: not an NPZ profile (No data left in file)"
    ]


@pytest.mark.timeout(60)
def test_serves_health_reflection_status_metrics_and_exits_0_on_sigterm(tmp_path):
    port, metrics = free_port(), free_port()
    args = [
        "--discovery", f"file://{tmp_path / 'disc'}", "--grpc-port", str(port), "--metrics-port", str(metrics),
        "--interval", "0.2", "--connector", "virtual", "--ack-timeout", "0.1",
    ]  # fmt: skip
    with running(Daemon("kvmesh-planner", args, tmp_path, port)) as (d,):
        d.wait_serving()
        with grpc.insecure_channel(d.address) as ch:
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            reply = next(iter(refl.ServerReflectionInfo(iter([ask]))))
            names = {s.name for s in reply.list_services_response.service}
            assert {"kvmesh.v1.PlannerService", "grpc.health.v1.Health"} <= names
            stub = planner_pb2_grpc.PlannerServiceStub(ch)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                status = stub.GetStatus(planner_pb2.GetStatusRequest(), timeout=2)
                if status.leader and status.latest.decision_id:
                    break
                time.sleep(0.1)
            assert status.leader and status.connector == "virtual" and status.mode == "load"
            assert status.latest.target.aggregated == 1  # the minimum, from an empty fleet
        url = metrics_url(metrics)
        assert metric_total(url, "kvmesh_planner_leader") == 1.0
        assert metric_total(url, "kvmesh_planner_pool_target", {"pool": "aggregated"}) == 1.0
        d.wait_log(r"decision 1 mode=load aggregated=0->1 reason='aggregated: below its minimum 1'")
        d.signal(signal.SIGTERM)
        assert d.wait(20) == 0


def test_a_virtual_pool_holds_while_the_engines_it_asked_for_have_not_registered(tmp_path):
    """The orchestrator never brings up (nor acknowledges) the engine asked for: the pool grew 1 -> 2 -> 3 -> 4,
    one step per ack timeout, on the one engine's load. The missing engine is starting: the pool holds
    ("no scaling on stale capacity"), and the ack timeout is said once."""
    with file_worker(tmp_path, "kvmesh", "--num-gpu-blocks", "64", "--block-size", "16", "--speedup-ratio", "1") as w:
        port = free_port()
        args = [
            "--discovery", f"file://{tmp_path / 'discovery'}", "--grpc-port", str(port), "--interval", "0.5",
            "--connector", "virtual", "--ack-timeout", "1", "--load-profile", "latency", "--max-engines", "4",
        ]  # fmt: skip
        with (
            running(Daemon("kvmesh-planner", args, tmp_path, port)) as (planner,),
            grpc.insecure_channel(w.address) as wch,
        ):
            planner.wait_serving()
            worker = worker_pb2_grpc.WorkerServiceStub(wch)
            engine = next(worker.WatchLoad(worker_pb2.WatchLoadRequest(), timeout=10)).loads[0].engine_id
            request = worker_pb2.GenerateRequest(  # 600 prompt tokens in a 1024-token cache, decoding for a while
                request_id="load", engine_id=engine, token_ids=list(range(1, 600)),
                sampling=worker_pb2.SamplingOptions(max_tokens=400, ignore_eos=True),
            )  # fmt: skip
            load = worker.GenerateStream(iter([worker_pb2.GenerateStreamRequest(requests=[request])]), timeout=60)
            threading.Thread(target=_drain_stream, args=(load,), daemon=True).start()
            targets = []
            with grpc.insecure_channel(planner.address) as ch:
                stub = planner_pb2_grpc.PlannerServiceStub(ch)
                deadline = time.monotonic() + 8  # several ack timeouts
                while time.monotonic() < deadline:
                    latest = stub.GetStatus(planner_pb2.GetStatusRequest(), timeout=2).latest
                    targets.append(latest.target.aggregated)
                    time.sleep(0.2)
            load.cancel()
            assert max(targets) == 2, targets  # asked for one more, then held while it never came
            assert "engine(s) still starting, holding" in latest.reason, latest
            assert planner.log_text().count("not acknowledged within --ack-timeout") == 1


def _drain_stream(call: Any) -> None:
    """Read a response stream to its end, or to its cancel (a sync gRPC stream sends nothing unread)."""
    with contextlib.suppress(grpc.RpcError):
        for _ in call:
            pass


@pytest.mark.timeout(90)
def test_a_virtual_planner_starts_from_the_engines_that_run_before_any_acknowledgement(tmp_path):
    """With no acknowledgement yet, the connector said no engine ran: the first decision went from 0 to the
    minimum, asking a running pool of 2 for 1 with no load seen ("start adopts what runs")."""
    with file_worker(tmp_path, "kvmesh", "--num-engines", "2", "--speedup-ratio", "0"):
        port = free_port()
        args = [
            "--discovery", f"file://{tmp_path / 'discovery'}", "--grpc-port", str(port), "--interval", "0.2",
            "--connector", "virtual", "--ack-timeout", "0.1",
        ]  # fmt: skip
        with running(Daemon("kvmesh-planner", args, tmp_path, port)) as (planner,):
            planner.wait_serving()
            with grpc.insecure_channel(planner.address) as ch:
                stub = planner_pb2_grpc.PlannerServiceStub(ch)
                deadline = time.monotonic() + 20
                while True:
                    status = stub.GetStatus(planner_pb2.GetStatusRequest(), timeout=2)
                    if status.latest.decision_id and status.observed.aggregated == 2:
                        break
                    assert time.monotonic() < deadline, status
                    time.sleep(0.1)
            assert status.latest.previous.aggregated == 2 and status.latest.target.aggregated == 2, status.latest


@pytest.mark.timeout(90)
def test_a_killed_planner_takes_the_workers_it_started_with_it(tmp_path):
    """kill -9 of a planner with the local connector: its workers drain and exit, not serve on as orphans a
    restarted planner would neither adopt nor stop (it would start more)."""
    port = free_port()
    args = [
        "--discovery", f"file://{tmp_path / 'disc'}", "--grpc-port", str(port), "--interval", "0.2",
        "--connector", "local", "--min-engines", "1", "--max-engines", "1",
    ]  # fmt: skip
    with running(Daemon("kvmesh-planner", args, tmp_path, port)) as (planner,):
        planner.wait_serving()
        worker_pid = int(planner.wait_log(r"started aggregated worker 1 \(pid (\d+)\)", timeout=30).group(1))
        deadline = time.monotonic() + 30
        while "kvmesh-worker" not in Path(f"/proc/{worker_pid}/cmdline").read_text():
            assert time.monotonic() < deadline, "the worker never exec'd"
            time.sleep(0.05)
        planner.signal(signal.SIGKILL)
        planner.wait(10)
        deadline = time.monotonic() + 30
        while running_pid(worker_pid):
            if time.monotonic() > deadline:
                os.kill(worker_pid, signal.SIGKILL)
                raise AssertionError("the planner's worker outlived it by 30 s")
            time.sleep(0.1)


def test_the_planner_applies_the_tuned_grpc_experiments():
    import os
    import subprocess
    import sys

    from kvmesh.grpc_core import EXPERIMENTS_ENV, TUNED_EXPERIMENTS

    env = {k: v for k, v in os.environ.items() if k != EXPERIMENTS_ENV}
    code = f"import os, kvmesh_planner.main; print(os.environ.get({EXPERIMENTS_ENV!r}, '<unset>'))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == TUNED_EXPERIMENTS
