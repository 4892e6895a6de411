"""Disaggregation under faults, with real processes: cancels at every phase, a prefill worker killed
mid-transfer, backpressure, enforce-disagg, workers added and removed under load. After each, 0 blocks
are held anywhere. The faults discovery takes part in run on the file backend and on a real etcd
(the ``discovery_url`` fixture, conftest.py)."""

from __future__ import annotations

import queue
import signal
import threading
import time
import uuid

import pytest
import tritonclient.grpc as grpcclient
from kvmesh_bench.prometheus_text import metric_total, metrics_url

from tests.disagg.kserve.test_mesh import LONG, assert_nothing_held, request
from tests.kserve_clients.mesh import MODEL, Mesh, Outcome, absorb, param, stream_error, stream_requests

pytestmark = pytest.mark.e2e


def _mesh(tmp_path, discovery_url: str | None = None) -> Mesh:
    url = discovery_url or f"file://{tmp_path / 'disc'}"
    return Mesh(tmp_path, url, f"pf{uuid.uuid4().hex[:8]}", lease_ttl=1.0)


def _build(mesh: Mesh, prefill: int, decode: int, decode_args=(), prefill_args=(), router_args=(), fe_args=(),
           decode_env=None) -> Mesh:  # fmt: skip
    for _ in range(decode):
        port_args = [*decode_args]
        if decode_env:
            from tests.support.daemons import Daemon
            from tests.support.etcd import free_port

            port = free_port()
            args = [*mesh._common(port), "--num-engines", "1", "--num-gpu-blocks", "2048", "--block-size", "16",
                    "--role", "decode", *port_args]  # fmt: skip
            daemon = Daemon("kvmesh-worker", args, mesh.log_dir, port, env=decode_env)
            mesh.daemons.append(daemon)
            daemon.wait_serving()
        else:
            mesh.worker("--role", "decode", *port_args)
    for _ in range(prefill):
        mesh.worker("--role", "prefill", *prefill_args)
    mesh.router(*router_args)
    mesh.start_frontend(*fe_args)
    mesh.wait_model(MODEL)
    return mesh


@pytest.mark.parametrize("phase,delay", [("queued/prefilling", 0.0), ("transferring", 0.15), ("decoding", 0.9)])
def test_client_cancel_at_any_phase_frees_both_sides_within_1s(tmp_path, phase, delay):
    mesh = _mesh(tmp_path)
    try:
        # Real time; a modelled 0.1 GB/s link makes the transfer phase last ~0.3 s (2 MiB model-true blocks).
        _build(mesh, 1, 1, decode_args=("--speedup-ratio", "1", "--kv-transfer-gbps", "0.1"),
               prefill_args=("--speedup-ratio", "1"))  # fmt: skip
        stream_requests(mesh.url_frontend, [request("warm", "warm up " + LONG, 2)])  # first NIXL connection
        results: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(mesh.url_frontend)
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(MODEL, **{k: v for k, v in request("c", f"{phase} {LONG}", 400).items()})
        time.sleep(delay)
        cancelled = time.monotonic()
        client.stop_stream(cancel_requests=True)
        client.close()
        freed = assert_nothing_held(mesh, timeout=1.0, since=cancelled)
        assert freed < 1.0
    finally:
        mesh.close()


def test_prefill_worker_killed_mid_transfer_fails_fast_and_the_request_migrates(tmp_path, discovery_url):
    mesh = _mesh(tmp_path, discovery_url)
    try:
        _build(mesh, 1, 1, decode_env={"KVMESH_TEST_PULL_DELAY_S": "0.5"})
        warm = stream_requests(mesh.url_frontend, [request("warm", "warm " + LONG, 4)])["warm"]
        assert param(warm.final, "kvmesh.disagg") == "remote"
        prefill = next(d for d in mesh.daemons if "prefill" in d.args)
        results: queue.Queue = queue.Queue()
        outcome = Outcome()
        with grpcclient.InferenceServerClient(mesh.url_frontend) as client:
            client.start_stream(callback=lambda result, error: results.put((result, error)))
            started = time.monotonic()
            client.async_stream_infer(MODEL, **request("k", "kill " + LONG, 20))
            time.sleep(0.25)  # the prefill is done and held; the decode side waits 0.5 s before its read
            prefill.proc.kill()
            killed = time.monotonic()
            while outcome.final is None:
                result, error = results.get(timeout=10)
                assert error is None, error
                absorb(outcome, result)
            client.stop_stream()
        done = time.monotonic()
        assert outcome.num_tokens == 20 and outcome.finish_reason == "length"  # one stream, no duplicate
        assert param(outcome.final, "kvmesh.disagg") == "local: no other prefill engine after a failed one"
        assert param(outcome.final, "kvmesh.migrations") == 1
        assert done - killed < 2.0, f"took {done - killed:.2f}s after the kill ({killed - started:.2f}s in)"
        assert_nothing_held(mesh)
    finally:
        mesh.close()


