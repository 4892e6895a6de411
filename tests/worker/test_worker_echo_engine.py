"""A second engine served by the real ``kvmesh-worker`` with no change to the worker's gRPC side.

``tests/worker/echo_engine.py`` implements the ``Engine`` interface from outside the package;
``--engine tests.worker.echo_engine:build`` makes the registry import it. Every RPC then works
through the interface alone: generation on ``GenerateStream``, the model card, the KV journal (the
shared ``kvmesh.kv_publisher``), load with forward-pass metrics, Prometheus, ``ReleaseKv``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from kvmesh.hashing import block_hashes
from kvmesh.v1 import worker_pb2, worker_pb2_grpc
from kvmesh_bench.prometheus_text import metrics_url, samples

from tests.support.daemons import Daemon, run_cli
from tests.support.etcd import free_port
from tests.support.generate import RequestFailed, StreamClient, engine_ids, generate, tokens_of

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
ENGINE = "tests.worker.echo_engine:build"
BLOCK = 4


@pytest.fixture(scope="module")
def echo_worker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("echo")
    port, metrics_port = free_port(), free_port()
    daemon = Daemon(
        "kvmesh-worker",
        [
            "--engine", ENGINE,
            "--num-engines", "2",
            "--discovery", f"file://{tmp / 'discovery'}",
            "--namespace", "echo",
            "--grpc-port", str(port),
            "--metrics-port", str(metrics_port),
            "--block-size", str(BLOCK),
            "--drain-timeout", "1",
        ],
        tmp,
        port,
        env={"PYTHONPATH": str(REPO)},
    )  # fmt: skip
    daemon.metrics_port = metrics_port
    try:
        yield daemon.wait_serving(60)
    finally:
        daemon.close()


@pytest.fixture
async def stub(echo_worker):
    async with grpc.aio.insecure_channel(echo_worker.address) as channel:
        yield worker_pb2_grpc.WorkerServiceStub(channel)


def request(request_id: str, engine: int, tokens: list[int], max_tokens: int) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=request_id,
        engine_id=engine,
        token_ids=tokens,
        sampling=worker_pb2.SamplingOptions(max_tokens=max_tokens),
    )


async def test_the_echo_engine_generates_its_prompt_back_and_advertises_its_kind(stub):
    engines = await engine_ids(stub)
    assert len(engines) == 2
    prompt = [5, 6, 7, 8, 9]
    responses = await generate(stub, request("e1", engines[0], prompt, 12))
    assert tokens_of(responses) == (prompt * 3)[:12]
    assert responses[0].num_prompt_tokens == len(prompt)
    assert responses[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
    card = (await stub.GetModelCard(worker_pb2.GetModelCardRequest(engine_id=engines[1]))).card
    assert card.capabilities.engine_kind == "echo" and card.block_size == BLOCK and card.engine_id == engines[1]


async def test_its_failures_come_back_in_band_like_the_mockers(stub):
    engines = await engine_ids(stub)
    with pytest.raises(RequestFailed) as error:
        await generate(stub, request("empty", engines[0], [], 3))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and "no tokens" in error.value.message
    with pytest.raises(grpc.aio.AioRpcError) as release:
        await stub.ReleaseKv(worker_pb2.ReleaseKvRequest(engine_id=engines[0], transfer_id="t"))
    assert release.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_a_request_the_engine_fails_itself_ends_in_band_after_the_tokens_it_streamed(stub):
    """An engine that fails a request after it started (vLLM's retryable "error" finish) says so with an
    output carrying an error code: the request ends in-band with that status, never as a finished request,
    and a request beside it on the same stream is untouched."""
    engine = (await engine_ids(stub))[0]
    client = StreamClient(stub)
    await client.send([request("fails", engine, [0, 7, 8], 5), request("beside", engine, [7, 8], 5)])
    await client.call.done_writing()
    async with asyncio.timeout(10):
        await client.ended.wait()
    assert client.tokens("fails") == [0]  # the token streamed before the failure
    failed = client.final("fails")
    assert failed is not None and not failed.response.finish_reason
    assert RequestFailed(failed).code == grpc.StatusCode.UNAVAILABLE
    assert failed.error_message == "echo: the engine failed the request"
    assert client.tokens("beside") == [7, 8, 7, 8, 7]
    assert client.final("beside").response.finish_reason == worker_pb2.FINISH_REASON_LENGTH


async def test_its_kv_events_reach_subscribers_through_the_shared_publisher(stub):
    engine = (await engine_ids(stub))[1]
    call = stub.SubscribeKvEvents(worker_pb2.SubscribeKvEventsRequest(engine_id=engine))
    snapshot = (await call.read()).snapshot
    prompt = list(range(100, 100 + 3 * BLOCK + 1))  # three full blocks and a partial one
    responses = await generate(stub, request("kv1", engine, prompt, 2))
    assert responses[0].num_cached_tokens == 0
    async with asyncio.timeout(10):
        live = (await call.read()).events
    call.cancel()
    local, sequence = block_hashes(prompt, BLOCK)
    (event,) = live.events
    assert event.event_id == snapshot.next_event_id
    assert list(event.stored.block_hashes) == sequence and list(event.stored.tokens_hashes) == local
    # the same prefix again is a cache hit: no new event, and the dump holds the blocks
    again = await generate(stub, request("kv2", engine, prompt[: 2 * BLOCK], 1))
    assert again[0].num_cached_tokens == 2 * BLOCK
    dump = await stub.DumpKvIndex(worker_pb2.DumpKvIndexRequest(engine_id=engine))
    assert dump.snapshot.next_event_id == event.event_id + 1
    assert set(sequence) <= {h for s in dump.snapshot.stored for h in s.block_hashes}


async def test_its_passes_reach_watchers_and_prometheus(echo_worker, stub):
    engine = (await engine_ids(stub))[0]
    watch = stub.WatchLoad(worker_pb2.WatchLoadRequest(engine_ids=[engine], forward_pass_metrics=True))
    await watch.read()
    await generate(stub, request("p1", engine, [3, 4, 5], 4))
    passes: list[worker_pb2.ForwardPassMetrics] = []
    async with asyncio.timeout(10):
        while sum(p.decode_tokens for p in passes) < 3:
            passes.extend((await watch.read()).passes)
    watch.cancel()
    assert passes[0].prefill_tokens == 3 and {p.engine_id for p in passes} == {engine}
    values = {(s.name, s.labels.get("engine")): s.value for s in samples(metrics_url(echo_worker.metrics_port))}
    assert values["kvmesh_engine_passes_total", f"{engine:x}"] >= 4
    assert values["kvmesh_engine_decode_tokens_total", f"{engine:x}"] >= 3


@pytest.mark.parametrize(
    ("engine", "says"),
    [
        ("nope", "unknown engine 'nope'"),
        ("tests.worker.no_such_module:build", "cannot import"),
        ("os:getcwd", "os:getcwd is not an engine factory (it must take settings, model files)"),
    ],
)
def test_an_engine_that_cannot_be_found_exits_2_with_one_line(tmp_path, engine, says):
    result = run_cli("kvmesh-worker", "--discovery", f"file://{tmp_path / 'discovery'}", "--engine", engine, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr
