"""The acceptance goal on a slice of the real Mooncake conversation trace: with every multiplier at 1 and as many
requests as the source, the synthesized trace's mean ISL, mean OSL and infinite-cache hit rate are within 5%."""

import math
import statistics
from pathlib import Path

import pytest
from kvmesh_bench.datagen.analyze import analyze, compare
from kvmesh_bench.datagen.synthesize import SynthesisConfig, Synthesizer
from kvmesh_bench.trace import load_trace

# shared/ lies beside the checkout (as in CI)
TRACE = Path(__file__).resolve().parents[2].parent / "shared/data/mooncake/conversation_trace.jsonl"


@pytest.mark.skipif(not TRACE.exists(), reason="Mooncake conversation trace not present")
def test_first_2000_rows_reproduce_mean_isl_osl_and_hit_rate_within_5_percent():
    source = load_trace(TRACE, max_requests=2000)
    synthesizer = Synthesizer(source, SynthesisConfig(seed=0))
    rows = synthesizer.generate()
    assert len(rows) == 2000
    assert all(math.ceil(r.input_length / 512) == len(r.hash_ids) for r in rows)
    source_report = analyze(source)
    diffs = {row["metric"]: row["relative_diff"] for row in compare(analyze(rows), source_report)}
    assert abs(diffs["ISL mean"]) < 0.05
    assert abs(diffs["OSL mean"]) < 0.05
    assert abs(diffs["hit rate"]) < 0.05
    assert abs(diffs["request rate (req/s)"]) < 0.05
    # the slice's statistics are what the test thinks they are (a 28.9% hit rate, ~9k mean ISL)
    assert source_report["cache"]["hit_rate"] == pytest.approx(0.289, abs=0.001)
    assert 5000 < statistics.mean(r.input_length for r in source) < 15000
