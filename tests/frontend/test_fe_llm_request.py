"""The LLM tensor contract: what each client sends parses to the right request; each mistake has its message."""

from __future__ import annotations

import json

import grpc
import pytest
from inference import grpc_service_pb2 as pb
from kvmesh.v1 import router_pb2
from kvmesh_frontend.errors import FrontendError
from kvmesh_frontend.llm_request import OUTPUT_FLAGS, OUTPUTS, parse_llm_request

from tests.frontend.frontend_fakes import bool_input, bytes_input, ids_input, llm_request, to_raw


def int_input(name: str, value: int, datatype: str = "INT32") -> pb.ModelInferRequest.InferInputTensor:
    tensor = pb.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=[1])
    (tensor.contents.int_contents if datatype == "INT32" else tensor.contents.int64_contents).append(value)
    return tensor


def test_vllm_backend_request_from_genai_perf() -> None:
    # genai-perf --backend vllm --streaming: numbers arrive as strings
    request = llm_request("tell me a story", stream=True, exclude_input=True, sampling={"max_tokens": "16"})
    for form in (request, to_raw(request)):
        req = parse_llm_request(form)
        assert req.text == "tell me a story"
        assert req.stream and req.exclude_input
        assert req.sampling.max_tokens == 16
        assert req.client_id == "r1" and req.model == "fake-model"


def test_tensorrtllm_style_request_from_genai_perf() -> None:
    request = llm_request("hi", stream=True, exclude_input=True, extra=[int_input("max_tokens", 256)])
    request.inputs.append(int_input("min_length", 256))
    req = parse_llm_request(to_raw(request))
    assert req.sampling.max_tokens == 256
    assert req.sampling.min_tokens == 256


def test_streaming_alias_and_defaults() -> None:
    req = parse_llm_request(llm_request("hi", extra=[bool_input("streaming", True)]))
    assert req.stream and req.exclude_input  # streaming never repeats the prompt
    req = parse_llm_request(llm_request("hi"))
    assert not req.stream and not req.exclude_input  # non-streaming repeats it by default (Triton's rule)
    assert req.sampling.max_tokens is None


def test_sampling_keys_and_precedence() -> None:
    sampling = {
        "max_tokens": 8, "min_tokens": 2, "temperature": 0, "top_p": "0.5", "top_k": -1, "seed": 7,
        "stop": ["\n", "END"], "stop_token_ids": [5, 6], "ignore_eos": True, "include_stop_str_in_output": True,
        "n": 1, "presence_penalty": 0, "lora_name": "",
    }  # fmt: skip
    params = {"max_tokens": 100, "temperature": 0.7, "ignore_eos": False, "seed": 3}
    req = parse_llm_request(llm_request("x", sampling=sampling, params=params, extra=[int_input("max_tokens", 4)]))
    s = req.sampling
    # parameters map < sampling_parameters JSON < max_tokens tensor
    assert (s.max_tokens, s.min_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (4, 2, 0.0, 0.5, 0, 7)
    assert s.stop == ("\n", "END") and s.stop_token_ids == (5, 6)
    assert s.ignore_eos and s.include_stop_str_in_output


def test_parameters_map_alone_carries_sampling() -> None:
    req = parse_llm_request(llm_request("x", params={"max_tokens": 5, "stop": "END", "top_k": 3}))
    assert req.sampling.max_tokens == 5 and req.sampling.stop == ("END",) and req.sampling.top_k == 3


def test_routing_and_triton_parameters() -> None:
    params = {"kvmesh.worker_id": 17, "triton_enable_empty_final_response": True, "sequence_id": 5, "unknown": "x"}
    req = parse_llm_request(llm_request("x", params=params))
    assert req.pinned_engine_id == 17
    assert req.router_mode == router_pb2.ROUTER_MODE_DIRECT
    assert req.empty_final
    assert parse_llm_request(llm_request("x", params={"kvmesh.worker_id": "0x11"})).pinned_engine_id == 17
    req = parse_llm_request(llm_request("x", params={"kvmesh.router_mode": "round_robin"}))
    assert req.router_mode == router_pb2.ROUTER_MODE_ROUND_ROBIN


def test_input_ids_and_messages() -> None:
    for datatype in ("INT32", "INT64"):
        request = llm_request(None, extra=[ids_input([5, 6, 7], datatype)])
        for form in (request, to_raw(request)):
            req = parse_llm_request(form)
            assert req.input_ids is not None and req.input_ids.tolist() == [5, 6, 7] and req.prompt_input == "input_ids"
            # the prompt is held as the u32 LE bytes that are hashed and sent to the worker
            assert req.input_ids.u32le == b"\x05\x00\x00\x00\x06\x00\x00\x00\x07\x00\x00\x00"
    # content as vLLM hands it to a template that takes strings: text parts joined by "\n", null as ""
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ]
    req = parse_llm_request(llm_request(None, extra=[bytes_input("messages", json.dumps(messages))]))
    assert req.messages == [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""}]


