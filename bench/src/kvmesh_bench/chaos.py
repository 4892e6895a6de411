"""Fault suite: real daemons on loopback, real etcd, a steady client load, and one fault per scenario.

``kvmesh bench chaos --scenario NAME`` (``--list`` for the names). Every scenario starts its own mesh
(etcd, workers, routers, one frontend, each its own process, everything on 127.0.0.1), runs an
open-loop load of ``--rate`` requests/s (each its own ``ModelStreamInfer`` stream, ``--tokens``
tokens, ``ignore_eos``) plus one *background stream* (long requests back to back, whose largest
inter-token gap is the stall a user would see), injects its fault, and prints:

- requests sent and failures by status (the frontend's in-band ``STATUS: message``);
- leaked KV blocks (``kvmesh_engine_active_blocks`` of every surviving engine) and bookings
  (``kvmesh_router_active_bookings``) once the load stopped and everything settled;
- the RSS of every daemon at start, middle and end (MiB, summed per daemon kind);
- the largest inter-token gap of the background stream.

The regression tests in ``tests/chaos/`` call :func:`run_scenario` with short durations and assert the
figures; ``docs/reliability.md`` holds a table from a real run. Fuzz and oversized-input scenarios
plug in through :data:`SCENARIOS` (a name -> coroutine function taking a :class:`Run`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import grpc
from inference import grpc_service_pb2 as kserve
from inference import grpc_service_pb2_grpc as kserve_grpc
from kvmesh.ports import free_port

from kvmesh_bench.argtypes import CommandParser, output_file, positive_float, positive_int
from kvmesh_bench.chaos_multihost import MultiHostMesh
from kvmesh_bench.frontend_bench import kserve_request as streamed_request
from kvmesh_bench.local_procs import process_cpu_s, script
from kvmesh_bench.multihost import Cluster, missing_requirements
from kvmesh_bench.prometheus_text import metric_total, metrics_url
from kvmesh_bench.tables import write_json

_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # exported at runtime; types-grpcio omits it
MODEL = "kvmesh-mock"


# -- processes ---------------------------------------------------------------------------------
def _lost_a_port_race(proc: Proc, wait_s: float = 10.0) -> bool:
    """Whether ``proc`` exited because a port it was given was taken meanwhile (else: it serves or starts)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not proc.alive:
            return proc.proc.returncode == 2 and "cannot bind" in proc.log.read_text(errors="replace")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", proc.port)) == 0:
                return False
        time.sleep(0.1)
    return False


