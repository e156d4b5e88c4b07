"""MariaDB's bells, the I/O side: one connection per backend that sleeps in the server while
this process waits for a name, and wakes the process's waiters when a release KILLs its
sleep (the statements, and why no wake-up is lost: :mod:`latchkey.stores.mysql_bells`).

- :class:`Bell` (sync) is started by the first waiter (``MySQLBackend.wait_in_line``): a
  connection opened as any of the pool's (the same host, settings and deadline) and a daemon
  thread that runs ``SELECT SLEEP(n)`` on it for as long as some waiter of the backend is in
  a line (:mod:`latchkey.stores.io.lines`), and idles otherwise. A sleep ended by ``KILL
  QUERY`` (error 1317) rings the first waiter of every name of the backend's lines: the
  server does not say which name, and a process waits for few. A sleep that runs out
  (``NAP``) is simply sent again. :class:`AsyncBell` is the twin, a task in the loop.
- A waiter (:class:`BellWaiter`) is a line's waiter whose process's bell is in the name's
  line in the server. A ring takes the bell out of that line, so before a woken waiter
  sleeps again its bell goes back in (at the end: another process's turn has come) and the
  waiter tries once more (its ``wait`` answers True at once), as after the first time.
- The last waiter of a name in this process takes the bell out of the name's line; one that
  was rung and leaves without the lease rings the next process if the name is free.
- The bell names its *heir* in the server's line (``Bells.bell_in``): the owner, JSON and TTL
  of the process's first waiter of the name (:meth:`Lines.first_heir`; a mutex waiter's
  ``heir``, set at join), to whom a release hands the lease. When that waiter leaves, the
  bell names the next one; one that leaves without the lease gives back what it may have
  been handed meanwhile (:meth:`BellState.giving_back`). An asyncio waiter's cancel is a
  finished wait here (its bell leaves the line at once), a store error is not. Bells leave
  lines only under the turn, as they join them: a bell taken out after a waiter that came
  since put it back in would leave the store believing it names an heir it no longer names.
- If the bell's connection fails, every waiter is woken once, tries, and from then on polls
  (the core's backoff); the next wait starts a new bell. What is handed to whom is decided
  in the server, by the store's statements (:mod:`latchkey.stores.mysql_bells`).

Why by hand: no driver offers server push for MySQL or MariaDB (neither server has one); the
only cross-session wake-up either has is ending another session's statement.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from latchkey._types import Busy, Grant
from latchkey.errors import StoreUnavailable
from latchkey.stores.base import AsyncWaiter, Waiter
from latchkey.stores.io import Steps, after_fork, drive
from latchkey.stores.io.aio import adrive
from latchkey.stores.io.lines import AsyncLines, AsyncLineWaiter, Lines, LineWaiter
from latchkey.stores.io.mysql_session import INTERRUPTED

log = logging.getLogger("latchkey.mysql")

#: How long one sleep of a bell lasts at most (seconds); then it is sent again.
NAP = 30.0
SLEEP = "SELECT SLEEP(%s)"
WHO = "SELECT CONNECTION_ID()"


def interrupted(exc: BaseException) -> bool:
    """Whether a driver error is a sleep ended by ``KILL QUERY``: the bell was rung."""
    return bool(getattr(exc, "args", None)) and exc.args[0] == INTERRUPTED


class BellState:
    """What the sync and the asyncio bell share: which lines the bell is in, which rings may
    have taken it out of them, and the decisions on them (no I/O; the store's steps are run
    by the subclass, under its turn)."""

    lines: Any  # the backend's Lines or AsyncLines
    waiting: Any  # set: the bell has something to listen for (sync or asyncio Event)

    def __init__(self, driver: Any, opener: Callable[[], Any]) -> None:
        self.driver = driver
        self.store = driver.store
        self.opener = opener  # opens a connection as the pool's
        self.pooled: Any = None
        self.id = 0  # the bell's connection id (the store rings its own without a KILL)
        self.epoch = 0  # rings of unknown name (KILLs) so far
        self.rung: dict[str, int] = {}  # rings of a known name (this process's own releases)
        self.registered: dict[str, tuple[int, int]] = {}  # name -> rings when its bell went in
        self.skipped: set[str] = set()  # names left without a round trip (see leaving)

    def rings(self, name: str) -> tuple[int, int]:
        """The rings so far that may have taken the bell out of ``name``'s line."""
        return self.epoch, self.rung.get(name, 0)

    def wake(self, name: str | None) -> None:
        """A ring: the first waiter of ``name`` (None: of every name) tries now."""
        self.ring(name)

    def taken(self, name: str) -> None:
        """This process's release took the bell out of ``name``'s line (and rings the line)."""
        self.ring(name, wake=False)

    def ring(self, name: str | None, wake: bool = True) -> None:
        """The bell goes back in the lines it may have been taken out of before a waiter
        sleeps again, and (``wake``) the first waiter of ``name`` (None: of every name) tries
        now."""
        if name is None:
            self.epoch += 1
        else:
            self.rung[name] = self.rung.get(name, 0) + 1
        if wake:
            for each in list(self.lines.names) if name is None else [name]:
                self.lines.ring(each)

    def registering(self, name: str) -> Steps[None]:
        """Under the turn: the bell in ``name``'s line (it keeps its place if there; not sent
        if a waiter of ours put it in since the last ring, naming the same heir), naming the
        heir of the process's first waiter of the name, the live lease marked; remembered
        only if no ring came meanwhile."""
        rings = self.rings(name)
        heir = self.lines.first_heir(name)
        yield from self.store.bell_in(name, self.id, self.unregistered(name, heir), heir)
        self.skipped.discard(name)
        if self.rings(name) == rings:
            self.registered[name] = rings

    def unregistered(self, name: str, heir: Any) -> bool:
        """Whether the bell may be out of ``name``'s line (a ring came since it went in), or
        names another heir than ``heir`` there."""
        named = self.store.heirs.get(name)
        return self.registered.get(name) != self.rings(name) or named != (heir and heir[0])

    def leaving(
        self, line: LineWaiter | AsyncLineWaiter, finished: bool = True
    ) -> Steps[None] | None:
        """Under the turn, ``line`` having left its line: the store's steps that take the
        bell out of the name's line, or None when there is nothing to do — other waiters of
        the process still wait, or the bell is not in line, or the waiter got the lease after
        a ring, which took the bell out already (if that ring was for another name, the bell
        tidies up at its next ring: ``tidy``). A wait that ended by an error (not
        ``finished``: the store failing) adds no round trip to it either: the bell is left to
        ``tidy`` too, so the error reaches the caller within its timeout.

        A waiter the bell names as heir that leaves without the lease may have been handed
        it by a release meanwhile: the bell stops naming it (it names the next waiter of the
        process, or leaves the line), then that lease, if any, is released, which passes it
        on (:meth:`giving_back`). After an error that is left to the bell (after its next
        ring or nap) and to the process's next acquire of the name (``Bells.orphans``)."""
        name = line.name
        heir = line.heir
        if heir is not None and not line.granted and self.store.heirs.get(name) == heir[0]:
            if finished:
                return self.giving_back(line)
            self.orphaned(name, heir[0])
        if name in self.lines.names or (went_in := self.registered.pop(name, None)) is None:
            return None
        rung_since = went_in != self.rings(name)
        self.rung.pop(name, None)
        if not finished or (line.granted and rung_since):
            self.skipped.add(name)
            return None
        return self.store.bell_out(name, self.id, line.rung and not line.granted)  # type: ignore[no-any-return]

    def giving_back(self, line: LineWaiter | AsyncLineWaiter) -> Steps[None]:
        """Under the turn: an heir left without the lease (see :meth:`leaving`): the bell
        names the process's next waiter instead, or leaves the line; then the lease it may
        have been handed is given back, and once more after any ring for a while after
        (``Bells.orphans``)."""
        name, owner = line.name, line.heir[0]
        self.orphaned(name, owner)
        if name in self.lines.names:
            yield from self.registering(name)
        else:
            self.registered.pop(name, None)
            self.rung.pop(name, None)
            yield from self.store.bell_out(name, self.id, line.rung)
        if (yield from self.store.give_back(name)):
            self.lines.ring(name)  # passed on, perhaps to a waiter of ours

    def nap(self) -> float:
        """How long the bell's next sleep lasts: NAP, or less while orphans wait for their
        grace to end (``Bells.orphans``: it gives them back once more then)."""
        ends = [until for until in list(self.store.orphans.values()) if until is not None]
        if not ends:
            return NAP
        return float(min(NAP, max(0.05, min(ends) - time.monotonic())))

    def orphaned(self, name: str, owner: str) -> None:
        """An heir left without the lease: the store keeps it as an orphan, and the bell
        listens (it sleeps in the server, so a ring reaches it) until it is given back."""
        self.store.orphan(name, owner)
        if self.waiting is not None:
            self.waiting.set()

    def stale(self) -> list[str]:
        """Under the turn, after a ring: the names left without a round trip that nobody
        here waits for any more (``tidy`` takes the bell out of their lines for sure)."""
        names = [name for name in self.skipped if name not in self.lines.names]
        self.skipped.clear()
        return names