def test_tool_calls_reach_the_template_as_vllm_hands_them() -> None:
    """Arguments as an object, not a JSON string inside the JSON; an empty list dropped ("list object has
    no element 0" in a Llama-3 template); a malformed one in the history as {} (else every later turn fails)."""

    def call(arguments: object) -> dict:
        return {"type": "function", "function": {"name": "f", "arguments": arguments}}

    messages = [
        {"role": "assistant", "content": None, "tool_calls": [call('{"city": "Paris"}'), call("{oops"), call("[1]")]},
        {"role": "assistant", "content": "b", "tool_calls": []},
    ]
    req = parse_llm_request(llm_request(None, extra=[bytes_input("messages", json.dumps(messages))]))
    assert [c["function"]["arguments"] for c in req.messages[0]["tool_calls"]] == [{"city": "Paris"}, {}, {}]
    assert "tool_calls" not in req.messages[1]


def test_requested_outputs_and_flags() -> None:
    request = llm_request("x", extra=[bool_input("return_finish_reason", True)])
    req = parse_llm_request(request)
    assert req.wants("text_output") and req.wants("finish_reason") and not req.wants("num_output_tokens")
    request.outputs.add(name="num_output_tokens")
    req = parse_llm_request(request)
    # Triton's vLLM backend: named outputs filter what the flags enable; they enable nothing
    assert not req.wants("num_output_tokens") and not req.wants("text_output") and not req.wants("finish_reason")
    request.outputs.add(name="finish_reason")
    assert parse_llm_request(request).wants("finish_reason")


def test_every_output_named_gives_only_the_flagged_ones() -> None:
    """perf_analyzer names every output of the metadata: the response still carries text_output only."""
    request = llm_request("x")
    for name in OUTPUTS:
        request.outputs.add(name=name)
    req = parse_llm_request(request)
    assert [name for name in OUTPUTS if req.wants(name)] == ["text_output"]
    flagged = llm_request("x", extra=[bool_input(flag, True) for flag in OUTPUT_FLAGS.values()])
    assert all(parse_llm_request(flagged).wants(name) for name in OUTPUTS)


@pytest.mark.parametrize(
    ("value", "expected"), [(16, 16), ("16", 16), (16.0, 16), (16.9, 16), (" 7 ", 7), ("016", 16), ("+16", 16)]
)
def test_max_tokens_as_vllm_backend_reads_it(value: object, expected: int) -> None:
    """The vLLM backend applies int() to max_tokens: strings and floats (truncated) are accepted."""
    request = llm_request("x", extra=[bytes_input("sampling_parameters", json.dumps({"max_tokens": value}))])
    assert parse_llm_request(request).sampling.max_tokens == expected


@pytest.mark.parametrize("value", ["0x10", "0b1", "16.0", "sixteen"])
def test_max_tokens_that_int_refuses_is_refused(value: str) -> None:
    """int() reads no base prefix: "0x10" was taken as 16 here while "016" was refused, the reverse of int()."""
    request = llm_request("x", extra=[bytes_input("sampling_parameters", json.dumps({"max_tokens": value}))])
    with pytest.raises(FrontendError, match=r"max_tokens.* must be an integer, got"):
        parse_llm_request(request)


