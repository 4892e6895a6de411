"""A real ``kvmesh-worker`` process over real gRPC: requests, load, discovery, model files, metrics.

Two workers serve the whole module (starting one costs seconds on a shared machine):

- ``worker``: two engines of the built-in model, no sleeping (``--speedup-ratio 0``), a
  ``--max-model-len``, Prometheus on ``--metrics-port``;
- ``slow_worker``: one engine of a copy of the built-in model under another name (its tokenizer
  padded past the 1 MiB chunk size), slow (``--speedup-ratio 0.04``: 0.15-0.85 s per decode pass),
  ``--max-num-seqs 1 --max-waiting-requests 1``, for cancellation and the queue bound.
"""

from __future__ import annotations

import array
import asyncio
import hashlib
import itertools
import shutil
import signal
import time

import grpc
import pytest
from kvmesh.discovery import instance_prefix, model_prefix, open_discovery
from kvmesh.v1 import discovery_pb2, worker_pb2, worker_pb2_grpc
from kvmesh_bench.prometheus_text import metrics_url, samples
from kvmesh_worker.model_files import BUILTIN_MODELS, DEFAULT_MODEL, SERVED_FILES, load_model_files

from tests.support.daemons import Daemon, run_cli
from tests.support.etcd import free_port
from tests.support.generate import RequestFailed, StreamClient, engine_ids, generate, tokens_of

pytestmark = pytest.mark.e2e

BUILTIN = BUILTIN_MODELS / DEFAULT_MODEL
NUM_BLOCKS = 128
BLOCK = 4
MAX_MODEL_LEN = 256
VOCAB = 2048  # the built-in model's


def start(tmp, name: str, namespace: str, *extra: str) -> Daemon:
    port = free_port()
    metrics_port = free_port()
    daemon = Daemon(
        "kvmesh-worker",
        [
            "--discovery", f"file://{tmp / 'discovery'}",
            "--namespace", namespace,
            "--lease-ttl", "2",
            "--drain-timeout", "1",
            "--grpc-port", str(port),
            "--metrics-port", str(metrics_port),
            "--block-size", str(BLOCK),
            *extra,
        ],
        tmp,
        port,
    )  # fmt: skip
    daemon.metrics_port = metrics_port
    daemon.discovery = f"file://{tmp / 'discovery'}"
    daemon.namespace = namespace
    daemon.model_dir = None
    return daemon


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("worker")
    daemon = start(
        tmp,
        "fast",
        "wsvc",
        "--num-engines", "2",
        "--num-gpu-blocks", str(NUM_BLOCKS),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--speedup-ratio", "0",
    )  # fmt: skip
    daemon.model_dir = BUILTIN
    try:
        yield daemon.wait_serving()
    finally:
        daemon.close()


@pytest.fixture(scope="module")
def slow_worker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slow-worker")
    model_dir = tmp / "my-model"
    shutil.copytree(BUILTIN, model_dir)
    with open(model_dir / "tokenizer.json", "ab") as f:  # still valid JSON; now streamed in two chunks
        f.write(b" " * (1 << 20) + b"\n")
    daemon = start(
        tmp,
        "slow",
        "wslow",
        "--model-path", str(model_dir),
        "--num-gpu-blocks", "256",
        "--speedup-ratio", "0.04",
        "--max-num-seqs", "1",
        "--max-waiting-requests", "1",
    )  # fmt: skip
    daemon.model_dir = model_dir
    try:
        yield daemon.wait_serving()
    finally:
        daemon.close()


_rids = itertools.count()


def request(engine: int, tokens, max_tokens: int, **sampling) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=f"t{next(_rids)}",
        engine_id=engine,
        token_ids=list(tokens),
        sampling=worker_pb2.SamplingOptions(max_tokens=max_tokens, **sampling),
    )


@pytest.fixture
async def channel(worker):
    async with grpc.aio.insecure_channel(worker.address) as channel:
        yield channel


@pytest.fixture
async def slow_channel(slow_worker):
    async with grpc.aio.insecure_channel(slow_worker.address) as channel:
        yield channel


@pytest.fixture
async def stream(channel):
    """(the worker's engine ids, a GenerateStream client on it), closed after the test."""
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    engines = await engine_ids(stub)
    client = StreamClient(stub)
    try:
        yield engines, client
    finally:
        await client.close()


