"""Every daemon's lifecycle contract, with real processes, real gRPC and real discovery backends.

- ``--help`` documents every flag with its default; a bad flag, an unknown TOML table or key, an
  unknown ``KVMESH_*`` variable or unreachable discovery exits 2 with one line.
- A started daemon answers grpc.health.v1 SERVING and lists its services through reflection.
- SIGTERM: the discovery record disappears at once, in-flight calls finish, exit code 0.
- kill -9: the record is gone within TTL + 1 s.
- etcd down for 3×TTL: the daemon keeps serving (discovery being unreachable says nothing about its
  health) and its record is there, under the same key, when etcd is back.
- frozen (SIGSTOP) for 2×TTL: others see its record vanish; on SIGCONT it re-registers under the
  same instance id without a restart (no zombie).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from inference import grpc_service_pb2 as kserve_pb
from inference import grpc_service_pb2_grpc as kserve_grpc
from kvmesh.discovery import instance_prefix, open_discovery
from kvmesh.v1 import worker_pb2, worker_pb2_grpc

from tests.support.daemons import Daemon, run_cli, script
from tests.support.etcd import EtcdServer, free_port
from tests.support.generate import generate_sync, tokens_of

pytestmark = pytest.mark.e2e

DAEMONS = ["kvmesh-worker", "kvmesh-router", "kvmesh-frontend"]
COMMON_FLAGS = [
    "--discovery",
    "--namespace",
    "--lease-ttl",
    "--metrics-port",
    "--otel-exporter",
    "--log-level",
    "--drain-timeout",
    "--config",
    "KVMESH_DISCOVERY",
    "KVMESH_NAMESPACE",
]


@pytest.mark.parametrize("daemon", DAEMONS)
def test_help_documents_every_flag(daemon):
    result = run_cli(daemon, "--help")
    assert result.returncode == 0, result.stderr
    for flag in COMMON_FLAGS:
        assert flag in result.stdout, f"{daemon} --help does not mention {flag}"
    text = " ".join(result.stdout.split())  # argparse wraps lines
    settings = text.count("(env KVMESH_") - text.count("(env KVMESH_CONFIG)")
    with_default = len(re.findall(r"\(env KVMESH_\w+; default: ", text))
    assert settings > len(COMMON_FLAGS) and with_default == settings, "every setting shows its default"
    assert f"tables [common], [{daemon.removeprefix('kvmesh-')}]" in text, "--help names the table the daemon reads"


@pytest.mark.parametrize("daemon", DAEMONS)
def test_bad_flag_exits_2_with_one_line(daemon):
    result = run_cli(daemon, "--definitely-not-a-flag")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"{daemon}: error: unrecognized arguments: --definitely-not-a-flag"]


@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [
        ("--overlap-weight", "1e7", "Input should be less than or equal to 1000000"),  # was a traceback, exit 1
        ("--busy-requests", "0", "Input should be greater than 0"),  # was every engine busy, idle or not
    ],
)
def test_a_router_policy_value_that_cannot_work_exits_2_with_one_line(tmp_path, flag, value, why):
    """Checked with the other settings, from every source, before anything starts."""
    name = flag.removeprefix("--").replace("-", "_")
    config = tmp_path / "kvmesh.toml"
    config.write_text(f"[router]\n{name} = {value}\n")
    for args, env, source in (
        ([flag, value], {}, "flag"),
        ([], {f"KVMESH_{name.upper()}": value}, f"KVMESH_{name.upper()}"),
        (["--config", str(config)], {}, f"{config}"),
    ):
        result = run_cli("kvmesh-router", "--discovery", f"file://{tmp_path / 'disc'}", *args, env=env)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines() == [f"kvmesh-router: error: {flag} (from {source}): {why}"]


@pytest.mark.parametrize("daemon", DAEMONS)
def test_unreachable_discovery_exits_69_with_one_line(daemon):
    """EX_UNAVAILABLE, not 2: the units restart on it (etcd may come up later), never on a bad setting."""
    url = f"etcd://127.0.0.1:{free_port()}"
    started = time.monotonic()
    result = run_cli(daemon, "--discovery", url, "--grpc-port", "0", timeout=30)
    assert result.returncode == 69, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{daemon}: error: --discovery {url}"), result.stderr
    assert time.monotonic() - started < 15


@pytest.mark.parametrize("daemon", DAEMONS)
def test_a_grpc_port_in_use_exits_2_with_one_line(daemon, tmp_path):
    """Another process listens there: a bad setting, said in one line before gRPC's C core says its own."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = run_cli(daemon, "--discovery", f"file://{tmp_path}", "--bind-host", "127.0.0.1",
                         "--grpc-port", str(port), timeout=60)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"{daemon}: error: --grpc-port {port}: cannot bind 127.0.0.1:{port} (Address already in use)"
    ]


