"""``kvmesh profile`` against a real worker (the mocker here; tests/vllm and docs/benchmarks.md do vLLM).

The profile it writes is a perf model the mocker loads (``--perf-model``), and the mocker driven by
a profile of itself reproduces its own timing shape: prefill grows with the ISL.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvmesh_worker.engine import load_perf_model

from tests.support.daemons import Daemon, run_cli
from tests.support.etcd import free_port

pytestmark = pytest.mark.e2e


def test_profile_of_a_running_engine_is_a_perf_model_the_mocker_loads(tmp_path) -> None:
    port = free_port()
    worker = Daemon(
        "kvmesh-worker",
        [
            "--discovery",
            f"file://{tmp_path / 'disc'}",
            "--namespace",
            "prof",
            "--grpc-port",
            str(port),
            "--block-size",
            "32",
            "--speedup-ratio",
            "1",
        ],
        tmp_path,
        port,
    )
    try:
        worker.wait_serving()
        out = run_cli(
            "kvmesh",
            "profile",
            "--engine-address",
            worker.address,
            "--isl",
            "32,512",
            "--cached",
            "0,0.5",
            "--batch",
            "1,4",
            "--context",
            "64,256",
            "--decode-tokens",
            "8",
            "--repeats",
            "1",
            "--out",
            str(tmp_path / "p.npz"),
            "--json",
            str(tmp_path / "p.json"),
            timeout=120,
        )
    finally:
        worker.close()
    assert out.returncode == 0, out.stderr
    assert "perf model written to" in out.stdout
    model = load_perf_model(tmp_path / "p.npz")
    with np.load(tmp_path / "p.npz") as data:
        assert list(data["prefill_isl"]) == [32, 512]
        assert data["decode_itl"].shape == (4, 2)  # 2 batch sizes x 2 contexts of active-KV points, 2 contexts
    assert model.prefill_ms(512) > model.prefill_ms(32) > 0