def test_what_triton_does_to_outputs_and_kvmesh_cannot_is_refused_not_ignored() -> None:
    """tritonclient's class_count and shared-memory outputs and inputs came back as plain text, or as a count
    of raw contents that named no cause."""
    classify = llm_request("x")
    classify.outputs.add(name="text_output").parameters["classification"].int64_param = 3
    with pytest.raises(FrontendError, match="output 'text_output': classification"):
        parse_llm_request(classify)
    shared_out = llm_request("x")
    shared_out.outputs.add(name="text_output").parameters["shared_memory_region"].string_param = "r"
    with pytest.raises(FrontendError, match="output 'text_output': kvmesh writes no shared memory"):
        parse_llm_request(shared_out)
    shared_in = llm_request("x")
    shared_in.inputs[0].parameters["shared_memory_region"].string_param = "r"
    with pytest.raises(FrontendError, match=r"input 'text_input' is in a shared memory region"):
        parse_llm_request(shared_in)
    plain = llm_request("x")
    plain.outputs.add(name="text_output").parameters["classification"].int64_param = 0  # 0: no classification
    assert parse_llm_request(plain).requested_outputs == ("text_output",)


def test_logprob_flags_and_key() -> None:
    sampling = bytes_input("sampling_parameters", json.dumps({"logprobs": 2}))
    flags = [bool_input("return_logprobs", True), bool_input("return_cumulative_logprob", True)]
    req = parse_llm_request(llm_request("x", extra=[sampling, *flags]))
    assert req.sampling.logprobs == 2 and req.wants("logprobs") and req.wants("cumulative_logprob")


@pytest.mark.parametrize(("value", "expected"), [(8, 8), ("8", 8), (1, 1), (None, None)])
def test_stream_interval_is_vllms_key(value: object, expected: int | None) -> None:
    """vLLM's ``stream_interval`` (tokens per streamed response after the first), read like its other ints."""
    request = llm_request("x", extra=[bytes_input("sampling_parameters", json.dumps({"stream_interval": value}))])
    assert parse_llm_request(request).sampling.stream_interval == expected


def messages_input(doc: object) -> pb.ModelInferRequest.InferInputTensor:
    return bytes_input("messages", doc if isinstance(doc, str) else json.dumps(doc))


