"""Shared harness of the router end-to-end tests (it holds no tests itself).

Real daemons as subprocesses (``kvmesh-worker`` with mocker engines, ``kvmesh-router``), talked to
through their gRPC contracts only, the way a frontend would:

- :class:`Mesh` starts workers and routers on one discovery backend and closes them all;
- :class:`SessionClient` is one frontend Session stream (route queries, lifecycle updates);
- ``prompt("A", "C", "D")`` builds a prompt of lettered blocks (each letter = one block of distinct
  tokens) and :func:`seq_hashes` the sequence hashes a frontend would send;
- :func:`router_index` / :func:`worker_truth` / :func:`active_load` read the two sides to compare;
- :func:`scrape` reads a router's Prometheus metrics.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
from kvmesh.hashing import block_hashes
from kvmesh.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh_bench.prometheus_text import metrics_url, samples

from tests.support.daemons import Daemon
from tests.support.etcd import free_port
from tests.support.generate import generate_sync, tokens_of

MODEL = "kvmesh-mock"
BLOCK_SIZE = 16
ROUTED = router_pb2.DECISION_OUTCOME_ROUTED
REJECTED = router_pb2.DECISION_OUTCOME_REJECTED
NO_ENGINE = router_pb2.DECISION_OUTCOME_NO_ENGINE
INVALID = router_pb2.DECISION_OUTCOME_INVALID
FIRST_TOKEN = router_pb2.LIFECYCLE_STAGE_FIRST_TOKEN
FINISHED = router_pb2.LIFECYCLE_STAGE_FINISHED


# ---------------------------------------------------------------------- prompts


def block(letter: str, block_size: int = BLOCK_SIZE) -> list[int]:
    """``block_size`` distinct tokens for one letter (A -> 100.., B -> 200.., ...; vocab is 2048)."""
    base = 100 + (ord(letter) - ord("A")) * 40
    return list(range(base, base + block_size))


def prompt(*letters: str, block_size: int = BLOCK_SIZE) -> list[int]:
    return [t for letter in letters for t in block(letter, block_size)]


def seq_hashes(tokens: list[int], block_size: int = BLOCK_SIZE) -> list[int]:
    return block_hashes(tokens, block_size)[1]


def wait_until(pred: Callable[[], Any], timeout: float, what: str = "", interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or pred}")
        time.sleep(interval)


# ---------------------------------------------------------------------- daemons


class Worker:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.address = daemon.address
        self.channel = grpc.insecure_channel(self.address)
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        call = self.stub.WatchLoad(worker_pb2.WatchLoadRequest(), timeout=5)
        first = next(call)
        call.cancel()  # an open stream would hold up the worker's drain at shutdown
        self.engine_ids = sorted(load.engine_id for load in first.loads)

    def generate(self, engine_id: int, tokens: list[int], max_tokens: int = 1, request_id: str = "") -> list[int]:
        request = worker_pb2.GenerateRequest(
            request_id=request_id or f"g{time.monotonic_ns()}",
            engine_id=engine_id,
            token_ids=tokens,
            sampling=worker_pb2.SamplingOptions(max_tokens=max_tokens, ignore_eos=True),
        )
        return tokens_of(generate_sync(self.stub, request, timeout=30))

    def truth(self) -> dict[int, set[int]]:
        return worker_truth(self.stub, self.engine_ids)

    def close(self) -> None:
        self.channel.close()
        self.daemon.close()


class Router:
    def __init__(self, daemon: Daemon, metrics_port: int) -> None:
        self.daemon = daemon
        self.address = daemon.address
        self.metrics_port = metrics_port
        self.channel = grpc.insecure_channel(self.address)
        self.stub = router_pb2_grpc.RouterServiceStub(self.channel)

    def session(self) -> SessionClient:
        return SessionClient(self.address)

    def index(self) -> dict[int, set[int]]:
        return router_index(self.stub)

    def load(self) -> dict[int, tuple[int, int, int]]:
        return active_load(self.stub)

    def metrics(self) -> dict[str, float]:
        return scrape(self.metrics_port)

    def close(self) -> None:
        self.channel.close()
        self.daemon.close()


class Mesh:
    """Daemons of one test on one discovery backend and namespace; ``close()`` stops them all."""

    def __init__(self, tmp_path: Path, url: str | None = None, namespace: str = "rt") -> None:
        self.tmp_path = tmp_path
        self.url = url or f"file://{tmp_path / 'discovery'}"
        self.namespace = namespace
        self._owned: list[Worker | Router] = []

    def common(self, namespace: str | None = None) -> list[str]:
        return [
            "--discovery",
            self.url,
            "--namespace",
            namespace or self.namespace,
            "--lease-ttl",
            "2",
            "--drain-timeout",
            "2",
        ]

    def worker(
        self,
        *extra: str,
        engines: int = 2,
        blocks: int = 1024,
        speedup: float = 0,
        namespace: str | None = None,
    ) -> Worker:
        port = free_port()
        args = [
            *self.common(namespace),
            "--grpc-port", str(port), "--num-engines", str(engines), "--num-gpu-blocks", str(blocks),
            "--block-size", str(BLOCK_SIZE), "--speedup-ratio", str(speedup), *extra,
        ]  # fmt: skip
        worker = Worker(Daemon("kvmesh-worker", args, self.tmp_path, port).wait_serving())
        self._owned.append(worker)
        return worker

    def router(self, *extra: str, wait: bool = True) -> Router:
        port, metrics_port = free_port(), free_port()
        args = [*self.common(), "--grpc-port", str(port), "--metrics-port", str(metrics_port), "--seed", "7", *extra]
        daemon = Daemon("kvmesh-router", args, self.tmp_path, port)
        if wait:
            daemon.wait_serving()
        router = Router(daemon, metrics_port)
        self._owned.append(router)
        return router

    def close(self) -> None:
        for daemon in reversed(self._owned):
            daemon.close()


# ---------------------------------------------------------------------- a frontend's Session stream


class SessionClient:
    """One Session stream, as a frontend holds it (sync API; a thread reads the decisions)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = router_pb2_grpc.RouterServiceStub(self.channel)
        self._out: queue.Queue[router_pb2.SessionRequest | None] = queue.Queue()
        self._in: queue.Queue[router_pb2.RouteDecision | BaseException] = queue.Queue()
        self._call = self.stub.Session(iter(self._out.get, None))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for response in self._call:
                self._in.put(response.decision)
        except BaseException as exc:  # the stream ended abnormally: wake whoever waits
            self._in.put(exc)

    def send_query(
        self,
        request_id: str,
        hashes: Iterable[int],
        num_tokens: int,
        *,
        model: str = MODEL,
        pinned: int | None = None,
        mode: int = 0,
        excluded: Iterable[int] = (),
        role: int = 0,
        excluded_prefill: Iterable[int] | None = None,
    ) -> None:
        query = router_pb2.RouteQuery(
            request_id=request_id,
            model=model,
            block_hashes=list(hashes),
            num_tokens=num_tokens,
            excluded_engine_ids=list(excluded),
        )
        if pinned is not None:
            query.pinned_engine_id = pinned
        if mode:
            query.overrides.mode = mode  # type: ignore[assignment]  # a raw enum number, as a test may send any
        if role:
            query.overrides.role = role  # type: ignore[assignment]
        if excluded_prefill is not None:  # a disaggregated query: the router decides the prefill too
            query.disagg.SetInParent()
            query.disagg.excluded_prefill_engine_ids.extend(excluded_prefill)
        self._out.put(router_pb2.SessionRequest(route=query))

    def decision(self, timeout: float = 10.0) -> router_pb2.RouteDecision:
        item = self._in.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise item
        return item

    def route(self, request_id: str, tokens: list[int], **kwargs: Any) -> router_pb2.RouteDecision:
        self.send_query(request_id, seq_hashes(tokens), len(tokens), **kwargs)
        return self.decision()

    def lifecycle(self, request_id: str, stage: int) -> None:
        self._out.put(
            router_pb2.SessionRequest(lifecycle=router_pb2.LifecycleUpdate(request_id=request_id, stage=stage))
        )

    def run(self, worker: Worker, request_id: str, tokens: list[int], **kwargs: Any) -> router_pb2.RouteDecision:
        """A frontend's whole flow: route, generate on the chosen engine, FIRST_TOKEN, FINISHED."""
        decision = self.route(request_id, tokens, **kwargs)
        assert decision.outcome == ROUTED, decision
        worker.generate(decision.engine_id, tokens, request_id=request_id)
        self.lifecycle(request_id, FIRST_TOKEN)
        self.lifecycle(request_id, FINISHED)
        return decision

    def close(self) -> None:
        """Half-close the stream (the frontend is done)."""
        self._out.put(None)
        self._reader.join(5)
        self.channel.close()

    def cancel(self) -> None:
        self._call.cancel()
        self._reader.join(5)
        self.channel.close()


