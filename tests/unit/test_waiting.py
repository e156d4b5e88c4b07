"""The waiting rules with a fake clock: no store, no sleeping.

The core's wait loop is a generator of operations (``latchkey._core.ops``); here a fake
runner answers them from a fake store and advances a fake clock on every pause, the way the
sync and asyncio runners would do with a real store and real time.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from latchkey._core.ops import CALL, SLEEP, Steps
from latchkey._core.waiting import Attempts, Backoff, wait_for
from latchkey._types import Busy, Grant

ARGS = ("n", "owner", "{}", 30.0, 1)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeWaiter:
    def __init__(self, clock: FakeClock, log: list[float], ahead: int = 0) -> None:
        self.clock, self.log, self.closed = clock, log, False
        self.outcome: Grant | Busy | None = None
        self.ahead = ahead  # waiters of this process woken before this one

    def wait(self, timeout: float) -> bool:
        self.log.append(timeout)
        self.clock.now += timeout
        return False

    def take_grant(self) -> Grant | None:
        return None

    def finish(self, result: Grant | Busy) -> None:
        self.outcome = result

    def close(self) -> None:
        self.closed = True


class FakeStore:
    """Answers ``acquire`` from a list (or a function), ``wait_in_line`` with a waiter."""

    def __init__(
        self,
        clock: FakeClock,
        answers: Callable[[], Grant | Busy],
        waiter: FakeWaiter | None = None,
        block: Callable[[float | None], Grant | Busy] | None = None,
    ) -> None:
        self.clock, self.answers, self.waiter, self.block = clock, answers, waiter, block
        self.calls: list[str] = []
        self.slept: list[float] = []

    def acquire(self, *args: Any) -> Grant | Busy:
        self.calls.append("acquire")
        return self.answers()

    def acquire_blocking(self, *args: Any) -> Grant | Busy:
        self.calls.append("acquire_blocking")
        assert self.block is not None
        return self.block(args[-1])

    def wait_in_line(self, *args: Any) -> FakeWaiter | None:
        self.calls.append("wait_in_line")
        return self.waiter


def drive(steps: Steps[Any], store: FakeStore) -> Any:
    """A runner with fake time: CALL on the fake store or its waiter, SLEEP moves the clock."""
    value: Any = None
    while True:
        try:
            op = steps.send(value)
        except StopIteration as stop:
            return stop.value
        kind, target, method, args = op
        if kind == CALL:
            value = getattr(store if target is None else target, method)(*args)
        else:
            assert kind == SLEEP
            store.slept.append(args[0])
            store.clock.now += args[0]
            value = None


def waiting(
    store: FakeStore,
    first: Busy,
    *,
    wait: float | None,
    limit: int = 1,
    push: bool = False,
    blocking: bool = False,
    poll_share: float | None = None,
) -> Grant | Busy:
    attempts = Attempts((*ARGS[:4], limit), store.clock, store.clock())
    steps = wait_for(
        attempts, first, wait=wait, limit=limit, push=push, blocking=blocking,
        rng=random.Random(0), poll_share=poll_share,
    )  # fmt: skip
    return drive(steps, store)  # type: ignore[no-any-return]


def answers(*items: Grant | Busy) -> Callable[[], Grant | Busy]:
    it = iter(items)
    return lambda: next(it)


def test_backoff_grows_to_its_cap_with_jitter() -> None:
    b = Backoff(initial=0.01, cap=0.08, rng=random.Random(1))
    delays = [b.next() for _ in range(8)]
    assert all(0.005 <= d <= 0.08 for d in delays)
    assert delays[-1] >= 0.04  # reached the cap's half at least


def test_gives_up_at_the_deadline_and_never_sleeps_past_it() -> None:
    clock, log = FakeClock(), []
    waiter = FakeWaiter(clock, log)
    store = FakeStore(clock, lambda: Busy(1), waiter)
    result = waiting(store, Busy(1), wait=1.0)
    assert isinstance(result, Busy)
    assert abs(clock.now - 1.0) < 1e-9
    assert max(log) <= 0.25 and waiter.closed and waiter.outcome is result


def test_a_store_without_push_is_polled_by_the_core() -> None:
    clock = FakeClock()
    store = FakeStore(clock, lambda: Busy(1), None)  # wait_in_line answers None: no push
    result = waiting(store, Busy(1), wait=1.0)
    assert isinstance(result, Busy)
    assert store.slept and max(store.slept) <= 0.25 and abs(clock.now - 1.0) < 1e-9
    assert store.calls.count("acquire") == len(store.slept) + 1


def test_cheap_polls_are_bounded_by_a_share_of_the_time_waited() -> None:
    """memcached (``poll_share`` 0.02): every pause is at most 2 % of the time waited so
    far, 15 ms at least — where the plain backoff grows to 250 ms; a waiter further back in
    its process's line keeps the slow polls."""
    clock = FakeClock()
    store = FakeStore(clock, lambda: Busy(1), None)
    waiting(store, Busy(1), wait=30.0, poll_share=0.02)
    waited = 0.0
    for pause in store.slept:
        assert pause <= max(0.015, 0.02 * waited) + 1e-9, (pause, waited)
        waited += pause
    assert max(store.slept[:20]) <= 0.015 and max(store.slept) > 0.2  # 250 ms after 12.5 s
    clock, log = FakeClock(), []
    behind = FakeStore(clock, lambda: Busy(1), FakeWaiter(clock, log, ahead=2))
    waiting(behind, Busy(1), wait=10.0, poll_share=0.02)
    assert min(log[:-1]) >= 1.0  # behind two others: CAP_WITH_PUSH x 3 (the last: the deadline)


