"""The waiting loop with a fake clock: no store, no sleeping."""

from __future__ import annotations

import random

from latchkey._types import Busy, Grant
from latchkey._waiting import Backoff, wait_for
from latchkey.stores.base import Waiter


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeWaiter(Waiter):
    def __init__(self, clock: FakeClock, log: list[float]) -> None:
        self.clock, self.log, self.closed = clock, log, False

    def wait(self, timeout: float) -> bool:
        self.log.append(timeout)
        self.clock.now += timeout
        return False

    def close(self) -> None:
        self.closed = True


def test_backoff_grows_to_its_cap_with_jitter() -> None:
    b = Backoff(initial=0.01, cap=0.08, rng=random.Random(1))
    delays = [b.next() for _ in range(8)]
    assert all(0.005 <= d <= 0.08 for d in delays)
    assert delays[-1] >= 0.04  # reached the cap's half at least


def test_try_once_does_not_subscribe() -> None:
    subscribed: list[int] = []
    result = wait_for(
        lambda: Busy(1),
        lambda: subscribed.append(1) or Waiter(),  # type: ignore[func-returns-value]
        wait=0,
        limit=1,
        push=False,
    )
    assert isinstance(result, Busy) and subscribed == []


def test_gives_up_at_the_deadline_and_never_sleeps_past_it() -> None:
    clock, log = FakeClock(), []
    waiter = FakeWaiter(clock, log)
    result = wait_for(
        lambda: Busy(1),
        lambda: waiter,
        wait=1.0,
        limit=1,
        push=False,
        clock=clock,
        rng=random.Random(0),
    )
    assert isinstance(result, Busy)
    assert clock.now == 1.0 or abs(clock.now - 1.0) < 1e-9
    assert max(log) <= 0.25 and waiter.closed


def test_sleeps_no_longer_than_the_holders_remaining_lease() -> None:
    clock, log = FakeClock(), []
    answers = iter([Busy(1, None, 0.5), Busy(1, None, 0.003), Grant(7, None)])
    result = wait_for(
        lambda: next(answers),
        lambda: FakeWaiter(clock, log),
        wait=None,
        limit=1,
        push=True,
        clock=clock,
        rng=random.Random(0),
    )
    assert result == Grant(7, None)
    assert log == [log[0]] and log[0] <= 0.004


def test_a_lost_race_for_a_free_slot_retries_at_once() -> None:
    clock, log = FakeClock(), []
    answers = iter([Busy(3), Busy(2), Busy(2), Grant(1, None)])
    result = wait_for(
        lambda: next(answers),
        lambda: FakeWaiter(clock, log),
        wait=10,
        limit=3,
        push=False,
        clock=clock,
    )
    assert result == Grant(1, None) and log == []


def test_first_try_wins_without_waiting() -> None:
    result = wait_for(lambda: Grant(1, None), lambda: Waiter(), wait=None, limit=1, push=False)
    assert result == Grant(1, None)


def test_a_blocking_store_waits_in_the_server_with_what_is_left() -> None:
    clock, asked = FakeClock(), []

    def block(timeout: float | None) -> Grant | Busy:
        asked.append(timeout)
        clock.now += 0.4  # the server held us 0.4 s, then answered (its own cap)
        return Grant(3, None) if len(asked) == 3 else Busy(1)

    subscribed: list[int] = []
    result = wait_for(
        lambda: Busy(1),
        lambda: subscribed.append(1) or Waiter(),  # type: ignore[func-returns-value]
        wait=2.0,
        limit=1,
        push=True,
        block=block,
        clock=clock,
    )
    assert result == Grant(3, None)
    assert [round(t or 0, 6) for t in asked] == [2.0, 1.6, 1.2]
    assert subscribed == []  # the server does the waking: no subscription


def test_a_blocking_store_gives_up_at_the_deadline() -> None:
    clock, asked = FakeClock(), []

    def block(timeout: float | None) -> Grant | Busy:
        asked.append(timeout)
        assert timeout is not None
        clock.now += timeout
        return Busy(1, None)

    result = wait_for(
        lambda: Busy(1), lambda: Waiter(), wait=1.5, limit=1, push=True, block=block, clock=clock
    )
    assert isinstance(result, Busy) and asked == [1.5]


def test_a_blocking_store_that_does_not_wait_cannot_make_the_loop_spin() -> None:
    clock, slept, calls = FakeClock(), [], []

    def block(timeout: float | None) -> Grant | Busy:
        calls.append(timeout)
        return Busy(1)  # answers at once, without waiting

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.now += seconds

    result = wait_for(
        lambda: Busy(1), lambda: Waiter(), wait=1.0, limit=1, push=True, block=block,
        clock=clock, sleep=sleep, rng=random.Random(0),
    )  # fmt: skip
    assert isinstance(result, Busy)
    assert len(calls) == len(slept) and 0 < len(calls) < 50 and abs(clock.now - 1.0) < 1e-9


class HandingWaiter(FakeWaiter):
    """Woken once by a release that hands the lease straight over (PostgreSQL's queue)."""

    def __init__(self, clock: FakeClock, log: list[float]) -> None:
        super().__init__(clock, log)
        self.outcome: Grant | Busy | None = None

    def wait(self, timeout: float) -> bool:
        super().wait(timeout)
        return len(self.log) == 2

    def take_grant(self) -> Grant | None:
        return Grant(9, None) if len(self.log) == 2 else None

    def finish(self, result: Grant | Busy) -> None:
        self.outcome = result


def test_a_lease_handed_over_on_release_is_returned_without_another_attempt() -> None:
    clock, log, attempts = FakeClock(), [], []
    waiter = HandingWaiter(clock, log)

    def attempt() -> Grant | Busy:
        attempts.append(clock.now)
        return Busy(1)

    result = wait_for(
        attempt, lambda: waiter, wait=10, limit=1, push=True, clock=clock, rng=random.Random(0)
    )
    assert result == Grant(9, None)
    assert len(attempts) == 3  # the first, one after subscribing, one after the first wake-up
    assert waiter.outcome == result and waiter.closed


def test_the_waiter_is_told_a_timeout_before_it_closes() -> None:
    clock, log = FakeClock(), []
    waiter = HandingWaiter(clock, log)
    waiter.take_grant = lambda: None  # type: ignore[method-assign]
    result = wait_for(lambda: Busy(1), lambda: waiter, wait=0.5, limit=1, push=True, clock=clock)
    assert isinstance(result, Busy) and waiter.outcome is result and waiter.closed
