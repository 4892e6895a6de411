"""``kvmesh profile`` against a real worker (the mocker here; docs/benchmarks.md profiles vLLM).

The profile it writes is a perf model the mocker loads (``--perf-model``), and the mocker driven by
a profile of itself reproduces its own timing shape: prefill grows with the ISL.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvmesh_bench.profile import DecodePoint, PrefillPoint, decode_window, path_overhead_ms, perf_model_arrays
from kvmesh_worker.engine import load_perf_model

from tests.support.daemons import Daemon, run_cli
from tests.support.etcd import free_port

pytestmark = pytest.mark.e2e


def test_profile_of_a_running_engine_is_a_perf_model_the_mocker_loads(tmp_path) -> None:
    """Two rounds of the sweep, each point the median of both rounds' samples."""
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
            "--rounds",
            "2",
            "--out",
            str(tmp_path / "p.npz"),
            "--json",
            str(tmp_path / "p.json"),
            timeout=120,
        )
        # An engine the worker does not host (ids as `kvmesh status` shows them, in hex): it was a traceback.
        wrong = run_cli(
            "kvmesh", "profile", "--engine-address", worker.address, "--engine-id", "7b", "--isl", "32",
            "--batch", "1", "--context", "64", "--repeats", "1", "--rounds", "1", "--out", str(tmp_path / "q.npz"),
            timeout=60,
        )  # fmt: skip
    finally:
        worker.close()
    assert wrong.returncode == 2 and len(wrong.stderr.strip().splitlines()) == 1, wrong.stderr
    assert "engine 7b is not hosted by this worker" in wrong.stderr and not (tmp_path / "q.npz").exists()
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


def test_a_sweep_of_zero_rounds_is_refused_with_exit_2(tmp_path) -> None:
    out = run_cli(
        "kvmesh", "profile", "--engine-address", "127.0.0.1:1", "--rounds", "0", "--out", str(tmp_path / "p.npz")
    )
    assert out.returncode == 2
    assert "argument --rounds: must be at least 1, got 0" in out.stderr
    assert not (tmp_path / "p.npz").exists()


def test_an_engine_that_cannot_be_reached_is_one_line_not_a_traceback(tmp_path) -> None:
    out = run_cli("kvmesh", "profile", "--engine-address", "127.0.0.1:1", "--out", str(tmp_path / "p.npz"))
    assert out.returncode == 2  # as every kvmesh command's unreachable target
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert out.stderr.startswith("kvmesh profile: error: 127.0.0.1:1: UNAVAILABLE: ")
    assert not (tmp_path / "p.npz").exists()


def test_net_prefill_takes_the_request_paths_fixed_cost_off_every_prefill_point() -> None:
    """Shortest prompt 7 ms, a batch-1 decode pass 1.5 ms: 5.5 ms is the path, not the prefill pass."""
    prefill = [PrefillPoint(32, 0, 7.0), PrefillPoint(1024, 0, 16.0), PrefillPoint(1024, 512, 12.0)]
    decode = [DecodePoint(1, 64, 1.5, 80, 80), DecodePoint(4, 64, 2.0, 320, 80)]
    assert path_overhead_ms(prefill, decode) == pytest.approx(5.5)
    gross = perf_model_arrays(prefill, decode)
    net = perf_model_arrays(prefill, decode, net_prefill=True)
    assert list(gross["prefill_ttft_ms"]) == [7.0, 16.0]
    assert list(net["prefill_ttft_ms"]) == pytest.approx([1.5, 10.5])
    assert np.array_equal(net["decode_itl"], gross["decode_itl"])  # decode points are passes already