class Bell(BellState):
    """One sync backend's bell (see the module docstring). ``driver`` runs the store's steps
    (``run``); ``opener`` opens a connection as the pool's (``drain``, ``deadline``, ``timeout``,
    ``close``)."""

    def __init__(self, driver: Any, opener: Callable[[], Any]) -> None:
        super().__init__(driver, opener)
        self.lock = threading.Lock()  # starting and stopping
        self.turn = threading.Lock()  # one name's bell in or out of its line at a time
        self.waiting = threading.Event()  # a waiter came: the thread sleeps in the server
        after_fork(self)

    @property
    def lines(self) -> Lines:
        """The backend's lines (made after its driver)."""
        return self.driver.backend.lines  # type: ignore[no-any-return]

    def join(self, name: str, heir: Any = None) -> Waiter:
        """A waiter for ``name``: in the backend's line, and the bell in the server's (a
        plain line, which polls, if the bell cannot start), naming ``heir`` (``heir_of``) if
        it is the process's first waiter of the name."""
        line = self.lines.join(name)
        line.heir = heir
        try:
            self.start()
        except StoreUnavailable as exc:
            log.debug("waiting for %r without a bell: %s", name, exc)
            return line
        except BaseException:
            line.close()
            raise
        waiter = BellWaiter(self, line)
        try:
            self.waiting.set()  # it sleeps in the server while the bell goes in line
            self.register(name)
        except StoreUnavailable as exc:  # it polls; the bell may name it (its close tidies)
            log.debug("waiting for %r, its bell not in line: %s", name, exc)
        except BaseException:
            waiter.close()  # (a wait that did not finish: the bell may name it: an orphan)
            raise
        return waiter

    def start(self) -> None:
        with self.lock:
            if self.pooled is not None:
                return
            with self.driver.backend.translate("start a bell", self.driver.errors):
                pooled = self.opener()
                try:
                    rows, _ = pooled.drain(WHO, None)
                except BaseException:
                    pooled.close()
                    raise
            self.pooled, self.id = pooled, int(rows[0][0])
            self.store.bell = self
            thread = threading.Thread(
                target=self._run, args=(pooled,), name="latchkey-mysql-bell", daemon=True
            )
            thread.start()

    def register(self, name: str) -> None:
        """Put the bell in ``name``'s line (it keeps its place if there) and mark the live
        lease; remembered only if no ring came meanwhile."""
        with self.turn:
            self.driver.run(self.registering(name), "wait")
            self.waiting.set()

    def rejoin(self, name: str) -> bool:
        """Before a woken waiter sleeps again: True if the bell had to go back in line (the
        waiter then tries at once), False if it is still there (or there is no bell)."""
        if self.pooled is None or not self.unregistered(name, self.lines.first_heir(name)):
            return False
        try:
            self.register(name)
        except StoreUnavailable:
            return False  # the next attempt finds out; meanwhile it polls
        return True

    def leave(self, line: LineWaiter, finished: bool = True) -> None:
        """After ``line`` left: if it was this process's last waiter of its name, the bell
        leaves the name's line (and, rung in vain, rings the next): :meth:`BellState.leaving`."""
        with self.turn:
            steps = self.leaving(line, finished)
            if steps is None:
                return
            try:
                self.driver.run(steps, "wait")
            except StoreUnavailable as exc:  # its ring will find nobody waiting: harmless
                log.debug("bell for %r left behind: %s", line.name, exc)

    def _run(self, pooled: Any) -> None:
        pid = os.getpid()
        try:
            while self.pooled is pooled:
                if not self.lines.names and not self.store.orphans:  # idle until a waiter
                    self.waiting.clear()
                    if not self.lines.names and not self.store.orphans:
                        self.waiting.wait(NAP)
                    continue
                nap = self.nap()
                pooled.deadline = time.monotonic() + nap + pooled.timeout
                try:
                    pooled.drain(SLEEP, (nap,))
                    rung = False  # slept it out: nobody rang
                except Exception as exc:
                    if not interrupted(exc):
                        raise
                    rung = True
                if rung:
                    self.wake(None)
                if (rung and self.skipped) or self.store.orphans:
                    self.tidy(pooled)
        except Exception as exc:  # the connection failed: every waiter tries, then polls
            log.debug("bell lost: %s", exc)
        finally:
            if os.getpid() == pid:
                self._lost(pooled)

    def tidy(self, pooled: Any) -> None:
        """After a ring or a nap, on the bell's connection: the names left without a round
        trip that nobody here waits for any more leave their lines for sure, and if one of
        them was just rung (for nobody), the next is rung in its place. Then, on a pooled
        connection (a release in a transaction must not run where a ring's KILL can end it
        half way, its row locks held), the orphans' leases are given back
        (``Bells.give_back``). The names leave under the turn: a waiter of the name that
        came since must not put the bell back in (naming its heir) before this takes it out."""
        with self.turn:
            for name in self.stale():
                pooled.deadline = time.monotonic() + pooled.timeout
                drive(self.store.bell_out(name, self.id, True), pooled.answer)
        # on a pooled connection: a ring may KILL this one's statement
        if self.store.orphans and self.driver.run(self.store.give_back(), "wait"):
            for name in list(self.lines.names):  # passed on, perhaps to a waiter of ours
                self.lines.ring(name)

    def _lost(self, pooled: Any) -> None:
        with self.lock:
            if self.pooled is pooled:
                self.pooled = None
                self.store.bell = None
                self.registered.clear()
        pooled.close()
        self.wake(None)

    def close(self) -> None:
        """Stop the bell: its thread ends when its connection is closed under it."""
        with self.lock:
            pooled, self.pooled = self.pooled, None
            self.store.bell = None
        self.waiting.set()
        if pooled is not None:
            with contextlib.suppress(OSError):
                pooled.sock.shutdown(2)  # SHUT_RDWR: the sleeping read ends now

    def forget_after_fork(self) -> None:
        """In a forked child: the thread and the connection are the parent's."""
        self.lock, self.turn = threading.Lock(), threading.Lock()
        self.pooled, self.id, self.registered = None, 0, {}
        self.waiting = threading.Event()
        self.store.bell = None


