"""``kvmesh up``: the whole mesh on one machine — a frontend, a router and a worker process.

It runs exactly what production runs (the three console scripts, as systemd would), wired through
the embedded file discovery so no server is needed, waits until the frontend reports ServerReady,
sends one streamed demo request so you see the mesh work, and stops everything on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path

from kvmesh.settings import DaemonSettings, default_discovery_url, is_setting_variable
from kvmesh_frontend.settings import Settings as FrontendSettings
from kvmesh_router.settings import Settings as RouterSettings
from kvmesh_worker.settings import Settings as WorkerSettings

from kvmesh_cli import planner as up_planner
from kvmesh_cli.kserve_demo import demo_request, server_ready

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
        "up", help="run a local mesh: frontend + router + worker (mocker engines)", description=__doc__
    )
    # Always passed (they override --config): up probes the port, and a local mesh gets its own namespace.
    p.add_argument("--grpc-port", type=int, default=8001, help="frontend KServe gRPC port (default: 8001)")
    p.add_argument("--num-engines", type=int, default=2, help="mocker engines in the worker (default: 2)")
    # Passed only when given, so --config or the daemon's own default applies otherwise.
    p.add_argument(
        "--router-mode",
        choices=typing.get_args(RouterSettings.model_fields["mode"].annotation),
        help=f"routing mode (default: the router's, {_default(RouterSettings, 'mode')})",
    )
    p.add_argument(
        "--block-size",
        type=int,
        help=f"tokens per KV block (default: the worker's, {_default(WorkerSettings, 'block_size')})",
    )
    p.add_argument(
        "--speedup-ratio",
        type=float,
        help=f"mocker speed, 0 = no sleeping (default: the worker's, {_default(WorkerSettings, 'speedup_ratio')})",
    )
    p.add_argument("--config", metavar="FILE", help="TOML file given to every daemon ([common], [worker], ...)")
    p.add_argument("--model-path", default=None, help="HF-style model dir (default: built-in kvmesh-mock)")
    p.add_argument("--discovery", default=None, help="discovery URL (default: the per-user file backend)")
    p.add_argument("--namespace", default="kvmesh-local", help="discovery namespace (default: kvmesh-local)")
    p.add_argument("--log-dir", default=None, help="where daemon logs go (default: a temp dir)")
    p.add_argument("--no-demo", action="store_true", help="do not send the demo request")
    p.add_argument("--ready-timeout", type=float, default=60.0, help="seconds to wait for ServerReady")
    up_planner.add_up_flags(p)
    p.set_defaults(func=run)


def _spawn(name: str, args: list[str], log_dir: Path) -> subprocess.Popen[bytes]:
    """Start daemon ``name``; it gets the ``KVMESH_*`` variables it declares, not the other daemons'."""
    exe = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if exe is None:
        raise FileNotFoundError(f"{name} is not installed (run `make setup`)")
    own = DAEMONS[name].variables()
    log = open(log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child for its lifetime
    return subprocess.Popen(
        [exe, *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={
            **{var: value for var, value in os.environ.items() if not is_setting_variable(var) or var in own},
            "PYTHONUNBUFFERED": "1",
        },
    )


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(args: argparse.Namespace) -> int:
    known = frozenset().union(*(settings.variables() for settings in DAEMONS.values()))
    stray = sorted(var for var in os.environ if is_setting_variable(var) and var not in known)
    if stray:  # meant for a daemon, known to none: a typo must not be silently dropped
        print(f"kvmesh up: error: {stray[0]}: unknown setting (environment)", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvmesh-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    common = ["--discovery", args.discovery or default_discovery_url(), "--namespace", args.namespace]
    if args.config:
        common += ["--config", args.config]
    worker_args = [*common, "--num-engines", str(args.num_engines)]
    if args.block_size is not None:
        worker_args += ["--block-size", str(args.block_size)]
    if args.speedup_ratio is not None:
        worker_args += ["--speedup-ratio", str(args.speedup_ratio)]
    router_args = [*common] + (["--router-mode", args.router_mode] if args.router_mode else [])
    if args.model_path:
        worker_args += ["--model-path", args.model_path]
    procs: list[subprocess.Popen[bytes]] = []
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    try:
        if args.planner:  # the planner starts (and stops) the workers itself
            procs.append(_spawn("kvmesh-planner", up_planner.planner_argv(args, common, worker_args), log_dir))
        else:
            procs.append(_spawn("kvmesh-worker", worker_args, log_dir))
        procs.append(_spawn("kvmesh-router", router_args, log_dir))
        procs.append(_spawn("kvmesh-frontend", [*common, "--grpc-port", str(args.grpc_port)], log_dir))
        address = f"127.0.0.1:{args.grpc_port}"
        deadline = time.monotonic() + args.ready_timeout
        while not server_ready(address):
            dead = [p for p in procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{Path(dead[0].args[0]).name} exited with {dead[0].returncode}" if dead else "timed out"
                print(f"kvmesh up: error: mesh not ready ({why}); logs in {log_dir}", file=sys.stderr)
                return 1
            time.sleep(0.2)
        model = "kvmesh-mock" if not args.model_path else Path(args.model_path).name
        print(
            f"kvmesh is up: KServe gRPC on localhost:{args.grpc_port}, model {model!r}, "
            f"{args.num_engines} mocker engine(s); logs in {log_dir}; "
            f"Ctrl-C stops it.",
            flush=True,
        )
        print("\nTry it with tritonclient:\n" + EXAMPLE.format(port=args.grpc_port, model=model) + "\n", flush=True)
        if not args.no_demo:
            # ServerReady means an engine is live; the router may still be warming up for a moment.
            outcome = demo_request(address, model)
            while outcome.startswith("demo request failed: UNAVAILABLE") and time.monotonic() < deadline + 30:
                time.sleep(0.5)
                outcome = demo_request(address, model)
            print(outcome, flush=True)
        while not stop["now"] and all(p.poll() is None for p in procs):
            time.sleep(0.2)
        dead = [p for p in procs if p.poll() is not None]
        if dead and not stop["now"]:
            print(
                f"kvmesh up: {Path(dead[0].args[0]).name} exited with {dead[0].returncode}; logs in {log_dir}",
                file=sys.stderr,
            )
            return 1
        return 0
    except KeyboardInterrupt:
        return 0
    except FileNotFoundError as exc:
        print(f"kvmesh up: error: {exc}", file=sys.stderr)
        return 2
    finally:
        print("kvmesh up: stopping...", file=sys.stderr, flush=True)
        _stop(procs)
