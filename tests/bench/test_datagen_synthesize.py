"""``kvmesh datagen synthesize`` on a small hand-made multi-turn trace: invariants and each knob's effect."""

import math
import random
import statistics

import pytest
from kvmesh_bench.datagen.analyze import prefix_hit_rate
from kvmesh_bench.datagen.cli import main
from kvmesh_bench.datagen.synthesize import DatagenError, SynthesisConfig, Synthesizer, synthesize
from kvmesh_bench.trace import TraceRequest, load_trace, write_trace

BS = 512


def make_source(sessions=60, seed=7):
    """Multi-turn chats under three system prompts that all start with block 0; turn k+1 extends turn k."""
    rng = random.Random(seed)
    system_prompts = [[0, 1, 2], [0, 3], [0, 4, 5, 6, 7]]
    next_id = 100
    clock = 0
    rows = []
    for _ in range(sessions):
        context = list(rng.choice(system_prompts))
        for _ in range(rng.randint(1, 4)):
            fresh = rng.randint(1, 6)
            ids = context + list(range(next_id, next_id + fresh))
            next_id += fresh
            rows.append(TraceRequest(clock, (len(ids) - 1) * BS + rng.randint(1, BS), rng.randint(1, 400), tuple(ids)))
            context = ids
            clock += rng.choice([0, 0, 1000, 2000])
    return rows


SOURCE = make_source()


def core_and_leaf_blocks(synthesizer, rows):
    """Mean number of shared-prefix (core) blocks and of unique-leaf blocks per row."""
    limit = synthesizer.core_ids * synthesizer.config.prefix_root_multiplier
    core = [sum(1 for h in r.hash_ids if h < limit) for r in rows]
    leaf = [sum(1 for h in r.hash_ids if h >= limit) for r in rows]
    return statistics.mean(core), statistics.mean(leaf)


def run(source=SOURCE, num_requests=None, **knobs):
    synthesizer = Synthesizer(source, SynthesisConfig(**knobs))
    return synthesizer, synthesizer.generate(num_requests)


def check_invariants(synthesizer, rows):
    limit = synthesizer.core_ids * synthesizer.config.prefix_root_multiplier
    seen_leaf_ids = set()
    for row in rows:
        assert math.ceil(row.input_length / BS) == len(row.hash_ids)
        assert row.output_length >= 1 and isinstance(row.timestamp_ms, int)
        leaf_ids = [h for h in row.hash_ids if h >= limit]
        core_ids = [h for h in row.hash_ids if h < limit]
        assert row.hash_ids == tuple(core_ids + leaf_ids)  # the unique leaf comes last
        assert seen_leaf_ids.isdisjoint(leaf_ids)  # fresh ids, never reused
        seen_leaf_ids.update(leaf_ids)
    timestamps = [row.timestamp_ms for row in rows]
    assert timestamps == sorted(timestamps) and timestamps[0] == 0


def test_defaults_reproduce_the_source_statistics():
    synthesizer, rows = run()
    check_invariants(synthesizer, rows)
    assert len(rows) == len(SOURCE)
    for field in ("input_length", "output_length"):
        assert statistics.mean(getattr(r, field) for r in rows) == pytest.approx(
            statistics.mean(getattr(r, field) for r in SOURCE), rel=0.05
        )
    assert prefix_hit_rate(rows)["hit_rate"] == pytest.approx(prefix_hit_rate(SOURCE)["hit_rate"], rel=0.05)


def test_iid_sampling_stays_close_and_keeps_the_invariants():
    synthesizer, rows = run(sampling="iid", num_requests=2000)
    check_invariants(synthesizer, rows)
    assert statistics.mean(r.output_length for r in rows) == pytest.approx(
        statistics.mean(r.output_length for r in SOURCE), rel=0.1
    )


def test_prefix_len_multiplier_stretches_shared_prefixes():
    base, base_rows = run()
    stretched, rows = run(prefix_len_multiplier=2)
    check_invariants(stretched, rows)
    assert stretched.core_ids == 2 * base.core_ids
    base_core, base_leaf = core_and_leaf_blocks(base, base_rows)
    core, leaf = core_and_leaf_blocks(stretched, rows)
    assert core == pytest.approx(2 * base_core, rel=0.02)
    assert leaf == pytest.approx(base_leaf, rel=0.02)
    assert prefix_hit_rate(rows)["hit_rate"] > prefix_hit_rate(base_rows)["hit_rate"] + 0.02


