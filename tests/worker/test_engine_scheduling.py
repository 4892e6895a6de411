"""Scheduling behaviour of the engine core: prefix hits, chunked prefill, watermark, preemption, cancellation."""

import math

from kvmesh.hashing import block_hashes
from kvmesh.kv_events import BlocksRemoved, BlocksStored, StoredBlock
from kvmesh_worker.engine import EngineConfig, EngineCore, EngineRequest, PreemptionMode

BS = 4


def config(**kw) -> EngineConfig:
    base = dict(num_gpu_blocks=64, block_size=BS, max_num_batched_tokens=1024, watermark=0.0, vocab_size=1000)
    return EngineConfig(**{**base, **kw})


def req(rid: str, prompt, max_tokens: int = 1, **kw) -> EngineRequest:
    return EngineRequest(rid, list(prompt), max_tokens=max_tokens, ignore_eos=True, **kw)


def run(core: EngineCore, max_steps: int = 10_000) -> list:
    """Step until idle; returns the StepOutputs."""
    steps = []
    while core.has_unfinished():
        steps.append(core.step())
        assert len(steps) < max_steps
    return steps


def tokens_of(steps: list) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for s in steps:
        for o in s.outputs:
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out


def events_of(steps: list) -> list:
    return [e for s in steps for e in s.kv_events]


def test_prefix_hit_computes_only_new_tokens_and_stores_only_new_blocks():
    core = EngineCore(config())
    first = list(range(16))  # 4 full blocks
    core.add_request(req("a", first))
    steps = run(core)
    local, seq = block_hashes(first, BS)
    assert [e.data for e in events_of(steps)] == [BlocksStored(None, tuple(map(StoredBlock, seq, local)))]

    second = first + list(range(100, 108))  # same 4 blocks + 2 new ones
    core.add_request(req("b", second))
    out = core.step()
    assert out.metrics.prefill_tokens == 8
    assert out.outputs[0].num_cached_prompt_tokens == 16
    local, seq = block_hashes(second, BS)
    assert [e.data for e in out.kv_events] == [BlocksStored(seq[3], tuple(map(StoredBlock, seq[4:], local[4:])))]


def test_fully_cached_prompt_still_computes_its_last_token():
    core = EngineCore(config())
    prompt = list(range(16))
    core.add_request(req("a", prompt))
    run(core)
    core.add_request(req("b", prompt))
    out = core.step()
    # The last block is recomputed (one token at least must run to produce the next one), but it is
    # the same block: re-used, not stored again.
    assert out.metrics.prefill_tokens == 4 and out.outputs[0].num_cached_prompt_tokens == 12
    assert out.kv_events == []


def test_chunked_prefill_takes_ceil_isl_over_budget_passes():
    budget, isl = 32, 100
    core = EngineCore(config(max_num_batched_tokens=budget))
    core.add_request(req("a", range(isl), max_tokens=2))
    steps = run(core)
    prefill = [s.metrics.prefill_tokens for s in steps if s.metrics.prefill_tokens]
    assert prefill == [32, 32, 32, 4] and len(prefill) == math.ceil(isl / budget)
    first_output = next(i for i, s in enumerate(steps) if s.outputs)
    assert first_output == math.ceil(isl / budget) - 1


def test_running_requests_spend_the_budget_before_waiting_ones():
    core = EngineCore(config(max_num_batched_tokens=10))
    core.add_request(req("a", range(8), max_tokens=5))
    core.step()  # a: 8 prefill tokens
    core.add_request(req("b", range(100, 120), max_tokens=1))
    out = core.step()  # a decodes 1 token, b gets the remaining 9
    assert (out.metrics.num_decode_requests, out.metrics.prefill_tokens) == (1, 9)
    assert core.load().queued_prefill_tokens == 11


def test_max_num_seqs_bounds_the_running_set():
    core = EngineCore(config(max_num_seqs=2))
    for i in range(3):
        core.add_request(req(f"r{i}", range(i * 10, i * 10 + 8), max_tokens=3))
    core.step()
    load = core.load()
    assert (load.num_running, load.num_waiting) == (2, 1)


def test_watermark_admission():
    # 100 blocks, watermark 0.1: admission keeps 10 blocks free (active + new blocks <= 90).
    cfg = config(num_gpu_blocks=100, watermark=0.1)
    core = EngineCore(cfg)
    core.add_request(req("a", range(200), max_tokens=20))  # 50 full blocks
    core.step()
    core.add_request(req("too_big", range(1000 - 160, 1000), max_tokens=1))  # 40 blocks
    out = core.step()  # a takes a partial block for its next token: 51 active; 51 + 40 > 90
    assert core.load().active_blocks == 51 and core.load().num_waiting == 1
    assert out.metrics.num_prefill_requests == 0
    assert core.abort_request("too_big")
    core.add_request(req("fits", range(1000 - 156, 1000), max_tokens=1))  # 39 blocks: 51 + 39 = 90
    out = core.step()
    assert out.metrics.num_prefill_requests == 1 and core.load().num_waiting == 0


def _preemption_run(mode: PreemptionMode) -> tuple[list, list[str]]:
    # Each request needs ceil((8 + 20 - 1) / 4) = 7 blocks; the cache has 10, so they cannot both finish.
    core = EngineCore(config(num_gpu_blocks=10, preemption_mode=mode))
    core.add_request(req("old", range(0, 8), max_tokens=20))
    core.add_request(req("new", range(100, 108), max_tokens=20))
    steps = run(core)
    finish_order = [o.request_id for s in steps for o in s.outputs if o.finished]
    return steps, finish_order