def test_sleeps_no_longer_than_the_holders_remaining_lease() -> None:
    clock, log = FakeClock(), []
    store = FakeStore(clock, answers(Busy(1, None, 0.003), Grant(7, None)), FakeWaiter(clock, log))
    result = waiting(store, Busy(1, None, 0.5), wait=None, push=True)
    assert result == Grant(7, None)
    assert log == [log[0]] and log[0] <= 0.004


def test_a_waiter_further_back_in_line_polls_less_often() -> None:
    """A push waiter with k waiters of its process ahead (each woken before it) polls every
    (k + 1) s at most, up to CAP_BEHIND, with jitter; first in line it backs off from 5 ms as
    always; the holder's remaining lease and the caller's deadline still bound every pause."""
    from latchkey._core.waiting import CAP_BEHIND

    for ahead, low, high in ((0, 0.0025, 0.005), (3, 2.0, 4.0), (500, CAP_BEHIND / 2, CAP_BEHIND)):
        clock, log = FakeClock(), []
        store = FakeStore(clock, answers(Busy(1), Grant(7, None)), FakeWaiter(clock, log, ahead))
        assert waiting(store, Busy(1), wait=None, push=True) == Grant(7, None)
        assert len(log) == 1 and low <= log[0] <= high, (ahead, log)
    clock, log = FakeClock(), []
    store = FakeStore(clock, answers(Busy(1, None, 0.5), Grant(7, None)),
                      FakeWaiter(clock, log, 40))  # fmt: skip
    assert waiting(store, Busy(1), wait=None, push=True) == Grant(7, None)
    assert log[0] <= 0.502  # the holder's lease ends first
    clock, log = FakeClock(), []
    store = FakeStore(clock, lambda: Busy(1), FakeWaiter(clock, log, 40))
    assert isinstance(waiting(store, Busy(1), wait=3.0, push=True), Busy)
    assert log and max(log) <= 3.0 and abs(clock.now - 3.0) < 1e-9


def test_a_lost_race_for_a_free_slot_retries_at_once() -> None:
    clock, log = FakeClock(), []
    store = FakeStore(
        clock, answers(Busy(2), Busy(2), Grant(1, None)), FakeWaiter(clock, log)
    )
    result = waiting(store, Busy(3), wait=10, limit=3)
    assert result == Grant(1, None) and log == []


def test_a_blocking_store_waits_in_the_server_with_what_is_left() -> None:
    clock, asked = FakeClock(), []

    def block(timeout: float | None) -> Grant | Busy:
        asked.append(timeout)
        clock.now += 0.4  # the server held us 0.4 s, then answered (its own cap)
        return Grant(3, None) if len(asked) == 3 else Busy(1)

    store = FakeStore(clock, lambda: Busy(1), None, block)
    result = waiting(store, Busy(1), wait=2.0, push=True, blocking=True)
    assert result == Grant(3, None)
    assert [round(t or 0, 6) for t in asked] == [2.0, 1.6, 1.2]
    assert "wait_in_line" not in store.calls  # the server does the waking


def test_a_blocking_store_gives_up_at_the_deadline() -> None:
    clock, asked = FakeClock(), []

    def block(timeout: float | None) -> Grant | Busy:
        asked.append(timeout)
        assert timeout is not None
        clock.now += timeout
        return Busy(1, None)

    store = FakeStore(clock, lambda: Busy(1), None, block)
    result = waiting(store, Busy(1), wait=1.5, push=True, blocking=True)
    assert isinstance(result, Busy) and asked == [1.5]


