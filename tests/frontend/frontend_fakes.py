"""In-process stand-ins for the frontend's peers, speaking the real kvmesh.v1 contracts over real gRPC.

- :func:`tokenizer_files`: a small byte-level BPE tokenizer (BOS post-processor, chat template)
  trained on ASCII only, so non-ASCII characters are split into byte tokens.
- :class:`FakeWorker`: ``WorkerService`` for N engines. ``GenerateStream`` streams the tokens of a fixed
  text, ``batch`` tokens per response; it can die mid-stream (UNAVAILABLE), reject, and it tracks
  active requests so tests can check cancellation reaches it.
- :class:`FakeRouter`: ``RouterService.Session`` with round-robin / pinned / excluded routing and
  a booking table (booked on decision, freed on FINISHED) so tests can check nothing leaks.
- :class:`FrontendHarness`: the frontend's real modules wired together on a real gRPC server.
"""

from __future__ import annotations

import array
import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from kvmesh.channels import ChannelPool
from kvmesh.discovery.base import Added, Removed, Snapshot, instance_key, model_key
from kvmesh.grpc_options import FRONTEND_SERVER_OPTIONS
from kvmesh.v1 import discovery_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh_frontend.generation import Generator
from kvmesh_frontend.metrics import FrontendMetrics
from kvmesh_frontend.models import ModelRegistry
from kvmesh_frontend.pipeline import Frontend
from kvmesh_frontend.routing import RouterClient
from kvmesh_frontend.service import InferenceServicer, add_inference_service
from kvmesh_frontend.tensors import encode_bytes
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

NS = "test"
MODEL = "fake-model"
BLOCK_SIZE = 4
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
OUTPUT_TEXT = " the quick brown fox jumps over the lazy dog and then it naps in the sun."

_tokenizer_cache: dict[str, bytes] = {}


def tokenizer_files() -> dict[str, bytes]:
    if not _tokenizer_cache:
        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        corpus = [OUTPUT_TEXT * 3, "hello world, this is a tiny corpus for a tiny tokenizer. " * 3]
        trainer = trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(corpus, trainer)
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
        config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": CHAT_TEMPLATE}
        _tokenizer_cache["tokenizer.json"] = tok.to_str().encode()
        _tokenizer_cache["tokenizer_config.json"] = json.dumps(config).encode()
    return dict(_tokenizer_cache)


def output_tokens() -> list[int]:
    tok = Tokenizer.from_str(tokenizer_files()["tokenizer.json"].decode())
    return tok.encode(OUTPUT_TEXT, add_special_tokens=False).ids


