"""EngineRunner in-process: the real-time loop around the engine core, without gRPC.

What the e2e tests cannot force deterministically is checked here: a KV subscriber that registers
while a pass is in flight (its events are already in the journal but not delivered yet) gets every
event exactly once, and the shared deadline timer wakes sleepers in deadline order, never early,
runs every due delivery before any woken sleeper steps again, and leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
from kvmesh.kv_events import CacheDump, KvEvent
from kvmesh.kv_publisher import KvSubscription
from kvmesh_worker import service as worker_service
from kvmesh_worker.engine import DuplicateRequest, EngineConfig, EngineCore, EngineRequest, ForwardPassMetrics
from kvmesh_worker.engine_runner import DeadlineTimer, EngineRunner
from kvmesh_worker.engines import OutputStream
from kvmesh_worker.kv_transfer.mocker_kv import KvConfig, MockerKv

CONFIG = EngineConfig(num_gpu_blocks=64, block_size=4, vocab_size=2048)


async def _drain(subscription: KvSubscription, until_id: int) -> list[KvEvent]:
    events: list[KvEvent] = []
    while not events or events[-1].event_id < until_id - 1:
        events += await asyncio.wait_for(subscription.next(), 5)
    return events


def _submit(runner: EngineRunner, request: EngineRequest) -> OutputStream:
    stream = OutputStream()
    runner.submit(request, stream)
    return stream


@contextlib.asynccontextmanager
async def _running(engine_id: int, speedup_ratio: float) -> AsyncIterator[tuple[EngineCore, EngineRunner]]:
    """A started runner around a fresh core (at speedup 0.1 a prefill pass sleeps ~170 ms before delivery)."""
    core = EngineCore(CONFIG)
    runner = EngineRunner(engine_id, core, speedup_ratio=speedup_ratio)
    runner.start()
    try:
        yield core, runner
    finally:
        await runner.stop()


async def _until_the_first_pass_is_in_flight(core: EngineCore) -> None:
    """Until the core has stepped its first pass (its events are journaled): delivery comes at its deadline."""
    while core.next_event_id == 0:
        await asyncio.sleep(0.001)


async def _finish(queue: OutputStream) -> list[int]:
    tokens: list[int] = []
    while True:
        output = await asyncio.wait_for(queue.get(), 10)
        tokens += output.token_ids
        if output.finished:
            return tokens


async def test_subscribing_while_a_pass_is_in_flight_gives_each_event_once():
    async with _running(7, 0.1) as (core, runner):
        queue = _submit(runner, EngineRequest("a", list(range(10, 30)), max_tokens=6, ignore_eos=True))
        await _until_the_first_pass_is_in_flight(core)
        assert runner.passes == 0  # stepped, not delivered yet
        in_flight = core.next_event_id

        replay, from_zero = runner.subscribe(0)
        dump, from_snapshot = runner.subscribe(None)
        mid, from_mid = runner.subscribe(in_flight)
        assert isinstance(replay, list) and [e.event_id for e in replay] == list(range(in_flight))
        assert isinstance(dump, CacheDump) and dump.next_event_id == in_flight
        assert mid == []

        assert len(await _finish(queue)) == 6
        end = core.next_event_id
        assert end > in_flight  # decode passes filled and stored more blocks
        live = await _drain(from_zero, end)
        assert [e.event_id for e in replay + live] == list(range(end))
        assert [e.event_id for e in await _drain(from_snapshot, end)] == list(range(in_flight, end))
        assert [e.event_id for e in await _drain(from_mid, end)] == list(range(in_flight, end))


async def test_blocks_a_pull_stored_on_an_idle_engine_reach_a_live_subscriber_at_once():
    """A decode engine's pulled blocks, then unpinned with no request to run (cancelled during the
    transfer, or refused): they were journaled, but an idle engine runs no pass to publish them, and a
    live subscriber (a router replica) did not hear of them until some unrelated request came."""
    async with _running(6, 1.0) as (core, runner):
        _, live = runner.subscribe(None)
        local, seq = core.prompt_hashes(list(range(12)), None)
        core.pin_new(seq, local, 0, 3)  # what MockerKv.pull does after its read
        core.unpin(seq)  # the request went away: MockerKv.unpin_request, then its hook
        runner._unpinned()
        (event,) = await asyncio.wait_for(live.next(), 2)
        assert [b.block_hash for b in event.data.blocks] == seq[:3]
        assert not core.has_unfinished()  # no pass ran for it


async def test_abort_frees_the_blocks_at_once_and_the_runner_goes_idle():
    async with _running(8, 0.5) as (core, runner):
        queue = _submit(runner, EngineRequest("long", list(range(10, 30)), max_tokens=200, ignore_eos=True))
        first = await asyncio.wait_for(queue.get(), 10)
        assert first.token_ids and core.load().active_blocks > 0
        runner.abort("long", queue)
        assert core.load().active_blocks == 0 and not core.has_unfinished()
        passes = runner.passes
        await asyncio.sleep(0.05)
        assert runner.passes <= passes + 1  # at most the pass already in flight completes
        assert queue.empty()


async def test_an_id_reused_while_its_cancelled_pass_is_in_flight_gets_only_its_own_outputs():
    """The pass computed for the cancelled request is delivered after the id is reused: it reaches no one."""
    async with _running(9, 0.1) as (core, runner):
        old = _submit(runner, EngineRequest("y", list(range(10, 30)), max_tokens=1, ignore_eos=True))
        await _until_the_first_pass_is_in_flight(core)  # its only pass
        runner.abort("y", old)
        new = _submit(runner, EngineRequest("y", list(range(40, 43)), max_tokens=5, ignore_eos=True))
        assert len(await _finish(new)) == 5
        assert old.empty()


async def test_an_id_whose_last_output_is_not_delivered_yet_is_refused():
    """Finished in the engine, but its last pass in flight: another stream taking the id would get its tokens."""
    async with _running(10, 0.1) as (core, runner):
        first = _submit(runner, EngineRequest("r", list(range(10, 30)), max_tokens=1, ignore_eos=True))
        await _until_the_first_pass_is_in_flight(core)
        assert not core.has_unfinished()  # the engine is done with it ...
        with pytest.raises(DuplicateRequest, match="already in the engine"):  # ... its stream is not
            _submit(runner, EngineRequest("r", list(range(40, 43)), max_tokens=5))
        assert len(await _finish(first)) == 1
        assert len(await _finish(_submit(runner, EngineRequest("r", [40, 41, 42], max_tokens=2, ignore_eos=True)))) == 2


async def test_a_starved_loop_restarts_the_schedule_and_counts_the_modelled_time_it_lost():
    """Deadlines are absolute, so passes a little late cost nothing in the end; after a stall longer than
    ``MAX_CATCH_UP_S`` the schedule restarts from now instead of rushing the passes that follow, and
    ``schedule_slip_s`` (``kvmesh_engine_schedule_slip_seconds``) counts the modelled time so lost: what
    tells a live replay's engines drifting apart from offline from a slow transport in front of them."""
    async with _running(11, 1.0) as (_core, runner):
        queue = _submit(runner, EngineRequest("s", list(range(10, 30)), max_tokens=40, ignore_eos=True))
        await asyncio.wait_for(queue.get(), 10)
        before = runner.schedule_slip_s
        time.sleep(0.05)  # the event loop starved: the deadlines meanwhile pass unserved
        assert len(await _finish(queue)) == 39
        assert runner.schedule_slip_s - before >= 0.03  # the stall, less the rest of the pass it caught in flight


