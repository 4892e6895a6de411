"""Every error of the contract, as stock tritonclient sees it: status code and message, unary and in-band."""

from __future__ import annotations

import queue
import threading

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.kserve_clients.mesh import MODEL, Mesh, bool_in, bytes_in, llm_inputs, stream_error, stream_requests

pytestmark = pytest.mark.e2e


def infer_error(mesh: Mesh, inputs: list, model: str = MODEL, **kwargs) -> InferenceServerException:
    with mesh.client() as client, pytest.raises(InferenceServerException) as info:
        client.infer(model, inputs, **kwargs)
    return info.value


@pytest.mark.parametrize(
    ("inputs", "status", "message"),
    [
        (lambda: llm_inputs(stream=False, max_tokens=1_000_000), "StatusCode.INVALID_ARGUMENT",
         "exceeds the context length"),
        (lambda: [bytes_in("sampling_parameters", "{}")], "StatusCode.INVALID_ARGUMENT",
         "missing input: one of 'text_input', 'input_ids' or 'messages' is required"),
        (lambda: [bytes_in("text_input", "x"), bool_in("beam_search", True)], "StatusCode.INVALID_ARGUMENT",
         "input 'beam_search' is not an input of this model"),
        (lambda: [bytes_in("text_input", "x"), bytes_in("sampling_parameters", "{oops")],
         "StatusCode.INVALID_ARGUMENT", "input 'sampling_parameters': not valid JSON"),
        (lambda: llm_inputs(stream=True), "StatusCode.INVALID_ARGUMENT", "input 'stream': true needs ModelStreamInfer"),
    ],
)  # fmt: skip
def test_unary_errors(mesh: Mesh, inputs, status: str, message: str) -> None:
    error = infer_error(mesh, inputs())
    assert error.status() == status, error
    assert message in error.message(), error.message()


def test_unknown_model_is_not_found(mesh: Mesh) -> None:
    error = infer_error(mesh, llm_inputs(stream=False), model="no-such-model")
    assert error.status() == "StatusCode.NOT_FOUND"
    assert "model 'no-such-model' is not served here" in error.message()
    error = stream_error(mesh.url_frontend, dict(model_name="no-such-model", inputs=llm_inputs(), request_id="x"))
    assert error.message().startswith("NOT_FOUND: model 'no-such-model'")
    with mesh.client() as client, pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("no-such-model")
    assert info.value.status() == "StatusCode.NOT_FOUND"


def test_in_band_errors_name_the_status_and_keep_the_stream(mesh: Mesh) -> None:
    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(mesh.url_frontend) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        bad = [t for t in llm_inputs() if t.name() != "exclude_input_in_output"]
        bad.append(bool_in("exclude_input_in_output", False))
        client.async_stream_infer(MODEL, bad, request_id="bad")
        client.async_stream_infer(MODEL, llm_inputs(max_tokens=3), request_id="good")
        errors, finals = [], []
        while not (errors and finals):
            result, error = results.get(timeout=30)
            if error is not None:
                errors.append(error)
            elif result.get_response().parameters["triton_final_response"].bool_param:
                finals.append(result.get_response().id)
        client.stop_stream()
    assert (
        errors[0]
        .message()
        .startswith("INVALID_ARGUMENT: input 'exclude_input_in_output': false is not allowed with stream=true")
    )
    assert finals == ["good"]


def test_model_without_live_engine_is_unavailable(mesh: Mesh) -> None:
    extra = mesh.worker("--served-model-name", "short-lived")
    mesh.wait_model("short-lived")
    assert stream_requests(mesh.url_frontend, [dict(model_name="short-lived", inputs=llm_inputs(max_tokens=2),
                                                    request_id="s")])["s"].num_tokens == 2  # fmt: skip
    extra.close()  # SIGTERM: its cards vanish at once
    mesh.wait_model("short-lived", ready=False)
    error = infer_error(mesh, llm_inputs(stream=False), model="short-lived")
    assert error.status() == "StatusCode.UNAVAILABLE"
    assert "model 'short-lived' has no live engine" in error.message()


def test_full_engine_is_resource_exhausted(mesh: Mesh) -> None:
    mesh.worker("--served-model-name", "tiny-queue", "--max-num-seqs", "1", "--max-waiting-requests", "1",
                speedup=1.0)  # fmt: skip
    mesh.wait_model("tiny-queue")
    errors: list[InferenceServerException] = []

    def one(i: int) -> None:
        try:
            with mesh.client() as client:
                client.infer("tiny-queue", llm_inputs(stream=False, max_tokens=200), request_id=f"q{i}")
        except InferenceServerException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors, "6 requests on a 1-running + 1-waiting engine: some must be refused"
    assert all(e.status() == "StatusCode.RESOURCE_EXHAUSTED" for e in errors), [e.message() for e in errors]


def test_other_triton_rpcs_are_unimplemented(mesh: Mesh) -> None:
    with mesh.client() as client, pytest.raises(InferenceServerException) as info:
        client.get_system_shared_memory_status()
    assert info.value.status() == "StatusCode.UNIMPLEMENTED"
    assert "kvmesh-frontend does not implement SystemSharedMemoryStatus" in info.value.message()
