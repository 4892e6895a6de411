"""``kvmesh up``: the whole mesh on one machine — a frontend, a router and a worker process.

It runs exactly what production runs (the three console scripts, as systemd would), wired through
the embedded file discovery so no server is needed, waits until the frontend reports ServerReady
and a request gets routed, sends one streamed demo request so you see the mesh work, and stops
everything on Ctrl-C (or when the terminal closes).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path

import grpc
from kvmesh.children import dies_with_parent
from kvmesh.settings import DaemonSettings, default_discovery_url, is_setting_variable
from kvmesh_bench.argtypes import non_negative_int, positive_float, positive_int, tcp_port
from kvmesh_frontend.settings import Settings as FrontendSettings
from kvmesh_router.settings import Settings as RouterSettings
from kvmesh_worker.settings import Settings as WorkerSettings

from kvmesh_cli import planner as up_planner
from kvmesh_cli.kserve_demo import demo_request, served_models, server_ready
from kvmesh_cli.up_tls import add_tls_argument, daemon_tls_args, kserve_credentials, prepare_tls, tls_dir_missing
from kvmesh_cli.vllm_cores import keep_off_model_cores, worker_environments

EXAMPLE = """\
import tritonclient.grpc as grpcclient, numpy as np
client = grpcclient.InferenceServerClient("localhost:{port}")
inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("stream", [1], "BOOL"),
          grpcclient.InferInput("sampling_parameters", [1], "BYTES")]
