"""``kvmesh up --tls`` serves the README's tritonclient example over TLS (stock tritonclient, ``ssl=True``),
and a plaintext client gets nothing."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.support.etcd import free_port
from tests.support.kvmesh_up import KvmeshUp

pytestmark = pytest.mark.e2e


def test_kvmesh_up_tls_serves_the_readme_example_over_tls(tmp_path: Path) -> None:
    port = free_port()
    with KvmeshUp(
        ["--tls", "--grpc-port", str(port), "--discovery", f"file://{tmp_path / 'disc'}",
         "--log-dir", str(tmp_path / "logs"), "--speedup-ratio", "0", "--no-demo"],
    ) as up:  # fmt: skip
        up.wait_for("client.stop_stream()", 90, at_start=False)
        found = re.search(r"ssl=True, root_certificates='([^']+)'", up.text)
        assert found, up.text
        ca = Path(found.group(1))
        # Made for the run in a private directory of its own: not among the logs (kept after a failed
        # run, shared to report it), and without the CA's key, which signs nothing after start-up.
        assert not (tmp_path / "logs" / "tls").exists() and ca.is_file()
        assert not (ca.parent / "ca.key").exists() and ca.parent.stat().st_mode & 0o077 == 0
        # The README's example, with the line `kvmesh up --tls` prints.
        outputs: list[object] = []
        client = grpcclient.InferenceServerClient(f"localhost:{port}", ssl=True, root_certificates=str(ca))
        inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("stream", [1], "BOOL"),
                  grpcclient.InferInput("sampling_parameters", [1], "BYTES")]  # fmt: skip
        inputs[0].set_data_from_numpy(np.array([b"Tell me about KV caches"], dtype=object))
        inputs[1].set_data_from_numpy(np.array([True]))
        inputs[2].set_data_from_numpy(np.array([b'{"max_tokens": 16}'], dtype=object))
        client.start_stream(callback=lambda result, error: outputs.append(error or result.as_numpy("text_output")))
        client.async_stream_infer("kvmesh-mock", inputs, enable_empty_final_response=True)
        client.stop_stream()
        texts = [o for o in outputs if o is not None]
        assert texts and all(isinstance(o, np.ndarray) for o in texts), outputs
        assert b"".join(o[0] for o in texts), outputs  # type: ignore[index]
        with grpcclient.InferenceServerClient(f"localhost:{port}") as plain, pytest.raises(InferenceServerException):
            plain.is_server_ready(client_timeout=3)
        assert up.stop(30) == 0
    assert not ca.parent.exists(), "the run's keys outlived it"
