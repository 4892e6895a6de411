"""A kvmesh deployment of real daemons (subprocesses) for the stock-client acceptance tests.

Imports neither ``inference.*`` stubs nor ``kvmesh_frontend``: this folder runs in a process that
has ``tritonclient.grpc`` loaded, and both declare the proto package ``inference``. What the tests
need from kvmesh's own contracts (engine load) comes from ``load_probe.py``, run as a subprocess.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from kvmesh_bench.prometheus_text import metric_total, metrics_url
from tritonclient.utils import InferenceServerException

from tests.support.daemons import Daemon
from tests.support.etcd import free_port

MODEL = "kvmesh-mock"
PROBE = Path(__file__).with_name("load_probe.py")


class Mesh:
    """Workers, routers and frontends on one discovery URL and namespace; closes what it started."""

    def __init__(self, log_dir: Path, url: str, namespace: str, lease_ttl: float = 2.0) -> None:
        self.log_dir = log_dir
        self.url = url
        self.namespace = namespace
        self.lease_ttl = lease_ttl
        self.daemons: list[Daemon] = []
        self.frontend: Daemon | None = None
        self.metrics_port = 0
        self.router_metrics_port = 0  # the first router's

    def _common(self, port: int) -> list[str]:
        return ["--discovery", self.url, "--namespace", self.namespace, "--grpc-port", str(port),
                "--lease-ttl", str(self.lease_ttl), "--drain-timeout", "2"]  # fmt: skip

    def worker(self, *extra: str, engines: int = 1, speedup: float = 0.0, wait: bool = True) -> Daemon:
        port = free_port()
        args = [*self._common(port), "--num-engines", str(engines), "--speedup-ratio", str(speedup),
                "--num-gpu-blocks", "2048", "--block-size", "16", *extra]  # fmt: skip
        daemon = Daemon("kvmesh-worker", args, self.log_dir, port)
        self.daemons.append(daemon)
        return daemon.wait_serving() if wait else daemon

    def router(self, *extra: str) -> Daemon:
        port, metrics_port = free_port(), free_port()
        args = [*self._common(port), "--router-mode", "kv", "--metrics-port", str(metrics_port), *extra]
        daemon = Daemon("kvmesh-router", args, self.log_dir, port)
        self.router_metrics_port = self.router_metrics_port or metrics_port
        self.daemons.append(daemon)
        return daemon.wait_serving()

    def start_frontend(self, *extra: str) -> Daemon:
        port = free_port()
        self.metrics_port = free_port()
        args = [*self._common(port), "--metrics-port", str(self.metrics_port), *extra]
        daemon = Daemon("kvmesh-frontend", args, self.log_dir, port)
        self.daemons.append(daemon)
        self.frontend = daemon.wait_started()  # not ready (NOT_SERVING) until a router and an engine come
        return daemon

    @property
    def url_frontend(self) -> str:
        assert self.frontend is not None
        return self.frontend.address

    def client(self) -> grpcclient.InferenceServerClient:
        return grpcclient.InferenceServerClient(self.url_frontend)

    def wait_model(self, model: str = MODEL, ready: bool = True, timeout: float = 20.0) -> float:
        """Seconds until ModelReady(model) == ready."""
        return wait_model_ready(self.url_frontend, model, ready, timeout, self.logs)

    def metrics(self) -> str:
        """The frontend's Prometheus exposition."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as reply:
            return reply.read().decode()

    def router_metric(self, name: str) -> float:
        """A metric of the first router (its samples summed; 0 when absent)."""
        return metric_total(metrics_url(self.router_metrics_port), name)

    def wait_router_metric(self, name: str, at_least: float, timeout: float = 30.0) -> float:
        return wait_metric(lambda: self.router_metric(name), name, at_least, timeout, self.logs)

    def logs(self) -> str:
        return "\n".join(f"--- {d.name}:{d.port}\n{d.log_text()[-4000:]}" for d in self.daemons)

    def close(self) -> None:
        for daemon in reversed(self.daemons):
            daemon.close()
        self.daemons.clear()


# -- requests ------------------------------------------------------------------------------------
def bytes_in(name: str, value: str | bytes) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_))
    return tensor


def bool_in(name: str, value: bool) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "BOOL")
    tensor.set_data_from_numpy(np.array([value], dtype=bool))
    return tensor


def ids_in(ids: list[int], datatype: str = "INT32") -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("input_ids", [len(ids)], datatype)
    tensor.set_data_from_numpy(np.array(ids, dtype=np.int32 if datatype == "INT32" else np.int64))
    return tensor


def llm_inputs(
    prompt: str | None = "Tell me about KV caches",
    *,
    stream: bool = True,
    max_tokens: int | None = 16,
    ids: list[int] | None = None,
    messages: list[dict[str, Any]] | None = None,
    sampling: dict[str, Any] | None = None,
    counts: bool = True,
) -> list[grpcclient.InferInput]:
    inputs = []
    if prompt is not None:
        inputs.append(bytes_in("text_input", prompt))
    if ids is not None:
        inputs.append(ids_in(ids))
    if messages is not None:
        inputs.append(bytes_in("messages", json.dumps(messages)))
    inputs.append(bool_in("stream", stream))
    if stream:
        inputs.append(bool_in("exclude_input_in_output", True))
    params = {"ignore_eos": True, **(sampling or {})}
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    inputs.append(bytes_in("sampling_parameters", json.dumps(params)))
    if counts:
        inputs.append(bool_in("return_num_output_tokens", True))
        inputs.append(bool_in("return_finish_reason", True))
    return inputs