async def test_deadline_timer_wakes_in_deadline_order_never_early_and_cleans_up():
    loop = asyncio.get_running_loop()
    timer = DeadlineTimer.acquire(loop)
    try:
        woke: list[tuple[int, float, float]] = []

        async def sleeper(tag: int, deadline: float) -> None:
            await timer.sleep_until(deadline)
            woke.append((tag, deadline, time.monotonic()))

        now = time.monotonic()
        cancelled = asyncio.create_task(sleeper(99, now + 0.015))
        tasks = [asyncio.create_task(sleeper(tag, now + 0.01 * tag)) for tag in (3, 1, 2)]
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(*tasks)
        assert [tag for tag, _, _ in woke] == [1, 2, 3]
        assert all(at >= deadline - 50e-6 for _, deadline, at in woke)
        await timer.sleep_until(time.monotonic() - 1)  # already due: returns at once
        assert not timer._heap
    finally:
        timer.release()
    assert loop not in DeadlineTimer._by_loop


async def test_deadline_timer_runs_every_due_callback_before_any_sleeper_resumes():
    """Deliveries happen at the deadline; the sleepers' next (slow) steps come after all of them."""
    loop = asyncio.get_running_loop()
    timer = DeadlineTimer.acquire(loop)
    try:
        log: list[str] = []

        async def sleeper(tag: str, deadline: float) -> None:
            await timer.sleep_until(deadline, lambda: log.append(f"due {tag}"))
            log.append(f"resumed {tag}")

        async def failing(deadline: float) -> None:
            def boom() -> None:
                raise RuntimeError("delivery failed")

            await timer.sleep_until(deadline, boom)

        deadline = time.monotonic() + 0.01
        cancelled = asyncio.create_task(sleeper("cancelled", deadline - 0.005))
        tasks = [asyncio.create_task(sleeper(tag, deadline)) for tag in "abc"]
        failed = asyncio.create_task(failing(deadline))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(*tasks)
        assert log[:3] == ["due a", "due b", "due c"]
        assert sorted(log[3:]) == ["resumed a", "resumed b", "resumed c"]
        try:
            await failed
        except RuntimeError as exc:
            assert str(exc) == "delivery failed"
        else:
            raise AssertionError("the sleeper whose callback raised returned normally")

        log.clear()
        await timer.sleep_until(time.monotonic() - 1, lambda: log.append("due late"))  # already due: runs at once
        assert log == ["due late"]
        assert not timer._heap
    finally:
        timer.release()