def test_a_bind_host_that_is_not_this_machines_exits_2_naming_it(tmp_path):
    """With port 0 (the default of router, worker and planner) the host was not checked: gRPC's C core
    logged a line of its own, then the error blamed --grpc-port 0."""
    result = run_cli("kvmesh-router", "--discovery", f"file://{tmp_path}", "--bind-host", "192.0.2.1", timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "kvmesh-router: error: --bind-host 192.0.2.1: cannot bind 192.0.2.1:0 (Cannot assign requested address)"
    ]


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 on this machine")
def test_an_ipv6_bind_host_serves_grpc_and_metrics(tmp_path):
    """'::1' was no gRPC target (it needs brackets), and '[::1]' no socket address for /metrics."""
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            pass
    except OSError:
        pytest.skip("::1 is not configured here")
    port, metrics = free_port(), free_port()
    daemon = Daemon("kvmesh-router", ["--discovery", f"file://{tmp_path / 'disc'}", "--bind-host", "::1",
                    "--grpc-port", str(port), "--metrics-port", str(metrics)], tmp_path, port)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert daemon.proc.poll() is None, daemon.log_text()
            with grpc.insecure_channel(f"[::1]:{port}") as channel:
                try:
                    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline, daemon.log_text()
            time.sleep(0.1)
        with urllib.request.urlopen(f"http://[::1]:{metrics}/metrics", timeout=5) as reply:
            assert b"kvmesh_router_decisions_total" in reply.read()
    finally:
        daemon.close()


SHARED_CONFIG = """
[common]
namespace = "shared"
[worker]
num-engines = 2
[router]
seed = 7
[frontend]
migration-limit = 1
"""


@pytest.mark.parametrize("daemon", DAEMONS)
def test_one_config_file_serves_every_daemon_and_unknown_settings_exit_2(daemon, tmp_path):
    good, unknown_table, unknown_key = (tmp_path / f"{n}.toml" for n in ("good", "table", "key"))
    good.write_text(SHARED_CONFIG)
    unknown_table.write_text(SHARED_CONFIG + "[wroker]\nnum-engines = 3\n")
    table = daemon.removeprefix("kvmesh-")
    unknown_key.write_text(f"[{table}]\nno-such-setting = 1\n")
    url = f"etcd://127.0.0.1:{free_port()}"  # nothing listens: a daemon that accepted its settings exits here

    def first_line(*args: str, env: dict[str, str] | None = None, code: int = 2) -> str:
        result = run_cli(daemon, "--discovery", url, *args, env=env, timeout=30)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == code and len(lines) == 1, result.stderr
        return lines[0]

    # accepted: the daemon goes on to discovery, which does not answer (69, see the test above)
    assert first_line("--config", str(good), code=69).startswith(f"{daemon}: error: --discovery {url}")
    assert f"unknown table [wroker] in {unknown_table}" in first_line("--config", str(unknown_table))
    assert f"unknown setting 'no-such-setting' in [{table}]" in first_line("--config", str(unknown_key))
    assert "KVMESH_NO_SUCH_SETTING: unknown setting" in first_line(env={"KVMESH_NO_SUCH_SETTING": "1"})