class Proc:
    """One child process with its log; only ever signals itself."""

    def __init__(self, kind: str, argv: list[str], log: Path, port: int = 0, metrics_port: int = 0) -> None:
        self.kind = kind
        self.port = port
        self.metrics_port = metrics_port
        self.log = log
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env=env)  # fmt: skip

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def signal(self, sig: int) -> None:
        if self.alive:
            self.proc.send_signal(sig)

    def cpu_s(self) -> float:
        """User + system CPU seconds the process has used (0 once it is gone)."""
        return process_cpu_s(self.proc.pid)

    def rss_mib(self) -> float:
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def stop(self) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Etcd:
    """A private single-member etcd; ``stop``/``start`` keep its data dir and ports."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir / "etcd"
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    def start(self) -> None:
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        argv = [os.environ.get("KVMESH_TEST_ETCD", "etcd"), "--name", "chaos", "--data-dir", str(self.dir / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer, "--initial-cluster", f"chaos={peer}",
                "--heartbeat-interval", "10", "--election-timeout", "100", "--log-level", "warn"]  # fmt: skip
        self.proc = Proc("etcd", argv, self.dir.parent / "etcd.log")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(f"{client}/health", timeout=0.5) as r:
                if json.load(r).get("health") == "true":
                    return
            time.sleep(0.05)
        raise RuntimeError("etcd did not become healthy within 15 s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.signal(signal.SIGCONT)


class Mesh:
    """Workers, routers and one frontend on a private etcd; closes everything it started."""

    def __init__(
        self, workdir: Path, lease_ttl: float, log_level: str = "info", frontend_flags: Sequence[str] = ()
    ) -> None:
        self.workdir = workdir
        self.lease_ttl = lease_ttl
        self.log_level = log_level
        self.frontend_flags = list(frontend_flags)
        self.namespace = f"chaos{os.getpid()}"
        self.etcd = Etcd(workdir)
        self.procs: list[Proc] = []
        self.frontend: Proc | None = None

    def _spawn(self, kind: str, *args: str) -> Proc:
        """Start a daemon on free ports; a port taken between the probe and the bind (another process on a
        shared machine) is one line and exit 2 from the daemon: then try again on new ports."""
        for _attempt in range(3):
            port, metrics = free_port(), free_port()
            argv = [script(f"kvmesh-{kind}"), "--discovery", self.etcd.url, "--namespace", self.namespace,
                    "--grpc-port", str(port), "--metrics-port", str(metrics), "--lease-ttl", f"{self.lease_ttl:g}",
                    "--drain-timeout", "2", "--log-level", self.log_level, *args]  # fmt: skip
            proc = Proc(kind, argv, self.workdir / f"{kind}-{port}.log", port, metrics)
            if not _lost_a_port_race(proc):
                break
        self.procs.append(proc)
        return proc

    def worker(self, engines: int, *extra: str) -> Proc:
        return self._spawn("worker", "--num-engines", str(engines), "--num-gpu-blocks", "4096",
                           "--block-size", "16", *extra)  # fmt: skip

    def router(self, *extra: str) -> Proc:
        return self._spawn("router", "--router-mode", "kv", *extra)

    def start_frontend(self, *extra: str) -> Proc:
        self.frontend = self._spawn("frontend", *extra, *self.frontend_flags)
        return self.frontend

    @property
    def frontend_address(self) -> str:
        assert self.frontend is not None
        return f"127.0.0.1:{self.frontend.port}"

    def check(self) -> None:
        for p in self.procs:
            if not p.alive and p.proc.returncode not in (-signal.SIGKILL, 0):
                raise RuntimeError(f"{p.kind} exited with {p.proc.returncode}:\n{p.log.read_text()[-3000:]}")

    def rss(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for p in self.procs:
            if p.alive:
                out[p.kind] = round(out.get(p.kind, 0.0) + p.rss_mib(), 1)
        return out

    def cpu(self) -> dict[tuple[str, int], float]:
        """CPU seconds used so far by every live daemon, keyed (kind, pid), and by this process (the load
        generator, key ``("client", 0)``)."""
        out = {("client", 0): time.process_time()}
        out.update(((p.kind, p.proc.pid), p.cpu_s()) for p in self.procs if p.alive)
        return out

    def metric_sum(self, kind: str, name: str) -> float:
        """Sum of a Prometheus metric over every live daemon of a kind (0 for none)."""
        return sum(self.metric(p, name) for p in self.procs if p.kind == kind and p.alive)

    @staticmethod
    def metric(proc: Proc, name: str) -> float:
        """Sum of a Prometheus metric's samples (every label set) on one daemon (0 if it does not answer)."""
        with contextlib.suppress(OSError):
            return metric_total(metrics_url(proc.metrics_port), name, timeout=2)
        return 0.0

    def close(self) -> None:
        for p in reversed(self.procs):
            p.signal(signal.SIGTERM)
        for p in reversed(self.procs):
            p.stop()
        self.etcd.stop()


# -- the client ------------------------------------------------------------------------------------
def kserve_request(request_id: str, tokens: int, prompt: str) -> kserve.ModelInferRequest:
    return streamed_request(MODEL, prompt, tokens, request_id)