def test_a_blocking_store_that_does_not_wait_cannot_make_the_loop_spin() -> None:
    clock, calls = FakeClock(), []

    def block(timeout: float | None) -> Grant | Busy:
        calls.append(timeout)
        return Busy(1)  # answers at once, without waiting

    store = FakeStore(clock, lambda: Busy(1), None, block)
    result = waiting(store, Busy(1), wait=1.0, push=True, blocking=True)
    assert isinstance(result, Busy)
    assert len(calls) == len(store.slept) and 0 < len(calls) < 50
    assert abs(clock.now - 1.0) < 1e-9


class HandingWaiter(FakeWaiter):
    """Woken once by a release that hands the lease straight over (PostgreSQL's queue)."""

    def wait(self, timeout: float) -> bool:
        super().wait(timeout)
        return len(self.log) == 2

    def take_grant(self) -> Grant | None:
        return Grant(9, None) if len(self.log) == 2 else None


def test_a_lease_handed_over_on_release_is_returned_without_another_attempt() -> None:
    clock, log = FakeClock(), []
    waiter = HandingWaiter(clock, log)
    store = FakeStore(clock, lambda: Busy(1), waiter)
    result = waiting(store, Busy(1), wait=10, push=True)
    assert result == Grant(9, None)
    # one attempt after waiting in line, one after the first wake-up (the first was the caller's)
    assert store.calls.count("acquire") == 2
    assert waiter.outcome == result and waiter.closed


def test_the_waiter_is_told_a_timeout_before_it_closes() -> None:
    clock, log = FakeClock(), []
    waiter = HandingWaiter(clock, log)
    waiter.take_grant = lambda: None  # type: ignore[method-assign]
    store = FakeStore(clock, lambda: Busy(1), waiter)
    result = waiting(store, Busy(1), wait=0.5, push=True)
    assert isinstance(result, Busy) and waiter.outcome is result and waiter.closed


def test_the_waiter_is_closed_when_the_store_fails() -> None:
    clock, log = FakeClock(), []
    waiter = FakeWaiter(clock, log)

    steps = wait_for(
        Attempts(ARGS, clock, 0.0), Busy(1), wait=5, limit=1, push=True, blocking=False
    )
    op = steps.send(None)  # wait_in_line
    assert op[2] == "wait_in_line"
    op = steps.send(waiter)  # the next attempt
    assert op[2] == "acquire"
    op = steps.throw(ConnectionError("gone"))  # the attempt failed: the waiter is closed...
    assert op[1:3] == (waiter, "close")
    try:
        steps.send(None)  # ...and the error goes on to the caller
    except ConnectionError:
        pass
    else:
        raise AssertionError("the store's error was swallowed")
    assert waiter.outcome is None  # not told an outcome: there was none


# -- turns within one process (issue 17, latchkey._core.holds) ----------------------------------


def _waiting_with(store: FakeStore, holds: Any, *, wait: float) -> Grant | Busy:
    attempts = Attempts(ARGS, store.clock, store.clock(), holds)
    steps = wait_for(
        attempts, Busy(1), wait=wait, limit=1, push=True, blocking=False, rng=random.Random(0)
    )
    return drive(steps, store)  # type: ignore[no-any-return]


def test_a_waiter_does_not_race_an_attempt_of_its_process_in_flight() -> None:
    from latchkey._core.holds import Holds

    clock, log = FakeClock(), []
    holds = Holds()
    holds.asks("n", 1)  # another thread's attempt of "n" is in flight…

    class Waiter(FakeWaiter):
        def wait(self, timeout: float) -> bool:
            woke = super().wait(timeout)
            if clock.now > 0.1 and "n" in holds.asking:
                holds.asks("n", -1)  # …and is answered (busy: it found another holder)
            return woke

    store = FakeStore(clock, lambda: Grant(7, None), Waiter(clock, log))
    result = _waiting_with(store, holds, wait=10.0)
    assert isinstance(result, Grant)
    assert store.calls == ["wait_in_line", "acquire"]  # it asked once the other was done
    assert not holds.queue  # and left the line