# -- a worker as the representative daemon, on both discovery backends ---------------------------
@pytest.fixture(params=["file", "etcd"])
def discovery_url(request, tmp_path):
    if request.param == "file":
        yield f"file://{tmp_path / 'discovery'}"
        return
    with EtcdServer(tmp_path / "etcd") as etcd:
        yield etcd.url


def start_worker(tmp_path, url, *extra: str, ttl: float = 2.0) -> Daemon:
    port = free_port()
    return Daemon(
        "kvmesh-worker",
        [
            "--discovery",
            url,
            "--grpc-port",
            str(port),
            "--lease-ttl",
            str(ttl),
            "--namespace",
            "lifecycle",
            "--num-gpu-blocks",
            "256",
            "--block-size",
            "16",
            *extra,
        ],
        tmp_path,
        port,
    )


def worker_records(url: str) -> dict[str, bytes]:
    async def read() -> dict[str, bytes]:
        discovery = await open_discovery(url, ttl=2.0)
        try:
            return await discovery.get_prefix(instance_prefix("lifecycle", "worker"))
        finally:
            await discovery.close()

    return asyncio.run(read())


def wait_records(url: str, present: bool, timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if bool(worker_records(url)) == present:
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"worker records {'never appeared' if present else 'still present'} after {timeout} s")


def generate(address: str, max_tokens: int, timeout: float = 30.0) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        engine_id = engine_ids(channel)[0]
        request = worker_pb2.GenerateRequest(
            request_id=f"r{time.monotonic_ns()}",
            engine_id=engine_id,
            token_ids=list(range(1, 40)),
            sampling=worker_pb2.SamplingOptions(max_tokens=max_tokens, ignore_eos=True),
        )
        return tokens_of(generate_sync(stub, request, timeout=timeout))


def engine_ids(channel: grpc.Channel) -> list[int]:
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    first = next(stub.WatchLoad(worker_pb2.WatchLoadRequest(), timeout=5))
    return [load.engine_id for load in first.loads]


