"""Prefill/decode disaggregation with real vLLM engines: vLLM's NixlConnector moves the KV on CPU memory.

A 1P1D mesh (``kvmesh-worker --engine vllm --role prefill`` and ``--role decode``, a KV router, a
frontend) serves a stock tritonclient request. The frontend runs the prefill leg on the prefill engine,
carries vLLM's ``kv_transfer_params`` to the decode engine in ``KvTransferParams.engine_params_json``,
and the decode engine's vLLM pulls the prompt's blocks through NIXL before it samples. Seeded weights
(made here, nothing downloads) make the tokens depend on the prompt, so "P/D output equals the
aggregated output" shows that the right KV arrived.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from kvmesh.v1 import worker_pb2, worker_pb2_grpc
from kvmesh_bench.prometheus_text import metric_total, metrics_url
from kvmesh_cli.vllm_cores import model_processes

from tests.support.daemons import Daemon
from tests.support.etcd import free_port
from tests.vllm.conftest import BLOCK_SIZE, MODEL, TINY_LLAMA, VllmMesh
from tests.vllm.test_vllm_mesh import (
    current_load,
    engine_core_pids,
    stream_client,
    triton,
    unique_ids,
    wait_until_queued,
)

NUM_BLOCKS = 48
MAX_TOKENS = 8


def seeded_model(directory: Path) -> Path:
    """tiny-llama with seeded random safetensors weights (about 1.6 MB), so outputs depend on the prompt."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = directory / MODEL
    model_dir.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_LLAMA / name, model_dir / name)
    config = LlamaConfig.from_pretrained(model_dir)
    config.initializer_range = 0.5  # sharper logits: greedy tokens that follow the prompt, no near-ties
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory / "saved", safe_serialization=True)
    shutil.copy(directory / "saved" / "model.safetensors", model_dir / "model.safetensors")
    return model_dir


# Each engine gets its own core for its OpenMP threads: vLLM's default binds both to every core, and the two
# spinning thread pools starved everything else (load average ~30: leases expired every few seconds, NIXL's
# handshake timed out).
WORKER_ENV = {"prefill": {"VLLM_CPU_OMP_THREADS_BIND": "0"}, "decode": {"VLLM_CPU_OMP_THREADS_BIND": "1"}}


@dataclass
class PdMesh:
    mesh: VllmMesh
    model: Path
    decode_metrics_port: int
    prefill: Daemon = field(init=False)
    decode: Daemon = field(init=False)

    def start_worker(self, role: str) -> Daemon:
        """A vLLM worker of ``role`` (returned before it serves: engines start in 25-50 s on 2 cores)."""
        port = free_port()
        extra = ["--metrics-port", str(self.decode_metrics_port)] if role == "decode" else []
        args = [
            *self.mesh.common(port),
            "--engine", "vllm",
            "--role", role,
            "--model-path", str(self.model),
            "--block-size", str(BLOCK_SIZE),
            "--num-gpu-blocks", str(NUM_BLOCKS),
            "--max-model-len", str((NUM_BLOCKS - 1) * BLOCK_SIZE),
            *extra,
        ]  # fmt: skip
        daemon = Daemon("kvmesh-worker", args, self.mesh.log_dir, port, env=WORKER_ENV[role])
        self.mesh.daemons.append(daemon)
        return daemon

    def engine_id(self, daemon: Daemon) -> int:
        return int(current_load(daemon.address).engine_id)

    def decode_counters(self) -> dict[str, float]:
        """The decode worker's Prometheus counters (vLLM's own transfer figures among them)."""
        url = metrics_url(self.decode_metrics_port)
        names = ("kvmesh_engine_kv_pulled_tokens_total", "kvmesh_engine_kv_pulled_bytes_total",
                 "kvmesh_engine_prefill_tokens_total")  # fmt: skip
        return {name: metric_total(url, name, timeout=10) for name in names}


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdMesh]:
    model = seeded_model(tmp_path_factory.mktemp("model"))
    log_dir = tmp_path_factory.mktemp("logs")
    mesh = VllmMesh(log_dir, f"file://{tmp_path_factory.mktemp('discovery')}", f"pd{uuid.uuid4().hex[:8]}")
    deployment = PdMesh(mesh, model, free_port())
    try:
        deployment.prefill = deployment.start_worker("prefill")  # both engines start at once
        deployment.decode = deployment.start_worker("decode")
        for daemon in (deployment.prefill, deployment.decode):
            daemon.wait_serving(300)
        mesh.router = mesh.start("kvmesh-router", ["--router-mode", "kv"])
        mesh.frontend = mesh.start("kvmesh-frontend", [])
        yield deployment
    finally:
        mesh.close()


