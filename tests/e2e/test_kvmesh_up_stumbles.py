"""``kvmesh up`` when things go wrong (issue 16.7): a taken port, a closed terminal, a killed parent,
a metrics-port clash, and the temp log directory of a clean run."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import kvmesh_cli.main as kvmesh_cli_main
import pytest
from inference import grpc_service_pb2_grpc as pb_grpc

from tests.frontend.frontend_fakes import llm_request
from tests.support.daemons import run_cli, running_pid, script
from tests.support.etcd import free_port

pytestmark = pytest.mark.e2e


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _wait_gone(pids: list[int], timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(running_pid(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if running_pid(p)]


@pytest.fixture
def listener() -> Iterator[int]:
    """Another server holding a port."""
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _up(tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [script("kvmesh"), "up", "--discovery", f"file://{tmp_path / 'disc'}", "--no-demo", "--speedup-ratio", "0",
         *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})  # fmt: skip


def _wait_up(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("kvmesh is up"):
            return
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"kvmesh up did not come up: {proc.communicate()}")


def _leases(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "disc").rglob("*") if p.is_file())


def test_port_in_use_is_refused_before_anything_starts(tmp_path: Path, listener: int) -> None:
    proc = _up(tmp_path, "--grpc-port", str(listener), env={"TMPDIR": str(tmp_path)})
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "kvmesh is up" not in out
    assert err.strip().splitlines() == [
        f"kvmesh up: error: --grpc-port {listener}: the port is already in use by another process "
        "(stop it, or pick a free port with --grpc-port)"
    ]
    assert not list(tmp_path.glob("kvmesh-up-*")), "no log dir for a run that never started"


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--grpc-port", "70000"], "argument --grpc-port: must be 1-65535, got 70000"),
        (["--ready-timeout", "-1"], "argument --ready-timeout: must be a positive number, got -1"),
        (["--planner", "--planner-args", "'--ttft-ms 500"], "argument --planner-args: cannot split"),
        (["--tls", "{tmp}/nowhere"], "--tls {tmp}/nowhere: not a directory (make one with kvmesh certs init DIR)"),
        (["--tls", "{tmp}"], "--tls {tmp}: no ca.crt, frontend.crt"),
        (["--log-dir", "/proc/kvmesh-logs"], "--log-dir /proc/kvmesh-logs: No such file or directory"),
        # a directory that takes no file: a traceback at the first daemon's log, then "stopping..."
        (["--log-dir", "/proc/self"], "--log-dir /proc/self: cannot write there (No such file or directory)"),
        # flags the layout would ignore: one engine per worker process under the planner or P/D workers
        (["--planner", "--num-engines", "3"], "--num-engines: with --planner or --decode-workers every worker"),
        (["--decode-workers", "2", "--num-engines", "3"], "--num-engines: with --planner or --decode-workers"),
        (["--max-engines", "3"], "--max-engines needs --planner"),
    ],
)
def test_a_flag_that_cannot_work_is_one_line_and_exit_2(tmp_path: Path, flags: list[str], says: str) -> None:
    proc = _up(tmp_path, "--grpc-port", str(free_port()), *(f.format(tmp=tmp_path) for f in flags))
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "kvmesh is up" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvmesh up: error: ") and says.format(tmp=tmp_path) in lines[0], err


def test_sighup_stops_the_mesh_and_removes_the_temp_logs(tmp_path: Path) -> None:
    proc = _up(tmp_path, "--grpc-port", str(free_port()), env={"TMPDIR": str(tmp_path)})
    _wait_up(proc)
    daemons = _children(proc.pid)
    assert len(daemons) == 3
    proc.send_signal(signal.SIGHUP)  # the terminal closed
    assert proc.wait(30) == 0
    assert _wait_gone(daemons) == []
    assert not list(tmp_path.glob("kvmesh-up-*")), "a clean run leaves no temp dir"
    assert [name for name in _leases(tmp_path) if name.endswith(".lease")] == []


def test_daemons_die_with_a_killed_parent(tmp_path: Path) -> None:
    proc = _up(tmp_path, "--grpc-port", str(free_port()), "--log-dir", str(tmp_path / "logs"))
    _wait_up(proc)
    daemons = _children(proc.pid)
    proc.kill()  # no handler runs: only the parent-death signal can stop them
    proc.wait()
    assert _wait_gone(daemons) == [], "daemons outlived kvmesh up"


def test_metrics_port_clash_is_one_line_and_exit_2(tmp_path: Path, listener: int) -> None:
    # --metrics-port-base P: the worker gets P (taken), the router P+1, the frontend P+2.
    proc = _up(tmp_path, "--grpc-port", str(free_port()), "--metrics-port-base", str(listener),
               "--log-dir", str(tmp_path / "logs"))  # fmt: skip
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, (out, err)
    assert "kvmesh is up" not in out
    assert (
        f"kvmesh-worker exited with 2: kvmesh-worker: error: --metrics-port {listener}: cannot bind "
        "(Address already in use)" in err
    ), err
    worker_log = (tmp_path / "logs" / "kvmesh-worker.log").read_text()
    assert "Traceback" not in worker_log
    time.sleep(0.5)
    assert [name for name in _leases(tmp_path) if name.endswith(".lease")] == [], "no stale lease"


def test_a_reused_log_dir_reports_this_runs_error_not_an_earlier_one(tmp_path: Path) -> None:
    """The worker dies with a traceback (no 'error:' line of its own): up quotes its last line, not the
    'error:' line an earlier run left in the same (appended) log."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "kvmesh-worker.log").write_text("kvmesh-worker: error: a stale line from an earlier run\n")
    (tmp_path / "crashing_engine.py").write_text("def build(settings, model):\n    raise RuntimeError('boom')\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = _up(tmp_path, "--grpc-port", str(free_port()), "--log-dir", str(logs), "--engine", "crashing_engine:build",
               env=env)  # fmt: skip
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "RuntimeError: boom" in err and "stale" not in err, err
    assert "a stale line" in (logs / "kvmesh-worker.log").read_text(), "earlier runs' lines are kept"


