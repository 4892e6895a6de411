"""``kvmesh profile`` against a real worker (the mocker here; docs/benchmarks.md profiles vLLM).

The profile it writes is a perf model the mocker loads (``--perf-model``), and the mocker driven by
a profile of itself reproduces its own timing shape: prefill grows with the ISL.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvmesh_bench.profile import decode_window
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


def test_decode_itl_is_timed_only_while_the_whole_batch_decodes() -> None:
    """Request a's first tokens come while b still prefills (slow mixed passes); only the shared window counts."""
    a = [(0.010, 1), (0.040, 1), (0.070, 1), (0.072, 1), (0.074, 1), (0.076, 1)]
    b = [(0.070, 1), (0.072, 1), (0.074, 1), (0.076, 1), (0.078, 1)]
    itls, mean_context = decode_window([a, b], context=100)
    assert itls == pytest.approx([2.0, 2.0])  # not a's 13.2 ms over its whole stream
    # a: 3 tokens before the window's first gap, 3 gaps in it; b: 1 token, 3 gaps (b's last is past a's end)
    assert mean_context == pytest.approx(100 + ((3 + 1.5) + (1 + 1.5)) / 2)


def test_a_batch_that_never_decodes_together_has_no_window() -> None:
    a = [(0.010, 1), (0.020, 1)]
    b = [(0.030, 1), (0.040, 1)]
    assert decode_window([a, b], context=100) == ([], None)