def test_prefix_root_multiplier_makes_disjoint_copies_and_lowers_the_hit_rate():
    synthesizer, rows = run(prefix_root_multiplier=3)
    check_invariants(synthesizer, rows)
    # every source request starts with block 0, so the first id tells the copy
    groups: dict[int, set[int]] = {}
    for row in rows:
        groups.setdefault(row.hash_ids[0], set()).update(row.hash_ids)
    assert len(groups) == 3
    copies = list(groups.values())
    for i in range(3):
        for j in range(i + 1, 3):
            assert copies[i].isdisjoint(copies[j])
    _, single = run()
    assert prefix_hit_rate(rows)["hit_rate"] < prefix_hit_rate(single)["hit_rate"] - 0.05


def test_prompt_len_multiplier_scales_unique_prompts_only():
    base, base_rows = run()
    scaled, rows = run(prompt_len_multiplier=3)
    check_invariants(scaled, rows)
    base_core, base_leaf = core_and_leaf_blocks(base, base_rows)
    core, leaf = core_and_leaf_blocks(scaled, rows)
    assert leaf == pytest.approx(3 * base_leaf, rel=0.02)
    assert core == pytest.approx(base_core, rel=0.02)


def test_osl_multiplier_scales_output_lengths():
    _, base_rows = run()
    _, rows = run(osl_multiplier=0.5)
    assert statistics.mean(r.output_length for r in rows) == pytest.approx(
        0.5 * statistics.mean(r.output_length for r in base_rows), rel=0.02
    )
    assert [r.input_length for r in rows] == [r.input_length for r in base_rows]  # nothing else moves


def test_speedup_ratio_compresses_timestamps():
    _, base_rows = run()
    _, rows = run(speedup_ratio=4)
    assert rows[-1].timestamp_ms == pytest.approx(base_rows[-1].timestamp_ms / 4, abs=1)
    assert [r.hash_ids for r in rows] == [r.hash_ids for r in base_rows]
    # requests per timestamp come from the source's empirical counts, unchanged by the speedup
    assert len({r.timestamp_ms for r in rows}) == len({r.timestamp_ms for r in base_rows})


def test_min_and_max_isl_filter():
    synthesizer, rows = run(min_isl=3 * BS, max_isl=8 * BS, num_requests=300)
    check_invariants(synthesizer, rows)
    assert len(rows) == 300
    assert all(3 * BS <= r.input_length <= 8 * BS for r in rows)
    _, unfiltered = run(num_requests=300)
    assert not all(3 * BS <= r.input_length <= 8 * BS for r in unfiltered)


def test_a_filter_nothing_passes_is_an_error():
    with pytest.raises(DatagenError, match="ISL filter"):
        run(min_isl=10**9, num_requests=5)


def test_num_requests_beyond_the_source():
    synthesizer, rows = run(num_requests=5 * len(SOURCE))
    check_invariants(synthesizer, rows)
    assert len(rows) == 5 * len(SOURCE)


def test_seed_reproducibility_byte_identical(tmp_path, capsys):
    source = tmp_path / "source.jsonl"
    write_trace(source, SOURCE)
    outputs = {}
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        outputs[name] = tmp_path / f"{name}.jsonl"
        assert main(["datagen", "synthesize", str(source), "-o", str(outputs[name]), "--seed", str(seed)]) == 0
    assert f"wrote {len(SOURCE)} requests" in capsys.readouterr().out
    assert outputs["a"].read_bytes() == outputs["b"].read_bytes()
    assert outputs["a"].read_bytes() != outputs["c"].read_bytes()
    assert synthesize(SOURCE, SynthesisConfig(seed=5)) == load_trace(outputs["a"])


def test_cli_knobs_reach_the_synthesizer(tmp_path):
    source = tmp_path / "source.jsonl"
    write_trace(source, SOURCE)
    out = tmp_path / "out.jsonl"
    argv = ["datagen", "synthesize", str(source), "-o", str(out), "--num-requests", "50", "--osl-multiplier", "2"]
    assert main([*argv, "--prefix-root-multiplier", "2", "--max-isl", "4096", "--speedup-ratio", "3"]) == 0
    rows = load_trace(out)
    config = SynthesisConfig(osl_multiplier=2, prefix_root_multiplier=2, max_isl=4096, speedup_ratio=3)
    assert rows == synthesize(SOURCE, config, num_requests=50)


