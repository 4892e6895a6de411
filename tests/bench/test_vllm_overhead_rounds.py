"""``kvmesh bench vllm-overhead --rounds N``: how several direct/mesh pairs of one run are summarized.

The pairs themselves need vLLM (``tests/vllm``); what is checked here is the arithmetic a reader
relies on (each round's ratio is taken within the round, and the report gives their median) and
that both modes are asked for the same work.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvmesh_bench.replay.live import build_infer_request
from kvmesh_bench.vllm_overhead import (
    ask_for_outputs,
    build_parser,
    compare,
    direct_sampling,
    mesh_request,
    summarize_rounds,
)
from kvmesh_frontend.llm_request import LlmRequest, parse_llm_request


def _mode(tok_s: float, ttft_p50_ms: float) -> dict[str, float]:
    return {"throughput_tok_s": tok_s, "ttft_p50_ms": ttft_p50_ms}


def test_a_round_compares_its_own_two_runs() -> None:
    round_ = compare(_mode(4000, 10.0), _mode(3000, 16.0))
    assert round_["throughput_ratio"] == pytest.approx(0.75)
    assert round_["added_ttft_p50_ms"] == pytest.approx(6.0)


def test_the_report_is_the_median_of_per_round_ratios_not_a_ratio_of_medians() -> None:
    rounds = [
        compare(_mode(4000, 10.0), _mode(3200, 15.0)),  # 0.80, +5
        compare(_mode(2000, 10.0), _mode(1900, 11.0)),  # 0.95, +1 (a slow moment for both modes)
        compare(_mode(4000, 10.0), _mode(2800, 20.0)),  # 0.70, +10
    ]
    summary = summarize_rounds(rounds)
    assert summary["throughput_ratio"] == pytest.approx(0.80)
    assert summary["added_ttft_p50_ms"] == pytest.approx(5.0)
    assert summary["throughput_ratio_range"] == pytest.approx([0.70, 0.95])
    assert summary["rounds"] == rounds
    # the ratio of the median throughputs would mix rounds: 2800 / 4000 = 0.70
    assert summary["throughput_ratio"] != pytest.approx(0.70)


def test_rounds_must_be_at_least_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["--rounds", "3"]).rounds == 3
    assert build_parser().parse_args([]).rounds == 1
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--rounds", "0"])
    assert exit_.value.code == 2
    assert "--rounds: must be at least 1, got 0" in capsys.readouterr().err


def test_the_mesh_is_asked_for_token_ids_as_the_direct_run_gets_them_unless_text_is_chosen() -> None:
    """The direct run does not detokenize; by default neither does the mesh (the frontend's own parser
    decides what a response carries), and ``--mesh-output text`` asks for KServe's default text."""

    def parsed(mesh_output: str) -> LlmRequest:
        request = build_infer_request("r1", np.arange(1, 17), 8, "tiny-llama")
        ask_for_outputs(request, mesh_output)
        return parse_llm_request(request)

    ids = parsed("ids")
    assert ids.wants("output_ids") and ids.wants("num_output_tokens")
    assert not ids.wants("text_output")
    text = parsed("text")
    assert text.wants("text_output") and not text.wants("output_ids")
    assert build_parser().parse_args([]).mesh_output == "ids"


@pytest.mark.parametrize("interval", [1, 16])
def test_both_modes_stream_at_the_same_interval(interval: int) -> None:
    """``--stream-interval N`` reaches the direct run's SamplingParams and the mesh's sampling_parameters
    alike (as the frontend's own parser reads them); 1, the default, sets it in neither."""
    args = build_parser().parse_args(["--stream-interval", str(interval), "--osl", "32"])
    expected = interval if interval > 1 else None
    assert direct_sampling(args)["stream_interval"] == expected
    parsed = parse_llm_request(mesh_request("r1", list(range(1, 17)), args, "tiny-llama"))
    assert parsed.sampling.stream_interval == expected
    assert parsed.sampling.max_tokens == direct_sampling(args)["max_tokens"] == 32