# -- worker ------------------------------------------------------------------------------------
class EngineFailure(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclass
class EngineBehaviour:
    tokens: list[int] = field(default_factory=output_tokens)
    batch: int = 1
    delay: float = 0.0
    die_after: int | None = None  # abort with UNAVAILABLE after this many tokens
    error: tuple[grpc.StatusCode, str] | None = None  # fail at once with this status
    eos_after: int | None = None  # finish with STOP after this many tokens
    cached_tokens: int = 3  # the engine's own prefix-cache hit, reported on its first response


def prompt_of(request: worker_pb2.GenerateRequest) -> list[int]:
    """The prompt a GenerateRequest carries, in either form (the frontend sends ``token_ids_u32le``)."""
    if request.token_ids_u32le:
        return array.array("I", request.token_ids_u32le).tolist()
    return list(request.token_ids)


class FakeWorker(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, engine_ids: list[int], files: dict[str, bytes] | None = None) -> None:
        self.engine_ids = engine_ids
        self.behaviour = {e: EngineBehaviour() for e in engine_ids}
        self.files = tokenizer_files() if files is None else files
        self.active: dict[str, int] = {}  # request id -> engine id
        self.requests: list[worker_pb2.GenerateRequest] = []
        self.cancelled: list[str] = []
        self.streams_opened = 0
        self.break_stream_after: int | None = None  # end the whole GenerateStream once a request sent this many tokens
        self.file_fetches = 0
        self.server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self) -> str:
        self.server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)

    def card(self, engine_id: int, model: str = MODEL, **overrides: object) -> discovery_pb2.ModelCard:
        fields: dict[str, object] = dict(
            name=model, block_size=BLOCK_SIZE, context_length=4096, vocab_size=320, eos_token_id=1,
            files=sorted(self.files), files_digest="digest-" + str(hash(tuple(sorted(self.files))) & 0xFFFF),
            engine_id=engine_id, address=self.address, role=discovery_pb2.WORKER_ROLE_AGGREGATED,
        )  # fmt: skip
        fields.update(overrides)
        return discovery_pb2.ModelCard(**fields)

    async def _generate(self, request: worker_pb2.GenerateRequest) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """One request's responses per its engine's behaviour; failures raise EngineFailure."""
        if request.engine_id not in self.behaviour:
            raise EngineFailure(grpc.StatusCode.NOT_FOUND, f"unknown engine {request.engine_id}")
        b = self.behaviour[request.engine_id]
        if b.error is not None:
            raise EngineFailure(*b.error)
        self.requests.append(request)
        self.active[request.request_id] = request.engine_id
        try:
            max_tokens = request.sampling.max_tokens
            stream = itertools.cycle(b.tokens)
            sent = 0
            first = True
            while sent < max_tokens:
                if b.die_after is not None and sent >= b.die_after:
                    raise EngineFailure(grpc.StatusCode.UNAVAILABLE, "engine died")
                n = min(b.batch, max_tokens - sent)
                if b.die_after is not None:
                    n = min(n, b.die_after - sent)
                if b.eos_after is not None:
                    n = min(n, b.eos_after - sent)
                ids = [next(stream) for _ in range(n)]
                sent += n
                finish = 0
                if b.eos_after is not None and sent >= b.eos_after:
                    finish = worker_pb2.FINISH_REASON_STOP
                elif sent >= max_tokens:
                    finish = worker_pb2.FINISH_REASON_LENGTH
                if b.delay:
                    await asyncio.sleep(b.delay)
                response = worker_pb2.GenerateResponse(token_ids=ids, finish_reason=finish)
                if first:
                    response.num_prompt_tokens = len(prompt_of(request))
                    response.num_cached_tokens = b.cached_tokens
                    first = False
                yield response
                if finish:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled.append(request.request_id)
            raise
        finally:
            self.active.pop(request.request_id, None)

    async def GenerateStream(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        """Each request runs in its own task; its outputs and in-band errors share the stream."""
        tasks: dict[str, asyncio.Task[None]] = {}
        lock = asyncio.Lock()
        self.streams_opened += 1

        async def send(output: worker_pb2.GenerateStreamOutput) -> None:
            async with lock:
                await context.write(worker_pb2.GenerateStreamResponse(outputs=[output]))

        async def run(request: worker_pb2.GenerateRequest) -> None:
            try:
                sent = 0
                async for response in self._generate(request):
                    await send(worker_pb2.GenerateStreamOutput(request_id=request.request_id, response=response))
                    sent += len(response.token_ids)
                    if self.break_stream_after is not None and sent >= self.break_stream_after:
                        self.break_stream_after = None  # the worker process "dies": the whole stream ends
                        await context.abort(grpc.StatusCode.UNAVAILABLE, "worker restarting")
            except EngineFailure as exc:
                await send(
                    worker_pb2.GenerateStreamOutput(
                        request_id=request.request_id, error_code=exc.code.value[0], error_message=exc.details
                    )
                )
            finally:
                tasks.pop(request.request_id, None)

        try:
            async for message in request_iterator:
                for request_id in message.cancel_request_ids:
                    task = tasks.pop(request_id, None)
                    if task is not None:
                        task.cancel()
                for request in message.requests:
                    tasks[request.request_id] = asyncio.create_task(run(request))
            while tasks:
                await asyncio.gather(*tasks.values(), return_exceptions=True)
        finally:
            for task in list(tasks.values()):
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)

    async def GetModelFile(self, request: worker_pb2.GetModelFileRequest, context: grpc.aio.ServicerContext):
        self.file_fetches += 1
        data = self.files.get(request.name)
        if data is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no file {request.name}")
        for i in range(0, len(data), 1000):
            yield worker_pb2.GetModelFileResponse(data=data[i : i + 1000], total_size=len(data) if i == 0 else 0)


