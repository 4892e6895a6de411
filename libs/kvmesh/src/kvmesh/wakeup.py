"""A one-waiter wake-up for producer/consumer pairs on one event loop.

The consumer checks its condition and, if there is nothing to do, awaits ``wait()``; producers call
``set()`` after they changed what the consumer looks at. Both run on the loop's thread, so the check
and the wait cannot race and no wake-up is lost. Cheaper than ``asyncio.Event`` on the hot path (no
waiter list, no clear()), which is why writer loops and output queues use it.

Invariant: at most one task waits at a time; ``set()`` with no waiter is a no-op (the consumer
re-checks its condition before it waits again).
"""

from __future__ import annotations

import asyncio


class Wakeup:
    __slots__ = ("_waiter",)

    def __init__(self) -> None:
        self._waiter: asyncio.Future[None] | None = None

    async def wait(self) -> None:
        """Suspend until the next ``set()``."""
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            if self._waiter is waiter:
                self._waiter = None

    def set(self) -> None:
        """Wake the waiting task, if any."""
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    @property
    def waiting(self) -> bool:
        return self._waiter is not None