def test_backpressure_prefill_pool_busy_falls_back_or_rejects(tmp_path):
    mesh = _mesh(tmp_path)
    try:
        _build(mesh, 1, 1, decode_args=("--speedup-ratio", "1"), prefill_args=("--speedup-ratio", "1"),
               router_args=("--prefill-backlog-tokens", "1"))  # fmt: skip
        outcomes = stream_requests(mesh.url_frontend, [request(f"b{i}", f"{i} {LONG}", 4) for i in range(6)])
        decisions = [param(o.final, "kvmesh.disagg") for o in outcomes.values()]
        assert all(o.num_tokens == 4 for o in outcomes.values())
        assert "remote" in decisions and "local: every prefill engine is busy" in decisions, decisions
        assert_nothing_held(mesh)
        mesh.daemons[-1].close()  # the frontend: restart it refusing instead of falling back
        mesh.daemons.pop()
        mesh.start_frontend("--disagg-busy", "reject")
        mesh.wait_model(MODEL)
        results: queue.Queue = queue.Queue()
        errors: list = []
        finals = 0
        with grpcclient.InferenceServerClient(mesh.url_frontend) as client:
            client.start_stream(callback=lambda result, error: results.put((result, error)))
            for i in range(6):
                client.async_stream_infer(MODEL, **request(f"r{i}", f"fresh {i} {LONG}", 4))
            while finals + len(errors) < 6:
                result, error = results.get(timeout=30)
                if error is not None:
                    errors.append(error)
                elif param(result, "triton_final_response"):
                    finals += 1
            client.stop_stream()
        assert finals >= 1 and errors, (finals, errors)
        assert all("RESOURCE_EXHAUSTED" in str(e) and "prefill" in str(e) for e in errors), errors
        assert_nothing_held(mesh)
    finally:
        mesh.close()


def test_without_prefill_engines_serve_aggregated_unless_enforced(tmp_path, discovery_url):
    mesh = _mesh(tmp_path, discovery_url)
    try:
        _build(mesh, 0, 1)
        out = stream_requests(mesh.url_frontend, [request("a", LONG)])["a"]
        assert out.num_tokens == 12 and param(out.final, "kvmesh.disagg") == "local: no prefill engine"
        mesh.daemons[-1].close()
        mesh.daemons.pop()
        mesh.start_frontend("--enforce-disagg")
        mesh.wait_model(MODEL)
        error = stream_error(mesh.url_frontend, request("b", LONG))
        assert error.message().startswith("UNAVAILABLE: ") and "--enforce-disagg" in error.message(), error.message()
        assert_nothing_held(mesh)
    finally:
        mesh.close()


def test_prefill_and_decode_workers_added_and_removed_under_load_fail_nothing(tmp_path, discovery_url):
    mesh = _mesh(tmp_path, discovery_url)
    try:
        _build(mesh, 1, 1, decode_args=("--speedup-ratio", "4"), prefill_args=("--speedup-ratio", "4"))
        stop = threading.Event()
        failures: list = []
        done: list = []

        def load(worker_id: int) -> None:
            i = 0
            while not stop.is_set():
                try:
                    out = stream_requests(mesh.url_frontend, [request(f"w{worker_id}-{i}", f"{i} {LONG}", 8)])
                    assert all(o.num_tokens == 8 for o in out.values())
                    done.append(1)
                except Exception as exc:
                    failures.append(exc)
                i += 1

        threads = [threading.Thread(target=load, args=(w,)) for w in range(3)]
        [t.start() for t in threads]
        time.sleep(1.0)
        mesh.worker("--role", "prefill", "--speedup-ratio", "4")
        mesh.worker("--role", "decode", "--speedup-ratio", "4")
        time.sleep(1.5)
        first_prefill = next(d for d in mesh.daemons if "prefill" in d.args)
        first_prefill.signal(signal.SIGTERM)  # drains: in-flight legs finish, new ones go elsewhere
        first_decode = next(d for d in mesh.daemons if "decode" in d.args)
        first_decode.signal(signal.SIGTERM)  # likewise for a decode worker
        first_prefill.wait(15)
        first_decode.wait(15)
        time.sleep(1.5)
        for d in [d for d in mesh.daemons if "prefill" in d.args and d.proc.poll() is None]:
            d.signal(signal.SIGTERM)  # the last prefill engine leaves: the decode engines prefill locally
            d.wait(15)
        time.sleep(1.5)
        stop.set()
        [t.join(60) for t in threads]
        assert not failures, [str(exc) for exc in failures[:3]]
        assert len(done) > 10
        out = stream_requests(mesh.url_frontend, [request("after", "after " + LONG)])["after"]
        assert param(out.final, "kvmesh.disagg") == "local: no prefill engine"
        assert_nothing_held(mesh)
    finally:
        mesh.close()


def _metric(daemon, name: str) -> float:
    """A metric of a daemon started with ``--metrics-port`` (its samples summed)."""
    return metric_total(metrics_url(int(daemon.args[daemon.args.index("--metrics-port") + 1])), name)