# -- router ------------------------------------------------------------------------------------
class FakeRouter(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, engines: dict[int, str], block_size: int = BLOCK_SIZE) -> None:
        self.engines = engines  # engine id -> address
        self.block_size = block_size
        self.bookings: dict[str, int] = {}
        self.queries: list[router_pb2.RouteQuery] = []
        self.lifecycle: list[tuple[str, int]] = []
        self.outcome: int = router_pb2.DECISION_OUTCOME_ROUTED
        self.overlap_blocks = 2
        self.silent = False  # never answer
        self.blind_for = 0  # answer NO_ENGINE to this many queries (a router that has not seen the engines yet)
        self._rr = itertools.count()
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self.sessions = 0

    async def start(self, port: int = 0) -> str:
        self.server = grpc.aio.server()
        router_pb2_grpc.add_RouterServiceServicer_to_server(self, self.server)
        bound = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        self.address = f"127.0.0.1:{bound}"
        return self.address

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)

    def decide(self, query: router_pb2.RouteQuery) -> router_pb2.RouteDecision:
        decision = router_pb2.RouteDecision(request_id=query.request_id, block_size=self.block_size)
        if self.outcome != router_pb2.DECISION_OUTCOME_ROUTED:
            decision.outcome = self.outcome
            decision.message = "fake router says no"
            return decision
        candidates = [e for e in sorted(self.engines) if e not in query.excluded_engine_ids]
        if self.blind_for > 0:
            self.blind_for -= 1
            candidates = []
        if query.HasField("pinned_engine_id"):
            candidates = [e for e in candidates if e == query.pinned_engine_id]
        if not candidates:
            decision.outcome = router_pb2.DECISION_OUTCOME_NO_ENGINE
            decision.message = "no eligible engine"
            return decision
        engine = candidates[next(self._rr) % len(candidates)]
        decision.outcome = router_pb2.DECISION_OUTCOME_ROUTED
        decision.engine_id = engine
        decision.address = self.engines[engine]
        decision.overlap_blocks = min(self.overlap_blocks, len(query.block_hashes))
        decision.best_overlap_blocks = decision.overlap_blocks
        self.bookings[query.request_id] = engine
        return decision

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        self.sessions += 1
        async for message in request_iterator:
            items = message.batch.requests if message.HasField("batch") else [message]
            decisions = []
            for item in items:
                if item.HasField("route"):
                    self.queries.append(item.route)
                    if not self.silent:
                        decisions.append(self.decide(item.route))
                else:
                    update = item.lifecycle
                    self.lifecycle.append((update.request_id, update.stage))
                    if update.stage == router_pb2.LIFECYCLE_STAGE_FINISHED:
                        self.bookings.pop(update.request_id, None)
            if decisions:  # as the real router when it decides quickly: one decision_batch
                if message.HasField("batch"):
                    yield router_pb2.SessionResponse(decision_batch=router_pb2.RouteDecisionBatch(decisions=decisions))
                else:
                    yield router_pb2.SessionResponse(decision=decisions[0])

    def record(self, replica_id: int, namespace: str = NS) -> tuple[str, bytes]:
        rec = discovery_pb2.InstanceRecord(
            namespace=namespace, component="router", endpoint="router", instance_id=replica_id, address=self.address
        )
        return instance_key(namespace, "router", "router", replica_id), rec.SerializeToString()


