"""The servicer in process: real frontend modules, real gRPC, contract-faithful worker and router peers."""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
import pytest
from inference import grpc_service_pb2 as pb
from kvmesh.channels import ChannelPool
from kvmesh.discovery.base import Added, Removed, Snapshot, model_key
from kvmesh.v1 import router_pb2, worker_pb2
from kvmesh_frontend.engine_stream import FOLD_AT, EngineCall, EngineError
from kvmesh_frontend.models import ModelRegistry
from kvmesh_frontend.tensors import output_values

from tests.frontend.frontend_fakes import (
    MODEL,
    NS,
    OUTPUT_TEXT,
    EngineBehaviour,
    FakeRouter,
    FakeWorker,
    FrontendHarness,
    bool_input,
    bytes_input,
    ids_input,
    llm_request,
    output_tokens,
    prompt_of,
    to_raw,
    tokenizer_files,
)

ENGINES = [0x11, 0x22]


@pytest.fixture
async def mesh():
    worker = FakeWorker(ENGINES)
    await worker.start()
    router = FakeRouter({e: worker.address for e in ENGINES})
    await router.start()
    fe = FrontendHarness()
    await fe.start()
    fe.add_cards(worker)
    fe.add_router(router, 0xAA)
    await fe.wait_ready()
    yield fe, worker, router
    await fe.stop()
    await router.stop()
    await worker.stop()


def text_of(response: pb.ModelInferResponse) -> str:
    values = output_values(response, "text_output")
    return values[0].decode() if values else ""


def param(response: pb.ModelInferResponse, key: str):
    p = response.parameters[key]
    return getattr(p, p.WhichOneof("parameter_choice"))


async def no_leaks(worker: FakeWorker, router: FakeRouter, within: float = 1.0) -> None:
    """Every engine stream ended and every booking was freed (lifecycle updates are asynchronous)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while (worker.active or router.bookings) and loop.time() < deadline:
        await asyncio.sleep(0.005)
    assert not worker.active, worker.active
    assert not router.bookings, router.bookings


async def stream_all(fe: FrontendHarness, requests: list[pb.ModelInferRequest]) -> list[pb.ModelStreamInferResponse]:
    """Send every request on one stream; collect until each request got its final response."""
    call = fe.stub.ModelStreamInfer()
    for request in requests:
        await call.write(request)
    pending = {r.id for r in requests}
    out = []
    while pending:
        message = await asyncio.wait_for(call.read(), 10)
        assert message is not grpc.aio.EOF
        out.append(message)
        r = message.infer_response
        if r.parameters["triton_final_response"].bool_param:
            pending.discard(r.id)
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    return out


# -- health and metadata -------------------------------------------------------------------------
async def test_readiness_follows_the_model_cards(mesh) -> None:
    fe, worker, _ = mesh
    stub = fe.stub
    assert (await stub.ServerLive(pb.ServerLiveRequest())).live
    assert (await stub.ServerReady(pb.ServerReadyRequest())).ready
    assert (await stub.ModelReady(pb.ModelReadyRequest(name=MODEL))).ready
    assert not (await stub.ModelReady(pb.ModelReadyRequest(name="other"))).ready
    fe.remove_cards(worker)
    assert not (await stub.ServerReady(pb.ServerReadyRequest())).ready
    assert not (await stub.ModelReady(pb.ModelReadyRequest(name=MODEL))).ready
    fe.add_cards(worker)
    assert (await stub.ModelReady(pb.ModelReadyRequest(name=MODEL))).ready
    # a fresh snapshot that lacks a card removes it
    fe.registry.apply(Snapshot({model_key(NS, MODEL, 0x11): worker.card(0x11).SerializeToString()}))
    assert fe.registry.engines(MODEL) == [0x11]
    assert worker.file_fetches == 2  # tokenizer.json + tokenizer_config.json, once for every engine (same digest)


async def test_metadata_and_decoupled_config(mesh) -> None:
    fe, _, _ = mesh
    meta = await fe.stub.ModelMetadata(pb.ModelMetadataRequest(name=MODEL))
    inputs = {t.name: (t.datatype, list(t.shape)) for t in meta.inputs}
    assert inputs["text_input"] == ("BYTES", [1]) and inputs["stream"] == ("BOOL", [1])
    assert {"sampling_parameters", "exclude_input_in_output", "max_tokens", "input_ids", "messages"} <= set(inputs)
    assert {t.name for t in meta.outputs} >= {"text_output", "finish_reason", "num_input_tokens", "num_output_tokens"}
    config = (await fe.stub.ModelConfig(pb.ModelConfigRequest(name=MODEL))).config
    assert config.model_transaction_policy.decoupled
    assert all(i.optional for i in config.input)
    assert config.parameters["block_size"].string_value == "4"
    server = await fe.stub.ServerMetadata(pb.ServerMetadataRequest())
    assert server.name == "kvmesh" and "model_configuration" in server.extensions
    for rpc, req in ((fe.stub.ModelMetadata, pb.ModelMetadataRequest), (fe.stub.ModelConfig, pb.ModelConfigRequest)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await rpc(req(name="nope"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "model 'nope' is not served here (known models: fake-model)" in info.value.details()


async def test_a_served_model_whose_engines_are_gone_is_unavailable_on_every_model_call(mesh) -> None:
    """A worker restarting: inference said UNAVAILABLE (retry) while the metadata, config and statistics
    a client reads first said NOT_FOUND "not served here (known models: none)", a wrong name's answer."""
    fe, worker, _ = mesh
    fe.remove_cards(worker)
    calls = (
        fe.stub.ModelMetadata(pb.ModelMetadataRequest(name=MODEL)),
        fe.stub.ModelConfig(pb.ModelConfigRequest(name=MODEL)),
        fe.stub.ModelStatistics(pb.ModelStatisticsRequest(name=MODEL)),
        fe.stub.ModelInfer(llm_request("x")),
    )
    for call in calls:
        await expect_status(call, grpc.StatusCode.UNAVAILABLE, f"model '{MODEL}' has no live engine")
    fe.add_cards(worker)
    await fe.wait_ready()
    await fe.stub.ModelMetadata(pb.ModelMetadataRequest(name=MODEL))