async def one_request(
    stub: kserve_grpc.GRPCInferenceServiceAsyncStub,
    request_id: str,
    tokens: int,
    *,
    cancel_after: int | None = None,
    on_token: Callable[[float], None] | None = None,
    timeout: float = 120.0,
) -> str:
    """``ok``, ``cancelled`` (on purpose, after ``cancel_after`` responses) or the failure's ``STATUS: message``."""
    prompt = f"chaos {request_id} " + " ".join(random.choice(("kv", "cache", "mesh", "lease")) for _ in range(24))
    call = stub.ModelStreamInfer(timeout=timeout)
    responses = 0
    try:
        await call.write(kserve_request(request_id, tokens, prompt))
        while True:
            read = await call.read()
            if read is _EOF:
                return "STREAM_ENDED"
            message = cast(kserve.ModelStreamInferResponse, read)
            if message.error_message:
                return message.error_message
            responses += 1
            if on_token is not None:
                on_token(time.monotonic())
            if message.infer_response.parameters["triton_final_response"].bool_param:
                return "ok"
            if cancel_after is not None and responses >= cancel_after:
                call.cancel()
                return "cancelled"
    except grpc.aio.AioRpcError as exc:
        return f"{exc.code().name}: {exc.details()}"
    finally:
        call.cancel()


@dataclass
class Report:
    scenario: str
    requests: int = 0
    ok: int = 0
    cancelled: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    leaked_blocks: float = 0.0
    leaked_bookings: float = 0.0
    rss_mib: dict[str, dict[str, float]] = field(default_factory=dict)
    max_gap_s: float = 0.0
    migrations: float = 0.0
    # Deltas over the load (background stream included), from the daemons' metrics: requests the
    # frontend admitted, those it refused at its gRPC entry, routing decisions of the live routers.
    admitted: float = 0.0
    refused_at_entry: float = 0.0
    router_decisions: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds over the load, per daemon kind and client
    background_requests: int = 0
    background_failures: dict[str, int] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)  # status -> its first message

    def table(self) -> str:
        rows = [
            ("scenario", self.scenario),
            ("requests (ok / cancelled on purpose)", f"{self.requests} ({self.ok} / {self.cancelled})"),
            ("failures by status", ", ".join(f"{k} {v}" for k, v in sorted(self.failures.items())) or "0"),
            ("leaked KV blocks / bookings", f"{self.leaked_blocks:g} / {self.leaked_bookings:g}"),
            ("migrations (frontend)", f"{self.migrations:g}"),
            (
                "frontend: admitted / refused at entry; router decisions",
                f"{self.admitted:g} / {self.refused_at_entry:g}; {self.router_decisions:g}",
            ),
            (
                "background stream: requests, failures",
                f"{self.background_requests}, {sum(self.background_failures.values())}",
            ),
            ("background stream: largest inter-token gap", f"{self.max_gap_s * 1000:.0f} ms"),
            ("CPU seconds over the load", ", ".join(f"{k} {v:.1f}" for k, v in sorted(self.cpu_s.items()))),
        ]
        for when, rss in self.rss_mib.items():
            rows.append((f"RSS MiB at {when}", ", ".join(f"{k} {v:.0f}" for k, v in sorted(rss.items()))))
        rows += [(k, str(v)) for k, v in self.notes.items()]
        rows += [(f"first {k}", v) for k, v in self.examples.items()]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


