"""Deadlines for asyncio calls, one timer per event loop: what
:func:`latchkey.stores.io.aio.bounded` runs on (Python 3.11+: ``Task.uncancel``; 3.10 keeps
``asyncio.wait_for``).

``asyncio.timeout`` arms a timer for every call it bounds (a ``TimerHandle`` pushed on the
loop's heap, cancelled when the call returns) and wraps the call in a context manager object:
~10 µs a call on the development VM, a fifth of an asyncio memcached acquire + release
(``bench/asyncrows.py``). Every call latchkey bounds ends long before its deadline, so a timer
per call is work thrown away. Here a call only registers ``(task, deadline)`` (a
:class:`Deadline`) in its loop's :class:`Keeper` and removes it when it returns; the keeper
keeps *one* timer, armed for the earliest deadline it holds, and when it fires it cancels every
task whose deadline has come, then re-arms for the next. A call that ends before the timer fires
costs a dict insert and a pop; the timer fires about once per timeout while calls keep coming.

On expiry the task is cancelled as ``asyncio.timeout`` cancels it, and :func:`bounded` turns
that cancellation into ``TimeoutError`` unless the task was also cancelled by someone else
(``Task.uncancel`` counts: a caller's own cancellation passes through untouched).

A keeper's entries are anything with a ``deadline`` and an ``expire()`` (:class:`Due`): a
:class:`Deadline` cancels its task; the session-lock driver's hold
(:mod:`latchkey.stores.io.sessions_async`) cancels the statement's future instead.
"""

from __future__ import annotations

import asyncio
import math
import time
import weakref
from collections.abc import Awaitable
from types import TracebackType
from typing import Protocol, TypeVar

T = TypeVar("T")
D = TypeVar("D", bound="Deadline")

#: A timer may fire this much before its time (the loop runs timers due within its clock's
#: resolution): a deadline this close counts as come.
_EARLY = time.get_clock_info("monotonic").resolution


class Due(Protocol):
    """What a keeper holds: a deadline (loop time) and what to do when it comes."""

    deadline: float

    def expire(self) -> None: ...


class Keeper:
    """The bounded calls in progress on one event loop, and the one timer for the earliest."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.calls: dict[Due, None] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.at = math.inf  # when the timer fires (inf: not armed)

    def add(self, call: Due) -> None:
        self.calls[call] = None
        if call.deadline < self.at:
            self.arm(call.deadline)

    def arm(self, at: float) -> None:
        """Fire at ``at`` (earlier than :attr:`at`)."""
        if self.timer is not None:
            self.timer.cancel()
        self.at = at
        self.timer = self.loop.call_at(at, self._fire)

    def _fire(self) -> None:
        self.timer, self.at = None, math.inf
        now = self.loop.time() + _EARLY
        earliest = math.inf
        for call in list(self.calls):
            if call.deadline <= now:
                del self.calls[call]
                call.expire()
            elif call.deadline < earliest:
                earliest = call.deadline
        if earliest < math.inf:
            self.arm(earliest)


_keepers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Keeper] = (
    weakref.WeakKeyDictionary()
)
_last: tuple[asyncio.AbstractEventLoop | None, Keeper | None] = (None, None)


def keeper(loop: asyncio.AbstractEventLoop) -> Keeper:
    """The keeper of ``loop`` (made on first use; it goes with the loop)."""
    global _last
    last_loop, last_keeper = _last
    if last_loop is loop and last_keeper is not None:
        return last_keeper
    found = _keepers.get(loop)
    if found is None:
        found = _keepers[loop] = Keeper(loop)
    _last = (loop, found)
    return found


class Deadline:
    """``with Deadline(seconds):`` in a coroutine: what ``asyncio.timeout`` does (the task
    cancelled at the deadline, ``TimeoutError`` out of the block), with the keeper's one timer
    per loop. A plain ``with``: cancellation reaches a coroutine only where it awaits."""

    __slots__ = ("cancelling", "deadline", "expired", "keeper", "seconds", "start", "task")

    def __init__(self, seconds: float, start: float | None = None) -> None:
        self.seconds = seconds
        self.start = start  # loop time the ``seconds`` count from (None: on entering)
        self.expired = False  # the keeper cancelled the task for it (not yet uncancelled)

    def expire(self) -> None:
        """The deadline came (the keeper took this entry out): cancel the task."""
        self.expired = True
        self.task.cancel()

    def __enter__(self: D) -> D:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:  # pragma: no cover - a coroutine always runs in a task here
            raise RuntimeError("Deadline needs a task")
        self.task = task
        self.deadline = (loop.time() if self.start is None else self.start) + self.seconds
        self.cancelling = task.cancelling()  # type: ignore[attr-defined,unused-ignore]
        self.keeper = keeper(loop)
        self.keeper.add(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.keeper.calls.pop(self, None)
        if self.expired:
            self.expired = False
            # As asyncio.timeout: the expiry's cancel is taken back whatever happened (a body
            # that swallowed it and returned leaves no cancel pending); it becomes TimeoutError
            # unless someone else cancelled the task too.
            uncancelled = self.task.uncancel()  # type: ignore[attr-defined,unused-ignore]
            if uncancelled <= self.cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError(f"no answer within {self.seconds:g}s") from exc

    async def __aenter__(self) -> Deadline:  # ``async with``, as asyncio.timeout is used
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)


async def bounded(aw: Awaitable[T], seconds: float, start: float | None = None) -> T:
    """Await ``aw`` for at most ``seconds`` (counted from the loop time ``start`` if given:
    a call whose first part ran before); ``TimeoutError`` after that (``aw`` cancelled)."""
    with Deadline(seconds, start):
        return await aw
