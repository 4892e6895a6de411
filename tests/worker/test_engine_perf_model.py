"""Perf models: the polynomial formulas, the simulated time of a scripted run, and the NPZ-interpolated model."""

import numpy as np
import pytest
from kvmesh_worker.engine import (
    EngineConfig,
    EngineCore,
    EngineRequest,
    InterpolatedPerfModel,
    PolynomialPerfModel,
    load_perf_model,
)


def prefill(t: int) -> float:
    return 4.209989e-07 * t * t + 1.518344e-02 * t + 16.50142


def decode(u: float) -> float:
    return max(1.0, -25.74 * u * u + 54.01 * u + 5.74)


def test_polynomial_formulas():
    model = PolynomialPerfModel()
    assert model.prefill_ms(1000) == pytest.approx(0.4209989 + 15.18344 + 16.50142)
    assert model.decode_ms(5000, 10000, 123.0) == pytest.approx(-25.74 * 0.25 + 54.01 * 0.5 + 5.74)
    assert model.decode_ms(0, 10000, 1.0) == pytest.approx(5.74)
    assert model.decode_ms(10000, 10000, 1.0) == pytest.approx(-25.74 + 54.01 + 5.74)


def test_scripted_run_takes_the_formula_time():
    # 100 blocks of 4 tokens, so u = active blocks / 100; token budget 64 per pass.
    cfg = EngineConfig(num_gpu_blocks=100, block_size=4, max_num_batched_tokens=64, watermark=0.0, vocab_size=1000)
    core = EngineCore(cfg)
    core.add_request(EngineRequest("a", list(range(100)), max_tokens=3, ignore_eos=True))
    durations = [core.step().metrics.duration_ms for _ in range(2)]
    core.add_request(EngineRequest("b", list(range(500, 520)), max_tokens=2, ignore_eos=True))
    while core.has_unfinished():
        durations.append(core.step().metrics.duration_ms)
    # pass 1: a prefills 64 tokens (16 blocks)                                 -> P(64)
    # pass 2: a prefills the other 36 (25 blocks) and samples token 1          -> P(36)
    # pass 3: a decodes (token 100 opens a 26th block); b prefills 20 tokens
    #         (5 blocks) and samples its token 1: 31 active blocks             -> P(20) + D(0.31)
    # pass 4: a decodes (same block); b decodes (token 20 opens a block: 32)   -> D(0.32)
    expected = [prefill(64), prefill(36), prefill(20) + decode(0.31), decode(0.32)]
    assert durations == pytest.approx(expected)
    assert sum(durations) == pytest.approx(prefill(64) + prefill(36) + prefill(20) + decode(0.31) + decode(0.32))


def write_profile(path) -> None:
    np.savez(
        path,
        prefill_isl=np.array([100, 1000, 4000]),
        prefill_ttft_ms=np.array([10.0, 40.0, 200.0]),
        decode_active_kv_tokens=np.array([0, 10_000, 20_000]),
        decode_context_length=np.array([100, 1100]),
        decode_itl=np.array([[5.0, 7.0], [9.0, 15.0], [13.0, 25.0]]),
    )


def test_interpolated_model_reproduces_and_interpolates_the_profile(tmp_path):
    path = tmp_path / "profile.npz"
    write_profile(path)
    model = InterpolatedPerfModel.from_npz(path)
    assert [model.prefill_ms(t) for t in (100, 1000, 4000)] == pytest.approx([10.0, 40.0, 200.0])
    assert model.prefill_ms(550) == pytest.approx(25.0)
    assert model.prefill_ms(2500) == pytest.approx(120.0)
    assert model.prefill_ms(10) == pytest.approx(10.0) and model.prefill_ms(10_000) == pytest.approx(200.0)

    assert model.decode_ms(10_000, 1, 1100) == pytest.approx(15.0)  # a grid point (total tokens unused)
    assert model.decode_ms(5_000, 1, 100) == pytest.approx(7.0)  # along one axis
    assert model.decode_ms(15_000, 1, 600) == pytest.approx((9 + 15 + 13 + 25) / 4)  # cell centre
    assert model.decode_ms(50_000, 1, 5000) == pytest.approx(25.0)  # clamped to the corner
    assert model.decode_ms(-5, 1, 0) == pytest.approx(5.0)


def test_load_perf_model_by_name_or_path(tmp_path):
    path = tmp_path / "p.npz"
    write_profile(path)
    assert isinstance(load_perf_model(None), PolynomialPerfModel)
    assert isinstance(load_perf_model("polynomial"), PolynomialPerfModel)
    assert isinstance(load_perf_model(path), InterpolatedPerfModel)
    assert isinstance(load_perf_model(str(path)), InterpolatedPerfModel)
    with pytest.raises(ValueError, match="unknown perf model"):
        load_perf_model("quadratic")


def test_interpolated_model_rejects_malformed_profiles(tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, prefill_isl=np.array([1, 2]), prefill_ttft_ms=np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="missing arrays"):
        InterpolatedPerfModel.from_npz(path)
    with pytest.raises(ValueError, match="shape"):
        InterpolatedPerfModel([1, 2], [1.0, 2.0], [0, 1], [0, 1, 2], np.zeros((2, 2)))


def test_engine_uses_the_given_model(tmp_path):
    path = tmp_path / "profile.npz"
    write_profile(path)
    cfg = EngineConfig(num_gpu_blocks=1000, block_size=4, vocab_size=1000)
    core = EngineCore(cfg, load_perf_model(path))
    core.add_request(EngineRequest("a", list(range(1000)), max_tokens=2, ignore_eos=True))
    assert core.step().metrics.duration_ms == pytest.approx(40.0)
    # Decode: 251 blocks * 4 = 1004 active tokens, context 1001 -> interpolate on both axes.
    kv, ctx = 1004, 1001
    fx, fy = kv / 10_000, (ctx - 100) / 1000
    expected = (5 * (1 - fy) + 7 * fy) * (1 - fx) + (9 * (1 - fy) + 15 * fy) * fx
    assert core.step().metrics.duration_ms == pytest.approx(expected)
