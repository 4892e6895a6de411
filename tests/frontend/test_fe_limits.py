"""Issue 14: bad or oversized input is refused early and clearly; no client message leaks internals.

The real servicer on real gRPC against the in-process peers of ``frontend_fakes`` (context length
4096, so a prompt may hold 4095 tokens and 4095 * 16 bytes). The end-to-end versions with stock
tritonclient, 10-64 MB requests and a neighbour stream's inter-token gaps are in
``tests/kserve_clients/test_kserve_limits.py``.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterator

import grpc
import pytest
from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from kvmesh import telemetry
from kvmesh.grpc_options import FRONTEND_MAX_RECEIVE_BYTES
from kvmesh_frontend.errors import MAX_MESSAGE_BYTES, FrontendError, internal
from kvmesh_frontend.llm_request import PROMPT_BYTES_PER_TOKEN, parse_llm_request
from kvmesh_frontend.service import InferenceServicer, add_inference_service
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from tests.frontend.frontend_fakes import MODEL, FrontendHarness, bytes_input, llm_request
from tests.frontend.test_fe_service import expect_status, mesh, no_leaks, stream_all  # noqa: F401 (fixture)

CONTEXT = 4096
MB = 1 << 20


def raw_request(name: str, datatype: str, shape: list[int], data: bytes) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=MODEL, id="big")
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    request.raw_input_contents.append(data)
    return request


def refusal(request: pb.ModelInferRequest, context_length: int = CONTEXT) -> str:
    with pytest.raises(FrontendError) as info:
        parse_llm_request(request, context_length=context_length, model=MODEL)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return info.value.message


# -- item 3: sizes are checked before decoding or tokenizing -----------------------------------------
def test_a_prompt_over_its_byte_limit_is_refused_before_it_is_decoded() -> None:
    limit = (CONTEXT - 1) * PROMPT_BYTES_PER_TOKEN
    text = b"a" * (limit + 1000)
    message = refusal(raw_request("text_input", "BYTES", [1], struct.pack("<I", len(text)) + text))
    assert message.startswith(f"input 'text_input': {len(text) + 4} bytes is over the limit of")
    assert f"context length of {CONTEXT} tokens" in message and f"{PROMPT_BYTES_PER_TOKEN} bytes per token" in message
    # typed contents are held to the same limit
    typed = pb.ModelInferRequest(model_name=MODEL, inputs=[bytes_input("messages", text.decode())])
    assert "input 'messages':" in refusal(typed) and "bytes is over the limit" in refusal(typed)


def test_tensor_shapes_and_sizes_are_checked_before_their_elements_are_read() -> None:
    # input_ids longer than the context, declared by the shape: refused from the shape alone
    ids = raw_request("input_ids", "INT32", [CONTEXT + 1], bytes(4 * (CONTEXT + 1)))
    assert refusal(ids).startswith(f"input 'input_ids': {CONTEXT + 1} elements is over the limit of {CONTEXT - 1}")
    # a shape that lies: [1] declared, 400k empty BYTES elements sent
    lying = raw_request("text_input", "BYTES", [1], bytes(4 * 400_000))
    assert "bytes is over the limit" in refusal(lying)
    # a small payload that holds more elements than its shape says stops at the first extra one
    extra = raw_request("text_input", "BYTES", [1], bytes(4 * 1000))
    assert "holds more than the 1 element(s) its shape declares" in refusal(extra)
    # millions of elements in a scalar's shape
    many = raw_request("stream", "BOOL", [16_000_000], b"")
    assert refusal(many).startswith("input 'stream': 16000000 elements is over the limit of 16")
    # requests padded with parameters or outputs
    padded = llm_request("x")
    for i in range(65):
        padded.parameters[f"p{i}"].bool_param = True
    assert refusal(padded) == "the request has 65 parameters; at most 64 are accepted"


async def test_oversized_requests_are_invalid_argument_over_grpc_and_leave_nothing_behind(mesh) -> None:  # noqa: F811
    fe, worker, router = mesh
    big = "hello " * 200_000  # 1.2 MB: under gRPC's limits, over this model's prompt limit
    await expect_status(fe.stub.ModelInfer(llm_request(big)), grpc.StatusCode.INVALID_ARGUMENT, "bytes per token")
    messages = await stream_all(fe, [llm_request(big, stream=True), llm_request("x", request_id="ok", stream=True)])
    errors = [m.error_message for m in messages if m.error_message]
    assert len(errors) == 1 and errors[0].startswith("INVALID_ARGUMENT: input 'text_input':")
    assert not worker.requests[1:] and len(worker.requests) == 1  # only the good request reached an engine
    await no_leaks(worker, router)


async def test_a_message_over_grpcs_receive_limit_is_resource_exhausted(mesh) -> None:  # noqa: F811
    fe, _, _ = mesh
    request = raw_request("input_ids", "INT32", [5 * MB], bytes(20 * MB))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await fe.stub.ModelInfer(request)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (
        f"Received message larger than max ({request.ByteSize()} vs. {FRONTEND_MAX_RECEIVE_BYTES})"
        in info.value.details()
    )


# -- item 4: deeply nested JSON ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["sampling_parameters", "messages"])
@pytest.mark.parametrize("depth", [33, 30_000])  # 30k levels: past Python's recursion limit, under the size limits
def test_deeply_nested_json_is_invalid_argument(name: str, depth: int) -> None:
    doc = "[" * depth + "]" * depth
    request = llm_request(None if name == "messages" else "x", extra=[bytes_input(name, doc)])
    assert refusal(request) == f"input '{name}': JSON nested deeper than 32 levels"


def test_100k_levels_of_json_in_messages_of_a_long_context_model() -> None:
    request = llm_request(None, extra=[bytes_input("messages", "[" * 100_000)])
    assert refusal(request, context_length=131_072) == "input 'messages': JSON nested deeper than 32 levels"
    # with a short context the same bytes are refused for their size, before parsing
    assert "bytes is over the limit" in refusal(request, context_length=4096)


async def test_deeply_nested_json_over_grpc(mesh) -> None:  # noqa: F811
    fe, _, _ = mesh
    deep = bytes_input("sampling_parameters", '{"stop": ' + "[" * 30_000 + "]" * 30_000 + "}")
    await expect_status(
        fe.stub.ModelInfer(llm_request("x", extra=[deep])), grpc.StatusCode.INVALID_ARGUMENT, "nested deeper than 32"
    )
    messages = await stream_all(fe, [llm_request(None, stream=True, extra=[bytes_input("messages", "[" * 30_000)])])
    assert messages[-1].error_message == "INVALID_ARGUMENT: input 'messages': JSON nested deeper than 32 levels"


# -- item 5: echoed values are capped ---------------------------------------------------------------
async def test_a_1mb_model_name_is_not_found_with_the_name_clipped(mesh) -> None:  # noqa: F811
    fe, _, _ = mesh
    name = "m" * (1 << 20)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await fe.stub.ModelInfer(llm_request("x", model=name))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND  # not RESOURCE_EXHAUSTED about the trailer's size
    assert info.value.details().startswith(f"model '{'m' * 64}... (1048576 characters)' is not served here")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await fe.stub.ModelMetadata(pb.ModelMetadataRequest(name=name))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    messages = await stream_all(fe, [llm_request("x", model=name, stream=True)])
    assert len(messages[-1].error_message) < 200


def test_every_client_message_is_bounded() -> None:
    error = internal("x" * 100_000)
    assert len(error.message.encode()) <= MAX_MESSAGE_BYTES
    assert len(internal("é" * 100_000).message.encode()) <= MAX_MESSAGE_BYTES


# -- item 7: no internal error text reaches a client -------------------------------------------------
async def test_grpc_debug_text_never_reaches_a_client() -> None:
    async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:  # nothing listens on port 1
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await pb_grpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(), timeout=2)
    assert "debug_error_string" in str(info.value)
    error = internal(f"request fe-1: worker 127.0.0.1:1 failed ({info.value})")
    assert "debug_error_string" not in error.message and "AioRpcError" not in error.message
    assert error.message.startswith("request fe-1: worker 127.0.0.1:1 failed")
    assert error.message.endswith("(details in the frontend log)")


async def test_the_migration_limit_message_is_clean(mesh, caplog) -> None:  # noqa: F811
    fe, worker, router = mesh
    fe.generator.migration_limit = 1
    for b in worker.behaviour.values():
        b.die_after = 1
    messages = await stream_all(fe, [llm_request("x", stream=True, sampling={"max_tokens": 8})])
    error = messages[-1].error_message
    assert error.startswith("UNAVAILABLE: request fe-") and error.endswith(
        "failed after 2 tokens and the migration limit (1) is reached"
    ), error
    assert "engine died" not in error and "worker" not in error  # the engine's own text...
    assert "engine died" in caplog.text  # ...is in the log
    fe.generator.migration_limit = 3
    messages = await stream_all(fe, [llm_request("x", request_id="z", stream=True, sampling={"max_tokens": 8})])
    assert "no engine left to migrate to after 2 failed engine(s)" in messages[-1].error_message
    assert "engine died" not in messages[-1].error_message
    await no_leaks(worker, router)


async def test_an_unexpected_exception_is_internal_without_its_text(mesh) -> None:  # noqa: F811
    fe, _, _ = mesh

    def broken(*_args: object) -> None:
        raise RuntimeError("secret internal state")

    fe.frontend._prepare = broken  # type: ignore[method-assign]  # a bug anywhere in the pipeline
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await fe.stub.ModelInfer(llm_request("x"))
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in info.value.details() and "RuntimeError" in info.value.details()


# -- item 11: completions are not counted as cancels --------------------------------------------------
async def test_a_stream_cancelled_after_its_final_response_counts_as_completed(mesh) -> None:  # noqa: F811
    fe, worker, router = mesh
    # What ModelStreamInfer does when the client cancels while the final response is being written:
    # the request's generator is closed right after it yielded that response.
    responses = fe.frontend.infer(llm_request("x", stream=True, sampling={"max_tokens": 3}), unary=False)
    async for response in responses:
        assert isinstance(response, pb.ModelStreamInferResponse)
        if response.infer_response.parameters["triton_final_response"].bool_param:
            break
    await responses.aclose()
    # ...and a client that cancels before the final response did cancel.
    responses = fe.frontend.infer(llm_request("x", stream=True, sampling={"max_tokens": 3}), unary=False)
    await anext(responses)
    await responses.aclose()
    assert fe.metrics.requests.labels(MODEL, "success")._value.get() == 1
    assert fe.metrics.requests.labels(MODEL, "cancelled")._value.get() == 1
    await no_leaks(worker, router)


async def test_a_modelinfer_past_its_deadline_counts_as_deadline_exceeded_not_cancelled(mesh) -> None:  # noqa: F811
    """The client did not cancel: its timeout ran out. Counted as its own cancel, a slow mesh hid."""
    fe, worker, router = mesh
    for behaviour in worker.behaviour.values():
        behaviour.delay = 0.2  # per token: well past the 0.3 s deadline
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await fe.stub.ModelInfer(llm_request("x", sampling={"max_tokens": 8}), timeout=0.3)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    async with asyncio.timeout(5):
        while fe.metrics.requests.labels(MODEL, "deadline_exceeded")._value.get() != 1:
            await asyncio.sleep(0.01)
    assert fe.metrics.requests.labels(MODEL, "cancelled")._value.get() == 0
    await no_leaks(worker, router)


async def test_a_known_model_without_engines_is_counted_under_its_own_name(mesh) -> None:  # noqa: F811
    """Its outage went to the model="_unknown" series: a per-model alert saw nothing."""
    fe, worker, _ = mesh
    fe.remove_cards(worker)
    await expect_status(fe.stub.ModelInfer(llm_request("x")), grpc.StatusCode.UNAVAILABLE, "has no live engine")
    assert fe.metrics.requests.labels(MODEL, "unavailable")._value.get() == 1
    await expect_status(fe.stub.ModelInfer(llm_request("x", model="never")), grpc.StatusCode.NOT_FOUND, "never")
    assert fe.metrics.requests.labels("_unknown", "not_found")._value.get() == 1  # names never served: one series


# -- item 2: a refused stream is UNAVAILABLE, never INTERNAL -------------------------------------------
async def test_a_refused_stream_is_unavailable_even_when_the_client_writes_late() -> None:
    from kvmesh import runtime

    gate = runtime._ServingGate(lambda: False, lambda: "the frontend lost its discovery lease")
    harness = FrontendHarness()
    server = grpc.aio.server(interceptors=[gate])
    add_inference_service(InferenceServicer(harness.frontend, "test"), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    codes: list[grpc.StatusCode] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)

            async def attempt() -> None:
                call = stub.ModelStreamInfer()
                await asyncio.sleep(0.001)  # a client writes when it has a request, not when the stream opens
                try:
                    await call.write(llm_request("x", stream=True))
                    await call.read()
                except asyncio.InvalidStateError:  # the refusal was already seen: the status is the answer
                    pass
                except grpc.aio.AioRpcError:
                    pass
                codes.append(await call.code())

            for _ in range(10):
                await asyncio.gather(*(attempt() for _ in range(20)))
    finally:
        await server.stop(None)
        await harness.stop()
    assert set(codes) == {grpc.StatusCode.UNAVAILABLE}, {c: codes.count(c) for c in set(codes)}


# -- item 8: a model at its in-flight bound is refused at the gRPC entry, before any work -------------
@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """The frontend's spans, as a daemon with an exporter would send them."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr("opentelemetry.trace.get_tracer", lambda name, *_args, **_kw: provider.get_tracer(name))
    monkeypatch.setattr(telemetry, "_tracing_enabled", True)
    yield exporter