def test_prefill_worker_killed_while_its_blocks_are_being_read_fails_fast_and_the_request_migrates(
    tmp_path, discovery_url
):
    """The kill lands inside the decode side's NIXL READ, not before or after it. The bytes go over UCX's TCP
    lane (as between hosts), so they leave only through the prefill process: the test waits until the decode
    worker's ``kvmesh_engine_kv_reading_blocks`` gauge shows the read in flight, freezes the prefill worker
    (SIGSTOP) so the read cannot finish, checks the read is still in flight, then SIGKILLs it. The hold lease
    is 120 s: only the transport's own failure detection can end the pull quickly."""
    from kvmesh_worker.kv_transfer.mocker_kv import PULL_TIMEOUT_S

    from tests.support.daemons import Daemon
    from tests.support.etcd import free_port

    mesh = _mesh(tmp_path, discovery_url)
    tcp_only = {"UCX_TLS": "tcp"}  # no shared-memory lane: a stopped or dead peer really stops the bytes
    workers: dict[str, Daemon] = {}
    try:
        for role in ("decode", "prefill"):
            port = free_port()
            args = [*mesh._common(port), "--num-engines", "1", "--num-gpu-blocks", "512", "--block-size", "16",
                    "--speedup-ratio", "0", "--role", role, "--kv-bytes-per-block", str(1 << 20),
                    "--kv-hold-timeout", "120", "--metrics-port", str(free_port())]  # fmt: skip
            workers[role] = Daemon("kvmesh-worker", args, mesh.log_dir, port, env=tcp_only)
            mesh.daemons.append(workers[role])
            workers[role].wait_serving()
        mesh.router()
        mesh.start_frontend()
        mesh.wait_model(MODEL)
        warm = stream_requests(mesh.url_frontend, [request("warm", "warm " + LONG, 4)])["warm"]
        assert param(warm.final, "kvmesh.disagg") == "remote"  # the first NIXL connection is made
        prompt = " ".join(f"tok{i}" for i in range(1000))  # ~5000 tokens: ~300 blocks of 1 MiB to read
        max_tokens = 20
        results: queue.Queue = queue.Queue()
        outcome = Outcome()
        decode, prefill = workers["decode"], workers["prefill"]
        with grpcclient.InferenceServerClient(mesh.url_frontend) as client:
            client.start_stream(callback=lambda result, error: results.put((result, error)))
            client.async_stream_infer(MODEL, **request("k", prompt, max_tokens))
            deadline = time.monotonic() + 60
            while (reading := _metric(decode, "kvmesh_engine_kv_reading_blocks")) == 0:
                assert results.empty(), f"answered before its KV read started: {results.queue[0][1].message()}"
                assert time.monotonic() < deadline, "the decode side never started reading"
                time.sleep(0.005)
            prefill.proc.send_signal(signal.SIGSTOP)  # the read can no longer finish
            assert _metric(decode, "kvmesh_engine_kv_reading_blocks") == reading, "the read ended before the kill"
            prefill.proc.kill()
            killed = time.monotonic()
            while outcome.final is None:
                result, error = results.get(timeout=2 * PULL_TIMEOUT_S)
                assert error is None, error
                absorb(outcome, result)
            done = time.monotonic() - killed
            client.stop_stream()
        # One stream, whole: exactly max_tokens, the same text an undisturbed local prefill gives.
        assert outcome.num_tokens == max_tokens and outcome.finish_reason == "length"
        assert param(outcome.final, "kvmesh.migrations") == 1
        assert param(outcome.final, "kvmesh.disagg") == "local: no other prefill engine after a failed one"
        again = stream_requests(mesh.url_frontend, [request("again", prompt, max_tokens)])["again"]
        assert outcome.text == again.text
        # Fail fast: the dead source was detected by the transport, far inside the read's own timeout.
        print(f"\nkilled mid-read of {reading:.0f} blocks; the request was done {done:.3f}s after the kill")
        assert done < PULL_TIMEOUT_S / 5, f"took {done:.2f}s after the kill"
        assert_nothing_held(mesh)
    finally:
        mesh.close()


def test_engines_that_cannot_share_kv_serve_with_a_local_prefill(tmp_path):
    """A prefill and a decode engine of other KV byte sizes (a mesh misconfiguration): the pull is refused
    FAILED_PRECONDITION, which failed every disaggregated request INTERNAL; the frontend now prefills
    locally on the decode engine and logs the misconfiguration."""
    mesh = _mesh(tmp_path)
    try:
        _build(mesh, 1, 1, decode_args=("--kv-bytes-per-block", "8192"))
        out = stream_requests(mesh.url_frontend, [request("a", LONG)])["a"]
        assert out.num_tokens == 12  # stream_requests raises an error response
        assert param(out.final, "kvmesh.disagg") == "local: no other prefill engine after a failed one"
        assert "its KV cannot be used" in mesh.frontend.log_text()  # type: ignore[union-attr]
        assert_nothing_held(mesh)
    finally:
        mesh.close()