def test_cli_tree_violation_is_one_line_exit_2(tmp_path, capsys):
    source = tmp_path / "bad_tree.jsonl"
    write_trace(source, [TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(0, 1024, 1, (3, 2))])
    assert main(["datagen", "synthesize", str(source), "-o", str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "hash id 2 has 2 parents: hash id 1 (first in request #1), hash id 3 (first in request #2)" in err


def test_cli_rejects_bad_knobs(tmp_path, capsys):
    source = tmp_path / "source.jsonl"
    write_trace(source, SOURCE)
    out = str(tmp_path / "out.jsonl")
    assert main(["datagen", "synthesize", str(source), "-o", out, "--min-isl", "9", "--max-isl", "3"]) == 2
    assert "--min-isl (9) is larger than --max-isl (3)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as caught:  # argparse's own check, also exit code 2
        main(["datagen", "synthesize", str(source), "-o", out, "--speedup-ratio", "0"])
    assert caught.value.code == 2


def test_config_validation():
    with pytest.raises(DatagenError, match="prefix-len-multiplier must be positive"):
        SynthesisConfig(prefix_len_multiplier=0).validate()
    with pytest.raises(DatagenError, match="prefix-root-multiplier"):
        SynthesisConfig(prefix_root_multiplier=0).validate()
    with pytest.raises(DatagenError, match="block-size"):
        Synthesizer(SOURCE, SynthesisConfig(block_size=0))


def test_wrong_block_size_is_reported():
    with pytest.raises(DatagenError, match="is --block-size right"):
        Synthesizer(SOURCE, SynthesisConfig(block_size=16))


def anti_correlated_source(sessions=80, seed=11):
    """Long prompts get short answers: OSL falls as ISL grows (a joint shape independent marginals lose)."""
    rows = []
    for row in make_source(sessions, seed):
        rows.append(
            TraceRequest(row.timestamp_ms, row.input_length, max(1, 4000 - row.input_length // 2), row.hash_ids)
        )
    return rows


def test_isl_and_osl_are_sampled_jointly_with_the_prefix_structure():
    from scipy.stats import spearmanr

    source = anti_correlated_source()
    for jitter in (None, 60.0):
        _, rows = run(source, num_requests=3 * len(source), order_jitter_s=jitter)
        for field in ("input_length", "output_length"):
            for q in (0.5, 0.9):
                got = statistics.quantiles([getattr(r, field) for r in rows], n=10)[int(q * 10) - 1]
                want = statistics.quantiles([getattr(r, field) for r in source], n=10)[int(q * 10) - 1]
                assert got == pytest.approx(want, rel=0.1), (field, q, jitter)
        rho_source = spearmanr([r.input_length for r in source], [r.output_length for r in source]).statistic
        rho = spearmanr([r.input_length for r in rows], [r.output_length for r in rows]).statistic
        assert rho_source < -0.9 and rho == pytest.approx(rho_source, abs=0.05)


def test_zero_order_jitter_deals_the_source_in_its_own_order():
    # Every deck dealt in time order: the same requests at the same times, only the ids renamed.
    _, rows = run(order_jitter_s=0.0)
    by_time = lambda rs: sorted((r.timestamp_ms, r.input_length, r.output_length, len(r.hash_ids)) for r in rs)  # noqa: E731
    assert by_time(rows) == by_time(SOURCE)


def test_order_jitter_keeps_a_conversation_near_its_source_time():
    # A session's later turns extend its earlier ones; in time order they come after them. Shuffled decks
    # (order_jitter_s=None) scatter the turns over the whole trace.
    def mean_reuse_time(rows):
        """Mean time from a request back to the last one sharing more than any system prompt (6+ blocks)."""
        last_seen: dict[tuple[int, ...], float] = {}
        gaps = []
        for r in sorted(rows, key=lambda r: r.timestamp_ms):
            prefixes = [r.hash_ids[:n] for n in range(6, len(r.hash_ids) + 1)]
            hits = [last_seen[p] for p in prefixes if p in last_seen]
            if hits:
                gaps.append(r.timestamp_ms - max(hits))
            for p in prefixes:
                last_seen[p] = r.timestamp_ms
        return statistics.mean(gaps)

    _, ordered = run(SOURCE, order_jitter_s=5.0)
    _, shuffled = run(SOURCE, order_jitter_s=None)
    assert mean_reuse_time(ordered) < 0.5 * mean_reuse_time(shuffled)
