"""The asyncio deadlines every async driver call runs under (stores/io/deadlines.py): one timer
per loop, yet each call ends at its own deadline, a caller's own cancellation passes through,
and nothing is left behind."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import pytest

if sys.version_info < (3, 11):  # pragma: no cover
    pytest.skip("deadlines need Task.uncancel (Python 3.11+)", allow_module_level=True)

from latchkey.stores.io.aio import bounded
from latchkey.stores.io.deadlines import keeper


def test_a_call_that_returns_in_time_returns_its_value_and_leaves_nothing() -> None:
    async def main() -> tuple[int, int]:
        async def answer() -> int:
            await asyncio.sleep(0)
            return 7

        value = await bounded(answer(), 5)
        return value, len(keeper(asyncio.get_running_loop()).calls)

    assert asyncio.run(main()) == (7, 0)


def test_a_call_past_its_deadline_is_a_timeout_at_that_deadline() -> None:
    async def main() -> float:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await bounded(asyncio.sleep(10), 0.2)
        return time.monotonic() - started

    took = asyncio.run(main())
    assert 0.19 <= took < 1.0


def test_each_of_many_calls_ends_at_its_own_deadline() -> None:
    """One timer for the earliest deadline, re-armed for the next: a later call is not cut
    short by an earlier one's expiry, nor kept past its own."""

    async def one(seconds: float) -> float:
        started = time.monotonic()
        try:
            await bounded(asyncio.sleep(10), seconds)
        except TimeoutError:
            return time.monotonic() - started
        raise AssertionError("not timed out")

    async def main() -> list[float]:
        # The longest first: its deadline arms the timer, the shorter ones re-arm it earlier.
        return await asyncio.gather(*(one(s) for s in (0.6, 0.4, 0.2, 0.05)))

    took = asyncio.run(main())
    for seconds, actual in zip((0.6, 0.4, 0.2, 0.05), took, strict=True):
        assert seconds - 0.01 <= actual < seconds + 0.5, (seconds, actual)


def test_a_call_that_finishes_is_not_cancelled_by_a_timer_armed_for_it() -> None:
    """The timer armed for a finished call's deadline fires later with that call gone: the
    task, busy with a later call, is not touched until that call's own deadline."""

    async def main() -> str:
        await bounded(asyncio.sleep(0), 0.1)  # arms the timer for +0.1 s, then leaves
        await asyncio.sleep(0.15)  # the timer fires with nothing due
        started = time.monotonic()
        await bounded(asyncio.sleep(0.3), 1.0)  # spans the old deadline's neighbourhood
        return f"{time.monotonic() - started:.2f}"

    assert float(asyncio.run(main())) >= 0.29


def test_the_callers_own_cancellation_passes_through_as_cancellation() -> None:
    async def main() -> None:
        task = asyncio.create_task(bounded(asyncio.sleep(10), 5))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not keeper(asyncio.get_running_loop()).calls

    asyncio.run(main())


def test_a_timeout_leaves_the_task_uncancelled_for_what_it_does_next() -> None:
    async def main() -> int:
        with pytest.raises(TimeoutError):
            await bounded(asyncio.sleep(10), 0.05)
        task = asyncio.current_task()
        assert task is not None
        await asyncio.sleep(0.01)  # would raise CancelledError if a cancel were pending
        return task.cancelling()

    assert asyncio.run(main()) == 0


def test_nested_calls_each_keep_their_own_deadline() -> None:
    async def inner() -> str:
        with pytest.raises(TimeoutError):
            await bounded(asyncio.sleep(10), 0.05)
        return "inner timed out, outer still running"

    async def main() -> str:
        return await bounded(inner(), 5)

    assert asyncio.run(main()) == "inner timed out, outer still running"


def test_a_call_that_swallows_its_expiry_and_returns_leaves_no_cancel_pending() -> None:
    """Like ``to_the_end``: a request that must finish catches the cancellation, finishes,
    and returns; the expiry must not stay counted against the task."""

    async def finishes_anyway() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0)  # not cancelled again: the expiry was delivered once
        return "finished"

    async def main() -> tuple[str, int]:
        value = await bounded(finishes_anyway(), 0.05)
        task = asyncio.current_task()
        assert task is not None
        return value, task.cancelling()

    assert asyncio.run(main()) == ("finished", 0)


def test_the_block_form_bounds_what_it_awaits() -> None:
    from latchkey.stores.io.deadlines import Deadline

    async def main() -> str:
        with pytest.raises(TimeoutError):
            async with Deadline(0.05):
                await asyncio.sleep(10)
        with Deadline(5):
            await asyncio.sleep(0)
        return "ok"

    assert asyncio.run(main()) == "ok"


def test_the_timeout_error_says_how_long_it_waited() -> None:
    """The driver's error becomes StoreUnavailable's text: "TimeoutError" alone says nothing."""

    async def main() -> str:
        try:
            await bounded(asyncio.sleep(10), 0.05)
        except TimeoutError as exc:
            return str(exc)
        return "not timed out"

    assert asyncio.run(main()) == "no answer within 0.05s"


# -- the session-lock driver's hold (AsyncSessionDriver.held): a statement on a shared session
# is never cut by its caller's cancellation (held back until it ends), only by its deadline.


class _Driver:
    """What held() reads and writes of its driver."""

    def __init__(self) -> None:
        from latchkey.stores.io.sessions_async import AsyncSessionDriver

        self.held = AsyncSessionDriver.held.__get__(self)
        self.deferred = False
        self._hold = None


def _statement(answer: asyncio.Future[str], log: list[str]) -> Any:
    async def statement() -> str:
        try:
            return await answer
        except asyncio.CancelledError:
            log.append("cut")
            raise

    return statement()


def test_a_held_statement_outlives_its_callers_cancellation() -> None:
    async def main() -> tuple[str, bool, list[str], int]:
        loop, driver, log = asyncio.get_running_loop(), _Driver(), []
        answer: asyncio.Future[str] = loop.create_future()
        task = asyncio.ensure_future(driver.held(_statement(answer, log), 5))
        await asyncio.sleep(0.01)
        task.cancel()  # refused: the statement goes on
        await asyncio.sleep(0.01)
        assert not task.done()
        answer.set_result("granted")
        value = await task
        return value, driver.deferred, log, len(keeper(loop).calls)

    assert asyncio.run(main()) == ("granted", True, [], 0)


def test_a_held_statement_past_its_deadline_is_cut_and_a_timeout() -> None:
    async def main() -> tuple[float, list[str], int, bool]:
        loop, driver, log = asyncio.get_running_loop(), _Driver(), []
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await driver.held(_statement(loop.create_future(), log), 0.2)
        took = time.monotonic() - started
        task = asyncio.current_task()
        assert task is not None
        return took, log, len(keeper(loop).calls), task.cancelling() == 0

    took, log, left, uncancelled = asyncio.run(main())
    assert 0.19 <= took < 1.0
    assert (log, left, uncancelled) == (["cut"], 0, True)


def test_a_held_statement_cut_by_its_deadline_after_a_cancel_is_a_cancellation() -> None:
    """The caller cancelled, then the deadline cut the statement: the caller's cancellation
    (not a TimeoutError) comes out, at the deadline."""

    async def main() -> tuple[float, list[str]]:
        loop, driver, log = asyncio.get_running_loop(), _Driver(), []
        started = time.monotonic()
        task = asyncio.ensure_future(driver.held(_statement(loop.create_future(), log), 0.2))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - started, log

    took, log = asyncio.run(main())
    assert 0.19 <= took < 1.0
    assert log == ["cut"]
