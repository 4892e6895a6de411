"""Engines coming and going, a worker killed mid-stream, a client that cancels: real processes, stock client."""

from __future__ import annotations

import json
import queue
import signal
import time

import pytest
import tritonclient.grpc as grpcclient

from tests.kserve_clients.mesh import MODEL, Mesh, Outcome, absorb, engine_loads, llm_inputs, param, watch_blocks
from tests.support.daemons import Daemon

pytestmark = pytest.mark.e2e


def test_readiness_follows_engines(fresh_mesh: Mesh) -> None:
    mesh = fresh_mesh
    mesh.router()
    mesh.start_frontend()
    with mesh.client() as client:
        assert client.is_server_live()
        assert not client.is_server_ready()
        assert not client.is_model_ready(MODEL)
    worker = mesh.worker()
    mesh.wait_model(MODEL, ready=True, timeout=10)
    with mesh.client() as client:
        assert client.is_server_ready()
    worker.close()  # graceful: the lease is revoked, the cards vanish at once
    assert mesh.wait_model(MODEL, ready=False, timeout=5) < 2.0
    worker = mesh.worker()
    mesh.wait_model(MODEL, ready=True, timeout=10)
    worker.signal(signal.SIGKILL)  # the cards vanish when the lease expires
    assert mesh.wait_model(MODEL, ready=False, timeout=10) < mesh.lease_ttl + 2.0
    with mesh.client() as client:
        assert not client.is_server_ready()


