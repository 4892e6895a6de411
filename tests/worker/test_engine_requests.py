"""Request validation, generation rules (max_tokens, EOS, stop ids), determinism and output shapes."""

import numpy as np
import pytest
from kvmesh_worker.engine import (
    DuplicateRequest,
    EngineConfig,
    EngineCore,
    EngineMode,
    EngineRequest,
    InvalidRequest,
    KvSource,
    QueueFull,
    Sampling,
)


def config(**kw) -> EngineConfig:
    base = dict(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=64, watermark=0.0, vocab_size=100)
    return EngineConfig(**{**base, **kw})


def run(core: EngineCore) -> list:
    steps = []
    while core.has_unfinished():
        steps.append(core.step())
    return steps


def outputs_by_request(steps: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in steps:
        for o in s.outputs:
            out.setdefault(o.request_id, []).append(o)
    return out


@pytest.mark.parametrize(
    ("request_kw", "message"),
    [
        (dict(prompt=[]), "no tokens"),
        (dict(prompt=[1, 100]), "vocab_size=100"),
        (dict(prompt=[-1, 3]), "vocab_size=100"),
        (dict(prompt=[1.5, 2.0]), "integer token ids"),
        (dict(max_tokens=0), "max_tokens=0"),
        (dict(prompt=list(range(60)), max_tokens=197), "context_length=256"),
        (dict(kv_source=KvSource.TRANSFER), "kv_source"),
    ],
)
def test_validation_errors_name_the_limit(request_kw, message):
    core = EngineCore(config())
    fields = {"request_id": "r", "prompt": [1, 2, 3], "max_tokens": 4, **request_kw}
    with pytest.raises(InvalidRequest, match=message):
        core.add_request(EngineRequest(**fields))
    assert not core.has_unfinished()


def test_context_length_limits():
    core = EngineCore(config())
    core.add_request(EngineRequest("fits", list(range(60)), max_tokens=196))  # 256 = 64 blocks * 4
    assert EngineConfig(max_model_len=1000).context_length == 1000
    assert EngineConfig(num_gpu_blocks=100, block_size=4, watermark=0.1).context_length == 360
    assert EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=512).context_length == 512


def test_duplicate_ids_and_queue_bound():
    # The bound is max_num_seqs running + max_waiting_requests waiting, counted together (as the card says):
    # requests that arrive between two passes fill the running slots first.
    core = EngineCore(config(max_num_seqs=1, max_waiting_requests=1))
    core.add_request(EngineRequest("a", [1, 2, 3], max_tokens=5))
    with pytest.raises(DuplicateRequest, match="'a'"):
        core.add_request(EngineRequest("a", [1, 2, 3], max_tokens=5))
    core.add_request(EngineRequest("b", [1, 2, 3], max_tokens=5))
    with pytest.raises(QueueFull, match="max_waiting_requests=1"):
        core.add_request(EngineRequest("c", [1, 2, 3], max_tokens=5))
    core.step()  # a runs, b waits: still full
    with pytest.raises(QueueFull):
        core.add_request(EngineRequest("c", [1, 2, 3], max_tokens=5))
    while "a" in {r.request_id for r in core.scheduler.running}:
        core.step()  # a finishes: b takes its slot, the queue has room again
    core.add_request(EngineRequest("c", [1, 2, 3], max_tokens=5))


def test_unimplemented_modes_are_refused():
    with pytest.raises(NotImplementedError, match="prefill"):
        EngineCore(config(mode=EngineMode.PREFILL))


def test_ignore_eos_gives_exactly_max_tokens():
    core = EngineCore(config(vocab_size=3, eos_token_id=0))  # EOS is every third token or so
    for n in (1, 2, 7, 40):
        core.add_request(EngineRequest(f"r{n}", [1, 2, 1], max_tokens=n, ignore_eos=True, seed=n))
    outs = outputs_by_request(run(core))
    for n in (1, 2, 7, 40):
        tokens = [t for o in outs[f"r{n}"] for t in o.token_ids]
        assert len(tokens) == n and outs[f"r{n}"][-1].num_output_tokens == n
        assert outs[f"r{n}"][-1].finish_reason == "length"
        assert [o.finished for o in outs[f"r{n}"]] == [False] * (n - 1) + [True]
    assert 0 in tokens  # EOS was generated and ignored