async def test_runners_share_one_timer_per_loop_and_release_it_on_stop():
    loop = asyncio.get_running_loop()
    runners = [EngineRunner(i, EngineCore(CONFIG), speedup_ratio=1.0) for i in range(3)]
    for runner in runners:
        runner.start()
    assert len({id(runner._timer) for runner in runners}) == 1
    queues = [
        _submit(runner, EngineRequest(f"r{i}", [5, 6, 7], max_tokens=3, ignore_eos=True))
        for i, runner in enumerate(runners)
    ]
    assert [len(await _finish(q)) for q in queues] == [3, 3, 3]
    for runner in runners:
        await runner.stop()
    assert loop not in DeadlineTimer._by_loop


def test_a_load_watcher_that_stops_reading_keeps_a_bounded_backlog_and_is_marked_too_slow(monkeypatch):
    """Every pass was queued for every forward-pass watcher: one that never read grew the worker to gigabytes."""
    monkeypatch.setattr(worker_service, "MAX_UNSENT_PASSES", 100)
    watcher = worker_service._LoadWatcher(None, want_passes=True)
    metrics = ForwardPassMetrics(0, 1, 0, 1, 0, 4, 1.5)
    for _ in range(99):
        watcher.on_pass(3, metrics, 0.002)
    assert len(watcher.passes) == 99 and not watcher.too_slow
    for _ in range(1000):
        watcher.on_pass(3, metrics, 0.002)
    assert watcher.too_slow and watcher.passes == [] and watcher.changed.is_set()


async def test_a_cancel_from_another_stream_leaves_this_streams_request_of_the_same_id_running():
    """Ids are unique per stream, not per engine (a stream cancels an id whose pull was still running,
    so it never reached the engine; or one whose last output it has not sent yet): only the stream that
    submitted a request can abort it."""
    async with _running(11, 0.5) as (core, runner):
        mine = _submit(runner, EngineRequest("r1", list(range(10, 30)), max_tokens=20, ignore_eos=True))
        await asyncio.wait_for(mine.get(), 10)
        runner.abort("r1", OutputStream())  # another stream's "r1"
        assert core.has_unfinished()
        assert len(await _finish(mine)) == 19  # the rest of its 20 tokens
        runner.abort("r1", mine)  # finished: nothing left to abort


@pytest.mark.parametrize("speedup_ratio", [1.0, 0.0])
async def test_a_request_kept_out_by_held_kv_waits_without_spinning_and_runs_once_the_hold_ends(speedup_ratio):
    """A prefill engine whose KV holds pin most blocks cannot admit a large request, and runs nothing
    else: it waits for the hold's release (or expiry) instead of stepping empty passes (tens of
    thousands a second, each one reported to every pass watcher, before)."""
    core = EngineCore(EngineConfig(num_gpu_blocks=16, block_size=4, vocab_size=2048, watermark=0.0))
    kv = MockerKv(12, core, KvConfig(4096, 4096, transfer_gbps=0.0, hold_timeout_s=30, speedup_ratio=1.0))
    runner = EngineRunner(12, core, speedup_ratio=speedup_ratio, role="prefill", kv=kv)
    runner.start()
    try:
        held = _submit(runner, EngineRequest("held", list(range(100, 140)), max_tokens=1, hold_kv=True))
        first = await asyncio.wait_for(held.get(), 10)
        assert first.finished and first.kv_transfer is not None and kv.held_blocks == 10
        blocked = _submit(runner, EngineRequest("next", list(range(200, 240)), max_tokens=2, ignore_eos=True))
        await asyncio.sleep(0.3)
        passes = runner.passes
        await asyncio.sleep(0.5)
        assert runner.passes == passes  # waiting, not stepping
        assert core.load().num_waiting == 1 and blocked.empty()
        assert runner.release_kv(first.kv_transfer.transfer_id)
        assert len(await _finish(blocked)) == 2
    finally:
        await runner.stop()


@pytest.mark.parametrize("speedup_ratio", [0.0, 1.0])
async def test_a_pass_that_raises_ends_the_engine_loudly(speedup_ratio, monkeypatch, caplog):
    """The loop's task died with the error and nobody looked: the engine answered nothing more while its
    worker said SERVING. ``wait_dead`` returns the error (logged), and the worker exits on it."""
    async with _running(0x51, speedup_ratio) as (core, runner):

        def broken_step():
            raise ValueError("Value out of range")  # as a hold's uint64 expiry once overflowed inside a pass

        monkeypatch.setattr(core, "step", broken_step)
        _submit(runner, EngineRequest("r", list(range(3, 20)), max_tokens=2))
        error = await asyncio.wait_for(runner.wait_dead(), 5)
    assert isinstance(error, ValueError)
    assert any(r.levelname == "CRITICAL" and r.exc_info for r in caplog.records)