def scrape(daemon: Daemon) -> dict[tuple[str, str], float]:
    """(sample name, engine label) -> value of every kvmesh_engine_* sample."""
    return {
        (sample.name, sample.labels.get("engine", "")): sample.value
        for sample in samples(metrics_url(daemon.metrics_port))
        if sample.name.startswith("kvmesh_engine_")
    }


async def read_discovery(daemon: Daemon) -> tuple[dict[str, bytes], dict[str, bytes]]:
    discovery = await open_discovery(daemon.discovery, ttl=2.0)
    try:
        return (
            await discovery.get_prefix(instance_prefix(daemon.namespace, "worker")),
            await discovery.get_prefix(model_prefix(daemon.namespace)),
        )
    finally:
        await discovery.close()


# -- generation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [1, 2, 17, 100])
async def test_ignore_eos_gives_exactly_max_tokens(channel, max_tokens):
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    engine = (await engine_ids(stub))[0]
    responses = await generate(stub, request(engine, range(3, 40), max_tokens, ignore_eos=True))
    tokens = tokens_of(responses)
    assert len(tokens) == max_tokens
    assert all(0 <= t < VOCAB for t in tokens)
    assert responses[0].num_prompt_tokens == 37
    assert responses[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
    assert all(r.finish_reason == worker_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])


async def test_a_request_at_exactly_the_context_length_is_served(channel):
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    engine = (await engine_ids(stub))[1]
    prompt = [5 + i % 100 for i in range(MAX_MODEL_LEN - 10)]
    tokens = tokens_of(await generate(stub, request(engine, prompt, 10, ignore_eos=True)))
    assert len(tokens) == 10


# -- validation ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tokens", "max_tokens", "limit"),
    [
        ([], 5, "no tokens"),
        ([1, 2, VOCAB], 5, f"vocab_size={VOCAB}"),
        ([1, 2, 3], 0, "max_tokens=0"),
        (range(3, 200), MAX_MODEL_LEN - 196, f"context_length={MAX_MODEL_LEN}"),
    ],
    ids=["empty-prompt", "token-outside-vocab", "max-tokens-0", "beyond-context-length"],
)
async def test_bad_request_is_invalid_argument_naming_the_limit(channel, tokens, max_tokens, limit):
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    engine = (await engine_ids(stub))[0]
    with pytest.raises(RequestFailed) as error:
        await generate(stub, request(engine, tokens, max_tokens, ignore_eos=True))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert limit in error.value.message


@pytest.mark.parametrize(
    ("sampling", "why"),
    [
        ({"temperature": -1.0}, "temperature must be finite and >= 0"),
        ({"temperature": float("nan")}, "temperature must be finite and >= 0"),
        ({"top_p": 5.0}, "top_p must be in (0, 1]"),
        ({"top_k": -5}, "top_k must be -1 or 0"),
        ({"min_tokens": 100}, "min_tokens (100) must not exceed max_tokens (2)"),
        ({"stop_token_ids": [5] * 1025}, "1025 stop_token_ids; at most 1024"),
    ],
    ids=["negative-temperature", "nan-temperature", "top-p-5", "top-k-minus-5", "min-over-max", "stop-ids"],
)
async def test_sampling_no_engine_can_honour_is_invalid_argument(channel, sampling, why):
    """The mocker took these silently (vLLM refuses them); now every engine refuses them the same way."""
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    engine = (await engine_ids(stub))[0]
    with pytest.raises(RequestFailed) as error:
        await generate(stub, request(engine, [3, 4, 5], 2, **sampling))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert why in error.value.message


async def test_a_prompt_sent_as_u32_bytes_generates_what_the_same_ids_do(channel):
    """The frontend's compact form (``token_ids_u32le``) is the same prompt as ``token_ids``."""
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    engine = (await engine_ids(stub))[0]
    prompt = list(range(3, 200))
    as_ids = request(engine, prompt, 12, ignore_eos=True, seed=7)
    as_bytes = request(engine, [], 12, ignore_eos=True, seed=7)
    as_bytes.token_ids_u32le = array.array("I", prompt).tobytes()
    by_ids, by_bytes = await generate(stub, as_ids), await generate(stub, as_bytes)
    assert tokens_of(by_bytes) == tokens_of(by_ids) and len(tokens_of(by_bytes)) == 12
    assert by_bytes[0].num_prompt_tokens == by_ids[0].num_prompt_tokens == len(prompt)
    assert by_bytes[-1].num_cached_tokens > 0  # the same blocks: the second request hits the first's cache


