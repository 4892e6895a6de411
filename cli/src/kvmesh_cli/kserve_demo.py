"""A minimal KServe v2 client on our own stubs: readiness probe and one streamed demo request.

(The tests use stock tritonclient; the CLI uses the generated stubs so it needs nothing else.)
"""

from __future__ import annotations

import json
import struct
import time

import grpc
from inference import grpc_service_pb2 as kserve
from inference import grpc_service_pb2_grpc as kserve_grpc

DEMO_PROMPT = "Tell me about KV caches"


def _channel(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
    """Plaintext, or TLS (the frontend's KServe port under ``kvmesh up --tls``)."""
    if credentials is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, credentials)


def server_ready(address: str, timeout: float = 1.0, credentials: grpc.ChannelCredentials | None = None) -> bool:
    with _channel(address, credentials) as channel:
        try:
            return (
                kserve_grpc.GRPCInferenceServiceStub(channel)
                .ServerReady(kserve.ServerReadyRequest(), timeout=timeout)
                .ready
            )
        except grpc.RpcError:
            return False


def served_models(address: str, timeout: float = 1.0, credentials: grpc.ChannelCredentials | None = None) -> list[str]:
    """The models the frontend serves now (with a live engine), from ModelStatistics of every model."""
    with _channel(address, credentials) as channel:
        try:
            stats = kserve_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
                kserve.ModelStatisticsRequest(), timeout=timeout
            )
        except grpc.RpcError:
            return []
    return [entry.name for entry in stats.model_stats]


def _bytes_tensor(name: str, value: bytes) -> tuple[kserve.ModelInferRequest.InferInputTensor, bytes]:
    tensor = kserve.ModelInferRequest.InferInputTensor(name=name, datatype="BYTES", shape=[1])
    return tensor, struct.pack("<I", len(value)) + value


def demo_request(
    address: str,
    model: str,
    prompt: str = DEMO_PROMPT,
    max_tokens: int = 16,
    credentials: grpc.ChannelCredentials | None = None,
) -> str:
    """Stream one request and describe what came back (text, timing, routing parameters)."""
    request = kserve.ModelInferRequest(model_name=model, id="kvmesh-up-demo")
    raw: list[bytes] = []
    for name, value in (
        ("text_input", prompt.encode()),
        ("sampling_parameters", json.dumps({"max_tokens": max_tokens}).encode()),
    ):
        tensor, data = _bytes_tensor(name, value)
        request.inputs.append(tensor)
        raw.append(data)
    request.inputs.append(kserve.ModelInferRequest.InferInputTensor(name="stream", datatype="BOOL", shape=[1]))
    raw.append(b"\x01")
    request.raw_input_contents.extend(raw)
    pieces: list[str] = []
    params: dict[str, object] = {}
    started = time.perf_counter()
    first = None
    with _channel(address, credentials) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        try:
            for reply in stub.ModelStreamInfer(iter([request]), timeout=60):
                if reply.error_message:
                    return f"demo request failed: {reply.error_message}"
                response = reply.infer_response
                for i, output in enumerate(response.outputs):
                    if output.name == "text_output" and i < len(response.raw_output_contents):
                        blob = response.raw_output_contents[i]
                        pieces.append(blob[4:].decode(errors="replace") if len(blob) >= 4 else "")
                    elif output.name == "text_output" and output.contents.bytes_contents:
                        pieces.append(output.contents.bytes_contents[0].decode(errors="replace"))
                if first is None and pieces:
                    first = time.perf_counter() - started
                for key, param in response.parameters.items():
                    if (choice := param.WhichOneof("parameter_choice")) is not None:
                        params[key] = getattr(param, choice)
                if (
                    response.parameters.get("triton_final_response")
                    and response.parameters["triton_final_response"].bool_param
                ):
                    break
        except grpc.RpcError as exc:  # the call itself failed (the frontend went away): say so, no traceback
            return f"demo request failed: {exc.code().name}: {exc.details()}"
    total = time.perf_counter() - started
    routing = {k: v for k, v in params.items() if k.startswith("kvmesh.")}
    return (
        f"demo request: {prompt!r} -> {''.join(pieces)!r}\n"
        f"  {len(pieces)} streamed responses, first after {1000 * (first or total):.1f} ms, "
        f"done in {1000 * total:.1f} ms; routing: {routing}"
    )