class Run:
    """What a scenario drives: the mesh, the load, the report; see :func:`run_scenario`."""

    def __init__(self, mesh: Mesh | MultiHostMesh, args: argparse.Namespace) -> None:
        self.mesh = mesh
        self.args = args
        self.report = Report(args.scenario)
        self.statuses: Counter[str] = Counter()
        self.background: Counter[str] = Counter()
        self.ttft: list[float] = []
        self.failure_latency: dict[str, list[float]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._stop_background = asyncio.Event()
        self._last_token = 0.0
        self._background_task: asyncio.Task[None] | None = None
        self.channel: grpc.aio.Channel | None = None
        self._counts_at_start: dict[str, float] = {}
        self._cpu_at_start: dict[tuple[str, int], float] = {}

    async def start(self, engines: int) -> None:
        """Once the scenario's daemons are spawned: wait until ``engines`` are ready, start the background stream."""
        self.channel = grpc.aio.insecure_channel(self.mesh.frontend_address)
        await self.wait_ready(engines)
        self._counts_at_start = await self.request_counts()
        self._cpu_at_start = self.mesh.cpu()
        self.sample_rss("start")
        self._background_task = asyncio.get_running_loop().create_task(self._background())

    @property
    def stub(self) -> kserve_grpc.GRPCInferenceServiceAsyncStub:
        assert self.channel is not None
        return kserve_grpc.GRPCInferenceServiceStub(self.channel)

    async def wait_ready(self, engines: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.mesh.check()
            with contextlib.suppress(grpc.aio.AioRpcError):
                if (await self.stub.ModelReady(kserve.ModelReadyRequest(name=MODEL), timeout=1)).ready:
                    config = (await self.stub.ModelConfig(kserve.ModelConfigRequest(name=MODEL), timeout=1)).config
                    # ModelReady speaks of engines only: the frontend may not have seen a router yet
                    if config.parameters["engines"].string_value == str(engines) and (
                        await one_request(self.stub, f"warmup{time.monotonic_ns()}", 2, timeout=5) == "ok"
                    ):
                        return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"the mesh did not have {engines} ready engines within {timeout:g} s")

    async def _send(self, n: int, cancel_after: int | None) -> None:
        started = time.monotonic()
        first: list[float] = []

        def on_token(at: float) -> None:
            if not first:
                first.append(at)

        status = await one_request(self.stub, f"r{n}", self.args.tokens, cancel_after=cancel_after, on_token=on_token)
        name = self._count(self.statuses, status)
        if name == "ok" and first:
            self.ttft.append(first[0] - started)
        elif name not in ("ok", "cancelled"):
            self.failure_latency.setdefault(name, []).append(time.monotonic() - started)

    def _count(self, counter: Counter[str], status: str) -> str:
        name = status.split(":", 1)[0].strip() or "ERROR"
        if name not in ("ok", "cancelled"):
            self.report.examples.setdefault(name, status[:300])
        counter[name] += 1
        return name

    async def load(self, seconds: float, rate: float | None = None, cancel: bool = False) -> None:
        """Open-loop load: ``rate`` requests/s for ``seconds`` (requests keep running after it returns)."""
        rate = rate or self.args.rate
        start = time.monotonic()
        sent = 0
        while time.monotonic() - start < seconds:
            cancel_after = random.randint(0, self.args.tokens) if cancel and random.random() < 0.5 else None
            task = asyncio.get_running_loop().create_task(self._send(self.report.requests, cancel_after))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            self.report.requests += 1
            sent += 1
            await asyncio.sleep(max(0.0, start + sent / rate - time.monotonic()))  # no drift, no catch-up burst

    async def burst(self, count: int, concurrency: int) -> None:
        """``count`` requests, at most ``concurrency`` in flight."""
        gate = asyncio.Semaphore(concurrency)

        async def one(n: int) -> None:
            async with gate:
                await self._send(n, None)

        base = self.report.requests
        self.report.requests += count
        await asyncio.gather(*(one(base + i) for i in range(count)))

    def _token(self, at: float) -> None:
        if self._last_token:
            self.report.max_gap_s = max(self.report.max_gap_s, at - self._last_token)
        self._last_token = at

    async def _background(self) -> None:
        n = 0
        while not self._stop_background.is_set():
            self._last_token = 0.0
            status = await one_request(self.stub, f"bg{n}", self.args.background_tokens, on_token=self._token)
            self._count(self.background, status)
            n += 1
            if not status.startswith("ok"):
                await asyncio.sleep(0.1)  # a failing mesh must not turn the background stream into a hot loop

    async def drain(self, timeout: float = 120.0) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)

    async def settle_leaks(self, timeout: float = 15.0) -> None:
        """Wait (bounded) for every surviving engine and router to hold nothing, then record what is left."""
        deadline = time.monotonic() + timeout
        while True:
            blocks = self.mesh.metric_sum("worker", "kvmesh_engine_active_blocks")
            bookings = self.mesh.metric_sum("router", "kvmesh_router_active_bookings")
            if (blocks == 0 and bookings == 0) or time.monotonic() > deadline:
                self.report.leaked_blocks, self.report.leaked_bookings = blocks, bookings
                return
            await asyncio.sleep(0.25)

    async def request_counts(self, timeout: float = 15.0) -> dict[str, float]:
        """The frontend's finished and entry-refused requests and the routers' decisions, read once nothing is
        in flight at the frontend (bounded wait), so that every decision taken belongs to a finished request."""
        deadline = time.monotonic() + timeout
        while self.mesh.metric_sum("frontend", "kvmesh_frontend_inflight_requests") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return {
            "finished": self.mesh.metric_sum("frontend", "kvmesh_frontend_requests_total"),
            "refused": self.mesh.metric_sum("frontend", "kvmesh_frontend_admission_rejected_total"),
            "decisions": self.mesh.metric_sum("router", "kvmesh_router_decisions_total"),
        }

    def sample_rss(self, when: str) -> None:
        self.report.rss_mib[when] = self.mesh.rss()


