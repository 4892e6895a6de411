"""Stock tritonclient (sync and asyncio) against real daemons: metadata, readiness and generation."""

from __future__ import annotations

import asyncio
import os

import pytest
import tritonclient.grpc.aio as aioclient

from tests.kserve_clients.mesh import (
    MODEL,
    Mesh,
    Outcome,
    absorb,
    is_final,
    llm_inputs,
    param,
    stream_requests,
)

pytestmark = pytest.mark.e2e

LONG_PROMPT = " ".join(f"word{i}" for i in range(120))  # several 16-token blocks


def test_server_and_model_readiness(mesh: Mesh) -> None:
    with mesh.client() as client:
        assert client.is_server_live()
        assert client.is_server_ready()
        assert client.is_model_ready(MODEL)
        assert not client.is_model_ready("no-such-model")
        meta = client.get_server_metadata()
        assert meta.name == "kvmesh"
        assert "model_configuration" in meta.extensions


def test_model_metadata_and_decoupled_config(mesh: Mesh) -> None:
    with mesh.client() as client:
        meta = client.get_model_metadata(MODEL)
        inputs = {t.name: t.datatype for t in meta.inputs}
        for name, datatype in [("text_input", "BYTES"), ("stream", "BOOL"), ("sampling_parameters", "BYTES"),
                               ("exclude_input_in_output", "BOOL"), ("max_tokens", "INT32")]:  # fmt: skip
            assert inputs[name] == datatype
        assert {"text_output", "finish_reason"} <= {t.name for t in meta.outputs}
        config = client.get_model_config(MODEL).config
        assert config.model_transaction_policy.decoupled
        assert all(i.optional for i in config.input)
        assert client.get_inference_statistics(MODEL).model_stats[0].name == MODEL


def test_streaming_from_text_input(mesh: Mesh) -> None:
    out = stream_requests(mesh.url_frontend, [dict(inputs=llm_inputs(max_tokens=24), request_id="t1")])["t1"]
    assert out.num_tokens == 24 and out.finish_reason == "length"
    assert out.responses >= 1 and out.text
    assert isinstance(param(out.final, "kvmesh.worker_id"), int)
    assert param(out.final, "kvmesh.cached_tokens") >= 0


def test_non_streaming_model_infer(mesh: Mesh) -> None:
    with mesh.client() as client:
        result = client.infer(MODEL, llm_inputs("Say hi", stream=False, max_tokens=8), request_id="u1")
    assert result.as_numpy("num_output_tokens")[0] == 8
    assert result.as_numpy("text_output")[0].decode().startswith("Say hi")  # not streaming: prompt + completion
    assert result.get_response().id == "u1"
    assert isinstance(param(result, "kvmesh.worker_id"), int)


def test_streaming_from_input_ids_and_from_messages(mesh: Mesh) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!"}]
    outcomes = stream_requests(mesh.url_frontend, [
        dict(inputs=llm_inputs(None, ids=list(range(100, 140)), max_tokens=10), request_id="ids"),
        dict(inputs=llm_inputs(None, messages=messages, max_tokens=12), request_id="chat"),
    ])  # fmt: skip
    assert outcomes["ids"].num_tokens == 10
    assert outcomes["chat"].num_tokens == 12


def test_empty_final_response(mesh: Mesh) -> None:
    out = stream_requests(
        mesh.url_frontend,
        [dict(inputs=llm_inputs(max_tokens=4), request_id="e1", enable_empty_final_response=True)],
    )["e1"]
    assert out.num_tokens == 4
    assert out.final.get_response().outputs == []  # the flag travels on an extra, empty response


def test_kv_routing_is_visible_and_pinning_works(mesh: Mesh) -> None:
    entries = mesh.router_metric("kvmesh_router_index_entries")
    first = stream_requests(mesh.url_frontend, [dict(inputs=llm_inputs(LONG_PROMPT, max_tokens=4), request_id="p1")])
    engine = param(first["p1"].final, "kvmesh.worker_id")
    # the same prompt again, once the engine's KV events for it reached the router (they travel after the
    # response): the router sees the cached prefix on that engine and goes back to it
    # at least a token per word: 7 full 16-token blocks, on the engine (and, disaggregated, on the prefill
    # engine); none new when the engine already held the prompt (a mesh shared with an earlier run of it)
    if not param(first["p1"].final, "kvmesh.cached_tokens"):
        blocks = (120 // 16) * (2 if os.environ.get("KVMESH_TEST_DISAGG") else 1)
        mesh.wait_router_metric("kvmesh_router_index_entries", entries + blocks)
    again = stream_requests(mesh.url_frontend, [dict(inputs=llm_inputs(LONG_PROMPT, max_tokens=4), request_id="p2")])
    assert param(again["p2"].final, "kvmesh.worker_id") == engine
    assert param(again["p2"].final, "kvmesh.cached_tokens") > 0
    pinned = stream_requests(mesh.url_frontend, [
        dict(inputs=llm_inputs("pin me", max_tokens=3), request_id="p3", parameters={"kvmesh.worker_id": engine}),
    ])  # fmt: skip
    assert param(pinned["p3"].final, "kvmesh.worker_id") == engine


def test_32_concurrent_requests_on_one_stream(mesh: Mesh) -> None:
    async def run() -> dict[str, Outcome]:
        outcomes = {f"c{i}": Outcome() for i in range(32)}

        async def requests():
            for i in range(32):
                yield {"model_name": MODEL, "inputs": llm_inputs(f"request number {i}", max_tokens=8 + i % 4),
                       "request_id": f"c{i}"}  # fmt: skip

        async with aioclient.InferenceServerClient(mesh.url_frontend) as client:
            async for result, error in client.stream_infer(requests()):
                assert error is None, error
                absorb(outcomes[result.get_response().id], result)
        return outcomes

    outcomes = asyncio.run(asyncio.wait_for(run(), 60))
    for i in range(32):
        out = outcomes[f"c{i}"]
        assert out.final is not None and is_final(out.final)
        assert out.num_tokens == 8 + i % 4


def test_prometheus_metrics(mesh: Mesh) -> None:
    stream_requests(mesh.url_frontend, [dict(inputs=llm_inputs(max_tokens=5), request_id="m1")])
    text = mesh.metrics()
    for needle in (
        'kvmesh_frontend_requests_total{model="kvmesh-mock",outcome="success"}',
        'kvmesh_frontend_time_to_first_token_seconds_count{model="kvmesh-mock"}',
        'kvmesh_frontend_inter_token_latency_seconds_count{model="kvmesh-mock"}',
        'kvmesh_frontend_request_duration_seconds_count{model="kvmesh-mock",outcome="success"}',
        'kvmesh_frontend_output_tokens_sum{model="kvmesh-mock"}',
        'kvmesh_frontend_inflight_requests{model="kvmesh-mock"} 0.0',
    ):
        assert needle in text, needle