def test_preemption_lifo_and_resume():
    steps, finish_order = _preemption_run(PreemptionMode.LIFO)
    assert sum(s.metrics.num_preempted for s in steps) >= 1
    assert finish_order == ["old", "new"]  # the most recently admitted request gave way
    tokens = tokens_of(steps)
    assert {rid: len(t) for rid, t in tokens.items()} == {"old": 20, "new": 20}
    # Preemption does not change what a request generates.
    solo = EngineCore(config())
    solo.add_request(req("new", range(100, 108), max_tokens=20))
    assert tokens_of(run(solo))["new"] == tokens["new"]


def test_preemption_fifo_preempts_the_oldest():
    steps, finish_order = _preemption_run(PreemptionMode.FIFO)
    assert sum(s.metrics.num_preempted for s in steps) >= 1
    assert finish_order == ["new", "old"]
    assert {rid: len(t) for rid, t in tokens_of(steps).items()} == {"old": 20, "new": 20}


def test_preempted_request_resumes_from_its_cached_blocks():
    core = EngineCore(config(num_gpu_blocks=10))
    core.add_request(req("old", range(0, 8), max_tokens=20))
    core.add_request(req("new", range(100, 108), max_tokens=20))
    resumed_prefill = None
    preempted = False
    while core.has_unfinished():
        out = core.step()
        preempted |= out.metrics.num_preempted > 0
        if preempted and out.metrics.num_prefill_requests and resumed_prefill is None:
            resumed_prefill = out.metrics.prefill_tokens
    # "new" had 8 prompt tokens plus some output; on resume the blocks still cached are hits,
    # so it recomputes less than its known tokens.
    assert resumed_prefill is not None and resumed_prefill < 8 + 20


def test_no_admission_in_a_pass_that_preempted():
    core = EngineCore(config(num_gpu_blocks=10))
    core.add_request(req("old", range(0, 8), max_tokens=20))
    core.add_request(req("new", range(100, 108), max_tokens=20))
    while core.has_unfinished():
        out = core.step()
        if out.metrics.num_preempted:
            assert out.metrics.num_prefill_requests == 0


def test_abort_frees_blocks_immediately():
    core = EngineCore(config())
    core.add_request(req("keep", range(0, 10), max_tokens=50))
    core.step()
    before = core.load().active_blocks
    core.add_request(req("gone", range(100, 130), max_tokens=50))
    core.step()
    core.step()
    assert core.load().active_blocks > before
    assert core.abort_request("gone")
    assert core.load().active_blocks == before
    assert not core.abort_request("gone") and not core.abort_request("unknown")
    out = core.step()
    assert [o.request_id for o in out.outputs] == ["keep"]


def test_abort_waiting_request_and_idle_engine():
    core = EngineCore(config(max_num_seqs=1))
    core.add_request(req("a", range(10), max_tokens=3))
    core.add_request(req("b", range(20, 30), max_tokens=3))
    core.step()
    assert core.load().num_waiting == 1 and core.load().queued_prefill_tokens == 10
    assert core.abort_request("b")
    assert core.load().num_waiting == 0 and core.load().queued_prefill_tokens == 0
    run(core)
    assert not core.has_unfinished()
    idle = core.step()
    assert idle.outputs == [] and idle.kv_events == [] and idle.metrics.duration_ms == 0.0
    load = core.load()
    assert (load.active_blocks, load.num_running, load.num_waiting) == (0, 0, 0) and load.cached_blocks > 0


def test_evictions_emit_removed_oldest_first():
    core = EngineCore(config(num_gpu_blocks=8))
    a, b = list(range(0, 8)), list(range(100, 108))
    for rid, prompt in (("a", a), ("b", b), ("a2", a)):  # a2 re-uses a, making it the most recent
        core.add_request(req(rid, prompt))
        run(core)
    core.add_request(req("c", range(200, 224)))  # 6 blocks: 4 unused slots + 2 evictions
    events = [e.data for e in core.step().kv_events]
    _, seq_b = block_hashes(b, BS)
    assert events[0] == BlocksRemoved((seq_b[1], seq_b[0]))  # b is the oldest; its tail goes first
    assert isinstance(events[1], BlocksStored) and len(events[1].blocks) == 6


def test_generation_block_promoted_when_it_fills():
    core = EngineCore(config())
    prompt = list(range(6))  # 1 full block + 2 tokens of a partial one
    core.add_request(req("a", prompt, max_tokens=5))
    steps = run(core)
    outputs = tokens_of(steps)["a"]
    local, seq = block_hashes(prompt + outputs, BS)
    stored = [(i, e.data) for i, s in enumerate(steps) for e in s.kv_events]
    # Pass 0 stores the prompt's full block. The second block (2 prompt tokens + 2 outputs) fills
    # when output 2's KV is computed, in pass 2; it is chained to block 0.
    assert stored == [
        (0, BlocksStored(None, (StoredBlock(seq[0], local[0]),))),
        (2, BlocksStored(seq[0], (StoredBlock(seq[1], local[1]),))),
    ]


def test_identical_generations_share_their_generated_blocks():
    core = EngineCore(config())
    for rid in ("a", "b"):  # same prompt, same seed: same output, so the same generated block
        core.add_request(req(rid, range(6), max_tokens=5))
    steps = run(core)
    assert tokens_of(steps)["a"] == tokens_of(steps)["b"]
    assert [len(e.data.blocks) for e in events_of(steps)] == [1, 1]


def test_cache_salt_separates_namespaces():
    core = EngineCore(config())
    core.add_request(req("a", range(16)))
    run(core)
    core.add_request(req("salted", range(16), cache_salt="lora-1"))
    out = core.step()
    assert out.outputs[0].num_cached_prompt_tokens == 0 and len(out.kv_events) == 1