Scenario = Callable[[Run], Awaitable[None]]


# -- scenarios ---------------------------------------------------------------------------------------
def _kill_worker(engines: int) -> Scenario:
    async def scenario(run: Run) -> None:
        workers = [run.mesh.worker(engines, "--speedup-ratio", str(run.args.speedup)) for _ in range(2)]
        run.mesh.router()
        run.mesh.start_frontend()
        await run.start(2 * engines)
        await run.load(run.args.duration / 2)
        workers[0].signal(signal.SIGKILL)
        run.report.notes["fault"] = f"kill -9 of a worker hosting {engines} engines under load"
        await run.load(run.args.duration / 2)

    return scenario


async def _kill_router(run: Run) -> None:
    mesh: Any = run.mesh  # Mesh or MultiHostMesh: each reads the metrics of its own kind of process
    run.mesh.worker(2, "--speedup-ratio", str(run.args.speedup))
    routers = [run.mesh.router(), run.mesh.router()]
    run.mesh.start_frontend()
    await run.start(2)
    await run.load(run.args.duration / 3)
    routers[0].signal(signal.SIGKILL)
    run.report.notes["fault"] = "kill -9 of one of two router replicas under load, then a new replica joins"
    await run.load(run.args.duration / 3)
    joined = run.mesh.router()
    before = mesh.metric(joined, "kvmesh_router_decisions_total")
    await run.load(run.args.duration / 3)
    await run.drain()
    decisions = {
        p.address: mesh.metric(p, "kvmesh_router_decisions_total")
        for p in run.mesh.procs
        if p.kind == "router" and p.alive
    }
    run.report.notes["decisions per live router"] = decisions
    run.report.notes["decisions of the joined router"] = mesh.metric(joined, "kvmesh_router_decisions_total") - before


def _etcd(mode: str) -> Scenario:
    async def scenario(run: Run) -> None:
        run.mesh.worker(2, "--speedup-ratio", str(run.args.speedup))
        run.mesh.worker(2, "--speedup-ratio", str(run.args.speedup))
        run.mesh.router()
        run.mesh.start_frontend()
        await run.start(4)
        await run.load(min(5.0, run.args.duration / 4))
        outage = run.args.outage
        if mode == "stop":
            run.mesh.etcd.stop()
        else:
            run.mesh.etcd.freeze()
        run.report.notes["fault"] = f"etcd {'stopped' if mode == 'stop' else 'frozen (SIGSTOP)'} for {outage:g} s"
        await run.load(outage)
        if mode == "stop":
            await asyncio.to_thread(run.mesh.etcd.start)
        else:
            run.mesh.etcd.thaw()
        await run.load(min(10.0, run.args.duration / 2))

    return scenario


async def _overload(run: Run) -> None:
    run.mesh.worker(2, "--speedup-ratio", str(run.args.speedup), "--max-num-seqs", "8")
    run.mesh.router()
    run.mesh.start_frontend()
    await run.start(2)
    started = time.monotonic()
    await run.burst(run.args.burst, run.args.concurrency)
    run.report.notes["fault"] = f"burst of {run.args.burst} requests at concurrency {run.args.concurrency}"
    run.report.notes["burst seconds"] = round(time.monotonic() - started, 1)


