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
#: A store-side wait that answered busy sooner than this (and before the deadline) did not
#: really wait: the loop then sleeps one backoff delay, so it can never spin.
MIN_BLOCK = 0.001


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
    block: Callable[[float | None], Grant | Busy] | None = None,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
    sleep: Callable[[float], None] = time.sleep,
    first: Grant | Busy | None = None,
) -> Grant | Busy:
    """Call ``attempt`` until it grants, or ``wait`` seconds pass (None: no limit).

    The first attempt is made without a subscription (the uncontended path costs one round
    trip). Before the second, the waiter is subscribed, so a release between an attempt and the
    wait is never missed. A Busy with fewer holders than ``limit`` lost a race for a free slot:
    retry at once, a few times. Sleeps never exceed the holder's remaining lease as the store
    reported it, nor the caller's deadline.

    With ``block`` (stores whose server can hold a waiter until the release: PostgreSQL
    advisory locks, GET_LOCK), every attempt after the first waits inside the store: ``block``
    is called with the seconds left (None: no limit) and returns a Grant, or Busy when its wait
    ended without one (it may wait less than it was given; the loop calls it again).

    ``first`` is the answer to a first attempt the caller already made.
    """
    result = attempt() if first is None else first
    if isinstance(result, Grant) or wait == 0:
        return result
    deadline = None if wait is None else clock() + wait
    if block is not None:
        return _block_until(block, result, deadline, clock, Backoff(rng=rng), sleep)
    backoff = Backoff(cap=CAP_WITH_PUSH if push else CAP_POLLING, rng=rng)
    with subscribe() as waiter:
        result = _wait_with(waiter, attempt, deadline, limit, backoff, clock)
        waiter.finish(result)
        return result


def _wait_with(
    waiter: Waiter,
    attempt: Callable[[], Grant | Busy],
    deadline: float | None,
    limit: int,
    backoff: Backoff,
    clock: Callable[[], float],
) -> Grant | Busy:
    races = 0
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
            grant = waiter.take_grant()
            if grant is not None:  # the release handed the lease straight to us
                return grant
            backoff.reset()


def _block_until(
    block: Callable[[float | None], Grant | Busy],
    result: Busy,
    deadline: float | None,
    clock: Callable[[], float],
    backoff: Backoff,
    sleep: Callable[[float], None],
) -> Grant | Busy:
    """The store waits for us: call ``block`` until it grants or the deadline passes."""
    while True:
        started = clock()
        remaining = None if deadline is None else deadline - started
        if remaining is not None and remaining <= 0:
            return result
        answer = block(remaining)
        if isinstance(answer, Grant):
            return answer
        result = answer
        now = clock()
        if now - started < MIN_BLOCK and (deadline is None or now < deadline):
            delay = backoff.next()
            sleep(delay if deadline is None else min(delay, deadline - now))