def wait_model_ready(url: str, model: str, ready: bool, timeout: float, logs: Callable[[], str] = str) -> float:
    """Seconds until the frontend at ``url`` answers ModelReady(model) == ready."""
    start = time.monotonic()
    with grpcclient.InferenceServerClient(url) as client:
        while time.monotonic() - start < timeout:
            try:
                if client.is_model_ready(model) == ready:
                    return time.monotonic() - start
            except InferenceServerException:
                pass
            time.sleep(0.05)
    raise AssertionError(f"ModelReady({model}) != {ready} within {timeout}s on {url}:\n{logs()}")


def wait_metric(
    read: Callable[[], float], name: str, at_least: float, timeout: float, logs: Callable[[], str] = str
) -> float:
    """Poll ``read()`` until it reaches ``at_least`` (KV events reach the routers asynchronously, after the
    response that caused them)."""
    deadline = time.monotonic() + timeout
    while (value := read()) < at_least:
        if time.monotonic() > deadline:
            raise AssertionError(f"metric {name} = {value} < {at_least} after {timeout}s:\n{logs()}")
        time.sleep(0.05)
    return value


def param(result: grpcclient.InferResult, key: str) -> Any:
    p = result.get_response().parameters.get(key)
    return None if p is None else getattr(p, p.WhichOneof("parameter_choice"))


def is_final(result: grpcclient.InferResult) -> bool:
    return bool(param(result, "triton_final_response"))


@dataclass
class Outcome:
    """Everything one request got back on a stream."""

    texts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str = ""
    final: grpcclient.InferResult | None = None
    responses: int = 0

    @property
    def text(self) -> str:
        return "".join(self.texts)


def absorb(outcome: Outcome, result: grpcclient.InferResult) -> None:
    outcome.responses += 1
    text = result.as_numpy("text_output")
    if text is not None:
        outcome.texts.append(text[0].decode())
    count = result.as_numpy("num_output_tokens")
    if count is not None:
        outcome.num_tokens += int(count[0])
    reason = result.as_numpy("finish_reason")
    if reason is not None and reason[0] not in (b"", b"None"):  # "None": not finished yet (vLLM backend)
        outcome.finish_reason = reason[0].decode()
    if is_final(result):
        outcome.final = result


def stream_requests(url: str, requests: list[dict[str, Any]], timeout: float = 60.0) -> dict[str, Outcome]:
    """Send every request on one stream (sync tritonclient); wait for each one's final response."""
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    outcomes = {r["request_id"]: Outcome() for r in requests}
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        try:
            for request in requests:
                client.async_stream_infer(model_name=request.get("model_name", MODEL), **{
                    k: v for k, v in request.items() if k != "model_name"})  # fmt: skip
            pending = set(outcomes)
            deadline = time.monotonic() + timeout
            while pending:
                result, error = results.get(timeout=max(0.1, deadline - time.monotonic()))
                if error is not None:
                    raise error
                outcome = outcomes[result.get_response().id]
                absorb(outcome, result)
                if outcome.final is not None:
                    pending.discard(result.get_response().id)
        finally:
            client.stop_stream()
    return outcomes


def stream_error(url: str, request: dict[str, Any], timeout: float = 30.0) -> InferenceServerException:
    """Send one request on a stream; return the in-band error it gets."""
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        try:
            client.async_stream_infer(model_name=request.pop("model_name", MODEL), **request)
            while True:
                result, error = results.get(timeout=timeout)
                if error is not None:
                    return error
                if is_final(result):
                    raise AssertionError("the request succeeded")
        finally:
            client.stop_stream()


def engine_loads(*addresses: str) -> dict[str, list[dict[str, int]]]:
    """{worker address: [{engine_id, active_blocks, running, waiting}]} via WorkerService.WatchLoad."""
    out = subprocess.run(
        [sys.executable, str(PROBE), "snapshot", *addresses], capture_output=True, text=True, timeout=30
    )
    if out.returncode != 0:
        raise AssertionError(f"load_probe failed: {out.stderr}")
    return json.loads(out.stdout)


def watch_blocks(address: str, blocks: int, timeout: float = 10.0) -> subprocess.Popen[str]:
    """A probe that follows the worker's load until it holds ``blocks`` active blocks and runs nothing.

    Returns once it is subscribed; its last stdout line is then ``{"at": unix time, ...}``.
    """
    probe = subprocess.Popen(
        [sys.executable, str(PROBE), "wait", address, "--blocks", str(blocks), "--timeout", str(timeout)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert probe.stdout is not None
    line = probe.stdout.readline()
    if line.strip() != "ready":
        probe.kill()
        raise AssertionError(f"load_probe did not subscribe: {line!r} {probe.stderr.read() if probe.stderr else ''}")
    return probe