async def _overload_open(run: Run) -> None:
    run.mesh.worker(2, "--speedup-ratio", str(run.args.speedup), "--max-num-seqs", "8")
    run.mesh.router()
    run.mesh.start_frontend()
    await run.start(2)
    run.report.notes["fault"] = f"open-loop {run.args.rate:g} requests/s for {run.args.duration:g} s, beyond capacity"
    await run.load(run.args.duration)


async def _cancel(run: Run) -> None:
    run.mesh.worker(2, "--speedup-ratio", str(run.args.speedup))
    run.mesh.router()
    run.mesh.start_frontend()
    await run.start(2)
    run.report.notes["fault"] = "half the requests cancelled by the client after a random number of tokens"
    await run.load(run.args.duration, cancel=True)


async def _soak(run: Run) -> None:
    run.mesh.worker(2, "--speedup-ratio", str(run.args.speedup))
    run.mesh.router()
    run.mesh.start_frontend()
    await run.start(2)
    run.report.notes["fault"] = f"none: steady load for {run.args.duration:g} s"
    await run.load(run.args.duration / 2)
    run.sample_rss("middle")
    await run.load(run.args.duration / 2)


# -- multi-host scenarios (--topology multihost) -----------------------------------------------------
class NeedsMultihost(Exception):
    """A partition scenario run on the loopback topology."""


async def _standard_layout(run: Run) -> Cluster:
    """3 workers (1 engine each), 2 router replicas, 2 frontends (the load goes to frontend1)."""
    if not isinstance(run.mesh, MultiHostMesh):
        raise NeedsMultihost(f"scenario {run.args.scenario} needs --topology multihost")
    for _ in range(3):
        run.mesh.worker(1, "--speedup-ratio", str(run.args.speedup))
    run.mesh.router()
    run.mesh.router()
    run.mesh.start_frontend()
    run.mesh.start_frontend()
    await run.start(3)
    return run.mesh.cluster


def _partition(side_a: str | list[str], side_b: str | list[str], what: str) -> Scenario:
    async def scenario(run: Run) -> None:
        cluster = await _standard_layout(run)
        await run.load(run.args.duration / 2)
        cluster.partition(side_a, side_b)
        run.report.notes["fault"] = f"{what}, for {run.args.outage:g} s, then healed"
        await run.load(run.args.outage)
        cluster.heal()
        await run.load(run.args.duration / 2)
        if "router1" in (side_a, side_b) and "router2" in (side_a, side_b):
            await run.drain()
            run.report.notes["index dumps identical after heal"] = await _dumps_converge(cluster)

    return scenario


async def _dumps_converge(cluster: Cluster, timeout: float = 30.0) -> bool:
    """Whether every router replica's DumpIndex becomes identical (bounded wait)."""
    from kvmesh.v1 import router_pb2, router_pb2_grpc

    async def dump(address: str) -> dict[int, list[int]]:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await router_pb2_grpc.RouterServiceStub(channel).DumpIndex(
                router_pb2.DumpIndexRequest(), timeout=10
            )
        return {e.engine_id: sorted(e.block_hashes) for e in reply.engines}

    deadline = time.monotonic() + timeout
    while True:
        dumps = [await dump(r.address) for r in cluster.routers if r.alive]
        if all(d == dumps[0] for d in dumps):
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.5)


def _etcd_fault(kind: str) -> Scenario:
    async def scenario(run: Run) -> None:
        cluster = await _standard_layout(run)
        await run.load(run.args.duration / 2)
        if kind == "kill":
            await asyncio.to_thread(cluster.move_etcd_leader, 0)
            cluster.kill_etcd_member(0)
            run.report.notes["fault"] = (
                f"kill -9 of etcd member 1 of 3 (leader, every daemon's endpoint), {run.args.outage:g} s"
            )
        elif kind == "minority":
            cluster.isolate_etcd_member(0, clients=False)
            run.report.notes["fault"] = f"etcd member 1 of 3 cut from its peers for {run.args.outage:g} s"
        else:
            cluster.isolate_etcd_member(1)
            cluster.isolate_etcd_member(2)
            run.report.notes["fault"] = f"etcd members 2 and 3 of 3 cut from everything for {run.args.outage:g} s"
        await run.load(run.args.outage)
        cluster.heal()
        if kind == "kill":
            await asyncio.to_thread(cluster.restart_etcd_member, 0)
        await run.load(run.args.duration / 2)

    return scenario


