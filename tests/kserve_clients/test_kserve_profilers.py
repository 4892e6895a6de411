"""Stock perf_analyzer 2.51 and genai-perf 0.0.16, unchanged, against a real ``kvmesh up`` (issue 16.1).

Both tools come from ``make perf-tools`` (``.venv-perf``, pinned in ``constraints-perf.txt``): their
pins clash with ours, so they run as subprocesses from that venv. Each run is bounded to a few
seconds of measurement. The same mesh answers the Triton vLLM-backend parity checks (which outputs
a response carries, ``finish_reason`` before the end, logprobs) with stock ``tritonclient``.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.kserve_clients.mesh import MODEL, bool_in, bytes_in
from tests.support.daemons import script
from tests.support.etcd import free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PERF_BIN = ROOT / ".venv-perf" / "bin"
CUDART = next((ROOT / ".venv-perf" / "lib").glob("python3*/site-packages/nvidia/cuda_runtime/lib"), None)


def _tools_env() -> dict[str, str]:
    if not (PERF_BIN / "perf_analyzer").exists() or not (PERF_BIN / "genai-perf").exists() or CUDART is None:
        pytest.skip("perf_analyzer / genai-perf are not installed: run `make perf-tools`")
    return {
        **os.environ,
        "PATH": f"{PERF_BIN}:{os.environ['PATH']}",  # genai-perf runs perf_analyzer from PATH
        "LD_LIBRARY_PATH": str(CUDART),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


class Up:
    """``kvmesh up`` as a user runs it, on its own discovery dir, namespace and port."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.discovery = f"file://{tmp / 'discovery'}"
        self.namespace = "profilers"
        self.logs = tmp / "logs"
        self.proc = subprocess.Popen(
            [script("kvmesh"), "up", "--grpc-port", str(self.port), "--discovery", self.discovery,
             "--namespace", self.namespace, "--log-dir", str(self.logs), "--no-demo", "--speedup-ratio", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        deadline = time.monotonic() + 60
        seen = []
        while True:
            line = self.proc.stdout.readline() if self.proc.stdout else ""
            seen.append(line)
            if line.startswith("kvmesh is up"):
                break
            if (not line and self.proc.poll() is not None) or time.monotonic() > deadline:
                self.close()
                raise AssertionError("kvmesh up did not come up:\n" + "".join(seen))

    @property
    def url(self) -> str:
        return f"localhost:{self.port}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    mesh = Up(tmp_path_factory.mktemp("up"))
    try:
        yield mesh
    finally:
        mesh.close()


# perf_analyzer 2.51 exports every output the model declares for every response, and an output the
# response lacks from memory it never set. For an FP32 output (``cumulative_logprob``, as Triton's
# vLLM backend declares it) that memory is sometimes a NaN; rapidjson's writer then stops, and the
# export is left empty or cut (1 run in 40 here, with exit 0). perf_analyzer asks every stream for
# an empty final response, which carries no output, so no input avoids it: a run whose export does
# not parse is run again.
EXPORT_ATTEMPTS = 3


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    output = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 0, f"{cmd[0]} exited {result.returncode}:\n{output}"
    return result


def test_perf_analyzer_streaming_without_model_version(up: Up, tmp_path: Path) -> None:
    """No ``-x 1``: perf_analyzer finds the version through ModelStatistics' queue counts."""
    env = _tools_env()
    data = {"data": [{"text_input": ["Hello"], "stream": [True], "exclude_input_in_output": [True],
                      "sampling_parameters": ['{"max_tokens": "8"}']}]}  # fmt: skip
    (tmp_path / "input.json").write_text(json.dumps(data))
    export = tmp_path / "profile.json"
    for _attempt in range(EXPORT_ATTEMPTS):
        export.unlink(missing_ok=True)  # perf_analyzer refuses an export path that exists (exit 99)
        result = _run(
            [str(PERF_BIN / "perf_analyzer"), "-m", MODEL, "-u", up.url, "-i", "grpc", "--service-kind", "triton",
             "--streaming", "--input-data", "input.json", "--concurrency-range", "2", "--measurement-mode",
             "count_windows", "--measurement-request-count", "10", "--profile-export-file", export.name,
             # a shared CI box is noisy: take the first windows, as genai-perf does (it passes 999 too)
             "--stability-percentage", "999", "--max-trials", "3"],
            env, tmp_path)  # fmt: skip
        assert "Detected decoupled model" in result.stdout
        assert "Successful request count" in result.stdout, result.stdout
        try:
            requests = json.loads(export.read_text())["experiments"][0]["requests"]
            break
        except json.JSONDecodeError:
            continue  # perf_analyzer 2.51 cut its own export: see EXPORT_ATTEMPTS
    else:
        raise AssertionError(f"perf_analyzer's export did not parse in {EXPORT_ATTEMPTS} runs")
    assert requests
    # perf_analyzer names every output; like Triton's vLLM backend, only text_output comes back (the
    # export lists every name anyway: an absent BYTES one as "", an absent number as stale memory).
    responses = [response for request in requests for response in request["response_outputs"]]
    assert any(response["text_output"] for response in responses)
    for name in ("finish_reason", "logprobs"):
        assert not any(response.get(name) for response in responses), name


def test_genai_perf_with_the_served_tokenizer(up: Up, tmp_path: Path) -> None:
    """``kvmesh model files`` gives genai-perf its ``--tokenizer``; genai-perf runs unchanged."""
    env = _tools_env()
    fetched = subprocess.run(
        [sys.executable, "-m", "kvmesh_cli.main", "model", "files", MODEL, "--out", str(tmp_path / "tok"),
         "--discovery", up.discovery, "--namespace", up.namespace],
        capture_output=True, text=True, timeout=60)  # fmt: skip
    assert fetched.returncode == 0, fetched.stderr
    assert (tmp_path / "tok" / "tokenizer.json").exists()
    _run(
        [str(PERF_BIN / "genai-perf"), "profile", "-m", MODEL, "--endpoint-type", "kserve", "--backend", "vllm",
         "-u", up.url, "--streaming", "--tokenizer", str(tmp_path / "tok"), "--synthetic-input-tokens-mean", "32",
         "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", "8", "--concurrency", "2",
         "--request-count", "10", "--warmup-request-count", "2", "--artifact-dir", "artifacts"],
        env, tmp_path, timeout=240)  # fmt: skip
    exports = list((tmp_path / "artifacts").rglob("profile_export_genai_perf.json"))
    assert exports, "genai-perf wrote no export"
    stats = json.loads(exports[0].read_text())
    assert stats["request_count"]["avg"] == 10
    assert stats["time_to_first_token"]["avg"] > 0


# -- Triton vLLM-backend parity (stock tritonclient) -------------------------------------------------
def _responses(url: str, inputs: list[grpcclient.InferInput], outputs: list[str] | None = None) -> list[Any]:
    """Every response of one streamed request (sync tritonclient), the final one included."""
    got: queue.Queue[Any] = queue.Queue()
    responses = []
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: got.put(error or result))
        client.async_stream_infer(
            MODEL, inputs, request_id="p1", outputs=[grpcclient.InferRequestedOutput(n) for n in outputs or []] or None
        )
        while True:
            item = got.get(timeout=30)
            assert not isinstance(item, Exception), item
            responses.append(item)
            final = item.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                break
        client.stop_stream()
    return responses


def _inputs(sampling: dict[str, Any], *flags: str) -> list[grpcclient.InferInput]:
    inputs = [bytes_in("text_input", "Tell me about KV caches"), bool_in("stream", True),
              bytes_in("sampling_parameters", json.dumps({"ignore_eos": True, **sampling}))]  # fmt: skip
    return inputs + [bool_in(flag, True) for flag in flags]


def test_outputs_follow_the_return_flags(up: Up) -> None:
    every = ["text_output", "finish_reason", "num_input_tokens", "num_output_tokens", "output_ids"]
    plain = _responses(up.url, _inputs({"max_tokens": 4}), outputs=every)
    assert {o.name for r in plain for o in r.get_response().outputs} == {"text_output"}
    flagged = _responses(up.url, _inputs({"max_tokens": 4}, "return_finish_reason", "return_num_input_tokens"))
    reasons = [r.as_numpy("finish_reason") for r in flagged]
    assert [x[0] for x in reasons[:-1]] == [b"None"] * (len(flagged) - 1)  # vLLM backend: str(None)
    assert reasons[-1][0] == b"length"
    assert all(r.as_numpy("num_input_tokens") is not None for r in flagged)
    assert all(r.as_numpy("num_output_tokens") is None for r in flagged)


def test_logprobs_and_cumulative_logprob(up: Up) -> None:
    with grpcclient.InferenceServerClient(up.url) as client:
        metadata = client.get_model_metadata(MODEL)
    assert {"return_logprobs", "return_cumulative_logprob"} <= {i.name for i in metadata.inputs}
    assert {"logprobs", "cumulative_logprob"} <= {o.name for o in metadata.outputs}
    responses = _responses(up.url, _inputs({"max_tokens": 5, "logprobs": 1}, "return_logprobs",
                                           "return_cumulative_logprob"))  # fmt: skip
    steps = [step for r in responses for step in json.loads(r.as_numpy("logprobs")[0])]
    assert len(steps) == 5
    for step in steps:
        (token, entry), *_ = step.items()
        assert int(token) >= 0 and entry["logprob"] <= 0 and entry["rank"] >= 1 and "decoded_token" in entry
    cumulative = [float(r.as_numpy("cumulative_logprob")[0]) for r in responses]
    total = sum(next(iter(step.values()))["logprob"] for step in steps)
    assert cumulative[-1] == pytest.approx(total, abs=1e-3)
    assert cumulative == sorted(cumulative, reverse=True)  # a running sum of values <= 0
    # without "logprobs" in sampling_parameters vLLM samples none: the output is "null"
    nulls = _responses(up.url, _inputs({"max_tokens": 2}, "return_logprobs"))
    assert {r.as_numpy("logprobs")[0] for r in nulls} == {b"null"}
    assert np.all([r.as_numpy("text_output") is not None for r in nulls])
