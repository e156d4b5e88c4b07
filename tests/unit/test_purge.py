"""The purge rule with a fake clock: bounded batches sized to a time step, rests between them.

``StoreCore._purge`` asks the store for at most ``limit`` expired leases at a time; here a fake
store whose batches cost a fixed time per row answers it, and a fake clock moves on each
batch and each rest, the way a real store and the runners would.
"""

from __future__ import annotations

from typing import Any

import pytest

from latchkey._core import store as core_store
from latchkey._core.ops import CALL, SLEEP
from latchkey._core.store import PURGE_MAX, PURGE_MIN, PURGE_REST, PURGE_STEP, StoreCore


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class Backlog:
    """``expired`` rows; deleting one costs ``per_row`` seconds of the fake clock."""

    def __init__(self, clock: Clock, expired: int, per_row: float) -> None:
        self.clock, self.expired, self.per_row = clock, expired, per_row
        self.limits: list[int] = []

    def purge_expired(self, limit: int) -> int:
        self.limits.append(limit)
        count = min(limit, self.expired)
        self.expired -= count
        self.clock.now += count * self.per_row
        return count


def drive(backlog: Backlog, clock: Clock) -> tuple[int, list[float]]:
    """Answer the purge's operations; return its result and the rests it asked for."""
    steps, rests = StoreCore._purge(object()), list[float]()  # type: ignore[arg-type]
    answer: Any = None
    try:
        while True:
            kind, _target, method, args = steps.send(answer)
            if kind == CALL:
                assert method == "purge_expired"
                answer = backlog.purge_expired(*args)
            else:
                assert kind == SLEEP
                rests.append(args[0])
                clock.now += args[0]
                answer = None
    except StopIteration as stop:
        return int(stop.value), rests


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(core_store.time, "monotonic", fake)
    return fake


def test_a_backlog_is_cleared_in_batches_that_each_take_about_one_step(clock: Clock) -> None:
    backlog = Backlog(clock, expired=2_000_000, per_row=20e-6)  # 20 µs a row: 500 rows = 10 ms
    total, rests = drive(backlog, clock)
    assert total == 2_000_000 and backlog.expired == 0
    for limit in backlog.limits[:-1]:  # every full batch took at most twice the step
        assert limit * backlog.per_row <= 2 * PURGE_STEP
    assert len(rests) == len(backlog.limits) - 1  # a rest after every full batch, none after
    # each rest as long as the batch before it (or PURGE_REST): others get the store at least
    # half the time
    for limit, rest in zip(backlog.limits[:-1], rests, strict=True):
        assert rest >= max(PURGE_REST, limit * backlog.per_row) - 1e-12


def test_batches_grow_when_rows_are_cheap_and_shrink_when_they_are_dear(clock: Clock) -> None:
    cheap = Backlog(clock, expired=1_000_000, per_row=0.1e-6)
    drive(cheap, clock)
    assert max(cheap.limits) == PURGE_MAX
    dear = Backlog(clock, expired=5_000, per_row=1e-3)  # 1 ms a row: a slow, loaded server
    drive(dear, clock)
    assert dear.limits[-1] == PURGE_MIN


def test_a_short_batch_ends_the_purge_without_a_rest(clock: Clock) -> None:
    backlog = Backlog(clock, expired=120, per_row=20e-6)
    assert drive(backlog, clock) == (120, [])
    assert backlog.limits == [core_store.PURGE_BATCH]
    assert drive(Backlog(clock, expired=0, per_row=0), clock) == (0, [])