@pytest.mark.parametrize(
    ("ids", "raw", "why"),
    [([], b"\x05\x00\x00", "3 bytes"), ([5, 6], array.array("I", [5, 6]).tobytes(), "both token_ids and")],
    ids=["not-whole-ids", "both-forms"],
)
async def test_a_malformed_compact_prompt_is_invalid_argument(channel, ids, raw, why):
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    engine = (await engine_ids(stub))[0]
    bad = request(engine, ids, 5)
    bad.token_ids_u32le = raw
    with pytest.raises(RequestFailed) as error:
        await generate(stub, bad)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids_u32le must hold the whole prompt" in error.value.message and why in error.value.message


async def test_unknown_engine_is_not_found_on_every_rpc(channel):
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    unknown = max(await engine_ids(stub)) + 1
    with pytest.raises(RequestFailed) as failed:
        await generate(stub, request(unknown, [1, 2, 3], 1))
    assert failed.value.code == grpc.StatusCode.NOT_FOUND and f"{unknown:x}" in failed.value.message
    streams = [
        stub.SubscribeKvEvents(worker_pb2.SubscribeKvEventsRequest(engine_id=unknown)),
        stub.WatchLoad(worker_pb2.WatchLoadRequest(engine_ids=[unknown])),
        stub.GetModelFile(worker_pb2.GetModelFileRequest(engine_id=unknown, name="config.json")),
    ]
    for call in streams:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call.read()
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        assert f"{unknown:x}" in error.value.details()
    for unary in (
        stub.DumpKvIndex(worker_pb2.DumpKvIndexRequest(engine_id=unknown)),
        stub.GetModelCard(worker_pb2.GetModelCardRequest(engine_id=unknown)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await unary
        assert error.value.code() == grpc.StatusCode.NOT_FOUND


# -- discovery, model card, model files ------------------------------------------------------------
async def test_two_engines_are_distinct_instances_with_their_own_model_cards(worker, channel):
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    engines = await engine_ids(stub)
    assert len(engines) == 2 and len(set(engines)) == 2
    instances, models = await read_discovery(worker)
    records = [discovery_pb2.InstanceRecord.FromString(v) for v in instances.values()]
    cards = [discovery_pb2.ModelCard.FromString(v) for v in models.values()]

    assert sorted(r.instance_id for r in records) == sorted(engines)
    assert sorted(r.engine_index for r in records) == [0, 1]
    assert len({r.lease_id for r in records}) == 1  # one process, one lease
    assert all(r.address == worker.address and r.model == DEFAULT_MODEL for r in records)
    assert all(r.role == discovery_pb2.WORKER_ROLE_AGGREGATED for r in records)
    assert {r.metrics_address for r in records} == {f"127.0.0.1:{worker.metrics_port}"}

    assert sorted(c.engine_id for c in cards) == sorted(engines)
    for card in cards:
        assert card.name == DEFAULT_MODEL
        assert card.address == worker.address
        assert (card.block_size, card.context_length, card.total_kv_blocks) == (BLOCK, MAX_MODEL_LEN, NUM_BLOCKS)
        assert card.vocab_size == VOCAB
        # the default bounds, advertised: frontends and routers bound admission by running + waiting slots
        assert (card.max_num_seqs, card.max_waiting_requests) == (256, 512)
        assert card.capabilities.kv_events and card.capabilities.engine_kind == "mocker"
        assert list(card.files) == list(SERVED_FILES)
        served = await stub.GetModelCard(worker_pb2.GetModelCardRequest(engine_id=card.engine_id))
        assert served.card == card


async def fetch_files(stub, engine: int, names) -> dict[str, bytes]:
    files = {}
    for name in names:
        chunks = [c async for c in stub.GetModelFile(worker_pb2.GetModelFileRequest(engine_id=engine, name=name))]
        data = b"".join(c.data for c in chunks)
        assert chunks[0].total_size == len(data)
        files[name] = data
    return files


async def test_get_model_file_returns_the_served_files_byte_identical(channel):
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    engine = (await engine_ids(stub))[1]
    card = (await stub.GetModelCard(worker_pb2.GetModelCardRequest(engine_id=engine))).card
    files = await fetch_files(stub, engine, card.files)
    assert files == {name: (BUILTIN / name).read_bytes() for name in SERVED_FILES}
    digest = hashlib.sha256(b"".join(hashlib.sha256(files[n]).digest() for n in SERVED_FILES)).hexdigest()
    assert card.files_digest == digest
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.GetModelFile(worker_pb2.GetModelFileRequest(engine_id=engine, name="../secret")).read()
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


async def test_model_path_is_served_under_its_directory_name(slow_worker, slow_channel):
    stub = worker_pb2_grpc.WorkerServiceStub(slow_channel)
    (engine,) = await engine_ids(stub)
    card = (await stub.GetModelCard(worker_pb2.GetModelCardRequest(engine_id=engine))).card
    assert card.name == "my-model"
    instances, models = await read_discovery(slow_worker)
    assert [discovery_pb2.ModelCard.FromString(v) for v in models.values()] == [card]
    assert [discovery_pb2.InstanceRecord.FromString(v).model for v in instances.values()] == ["my-model"]
    files = await fetch_files(stub, engine, card.files)
    assert len(files["tokenizer.json"]) > 1 << 20  # more than one chunk
    assert files == {name: (slow_worker.model_dir / name).read_bytes() for name in SERVED_FILES}


def test_model_path_dot_is_named_after_the_directory(tmp_path, monkeypatch):
    model_dir = tmp_path / "here-model"
    shutil.copytree(BUILTIN, model_dir)
    monkeypatch.chdir(model_dir)
    assert load_model_files(".").name == "here-model"  # not "", which no discovery key accepts
    assert load_model_files(".", "alias").name == "alias"


def test_a_chat_template_file_and_a_special_tokens_map_are_served_when_the_model_has_them(tmp_path):
    """A chat template saved as chat_template.jinja (transformers since 4.43), or special tokens only in
    special_tokens_map.json, never reached a frontend: no chat at all, or a prompt without its BOS."""
    model_dir = tmp_path / "m"
    shutil.copytree(BUILTIN, model_dir)
    (model_dir / "chat_template.jinja").write_text("{{ messages[0].content }}")
    (model_dir / "special_tokens_map.json").write_text('{"bos_token": "<s>"}')
    before = load_model_files(str(BUILTIN)).digest
    model = load_model_files(str(model_dir))
    assert set(model.files) == {*SERVED_FILES, "chat_template.jinja", "special_tokens_map.json"}
    assert model.digest != before  # a frontend fetches the files again


@pytest.mark.parametrize(
    ("breakage", "says"),
    [
        ("missing-tokenizer", "missing tokenizer.json"),
        ("invalid-json", "not valid JSON"),
        ("a list", "not a JSON object"),  # these two were tracebacks (AttributeError, ValueError)
        ("vocab text", 'vocab_size must be a non-negative integer, got "lots"'),
    ],
)
def test_broken_model_path_exits_2_with_one_line(tmp_path, breakage, says):
    model_dir = tmp_path / "broken"
    shutil.copytree(BUILTIN, model_dir)
    if breakage == "missing-tokenizer":
        (model_dir / "tokenizer.json").unlink()
    elif breakage == "invalid-json":
        (model_dir / "config.json").write_text("{not json")
    elif breakage == "a list":
        (model_dir / "config.json").write_text("[1, 2]")
    else:
        (model_dir / "config.json").write_text('{"vocab_size": "lots"}')
    result = run_cli(
        "kvmesh-worker", "--discovery", f"file://{tmp_path / 'discovery'}", "--model-path", str(model_dir), timeout=60
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvmesh-worker: error: --model-path"), result.stderr
    assert str(model_dir) in lines[0] and says in lines[0]


def test_a_kv_arena_larger_than_the_machine_exits_2_with_one_line(tmp_path):
    """It was numpy's _ArrayMemoryError traceback, once the worker was already serving."""
    result = run_cli(
        "kvmesh-worker", "--discovery", f"file://{tmp_path / 'discovery'}", "--role", "prefill",
        "--kv-bytes-per-block", "99999999999999", timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "GiB of KV arena, more than this machine's" in lines[0], result.stderr


# -- load and metrics ------------------------------------------------------------------------------
async def test_prometheus_shows_per_engine_gauges(worker, channel):
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    engines = await engine_ids(stub)
    await generate(stub, request(engines[0], range(3, 40), 5, ignore_eos=True))
    values = scrape(worker)
    for engine in engines:
        label = f"{engine:x}"
        for gauge in (
            "active_blocks",
            "cached_blocks",
            "waiting_requests",
            "running_requests",
            "queued_prefill_tokens",
        ):
            assert (f"kvmesh_engine_{gauge}", label) in values, gauge
        assert values["kvmesh_engine_total_blocks", label] == NUM_BLOCKS
        assert values["kvmesh_engine_active_blocks", label] == 0  # idle
    first = f"{engines[0]:x}"
    assert values["kvmesh_engine_passes_total", first] >= 5
    assert values["kvmesh_engine_decode_tokens_total", first] >= 4
    assert ("kvmesh_engine_schedule_slip_seconds_total", first) in values  # a mocker's stalls (test_worker_runner)
    assert values["kvmesh_engine_cached_blocks", first] >= 37 // BLOCK


async def test_watch_load_streams_loads_and_forward_pass_metrics(channel):
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    engines = await engine_ids(stub)
    watch = stub.WatchLoad(worker_pb2.WatchLoadRequest(engine_ids=[engines[1]], forward_pass_metrics=True))
    first = await watch.read()
    assert [load.engine_id for load in first.loads] == [engines[1]]
    assert first.loads[0].total_blocks == NUM_BLOCKS
    await generate(stub, request(engines[0], range(3, 20), 3, ignore_eos=True))  # not watched
    await generate(stub, request(engines[1], range(3, 40), 6, ignore_eos=True))
    passes: list[worker_pb2.ForwardPassMetrics] = []
    async with asyncio.timeout(10):
        while sum(p.decode_tokens for p in passes) < 5:
            message = await watch.read()
            assert all(load.engine_id == engines[1] for load in message.loads)
            passes.extend(message.passes)
    watch.cancel()
    assert {p.engine_id for p in passes} == {engines[1]}
    assert passes[0].prefill_tokens == 37 and passes[0].num_prefill_requests == 1 and passes[0].batch_size == 1
    assert all(p.modelled_ms > 0 and p.wall_ms >= 0 and p.end_unix_s > 0 for p in passes)


# -- cancellation and the queue bound (slow worker) -------------------------------------------------
class LoadWatch:
    """Every load snapshot of one engine, timestamped on arrival."""

    def __init__(self, stub, engine: int) -> None:
        self.call = stub.WatchLoad(worker_pb2.WatchLoadRequest(engine_ids=[engine]))
        self.loads: list[tuple[float, worker_pb2.EngineLoad]] = []
        self.task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for message in self.call:
            now = time.monotonic()
            self.loads.extend((now, load) for load in message.loads)

    async def wait_for(self, predicate, after: float = 0.0, timeout: float = 10.0) -> float:
        """Arrival time of the first load after ``after`` that satisfies ``predicate``."""
        async with asyncio.timeout(timeout):
            while True:
                for at, load in self.loads:
                    if at >= after and predicate(load):
                        return at
                assert not self.task.done(), "WatchLoad ended"
                await asyncio.sleep(0.005)

    async def close(self) -> None:
        self.call.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def idle(watch: LoadWatch) -> None:
    await watch.wait_for(lambda load: load.running == 0 and load.waiting == 0 and load.active_blocks == 0)


async def test_cancelling_a_request_frees_its_blocks_within_one_second(slow_worker, slow_channel):
    stub = worker_pb2_grpc.WorkerServiceStub(slow_channel)
    (engine,) = await engine_ids(stub)
    label = f"{engine:x}"
    watch = LoadWatch(stub, engine)
    client = StreamClient(stub)
    try:
        await idle(watch)
        before = watch.loads[-1][1].active_blocks
        # 920 prompt tokens fill 90 % of the cache: each decode pass then takes ~0.85 s at speedup 0.04
        prompt = [3 + i % 2000 for i in range(920)]
        long = request(engine, prompt, 80, ignore_eos=True)
        await client.send([long])
        first = (await client.wait_first(long.request_id)).response
        assert first.token_ids and first.num_prompt_tokens == len(prompt)
        await watch.wait_for(lambda load: load.active_blocks >= len(prompt) // BLOCK)
        passes = scrape(slow_worker)["kvmesh_engine_passes_total", label]

        await client.send(cancel=[long.request_id])
        cancelled_at = time.monotonic()
        freed_at = await watch.wait_for(lambda load: load.active_blocks == before, after=cancelled_at)
        metrics = scrape(slow_worker)
        assert freed_at - cancelled_at < 1.0
        # reported at the abort, not when the pass in flight ends (it may be long, or the last one)
        assert metrics["kvmesh_engine_passes_total", label] == passes
        assert metrics["kvmesh_engine_active_blocks", label] == before
        # the blocks were released, not destroyed: the prompt's full blocks are still cached
        dump = await stub.DumpKvIndex(worker_pb2.DumpKvIndexRequest(engine_id=engine))
        assert sum(len(s.block_hashes) for s in dump.snapshot.stored) >= len(prompt) // BLOCK
        await idle(watch)
    finally:
        await client.close()
        await watch.close()


async def test_waiting_queue_beyond_its_bound_is_resource_exhausted(slow_channel):
    stub = worker_pb2_grpc.WorkerServiceStub(slow_channel)
    (engine,) = await engine_ids(stub)
    watch = LoadWatch(stub, engine)
    client = StreamClient(stub)
    try:
        await idle(watch)
        running = request(engine, range(3, 20), 500, ignore_eos=True)
        await client.send([running])
        await client.wait_first(running.request_id)  # admitted: it is the one running sequence (--max-num-seqs 1)
        waiting = request(engine, range(3, 20), 500, ignore_eos=True)
        await client.send([waiting])
        await watch.wait_for(lambda load: load.waiting == 1)

        flood = [request(engine, range(3, 20), 5, ignore_eos=True) for _ in range(6)]
        await client.send(flood)
        for final in await client.wait_final(*(r.request_id for r in flood)):
            assert final.error_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            assert "max_waiting_requests=1" in final.error_message

        await client.send(cancel=[running.request_id])  # the waiting request gets the sequence slot
        await client.wait_first(waiting.request_id)
        accepted = request(engine, range(3, 20), 2, ignore_eos=True)
        await client.send([accepted], cancel=[waiting.request_id])
        await client.wait_final(accepted.request_id)
        assert len(client.tokens(accepted.request_id)) == 2
        await idle(watch)
    finally:
        await client.close()
        await watch.close()


# -- GenerateStream: many requests on one call ------------------------------------------------------
async def test_generate_stream_serves_many_requests_with_exactly_their_max_tokens(stream):
    engines, client = stream
    wanted = {}
    for _ in range(2):
        requests = [request(engines[i % 2], range(3 + i, 40 + i), 1 + (i * 7) % 30, ignore_eos=True) for i in range(16)]
        wanted.update({r.request_id: (r.sampling.max_tokens, len(r.token_ids)) for r in requests})
        await client.send(requests)
    await client.wait_final(*wanted)
    for rid, (max_tokens, prompt) in wanted.items():
        outputs = client.outputs[rid]
        assert len(client.tokens(rid)) == max_tokens
        assert [o.response.finish_reason for o in outputs].count(worker_pb2.FINISH_REASON_LENGTH) == 1
        assert outputs[0].response.num_prompt_tokens == prompt and not any(o.error_code for o in outputs)
    # several requests share each message: fewer messages than request outputs
    assert client.messages < sum(len(o) for o in client.outputs.values())


async def test_generate_stream_failures_are_in_band_and_end_only_their_request(stream):
    engines, client = stream
    good = request(engines[0], range(3, 20), 5, ignore_eos=True)
    unknown = request(0xBAD, range(3, 20), 5)
    too_long = request(engines[1], range(3, 3 + MAX_MODEL_LEN), 5)
    no_id = request(engines[0], range(3, 20), 5)
    no_id.request_id = ""
    long_running = request(engines[1], range(3, 20), 200, ignore_eos=True)
    duplicate = worker_pb2.GenerateRequest()
    duplicate.CopyFrom(long_running)
    await client.send([long_running, good, unknown, too_long, no_id, duplicate])
    finals = await client.wait_final(good.request_id, unknown.request_id, too_long.request_id, "")
    assert len(client.tokens(good.request_id)) == 5 and not finals[0].error_code
    assert finals[1].error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "engine bad is not hosted by this worker" in finals[1].error_message
    assert finals[2].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert str(MAX_MODEL_LEN) in finals[2].error_message
    assert finals[3].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "request_id is required" in finals[3].error_message
    # An id sent again while active: its outputs could not be told apart, so the one error ends both
    (ended,) = await client.wait_final(long_running.request_id)
    assert ended.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert (
        ended.error_message
        == f"request id {long_running.request_id!r} was sent again while active; both requests are ended"
    )
    await asyncio.sleep(0.2)
    outputs = client.outputs[long_running.request_id]
    assert outputs[-1] is ended and not any(o.response.finish_reason for o in outputs)  # nothing after the end


async def test_a_message_that_does_not_parse_is_refused_in_band_and_the_stream_goes_on(channel):
    """Garbage, or a request id that is not UTF-8 (a C++ or Go client can send one), ended the whole stream as
    UNKNOWN naming protobuf's DecodeError, with the requests in flight on it."""
    engines = await engine_ids(worker_pb2_grpc.WorkerServiceStub(channel))
    call = channel.stream_stream(
        "/kvmesh.v1.WorkerService/GenerateStream", lambda b: b, worker_pb2.GenerateStreamResponse.FromString
    )()
    running = request(engines[0], range(3, 20), 40, ignore_eos=True)
    not_utf8 = b"\x0a\x04\x0a\x02\xff\xfe"  # requests[0].request_id = b"\xff\xfe"
    for message in (worker_pb2.GenerateStreamRequest(requests=[running]).SerializeToString(), not_utf8, b"\xff\xff"):
        await call.write(message)
    await call.done_writing()
    outputs = [o async for response in call for o in response.outputs]
    assert await call.code() is grpc.StatusCode.OK
    refused = [o for o in outputs if o.error_code]
    assert [(o.request_id, o.error_code) for o in refused] == [("", grpc.StatusCode.INVALID_ARGUMENT.value[0])] * 2
    assert "not a valid kvmesh.v1.GenerateStreamRequest" in refused[0].error_message
    mine = [o for o in outputs if o.request_id == running.request_id]
    assert sum(len(o.response.token_ids) for o in mine) == 40 and mine[-1].response.finish_reason


async def test_a_caller_that_sends_and_never_reads_is_not_read_either(channel):
    """Each bad request is an in-band error queued for the caller: one that never read grew the worker by
    1.4 GB in 30 s. Now the worker stops reading it, flow control stalls its writes, and nothing is lost."""
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    call = stub.GenerateStream()
    no_id = worker_pb2.GenerateRequest(engine_id=1, token_ids=[3] * 100)  # ~60 KB a message: 110 MB in all
    message = worker_pb2.GenerateStreamRequest(requests=[no_id] * 500)
    sent, stalled = 0, False

    async def write() -> None:
        nonlocal sent
        while not stalled and sent < 1_000_000:
            await call.write(message)
            sent += 500
        await call.done_writing()

    writer = asyncio.create_task(write())
    last = -1
    while sent != last:  # until two seconds pass without a write going through
        last = sent
        await asyncio.sleep(2)
    stalled = True
    assert not writer.done() and sent < 500_000  # what gRPC's flow-control windows hold, a few MB
    errors = 0
    async with asyncio.timeout(60):  # reading resumes the worker: every request still gets its error
        async for response in call:
            errors += sum(1 for o in response.outputs if o.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0])
        await writer
    assert errors == sent


async def test_every_other_rpc_answers_bytes_that_do_not_parse_with_invalid_argument(channel):
    for method, response in [
        ("/kvmesh.v1.WorkerService/GetModelCard", worker_pb2.GetModelCardResponse),
        ("/kvmesh.v1.WorkerService/DumpKvIndex", worker_pb2.DumpKvIndexResponse),
        ("/kvmesh.v1.AdminService/Drain", worker_pb2.DumpKvIndexResponse),
        ("/grpc.health.v1.Health/Check", worker_pb2.DumpKvIndexResponse),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary(method, lambda b: b, response.FromString)(b"\xff\xff")
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT, method
        assert "DecodeError" not in caught.value.details()
    watch = channel.unary_stream(
        "/kvmesh.v1.WorkerService/WatchLoad", lambda b: b, worker_pb2.WatchLoadResponse.FromString
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in watch(b"\xff\xff"):
            pass
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_generate_stream_cancel_and_hang_up_free_blocks_within_one_second(slow_worker, slow_channel):
    stub = worker_pb2_grpc.WorkerServiceStub(slow_channel)
    (engine,) = await engine_ids(stub)
    watch = LoadWatch(stub, engine)
    client = StreamClient(stub)
    try:
        await idle(watch)
        before = watch.loads[-1][1].active_blocks
        prompt = [3 + i % 2000 for i in range(920)]
        for ends_by in ("cancel", "hang up"):
            long = request(engine, prompt, 80, ignore_eos=True)
            await client.send([long])
            async with asyncio.timeout(10):
                while not client.tokens(long.request_id):
                    await asyncio.sleep(0.005)
            await watch.wait_for(lambda load: load.active_blocks >= len(prompt) // BLOCK)
            if ends_by == "cancel":
                await client.send(cancel=[long.request_id])
            else:
                client.call.cancel()
            ended_at = time.monotonic()
            freed_at = await watch.wait_for(lambda load: load.active_blocks == before, after=ended_at)
            assert freed_at - ended_at < 1.0, ends_by
            assert client.final(long.request_id) is None  # nothing more was sent for it
            await idle(watch)
    finally:
        await client.close()
        await watch.close()


def test_a_draining_worker_finishes_its_stream_requests_then_ends_the_stream(tmp_path):
    async def scenario(daemon: Daemon) -> None:
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            (engine,) = await engine_ids(stub)
            client = StreamClient(stub)
            try:
                in_flight = request(engine, range(3, 40), 40, ignore_eos=True)
                await client.send([in_flight])
                async with asyncio.timeout(10):
                    while not client.tokens(in_flight.request_id):
                        await asyncio.sleep(0.005)
                daemon.signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                late = request(engine, range(3, 40), 5, ignore_eos=True)
                await client.send([late])
                late_final, final = await client.wait_final(late.request_id, in_flight.request_id)
                assert late_final.error_code == grpc.StatusCode.UNAVAILABLE.value[0]
                assert "shutting down" in late_final.error_message
                assert len(client.tokens(in_flight.request_id)) == 40 and not final.error_code
                await asyncio.wait_for(client.ended.wait(), 5)  # well before --drain-timeout 20
            finally:
                await client.close()

    daemon = start(tmp_path, "drain", "wdrain", "--speedup-ratio", "0.5", "--drain-timeout", "20").wait_serving()
    try:
        asyncio.run(scenario(daemon))
        assert daemon.wait(10) == 0
    finally:
        daemon.close()


def test_a_draining_worker_ends_its_kv_event_and_load_watches_at_once(tmp_path):
    """A router's KV subscription and load watch never end by themselves: each held a SIGTERM'd worker
    for its whole --drain-timeout (a router that has not yet seen the record go, or cannot)."""

    async def scenario(daemon: Daemon) -> None:
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            engine = (await engine_ids(stub))[0]
            events = stub.SubscribeKvEvents(worker_pb2.SubscribeKvEventsRequest(engine_id=engine))
            loads = stub.WatchLoad(worker_pb2.WatchLoadRequest())
            await events.read()  # the snapshot: subscribed
            await loads.read()  # the first loads: watching
            started = time.monotonic()
            daemon.signal(signal.SIGTERM)
            for call in (events, loads):
                async with asyncio.timeout(5):  # well before --drain-timeout 20
                    while await call.read() is not grpc.aio.EOF:
                        pass
                assert await call.code() == grpc.StatusCode.OK
            assert time.monotonic() - started < 5

    daemon = start(tmp_path, "drain", "wwatch", "--drain-timeout", "20").wait_serving()
    try:
        asyncio.run(scenario(daemon))
        assert daemon.wait(10) == 0
    finally:
        daemon.close()
