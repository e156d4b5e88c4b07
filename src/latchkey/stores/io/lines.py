"""Lines: the waiters of one process for a name, on a store that has no push of its own
(``mysql://``, ``memcached://``, ``mongodb://``).

Without them every blocked acquire polls the store on its own, every 250 ms at most: 2,500
waiters in five processes are 10,000 store calls a second, most of them by waiters that could
not have won anyway, since others of their process asked first. With them, a blocked acquire
of such a store joins its name's line in its backend (:meth:`Lines.join`); the waiter's
:attr:`~latchkey.stores.base.Waiter.ahead` is its place, so the core polls the store the
less often the further back it is (``_core/waiting.py``), and a release through the same
backend rings the first waiter not yet rung (:meth:`Lines.ring`), which tries at once. One,
not all: the others would only lose the race to it. A waiter that was rung and leaves without
the lease passes the ring on.

It is only a wake-up, as the doorbells and pub/sub are: correctness never depends on it. A
release in another process is found by the first waiter's own polls; a holder's expiry by the
busy answer's bound on every sleep.

The sync twin is guarded by a lock (threads); the asyncio twin lives in one event loop. A
forked child starts with empty lines: the parent's waiters are not its own.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterable
from typing import Any

from latchkey._types import Busy, Grant
from latchkey.stores.base import AsyncWaiter, Waiter, woken
from latchkey.stores.io.aio import awoken

#: ``ahead`` counts at most this many waiters (the core's poll stops growing well before).
AHEAD_COUNTED = 64


def place_in_line(line: Iterable[object], mine: object) -> int:
    """How many of ``line`` (one name's waiters in this process, in the order they came) come
    before ``mine``, up to :data:`AHEAD_COUNTED`; 0 if it is not there. Also the Redis
    listeners' (:mod:`latchkey.stores.io.redis`): whoever keeps a line in arrival order."""
    for i, other in enumerate(line):
        if other is mine or i >= AHEAD_COUNTED:
            return i
    return 0


class Lines:
    """One backend's lines, sync (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.names: dict[str, dict[LineWaiter, None]] = {}
        self.pid = os.getpid()

    def join(self, name: str) -> LineWaiter:
        waiter = LineWaiter(self, name)
        with self.lock:
            if self.pid != os.getpid():  # forked: the parent's waiters are not ours
                self.names, self.pid = {}, os.getpid()
            self.names.setdefault(name, {})[waiter] = None
        return waiter

    def ring(self, name: str) -> None:
        """A release of ``name`` went through this backend: wake its first waiter."""
        with self.lock:
            _ring_first(self.names.get(name, {}))

    def first_heir(self, name: str) -> Any:
        """The ``heir`` of ``name``'s first waiter (None: none, or no one waits)."""
        with self.lock:
            return next((waiter.heir for waiter in self.names.get(name, ())), None)

    def leave(self, waiter: LineWaiter, pass_on: bool) -> None:
        with self.lock:
            _leave(self.names, waiter, pass_on)


def _leave(names: Any, waiter: Any, pass_on: bool) -> None:
    """``waiter`` leaves its line; ``pass_on``: it was rung and did not get the lease, so the
    next is rung in its place. An empty line is dropped."""
    line = names.get(waiter.name)
    if line is None:
        return
    line.pop(waiter, None)
    if pass_on:
        _ring_first(line)
    if not line:
        del names[waiter.name]


def _ring_first(line: dict[LineWaiter, None] | dict[AsyncLineWaiter, None]) -> None:
    for waiter in line:
        if not waiter.event.is_set():
            waiter.rung = True
            waiter.event.set()
            return


class LineWaiter(Waiter):
    """One blocked acquire in its name's line."""

    def __init__(self, lines: Lines, name: str) -> None:
        self.lines, self.name = lines, name
        self.event = threading.Event()
        self.rung = False  # rung at least once
        self.granted = False
        self.heir: Any = None  # what a store may hand this waiter's lease to (MariaDB's bells)

    def wait(self, timeout: float) -> bool:
        return woken(self.event, timeout)

    @property
    def ahead(self) -> int:
        with self.lines.lock:
            return place_in_line(self.lines.names.get(self.name, {}), self)

    def finish(self, result: Grant | Busy) -> None:
        self.granted = type(result) is Grant

    def close(self) -> None:
        self.lines.leave(self, self.rung and not self.granted)


class AsyncLines:
    """One asyncio backend's lines (see the module docstring)."""

    def __init__(self) -> None:
        self.names: dict[str, dict[AsyncLineWaiter, None]] = {}

    def join(self, name: str) -> AsyncLineWaiter:
        waiter = AsyncLineWaiter(self, name)
        self.names.setdefault(name, {})[waiter] = None
        return waiter

    def ring(self, name: str) -> None:
        _ring_first(self.names.get(name, {}))

    def first_heir(self, name: str) -> Any:
        return next((waiter.heir for waiter in self.names.get(name, ())), None)

    def leave(self, waiter: AsyncLineWaiter, pass_on: bool) -> None:
        _leave(self.names, waiter, pass_on)


class AsyncLineWaiter(AsyncWaiter):
    """The asyncio twin of :class:`LineWaiter`."""

    def __init__(self, lines: AsyncLines, name: str) -> None:
        self.lines, self.name = lines, name
        self.event = asyncio.Event()
        self.rung = False
        self.granted = False
        self.heir: Any = None

    async def wait(self, timeout: float) -> bool:
        return await awoken(self.event, timeout)

    @property
    def ahead(self) -> int:
        return place_in_line(self.lines.names.get(self.name, {}), self)

    async def finish(self, result: Grant | Busy) -> None:
        self.granted = type(result) is Grant

    async def close(self) -> None:
        self.lines.leave(self, self.rung and not self.granted)