async def test_a_model_has_one_version_and_any_other_is_not_found(mesh) -> None:
    """As Triton answers for a version it does not have; "" and "1" name the one there is."""
    fe, _, _ = mesh
    missing = f"model '{MODEL}' version 7 is not found (its one version is 1)"
    for version in ("", "1"):
        assert (await fe.stub.ModelReady(pb.ModelReadyRequest(name=MODEL, version=version))).ready
        await fe.stub.ModelMetadata(pb.ModelMetadataRequest(name=MODEL, version=version))
    assert not (await fe.stub.ModelReady(pb.ModelReadyRequest(name=MODEL, version="7"))).ready
    for call in (
        fe.stub.ModelMetadata(pb.ModelMetadataRequest(name=MODEL, version="7")),
        fe.stub.ModelConfig(pb.ModelConfigRequest(name=MODEL, version="7")),
        fe.stub.ModelStatistics(pb.ModelStatisticsRequest(name=MODEL, version="7")),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.NOT_FOUND, missing)
    request = llm_request("x", model=MODEL)
    request.model_version = "7"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await fe.stub.ModelInfer(request)
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.NOT_FOUND, missing)


async def test_a_version_is_read_as_triton_reads_it(mesh) -> None:
    """Triton reads a version with ``std::stol``: "01" and " 1" are version 1, a version that is no integer
    or is negative is INVALID_ARGUMENT (on ModelReady too), any other integer NOT_FOUND."""
    fe, _, _ = mesh
    for version in ("01", " 1", "+1", "1 "):
        assert (await fe.stub.ModelReady(pb.ModelReadyRequest(name=MODEL, version=version))).ready, version
        await fe.stub.ModelMetadata(pb.ModelMetadataRequest(name=MODEL, version=version))
    assert not (await fe.stub.ModelReady(pb.ModelReadyRequest(name=MODEL, version="0"))).ready
    for version, says in (
        ("abc", "failed to get model version from specified version string 'abc'"),
        ("99999999999999999999", "failed to get model version from specified version string"),
        ("-1", "invalid model version specified '-1', version should be an integral value > 0"),
    ):
        for call in (
            fe.stub.ModelReady(pb.ModelReadyRequest(name=MODEL, version=version)),
            fe.stub.ModelMetadata(pb.ModelMetadataRequest(name=MODEL, version=version)),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in info.value.details(), version


async def test_unimplemented_rpcs_say_why(mesh) -> None:
    fe, _, _ = mesh
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await fe.stub.RepositoryIndex(pb.RepositoryIndexRequest())
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "does not implement RepositoryIndex" in info.value.details()


# -- generation ----------------------------------------------------------------------------------
async def test_model_infer_returns_prompt_and_completion(mesh) -> None:
    fe, worker, router = mesh
    request = llm_request("hello world", sampling={"max_tokens": 6}, extra=[bool_input("return_finish_reason", True)])
    request.inputs.append(bool_input("return_num_output_tokens", True))
    request.inputs.append(bool_input("return_num_input_tokens", True))
    response = await fe.stub.ModelInfer(request)
    expected = fe.registry.get(MODEL).assets.tokenizer.decode(output_tokens()[:6])
    assert text_of(response) == "hello world" + expected  # not streaming: the prompt is repeated (Triton's rule)
    assert output_values(response, "finish_reason") == [b"length"]
    assert output_values(response, "num_output_tokens") == [6]
    tok = fe.registry.get(MODEL).assets.tokenizer
    assert output_values(response, "num_input_tokens") == [len(tok.encode("hello world"))]
    assert response.id == "r1" and response.model_name == MODEL
    assert param(response, "kvmesh.worker_id") in ENGINES
    assert param(response, "kvmesh.cached_tokens") == 3  # the engine's own count, not the router's overlap
    await no_leaks(worker, router)
    sent = worker.requests[-1]
    assert prompt_of(sent) == [0, *fe.registry.get(MODEL).assets.tokenizer.encode("hello world", False)]
    assert sent.sampling.max_tokens == 6


async def test_streaming_deltas_final_flag_and_routing_parameters(mesh) -> None:
    fe, worker, router = mesh
    for b in worker.behaviour.values():
        b.batch = 3
        b.delay = 0.01  # the client keeps up: no coalescing
    prompt = "hello world hello world hello"  # > one block: the router reports overlap
    messages = await stream_all(fe, [llm_request(prompt, stream=True, sampling={"max_tokens": 10})])
    assert all(not m.error_message for m in messages)
    responses = [m.infer_response for m in messages]
    assert len(responses) == 4  # one KServe response per engine response (3+3+3+1 tokens)
    assert [r.parameters["triton_final_response"].bool_param for r in responses] == [False, False, False, True]
    tok = fe.registry.get(MODEL).assets.tokenizer
    assert "".join(text_of(r) for r in responses) == tok.decode(output_tokens()[:10])
    final = responses[-1]
    assert param(final, "kvmesh.worker_id") in ENGINES
    assert param(final, "kvmesh.cached_tokens") == 3  # the engine's own count (the router predicted 2 x 4)
    assert "kvmesh.worker_id" not in responses[0].parameters
    query = router.queries[-1]
    assert query.num_tokens == len(tok.encode(prompt)) and len(query.block_hashes) == query.num_tokens // 4
    stages = [s for rid, s in router.lifecycle if rid == query.request_id]
    assert stages == [router_pb2.LIFECYCLE_STAGE_FIRST_TOKEN, router_pb2.LIFECYCLE_STAGE_FINISHED]


class _StreamEnd:
    """The one thing an EngineCall asks of its stream: to cancel a request."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


async def test_engine_responses_that_pile_up_are_merged() -> None:
    call = EngineCall(_StreamEnd(), "r1")  # type: ignore[arg-type]  # a fake: cancel() is all it uses
    call._push(worker_pb2.GenerateResponse(token_ids=[0], num_prompt_tokens=7))
    first = await anext(call)  # the consumer keeps up: the first response alone
    assert list(first.token_ids) == [0] and first.num_prompt_tokens == 7
    for i in range(1, 10):  # the consumer is busy (writing to its client) while the rest arrives
        call._push(worker_pb2.GenerateResponse(token_ids=[i]))
    call._push(worker_pb2.GenerateResponse(token_ids=[10], finish_reason=worker_pb2.FINISH_REASON_LENGTH))
    merged = await anext(call)
    assert list(merged.token_ids) == list(range(1, 11))
    assert merged.finish_reason == worker_pb2.FINISH_REASON_LENGTH
    with pytest.raises(StopAsyncIteration):
        await anext(call)


async def test_responses_piling_up_for_a_stalled_consumer_are_folded_as_they_come() -> None:
    """A client that stops reading stalls its request's consumer: what piles up meanwhile is kept as one
    growing response (FOLD_AT responses at most), and the consumer still gets every token once, in order."""
    call = EngineCall(_StreamEnd(), "r1")  # type: ignore[arg-type]  # a fake: cancel() is all it uses
    lp = worker_pb2.TokenLogprobs
    first = worker_pb2.GenerateResponse(token_ids=[0, 1], logprobs=[lp(logprob=0), lp(logprob=-1)], num_prompt_tokens=7)
    first.num_cached_tokens = 4
    call._push(first)
    for i in range(2, 10 * FOLD_AT):
        call._push(worker_pb2.GenerateResponse(token_ids=[i], logprobs=[lp(logprob=-i)]))
        assert len(call._items) < FOLD_AT
    call._push(worker_pb2.GenerateResponse(token_ids=[10 * FOLD_AT], finish_reason=worker_pb2.FINISH_REASON_STOP))
    merged = await anext(call)
    assert list(merged.token_ids) == list(range(10 * FOLD_AT + 1))
    assert [p.logprob for p in merged.logprobs] == [-i for i in range(10 * FOLD_AT)]
    assert merged.num_prompt_tokens == 7 and merged.num_cached_tokens == 4
    assert merged.finish_reason == worker_pb2.FINISH_REASON_STOP
    with pytest.raises(StopAsyncIteration):
        await anext(call)


async def test_an_engine_call_waits_then_surfaces_its_error_and_cancels_once() -> None:
    stream = _StreamEnd()
    call = EngineCall(stream, "r1")  # type: ignore[arg-type]  # a fake: cancel() is all it uses
    waiting = asyncio.ensure_future(anext(call))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    call._push(worker_pb2.GenerateResponse(token_ids=[1]))
    assert list((await waiting).token_ids) == [1]
    call._fail(EngineError(grpc.StatusCode.UNAVAILABLE, "worker gone"))
    with pytest.raises(EngineError, match="worker gone"):
        await anext(call)
    call.cancel()  # already over: nothing to tell the worker
    assert stream.cancelled == []

    live = EngineCall(stream, "r2")  # type: ignore[arg-type]  # a fake: cancel() is all it uses
    live.cancel()
    live.cancel()
    assert stream.cancelled == ["r2"]
    with pytest.raises(StopAsyncIteration):
        await anext(live)


async def test_empty_final_response(mesh) -> None:
    fe, _, _ = mesh
    request = llm_request(
        "hi", stream=True, sampling={"max_tokens": 2}, params={"triton_enable_empty_final_response": True}
    )
    responses = [m.infer_response for m in await stream_all(fe, [request])]
    assert [r.parameters["triton_final_response"].bool_param for r in responses] == [False, False, True]
    assert len(responses[-1].outputs) == 0 and "kvmesh.worker_id" in responses[-1].parameters


async def test_non_streaming_on_the_stream_sends_one_response(mesh) -> None:
    fe, _, _ = mesh
    request = llm_request("hi", stream=False, exclude_input=True, sampling={"max_tokens": 5})
    responses = [m.infer_response for m in await stream_all(fe, [request])]
    assert len(responses) == 1 and responses[0].parameters["triton_final_response"].bool_param
    tok = fe.registry.get(MODEL).assets.tokenizer
    assert text_of(responses[0]) == tok.decode(output_tokens()[:5])


async def test_32_concurrent_requests_on_one_stream_are_demultiplexed(mesh) -> None:
    fe, worker, router = mesh
    for b in worker.behaviour.values():
        b.delay = 0.002
    requests = [llm_request(f"prompt {i}", request_id=f"req-{i}", stream=True, sampling={"max_tokens": 3 + i % 5})
                for i in range(32)]  # fmt: skip
    messages = await stream_all(fe, requests)
    by_id: dict[str, list[pb.ModelInferResponse]] = {}
    for m in messages:
        assert not m.error_message
        by_id.setdefault(m.infer_response.id, []).append(m.infer_response)
    tok = fe.registry.get(MODEL).assets.tokenizer
    for i in range(32):
        got = by_id[f"req-{i}"]
        assert "".join(text_of(r) for r in got) == tok.decode(output_tokens()[: 3 + i % 5])
        assert [r.parameters["triton_final_response"].bool_param for r in got][-1]
    assert len({param(r[-1], "kvmesh.worker_id") for r in by_id.values()}) == 2  # round robin used both
    await no_leaks(worker, router)


async def test_input_ids_and_raw_inputs(mesh) -> None:
    fe, worker, _ = mesh
    request = llm_request(None, stream=True, sampling={"max_tokens": 4}, extra=[ids_input([5, 6, 7, 8, 9], "INT64")])
    responses = [m.infer_response for m in await stream_all(fe, [to_raw(request)])]
    assert prompt_of(worker.requests[-1]) == [5, 6, 7, 8, 9]
    tok = fe.registry.get(MODEL).assets.tokenizer
    assert "".join(text_of(r) for r in responses) == tok.decode(output_tokens()[:4])
    request = llm_request(
        None,
        sampling={"max_tokens": 3},
        extra=[ids_input([5, 6]), bool_input("return_output_ids", True)],
    )
    request.outputs.add(name="output_ids")
    response = await fe.stub.ModelInfer(request)
    assert output_values(response, "output_ids") == output_tokens()[:3]
    assert output_values(response, "text_output") is None


async def test_messages_are_rendered_with_the_chat_template(mesh) -> None:
    fe, worker, _ = mesh
    messages = [{"role": "user", "content": "hello"}]
    request = llm_request(
        None, stream=True, sampling={"max_tokens": 2}, extra=[bytes_input("messages", json.dumps(messages))]
    )
    await stream_all(fe, [request])
    tok = fe.registry.get(MODEL).assets.tokenizer
    assert prompt_of(worker.requests[-1]) == tok.encode("<s><|user|>hello\n<|assistant|>", add_special_tokens=False)
    assert prompt_of(worker.requests[-1])[0] == 0  # exactly one BOS: the template's


async def test_utf8_is_never_split_on_the_wire(mesh) -> None:
    fe, worker, _ = mesh
    tok_ids = fe.registry.get(MODEL).assets.tokenizer.encode(" 日本 🙂 ok", add_special_tokens=False)
    for b in worker.behaviour.values():
        b.tokens = tok_ids
        b.delay = 0.005  # the client keeps up: one KServe response per engine response
    responses = [
        m.infer_response
        for m in await stream_all(fe, [llm_request("x", stream=True, sampling={"max_tokens": len(tok_ids)})])
    ]
    texts = [text_of(r) for r in responses]
    assert "".join(texts) == " 日本 🙂 ok"
    assert all("\ufffd" not in t for t in texts)
    assert len(responses) == len(tok_ids)  # still one response per engine response, some with empty text


async def test_stop_string_ends_the_request_and_the_engine_stream(mesh) -> None:
    fe, worker, router = mesh
    for b in worker.behaviour.values():
        b.delay = 0.005
    request = llm_request("x", stream=True, sampling={"max_tokens": 400, "stop": ["lazy"]},
                          extra=[bool_input("return_finish_reason", True)])  # fmt: skip
    responses = [m.infer_response for m in await stream_all(fe, [request])]
    text = "".join(text_of(r) for r in responses)
    assert text == OUTPUT_TEXT[: OUTPUT_TEXT.index("lazy")]
    assert output_values(responses[-1], "finish_reason") == [b"stop"]
    # before the last response: str(None), as Triton's vLLM backend sends it
    assert {tuple(output_values(r, "finish_reason")) for r in responses[:-1]} == {(b"None",)}
    await no_leaks(worker, router)
    assert worker.cancelled  # the engine was told to stop


async def test_a_stop_string_inside_a_many_token_response_ends_at_its_token(mesh) -> None:
    """Engine responses of several tokens (a stream interval, or deltas merged behind a slow client) stop
    where one token at a time would: the token completing the stop string is the last one counted."""
    fe, worker, router = mesh
    tokenizer = fe.registry.get(MODEL).assets.tokenizer
    tokens = worker.behaviour[ENGINES[0]].tokens
    kept = next(n for n in range(1, len(tokens) + 1) if "lazy" in tokenizer.decode(tokens[:n]))
    for b in worker.behaviour.values():
        b.batch = 5  # "lazy" ends inside a response, not at its end
        b.delay = 0.005
    assert kept % 5 != 0
    flags = [bool_input("return_output_ids", True), bool_input("return_num_output_tokens", True)]
    request = llm_request("x", stream=True, sampling={"max_tokens": 400, "stop": ["lazy"]}, extra=flags)
    responses = [m.infer_response for m in await stream_all(fe, [request])]
    assert "".join(text_of(r) for r in responses) == OUTPUT_TEXT[: OUTPUT_TEXT.index("lazy")]
    ids = [t for r in responses for t in output_values(r, "output_ids")]
    assert ids == tokens[:kept]
    assert sum(output_values(r, "num_output_tokens")[0] for r in responses) == kept
    await no_leaks(worker, router)


async def test_a_stop_string_in_the_first_min_tokens_tokens_does_not_stop(mesh) -> None:
    """As in vLLM, the text of the first min_tokens tokens is not searched for stop strings."""
    fe, worker, router = mesh
    tokenizer = fe.registry.get(MODEL).assets.tokenizer
    tokens = worker.behaviour[ENGINES[0]].tokens
    kept = next(n for n in range(1, len(tokens) + 1) if "lazy" in tokenizer.decode(tokens[:n]))
    sampling = {"max_tokens": kept + 4, "min_tokens": kept, "stop": ["lazy"]}
    response = await fe.stub.ModelInfer(
        llm_request("x", sampling=sampling, extra=[bool_input("return_finish_reason", True)])
    )
    assert "lazy" in text_of(response) and output_values(response, "finish_reason") == [b"length"]
    await no_leaks(worker, router)


async def test_a_stop_tokens_text_is_left_out_unless_asked_for(mesh) -> None:
    """As vLLM: the stop token's id is output, its text only with include_stop_str_in_output."""
    fe, worker, router = mesh
    tokenizer = fe.registry.get(MODEL).assets.tokenizer
    tokens = worker.behaviour[ENGINES[0]].tokens
    k = next(n for n in range(2, len(tokens)) if tokenizer.decode(tokens[n - 1 : n]).strip())  # a token with text
    for b in worker.behaviour.values():
        b.eos_after = k  # the engine stops at the k-th token: the stop token
    flags = [bool_input("return_output_ids", True), bool_input("exclude_input_in_output", True)]
    for include, text in ((False, tokenizer.decode(tokens[: k - 1])), (True, tokenizer.decode(tokens[:k]))):
        sampling = {"max_tokens": 50, "stop_token_ids": [tokens[k - 1]], "include_stop_str_in_output": include}
        response = await fe.stub.ModelInfer(llm_request("x", sampling=sampling, extra=flags))
        assert text_of(response) == text, include
        assert output_values(response, "output_ids") == tokens[:k]
    await no_leaks(worker, router)


async def test_stream_interval_reaches_the_engine(mesh) -> None:
    fe, worker, _ = mesh
    await stream_all(fe, [llm_request("x", stream=True, sampling={"max_tokens": 4, "stream_interval": 6})])
    assert worker.requests[-1].sampling.stream_interval == 6
    await stream_all(fe, [llm_request("x", stream=True, sampling={"max_tokens": 4})])
    assert worker.requests[-1].sampling.stream_interval == 0  # unset: the worker's own interval


async def test_a_request_answered_once_asks_the_engine_for_its_first_and_last_output_only(mesh) -> None:
    """Without ``stream`` the client gets one response at the end, so the engine holds every token after
    the first (TTFT) until it finishes: the whole interval is ``max_tokens``, whatever the request said.
    Stop strings are matched on the text as it arrives, so a request with them streams per token."""
    fe, worker, router = mesh
    response = await fe.stub.ModelInfer(llm_request("x", sampling={"max_tokens": 40, "stream_interval": 3}))
    assert text_of(response)
    assert worker.requests[-1].sampling.stream_interval == 40
    await stream_all(fe, [llm_request("x", sampling={"max_tokens": 12})])  # a stream, but stream=false
    assert worker.requests[-1].sampling.stream_interval == 12
    await fe.stub.ModelInfer(llm_request("x", sampling={"max_tokens": 40, "stop": ["zebra"]}))
    assert worker.requests[-1].sampling.stream_interval == 0
    await no_leaks(worker, router)


# -- errors --------------------------------------------------------------------------------------
async def expect_status(call, code: grpc.StatusCode, text: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    assert text in info.value.details(), info.value.details()


MALFORMED_BYTES = b"\x0a\x03\xff\xfe\xfd"  # model_name = 3 bytes that are not UTF-8 (a C++ client can send them)


async def test_bytes_that_are_no_model_infer_request_are_invalid_argument(mesh) -> None:
    fe, _, _ = mesh
    raw = fe.channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer", request_serializer=bytes, response_deserializer=bytes
    )
    for garbage in (MALFORMED_BYTES, b"\xff\xff\xff"):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw(garbage)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == (
            "the message is not a valid inference.ModelInferRequest (it does not parse, or a string field is not UTF-8)"
        )


async def test_a_malformed_message_on_a_stream_is_refused_in_band_and_the_others_go_on(mesh) -> None:
    fe, worker, router = mesh
    for b in worker.behaviour.values():
        b.delay = 0.002
    good = llm_request("a long answer", request_id="good", stream=True, sampling={"max_tokens": 20})
    stream = fe.channel.stream_stream(
        "/inference.GRPCInferenceService/ModelStreamInfer",
        request_serializer=bytes,
        response_deserializer=pb.ModelStreamInferResponse.FromString,
    )
    messages = [m async for m in stream(iter([good.SerializeToString(), MALFORMED_BYTES]))]
    errors = [m.error_message for m in messages if m.error_message]
    assert errors == ["INVALID_ARGUMENT: the message is not a valid inference.ModelInferRequest (it does not "
                      "parse, or a string field is not UTF-8)"]  # fmt: skip
    answer = [m.infer_response for m in messages if m.infer_response.id == "good"]
    tok = fe.registry.get(MODEL).assets.tokenizer
    assert "".join(text_of(r) for r in answer) == tok.decode(output_tokens()[:20])
    # Counted as every refusal is (it was not: a client sending garbage showed nowhere).
    assert fe.metrics.requests.labels("_unknown", "invalid_argument")._value.get() == 1
    await no_leaks(worker, router)


async def test_model_infer_errors_are_statuses(mesh) -> None:
    fe, worker, router = mesh
    stub = fe.stub
    await expect_status(stub.ModelInfer(llm_request("x", model="nope")), grpc.StatusCode.NOT_FOUND, "model 'nope'")
    await expect_status(stub.ModelInfer(llm_request(None)), grpc.StatusCode.INVALID_ARGUMENT, "missing input")
    await expect_status(stub.ModelInfer(llm_request("x", stream=True)), grpc.StatusCode.INVALID_ARGUMENT,
                        "input 'stream': true needs ModelStreamInfer")  # fmt: skip
    await expect_status(
        stub.ModelInfer(llm_request(None, extra=[ids_input([1, 400])])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "token id 400 at index 1 is outside the vocabulary [0, 320)",
    )
    await expect_status(stub.ModelInfer(llm_request("x", sampling={"max_tokens": 5000})),
                        grpc.StatusCode.INVALID_ARGUMENT, "exceeds the context length 4096")  # fmt: skip
    await expect_status(
        stub.ModelInfer(llm_request("x", sampling={"min_tokens": 100})),
        grpc.StatusCode.INVALID_ARGUMENT,
        "min_tokens (100) must not exceed max_tokens (16, the default here): set max_tokens",
    )
    await expect_status(
        stub.ModelInfer(llm_request("x", params={"kvmesh.worker_id": 99})),
        grpc.StatusCode.NOT_FOUND,
        "engine 0x63 does not serve model 'fake-model' (its engines: 0x",
    )
    router.outcome = router_pb2.DECISION_OUTCOME_REJECTED
    await expect_status(stub.ModelInfer(llm_request("x")), grpc.StatusCode.RESOURCE_EXHAUSTED, "every engine is busy")
    router.outcome = router_pb2.DECISION_OUTCOME_NO_ENGINE
    await expect_status(stub.ModelInfer(llm_request("x")), grpc.StatusCode.UNAVAILABLE, "no live engine")
    router.outcome = router_pb2.DECISION_OUTCOME_ERROR  # the router's own failure is not the client's mistake
    await expect_status(stub.ModelInfer(llm_request("x")), grpc.StatusCode.INTERNAL, "the router failed to decide")
    router.outcome = router_pb2.DECISION_OUTCOME_ROUTED
    for b in worker.behaviour.values():
        b.error = (grpc.StatusCode.INVALID_ARGUMENT, "prompt longer than max_model_len 100")
    await expect_status(stub.ModelInfer(llm_request("x")), grpc.StatusCode.INVALID_ARGUMENT, "max_model_len 100")
    for b in worker.behaviour.values():
        b.error = (grpc.StatusCode.RESOURCE_EXHAUSTED, "waiting queue full")
    await expect_status(stub.ModelInfer(llm_request("x")), grpc.StatusCode.RESOURCE_EXHAUSTED, "waiting queue full")
    for b in worker.behaviour.values():
        b.error = (grpc.StatusCode.DATA_LOSS, "boom")
    await expect_status(stub.ModelInfer(llm_request("x")), grpc.StatusCode.INTERNAL, "request fe-")
    fe.remove_cards(worker)
    await expect_status(stub.ModelInfer(llm_request("x")), grpc.StatusCode.UNAVAILABLE, "has no live engine")
    await no_leaks(worker, router)


async def test_a_request_the_router_did_not_route_sends_it_no_lifecycle_update(mesh) -> None:
    """The router booked nothing for a refusal: a FINISHED for it would count as an unknown request."""
    fe, _, router = mesh
    for outcome in (router_pb2.DECISION_OUTCOME_REJECTED, router_pb2.DECISION_OUTCOME_NO_ENGINE):
        router.outcome = outcome
        with pytest.raises(grpc.aio.AioRpcError):
            await fe.stub.ModelInfer(llm_request("x"))
    router.outcome = router_pb2.DECISION_OUTCOME_ROUTED
    await fe.stub.ModelInfer(llm_request("x"))  # its updates follow any sent before on the one Session stream
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while router_pb2.LIFECYCLE_STAGE_FINISHED not in {stage for _, stage in router.lifecycle}:
        assert loop.time() < deadline, router.lifecycle
        await asyncio.sleep(0.005)
    assert len({rid for rid, _ in router.lifecycle}) == 1, router.lifecycle  # the routed request's only


async def test_engines_of_two_block_sizes_route_at_the_size_most_of_them_have(mesh, caplog) -> None:
    """A fleet in the middle of a --block-size change: prompts are hashed at one size, the most engines'
    (not whichever card came last), and the router told which; a request pinned to an engine of the
    other size is hashed at that engine's."""
    fe, worker, router = mesh
    caplog.set_level(logging.WARNING, "kvmesh_frontend.models")
    worker.behaviour[0x33] = EngineBehaviour()
    router.engines[0x33] = worker.address
    odd = worker.card(0x33, block_size=8)
    fe.registry.apply(Added(model_key(NS, MODEL, 0x33), odd.SerializeToString()))  # the last card seen
    assert "its engines have block sizes 4/8; requests are routed at block size 4 (2 engines)" in caplog.text
    await fe.stub.ModelInfer(llm_request("hello world, hello KV caches"))
    await fe.stub.ModelInfer(llm_request("hello world, hello KV caches", params={"kvmesh.worker_id": 0x33}))
    routed, pinned = router.queries[-2:]
    assert routed.block_size == 4 and pinned.block_size == 8
    assert len(routed.block_hashes) == 2 * len(pinned.block_hashes) > 0


async def test_stream_errors_are_in_band_and_the_stream_goes_on(mesh) -> None:
    fe, _, router = mesh
    requests = [
        llm_request("x", model="nope", request_id="a", stream=True),
        llm_request("x", request_id="b", stream=True, exclude_input=False),
        llm_request("x", request_id="c", stream=True, sampling={"max_tokens": 2}),
    ]
    messages = await stream_all(fe, requests)
    errors = {m.infer_response.id: m.error_message for m in messages if m.error_message}
    assert errors["a"].startswith("NOT_FOUND: model 'nope'")
    assert errors["b"].startswith("INVALID_ARGUMENT: input 'exclude_input_in_output'")
    assert [m.infer_response.id for m in messages if not m.error_message] == ["c", "c"]
    fe.router.apply(Removed(router.record(0xAA)[0]))
    messages = await stream_all(fe, [llm_request("x", request_id="d", stream=True)])
    assert messages[0].error_message.startswith("UNAVAILABLE: no router replica is registered in namespace 'test'")


async def test_a_draining_frontend_ends_each_stream_once_its_requests_in_flight_have(mesh) -> None:
    """SIGTERM: a stream with a request in flight finishes it, refuses new ones (UNAVAILABLE, in band) and
    then ends; an idle stream a client keeps open ends at once. Else the drain waited its whole timeout."""
    fe, worker, _ = mesh
    for b in worker.behaviour.values():
        b.delay = 0.01
    busy, idle = fe.stub.ModelStreamInfer(), fe.stub.ModelStreamInfer()
    await busy.write(llm_request("x", request_id="in-flight", stream=True, sampling={"max_tokens": 30}))
    first = await asyncio.wait_for(busy.read(), 10)
    assert not first.error_message
    await idle.write(llm_request("x", request_id="warm", stream=True, sampling={"max_tokens": 1}))
    while not (await asyncio.wait_for(idle.read(), 10)).infer_response.parameters["triton_final_response"].bool_param:
        pass
    fe.servicer.drain()
    assert await asyncio.wait_for(idle.read(), 2) is grpc.aio.EOF  # nothing in flight: ended at once
    await busy.write(llm_request("x", request_id="late", stream=True, sampling={"max_tokens": 1}))
    finals: dict[str, pb.ModelStreamInferResponse] = {}
    while (message := await asyncio.wait_for(busy.read(), 10)) is not grpc.aio.EOF:
        if message.error_message or message.infer_response.parameters["triton_final_response"].bool_param:
            finals[message.infer_response.id] = message
    assert finals["late"].error_message.startswith("UNAVAILABLE: kvmesh-frontend is shutting down")
    assert not finals["in-flight"].error_message
    assert (await busy.code()) == grpc.StatusCode.OK


# -- migration, cancellation, failover -------------------------------------------------------------
async def test_migration_when_the_engine_dies_mid_stream(mesh) -> None:
    fe, worker, router = mesh
    worker.behaviour[0x11].die_after = 5
    worker.behaviour[0x11].batch = 2
    request = llm_request(
        "hello world",
        stream=True,
        sampling={"max_tokens": 12},
        params={"kvmesh.router_mode": "round_robin"},
        extra=[bool_input("return_num_output_tokens", True)],
    )
    messages = await stream_all(fe, [request])
    assert not [m for m in messages if m.error_message]
    responses = [m.infer_response for m in messages]
    assert sum(output_values(r, "num_output_tokens")[0] for r in responses) == 12
    final = responses[-1]
    assert param(final, "kvmesh.migrations") == 1 and param(final, "kvmesh.worker_id") == 0x22
    first, second = router.queries[-2:]
    assert list(second.excluded_engine_ids) == [0x11]
    assert second.num_tokens == first.num_tokens + 5 and second.expected_output_tokens == 7
    resumed = worker.requests[-1]
    assert resumed.sampling.max_tokens == 7
    assert prompt_of(resumed) == prompt_of(worker.requests[-2]) + output_tokens()[:5]
    tok = fe.registry.get(MODEL).assets.tokenizer
    assert "".join(text_of(r) for r in responses) == tok.decode(output_tokens()[:5] + output_tokens()[:7])
    await no_leaks(worker, router)


async def test_a_broken_engine_stream_migrates_every_request_on_it_and_is_reopened(mesh) -> None:
    fe, worker, router = mesh
    for b in worker.behaviour.values():
        b.delay = 0.01
    worker.break_stream_after = 3
    requests = [
        llm_request(
            "hello world",
            request_id=f"r{i}",
            stream=True,
            sampling={"max_tokens": 8},
            extra=[bool_input("return_num_output_tokens", True)],
        )
        for i in range(2)
    ]
    messages = await stream_all(fe, requests)
    assert not [m for m in messages if m.error_message]
    for rid in ("r0", "r1"):
        responses = [m.infer_response for m in messages if m.infer_response.id == rid]
        assert sum(output_values(r, "num_output_tokens")[0] for r in responses) == 8
        assert param(responses[-1], "kvmesh.migrations") == 1  # both were on the stream that broke
    assert worker.streams_opened == 2
    messages = await stream_all(fe, [llm_request("hello world", stream=True, sampling={"max_tokens": 4})])
    assert not [m for m in messages if m.error_message]
    assert worker.streams_opened == 2  # the new stream serves the next request
    await no_leaks(worker, router)


async def test_a_worker_that_leaves_discovery_keeps_its_stream_until_its_requests_end(mesh) -> None:
    fe, worker, router = mesh
    for b in worker.behaviour.values():
        b.delay = 0.02
    call = fe.stub.ModelStreamInfer()
    await call.write(llm_request("hello world", stream=True, sampling={"max_tokens": 10}))
    first = await asyncio.wait_for(call.read(), 10)
    assert not first.error_message and worker.address in fe.pool

    fe.remove_cards(worker)  # the worker leaves discovery (lease gone) while the request runs
    responses = [first]
    while not responses[-1].infer_response.parameters["triton_final_response"].bool_param:
        responses.append(await asyncio.wait_for(call.read(), 10))
    assert not [m for m in responses if m.error_message]
    assert param(responses[-1].infer_response, "kvmesh.migrations") == 0  # finished where it was
    await call.done_writing()

    async with asyncio.timeout(5):  # then the stream and the connection go
        while worker.address in fe.pool or worker.address in fe.generator.engines:
            await asyncio.sleep(0.01)
    fe.add_cards(worker)  # back at the same address: a new connection serves it
    messages = await stream_all(fe, [llm_request("hello world", stream=True, sampling={"max_tokens": 3})])
    assert not [m for m in messages if m.error_message]
    assert worker.streams_opened == 2
    await no_leaks(worker, router)


async def test_an_engine_that_left_discovery_is_excluded_while_a_router_replica_still_offers_it(mesh) -> None:
    """Routers watch discovery on their own and may lag: the frontend excludes the engines it saw leave,
    so none of its new requests goes to one, until the engine registers again."""
    fe, worker, router = mesh
    fe.registry.apply(Removed(model_key(NS, MODEL, 0x11)))  # the fake router still offers 0x11
    messages = await stream_all(
        fe, [llm_request(f"prompt {i}", request_id=f"p{i}", sampling={"max_tokens": 2}) for i in range(4)]
    )
    assert not [m for m in messages if m.error_message]
    assert [list(q.excluded_engine_ids) for q in router.queries] == [[0x11]] * 4
    assert {r.engine_id for r in worker.requests} == {0x22}

    fe.add_cards(worker)  # 0x11 registers again: offered and served again
    router.queries.clear()
    await stream_all(fe, [llm_request(f"again {i}", request_id=f"a{i}", sampling={"max_tokens": 2}) for i in range(2)])
    assert [list(q.excluded_engine_ids) for q in router.queries] == [[], []]
    assert 0x11 in {r.engine_id for r in worker.requests}
    await no_leaks(worker, router)


def test_the_registry_reports_a_worker_address_once_its_last_card_is_gone() -> None:
    registry = ModelRegistry(ChannelPool(), NS)
    gone: list[str] = []
    registry.on_address_gone = gone.append
    worker = FakeWorker([0x11, 0x22], files={})
    worker.address = "10.0.0.1:1"

    def put(engine_id: int, address: str) -> None:
        card = worker.card(engine_id, address=address)
        registry.apply(Added(model_key(NS, MODEL, engine_id), card.SerializeToString()))

    put(0x11, "10.0.0.1:1")
    put(0x22, "10.0.0.1:1")
    put(0x11, "10.0.0.2:1")  # engine 11 re-registers elsewhere: engine 22 still lives at the first address
    assert gone == [] and registry.address_live("10.0.0.1:1") and registry.address_live("10.0.0.2:1")
    registry.apply(Removed(model_key(NS, MODEL, 0x22)))
    assert gone == ["10.0.0.1:1"] and not registry.address_live("10.0.0.1:1")
    registry.apply(Removed(model_key(NS, MODEL, 0x11)))
    assert gone == ["10.0.0.1:1", "10.0.0.2:1"]


async def test_migration_limit(mesh) -> None:
    fe, worker, router = mesh
    fe.generator.migration_limit = 1
    for b in worker.behaviour.values():
        b.die_after = 1
    messages = await stream_all(fe, [llm_request("x", stream=True, sampling={"max_tokens": 8})])
    assert messages[-1].error_message.startswith("UNAVAILABLE: request fe-")
    assert "migration limit (1) is reached" in messages[-1].error_message
    fe.generator.migration_limit = 3
    messages = await stream_all(fe, [llm_request("x", request_id="z", stream=True, sampling={"max_tokens": 8})])
    assert "no engine left to migrate to" in messages[-1].error_message  # both engines excluded
    await no_leaks(worker, router)


async def test_client_cancel_frees_the_engine_and_the_booking(mesh) -> None:
    fe, worker, router = mesh
    for b in worker.behaviour.values():
        b.delay = 0.01
    call = fe.stub.ModelStreamInfer()
    for i in range(4):
        await call.write(llm_request("x", request_id=f"c{i}", stream=True, sampling={"max_tokens": 1000}))
    for _ in range(8):
        await call.read()
    assert len(worker.active) == 4 and len(router.bookings) == 4
    call.cancel()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 1.0
    while (worker.active or router.bookings) and loop.time() < deadline:
        await asyncio.sleep(0.01)
    assert not worker.active and not router.bookings
    assert len(worker.cancelled) == 4


async def test_unary_cancel_frees_everything(mesh) -> None:
    fe, worker, router = mesh
    for b in worker.behaviour.values():
        b.delay = 0.01
    call = fe.stub.ModelInfer(llm_request("x", sampling={"max_tokens": 1000}))
    while not worker.active:
        await asyncio.sleep(0.005)
    call.cancel()
    for _ in range(100):
        if not worker.active and not router.bookings:
            break
        await asyncio.sleep(0.01)
    assert not worker.active and not router.bookings


async def test_router_failover_to_another_replica(mesh) -> None:
    fe, _, router = mesh
    second = FakeRouter(dict(router.engines))
    await second.start()
    try:
        fe.router_snapshot((router, 0xAA), (second, 0xBB))
        await stream_all(fe, [llm_request("x", request_id="warm", stream=True, sampling={"max_tokens": 1})])
        used, spare = router, second  # queries are spread round-robin: each replica gets some
        # the replica stops answering, then dies with queries waiting for decisions; its record
        # stays in discovery (as after kill -9, until the lease expires)
        used.silent = True
        before = len(used.queries) + len(spare.queries)
        pending = asyncio.create_task(
            stream_all(fe, [llm_request("x", request_id=f"f{i}", stream=True) for i in range(5)])
        )
        while len(used.queries) + len(spare.queries) < before + 5:
            await asyncio.sleep(0.005)
        waiting = len(used.queries)
        await used.stop()
        messages = await pending
        assert not [m for m in messages if m.error_message]
        assert waiting and len(spare.queries) >= 5
        await asyncio.sleep(0.05)
        assert spare.queries and not spare.bookings
    finally:
        await second.stop()


async def test_a_replica_restarted_on_its_port_gets_a_fresh_channel(mesh, caplog) -> None:
    """Restart=on-failure with a fixed port: the new replica (a new instance id) answers where the dead one
    did. Its Session gets a channel of its own, not the dead replica's, whose reconnect backoff failed the
    first write (the replica was then avoided for 5 s); the dead one's channel is closed."""
    fe, _, router = mesh
    await stream_all(fe, [llm_request("x", request_id="warm", stream=True, sampling={"max_tokens": 1})])
    port = int(router.address.rsplit(":", 1)[1])
    await router.stop()  # kill -9, its record still in discovery: a query fails to connect to it
    down = await stream_all(fe, [llm_request("x", request_id="down", stream=True, sampling={"max_tokens": 1})])
    assert down[0].error_message.startswith("UNAVAILABLE")  # the dead replica's channel now backs off
    restarted = FakeRouter(dict(router.engines))
    await restarted.start(port)
    try:
        fe.router.apply(Removed(router.record(0xAA)[0]))
        fe.router.apply(Added(*restarted.record(0xAB)))
        caplog.set_level(logging.WARNING, logger="kvmesh_frontend.routing")
        caplog.clear()  # the dead replica's own breaks are behind us
        messages = await stream_all(fe, [llm_request("x", request_id="after", stream=True, sampling={"max_tokens": 1})])
        assert not [m for m in messages if m.error_message]
        assert restarted.queries and not [r for r in caplog.records if "broke" in r.getMessage()]
        await asyncio.sleep(0.05)
        assert 0xAA not in fe.pool and 0xAB in fe.pool
    finally:
        await restarted.stop()


async def test_a_silent_replica_is_hedged_to_another_and_abandoned(mesh) -> None:
    """A replica behind a dropped link stalls silently: its stream breaks only when gRPC keepalive notices
    (~5 s, issue 18). After ``--route-hedge`` a query without a decision also goes to another replica, the
    first decision wins, and the silent replica is told FINISHED for it (whatever it booked is freed)."""
    fe, _, router = mesh
    fe.router._hedge = 0.1
    second = FakeRouter(dict(router.engines))
    await second.start()
    try:
        fe.router_snapshot((router, 0xAA), (second, 0xBB))
        await stream_all(fe, [llm_request("x", request_id="warm", stream=True, sampling={"max_tokens": 1})])
        router.silent = True
        before = len(router.queries)
        requests = [llm_request("x", request_id=f"h{i}", stream=True, sampling={"max_tokens": 2}) for i in range(4)]
        messages = await stream_all(fe, requests)
        assert not [m for m in messages if m.error_message]
        stalled = {q.request_id for q in router.queries[before:]}
        assert stalled  # round robin sent some of them to the silent replica first
        assert stalled <= {q.request_id for q in second.queries}  # each of those was hedged
        await asyncio.sleep(0.05)
        finished = {rid for rid, stage in router.lifecycle if stage == router_pb2.LIFECYCLE_STAGE_FINISHED}
        assert stalled <= finished
    finally:
        await second.stop()


async def test_router_timeout_frees_the_booking(mesh) -> None:
    fe, _, router = mesh
    fe.router._timeout = 0.2
    router.silent = True
    messages = await stream_all(fe, [llm_request("x", stream=True)])
    assert messages[0].error_message.startswith("UNAVAILABLE: no router replica gave a decision within 0.2s (1 tried)")
    await asyncio.sleep(0.05)
    assert router.lifecycle[-1][1] == router_pb2.LIFECYCLE_STAGE_FINISHED


async def test_router_that_has_not_seen_the_engine_yet_is_retried(mesh) -> None:
    fe, worker, router = mesh
    router.blind_for = 3  # discovery reached the frontend before the router
    messages = await stream_all(fe, [llm_request("x", stream=True, sampling={"max_tokens": 2})])
    assert not [m for m in messages if m.error_message]
    assert len(router.queries) == 4
    await no_leaks(worker, router)
    # but a router that keeps saying so is believed after the grace period
    router.blind_for = 1000
    messages = await stream_all(fe, [llm_request("x", request_id="r2", stream=True)])
    assert messages[0].error_message.startswith("UNAVAILABLE: model 'fake-model': no live engine can take the request")


async def test_pinned_worker_goes_direct(mesh) -> None:
    fe, _, router = mesh
    responses = [
        m.infer_response
        for m in await stream_all(fe, [llm_request("x", stream=True, params={"kvmesh.worker_id": 0x22})])
    ]
    assert param(responses[-1], "kvmesh.worker_id") == 0x22
    query = router.queries[-1]
    assert query.pinned_engine_id == 0x22 and query.overrides.mode == router_pb2.ROUTER_MODE_DIRECT


async def test_statistics_and_metrics(mesh) -> None:
    fe, _, _ = mesh
    await fe.stub.ModelInfer(llm_request("x", sampling={"max_tokens": 2}))
    with pytest.raises(grpc.aio.AioRpcError):
        await fe.stub.ModelInfer(llm_request(None))
    stats = await fe.stub.ModelStatistics(pb.ModelStatisticsRequest(name=MODEL))
    s = stats.model_stats[0]
    assert s.inference_count == 1 and s.inference_stats.success.count == 1 and s.inference_stats.fail.count == 1
    assert fe.metrics.requests.labels(MODEL, "success")._value.get() == 1
    assert fe.metrics.requests.labels(MODEL, "invalid_argument")._value.get() == 1


async def test_tokenizer_less_model_needs_input_ids() -> None:
    worker = FakeWorker([0x33], files={})
    await worker.start()
    router = FakeRouter({0x33: worker.address})
    await router.start()
    fe = FrontendHarness()
    await fe.start()
    try:
        fe.add_cards(worker)
        fe.add_router(router, 1)
        await fe.wait_ready()
        await expect_status(fe.stub.ModelInfer(llm_request("x")), grpc.StatusCode.INVALID_ARGUMENT,
                            "model 'fake-model' serves no tokenizer; send 'input_ids' instead")  # fmt: skip
        # stop strings would match nothing: refused, never silently ignored
        await expect_status(
            fe.stub.ModelInfer(llm_request(None, sampling={"stop": ["."]}, extra=[ids_input([1, 2])])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "'stop' strings are matched on text, and model 'fake-model' serves no tokenizer; send 'stop_token_ids'",
        )
        request = llm_request(
            None,
            sampling={"max_tokens": 2},
            extra=[ids_input([1, 2]), bool_input("return_output_ids", True)],
        )
        request.outputs.add(name="output_ids")
        response = await fe.stub.ModelInfer(request)
        assert len(output_values(response, "output_ids")) == 2
    finally:
        await fe.stop()
        await router.stop()
        await worker.stop()


async def test_tokenizer_files_that_do_not_load_are_unavailable_without_the_engines_address() -> None:
    """Why the files failed (which engine, at which address, the parser's words) is for the log only."""
    worker = FakeWorker([0x34], files={"tokenizer.json": b"{not json"})
    await worker.start()
    router = FakeRouter({0x34: worker.address})
    await router.start()
    fe = FrontendHarness()
    await fe.start()
    try:
        fe.add_cards(worker)
        fe.add_router(router, 1)
        await fe.wait_ready()
        await expect_status(
            fe.stub.ModelInfer(llm_request("x")),
            grpc.StatusCode.UNAVAILABLE,
            "model 'fake-model': its tokenizer files could not be loaded from any of its engines (retried within 5 s)",
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await fe.stub.ModelInfer(llm_request("x"))
        assert worker.address not in (refused.value.details() or "")
    finally:
        await fe.stop()
        await router.stop()
        await worker.stop()


async def test_models_appear_live_and_share_tokenizer_downloads() -> None:
    worker = FakeWorker([0x41, 0x42])
    await worker.start()
    fe = FrontendHarness()
    await fe.start()
    try:
        assert not (await fe.stub.ServerReady(pb.ServerReadyRequest())).ready
        fe.add_cards(worker, model="m1")
        fe.add_cards(worker, model="m2")
        await fe.wait_ready("m1")
        await fe.wait_ready("m2")
        assert (await fe.stub.ServerReady(pb.ServerReadyRequest())).ready
        assert worker.file_fetches == 2  # same files digest: one download for both models
        assert fe.registry.names() == ["m1", "m2"]
        assert tokenizer_files()  # (the digest is derived from these files)
    finally:
        await fe.stop()
        await worker.stop()