def _engines_known(mesh: Mesh, count: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    with mesh.client() as client:
        while time.monotonic() < deadline:
            config = client.get_model_config(MODEL).config
            if config.parameters["engines"].string_value == str(count):
                return
            time.sleep(0.05)
    raise AssertionError(f"the frontend does not see {count} engines")


def _two_workers_behind_a_frontend(mesh: Mesh) -> list[Daemon]:
    """Two one-engine mocker workers at real speed, a router and a frontend that knows both engines."""
    workers = [mesh.worker(speedup=1.0), mesh.worker(speedup=1.0)]
    mesh.router()
    mesh.start_frontend()
    mesh.wait_model(MODEL)
    _engines_known(mesh, 2)
    return workers


def _engine_of(worker: Daemon) -> int:
    """The engine id of a one-engine worker."""
    return engine_loads(worker.address)[worker.address][0]["engine_id"]


def _serving_after_20_tokens(workers: list[Daemon], results: queue.Queue, outcome: Outcome) -> Daemon:
    """Read the stream until 20 tokens came; the one worker running the request."""
    while outcome.num_tokens < 20:
        result, error = results.get(timeout=30)
        assert error is None, error
        absorb(outcome, result)
    loads = engine_loads(*(w.address for w in workers))
    serving = [w for w in workers if any(e["running"] for e in loads[w.address])]
    assert len(serving) == 1, loads
    return serving[0]


def _read_to_the_end(results: queue.Queue, outcome: Outcome, timeout: float = 30) -> None:
    while outcome.final is None:
        result, error = results.get(timeout=timeout)
        assert error is None, f"the client saw an error: {error}"
        absorb(outcome, result)


@pytest.mark.parametrize("stream_interval", [None, 16])
def test_migration_when_the_serving_worker_is_killed(fresh_mesh: Mesh, stream_interval: int | None) -> None:
    """The client gets exactly max_tokens; with a stream interval, the tokens the dead worker held back
    were never sent, so the survivor generates them again and none is missing or doubled."""
    mesh = fresh_mesh
    workers = _two_workers_behind_a_frontend(mesh)
    max_tokens = 300  # about 2 s of simulated decoding
    results: queue.Queue = queue.Queue()
    outcome = Outcome()
    with grpcclient.InferenceServerClient(mesh.url_frontend) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        sampling = {"stream_interval": stream_interval} if stream_interval else None
        client.async_stream_infer(MODEL, llm_inputs(max_tokens=max_tokens, sampling=sampling), request_id="m1")
        serving = _serving_after_20_tokens(workers, results, outcome)
        serving.signal(signal.SIGKILL)
        _read_to_the_end(results, outcome)
        client.stop_stream()
    assert outcome.num_tokens == max_tokens
    assert outcome.finish_reason == "length"
    assert param(outcome.final, "kvmesh.migrations") == 1
    assert param(outcome.final, "kvmesh.worker_id") == _engine_of(next(w for w in workers if w is not serving))


def test_a_frozen_worker_is_given_up_on_within_seconds_and_its_request_migrates(fresh_mesh: Mesh) -> None:
    """SIGSTOP, not SIGKILL: the worker's kernel still ACKs, so only gRPC's keepalive ping, unanswered for
    grpc.http2.ping_timeout_ms, ends its stream (10 s + 5 s); the request then migrates and completes.
    With gRPC's default ping timeout (60 s) the request waited for as long as the worker stayed frozen."""
    mesh = fresh_mesh
    workers = _two_workers_behind_a_frontend(mesh)
    max_tokens = 300
    results: queue.Queue = queue.Queue()
    outcome = Outcome()
    frozen = None
    try:
        with grpcclient.InferenceServerClient(mesh.url_frontend) as client:
            client.start_stream(callback=lambda result, error: results.put((result, error)))
            client.async_stream_infer(MODEL, llm_inputs(max_tokens=max_tokens), request_id="f1")
            frozen = _serving_after_20_tokens(workers, results, outcome)
            frozen.signal(signal.SIGSTOP)
            stopped = time.monotonic()
            _read_to_the_end(results, outcome, timeout=40)
            given_up_after = time.monotonic() - stopped
            client.stop_stream()
    finally:
        if frozen is not None:
            frozen.signal(signal.SIGCONT)
    assert outcome.num_tokens == max_tokens and param(outcome.final, "kvmesh.migrations") == 1
    assert given_up_after < 30, f"the frozen worker held the request {given_up_after:.1f} s"


def test_a_request_answered_once_migrates_whole_when_its_worker_is_killed(fresh_mesh: Mesh) -> None:
    """ModelInfer gets one response, so the worker holds back every token after the first: a kill loses all
    it held, the survivor generates them, and the one response still has exactly max_tokens."""
    mesh = fresh_mesh
    workers = _two_workers_behind_a_frontend(mesh)
    max_tokens = 300  # about 2 s of simulated decoding
    done: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(mesh.url_frontend) as client:
        client.async_infer(MODEL, llm_inputs(max_tokens=max_tokens, stream=False),
                           callback=lambda result, error: done.put((result, error)), request_id="u1")  # fmt: skip
        deadline = time.monotonic() + 10
        serving: list = []
        while not serving and time.monotonic() < deadline:
            loads = engine_loads(*(w.address for w in workers))
            serving = [w for w in workers if any(e["running"] for e in loads[w.address])]
            time.sleep(0.05)
        assert len(serving) == 1, loads
        time.sleep(0.3)  # well into the decode: tokens are held on the worker
        serving[0].signal(signal.SIGKILL)
        result, error = done.get(timeout=30)
    assert error is None, f"the client saw an error: {error}"
    assert int(result.as_numpy("num_output_tokens")[0]) == max_tokens
    assert result.as_numpy("finish_reason")[0] == b"length"
    assert param(result, "kvmesh.migrations") == 1
    assert param(result, "kvmesh.worker_id") == _engine_of(next(w for w in workers if w is not serving[0]))


def test_cancel_frees_the_engine_within_a_second(fresh_mesh: Mesh) -> None:
    mesh = fresh_mesh
    worker = mesh.worker(speedup=1.0)
    mesh.router()
    mesh.start_frontend()
    mesh.wait_model(MODEL)
    before = engine_loads(worker.address)[worker.address][0]["active_blocks"]
    results: queue.Queue = queue.Queue()
    outcome = Outcome()
    client = grpcclient.InferenceServerClient(mesh.url_frontend)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(MODEL, llm_inputs(" ".join(["long prompt"] * 200), max_tokens=5000),
                                  request_id="k1")  # fmt: skip
        while outcome.num_tokens < 10:
            result, error = results.get(timeout=30)
            assert error is None, error
            absorb(outcome, result)
        busy = engine_loads(worker.address)[worker.address][0]["active_blocks"]
        assert busy > before
        probe = watch_blocks(worker.address, before, timeout=10)
        cancelled_at = time.time()
        client.stop_stream(cancel_requests=True)
        out, err = probe.communicate(timeout=15)
        assert probe.returncode == 0, (out, err)
        freed = json.loads(out.strip().splitlines()[-1])
        assert freed["at"] - cancelled_at < 1.0, f"blocks freed {freed['at'] - cancelled_at:.3f}s after the cancel"
    finally:
        client.close()
