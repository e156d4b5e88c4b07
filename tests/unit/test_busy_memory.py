"""BusyMemory: which names an attempt found busy lately (the contention hint of the session
locks and SQLite), with a fake clock."""

from __future__ import annotations

import pytest

from latchkey.stores import primitives
from latchkey.stores.primitives import BusyMemory


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(primitives.time, "monotonic", lambda: now[0])
    return now


def test_a_name_found_busy_is_recent_for_its_seconds_then_forgotten(clock: list[float]) -> None:
    memory = BusyMemory(seconds=1.0)
    assert not memory.recent("n")
    memory.mark("n")
    clock[0] += 0.999
    assert memory.recent("n") and not memory.recent("other")
    clock[0] += 0.002
    assert not memory.recent("n")


def test_it_keeps_at_most_its_size_dropping_the_stale_then_the_oldest(clock: list[float]) -> None:
    memory = BusyMemory(seconds=1.0, size=3)
    for name in ("a", "b"):
        memory.mark(name)
    clock[0] += 2.0  # a and b are stale
    for name in ("c", "d", "e"):
        memory.mark(name)
    assert len(memory.until) == 3 and {"c", "d", "e"} == set(memory.until)
    memory.mark("f")  # all fresh: the oldest (c) goes
    assert set(memory.until) == {"d", "e", "f"}
    assert all(memory.recent(name) for name in ("d", "e", "f"))
