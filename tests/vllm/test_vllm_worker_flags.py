"""``kvmesh-worker --engine vllm`` refuses a bad configuration with one line and exit 2, before vLLM starts.

(An unknown vLLM argument is refused the same way, with vLLM's own message, but only after importing
vLLM, which takes 10-60 s here: not worth a test run.)
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.support.daemons import run_cli
from tests.vllm.conftest import TINY_LLAMA


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--vllm-engine-args", "[1]"], "must be a JSON object"),
        (["--vllm-engine-args", '{"kv_events_config": {}}'], "set by the worker"),
        (["--num-engines", "2"], "one engine per process"),
    ],
    ids=["not an object", "an argument the worker owns", "two engines"],
)
def test_a_bad_vllm_configuration_exits_2_with_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    out = run_cli(
        "kvmesh-worker",
        "--engine",
        "vllm",
        "--model-path",
        str(TINY_LLAMA),
        "--discovery",
        f"file://{tmp_path}",
        *args,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("kvmesh-worker: error:") and message in last, out.stderr[-2000:]


def test_a_worker_whose_port_is_taken_exits_2_before_its_engine_starts(tmp_path: Path) -> None:
    """The port is bound before the engine loads: a taken port fails the worker at once, not after a
    minute of loading, and the engine's own sockets can never take the port while it loads."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run_cli(
            "kvmesh-worker",
            "--engine",
            "vllm",
            "--model-path",
            str(TINY_LLAMA),
            "--discovery",
            f"file://{tmp_path}",
            "--grpc-port",
            str(port),
            timeout=120,
        )
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(f"kvmesh-worker: error: --grpc-port {port}: cannot bind")
    assert "EngineCore" not in out.stderr, "the engine started before the port was bound"