inputs[0].set_data_from_numpy(np.array([b"Tell me about KV caches"], dtype=object))
inputs[1].set_data_from_numpy(np.array([True]))
inputs[2].set_data_from_numpy(np.array([b'{{"max_tokens": 16}}'], dtype=object))
client.start_stream(callback=lambda result, error: print(error or result.as_numpy("text_output")))
client.async_stream_infer("{model}", inputs, enable_empty_final_response=True)
client.stop_stream()"""


# What `kvmesh up` starts, and the settings each declares (defaults and choices below come from them).
DAEMONS: dict[str, type[DaemonSettings]] = {
    "kvmesh-worker": WorkerSettings,
    "kvmesh-router": RouterSettings,
    "kvmesh-frontend": FrontendSettings,
    "kvmesh-planner": up_planner.PlannerSettings,
}


def _default(cls: type[DaemonSettings], name: str) -> object:
    return cls.model_fields[name].get_default(call_default_factory=True)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "up", help="run a local mesh: frontend + router + worker (mocker or vLLM engines)", description=__doc__
    )
    # Always passed (they override --config): up probes the port, and a local mesh gets its own namespace.
    p.add_argument("--grpc-port", type=tcp_port, default=8001, help="frontend KServe gRPC port (default: 8001)")
    p.add_argument(
        "--engine",
        default="mocker",
        help="the worker's engine: mocker, vllm (run kvmesh from .venv-vllm: make setup-vllm) or module:factory",
    )
    p.add_argument(
        "--num-engines",
        type=positive_int,
        default=None,
        help="engines in the worker (default: 2 mockers, 1 vLLM engine)",
    )
    p.add_argument(
        "--vllm-engine-args",
        metavar="JSON",
        help='--engine vllm: vLLM engine arguments as a JSON object, e.g. \'{"load_format": "dummy"}\'',
    )
    # Passed only when given, so --config or the daemon's own default applies otherwise.
    p.add_argument(
        "--router-mode",
        choices=typing.get_args(RouterSettings.model_fields["mode"].annotation),
        help="how the router picks an engine: kv = most prompt blocks already cached, least load (KV-aware); "
        "round_robin, random, power_of_two = least loaded of two random engines "
        f"(default: the router's, {_default(RouterSettings, 'mode')})",
    )
    p.add_argument(
        "--block-size",
        type=positive_int,
        help=f"tokens per KV block (default: the worker's, {_default(WorkerSettings, 'block_size')})",
    )
    p.add_argument(
        "--speedup-ratio",
        type=float,
        help=f"mocker speed, 0 = no sleeping (default: the worker's, {_default(WorkerSettings, 'speedup_ratio')})",
    )
    p.add_argument("--config", metavar="FILE", help="TOML file given to every daemon ([common], [worker], ...)")
    # Disaggregated prefill/decode (docs/disaggregation.md): instead of the aggregated worker, P prefill and
    # D decode worker processes of one engine each.
    p.add_argument(
        "--prefill-workers",
        type=non_negative_int,
        default=0,
        help="prefill worker processes (default: 0); with --planner: the prefill pool's minimum",
    )
    p.add_argument(
        "--decode-workers",
        type=non_negative_int,
        default=0,
        help="decode worker processes (default: 0 = aggregated); with --planner: the decode pool's minimum",
    )
    p.add_argument("--model-path", default=None, help="HF-style model dir (default: built-in kvmesh-mock)")
    p.add_argument("--discovery", default=None, help="discovery URL (default: the per-user file backend)")
    p.add_argument("--namespace", default="kvmesh-local", help="discovery namespace (default: kvmesh-local)")
    p.add_argument(
        "--log-dir", default=None, help="where daemon logs go (default: a temp dir, removed after a clean stop)"
    )
    p.add_argument(
        "--otel-exporter",
        choices=typing.get_args(DaemonSettings.model_fields["otel_exporter"].annotation),
        help="OpenTelemetry traces of every daemon: console (to each daemon's log), otlp, none "
        f"(default: the daemons', {_default(DaemonSettings, 'otel_exporter')})",
    )
    p.add_argument(
        "--metrics-port-base",
        type=tcp_port,
        metavar="PORT",
        help="Prometheus /metrics on PORT (worker), PORT+1 (router), PORT+2 (frontend) (default: none)",
    )
    p.add_argument("--no-demo", action="store_true", help="do not send the demo request")
    p.add_argument(
        "--share-model-cores",
        action="store_true",
        help="let the daemons run on the cores vLLM binds its model to (default: once the mesh is up, they "
        "move to the cores vLLM leaves over)",
    )
    add_tls_argument(p)
    p.add_argument(
        "--ready-timeout",
        type=positive_float,
        default=None,
        help="seconds to wait for ServerReady (default: 60, vLLM 240)",
    )
    up_planner.add_up_flags(p)
    p.set_defaults(func=run)


def _cores(cores: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cores))


def _port_taken(port: int) -> bool:
    """Whether something already accepts connections on ``port`` (then our frontend could not bind)."""
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0


_SPAWNED: dict[int, tuple[str, Path, int]] = {}
"""Each spawned daemon by pid: its program, its log file and where its lines of this run start (P/D workers log
to one file each)."""


def _why(proc: subprocess.Popen[bytes]) -> str:
    """A dead daemon's own last word: its ``error:`` line, else the last line of its log."""
    name, log_path, start = _SPAWNED[proc.pid]
    try:
        with open(log_path, "rb") as log:
            log.seek(start)
            lines = [line for line in log.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    said = next((line for line in reversed(lines) if f"{name}: error:" in line), lines[-1] if lines else "")
    return f"{name} exited with {proc.returncode}" + (f": {said.strip()}" if said else "")


def _routable(
    address: str, model: str, credentials: grpc.ChannelCredentials | None, disaggregated: bool = False
) -> bool:
    """Whether a request gets routed yet (ServerReady says only that an engine is live: the router
    may still be registering). "kvmesh is up" must mean a client's first request works; with prefill
    workers, that it gets a remote prefill (a vLLM prefill engine may come up well after the decode one)."""
    try:
        outcome = demo_request(address, model, max_tokens=1, credentials=credentials)
    except grpc.RpcError:
        return False
    if outcome.startswith(("demo request failed: UNAVAILABLE", "demo request failed: NOT_FOUND")):
        return False
    return not (disaggregated and "no prefill engine" in outcome)  # the frontend's kvmesh.disagg reason


def _spawn(
    name: str, args: list[str], log_dir: Path, log_name: str | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start daemon ``name``; it gets the ``KVMESH_*`` variables it declares, not the other daemons', and
    ``env``."""
    exe = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if exe is None:
        raise FileNotFoundError(f"{name} is not installed (run `make setup`)")
    own = DAEMONS[name].variables()
    log_path = log_dir / f"{log_name or name}.log"
    log = open(log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
    start = log.tell()  # a reused --log-dir keeps earlier runs' lines; this run's start here
    proc = subprocess.Popen(
        dies_with_parent([exe, *args]),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        # Its own process group (the terminal's Ctrl-C reaches only kvmesh up, which drains the daemons),
        # but not its own session: Linux autogroup schedules each session as one group, and a vLLM
        # worker in a session of its own held its tokens back until requests finished (docs/benchmarks.md,
        # "Overhead of the mesh").
        process_group=0,
        env={
            **{var: value for var, value in os.environ.items() if not is_setting_variable(var) or var in own},
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        },
    )
    _SPAWNED[proc.pid] = (name, log_path, start)
    return proc


def _drain_wait_s() -> float:
    """How long the daemons may take to stop: their drain (``KVMESH_DRAIN_TIMEOUT``, else the default) and
    15 s to leave after it. A fixed 15 s cut a request that the daemons' 30 s drain was finishing."""
    drain = DaemonSettings.model_fields["drain_timeout"].default
    with contextlib.suppress(ValueError):  # a bad value is refused by the daemons themselves
        drain = float(os.environ.get("KVMESH_DRAIN_TIMEOUT", drain))
    return drain + 15.0 if math.isfinite(drain) else 45.0


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM: each daemon drains. A second Ctrl-C sends SIGTERM again, on which each daemon cancels
    what it still serves and leaves at once, its lease revoked (a SIGKILL would leave it to expire).
    SIGKILL whatever still runs after its drain and 15 s (:func:`_drain_wait_s`), 5 s after a second
    Ctrl-C, or at once on a third; saying which.

    Ctrl-C only counts here (no KeyboardInterrupt): one raised inside ``Popen.wait`` could leave its
    internal lock taken, and every later wait then hung for good (seen once in five double Ctrl-Cs)."""
    presses = [0]
    previous = signal.signal(signal.SIGINT, lambda *_: presses.__setitem__(0, presses[0] + 1))
    try:
        _signal(procs, signal.SIGTERM)
        if not _wait(procs, _drain_wait_s(), presses):
            print("kvmesh up: second Ctrl-C: cancelling what the daemons still serve", file=sys.stderr, flush=True)
            _signal(procs, signal.SIGTERM)
            if not _wait(procs, 5, presses):
                print("kvmesh up: third Ctrl-C: killing the daemons", file=sys.stderr, flush=True)
        if left := [proc for proc in procs if proc.poll() is None]:
            names = ", ".join(_SPAWNED.get(proc.pid, (str(proc.pid),))[0] for proc in left)
            print(f"kvmesh up: killing what has not stopped: {names}", file=sys.stderr, flush=True)
        for proc in left:
            proc.kill()
        _wait(procs, 5, [0])
    finally:
        signal.signal(signal.SIGINT, previous)


def _signal(procs: list[subprocess.Popen[bytes]], sig: signal.Signals) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(sig)


def _wait(procs: list[subprocess.Popen[bytes]], seconds: float, presses: list[int]) -> bool:
    """Until every process ended or ``seconds`` passed (True), or a Ctrl-C came meanwhile (False)."""
    deadline, seen = time.monotonic() + seconds, presses[0]
    while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
        if presses[0] != seen:
            return False
        time.sleep(0.05)
    return presses[0] == seen


def _serve_until_stopped(procs: list[subprocess.Popen[bytes]], stop: dict[str, bool]) -> subprocess.Popen[bytes] | None:
    """Watch the daemons until a stop is asked (None) or one fails (it is returned, the mesh stops).

    A worker that exits 0 was drained (``kvmesh drain``, or a SIGTERM of its own): it left on purpose,
    its requests finished or migrated, so the rest of the mesh serves on. Any other exit, and a router,
    frontend or planner leaving at all, ends the mesh: nothing here would replace them."""
    left: set[int] = set()
    while not stop["now"]:
        for proc in procs:
            if proc.pid in left or proc.poll() is None:
                continue
            if proc.returncode != 0 or _SPAWNED[proc.pid][0] != "kvmesh-worker":
                return proc
            left.add(proc.pid)
            workers = [p for p in procs if _SPAWNED[p.pid][0] == "kvmesh-worker" and p.pid not in left]
            rest = (
                f"{len(workers)} worker(s) serve on"
                if workers
                else "no worker is left: requests fail UNAVAILABLE (Ctrl-C stops the mesh)"
            )
            print(f"kvmesh up: {_SPAWNED[proc.pid][1].stem} drained and left; {rest}", file=sys.stderr, flush=True)
        time.sleep(0.2)
    return None


def _ignored_flags(args: argparse.Namespace) -> str | None:
    """A flag the chosen layout would ignore (then refused, not silently dropped), else None; fills in the
    planner flags' defaults."""
    if args.num_engines is not None and (args.planner or args.decode_workers):
        return (
            "--num-engines: with --planner or --decode-workers every worker process runs one engine "
            "(size the pools with --max-engines, --decode-workers and --prefill-workers)"
        )
    if not args.planner:
        given = [f for f, v in (("--min-engines", args.min_engines), ("--max-engines", args.max_engines)) if v]
        given += ["--planner-args"] if args.planner_args else []
        if given:
            return f"{given[0]} needs --planner"
    args.min_engines = args.min_engines or 1
    args.max_engines = args.max_engines or 4
    return None


def run(args: argparse.Namespace) -> int:
    known = frozenset().union(*(settings.variables() for settings in DAEMONS.values()))
    stray = sorted(var for var in os.environ if is_setting_variable(var) and var not in known)
    if stray:  # meant for a daemon, known to none: a typo must not be silently dropped
        print(f"kvmesh up: error: {stray[0]}: unknown setting (environment)", file=sys.stderr)
        return 2
    if _port_taken(args.grpc_port):  # before anything starts: the demo must never reach another server
        print(
            f"kvmesh up: error: --grpc-port {args.grpc_port}: the port is already in use by another process "
            "(stop it, or pick a free port with --grpc-port)",
            file=sys.stderr,
        )
        return 2
    if args.metrics_port_base is not None and args.metrics_port_base + len(DAEMONS) - 1 > 65535:
        print(
            f"kvmesh up: error: --metrics-port-base {args.metrics_port_base}: the daemons' ports pass 65535",
            file=sys.stderr,
        )
        return 2
    if args.tls and (missing := tls_dir_missing(Path(args.tls))):
        print(f"kvmesh up: error: --tls {args.tls}: {missing} (make one with kvmesh certs init DIR)", file=sys.stderr)
        return 2
    vllm = args.engine == "vllm"
    if vllm and not args.model_path:  # every check of the arguments before anything is made on disk
        print("kvmesh up: error: --engine vllm needs --model-path DIR", file=sys.stderr)
        return 2
    if args.prefill_workers and not args.decode_workers:
        print("kvmesh up: error: --prefill-workers needs --decode-workers", file=sys.stderr)
        return 2
    if problem := _ignored_flags(args):
        print(f"kvmesh up: error: {problem}", file=sys.stderr)
        return 2
    temporary = args.log_dir is None
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvmesh-up-"))
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"kvmesh up: error: --log-dir {log_dir}: {exc.strerror}", file=sys.stderr)
        return 2
    try:  # a directory that exists but takes no file (/sys/..., /proc/...) failed at the first daemon's log
        with tempfile.TemporaryFile(dir=log_dir):
            pass
    except OSError as exc:
        print(f"kvmesh up: error: --log-dir {log_dir}: cannot write there ({exc.strerror})", file=sys.stderr)
        return 2
    common = ["--discovery", args.discovery or default_discovery_url(), "--namespace", args.namespace]
    common += ["--bind-host", "127.0.0.1"]  # a local mesh is reachable from this machine only
    if args.config:
        common += ["--config", args.config]
    engines_from_config = args.num_engines is None and args.config is not None  # [worker] num-engines, else 1
    if args.num_engines is None:
        args.num_engines = 1 if vllm else 2
    if args.ready_timeout is None:
        args.ready_timeout = 240.0 if vllm else 60.0  # vLLM starts in 13-50 s on 2 cores
    if args.otel_exporter:
        common += ["--otel-exporter", args.otel_exporter]
    metrics = {}
    if args.metrics_port_base is not None:
        metrics = {name: args.metrics_port_base + i for i, name in enumerate(DAEMONS)}
    worker_args = [*common, "--engine", args.engine]
    if args.vllm_engine_args:
        worker_args += ["--vllm-engine-args", args.vllm_engine_args]
    if args.block_size is not None:
        worker_args += ["--block-size", str(args.block_size)]
    if args.speedup_ratio is not None:
        worker_args += ["--speedup-ratio", str(args.speedup_ratio)]
    router_args = [*common] + (["--router-mode", args.router_mode] if args.router_mode else [])
    if args.model_path:
        worker_args += ["--model-path", args.model_path]
    frontend_args = [*common, "--grpc-port", str(args.grpc_port)]
    if "kvmesh-router" in metrics:
        router_args += ["--metrics-port", str(metrics["kvmesh-router"])]
    if "kvmesh-frontend" in metrics:
        frontend_args += ["--metrics-port", str(metrics["kvmesh-frontend"])]
    # Worker processes: the first gets the worker's port of the base; further P/D workers the ports after
    # the three daemons' (base+3, base+4, ...), so that no two processes clash.
    worker_ports = iter(
        [metrics["kvmesh-worker"], *range(args.metrics_port_base + len(DAEMONS), 65536)]
        if args.metrics_port_base is not None
        else []
    )

    worker_metrics: list[int] = []  # every worker process's /metrics port, in start order

    def worker(extra: list[str]) -> list[str]:
        port = next(worker_ports, None)
        if port is not None:
            worker_metrics.append(port)
        return [*worker_args, *extra, *(["--metrics-port", str(port)] if port is not None else [])]

    procs: list[subprocess.Popen[bytes]] = []
    stop = {"now": False}
    # SIGHUP: the terminal closed. Stop the mesh like Ctrl-C instead of orphaning live daemons.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda *_: stop.update(now=True))
    clean = False
    tls_dir, made_tls = None, False
    try:
        tls_dir, made_tls = prepare_tls(args)
        credentials = kserve_credentials(tls_dir)
        worker_args += daemon_tls_args(tls_dir, "worker")
        router_args += daemon_tls_args(tls_dir, "router")
        frontend_args += daemon_tls_args(tls_dir, "frontend")
        if args.planner:  # the planner starts (and stops) the workers itself, one engine each
            planner_argv = up_planner.planner_argv(args, common, worker_args) + daemon_tls_args(tls_dir, "planner")
            if "kvmesh-planner" in metrics:
                planner_argv += ["--metrics-port", str(metrics["kvmesh-planner"])]
            procs.append(_spawn("kvmesh-planner", planner_argv, log_dir))
        elif args.decode_workers:
            # several vLLM engines on one machine: each gets its own cores (see kvmesh_cli.vllm_cores)
            envs = iter(worker_environments(args.decode_workers + args.prefill_workers) if vllm else [])
            for role, count in (("decode", args.decode_workers), ("prefill", args.prefill_workers)):
                for i in range(count):
                    role_args = worker(["--num-engines", "1", "--role", role])
                    name = f"kvmesh-worker-{role}-{i}"
                    procs.append(_spawn("kvmesh-worker", role_args, log_dir, name, env=next(envs, None)))
        else:
            engines = [] if engines_from_config else ["--num-engines", str(args.num_engines)]
            procs.append(_spawn("kvmesh-worker", worker(engines), log_dir))
        procs.append(_spawn("kvmesh-router", router_args, log_dir))
        procs.append(_spawn("kvmesh-frontend", frontend_args, log_dir))
        address = f"127.0.0.1:{args.grpc_port}"
        model = "kvmesh-mock" if not args.model_path else Path(args.model_path).name
        deadline = time.monotonic() + args.ready_timeout
        while True:
            # Our own children first: a ServerReady from the port proves nothing if ours is dead.
            dead = [p for p in procs if p.poll() is not None]
            if dead or stop["now"] or time.monotonic() > deadline:
                if stop["now"]:
                    clean = True
                    return 0
                why = _why(dead[0]) if dead else f"not ready within {args.ready_timeout:g}s"
                print(f"kvmesh up: error: mesh not ready ({why}); logs in {log_dir}", file=sys.stderr)
                return 2 if dead and dead[0].returncode == 2 else 1
            if server_ready(address, credentials=credentials) and all(p.poll() is None for p in procs):
                served = served_models(address, credentials=credentials)
                if model not in served and len(served) == 1:  # named otherwise by --config (served-model-name)
                    model = served[0]
                if _routable(address, model, credentials, disaggregated=bool(args.prefill_workers)):
                    break
            time.sleep(0.2)
        # The planner's later workers would inherit a confined affinity, and vLLM picks its cores from it.
        split = (
            None if not vllm or args.planner or args.share_model_cores else keep_off_model_cores([p.pid for p in procs])
        )
        print(
            f"kvmesh is up: KServe gRPC on localhost:{args.grpc_port}, model {model!r}, "
            + (
                f"{args.engine} engines started by the planner"
                if args.planner
                else f"{args.prefill_workers} prefill + {args.decode_workers} decode worker(s)"
                if args.decode_workers
                else f"{args.engine} engines as --config sets"
                if engines_from_config
                else f"{args.num_engines} {args.engine} engine(s)"
            )
            + f"; logs in {log_dir}; "
            f"Ctrl-C stops it.",
            flush=True,
        )
        if split is not None:
            model_cores, serving = split
            print(
                f"vLLM's model runs on cores {_cores(model_cores)}; the daemons moved to {_cores(serving)} "
                "(--share-model-cores keeps them everywhere)",
                flush=True,
            )
        if metrics:  # what listens: the planner's workers have none, and a planner runs only with --planner
            listening = [("worker", p) for p in worker_metrics]  # P/D: one per worker process
            listening += [(n.removeprefix("kvmesh-"), p) for n, p in metrics.items() if n != "kvmesh-worker"]
            if not args.planner:
                listening = [(n, p) for n, p in listening if n != "planner"]
            where = ", ".join(f"{n} http://localhost:{p}/metrics" for n, p in listening)
            print(f"Prometheus metrics: {where}", flush=True)
        example = EXAMPLE.format(port=args.grpc_port, model=model)
        if tls_dir is not None:  # stock tritonclient over TLS: the mesh CA verifies the frontend
            example = example.replace(
                ")\ninputs", f", ssl=True, root_certificates={str(tls_dir / 'ca.crt')!r})\ninputs", 1
            )
        print("\nTry it with tritonclient:\n" + example + "\n", flush=True)
        # quoted: the commands are printed to be pasted into a shell (a discovery path with a space broke them)
        where = "" if args.namespace == "kvmesh-local" else f" --namespace {shlex.quote(args.namespace)}"
        where += f" --discovery {shlex.quote(args.discovery)}" if args.discovery else ""
        operator = perf_tls = ""
        if tls_dir is not None:  # the operator certificate for the mesh's ports, the CA for the frontend's
            cert, key, ca = (str(tls_dir / name) for name in ("operator.crt", "operator.key", "ca.crt"))
            operator = " " + shlex.join(["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca])
            perf_tls = " -- --ssl-grpc-use-ssl " + shlex.quote(f"--ssl-grpc-root-certifications-file={ca}")
        print(
            f"Benchmark it (make perf-tools): kvmesh model files {model} --out ./tok{where}{operator} && genai-perf "
            f"profile -m {model} --endpoint-type kserve --backend vllm --streaming -u localhost:{args.grpc_port} "
            f"--tokenizer ./tok{perf_tls}\n",
            flush=True,
        )
        if args.planner:
            flags = f" --namespace {shlex.quote(args.namespace)}"
            flags += f" --discovery {shlex.quote(args.discovery)}" if args.discovery else ""
            print(f"Watch the planner: kvmesh planner status{flags}{operator}\n", flush=True)
        if not args.no_demo:
            # ServerReady means an engine is live; the router may still be warming up for a moment.
            outcome = demo_request(address, model, credentials=credentials)
            while outcome.startswith("demo request failed: UNAVAILABLE") and time.monotonic() < deadline + 30:
                time.sleep(0.5)
                outcome = demo_request(address, model, credentials=credentials)
            print(outcome, flush=True)
        if (failed := _serve_until_stopped(procs, stop)) is not None:
            print(f"kvmesh up: {_why(failed)}; logs in {log_dir}", file=sys.stderr)
            return 1
        clean = True
        return 0
    except KeyboardInterrupt:
        clean = True
        return 0
    except FileNotFoundError as exc:
        print(f"kvmesh up: error: {exc}", file=sys.stderr)
        return 2
    finally:
        print("kvmesh up: stopping...", file=sys.stderr, flush=True)
        _stop(procs)
        if temporary and clean:  # a failed run keeps its logs: the error message points at them
            shutil.rmtree(log_dir, ignore_errors=True)
        if made_tls and tls_dir is not None:  # keys never outlive the run, failed or not, whatever --log-dir
            shutil.rmtree(tls_dir, ignore_errors=True)
