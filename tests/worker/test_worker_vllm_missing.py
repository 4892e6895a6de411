"""In the default venv (no vLLM) ``--engine vllm`` says how to get vLLM, in one line, exit 2.

The mocker path never imports vLLM; the vLLM engine itself is tested in tests/vllm (its own venv).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.support.daemons import run_cli

TINY_LLAMA = Path(__file__).resolve().parents[2] / "services/worker/src/kvmesh_worker/models/tiny-llama"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="this venv has vLLM (tests/vllm cover it)")
def test_engine_vllm_without_vllm_exits_2_saying_how_to_install_it(tmp_path: Path) -> None:
    out = run_cli(
        "kvmesh-worker", "--engine", "vllm", "--model-path", str(TINY_LLAMA), "--discovery", f"file://{tmp_path}"
    )
    assert out.returncode == 2, out.stderr
    assert (
        out.stderr.strip().splitlines()[-1].startswith("kvmesh-worker: error: --engine vllm: vLLM cannot be imported")
    )
    assert "make setup-vllm" in out.stderr


def test_the_mocker_path_never_imports_vllm() -> None:
    import subprocess
    import sys

    code = "import sys, kvmesh_worker.main, kvmesh_worker.engines.mocker; print('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
