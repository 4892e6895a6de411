"""Capped exponential backoff with jitter, for reconnect loops that run until they are cancelled.

Every long-lived stream in the mesh (KV-event feeds, replica links, load watches, discovery watches,
lease re-grants) reconnects the same way: wait, double the wait up to a cap, start over after a
success. The jitter keeps N routers that lost the same worker from redialling it in lockstep.

Why not tenacity or stamina: both count attempts of one operation and give up after a budget; these
loops never give up and reset after every success, which is this class's whole API.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable


class Backoff:
    """Delays ``initial, 2*initial, ...`` capped at ``maximum``, each shortened by up to ``jitter``.

    ``jitter`` is the largest fraction taken off a delay (0 = deterministic, 1 = "full jitter").
    """

    __slots__ = ("_current", "_rng", "attempts", "factor", "initial", "jitter", "maximum")

    def __init__(
        self,
        initial: float = 0.05,
        maximum: float = 2.0,
        *,
        factor: float = 2.0,
        jitter: float = 0.5,
        rng: Callable[[], float] = random.random,
    ) -> None:
        if not 0 < initial <= maximum:
            raise ValueError(f"need 0 < initial <= maximum, got {initial}, {maximum}")
        if factor < 1 or not 0 <= jitter <= 1:
            raise ValueError(f"need factor >= 1 and 0 <= jitter <= 1, got {factor}, {jitter}")
        self.initial = initial
        self.maximum = maximum
        self.factor = factor
        self.jitter = jitter
        self._rng = rng
        self._current = initial
        self.attempts = 0

    def next_delay(self) -> float:
        """The delay before the next attempt; each call advances the schedule."""
        base = self._current
        self._current = min(self._current * self.factor, self.maximum)
        self.attempts += 1
        if not self.jitter:  # deterministic: leave the shared random state alone
            return base
        return base * (1.0 - self.jitter * self._rng())

    async def sleep(self) -> float:
        """Sleep the next delay and return it (for the log line)."""
        delay = self.next_delay()
        await asyncio.sleep(delay)
        return delay

    def reset(self) -> None:
        """After a success: the next failure waits ``initial`` again."""
        self._current = self.initial
        self.attempts = 0
