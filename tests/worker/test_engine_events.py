"""KV events as a journal of the engine's cached set: exactness, ids, resumption, dumps, clearing."""

import random

import pytest
from kvmesh.kv_events import AllCleared, BlocksRemoved, BlocksStored, StoredBlock
from kvmesh.kv_publisher import EventIdTooNew, EventJournal
from kvmesh_worker.engine import EngineConfig, EngineCore, EngineRequest


class ToyIndex:
    """The smallest possible router index: the set of one engine's cached block hashes."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()

    def apply(self, data) -> None:
        if isinstance(data, BlocksStored):
            assert data.parent_hash is None or data.parent_hash in self.blocks, "parent must come first"
            for b in data.blocks:
                assert b.block_hash not in self.blocks, "Stored only for new blocks"
                self.blocks.add(b.block_hash)
        elif isinstance(data, BlocksRemoved):
            for h in data.block_hashes:
                assert h in self.blocks, "Removed only for cached blocks"
                self.blocks.remove(h)
        else:
            assert isinstance(data, AllCleared)
            self.blocks.clear()


def busy_engine(seed: int = 0, **kw) -> tuple[EngineCore, list]:
    """An engine with a small cache driven by a random workload with shared prefixes; returns it and its steps."""
    cfg = EngineConfig(
        **{
            **dict(num_gpu_blocks=40, block_size=4, max_num_batched_tokens=48, watermark=0.0, vocab_size=500),
            **kw,
        }
    )
    core = EngineCore(cfg)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(500) for _ in range(rng.randrange(4, 24))] for _ in range(4)]
    steps = []
    for i in range(40):
        prompt = rng.choice(prefixes) + [rng.randrange(500) for _ in range(rng.randrange(1, 16))]
        core.add_request(EngineRequest(f"r{i}", prompt, max_tokens=rng.randrange(1, 12), ignore_eos=True, seed=i))
        for _ in range(rng.randrange(0, 4)):
            steps.append(core.step())
    while core.has_unfinished():
        steps.append(core.step())
    return core, steps


def test_events_track_the_cached_set_exactly_at_every_step():
    cfg = dict(num_gpu_blocks=40, block_size=4, max_num_batched_tokens=48, watermark=0.0, vocab_size=500)
    core = EngineCore(EngineConfig(**cfg))
    index = ToyIndex()
    rng = random.Random(7)
    prefixes = [[rng.randrange(500) for _ in range(rng.randrange(4, 24))] for _ in range(4)]
    seen_reuse = False
    for i in range(60):
        prompt = rng.choice(prefixes) + [rng.randrange(500) for _ in range(rng.randrange(1, 16))]
        core.add_request(EngineRequest(f"r{i}", prompt, max_tokens=rng.randrange(1, 12), ignore_eos=True))
        for _ in range(rng.randrange(1, 4)):
            out = core.step()
            for e in out.kv_events:
                index.apply(e.data)  # asserts: no Stored for known blocks, no Removed for unknown ones
            assert index.blocks == core.block_manager.cached_hashes()
            seen_reuse |= any(o.num_cached_prompt_tokens for o in out.outputs)
    assert seen_reuse  # the workload did re-use cached prefixes


def test_event_ids_are_contiguous_from_zero():
    core, steps = busy_engine()
    ids = [e.event_id for s in steps for e in s.kv_events]
    assert len(ids) > 20 and ids == list(range(len(ids)))
    assert core.next_event_id == len(ids)
    kinds = {type(e.data) for s in steps for e in s.kv_events}
    assert kinds == {BlocksStored, BlocksRemoved}  # the small cache forces evictions


def test_journal_resume():
    journal = EventJournal(capacity=4)
    assert journal.since(0) == []
    for i in range(10):
        journal.append(BlocksRemoved((i,)))
    assert [e.event_id for e in journal.since(6)] == [6, 7, 8, 9]
    assert [e.data.block_hashes for e in journal.since(8)] == [(8,), (9,)]
    assert journal.since(10) == []
    assert journal.since(5) is None  # already left the buffer: take a dump
    with pytest.raises(EventIdTooNew):
        journal.since(11)


def test_the_journal_replays_every_kind_of_event_exactly_as_appended():
    """The buffer keeps events packed (bytes the GC never walks); a replay gives back equal events."""
    top = (1 << 64) - 1  # hashes are u64: the extremes survive the packing
    events = [
        BlocksStored(None, (StoredBlock(top, 0), StoredBlock(7, top))),
        BlocksStored(top, (StoredBlock(9, 10),)),
        BlocksStored(0, ()),  # parent 0 is a parent, not "no parent"
        BlocksRemoved((top, 0, 5)),
        AllCleared(),
    ]
    journal = EventJournal()
    live = [journal.append(data) for data in events]
    assert journal.since(0) == live
    assert [e.data for e in journal.since(0)] == events


def test_engine_journal_matches_the_step_events():
    core, steps = busy_engine(event_journal_size=16)
    all_events = [e for s in steps for e in s.kv_events]
    k = core.next_event_id - 10
    assert core.events_since(k) == all_events[k:]
    assert core.events_since(0) is None


def test_dump_rebuilds_the_cached_set_and_resumes_with_later_events():
    core, _ = busy_engine()
    dump = core.dump_cache()
    assert dump.next_event_id == core.next_event_id and dump.last_event_id == core.next_event_id - 1
    index = ToyIndex()
    for stored in dump.stored:
        index.apply(stored)  # asserts parents come before children
    assert index.blocks == core.block_manager.cached_hashes() and index.blocks

    # Keep running; the dump plus the events since its id give the new state.
    for i in range(5):
        core.add_request(EngineRequest(f"late{i}", list(range(i * 30, i * 30 + 20)), max_tokens=3, ignore_eos=True))
    while core.has_unfinished():
        core.step()
    for e in core.events_since(dump.next_event_id):
        index.apply(e.data)
    assert index.blocks == core.block_manager.cached_hashes()


def test_dump_while_requests_run_includes_active_blocks():
    core = EngineCore(EngineConfig(num_gpu_blocks=40, block_size=4, vocab_size=500))
    core.add_request(EngineRequest("a", list(range(20)), max_tokens=10, ignore_eos=True))
    core.step()
    index = ToyIndex()
    for stored in core.dump_cache().stored:
        index.apply(stored)
    assert len(index.blocks) == 5 and index.blocks == core.block_manager.cached_hashes()


def test_clear_cache_idle_emits_all_cleared():
    core, _ = busy_engine()
    events = core.clear_cache()
    assert [e.data for e in events] == [AllCleared()]
    assert events[0].event_id == core.next_event_id - 1
    assert core.block_manager.cached_hashes() == set() and core.dump_cache().stored == []


def test_clear_cache_keeps_blocks_in_use_and_says_so():
    core = EngineCore(EngineConfig(num_gpu_blocks=40, block_size=4, vocab_size=500))
    core.add_request(EngineRequest("done", list(range(100, 120)), max_tokens=1, ignore_eos=True))
    core.step()
    core.add_request(EngineRequest("running", list(range(20)), max_tokens=10, ignore_eos=True))
    core.step()
    index = ToyIndex()
    for stored in core.dump_cache().stored:
        index.apply(stored)
    events = core.clear_cache()
    assert isinstance(events[0].data, AllCleared) and len(events) > 1
    for e in events:
        index.apply(e.data)
    assert index.blocks == core.block_manager.cached_hashes() and len(index.blocks) == 5
    while core.has_unfinished():  # the running request finishes normally
        for e in core.step().kv_events:
            index.apply(e.data)
    assert index.blocks == core.block_manager.cached_hashes()


class RecordingSink:
    """A KvSink that records the changes as tuples (what the offline replay does)."""

    def __init__(self) -> None:
        self.changes: list[tuple] = []

    def stored(self, parent_hash, block_hashes, tokens_hashes) -> None:
        self.changes.append(("stored", parent_hash, tuple(block_hashes), tuple(tokens_hashes)))

    def removed(self, block_hashes) -> None:
        self.changes.append(("removed", tuple(block_hashes)))

    def cleared(self) -> None:
        self.changes.append(("cleared",))


def _as_changes(data) -> tuple:
    if isinstance(data, BlocksStored):
        return (
            "stored",
            data.parent_hash,
            tuple(b.block_hash for b in data.blocks),
            tuple(b.tokens_hash for b in data.blocks),
        )
    if isinstance(data, BlocksRemoved):
        return ("removed", tuple(data.block_hashes))
    return ("cleared",)


def test_a_kv_sink_gets_exactly_the_journal_changes_and_the_outputs_stay_the_same():
    def drive(core: EngineCore) -> tuple[list, list]:
        rng = random.Random(3)
        prefixes = [[rng.randrange(500) for _ in range(rng.randrange(4, 24))] for _ in range(4)]
        outs, journal = [], []
        for i in range(60):
            prompt = rng.choice(prefixes) + [rng.randrange(500) for _ in range(rng.randrange(1, 16))]
            core.add_request(EngineRequest(f"r{i}", prompt, max_tokens=rng.randrange(1, 12), ignore_eos=True))
            for _ in range(rng.randrange(1, 4)):
                outs.append(core.step())
                journal += [_as_changes(e.data) for e in outs[-1].kv_events]
        while core.has_unfinished():
            outs.append(core.step())
            journal += [_as_changes(e.data) for e in outs[-1].kv_events]
        return outs, journal

    cfg = EngineConfig(num_gpu_blocks=40, block_size=4, max_num_batched_tokens=48, watermark=0.0, vocab_size=500)
    sink = RecordingSink()
    a, journal = drive(EngineCore(cfg))
    b, nothing = drive(EngineCore(cfg, kv_sink=sink))
    assert [(o.outputs, o.metrics) for o in a] == [(o.outputs, o.metrics) for o in b]
    assert nothing == []
    assert len(journal) > 10 and any(c[0] == "removed" for c in journal)
    assert sink.changes == journal


def test_an_engine_with_a_kv_sink_keeps_no_metadata_so_it_cannot_dump_or_clear():
    cfg = EngineConfig(num_gpu_blocks=40, block_size=4, max_num_batched_tokens=48, watermark=0.0, vocab_size=500)
    core = EngineCore(cfg, kv_sink=RecordingSink())
    core.add_request(EngineRequest("a", list(range(10)), max_tokens=3, ignore_eos=True))
    while core.has_unfinished():
        core.step()
    assert len(core.block_manager.cached_hashes()) == 3
    with pytest.raises(RuntimeError, match="metadata"):
        core.dump_cache()
    with pytest.raises(RuntimeError, match="metadata"):
        core.clear_cache()


def test_prompt_hashes_given_by_the_caller_are_used_as_computed():
    from kvmesh.hashing import block_hashes

    cfg = EngineConfig(num_gpu_blocks=40, block_size=4, max_num_batched_tokens=48, watermark=0.0, vocab_size=500)
    prompt = list(range(30))
    plain, given = EngineCore(cfg), EngineCore(cfg)
    plain.add_request(EngineRequest("a", prompt, max_tokens=5, ignore_eos=True))
    given.add_request(EngineRequest("a", prompt, max_tokens=5, ignore_eos=True, prompt_hashes=block_hashes(prompt, 4)))
    while plain.has_unfinished():
        assert plain.step() == given.step()
    assert plain.block_manager.cached_hashes() == given.block_manager.cached_hashes()
