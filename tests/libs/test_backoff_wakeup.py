"""The two shared primitives of reconnect loops and writer loops."""

import asyncio

import pytest
from kvmesh.backoff import Backoff
from kvmesh.wakeup import Wakeup


def test_backoff_doubles_up_to_the_cap_and_resets_after_success():
    backoff = Backoff(0.1, 0.5, jitter=0.0)
    assert [backoff.next_delay() for _ in range(5)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    assert backoff.attempts == 5
    backoff.reset()
    assert backoff.next_delay() == pytest.approx(0.1)


def test_backoff_jitter_only_shortens_a_delay():
    backoff = Backoff(1.0, 1.0, jitter=0.5, rng=lambda: 1.0)
    assert backoff.next_delay() == pytest.approx(0.5)
    backoff = Backoff(1.0, 1.0, jitter=0.5, rng=lambda: 0.0)
    assert backoff.next_delay() == pytest.approx(1.0)


@pytest.mark.parametrize(("args", "kwargs"), [((0.0, 1.0), {}), ((2.0, 1.0), {}), ((0.1, 1.0), {"jitter": 2.0})])
def test_backoff_rejects_nonsense(args, kwargs):
    with pytest.raises(ValueError):
        Backoff(*args, **kwargs)


async def test_wakeup_wakes_the_waiter_once_and_ignores_a_set_with_no_waiter():
    wakeup = Wakeup()
    wakeup.set()  # nobody waits: a no-op, not a stored wake-up
    task = asyncio.create_task(wakeup.wait())
    await asyncio.sleep(0)
    assert wakeup.waiting and not task.done()
    wakeup.set()
    await asyncio.wait_for(task, 1)
    assert not wakeup.waiting


async def test_wakeup_cancelled_waiter_leaves_no_stale_future():
    wakeup = Wakeup()
    task = asyncio.create_task(wakeup.wait())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not wakeup.waiting


def test_backoff_without_jitter_draws_no_random_numbers():
    def no_draws() -> float:
        raise AssertionError("a deterministic backoff must not consume the random state")

    assert Backoff(0.1, 1.0, jitter=0.0, rng=no_draws).next_delay() == pytest.approx(0.1)