BAD = [
    ("missing prompt", llm_request(None), "missing input: one of 'text_input', 'input_ids' or 'messages' is required"),
    ("long id", llm_request("x", request_id="i" * 4097),  # echoed in every response of a stream
     "the request id has 4097 characters; at most 4096 are accepted"),
    ("two prompts", llm_request("x", extra=[ids_input([1])]), "inputs 'text_input' and 'input_ids' are exclusive"),
    ("unknown input", llm_request("x", extra=[bool_input("beam", True)]), "input 'beam' is not an input of this model"),
    ("text datatype", llm_request(None, extra=[int_input("text_input", 3)]),
     "input 'text_input': expected datatype BYTES, got INT32"),
    ("stream datatype", llm_request("x", extra=[bytes_input("stream", "true")]),
     "input 'stream': expected datatype BOOL, got BYTES"),
    ("batch of prompts", pb.ModelInferRequest(model_name="m", inputs=[pb.ModelInferRequest.InferInputTensor(
        name="text_input", datatype="BYTES", shape=[2], contents=pb.InferTensorContents(bytes_contents=[b"a", b"b"]))]),
     "input 'text_input': expected exactly one prompt, got 2 elements"),
    ("bad utf-8", llm_request(b"ab\xff"), "input 'text_input': not valid UTF-8 (byte 0xff at offset 2)"),
    ("stream with prompt in output", llm_request("x", stream=True, exclude_input=False),
     "input 'exclude_input_in_output': false is not allowed with stream=true"),
    ("stream and streaming disagree", llm_request("x", stream=True, extra=[bool_input("streaming", False)]),
     "inputs 'stream' and 'streaming' disagree"),
    ("two-element flag", llm_request("x", extra=[pb.ModelInferRequest.InferInputTensor(
        name="stream", datatype="BOOL", shape=[2], contents=pb.InferTensorContents(bool_contents=[True, True]))]),
     "input 'stream': expected exactly 1 element, got 2"),
    ("sampling not json", llm_request("x", extra=[bytes_input("sampling_parameters", "{max_tokens: 3")]),
     "input 'sampling_parameters': not valid JSON"),
    ("sampling not object", llm_request("x", extra=[bytes_input("sampling_parameters", "[1]")]),
     "input 'sampling_parameters': expected a JSON object"),
    ("sampling unknown key", llm_request("x", sampling={"max_token": 3}),
     "input 'sampling_parameters': unknown key 'max_token'"),
    ("max_tokens zero", llm_request("x", sampling={"max_tokens": 0}),
     "input 'sampling_parameters': 'max_tokens' must be >= 1, got 0"),
    ("max_tokens text", llm_request("x", sampling={"max_tokens": "many"}),
     "input 'sampling_parameters': 'max_tokens' must be an integer, got \"many\""),
    ("temperature beyond any float", llm_request("x", sampling={"temperature": 10**400}),
     "input 'sampling_parameters': 'temperature' is out of range, got 1000"),
    ("temperature negative", llm_request("x", sampling={"temperature": -1}),
     "input 'sampling_parameters': 'temperature' must be >= 0 and at most 3.40282e+38 (a 32-bit float), got -1.0"),
    ("temperature infinite", llm_request("x", params={"temperature": "inf"}), "'temperature' must be >= 0 and at"),
    # SamplingOptions carries a float32: 1e39 would reach the engine as inf, a value the client never sent.
    ("temperature past float32", llm_request("x", sampling={"temperature": 1e39}), "at most 3.40282e+38"),
    ("top_p zero", llm_request("x", sampling={"top_p": 0}), "'top_p' must be in (0, 1] and at least 1.4013e-45"),
    # ...and a top_p of 1e-46 as 0.0, which the engines read as "no top-p": near-greedy turned unfiltered.
    ("top_p below float32", llm_request("x", sampling={"top_p": 1e-46}), "got 1e-46"),
    ("top_k", llm_request("x", sampling={"top_k": -5}), "'top_k' must be -1 (disabled), 0 (disabled) or a positive"),
    ("stop type", llm_request("x", sampling={"stop": 5}), "'stop' must be a string or a list of strings, got 5"),
    ("stop empty", llm_request("x", sampling={"stop": [""]}), "'stop' must not contain an empty string"),
    ("stop ids", llm_request("x", sampling={"stop_token_ids": [-1]}),
     "'stop_token_ids'[0] must be a token id in [0, 2**32), got -1"),
    # A number echoed back is clipped like any other value (it was 301 digits here).
    ("stop ids huge", llm_request("x", sampling={"stop_token_ids": [10**300]}), "... (301 characters)"),
    ("seed huge", llm_request("x", sampling={"seed": 10**300}), "'seed' must be in [0, 2**64), got 1000"),
    ("ignore_eos", llm_request("x", sampling={"ignore_eos": "maybe"}), "'ignore_eos' must be a boolean"),
    ("n", llm_request("x", sampling={"n": 2}), "'n'=2 is not supported by kvmesh (one completion per request)"),
    ("penalty", llm_request("x", sampling={"presence_penalty": 0.5}), "'presence_penalty'=0.5 is not supported"),
    ("lora", llm_request("x", sampling={"lora_name": "a"}), "LoRA adapters are not supported by kvmesh"),
    ("min over max", llm_request("x", sampling={"max_tokens": 2, "min_tokens": 3}),
     "min_tokens (3) must not exceed max_tokens (2)"),
    ("param max_tokens", llm_request("x", params={"max_tokens": -3}), "parameter 'max_tokens' must be >= 1, got -3"),
    ("max_tokens tensor", llm_request("x", extra=[int_input("max_tokens", 0)]), "input 'max_tokens' must be >= 1"),
    ("worker id", llm_request("x", params={"kvmesh.worker_id": "eleven"}),
     "parameter 'kvmesh.worker_id' must be an engine id"),
    ("router mode", llm_request("x", params={"kvmesh.router_mode": "fastest"}),
     "parameter 'kvmesh.router_mode' must be one of kv, round_robin, random, power_of_two, direct"),
    ("direct without id", llm_request("x", params={"kvmesh.router_mode": "direct"}),
     "parameter 'kvmesh.router_mode': direct needs parameter 'kvmesh.worker_id'"),
    ("empty final flag", llm_request("x", params={"triton_enable_empty_final_response": "perhaps"}),
     "parameter 'triton_enable_empty_final_response' must be a boolean"),
    ("input_ids negative", llm_request(None, extra=[ids_input([1, -2])]),
     "input 'input_ids': token id -2 at index 1 is negative"),
    ("input_ids empty", llm_request(None, extra=[ids_input([])]), "input 'input_ids': the prompt is empty"),
    ("input_ids negative, raw", to_raw(llm_request(None, extra=[ids_input([1, 2, -3])])),
     "input 'input_ids': token id -3 at index 2 is negative"),
    ("input_ids beyond u32", to_raw(llm_request(None, extra=[ids_input([1, 1 << 32], "INT64")])),
     "input 'input_ids': token id 4294967296 at index 1 is above the largest token id 4294967295"),
    ("input_ids float", llm_request(None, extra=[pb.ModelInferRequest.InferInputTensor(
        name="input_ids", datatype="FP32", shape=[1], contents=pb.InferTensorContents(fp32_contents=[1.0]))]),
     "input 'input_ids': expected datatype INT32 or INT64, got FP32"),
    ("input_ids shape", llm_request(None, extra=[pb.ModelInferRequest.InferInputTensor(
        name="input_ids", datatype="INT32", shape=[2, 1], contents=pb.InferTensorContents(int_contents=[1, 2]))]),
     "input 'input_ids': expected shape [N] or [1, N], got [2, 1]"),
    ("messages json", llm_request(None, extra=[messages_input("[{")]), "input 'messages': not valid JSON"),
    ("messages empty", llm_request(None, extra=[messages_input([])]),
     "input 'messages': expected a non-empty JSON list"),
    ("messages role", llm_request(None, extra=[messages_input([{"content": "x"}])]),
     "input 'messages': message #0 has no string 'role'"),
    ("messages content", llm_request(None, extra=[messages_input([{"role": "user", "content": 5}])]),
     "input 'messages': message #0 'content' must be a string, a list of text parts or null"),
    ("messages part", llm_request(None, extra=[messages_input([{"role": "user", "content": [{"type": "image"}]}])]),
     "input 'messages': message #0 content part #0 is not a {\"type\": \"text\", \"text\": ...} part"),
    ("logprobs", llm_request("x", extra=[bytes_input("sampling_parameters", '{"logprobs": -1}')]),
     "input 'sampling_parameters': 'logprobs' must be >= 0, got -1"),
    ("stream_interval zero", llm_request("x", sampling={"stream_interval": 0}),
     "input 'sampling_parameters': 'stream_interval' must be >= 1, got 0"),
    ("stream_interval text", llm_request("x", sampling={"stream_interval": "often"}),
     "input 'sampling_parameters': 'stream_interval' must be an integer"),
    # Values the worker contract's integer fields cannot hold (they once failed as INTERNAL, naming ValueError)
    ("top_k beyond int32", llm_request("x", sampling={"top_k": 2**31}), "'top_k' must be -1 (disabled), 0 (disabled)"),
    ("top_k parameter", llm_request("x", params={"top_k": 2**40}), "parameter 'top_k' must be -1 (disabled)"),
    ("logprobs beyond u32", llm_request("x", sampling={"logprobs": 2**32}), "'logprobs' must be <= 4294967295"),
    ("stream_interval beyond u32", llm_request("x", sampling={"stream_interval": 2**32}),
     "'stream_interval' must be <= 4294967295"),
    ("min_tokens beyond u32", llm_request("x", sampling={"min_tokens": 2**32}), "'min_tokens' must be <= 4294967295"),
    ("a 5000-digit integer",
     llm_request("x", extra=[bytes_input("sampling_parameters", '{"max_tokens": 1' + "0" * 5000 + "}")]),
     "input 'sampling_parameters': not valid JSON here (a number with too many digits)"),
    ("65 stop strings", llm_request("x", sampling={"stop": [f"s{i}" for i in range(65)]}),
     "'stop' has 65 strings; at most 64 are accepted"),
    ("1025 stop token ids", llm_request("x", sampling={"stop_token_ids": [2] * 1025}),
     "'stop_token_ids' has 1025 token ids; at most 1024 are accepted"),
    ("a long cost policy name", llm_request("x", params={"kvmesh.router_policy": "p" * 4000}),
     "(at most 64 characters), got 'pppp"),
    ("unknown output", pb.ModelInferRequest(model_name="m", inputs=[bytes_input("text_input", "x")],
                                            outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name="logits")]),
     "output 'logits' is not an output of this model"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "request_", "message"), BAD, ids=[b[0] for b in BAD])
def test_invalid_requests(case: str, request_: pb.ModelInferRequest, message: str) -> None:
    with pytest.raises(FrontendError) as info:
        parse_llm_request(request_)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.message, info.value.message


def test_unary_refuses_streaming() -> None:
    with pytest.raises(FrontendError) as info:
        parse_llm_request(llm_request("x", stream=True), unary=True)
    assert "input 'stream': true needs ModelStreamInfer" in info.value.message
    assert not parse_llm_request(llm_request("x", stream=False), unary=True).stream