def test_worker_serves_health_and_reflection(tmp_path, discovery_url):
    worker = start_worker(tmp_path, discovery_url).wait_serving()
    try:
        assert worker.health("kvmesh.v1.WorkerService") == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(worker.address) as channel:
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert {
            "kvmesh.v1.WorkerService",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= services
        assert len(worker_records(discovery_url)) == 1
    finally:
        worker.close()


def test_sigterm_deregisters_at_once_and_drains_in_flight_calls(tmp_path, discovery_url):
    # speedup 0.5 makes 40 decode passes take ~0.5 s: long enough to be in flight at SIGTERM
    worker = start_worker(tmp_path, discovery_url, "--speedup-ratio", "0.5").wait_serving()
    try:
        result: dict[str, object] = {}
        call = threading.Thread(target=lambda: result.update(tokens=generate(worker.address, 40)))
        call.start()
        time.sleep(0.2)
        worker.signal(signal.SIGTERM)
        gone_after = wait_records(discovery_url, present=False, timeout=1.0)
        call.join(15)
        assert result.get("tokens") is not None and len(result["tokens"]) == 40, "in-flight call did not finish"
        assert worker.wait(15) == 0
        assert gone_after < 1.0
    finally:
        worker.close()


_THREADED_PARENT = """
import subprocess, sys, threading, time
from kvmesh.children import dies_with_parent
for _ in range(8):  # a daemon's threads (gRPC's, discovery's heartbeat): the kernel hands the child over at each
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
with open(sys.argv[1], "ab") as log:
    child = subprocess.Popen(dies_with_parent(sys.argv[2:]), stdout=log, stderr=subprocess.STDOUT)
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_daemon_whose_parent_is_killed_drains_what_it_serves(tmp_path, discovery_url):
    """kill -9 of a multi-threaded parent (a planner, ``kvmesh up``): the kernel sends the parent-death
    signal once per thread the child is handed to, and SIGTERM twice meant "cancel what is in flight":
    a killed planner's workers failed their requests. SIGHUP, however often, is one drain."""
    port, log = free_port(), tmp_path / "worker.log"
    argv = [script("kvmesh-worker"), "--discovery", discovery_url, "--grpc-port", str(port), "--lease-ttl", "2",
            "--namespace", "lifecycle", "--num-gpu-blocks", "256", "--block-size", "16",
            "--speedup-ratio", "0.5"]  # fmt: skip
    parent = subprocess.Popen([sys.executable, "-c", _THREADED_PARENT, str(log), *argv], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 60
        while _health(f"127.0.0.1:{port}") != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        result: dict[str, object] = {}
        call = threading.Thread(target=lambda: result.update(tokens=generate(f"127.0.0.1:{port}", 150)))
        call.start()
        time.sleep(0.3)
        parent.kill()
        parent.wait()
        call.join(30)
        text = log.read_text()
        assert result.get("tokens") is not None and len(result["tokens"]) == 150, text
        deadline = time.monotonic() + 30
        while Path(f"/proc/{child}").exists():
            assert time.monotonic() < deadline, f"the worker outlived its parent:\n{text}"
            time.sleep(0.1)
        text = log.read_text()
        assert "the process that started this daemon is gone: stopping" in text, text
        assert "second stop signal" not in text, text
    finally:
        parent.kill()
        parent.wait()


def _health(address: str) -> int | None:
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1).status
        except grpc.RpcError:
            return None


def test_kill_9_removes_the_record_within_ttl_plus_one_second(tmp_path, discovery_url):
    worker = start_worker(tmp_path, discovery_url, ttl=2.0).wait_serving()
    try:
        wait_records(discovery_url, present=True, timeout=5)
        worker.signal(signal.SIGKILL)
        worker.wait(5)
        assert wait_records(discovery_url, present=False, timeout=3.0 + 1.0) <= 3.0
    finally:
        worker.close()


def test_etcd_outage_keeps_serving_and_keeps_the_registration(tmp_path):
    """Issue 14 item 1: an etcd outage is not an outage of the mesh."""
    with EtcdServer(tmp_path / "etcd") as etcd:
        worker = start_worker(tmp_path, etcd.url, ttl=2.0).wait_serving()
        try:
            before = worker_records(etcd.url)
            etcd.stop()
            down = time.monotonic()
            served = 0
            while time.monotonic() - down < 6.0:  # 3 x TTL: long past any lease deadline
                assert worker.health() == health_pb2.HealthCheckResponse.SERVING, worker.log_text()[-3000:]
                assert len(generate(worker.address, 2, timeout=10)) == 2
                served += 1
                time.sleep(0.2)
            assert served >= 5
            etcd.start()
            deadline = time.monotonic() + 10
            while worker_records(etcd.url).keys() != before.keys():
                assert time.monotonic() < deadline, "not registered under the same key after etcd came back"
                time.sleep(0.1)
            assert worker.proc.poll() is None and worker.health() == health_pb2.HealthCheckResponse.SERVING
        finally:
            worker.close()


def test_an_etcd_freeze_while_a_worker_publishes_its_engines_does_not_stop_it(tmp_path):
    """Caught publishing its records at start-up by an etcd that stopped answering, a worker exited with a
    traceback: an etcd blip became an outage. It serves on, queues the records etcd did not take (one
    write timeout, not one per record) and publishes them once etcd answers again."""
    engines = 1000
    with EtcdServer(tmp_path / "etcd") as etcd:
        worker = start_worker(tmp_path, etcd.url, "--num-engines", str(engines), ttl=10.0)
        try:
            deadline = time.monotonic() + 90
            while not (records := worker_records(etcd.url)):
                assert time.monotonic() < deadline and worker.proc.poll() is None, worker.log_text()[-3000:]
                time.sleep(0.01)
            etcd.freeze()
            try:
                time.sleep(7)  # past the write timeout (5 s)
                assert worker.proc.poll() is None, worker.log_text()[-3000:]
                assert worker.health() == health_pb2.HealthCheckResponse.SERVING
            finally:
                etcd.thaw()
            assert len(records) < engines, "all published before etcd froze: nothing was tested"
            deadline = time.monotonic() + 60
            while len(worker_records(etcd.url)) < engines:
                assert time.monotonic() < deadline, "the queued records were not published after etcd came back"
                time.sleep(0.2)
            assert worker.proc.poll() is None
            assert worker.log_text().count("those after it are kept and published once discovery answers") == 1
        finally:
            worker.close()


@pytest.mark.parametrize("backend", ["etcd", "file"])
def test_a_frozen_daemon_is_dropped_by_others_then_re_registers_under_its_old_id(tmp_path, backend):
    """Not a zombie: SIGSTOP for 2xTTL, its record vanishes for everyone; on SIGCONT it is back, same key."""
    with contextlib.ExitStack() as stack:
        if backend == "etcd":
            url = stack.enter_context(EtcdServer(tmp_path / "etcd")).url
        else:
            url = f"file://{tmp_path / 'discovery'}"
        worker = start_worker(tmp_path, url, ttl=1.0).wait_serving()
        stack.callback(worker.close)
        keys = worker_records(url).keys()
        assert keys
        worker.signal(signal.SIGSTOP)
        try:
            wait_records(url, present=False, timeout=6.0)
        finally:
            worker.signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while worker_records(url).keys() != keys:
            assert time.monotonic() < deadline, f"did not re-register after SIGCONT:\n{worker.log_text()[-3000:]}"
            time.sleep(0.1)
        assert worker.health() == health_pb2.HealthCheckResponse.SERVING
        assert len(generate(worker.address, 3)) == 3


# -- every daemon: health, reflection; and one trace across daemons -------------------------------
SERVICES = {
    "kvmesh-worker": "kvmesh.v1.WorkerService",
    "kvmesh-router": "kvmesh.v1.RouterService",
    "kvmesh-frontend": "inference.GRPCInferenceService",
}


def start(name: str, tmp_path, url: str, *extra: str) -> Daemon:
    port = free_port()
    # a short drain: Daemon.close() SIGKILLs after 10 s, and a killed daemon flushes no spans
    args = ["--discovery", url, "--grpc-port", str(port), "--lease-ttl", "2", "--namespace", "lifecycle",
            "--drain-timeout", "3", *extra]  # fmt: skip
    return Daemon(name, args, tmp_path, port)


@pytest.mark.parametrize("daemon", DAEMONS)
def test_every_daemon_answers_health_and_lists_its_services(tmp_path, daemon):
    proc = start(daemon, tmp_path, f"file://{tmp_path / 'discovery'}")
    try:
        # a frontend alone is not ready (no router, no engine), and says so (see the test below); a router
        # answers NOT_SERVING until its warm restart is done, which on a loaded machine outlasts its first answer
        status = health_pb2.HealthCheckResponse
        alone = status.NOT_SERVING if daemon == "kvmesh-frontend" else status.SERVING
        proc.wait_health((alone,), 60)
        assert proc.health() == alone
        assert proc.health(SERVICES[daemon]) == alone
        with grpc.insecure_channel(proc.address) as channel:
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert {SERVICES[daemon], "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
        proc.signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        proc.close()


def test_the_frontends_health_follows_server_ready(tmp_path):
    """As Triton's does: a load balancer probing grpc.health.v1 must not send requests to a frontend
    whose every request would fail UNAVAILABLE (no router replica, or no model with a live engine)."""
    url = f"file://{tmp_path / 'discovery'}"
    frontend = start("kvmesh-frontend", tmp_path, url).wait_started()
    router = worker = None
    try:
        assert frontend.health() == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not _server_ready(frontend)
        worker = start("kvmesh-worker", tmp_path, url, "--speedup-ratio", "0").wait_serving()
        time.sleep(1)  # an engine without a router is no readier
        assert frontend.health() == health_pb2.HealthCheckResponse.NOT_SERVING
        router = start("kvmesh-router", tmp_path, url).wait_serving()
        frontend.wait_serving(30)
        assert _server_ready(frontend)
        worker.signal(signal.SIGTERM)  # the last engine leaves: not ready again
        assert worker.wait(15) == 0
        frontend.wait_health((health_pb2.HealthCheckResponse.NOT_SERVING,), 15)
        assert not _server_ready(frontend)
    finally:
        for daemon in (frontend, router, worker):
            if daemon is not None:
                daemon.close()


def test_a_frontend_is_not_ready_while_its_router_is_unreachable(tmp_path):
    """A router killed -9 keeps its record in discovery until its lease expires (60 s here), and every
    request meanwhile fails UNAVAILABLE: the frontend turns NOT_SERVING as soon as the replica's channel
    fails, and SERVING again once a replica answers."""
    url = f"file://{tmp_path / 'discovery'}"
    worker = start("kvmesh-worker", tmp_path, url, "--speedup-ratio", "0").wait_serving()
    router = start("kvmesh-router", tmp_path, url, "--lease-ttl", "60").wait_serving()
    frontend = start("kvmesh-frontend", tmp_path, url).wait_started()
    replacement = None
    try:
        frontend.wait_serving(30)
        router.signal(signal.SIGKILL)
        router.wait(10)
        frontend.wait_health((health_pb2.HealthCheckResponse.NOT_SERVING,), 15)
        assert not _server_ready(frontend)
        assert "not ready: no reachable router replica" in frontend.log_text()
        replacement = start("kvmesh-router", tmp_path, url).wait_serving()
        frontend.wait_serving(30)
        assert _server_ready(frontend)
    finally:
        for daemon in (frontend, router, replacement, worker):
            if daemon is not None:
                daemon.close()


def _server_ready(frontend: Daemon) -> bool:
    with grpc.insecure_channel(frontend.address) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        return stub.ServerReady(kserve_pb.ServerReadyRequest(), timeout=5).ready


def spans(log: str) -> list[dict]:
    """Spans the console exporter printed (pretty-printed JSON objects) in a daemon log."""
    found, depth, start_at = [], 0, None
    for i, ch in enumerate(log):
        if ch == "{":
            start_at = i if depth == 0 else start_at
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0 and start_at is not None:
                with contextlib.suppress(json.JSONDecodeError):
                    doc = json.loads(log[start_at : i + 1])
                    if "context" in doc and "name" in doc:
                        found.append(doc)
    return found


def test_one_request_is_one_trace_across_frontend_and_worker(tmp_path):
    from kvmesh_cli.kserve_demo import demo_request

    url = f"file://{tmp_path / 'discovery'}"
    tracing = ("--otel-exporter", "console")
    worker = start("kvmesh-worker", tmp_path, url, "--speedup-ratio", "0", *tracing).wait_serving()
    router = start("kvmesh-router", tmp_path, url, *tracing).wait_serving()
    frontend = start("kvmesh-frontend", tmp_path, url, *tracing).wait_serving()
    try:
        deadline = time.monotonic() + 60  # a loaded 2-core machine
        while "done in" not in (outcome := demo_request(frontend.address, "kvmesh-mock", max_tokens=4)):
            assert time.monotonic() < deadline, outcome
            time.sleep(0.2)
    finally:
        for proc in (frontend, router, worker):  # SIGTERM flushes the span processors
            proc.close()
    generate = [s for s in spans(worker.log_text()) if s["name"].endswith("WorkerService/Generate")]
    assert generate, "the worker exported no Generate span"
    frontend_traces = {s["context"]["trace_id"] for s in spans(frontend.log_text())}
    assert {s["context"]["trace_id"] for s in generate} & frontend_traces, "trace context did not cross daemons"