def generate_on(daemon: Daemon, engine_id: int, prompt: list[int], request_id: str) -> list[int]:
    """An ordinary (aggregated) request straight to one worker: vLLM computes the whole prompt itself."""
    request = worker_pb2.GenerateRequest(
        request_id=request_id,
        engine_id=engine_id,
        token_ids=prompt,
        sampling=worker_pb2.SamplingOptions(max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    with grpc.insecure_channel(daemon.address) as channel:
        stream = worker_pb2_grpc.WorkerServiceStub(channel).GenerateStream(
            iter([worker_pb2.GenerateStreamRequest(requests=[request])]), timeout=120
        )
        outputs = [output for message in stream for output in message.outputs]
    assert not any(o.error_code for o in outputs), outputs
    return [token for output in outputs for token in output.response.token_ids]


@pytest.mark.timeout(600)  # two vLLM engines start in the fixture: 25-50 s each, more on a loaded machine
def test_a_disaggregated_request_equals_vllms_aggregated_output_and_the_decode_engine_pulled_the_kv(
    pd: PdMesh,
) -> None:
    prompt = unique_ids(3 * BLOCK_SIZE + 7, random.Random(21))  # 3 full blocks and a partial one
    before = pd.decode_counters()
    spec = {
        "request_id": "pd",
        "ids": prompt,
        "max_tokens": MAX_TOKENS,
        "sampling": {"temperature": 0.0},  # greedy (KServe's default is 1.0)
        "flags": {"return_output_ids": True},
    }
    report = triton(pd.mesh, [spec])["pd"]
    params = report["params"]
    assert (report["num_tokens"], report["finish_reason"]) == (MAX_TOKENS, "length")
    assert params["kvmesh.disagg"] == "remote", params
    assert params["kvmesh.prefill_worker_id"] == pd.engine_id(pd.prefill)
    assert params["kvmesh.worker_id"] == pd.engine_id(pd.decode)
    assert params["kvmesh.kv_transferred_blocks"] == 4  # vLLM offers every block of the prompt, partial included

    # The decode engine's vLLM loaded the prompt through its KV connector (NIXL READ), computing at most the
    # few trailing tokens it recomputes by design, and NIXL moved bytes.
    after = pd.decode_counters()
    pulled = after["kvmesh_engine_kv_pulled_tokens_total"] - before["kvmesh_engine_kv_pulled_tokens_total"]
    computed = after["kvmesh_engine_prefill_tokens_total"] - before["kvmesh_engine_prefill_tokens_total"]
    assert pulled >= 3 * BLOCK_SIZE, (before, after)
    assert computed < BLOCK_SIZE, (before, after)
    assert after["kvmesh_engine_kv_pulled_bytes_total"] > before["kvmesh_engine_kv_pulled_bytes_total"]

    # The aggregated reference: the prefill worker's vLLM runs the same prompt by itself, greedy.
    reference = generate_on(pd.prefill, pd.engine_id(pd.prefill), prompt, "reference")
    assert report["output_ids"] == reference
    # ... and the tokens follow the prompt (the equality is not that of a constant output).
    other = generate_on(pd.prefill, pd.engine_id(pd.prefill), unique_ids(len(prompt), random.Random(22)), "other")
    assert other != reference


def _wait_load(
    daemon: Daemon, done: Callable[[worker_pb2.EngineLoad], bool], timeout: float, *, fresh: bool = True
) -> float:
    """Seconds until the worker's ``WatchLoad`` reports a load for which ``done`` holds. The first message is
    the engine's last recorded load, which may predate the request: with ``fresh`` only later ones count.
    (Messages come when the load changes, so an engine already in the awaited state sends only that one.)"""
    start = time.monotonic()
    with grpc.insecure_channel(daemon.address) as channel:
        call = worker_pb2_grpc.WorkerServiceStub(channel).WatchLoad(
            worker_pb2.WatchLoadRequest(forward_pass_metrics=True), timeout=timeout
        )
        for index, message in enumerate(call):
            if (index or not fresh) and done(message.loads[0]):
                call.cancel()
                return time.monotonic() - start
    raise AssertionError(f"{daemon.address}: the load never matched within {timeout:g}s")


@pytest.mark.timeout(300)
def test_a_client_gone_mid_decode_aborts_the_decode_engine_and_leaves_no_blocks_held(pd: PdMesh) -> None:
    """The client process dies while the decode engine streams (after the NIXL pull): the frontend
    cancels the decode leg, and within seconds neither engine holds a request or a block in use."""
    prompt = unique_ids(3 * BLOCK_SIZE + 7, random.Random(23))
    spec = {"request_id": "gone", "ids": prompt, "max_tokens": 1000, "sampling": {"ignore_eos": True}}
    client = stream_client(pd.mesh.frontend.address, [spec])  # type: ignore[union-attr]
    _wait_load(pd.decode, lambda load: load.running >= 1, 120)  # decoding: the prompt's KV was pulled
    client.kill()
    client.wait()

    def idle(load: worker_pb2.EngineLoad) -> bool:  # the decode engine ran the request: no stale idle here
        return (load.running, load.waiting, load.active_blocks) == (0, 0, 0)

    freed = _wait_load(pd.decode, idle, 30, fresh=False)
    _wait_load(pd.prefill, idle, 30, fresh=False)
    print(f"\n[client gone mid-decode] decode engine idle {freed:.2f} s after the client died")


def _engine_processes(worker: Daemon) -> list[int]:
    """A vLLM worker's engine: its EngineCore process(es) and the model process(es) below them."""
    cores = engine_core_pids(worker.proc.pid)
    assert cores, "no EngineCore child process found"
    return [*cores, *sorted(model_processes(cores))]


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by init, whenever it gets to it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _signal(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


@pytest.mark.timeout(400)
def test_a_prefill_worker_killed_before_the_decode_engine_reads_its_kv_leaves_the_decode_engine_to_prefill_it(
    pd: PdMesh,
) -> None:
    """The prefill leg is done and the decode worker holds the request, but its engine (frozen) has not read
    the KV yet when the prefill worker and its engine are killed. The decode engine's NIXL READ then fails and
    vLLM fails the request (``kv_load_failure_policy`` "fail", finish reason "error"): the worker reports it
    in-band as a failed pull, never as a finished request (it once came back as an empty "stop"), and the
    frontend prefills it on the decode engine: one whole stream, the tokens of an aggregated run. Then a new
    prefill worker replaces the dead one for the rest of the module."""
    prompt = unique_ids(30 * BLOCK_SIZE + 5, random.Random(25))  # 31 blocks to read
    decode_engine = _engine_processes(pd.decode)
    prefill_engine = _engine_processes(pd.prefill)
    _signal(decode_engine, signal.SIGSTOP)
    try:
        spec = {"request_id": "unread", "ids": prompt, "max_tokens": MAX_TOKENS,
                "sampling": {"temperature": 0.0}, "flags": {"return_output_ids": True}}  # fmt: skip
        client = stream_client(pd.mesh.frontend.address, [spec], timeout=300)  # type: ignore[union-attr]
        wait_until_queued(pd.decode.address, len(prompt), timeout=120)  # the prefill leg is done
        pd.prefill.proc.kill()
        _signal(prefill_engine, signal.SIGKILL)
        pd.prefill.proc.wait()
        killed = time.monotonic()
    finally:
        _signal(decode_engine, signal.SIGCONT)
    assert client.wait(150) == 0, client.stderr.read()[-3000:] if client.stderr else ""
    done = time.monotonic() - killed
    assert client.stdout is not None
    report = json.loads(client.stdout.read().splitlines()[-1])["unread"]
    params = report["params"]
    assert (report["num_tokens"], report["finish_reason"]) == (MAX_TOKENS, "length"), report
    assert params["kvmesh.disagg"] == "local: no other prefill engine after a failed one", params
    assert params["kvmesh.migrations"] == 1 and params["kvmesh.worker_id"] == pd.engine_id(pd.decode), params
    assert "could not pull request" in pd.decode.log_text()  # vLLM's "error" finish, read as a failed pull
    assert report["output_ids"] == generate_on(pd.decode, pd.engine_id(pd.decode), prompt, "unread-reference")
    _wait_load(pd.decode, lambda load: (load.running, load.waiting, load.active_blocks) == (0, 0, 0), 30, fresh=False)
    print(f"\n[prefill killed before the READ] the request was done {done:.2f} s after the kill")
    # A new prefill worker takes over: once discovery has it, requests are prefilled remotely again.
    pd.prefill = pd.start_worker("prefill").wait_serving(300)
    deadline = time.monotonic() + 120
    while True:
        again = {"request_id": "again", "ids": unique_ids(2 * BLOCK_SIZE, random.Random(26)), "max_tokens": 2}
        if triton(pd.mesh, [again])["again"]["params"]["kvmesh.disagg"] == "remote":
            break
        assert time.monotonic() < deadline, "the new prefill worker never got a request"
        time.sleep(1)


@pytest.mark.timeout(300)
def test_a_prefill_worker_killed_holding_a_request_leaves_the_decode_engine_to_prefill_it(pd: PdMesh) -> None:
    """The prefill worker dies while it holds a request (its engine frozen first, so the request can neither
    finish nor hand its KV over before the kill): the decode engine's vLLM prefills it itself, and the client
    sees one whole stream. Only the worker is killed: vLLM's engine processes, which would outlive it
    (vllm-project/vllm#55510), go down with it. Last in this module: the mesh loses its prefill worker."""
    prompt = unique_ids(3 * BLOCK_SIZE + 7, random.Random(24))
    engine = _engine_processes(pd.prefill)
    cores = engine_core_pids(pd.prefill.proc.pid)
    for pid in cores:
        os.kill(pid, signal.SIGSTOP)
    spec = {"request_id": "orphan", "ids": prompt, "max_tokens": MAX_TOKENS, "sampling": {"ignore_eos": True}}
    client = stream_client(pd.mesh.frontend.address, [spec])  # type: ignore[union-attr]
    wait_until_queued(pd.prefill.address, len(prompt))  # the prefill worker holds it; its frozen engine ran nothing
    pd.prefill.proc.kill()  # only the worker: its orphan guard takes vLLM's processes down with it
    pd.prefill.proc.wait()
    deadline = time.monotonic() + 30
    while left := [pid for pid in engine if _running(pid)]:
        assert time.monotonic() < deadline, f"vLLM's processes {left} outlived their SIGKILLed worker"
        time.sleep(0.1)
    assert client.wait(150) == 0, client.stderr.read()[-3000:] if client.stderr else ""
    assert client.stdout is not None
    report = json.loads(client.stdout.read().splitlines()[-1])["orphan"]
    params = report["params"]
    assert (report["num_tokens"], report["finish_reason"]) == (MAX_TOKENS, "length"), report
    # The prefill leg failed before any token: the frontend prefills on the decode engine instead (not a
    # migration: no decode engine failed, nothing streamed yet) and says why.
    assert params["kvmesh.disagg"] == "local: the prefill engine failed", params
    assert params["kvmesh.kv_transferred_blocks"] == 0 and params["kvmesh.migrations"] == 0, params
    assert params["kvmesh.worker_id"] == pd.engine_id(pd.decode)
    _wait_load(pd.decode, lambda load: (load.running, load.waiting, load.active_blocks) == (0, 0, 0), 30, fresh=False)