def test_eos_stops_a_request_that_does_not_ignore_it():
    core = EngineCore(config(vocab_size=3, eos_token_id=0))
    core.add_request(EngineRequest("r", [1, 2, 1], max_tokens=40))
    outs = outputs_by_request(run(core))["r"]
    tokens = [t for o in outs for t in o.token_ids]
    assert outs[-1].finish_reason == "stop" and tokens[-1] == 0 and 0 not in tokens[:-1]
    assert len(tokens) < 40


def test_stop_token_ids_apply_even_with_ignore_eos():
    core = EngineCore(config(vocab_size=3, eos_token_id=0))
    core.add_request(EngineRequest("r", [1, 2, 1], max_tokens=40, ignore_eos=True, stop_token_ids=(2,)))
    outs = outputs_by_request(run(core))["r"]
    tokens = [t for o in outs for t in o.token_ids]
    assert outs[-1].finish_reason == "stop" and tokens[-1] == 2 and 2 not in tokens[:-1]


@pytest.mark.parametrize("stops", [{"stop_token_ids": (2,), "ignore_eos": True}, {}])
def test_no_stop_comes_before_min_tokens(stops):
    """As vLLM: the first min_tokens tokens cannot be a stop token or EOS (a vocabulary of 3 has one in the
    first few tokens), the next one can."""
    core = EngineCore(config(vocab_size=3, eos_token_id=0))
    core.add_request(EngineRequest("r", [1, 2, 1], max_tokens=200, sampling=Sampling(min_tokens=30), **stops))
    outs = outputs_by_request(run(core))["r"]
    tokens = [t for o in outs for t in o.token_ids]
    stop = stops.get("stop_token_ids", (0,))[0]
    assert stop in tokens[:30], "a stop among the first 30 tokens, passed over"
    assert outs[-1].finish_reason == "stop" and tokens[-1] == stop and len(tokens) > 30
    assert stop not in tokens[30:-1]


def test_same_seed_and_prompt_give_the_same_tokens():
    core = EngineCore(config(vocab_size=50_000))
    prompt = np.arange(10, 30)
    core.add_request(EngineRequest("a", prompt, max_tokens=30, ignore_eos=True, seed=5))
    core.add_request(EngineRequest("b", list(prompt), max_tokens=30, ignore_eos=True, seed=5))
    core.add_request(EngineRequest("c", prompt, max_tokens=30, ignore_eos=True, seed=6))
    outs = outputs_by_request(run(core))
    tokens = {rid: [t for o in v for t in o.token_ids] for rid, v in outs.items()}
    assert tokens["a"] == tokens["b"] != tokens["c"]
    assert all(0 <= t < 50_000 for t in tokens["c"])


def _scripted_run(**cfg) -> list:
    core = EngineCore(config(num_gpu_blocks=16, max_num_batched_tokens=20, **cfg))
    steps = []
    for i in range(12):
        prompt = [*range(i % 3, i % 3 + 9), i, i + 1, i + 2]
        core.add_request(EngineRequest(f"r{i}", prompt, max_tokens=4 + (i % 5) * 4, seed=i))
        steps.append(core.step())
    steps.extend(run(core))
    return steps


def test_same_inputs_give_the_same_outputs_and_events():
    first, second = _scripted_run(), _scripted_run()
    assert repr(first) == repr(second)
    assert any(s.kv_events for s in first) and any(s.metrics.num_preempted for s in first)


def test_lean_outputs_keep_events_and_timing():
    full, lean = _scripted_run(), _scripted_run(emit_token_ids=False)
    assert [s.kv_events for s in full] == [s.kv_events for s in lean]
    assert [s.metrics for s in full] == [s.metrics for s in lean]
    lean_outs = outputs_by_request(lean)
    for rid, outs in outputs_by_request(full).items():
        # Lean: only the first output (with the cache hit) and the final one, counts only.
        expected = [o for o in outs if o.num_output_tokens == 1 or o.finished]
        assert [(o.num_output_tokens, o.finished, o.finish_reason, o.num_cached_prompt_tokens) for o in expected] == [
            (o.num_output_tokens, o.finished, o.finish_reason, o.num_cached_prompt_tokens) for o in lean_outs[rid]
        ]
        assert all(o.token_ids == () for o in lean_outs[rid])


def test_first_output_reports_cached_prompt_tokens_once():
    core = EngineCore(config())
    core.add_request(EngineRequest("a", list(range(12)), max_tokens=1))
    run(core)
    core.add_request(EngineRequest("b", [*range(12), 50, 51], max_tokens=3, ignore_eos=True))
    outs = outputs_by_request(run(core))["b"]
    assert [o.num_cached_prompt_tokens for o in outs] == [12, None, None]
