"""A real vLLM engine behind kvmesh: stock tritonclient → frontend → router → ``kvmesh-worker --engine vllm``.

One vLLM worker serves the whole session (conftest.py): 48 blocks of 32 tokens, dummy weights, and
ZMQ batches 1 and 2 dropped on arrival so that the replay path runs. The tests run in file order;
the last one kills the engine.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kvmesh.hashing import block_hashes
from kvmesh.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh_cli.vllm_cores import keep_off_model_cores, model_processes

from tests.vllm.conftest import BLOCK_SIZE, MODEL, NUM_BLOCKS, VllmMesh

TRITON_STREAM = Path(__file__).with_name("triton_stream.py")
ROOT = Path(__file__).resolve().parents[2]


def unique_ids(n: int, rng: random.Random) -> list[int]:
    """Prompt token ids no other test uses (ids 10..2000 of the tiny model's 2048)."""
    return [rng.randrange(10, 2000) for _ in range(n)]


def triton(mesh: VllmMesh, specs: list[dict[str, object]], timeout: float = 120) -> dict[str, dict[str, object]]:
    assert mesh.frontend is not None
    out = subprocess.run(
        [sys.executable, str(TRITON_STREAM), mesh.frontend.address, MODEL, str(timeout)],
        input=json.dumps(specs),
        capture_output=True,
        text=True,
        timeout=timeout + 30,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, f"{out.stderr[-3000:]}\n{mesh.logs()}"
    report: dict[str, dict[str, object]] = json.loads(out.stdout.splitlines()[-1])
    return report


def stream_client(frontend: str, specs: list[dict[str, object]], timeout: float = 120) -> subprocess.Popen[str]:
    """The stock-tritonclient script of ``triton`` in a process of its own, returned once it sent ``specs``:
    for tests that kill something while the requests run. Its last stdout line is the report."""
    client = subprocess.Popen(
        [sys.executable, str(TRITON_STREAM), frontend, MODEL, str(timeout)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert client.stdin is not None and client.stdout is not None
    client.stdin.write(json.dumps(specs))
    client.stdin.close()
    assert client.stdout.readline().strip() == "sent"
    return client


def current_load(address: str) -> worker_pb2.EngineLoad:
    """A worker's (first) engine load now: the first message of a fresh WatchLoad stream, computed when it opens."""
    with grpc.insecure_channel(address) as channel:
        call = worker_pb2_grpc.WorkerServiceStub(channel).WatchLoad(worker_pb2.WatchLoadRequest(), timeout=10)
        load: worker_pb2.EngineLoad = next(call).loads[0]
        call.cancel()
    return load


def wait_until_queued(address: str, prompt_tokens: int, timeout: float = 60) -> None:
    """Until the worker holds a prompt of ``prompt_tokens`` as queued prefill. Polled: a frozen engine takes no
    step, so a WatchLoad stream sends nothing after its first message."""
    deadline = time.monotonic() + timeout
    while current_load(address).queued_prefill_tokens < prompt_tokens:
        assert time.monotonic() < deadline, f"{address} never held the request"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def worker(mesh: VllmMesh) -> Iterator[worker_pb2_grpc.WorkerServiceStub]:
    assert mesh.worker is not None
    with grpc.insecure_channel(mesh.worker.address) as channel:
        yield worker_pb2_grpc.WorkerServiceStub(channel)


@pytest.fixture(scope="module")
def engine_id(worker: worker_pb2_grpc.WorkerServiceStub) -> int:
    call = worker.WatchLoad(worker_pb2.WatchLoadRequest(), timeout=10)
    first = next(call)
    call.cancel()
    return int(first.loads[0].engine_id)


def dump_hashes(worker: worker_pb2_grpc.WorkerServiceStub, engine_id: int) -> set[int]:
    snapshot = worker.DumpKvIndex(worker_pb2.DumpKvIndexRequest(engine_id=engine_id)).snapshot
    return {h for stored in snapshot.stored for h in stored.block_hashes}


def test_tritonclient_streams_exactly_max_tokens_and_the_second_request_hits_vllms_prefix_cache(
    mesh: VllmMesh, worker: worker_pb2_grpc.WorkerServiceStub, engine_id: int
) -> None:
    prefix = unique_ids(100, random.Random(1))
    first = triton(mesh, [{"request_id": "a", "ids": prefix, "max_tokens": 7}])["a"]
    assert (first["num_tokens"], first["finish_reason"]) == (7, "length")
    assert first["params"]["kvmesh.cached_tokens"] == 0
    # The same 100-token prefix: vLLM reports 3 full blocks of 32 as cached, and kvmesh relays its count.
    second = triton(mesh, [{"request_id": "b", "ids": [*prefix, 5, 6, 7], "max_tokens": 5}])["b"]
    assert (second["num_tokens"], second["finish_reason"]) == (5, "length")
    assert second["params"]["kvmesh.cached_tokens"] == 3 * BLOCK_SIZE
    assert second["params"]["kvmesh.worker_id"] == engine_id
    # vLLM's KV events, re-hashed, give exactly kvmesh's hashes of the prompt's full blocks.
    _, sequence = block_hashes(prefix, BLOCK_SIZE)
    assert set(sequence) <= dump_hashes(worker, engine_id)


def test_the_mesh_moves_off_the_cores_vllm_binds_its_model_to(mesh: VllmMesh) -> None:
    """What ``kvmesh up`` does once vLLM is up: vLLM's own model process is found by name and keeps its
    binding; every other process of the mesh (vLLM's scheduler included) moves to the cores left over.
    The rest of this module then runs on that placement."""
    daemons = [d for d in (mesh.worker, mesh.router, mesh.frontend) if d is not None]
    split = keep_off_model_cores([d.proc.pid for d in daemons])
    if len(os.sched_getaffinity(0)) < 2:  # vLLM then binds the model to the only core: nothing is left over
        assert split is None
        return
    assert split is not None
    model_cores, serving = split
    assert model_cores and serving and not model_cores & serving
    assert model_cores | serving <= os.sched_getaffinity(0)
    for daemon in daemons:
        for tid in os.listdir(f"/proc/{daemon.proc.pid}/task"):
            assert os.sched_getaffinity(int(tid)) == serving, daemon.name
    models = model_processes([d.proc.pid for d in daemons])
    assert models and all(os.sched_getaffinity(pid) <= model_cores for pid in models)
    served = triton(mesh, [{"request_id": "pinned", "ids": unique_ids(40, random.Random(2)), "max_tokens": 4}])
    assert served["pinned"]["num_tokens"] == 4


def test_logprobs_are_vllms_own(mesh: VllmMesh) -> None:
    """main's contract (SamplingOptions.logprobs -> TokenLogprobs), filled from vLLM's own Logprob dicts."""
    flags = {"return_logprobs": True, "return_cumulative_logprob": True}
    spec = {
        "request_id": "lp",
        "ids": unique_ids(40, random.Random(5)),
        "max_tokens": 6,
        "sampling": {"logprobs": 2},
        "flags": flags,
    }
    report = triton(mesh, [spec])["lp"]
    steps = report["logprobs"]
    assert isinstance(steps, list) and len(steps) == 6
    for step in steps:  # {token: {logprob, rank, decoded_token}}: the sampled token first, then the top 2
        ranks = sorted(entry["rank"] for entry in step.values())
        assert 2 <= len(step) <= 3 and ranks[:2] == [1, 2], step
        assert all(entry["logprob"] <= 0 for entry in step.values())
    values = [next(iter(step.values()))["logprob"] for step in steps]
    # Not the mocker's stand-ins (those lie in (-4, 0] with rank 1 and no alternatives).
    assert report["cumulative_logprob"] == pytest.approx(sum(values), rel=1e-4, abs=1e-4)


def test_a_stream_interval_sends_the_same_tokens_in_vllms_chunks(mesh: VllmMesh) -> None:
    """``sampling_parameters.stream_interval`` as vLLM defines it (first token at once, then chunks of at
    least that many, the rest at the end): vLLM batches its own outputs, the tokens are the same."""
    prompt = unique_ids(60, random.Random(6))
    flags = {"return_output_ids": True}
    specs = [
        {"request_id": "every", "ids": prompt, "max_tokens": 33, "sampling": {"temperature": 0}, "flags": flags},
        {"request_id": "chunked", "ids": prompt, "max_tokens": 33, "flags": flags,
         "sampling": {"temperature": 0, "stream_interval": 8}},
    ]  # fmt: skip
    report = triton(mesh, specs)
    every, chunked = report["every"], report["chunked"]
    assert chunked["output_ids"] == every["output_ids"] and len(every["output_ids"]) == 33
    chunks = chunked["chunks"]
    assert sum(chunks) == 33 and chunks[0] == 1, chunks
    assert all(size >= 8 for size in chunks[1:-1]), chunks
    assert len(chunks) <= 5 < len(every["chunks"]), (chunks, every["chunks"])


def test_cancellation_frees_vllms_blocks_as_its_kv_events_show(
    worker: worker_pb2_grpc.WorkerServiceStub, engine_id: int
) -> None:
    rng = random.Random(2)
    start = worker.DumpKvIndex(worker_pb2.DumpKvIndexRequest(engine_id=engine_id)).snapshot.next_event_id
    events = worker.SubscribeKvEvents(
        worker_pb2.SubscribeKvEventsRequest(engine_id=engine_id, start_event_id=start), timeout=120
    )
    holder = unique_ids(20 * BLOCK_SIZE, rng)
    _, holder_hashes = block_hashes(holder, BLOCK_SIZE)
    sampling = worker_pb2.SamplingOptions(max_tokens=800, ignore_eos=True)
    requests: list[worker_pb2.GenerateStreamRequest] = [
        worker_pb2.GenerateStreamRequest(
            requests=[
                worker_pb2.GenerateRequest(request_id="hold", engine_id=engine_id, token_ids=holder, sampling=sampling)
            ]
        )
    ]
    import queue

    outbox: queue.Queue[worker_pb2.GenerateStreamRequest | None] = queue.Queue()
    outbox.put(requests[0])

    def messages() -> Iterator[worker_pb2.GenerateStreamRequest]:
        while (item := outbox.get()) is not None:
            yield item

    stream = worker.GenerateStream(messages(), timeout=120)
    got_tokens = next(stream)  # 'hold' has prefilled: its 20 blocks are stored and referenced
    assert got_tokens.outputs[0].request_id == "hold"
    # Cancel it, then ask for 41 of the 47 usable blocks: possible only if 'hold' released its blocks.
    big = unique_ids(40 * BLOCK_SIZE, rng)
    outbox.put(worker_pb2.GenerateStreamRequest(cancel_request_ids=["hold"]))
    outbox.put(
        worker_pb2.GenerateStreamRequest(
            requests=[
                worker_pb2.GenerateRequest(
                    request_id="big",
                    engine_id=engine_id,
                    token_ids=big,
                    sampling=worker_pb2.SamplingOptions(max_tokens=8, ignore_eos=True),
                )
            ]
        )
    )
    outbox.put(None)
    big_tokens = 0
    for message in stream:
        for output in message.outputs:
            if output.request_id == "hold":
                continue  # passes that ran before the cancel arrived
            assert not output.error_code, output.error_message
            big_tokens += len(output.response.token_ids)
    assert big_tokens == 8
    removed: set[int] = set()
    deadline = time.monotonic() + 10
    for item in events:
        for event in item.events.events:
            if event.HasField("removed"):
                removed.update(event.removed.block_hashes)
        if removed & set(holder_hashes) or time.monotonic() > deadline:
            break
    events.cancel()
    assert removed & set(holder_hashes), "the cancelled request's blocks were never evicted"


def test_router_index_equals_the_workers_dump_after_eviction_heavy_traffic(
    mesh: VllmMesh, worker: worker_pb2_grpc.WorkerServiceStub, engine_id: int
) -> None:
    rng = random.Random(3)
    prompts = [unique_ids(10 * BLOCK_SIZE + 5, rng) for _ in range(12)]  # 12 x 11 blocks through 47
    report = triton(mesh, [{"request_id": f"e{i}", "ids": p, "max_tokens": 4} for i, p in enumerate(prompts)])
    assert all(r["num_tokens"] == 4 for r in report.values())
    engine_blocks = dump_hashes(worker, engine_id)
    assert len(engine_blocks) < NUM_BLOCKS
    assert not set(block_hashes(prompts[0], BLOCK_SIZE)[1]) <= engine_blocks, "nothing was evicted"
    assert mesh.router is not None
    with grpc.insecure_channel(mesh.router.address) as channel:
        router = router_pb2_grpc.RouterServiceStub(channel)
        deadline = time.monotonic() + 10
        while True:
            dump = router.DumpIndex(router_pb2.DumpIndexRequest(engine_ids=[engine_id]), timeout=5)
            indexed = {h for e in dump.engines for h in e.block_hashes}
            if indexed == engine_blocks or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert indexed == engine_blocks


def test_batches_missing_from_the_zmq_stream_are_recovered_by_vllms_replay(mesh: VllmMesh) -> None:
    assert mesh.worker is not None
    log = mesh.worker.log_text()
    assert "vLLM KV events 1..1 recovered from the replay endpoint" in log or (
        "vLLM KV events 1..2 recovered from the replay endpoint" in log
    ), log[-3000:]
    assert "are lost" not in log
    # The index built from the recovered stream is the one the previous tests compared: stores from
    # batches 1 and 2 are in the router's index and the worker's dump alike.


def test_watch_load_reports_vllms_own_scheduler_figures(
    worker: worker_pb2_grpc.WorkerServiceStub, engine_id: int
) -> None:
    """Running requests, KV usage and per-pass tokens come from vLLM's stat logger."""
    watch = worker.WatchLoad(worker_pb2.WatchLoadRequest(forward_pass_metrics=True), timeout=60)
    next(watch)  # the current load
    prompt = unique_ids(6 * BLOCK_SIZE, random.Random(11))
    sampling = worker_pb2.SamplingOptions(max_tokens=200, ignore_eos=True)
    request = worker_pb2.GenerateRequest(request_id="load", engine_id=engine_id, token_ids=prompt, sampling=sampling)
    stream = worker.GenerateStream(iter([worker_pb2.GenerateStreamRequest(requests=[request])]), timeout=60)
    busy = None
    prefill_tokens = decode_tokens = 0
    for message in watch:
        prefill_tokens += sum(p.prefill_tokens for p in message.passes)
        decode_tokens += sum(p.decode_tokens for p in message.passes)
        busy = next((x for x in message.loads if x.running >= 1 and x.active_blocks >= 6), busy)
        if busy is not None and decode_tokens > 10:
            break
    watch.cancel()
    assert sum(len(o.response.token_ids) for m in stream for o in m.outputs) == 200
    assert busy is not None and busy.total_blocks == NUM_BLOCKS
    assert prefill_tokens >= len(prompt) - 5 * BLOCK_SIZE  # some of it may have been cached already


def test_bad_requests_get_a_clear_status(worker: worker_pb2_grpc.WorkerServiceStub, engine_id: int) -> None:
    sampling = worker_pb2.SamplingOptions(max_tokens=4)
    bad = [
        worker_pb2.GenerateRequest(request_id="vocab", engine_id=engine_id, token_ids=[5, 4096], sampling=sampling),
        worker_pb2.GenerateRequest(
            request_id="long",
            engine_id=engine_id,
            token_ids=[5] * 1500,
            sampling=worker_pb2.SamplingOptions(max_tokens=10),
        ),
        worker_pb2.GenerateRequest(  # past vLLM's max_logprobs (20): vLLM itself refuses it
            request_id="logprobs",
            engine_id=engine_id,
            token_ids=[5, 6],
            sampling=worker_pb2.SamplingOptions(max_tokens=4, logprobs=50),
        ),
    ]
    outputs = [
        o for m in worker.GenerateStream(iter([worker_pb2.GenerateStreamRequest(requests=bad)])) for o in m.outputs
    ]
    by_id = {o.request_id: o for o in outputs}
    assert by_id["vocab"].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "outside the vocabulary" in by_id["vocab"].error_message
    assert by_id["long"].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "context length 1504" in by_id["long"].error_message
    # Refused by vLLM rather than by the worker's own checks: a status with vLLM's reason, not a finish.
    refused = [o for o in outputs if o.request_id == "logprobs"]
    assert [o.error_code for o in refused] == [grpc.StatusCode.INVALID_ARGUMENT.value[0]], refused
    assert refused[0].error_message.startswith("vLLM refused the request: ") and "logprobs" in refused[0].error_message


def engine_core_pids(worker_pid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == worker_pid and "EngineCore" in (stat + cmdline):
            pids.append(int(entry.name))
    return pids


def test_an_engine_death_stops_the_worker_and_its_requests_migrate_to_a_mocker(fresh_mesh: VllmMesh) -> None:
    # Its own mesh: it kills the engine, and after the shared mesh's earlier tests (full cache, dropped
    # event sequences) the router could place the request on the mocker from the start.
    mesh = fresh_mesh
    assert mesh.worker is not None and mesh.frontend is not None
    # A prefix vLLM holds, so that the KV router sends the long request there and not to the mocker.
    prefix = unique_ids(10 * BLOCK_SIZE, random.Random(7))
    triton(mesh, [{"request_id": "warm", "ids": prefix, "max_tokens": 1}])
    # Idle again, the engine says so: vLLM's last stats (taken before "warm" finished) still counted it
    # running with its blocks in use, and that stale load once sent "long" to the idle mocker instead.
    idle = current_load(mesh.worker.address)
    assert (idle.running, idle.waiting, idle.active_blocks) == (0, 0, 0)
    cores = engine_core_pids(mesh.worker.proc.pid)
    assert cores, "no EngineCore child process found"
    # vLLM's sockets and its rendezvous file (which a killed engine leaves behind) are in the worker's scratch.
    environ = dict(
        item.split("=", 1) for item in Path(f"/proc/{cores[0]}/environ").read_text().split("\0") if "=" in item
    )
    scratch = Path(environ["VLLM_RPC_BASE_PATH"])
    assert environ["TMPDIR"] == str(scratch)
    assert list(scratch.glob("vllm_dist_*")), sorted(p.name for p in scratch.iterdir())
    # The engine is frozen before "long" reaches it, so "long" can neither run nor finish before the kill.
    # (Killing once vLLM reported it running raced on a loaded machine: this tiny model decodes 1000 tokens
    # in about a second, and "long" had finished on vLLM, with no migration to show, by the time the
    # report reached the test.)
    for pid in cores:
        os.kill(pid, signal.SIGSTOP)
    mesh.mocker()  # somewhere to migrate to
    long_ids = [*prefix, 11, 12, 13, 14]
    client = stream_client(mesh.frontend.address, [{"request_id": "long", "ids": long_ids, "max_tokens": 1000}])
    # Kill once the worker holds "long" for vLLM: its prompt is queued prefill there (nothing has run yet).
    wait_until_queued(mesh.worker.address, len(long_ids))
    for pid in cores:
        os.kill(pid, signal.SIGKILL)
    assert mesh.worker.wait(30) == 1
    assert "died" in mesh.worker.log_text()
    deadline = time.monotonic() + 15  # the orphan guard removes the scratch once the engine's processes are gone
    while scratch.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not scratch.exists(), sorted(p.name for p in scratch.iterdir())
    assert client.wait(150) == 0, client.stderr.read()[-3000:] if client.stderr else ""
    assert client.stdout is not None
    outcome = json.loads(client.stdout.read().splitlines()[-1])["long"]
    assert (outcome["num_tokens"], outcome["finish_reason"]) == (1000, "length")
    assert outcome["params"]["kvmesh.migrations"] >= 1