class BellWaiter(Waiter):
    """A waiter of a line whose process's bell waits in the server's line (see the module)."""

    def __init__(self, bell: Bell, line: LineWaiter) -> None:
        self.bell, self.line = bell, line
        self.finished = False  # told the wait's outcome (not ended by an error)

    def wait(self, timeout: float) -> bool:
        if self.bell.rejoin(self.line.name):
            self.line.event.clear()  # (a ring, if any: this answer is its)
            return True
        return self.line.wait(timeout)

    @property
    def ahead(self) -> int:
        return self.line.ahead

    def finish(self, result: Grant | Busy) -> None:
        self.finished = True
        self.line.finish(result)

    def close(self) -> None:
        self.line.close()
        self.bell.leave(self.line, self.finished)


class AsyncBell(BellState):
    """The asyncio twin of :class:`Bell`: a task of the loop the backend is used in."""

    def __init__(self, driver: Any, opener: Callable[[], Awaitable[Any]]) -> None:
        super().__init__(driver, opener)
        self.task: asyncio.Task[None] | None = None
        self.turn: asyncio.Lock | None = None
        self.waiting: asyncio.Event | None = None

    @property
    def lines(self) -> AsyncLines:
        return self.driver.backend.lines  # type: ignore[no-any-return]

    async def join(self, name: str, heir: Any = None) -> AsyncWaiter:
        """As :meth:`Bell.join`."""
        line = self.lines.join(name)
        line.heir = heir
        try:
            await self.start()
        except StoreUnavailable as exc:
            log.debug("waiting for %r without a bell: %s", name, exc)
            return line
        except BaseException:
            await line.close()
            raise
        waiter = AsyncBellWaiter(self, line)
        try:
            assert self.waiting is not None
            self.waiting.set()  # it sleeps in the server while the bell goes in line
            await self.register(name)
        except StoreUnavailable as exc:
            log.debug("waiting for %r, its bell not in line: %s", name, exc)
        except BaseException:
            await waiter.close()
            raise
        return waiter

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.task is not None and self.task.get_loop() is loop and not self.task.done():
            return
        if self.turn is None or self.task is not None:  # a first start, or in a new loop
            self.turn, self.waiting = asyncio.Lock(), asyncio.Event()
            self.task = self.pooled = None
        async with self.turn:
            if self.task is not None:
                return  # started while we waited for the turn
            with self.driver.backend.translate("start a bell", self.driver.errors):
                pooled = await self.opener()
                try:
                    await pooled.cur.execute(WHO)
                    rows = await pooled.cur.fetchall()
                except BaseException:
                    await pooled.close()
                    raise
            self.pooled, self.id = pooled, int(rows[0][0])
            self.store.bell = self
            self.task = loop.create_task(self._run(pooled))

    async def register(self, name: str) -> None:
        assert self.turn is not None and self.waiting is not None
        async with self.turn:
            await self.driver.run(self.registering(name), "wait")
            self.waiting.set()

    async def rejoin(self, name: str) -> bool:
        if self.pooled is None or not self.unregistered(name, self.lines.first_heir(name)):
            return False
        try:
            await self.register(name)
        except StoreUnavailable:
            return False
        return True

    async def leave(self, line: AsyncLineWaiter, finished: bool = True) -> None:
        if self.turn is None:
            return
        async with self.turn:
            steps = self.leaving(line, finished)
            if steps is None:
                return
            try:
                await self.driver.run(steps, "wait")
            except StoreUnavailable as exc:
                log.debug("bell for %r left behind: %s", line.name, exc)


    async def _run(self, pooled: Any) -> None:
        from latchkey.stores.io.asyncmy import drain

        assert self.waiting is not None
        timeout = self.driver.backend.timeout
        try:
            while self.pooled is pooled:
                if not self.lines.names and not self.store.orphans:
                    self.waiting.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self.waiting.wait(), NAP)
                    continue
                nap = self.nap()
                try:
                    await asyncio.wait_for(drain(pooled.cur, SLEEP, (nap,)), nap + timeout)
                    rung = False
                except Exception as exc:
                    if not interrupted(exc):
                        raise
                    rung = True
                if rung:
                    self.wake(None)
                if (rung and self.skipped) or self.store.orphans:
                    await self.tidy(pooled)
        except Exception as exc:
            log.debug("bell lost: %s", exc)
        finally:
            if self.pooled is pooled:
                self.pooled = None
                self.store.bell = None
                self.registered.clear()
            await pooled.close()
            self.wake(None)

    async def tidy(self, pooled: Any) -> None:
        assert self.turn is not None
        timeout = self.driver.backend.timeout
        async with self.turn:
            for name in self.stale():
                steps = self.store.bell_out(name, self.id, True)
                await asyncio.wait_for(adrive(steps, pooled.answer), timeout)
        # on a pooled connection: a ring may KILL this one's statement
        if self.store.orphans and await self.driver.run(self.store.give_back(), "wait"):
            for name in list(self.lines.names):
                self.lines.ring(name)

    async def aclose(self) -> None:
        task, self.task, self.pooled = self.task, None, None
        self.store.bell = None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


class AsyncBellWaiter(AsyncWaiter):
    """The asyncio twin of :class:`BellWaiter`."""

    def __init__(self, bell: AsyncBell, line: AsyncLineWaiter) -> None:
        self.bell, self.line = bell, line
        self.finished = False

    async def wait(self, timeout: float) -> bool:
        try:
            if await self.bell.rejoin(self.line.name):
                self.line.event.clear()
                return True
            return await self.line.wait(timeout)
        except asyncio.CancelledError:
            self.finished = True  # a cancel, not a store failure: the bell may tidy now
            raise

    @property
    def ahead(self) -> int:
        return self.line.ahead

    async def finish(self, result: Grant | Busy) -> None:
        self.finished = True
        await self.line.finish(result)

    async def close(self) -> None:
        await self.line.close()
        await self.bell.leave(self.line, self.finished)