async def test_a_model_at_its_bound_is_refused_at_entry_and_reaches_no_router_nor_engine(mesh, spans) -> None:  # noqa: F811
    fe, worker, router = mesh
    fe.frontend.admission.factor = 1.0  # the daemon's default (--admission-factor)
    fe.add_cards(worker, max_num_seqs=1, max_waiting_requests=1)  # each engine holds 2: the model, 4
    bound = 2 * len(worker.engine_ids)
    for engine in worker.engine_ids:
        worker.behaviour[engine].delay = 0.05  # the admitted requests stay in flight while the others arrive
    call = fe.stub.ModelStreamInfer()
    admitted = [llm_request("hello world", request_id=f"a{i}", sampling={"max_tokens": 40}) for i in range(bound)]
    for request in admitted:
        await call.write(request)
    deadline = asyncio.get_running_loop().time() + 10
    while len(worker.active) < bound and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    assert len(worker.active) == bound and len(router.queries) == bound

    for i in range(3):  # on the same stream: in-band, and the stream goes on
        await call.write(llm_request("hello world", request_id=f"over{i}"))
    unary = fe.stub.ModelInfer(llm_request("hello world", request_id="over-unary"))
    await expect_status(unary, grpc.StatusCode.RESOURCE_EXHAUSTED, f"model '{MODEL}' is at capacity: {bound} requests")
    refused: list[str] = []
    finished: set[str] = set()
    while len(finished) < bound:
        message = await asyncio.wait_for(call.read(), 10)
        if message.error_message:
            assert message.error_message.startswith(f"RESOURCE_EXHAUSTED: model '{MODEL}' is at capacity")
            refused.append(message.infer_response.id)
        elif message.infer_response.parameters["triton_final_response"].bool_param:
            finished.add(message.infer_response.id)
    assert sorted(refused) == ["over0", "over1", "over2"] and finished == {r.id for r in admitted}
    # the refused requests never reached the router nor an engine
    assert len(router.queries) == bound and len(worker.requests) == bound
    assert fe.metrics.requests.labels(MODEL, "resource_exhausted")._value.get() == 4
    # each is a trace too, one failed span: load shedding shows in a trace backend
    shed = {
        span.attributes["kvmesh.client_request_id"]: span.status
        for span in spans.get_finished_spans()
        if span.name == "kvmesh.frontend/request" and span.status.status_code is StatusCode.ERROR
    }
    assert sorted(shed) == ["over-unary", "over0", "over1", "over2"]
    assert all(status.description.startswith("RESOURCE_EXHAUSTED: model") for status in shed.values())

    # the slots are given back as requests end (each as its task ends, just after its final response went
    # out): the next one is admitted
    deadline = asyncio.get_running_loop().time() + 5
    while fe.frontend.admission.inflight(MODEL) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    assert fe.frontend.admission.inflight(MODEL) == 0
    await call.write(llm_request("hello world", request_id="after", sampling={"max_tokens": 2}))
    while True:
        message = await asyncio.wait_for(call.read(), 10)
        assert not message.error_message, message.error_message
        if message.infer_response.parameters["triton_final_response"].bool_param:
            break
    await call.done_writing()
    await no_leaks(worker, router)


async def test_no_bound_when_an_engine_queue_is_unbounded(mesh) -> None:  # noqa: F811
    fe, worker, _router = mesh
    fe.frontend.admission.factor = 1.0
    fe.add_cards(worker, max_num_seqs=1, max_waiting_requests=1)
    entry = fe.registry.get(MODEL)
    assert entry is not None and fe.frontend.admission.bound(entry) == 2 * len(worker.engine_ids)
    fe.add_cards(worker, max_num_seqs=1)  # max_waiting_requests 0: the engines queue without bound
    assert fe.frontend.admission.bound(entry) == 0
    fe.frontend.admission.factor = 0.0  # --admission-factor 0: off, whatever the cards say
    fe.add_cards(worker, max_num_seqs=1, max_waiting_requests=1)
    assert fe.frontend.admission.bound(entry) == 0