# -- the frontend, in process --------------------------------------------------------------------
class FrontendHarness:
    """The frontend's real modules on a real gRPC server, fed discovery events by the test."""

    def __init__(self, migration_limit: int = 3, route_timeout: float = 5.0) -> None:
        self.pool = ChannelPool()
        self.registry = ModelRegistry(self.pool, NS, fetch_timeout=5.0)
        self.router = RouterClient(self.pool, NS, route_timeout=route_timeout)
        self.metrics = FrontendMetrics(CollectorRegistry())
        self.generator = Generator(
            self.router,
            self.pool,
            migration_limit,
            on_migration=self.metrics.migration,
            engine_alive=self.registry.engine_alive,
            no_engine_grace=0.3,
            address_live=self.registry.address_live,
            departed_engines=self.registry.departed,
        )
        self.registry.on_address_gone = self.generator.engines.retire
        self.frontend = Frontend(self.registry, self.generator, self.metrics, id_prefix="fe")
        self.server: grpc.aio.Server | None = None
        self.channel: grpc.aio.Channel | None = None
        self.stub: pb_grpc.GRPCInferenceServiceStub | None = None
        self.address = ""

    async def start(self) -> None:
        self.server = grpc.aio.server(options=FRONTEND_SERVER_OPTIONS)
        self.servicer = InferenceServicer(self.frontend, "test")
        add_inference_service(self.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.channel = grpc.aio.insecure_channel(self.address)
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.server is not None:
            await self.server.stop(grace=None)
        await self.router.close()
        await self.generator.engines.close()
        await self.registry.close()
        await self.pool.close()

    def add_cards(self, worker: FakeWorker, model: str = MODEL, **overrides: object) -> None:
        for engine_id in worker.engine_ids:
            card = worker.card(engine_id, model, **overrides)
            self.registry.apply(Added(model_key(NS, model, engine_id), card.SerializeToString()))

    def remove_cards(self, worker: FakeWorker, model: str = MODEL) -> None:
        for engine_id in worker.engine_ids:
            self.registry.apply(Removed(model_key(NS, model, engine_id)))

    def add_router(self, router: FakeRouter, replica_id: int) -> None:
        self.router.apply(Added(*router.record(replica_id)))

    def router_snapshot(self, *routers: tuple[FakeRouter, int]) -> None:
        self.router.apply(Snapshot(dict(r.record(rid) for r, rid in routers)))

    async def wait_ready(self, model: str = MODEL, timeout: float = 5.0) -> None:
        async def ready() -> None:
            while not (entry := self.registry.get(model)) or not entry.ready:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(ready(), timeout)


# -- request building ------------------------------------------------------------------------------
def bytes_input(name: str, value: str | bytes) -> pb.ModelInferRequest.InferInputTensor:
    data = value.encode() if isinstance(value, str) else value
    tensor = pb.ModelInferRequest.InferInputTensor(name=name, datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(data)
    return tensor


def bool_input(name: str, value: bool) -> pb.ModelInferRequest.InferInputTensor:
    tensor = pb.ModelInferRequest.InferInputTensor(name=name, datatype="BOOL", shape=[1])
    tensor.contents.bool_contents.append(value)
    return tensor


def ids_input(ids: list[int], datatype: str = "INT32") -> pb.ModelInferRequest.InferInputTensor:
    tensor = pb.ModelInferRequest.InferInputTensor(name="input_ids", datatype=datatype, shape=[len(ids)])
    if datatype == "INT64":
        tensor.contents.int64_contents.extend(ids)
    else:
        tensor.contents.int_contents.extend(ids)
    return tensor


def llm_request(
    prompt: str | None = "hello world",
    *,
    model: str = MODEL,
    request_id: str = "r1",
    stream: bool | None = None,
    sampling: dict | None = None,
    exclude_input: bool | None = None,
    params: dict | None = None,
    extra: list[pb.ModelInferRequest.InferInputTensor] | None = None,
) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    if prompt is not None:
        request.inputs.append(bytes_input("text_input", prompt))
    if stream is not None:
        request.inputs.append(bool_input("stream", stream))
    if exclude_input is not None:
        request.inputs.append(bool_input("exclude_input_in_output", exclude_input))
    if sampling is not None:
        request.inputs.append(bytes_input("sampling_parameters", json.dumps(sampling)))
    for tensor in extra or []:
        request.inputs.append(tensor)
    for key, value in (params or {}).items():
        if isinstance(value, bool):
            request.parameters[key].bool_param = value
        elif isinstance(value, int):
            request.parameters[key].int64_param = value
        elif isinstance(value, float):
            request.parameters[key].double_param = value
        else:
            request.parameters[key].string_param = value
    return request


def to_raw(request: pb.ModelInferRequest) -> pb.ModelInferRequest:
    """The same request with every input moved to raw_input_contents."""
    import numpy as np

    raw = pb.ModelInferRequest()
    raw.CopyFrom(request)
    for tensor in raw.inputs:
        c = tensor.contents
        if tensor.datatype == "BYTES":
            data = encode_bytes(list(c.bytes_contents))
        elif tensor.datatype == "BOOL":
            data = bytes(1 if v else 0 for v in c.bool_contents)
        elif tensor.datatype == "INT32":
            data = np.asarray(list(c.int_contents), dtype="<i4").tobytes()
        elif tensor.datatype == "INT64":
            data = np.asarray(list(c.int64_contents), dtype="<i8").tobytes()
        else:
            raise AssertionError(tensor.datatype)
        raw.raw_input_contents.append(data)
        tensor.ClearField("contents")
    return raw