SCENARIOS: dict[str, tuple[str, Scenario]] = {
    "worker-kill-2": ("kill -9 a worker with 2 engines (of 2 workers) under load", _kill_worker(2)),
    "worker-kill-4": ("kill -9 a worker with 4 engines (of 2 workers) under load", _kill_worker(4)),
    "router-kill": ("kill -9 one of two router replicas under load", _kill_router),
    "etcd-outage": ("stop etcd for --outage seconds under load, then start it again", _etcd("stop")),
    "etcd-frozen": ("SIGSTOP etcd for --outage seconds under load, then SIGCONT", _etcd("freeze")),
    "overload": ("a burst of --burst requests at --concurrency on 2 engines with --max-num-seqs 8", _overload),
    "overload-open": ("open-loop --rate beyond what 2 engines with --max-num-seqs 8 serve", _overload_open),
    "cancel": ("half the requests cancelled at a random token", _cancel),
    "soak": ("steady load, no fault (memory and leaks over time)", _soak),
    "partition-worker-router": (
        "multihost: worker1 cut from router1 for --outage s",
        _partition("worker1", "router1", "worker1 cut from router1 (not from frontends, etcd)"),
    ),
    "partition-frontend-router": (
        "multihost: frontend1 (the load's) cut from router1 for --outage s",
        _partition("frontend1", "router1", "frontend1 cut from router1"),
    ),
    "partition-worker-etcd": (
        "multihost: worker1 cut from every etcd member for --outage s",
        _partition("worker1", ["etcd1", "etcd2", "etcd3"], "worker1 cut from etcd only"),
    ),
    "partition-routers": (
        "multihost: router1 cut from router2 (replica sync) for --outage s, then index dumps compared",
        _partition("router1", "router2", "router1 cut from router2"),
    ),
    "etcd-member-kill": ("multihost: kill -9 the etcd leader (1 of 3) for --outage s", _etcd_fault("kill")),
    "etcd-minority": ("multihost: one etcd member cut from its peers for --outage s", _etcd_fault("minority")),
    "etcd-majority": ("multihost: two etcd members of 3 cut off for --outage s", _etcd_fault("majority")),
}
"""Scenario name -> (help, coroutine). Other fault kinds (fuzzed or oversized inputs) register here."""


async def run_scenario(args: argparse.Namespace, workdir: Path) -> Report:
    """Run one scenario in ``workdir`` and return its report (the mesh is always torn down)."""
    mesh: Mesh | MultiHostMesh
    if args.topology == "multihost":
        mesh = MultiHostMesh(workdir, args.lease_ttl, args.daemon_log_level, shlex.split(args.frontend_flags))
    else:
        mesh = Mesh(workdir, args.lease_ttl, args.daemon_log_level, shlex.split(args.frontend_flags))
    try:
        await asyncio.to_thread(mesh.etcd.start)
    except BaseException:
        await asyncio.to_thread(mesh.close)
        raise
    run = Run(mesh, args)
    try:
        _help, scenario = SCENARIOS[args.scenario]
        await scenario(run)
        if "middle" not in run.report.rss_mib:
            run.sample_rss("middle")
        await run.drain()
        run._stop_background.set()
        if run._background_task is not None:
            await asyncio.wait([run._background_task], timeout=60)
        await run.settle_leaks()
        run.report.migrations = mesh.metric_sum("frontend", "kvmesh_frontend_migrations_total")
        if run._counts_at_start:
            counts = await run.request_counts()
            delta = {k: v - run._counts_at_start[k] for k, v in counts.items()}
            run.report.refused_at_entry = delta["refused"]
            run.report.admitted = delta["finished"] - delta["refused"]
            run.report.router_decisions = delta["decisions"]
            # per kind, the daemons alive at the end (one killed meanwhile took its figure with it)
            for (kind, pid), cpu_now in mesh.cpu().items():
                used = cpu_now - run._cpu_at_start.get((kind, pid), 0.0)
                run.report.cpu_s[kind] = round(run.report.cpu_s.get(kind, 0.0) + used, 2)
        run.sample_rss("end")
        report = run.report
        report.ok = run.statuses.pop("ok", 0)
        report.cancelled = run.statuses.pop("cancelled", 0)
        report.failures = dict(run.statuses)
        if run.ttft:
            report.notes["TTFT of ok requests p50 / p99"] = _p50_p99(run.ttft)
        for name, seconds in run.failure_latency.items():
            report.notes[f"{name} latency p50 / p99"] = _p50_p99(seconds)
        if isinstance(mesh, MultiHostMesh):
            lost = sum(d.log_text().count(" lost: ") for d in mesh.procs)
            report.notes["leases lost (daemon logs)"] = lost
        report.background_requests = sum(run.background.values())
        report.background_failures = {k: v for k, v in run.background.items() if k != "ok"}
        return report
    finally:
        if run.channel is not None:
            await run.channel.close()
        await asyncio.to_thread(mesh.close)