def test_a_second_ctrl_c_cancels_what_is_in_flight_and_still_revokes_every_lease(tmp_path: Path) -> None:
    """Ctrl-C drains, and a stream in flight may hold that for the whole drain timeout (30 s). A second
    Ctrl-C has every daemon cancel what it still serves and leave within seconds, each revoking its
    lease on the way out: no record outlives the mesh, as it would after a SIGKILL."""
    port = free_port()
    proc = _up(tmp_path, "--grpc-port", str(port), "--speedup-ratio", "0.01")  # a decode pass: ~0.6 s
    _wait_up(proc)
    daemons = _children(proc.pid)
    streaming, ended = threading.Event(), queue.Queue[str]()

    def stream() -> None:
        request = llm_request("Tell me about KV caches", model="kvmesh-mock", stream=True,
                              sampling={"max_tokens": 2000, "ignore_eos": True})  # fmt: skip
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            try:
                for _message in stub.ModelStreamInfer(iter([request]), timeout=120):
                    streaming.set()
            except grpc.RpcError as exc:
                ended.put(exc.code().name)
            else:
                ended.put("OK")

    threading.Thread(target=stream, daemon=True).start()
    assert streaming.wait(30), "no token came"
    proc.send_signal(signal.SIGINT)
    time.sleep(2)
    assert proc.poll() is None, "the first Ctrl-C drains: the stream in flight holds the mesh"
    second = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=30)
    assert time.monotonic() - second < 10, err
    assert "second Ctrl-C: cancelling what the daemons still serve" in err and "killing" not in err, err
    assert ended.get(timeout=10) != "OK"
    assert _wait_gone(daemons) == []
    assert [name for name in _leases(tmp_path) if name.endswith(".lease")] == [], "every lease revoked"


@pytest.mark.parametrize("flags", [["--engine", "vllm"], ["--tls", "--prefill-workers", "1"]])
def test_refused_arguments_leave_no_log_directory_and_no_ca_key_behind(tmp_path: Path, flags: list[str]) -> None:
    """Two argument checks came after the temporary log directory (and, with --tls, a fresh CA's private
    key in it) was made, and returned without removing it."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    result = run_cli("kvmesh", "up", "--no-demo", "--grpc-port", str(free_port()), *flags, env={"TMPDIR": str(scratch)})
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert list(scratch.iterdir()) == []


def test_a_demo_request_whose_call_fails_is_reported_not_raised() -> None:
    """The frontend gone during kvmesh up's demo request: one line (kvmesh up retries it while it says
    UNAVAILABLE), where the call's RpcError escaped as a traceback."""
    from kvmesh_cli.kserve_demo import demo_request

    outcome = demo_request(f"127.0.0.1:{free_port()}", "kvmesh-mock")  # nobody listens there
    assert outcome.startswith("demo request failed: UNAVAILABLE: "), outcome


def test_ctrl_c_while_a_command_loads_is_one_line_and_exit_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvmesh up`` imports every daemon's settings first (seconds): a Ctrl-C then was a traceback."""

    def interrupted_import(name: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(kvmesh_cli_main.importlib, "import_module", interrupted_import)
    assert kvmesh_cli_main.main(["up"]) == 130
    assert capsys.readouterr().err == "kvmesh: interrupted\n"