# ---------------------------------------------------------------------- reading both sides


def router_index(stub: router_pb2_grpc.RouterServiceStub) -> dict[int, set[int]]:
    reply = stub.DumpIndex(router_pb2.DumpIndexRequest(), timeout=5)
    return {e.engine_id: set(e.block_hashes) for e in reply.engines}


def worker_truth(stub: worker_pb2_grpc.WorkerServiceStub, engine_ids: Iterable[int]) -> dict[int, set[int]]:
    out = {}
    for engine_id in engine_ids:
        snap = stub.DumpKvIndex(worker_pb2.DumpKvIndexRequest(engine_id=engine_id), timeout=5).snapshot
        out[engine_id] = {h for stored in snap.stored for h in stored.block_hashes}
    return out


def active_load(stub: router_pb2_grpc.RouterServiceStub) -> dict[int, tuple[int, int, int]]:
    reply = stub.GetActiveLoad(router_pb2.GetActiveLoadRequest(), timeout=5)
    return {e.engine_id: (e.active_blocks, e.active_prefill_tokens, e.active_requests) for e in reply.engines}


def scrape(port: int) -> dict[str, float]:
    """``{"name{label=value,...}": value}`` of a /metrics page (samples only, labels sorted)."""
    out: dict[str, float] = {}
    for sample in samples(metrics_url(port)):
        labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
        out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out