def _p50_p99(seconds: list[float]) -> str:
    ordered = sorted(seconds)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000  # noqa: E731
    return f"{pick(0.5):.0f} ms / {pick(0.99):.0f} ms"


def options(scenario: str, **overrides: Any) -> argparse.Namespace:
    """The defaults of ``kvmesh bench chaos --scenario NAME`` with ``overrides`` (for the tests)."""
    args = parser().parse_args(["--scenario", scenario])
    for key, value in overrides.items():
        if not hasattr(args, key):
            raise TypeError(f"unknown chaos option {key!r}")
        setattr(args, key, value)
    return args


def parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="kvmesh bench chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", choices=sorted(SCENARIOS), help="the fault to inject")
    p.add_argument(
        "--topology",
        choices=("loopback", "multihost"),
        default="loopback",
        help="loopback: every daemon on 127.0.0.1; multihost: each on its own network namespace, 3-member etcd "
        "(root; docs/reliability.md)",
    )
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--duration", type=positive_float, default=20.0, help="seconds of load (soak: its length)")
    p.add_argument("--rate", type=positive_float, default=4.0, help="requests per second")
    p.add_argument("--tokens", type=positive_int, default=48, help="tokens per request")
    p.add_argument("--background-tokens", type=positive_int, default=200, help="tokens per background-stream request")
    p.add_argument("--speedup", type=positive_float, default=4.0, help="mocker --speedup-ratio (1 = real-time vLLM)")
    p.add_argument("--lease-ttl", type=positive_float, default=10.0, help="every daemon's --lease-ttl")
    p.add_argument(
        "--outage", type=positive_float, default=60.0, help="etcd-outage / etcd-frozen: seconds etcd is down"
    )
    p.add_argument("--burst", type=positive_int, default=2000, help="overload: requests in the burst")
    p.add_argument("--concurrency", type=positive_int, default=500, help="overload: requests in flight")
    p.add_argument(
        "--frontend-flags",
        default="",
        help="extra flags of the frontend, one string (e.g. --frontend-flags='--admission-factor 0')",
    )
    p.add_argument("--daemon-log-level", default="info", help="every daemon's --log-level (logs kept with --keep)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (daemon logs)")
    p.add_argument("--json", type=output_file, help="also write the report as JSON here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.list or not args.scenario:
        for name, (text, _) in SCENARIOS.items():
            print(f"{name:15} {text}")
        return 0
    if args.topology == "multihost" and (problem := missing_requirements()):
        print(f"kvmesh bench chaos: {problem}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix=f"kvmesh-chaos-{args.scenario}-"))
    try:
        report = asyncio.run(run_scenario(args, workdir))
    except NeedsMultihost as exc:
        print(f"kvmesh bench chaos: {exc}", file=sys.stderr)
        return 2
    finally:
        if args.keep:
            print(f"logs: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(report.table())
    if args.json:
        write_json(args.json, asdict(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