def test_paced_is_never_the_answer_a_wait_ends_with_the_store_is_asked_once() -> None:
    from latchkey._core.holds import PACED, Holds

    clock, log = FakeClock(), []
    holds = Holds()
    holds.asks("n", 1)  # an attempt in flight for the whole wait
    store = FakeStore(clock, lambda: Busy(1, None, 5.0), FakeWaiter(clock, log))
    result = _waiting_with(store, holds, wait=1.0)
    assert result is not PACED and result == Busy(1, None, 5.0)
    assert store.calls == ["wait_in_line", "acquire"]  # the one ask, at the deadline
    assert clock.now >= 1.0


def test_the_first_of_its_process_polls_as_the_first_whatever_its_place_in_the_listener() -> None:
    """The others of its process wait for its attempts (PACED): were it to sleep as its
    waiter's place says (that order can differ: Redis's line costs a round trip between the
    two), nobody of the process would ask for up to CAP_BEHIND seconds."""
    from latchkey._core.holds import Holds

    clock, log = FakeClock(), []
    holds = Holds()
    store = FakeStore(clock, answers(Busy(1), Grant(7, None)), FakeWaiter(clock, log, ahead=40))
    attempts = Attempts((*ARGS[:4], 1), clock, clock(), holds)
    steps = wait_for(attempts, Busy(1), wait=None, limit=1, push=True, blocking=False,
                     rng=random.Random(0))  # fmt: skip
    assert drive(steps, store) == Grant(7, None)
    assert len(log) == 1 and log[0] <= 0.005, log  # not the 20-40 s of 40 ahead


def test_waiters_of_a_process_ask_in_the_order_they_came_unless_woken() -> None:
    from latchkey._core.holds import PACED, Holds

    holds = Holds()
    first, second = object(), object()
    holds.join("n", first)
    holds.join("n", second)
    assert holds.answer("n", 1, first, False) is None  # the first waiter asks
    assert holds.answer("n", 1, second, False) is PACED  # the second lets it go first…
    assert holds.answer("n", 1, second, True) is None  # …unless a notice woke it
    assert holds.answer("n", 3, second, False) is None  # semaphores take no turns
    holds.asks("n", 1)
    assert holds.answer("n", 1, first, False) is PACED  # an attempt in flight: wait for it…
    # …unless a notice woke it: the attempt in flight may have been answered before that
    # release, and where a release wakes one process (Redis) nobody else would try
    assert holds.answer("n", 1, first, True) is None
    holds.asks("n", -1)
    holds.leave("n", first)
    assert holds.answer("n", 1, second, False) is None
    holds.leave("n", second)
    assert not holds.queue and not holds.asking


def test_the_wait_counts_from_the_first_attempt_not_its_answer() -> None:
    # A first attempt that took 0.8 s (a store slowed by a fault) leaves 0.2 s of a 1 s wait:
    # the call ends by its wait plus the last attempt, not by the first attempt + the wait
    # (the chaos run found ZooKeeper acquires of 4.0-4.4 s against wait 1 s + timeout 2 s).
    clock = FakeClock()
    store = FakeStore(clock, lambda: Busy(1, None, 5.0))
    attempts = Attempts(ARGS, clock, 0.0)  # the first attempt was sent at 0...
    clock.now = 0.8  # ...and answered at 0.8
    steps = wait_for(
        attempts, Busy(1, None, 5.0), wait=1.0, limit=1, push=False, blocking=False,
        rng=random.Random(0),
    )  # fmt: skip
    result = drive(steps, store)
    assert isinstance(result, Busy)
    assert clock.now <= 1.0 + 1e-9, f"waited until {clock.now:.3f}, past the 1 s wait"
    assert sum(store.slept) <= 0.2 + 1e-9


def test_no_attempt_after_joining_the_line_took_the_rest_of_the_wait() -> None:
    # Joining the line (a store call) answered after the wait's end: another attempt then
    # could take a whole timeout more (a store slowed by a fault). The wait ends busy.
    clock = FakeClock()
    log: list[float] = []
    waiter = FakeWaiter(clock, log)

    class SlowLine(FakeStore):
        def wait_in_line(self, *args: Any) -> FakeWaiter | None:
            clock.now = 1.3  # answered 0.3 s after the 1 s wait ended
            return super().wait_in_line(*args)

    store = SlowLine(clock, lambda: Grant(1, None), waiter)
    first = Busy(1, None, 5.0)
    steps = wait_for(
        Attempts(ARGS, clock, 0.0), first, wait=1.0, limit=1, push=True, blocking=False,
        rng=random.Random(0),
    )  # fmt: skip
    assert drive(steps, store) is first
    assert store.calls == ["wait_in_line"]  # no attempt after it
    assert waiter.outcome is first and waiter.closed  # the waiter told, and closed
