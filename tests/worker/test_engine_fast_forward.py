"""fast_forward: k quiet decode passes at once must be indistinguishable from k step() calls."""

import random

import pytest
from kvmesh_worker.engine import EngineConfig, EngineCore, EngineRequest


def config(**kw) -> EngineConfig:
    base = dict(
        num_gpu_blocks=48, block_size=16, max_num_batched_tokens=40, watermark=0.0, vocab_size=50, emit_token_ids=False
    )
    return EngineConfig(**{**base, **kw})


def arrivals(seed: int = 3) -> list[tuple[float, EngineRequest]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    prefix = [rng.randrange(50) for _ in range(20)]
    for i in range(30):
        t += rng.expovariate(1 / 150.0)
        prompt = prefix[: rng.randrange(0, 20)] + [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
        out.append((t, EngineRequest(f"r{i}", prompt, max_tokens=rng.randrange(1, 100), seed=i)))
    return out


def replay(use_fast_forward: bool, **cfg) -> tuple[dict, list, float, int, int]:
    """Virtual-time replay of one engine: (output times and shapes, events, end time, step() calls, preemptions)."""
    core = EngineCore(config(**cfg))
    pending = arrivals()
    t, steps, ai, preempted = 0.0, 0, 0, 0
    outputs: dict[str, list] = {}
    events = []
    while ai < len(pending) or core.has_unfinished():
        while ai < len(pending) and pending[ai][0] <= t:
            core.add_request(pending[ai][1])
            ai += 1
        if not core.has_unfinished():
            t = pending[ai][0]
            continue
        if use_fast_forward:
            horizon = pending[ai][0] - t if ai < len(pending) else float("inf")
            passes, ms = core.fast_forward(10**9, horizon)
            if passes:
                t += ms
                continue
        out = core.step()
        steps += 1
        preempted += out.metrics.num_preempted
        t += out.metrics.duration_ms
        events.extend(out.kv_events)
        for o in out.outputs:
            outputs.setdefault(o.request_id, []).append((t, o.num_output_tokens, o.finish_reason))
    return outputs, events, t, steps, preempted


@pytest.mark.parametrize("cfg", [{}, dict(num_gpu_blocks=12)])  # the second one preempts
def test_fast_forward_is_equivalent_to_stepping(cfg):
    slow_outputs, slow_events, slow_end, slow_steps, slow_preempted = replay(False, **cfg)
    fast_outputs, fast_events, fast_end, fast_steps, fast_preempted = replay(True, **cfg)
    assert fast_preempted == slow_preempted and (slow_preempted > 0) == ("num_gpu_blocks" in cfg)
    assert fast_events == slow_events
    assert fast_end == pytest.approx(slow_end, rel=1e-12)
    assert fast_outputs.keys() == slow_outputs.keys()
    for rid, outs in slow_outputs.items():
        assert [(n, why) for _, n, why in fast_outputs[rid]] == [(n, why) for _, n, why in outs]
        assert [t for t, _, _ in fast_outputs[rid]] == pytest.approx([t for t, _, _ in outs], rel=1e-12)
    assert fast_steps < slow_steps


def test_fast_forward_only_runs_quiet_passes():
    core = EngineCore(config(block_size=8, num_gpu_blocks=96))
    assert core.fast_forward(100) == (0, 0.0)  # idle
    core.add_request(EngineRequest("a", list(range(10)), max_tokens=40, ignore_eos=True))
    assert core.fast_forward(100) == (0, 0.0)  # waiting: the next pass admits it
    core.step()  # prefill: 10 tokens computed, token 1 sampled
    # Next passes compute positions 10..14 inside block 1; position 15 fills it (promotion, a Stored event).
    passes, ms = core.fast_forward(100)
    assert passes == 5 and ms > 0
    assert core.fast_forward(100) == (0, 0.0)
    out = core.step()
    assert len(out.kv_events) == 1 and out.metrics.num_decode_requests == 1
    assert core.fast_forward(100) == (0, 0.0)  # position 16 opens a new block
    d = core.step().metrics.duration_ms  # the next passes have the same shape (one more block in use)
    assert core.fast_forward(3) == (3, pytest.approx(3 * d))
    assert core.fast_forward(100, max_ms=d * 2.5)[0] == 2


def test_fast_forward_stops_before_a_finishing_pass():
    core = EngineCore(config(block_size=64))
    core.add_request(EngineRequest("a", list(range(10)), max_tokens=6, ignore_eos=True))
    core.step()
    assert core.fast_forward(100)[0] == 4  # outputs 2..5; output 6 finishes the request in a real step
    out = core.step()
    assert out.outputs[0].finished and out.outputs[0].num_output_tokens == 6


def test_fast_forward_needs_lean_outputs():
    core = EngineCore(config(emit_token_ids=True))
    with pytest.raises(ValueError, match="emit_token_ids=False"):
        core.fast_forward(1)
