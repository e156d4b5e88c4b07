"""Waiters woken by an event never lose a wake-up, and a queued PostgreSQL waiter never loses
a lease handed to it (tests/multiprocess' counter under lock, asyncio, lost increments and
30 s stalls before: a hand-over's notice set the event while ``wait_for`` timed out, the
wait cleared it, and the lease sat untaken until it expired — then a later wake-up returned
it, long after others had taken the name).

No server: the waiters' own logic, driven by hand (the end-to-end proof is the multiprocess
counter test, run on every store in both modes)."""

from __future__ import annotations

import asyncio
import threading
from datetime import datetime, timedelta, timezone
from typing import Any

from latchkey._types import Grant
from latchkey.stores.base import EventWaiter
from latchkey.stores.io.psycopg import HandoffWaiter
from latchkey.stores.io.psycopg_async import AsyncHandoffWaiter


class _Listener:  # what a waiter asks of its listener here: nothing
    def unsubscribe(self, waiter: Any) -> None:
        pass


def _grant() -> Grant:
    return Grant(token=7, expires_at=datetime.now(timezone.utc) + timedelta(seconds=30))


class _SetAfterTimeout(threading.Event):
    """A notice that lands just after a wait timed out, before the waiter reads on."""

    def wait(self, timeout: float | None = None) -> bool:
        woke = super().wait(timeout)
        if not woke:
            self.set()
        return woke


def test_a_notice_just_after_a_timed_out_wait_wakes_the_next_wait() -> None:
    waiter = EventWaiter(_SetAfterTimeout())
    assert waiter.wait(0.0) is False  # timed out; the notice came right after
    assert waiter.wait(0.0) is True  # kept, not cleared: the next wait returns at once
    assert waiter.event.is_set() is False  # and that one consumed it


def test_an_async_hand_over_is_seen_whatever_the_event_says() -> None:
    async def main() -> None:
        waiter = AsyncHandoffWaiter(_Listener(), "k", 1)  # type: ignore[arg-type]
        waiter.grant = _grant()  # delivered; its event's set lost to a timed-out wait
        assert await waiter.wait(0.0) is True
        assert (await waiter.take_grant()) is not None and waiter.handed_over

    asyncio.run(main())


def test_an_async_notice_during_a_short_wait_is_never_cleared_unseen() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        for _ in range(200):  # the timer and the notice in one turn of the loop, often
            waiter = AsyncHandoffWaiter(_Listener(), "k", 1)  # type: ignore[arg-type]
            loop.call_later(0.001, waiter.deliver, _grant())
            woke = await waiter.wait(0.001)
            if not woke:  # timed out first: the grant must still be found by the next wait
                assert await waiter.wait(1.0) is True
            assert await waiter.take_grant() is not None

    asyncio.run(main())


def test_a_sync_hand_over_is_seen_whatever_the_event_says() -> None:
    waiter = HandoffWaiter(_Listener(), "k", 1)  # type: ignore[arg-type]
    waiter.grant = _grant()  # delivered; its event's set lost to a concurrent clear
    assert waiter.wait(0.0) is True
    assert waiter.take_grant() is not None and waiter.handed_over


def test_the_line_and_watch_waiters_keep_a_notice_that_came_as_they_timed_out() -> None:
    """The same rule in each sync waiter that clears its event (process lines, ZooKeeper)."""
    from latchkey.stores.io.kazoo import LineWaiter as ZooKeeperWaiter
    from latchkey.stores.io.lines import Lines, LineWaiter

    for waiter in (LineWaiter(Lines(), "n"), ZooKeeperWaiter(None, "n", "o")):  # type: ignore[arg-type]
        waiter.event = _SetAfterTimeout()
        assert waiter.wait(0.0) is False
        assert waiter.wait(0.0) is True, type(waiter)


def test_the_asyncio_line_waiters_never_clear_a_notice_unseen() -> None:
    from latchkey.stores.io.kazoo_async import AsyncLineWaiter as ZooKeeperWaiter
    from latchkey.stores.io.lines import AsyncLines
    from latchkey.stores.io.lines import AsyncLineWaiter as LineWaiter

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for make in (lambda: LineWaiter(AsyncLines(), "n"),
                     lambda: ZooKeeperWaiter(None, "n", "o")):  # type: ignore[arg-type]  # fmt: skip
            for _ in range(200):  # the timer and the notice in one turn of the loop, often
                waiter = make()
                loop.call_later(0.001, waiter.event.set)
                if not await waiter.wait(0.001):  # timed out first: kept for the next wait
                    assert await waiter.wait(1.0) is True

    asyncio.run(main())
