"""``kvmesh up`` (what ``make run`` runs): the whole local mesh, a demo request, a clean Ctrl-C.

Each daemon gets the ``KVMESH_*`` variables it declares (a worker setting in the environment does not
stop the router), and a variable no daemon declares is an error before anything starts.

Load-proof (issue 14 item 12): the bounds are what a shared 2-core CI box busy with other work needs
(three Python daemons start and stop; ``kvmesh up`` gives them their drain and 15 s before SIGKILL), and
``kvmesh up``'s output is read by a thread to the end, so a full pipe can never stall its shutdown.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import threading
import time

import grpc
import pytest
from inference.grpc_service_pb2_grpc import GRPCInferenceServiceStub
from kvmesh_cli.kserve_demo import demo_request

from tests.frontend.frontend_fakes import llm_request
from tests.support.daemons import script
from tests.support.etcd import free_port
from tests.support.kvmesh_up import KvmeshUp

pytestmark = pytest.mark.e2e


def test_kvmesh_up_serves_a_request_and_stops_cleanly_on_ctrl_c(tmp_path):
    port = free_port()
    with KvmeshUp(
        ["--grpc-port", str(port), "--discovery", f"file://{tmp_path / 'disc'}", "--log-dir", str(tmp_path / "logs"),
         "--speedup-ratio", "0"],
        env={**os.environ, "KVMESH_NUM_GPU_BLOCKS": "4096", "KVMESH_MIGRATION_LIMIT": "2",
             "KVMESH_DRAIN_TIMEOUT": "5"},
    ) as up:  # fmt: skip
        demo = up.wait_for("demo request", 120)  # three daemons and a tokenizer start on a busy machine
        assert f"KServe gRPC on localhost:{port}" in up.text
        assert "InferenceServerClient" in up.text, "the tritonclient example is printed"
        assert "failed" not in demo, up.text
        assert up.stop() == 0
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").iterdir()}
    assert set(logs) == {"kvmesh-frontend.log", "kvmesh-router.log", "kvmesh-worker.log"}
    for name, text in logs.items():
        assert "Traceback" not in text, f"{name}:\n{text}"


def test_kvmesh_up_refuses_a_variable_no_daemon_declares(tmp_path):
    result = subprocess.run(
        [script("kvmesh"), "up", "--log-dir", str(tmp_path / "logs")],
        env={**os.environ, "KVMESH_NUM_ENGINE": "2"}, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["kvmesh up: error: KVMESH_NUM_ENGINE: unknown setting (environment)"]
    assert not (tmp_path / "logs").exists(), "nothing was started"


def test_a_drained_worker_leaves_and_the_rest_of_the_mesh_serves_on(tmp_path):
    """``kvmesh drain`` of one of ``kvmesh up``'s workers is a planned departure, not a failure."""
    discovery = ["--discovery", f"file://{tmp_path / 'disc'}"]
    mesh = [*discovery, "--namespace", "kvmesh-local"]  # the operator commands default to the daemons' namespace
    port = free_port()
    with KvmeshUp(
        ["--grpc-port", str(port), *discovery, "--decode-workers", "2", "--speedup-ratio", "0"],
        env={**os.environ, "KVMESH_NUM_GPU_BLOCKS": "4096", "KVMESH_DRAIN_TIMEOUT": "5"},
    ) as up:
        assert "failed" not in up.wait_for("demo request", 120), up.text
        status = subprocess.run([script("kvmesh"), "status", "--json", *mesh],
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        engines = [row["id"] for row in json.loads(status.stdout) if row["component"] == "worker/engine"]
        assert len(engines) == 2, status.stdout + status.stderr
        drain = subprocess.run([script("kvmesh"), "drain", engines[0], *mesh],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert drain.returncode == 0, drain.stdout + drain.stderr
        left = up.wait_for("kvmesh up: kvmesh-worker-decode-", 60)
        assert "drained and left; 1 worker(s) serve on" in left, up.text
        outcome = demo_request(f"127.0.0.1:{port}", "kvmesh-mock", max_tokens=4)
        assert "failed" not in outcome, outcome
        assert up.proc is not None and up.proc.poll() is None, up.text
        assert up.stop() == 0, up.text


def test_a_config_files_model_name_and_engine_count_are_what_up_serves_and_shows(tmp_path):
    """up passed --num-engines 2 over the config's [worker] num-engines, and announced (and asked its demo
    request of) the built-in model name, not the config's served-model-name: NOT_FOUND for every pasted line."""
    config = tmp_path / "mesh.toml"
    config.write_text('[worker]\nnum-engines = 3\nserved-model-name = "mymodel"\n')
    discovery = ["--discovery", f"file://{tmp_path / 'disc'}"]
    with KvmeshUp(["--grpc-port", str(free_port()), *discovery, "--config", str(config), "--speedup-ratio", "0"]) as up:
        demo = up.wait_for("demo request", 120)
        assert "model 'mymodel'" in up.wait_for("kvmesh is up", 1) and "failed" not in demo, up.text
        status = subprocess.run([script("kvmesh"), "status", "--json", *discovery, "--namespace", "kvmesh-local"],
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        engines = [row for row in json.loads(status.stdout) if row["component"] == "worker/engine"]
        assert len(engines) == 3, status.stdout + status.stderr
        assert up.stop() == 0


def test_the_printed_commands_work_pasted_as_they_are_with_a_space_in_the_discovery_path(tmp_path):
    """The "Benchmark it" command is printed to be pasted into a shell; an unquoted path with a space split in two
    ("unrecognized arguments: e")."""
    port = free_port()
    with KvmeshUp(
        ["--grpc-port", str(port), "--discovery", f"file://{tmp_path / 'd e'}", "--speedup-ratio", "0", "--no-demo"]
    ) as up:
        line = up.wait_for("Benchmark it", 120)
        files = line.split(": ", 1)[1].split(" && ")[0].replace("./tok", shlex.quote(str(tmp_path / "tok")))
        fetched = subprocess.run([script("kvmesh"), *shlex.split(files)[1:]], capture_output=True, text=True,
                                 timeout=60)  # fmt: skip
        assert fetched.returncode == 0, fetched.stdout + fetched.stderr
        assert (tmp_path / "tok" / "tokenizer.json").exists()
        assert up.stop() == 0, up.text


def test_ctrl_c_lets_a_long_stream_finish_within_the_daemons_drain(tmp_path):
    """README: Ctrl-C stops everything, the daemons draining what is in flight. kvmesh up SIGKILLed them 15 s
    after Ctrl-C, whatever their drain (30 s by default), and said nothing: a 26 s stream was cut with
    UNAVAILABLE. Now it waits out their drain (here 90 s: a loaded machine paces the mocker slower)."""
    port = free_port()
    finals: list[bool] = []
    with KvmeshUp(
        ["--grpc-port", str(port), "--discovery", f"file://{tmp_path / 'disc'}", "--speedup-ratio", "1", "--no-demo"],
        env={**os.environ, "KVMESH_DRAIN_TIMEOUT": "90"},
    ) as up:
        up.wait_for("kvmesh is up", 120)
        sampling = {"max_tokens": 4000, "ignore_eos": True}
        request = llm_request("hello", model="kvmesh-mock", request_id="long", stream=True, sampling=sampling)

        def stream() -> None:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                for reply in GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([request]), timeout=200):
                    assert not reply.error_message, reply.error_message
                    final = reply.infer_response.parameters.get("triton_final_response")
                    finals.append(final is not None and final.bool_param)

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 60
        while len(finals) < 10:  # streaming
            assert reader.is_alive() and time.monotonic() < deadline, (finals, up.text)
            time.sleep(0.05)
        assert up.stop(timeout=200) == 0, up.text
        reader.join(10)
    assert finals[-1] is True and len(finals) >= 4000, len(finals)  # every token, and the final response
    assert "killing what has not stopped" not in up.text, up.text
