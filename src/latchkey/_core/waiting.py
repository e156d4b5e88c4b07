"""Blocking waits: a monotonic deadline and capped exponential backoff with full jitter.

I/O-free: the store is reached only through yielded operations (``acquire``,
``acquire_blocking``, ``wait_in_line`` and the waiter's ``wait``/``take_grant``/``finish``/
``close``); pauses are yielded too. The clock and the random source are injectable, so unit
tests drive this with a fake clock (``tests/unit/test_waiting.py``).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

from latchkey._core.holds import PACED, Holds
from latchkey._core.ops import Steps, call, on, sleep
from latchkey._types import Busy, Grant

#: First retry delay, its cap when the store pushes release notices (the poll is then only a
#: safety net for a lost notice), and its cap when it does not.
INITIAL_DELAY = 0.005
CAP_WITH_PUSH = 1.0
CAP_POLLING = 0.25
#: A push waiter with others of its process ahead of it in line (``Waiter.ahead``) is woken
#: only after them, so its safety-net poll may come later: after ``CAP_WITH_PUSH`` seconds
#: for each waiter ahead plus one, up to this (and never past the holder's lease or the
#: caller's deadline). Without it, thousands of waiters in a few processes would each poll
#: every second: ~200 store calls per grant with 2,500 waiters in 5 processes on Redis.
CAP_BEHIND = 30.0
#: Stores without push whose polls are cheap (``Backend.poll_share``: memcached): the
#: first waiter of a process polls at least every ``poll_share`` times the time it has waited,
#: and never less often than every QUICK_POLL seconds — a release is seen within about 2 %
#: of the wait (15 ms early on) instead of the backoff's up to 250 ms.
QUICK_POLL = 0.015
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
        # Made on first use: seeding one from the OS cost a waiting acquire of a blocking
        # store (which rarely backs off) a tenth of its CPU.
        self._given = rng

    @functools.cached_property
    def _rng(self) -> random.Random:
        return self._given or random.Random()

    def next(self) -> float:
        delay = self._current
        self._current = min(self.cap, self._current * 2)
        return self._rng.uniform(delay / 2, delay)

    def reset(self) -> None:
        self._current = self.initial

    def within(self, cap: float) -> float:
        """A delay jittered as :meth:`next`, from ``cap``."""
        return self._rng.uniform(cap / 2, cap)

    def behind(self, ahead: int) -> float:
        """The delay of a push waiter with ``ahead`` waiters before it: jittered as
        :meth:`next`, from a cap that grows with its place in line."""
        cap = min(CAP_BEHIND, CAP_WITH_PUSH * (ahead + 1))
        return self._rng.uniform(cap / 2, cap)


class Attempts:
    """The acquire attempts of one wait, all for the same owner; remembers when the last one
    was sent (the holder's local deadline counts from there). With ``holds`` (the store
    object's record of this process's leases and turns, ``_core/holds.py``) an attempt asks
    the store only when that record has no answer."""

    __slots__ = ("args", "clock", "holds", "sent", "woken")

    def __init__(
        self,
        args: tuple[Any, ...],
        clock: Callable[[], float],
        sent: float,
        holds: Holds | None = None,
    ) -> None:
        self.args = args  # (name, owner, owner_info, ttl, limit)
        self.clock = clock
        self.sent = sent
        self.holds = holds
        #: A release notice woke this wait since it last asked the store: it may ask before
        #: the waiters of its process that came earlier (the notice was for it).
        self.woken = False

    def attempt(self) -> Steps[Grant | Busy]:
        """Ask the store, unless this process's own record answers: busy while a lease of
        it through the same store object is live by its holder's clock; for a mutex, PACED
        while an attempt of it is in flight or a waiter of it came first."""
        if self.holds is not None:
            local = self.holds.answer(self.args[0], self.args[4], self, self.woken)
            if local is not None:
                return local
        return (yield from self.ask())

    def ask(self) -> Steps[Grant | Busy]:
        """Ask the store (a mutex attempt is known to be in flight meanwhile)."""
        self.woken = False
        self.sent = self.clock()
        holds = self.holds
        if holds is None or self.args[4] != 1:
            return (yield call("acquire", *self.args))  # type: ignore[no-any-return]
        return (yield from ask_in_turn(holds, self.args))

    def block(self, timeout: float | None) -> Steps[Grant | Busy]:
        self.sent = self.clock()
        return (yield call("acquire_blocking", *self.args, timeout))  # type: ignore[no-any-return]


def ask_in_turn(holds: Holds, args: tuple[Any, ...]) -> Steps[Grant | Busy]:
    """A mutex attempt, known to this process's waiters of the name while it is in flight
    (they wait for its outcome instead of racing it: ``Holds.answer``)."""
    holds.asks(args[0], 1)
    try:
        return (yield call("acquire", *args))  # type: ignore[no-any-return]
    finally:
        holds.asks(args[0], -1)


def wait_for(
    attempts: Attempts,
    first: Busy,
    *,
    wait: float | None,
    limit: int,
    push: bool,
    blocking: bool,
    rng: random.Random | None = None,
    poll_share: float | None = None,
) -> Steps[Grant | Busy]:
    """Attempt until a grant, or until ``wait`` seconds pass (None: no limit), after a
    ``first`` attempt that found the name busy; the seconds count from that attempt's send
    (``attempts.sent``), as the caller's call began then.

    Before the second attempt the store is asked for a waiter (``wait_in_line``), so a release
    between an attempt and the wait is never missed; a store without push answers None and
    the loop polls. A Busy with fewer holders than ``limit`` lost a race for a free slot: retry
    at once, a few times. Pauses never exceed the holder's remaining lease as the store
    reported it, nor the caller's deadline.

    With ``blocking`` (stores whose server holds a waiter until the release: PostgreSQL
    advisory locks, GET_LOCK), every attempt after the first waits inside the store. With
    ``poll_share`` (a store without push whose polls are cheap) the first waiter in line polls
    at least every ``poll_share`` times the time waited, QUICK_POLL at least.
    """
    # From the first attempt's send, not its answer: a first attempt slowed by the store does
    # not lengthen the wait (the chaos run's slow-call rule: wait + one call's bound).
    deadline = None if wait is None else attempts.sent + wait
    if blocking:
        return (yield from _block_until(attempts, first, deadline, Backoff(rng=rng)))
    backoff = Backoff(cap=CAP_WITH_PUSH if push else CAP_POLLING, rng=rng)
    holds = attempts.holds if limit == 1 else None
    if holds is not None:  # this process's mutex waiters take their turns in arrival order
        holds.join(attempts.args[0], attempts)
    try:
        waiter = yield call("wait_in_line", *attempts.args)
        try:
            if deadline is not None and attempts.clock() >= deadline:
                # Joining the line took the rest of the wait (a slow store): no attempt after
                # it, which could take a whole timeout more; the wait ends busy, as it began.
                result: Grant | Busy = first
            else:
                share = None if push else poll_share
                result = yield from _wait_with(waiter, attempts, deadline, limit, backoff, share)
            if waiter is not None:
                yield on(waiter, "finish", result)
            return result
        finally:
            if waiter is not None:
                yield on(waiter, "close")
    finally:
        if holds is not None:
            holds.leave(attempts.args[0], attempts)


def _wait_with(
    waiter: Any,
    attempts: Attempts,
    deadline: float | None,
    limit: int,
    backoff: Backoff,
    share: float | None = None,
) -> Steps[Grant | Busy]:
    clock = attempts.clock
    started = clock()
    races = 0
    while True:
        result = yield from attempts.attempt()
        if type(result) is Grant:
            return result
        assert isinstance(result, Busy)
        remaining = None if deadline is None else deadline - clock()
        if remaining is not None and remaining <= 0:
            if result is PACED:  # another's turn is no answer: ask the store, once
                result = yield from attempts.ask()
            return result
        if result.holders < limit and races < MAX_IMMEDIATE_RETRIES:
            races += 1
            continue
        races = 0
        ahead = 0 if waiter is None else waiter.ahead
        holds = attempts.holds
        if ahead and holds is not None and holds.first(attempts.args[0], attempts):
            ahead = 0  # the others of this process wait for its attempts (PACED): it polls
        delay = backoff.next() if not ahead else backoff.behind(ahead)
        if share is not None and not ahead:  # cheap polls: bounded by the time waited
            quick = max(QUICK_POLL, share * (clock() - started))
            if delay > quick:
                delay = backoff.within(quick)
        if result.retry_after is not None:
            delay = min(delay, max(result.retry_after, 0.0) + 0.001)
        if remaining is not None:
            delay = min(delay, remaining)
        if waiter is None:
            yield sleep(delay)
        elif (yield on(waiter, "wait", delay)):
            grant = yield on(waiter, "take_grant")
            if grant is not None:  # the release handed the lease straight to us
                return grant  # type: ignore[no-any-return]
            attempts.woken = True
            backoff.reset()


def _block_until(
    attempts: Attempts, result: Busy, deadline: float | None, backoff: Backoff
) -> Steps[Grant | Busy]:
    """The store waits for us: ask it to until it grants or the deadline passes."""
    clock = attempts.clock
    while True:
        started = clock()
        remaining = None if deadline is None else deadline - started
        if remaining is not None and remaining <= 0:
            return result
        answer = yield from attempts.block(remaining)
        if type(answer) is Grant:
            return answer
        assert isinstance(answer, Busy)
        result = answer
        now = clock()
        if now - started < MIN_BLOCK and (deadline is None or now < deadline):
            delay = backoff.next()
            yield sleep(delay if deadline is None else min(delay, deadline - now))
