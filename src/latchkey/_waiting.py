"""Blocking waits: a monotonic deadline and capped exponential backoff with full jitter.

I/O-free: the store is reached only through the ``attempt`` callable and the ``Waiter``; the
clock is injectable, so unit tests drive this with a fake clock.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

from latchkey._types import Busy, Grant
from latchkey.stores.base import Waiter

T = TypeVar("T")

#: First retry delay, its cap when the store pushes release notices (the poll is then only a
#: safety net for a lost notice), and its cap when it does not.
INITIAL_DELAY = 0.005
CAP_WITH_PUSH = 1.0
CAP_POLLING = 0.25
#: After this many attempts that lost a race for a free slot, back off like a busy answer.
MAX_IMMEDIATE_RETRIES = 3


class Backoff:
    """Capped exponential delays with jitter: each delay is uniform in [d/2, d]."""

    def __init__(
        self,
        initial: float = INITIAL_DELAY,
        cap: float = CAP_POLLING,
        rng: random.Random | None = None,
    ) -> None:
        self.initial = initial
        self.cap = cap
        self._current = initial
        self._rng = rng or random.Random()

    def next(self) -> float:
        delay = self._current
        self._current = min(self.cap, self._current * 2)
        return self._rng.uniform(delay / 2, delay)

    def reset(self) -> None:
        self._current = self.initial


def wait_for(
    attempt: Callable[[], Grant | Busy],
    subscribe: Callable[[], Waiter],
    *,
    wait: float | None,
    limit: int,
    push: bool,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
) -> Grant | Busy:
    """Call ``attempt`` until it grants, or ``wait`` seconds pass (None: no limit).

    The first attempt is made without a subscription (the uncontended path costs one round
    trip). Before the second, the waiter is subscribed, so a release between an attempt and the
    wait is never missed. A Busy with fewer holders than ``limit`` lost a race for a free slot:
    retry at once, a few times. Sleeps never exceed the holder's remaining lease as the store
    reported it, nor the caller's deadline.
    """
    result = attempt()
    if isinstance(result, Grant) or wait == 0:
        return result
    deadline = None if wait is None else clock() + wait
    backoff = Backoff(cap=CAP_WITH_PUSH if push else CAP_POLLING, rng=rng)
    races = 0
    with subscribe() as waiter:
        while True:
            result = attempt()
            if isinstance(result, Grant):
                return result
            remaining = None if deadline is None else deadline - clock()
            if remaining is not None and remaining <= 0:
                return result
            if result.holders < limit and races < MAX_IMMEDIATE_RETRIES:
                races += 1
                continue
            races = 0
            delay = backoff.next()
            if result.retry_after is not None:
                delay = min(delay, max(result.retry_after, 0.0) + 0.001)
            if remaining is not None:
                delay = min(delay, remaining)
            if waiter.wait(delay):
                backoff.reset()
