"""The sessions of a session-lock store, asyncio flavour: the twin of
:mod:`latchkey.stores.io.sessions` (a main session, spares pinned to the lock they got, the
store told when a session ends), for one event loop.

One primitive runs at a time under an :class:`asyncio.Lock`, in the caller's task. A
statement on a session is never cut in half by a cancellation: a statement cut short would
leave a session that must be closed, and closing it would end every lock in it, other owners'
included. So a cancellation that arrives during a statement is held back (:meth:`shielded`):
the primitive finishes (each statement bounded by the timeout), its bookkeeping stands — a
lock it took is recorded, so the core's release after a cancellation finds it — and then the
caller sees CancelledError. A wait in the server is the exception: a cancellation cuts it,
and its spare is closed, so the server drops the wait and any lock granted at that instant.
At most ``store.MAX_WAITS`` waits in the server at once (each needs a session of its own);
the others wait in the loop for a turn, and one that does not come within the wait's length
becomes one more try. Borrowed sessions (the application's pool or engine) as in the sync
flavour: given back once they hold nothing, discarded when they failed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import sys
from collections.abc import Awaitable, Coroutine, Generator
from typing import Any, ClassVar, TypeVar

from latchkey.errors import StoreUnavailable
from latchkey.stores.io import Steps
from latchkey.stores.io.aio import AsyncDriver, bounded
from latchkey.stores.io.deadlines import keeper
from latchkey.stores.io.sessions import IDLE_SPARES, held_keys
from latchkey.stores.sessionlocks import (
    WAIT,
    Alive,
    End,
    Free,
    Reach,
    Refused,
    Run,
    SessionEnded,
    Spare,
    Statement,
)

T = TypeVar("T")


class AsyncSessionDriver(AsyncDriver):
    """See the module docstring; a driver module adds how to open a session and run one
    statement (``io/sessions_psycopg.py``, ``io/sessions_asyncmy.py``)."""

    driver_errors: ClassVar[tuple[type[BaseException], ...]] = (OSError, asyncio.TimeoutError)
    #: See :attr:`latchkey.stores.io.sessions.SessionDriver.idle_spares`.
    idle_spares: ClassVar[int] = IDLE_SPARES
    #: Whether the main session is the application's, given back after each primitive that
    #: leaves it holding nothing (:meth:`after_primitive`).
    lending: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.errors = (*cls.driver_errors, SessionEnded, Refused)  # the store's mapped too

    def __init__(self, backend: Any, store: Any) -> None:
        super().__init__(backend, store)
        self.timeout: float = backend.timeout
        self.mutex = Mutex()
        self.main: Any = None
        self.idle: list[Any] = []
        self.spares: set[Any] = set()
        self.waiting: set[Any] = set()
        self.turns = asyncio.Semaphore(store.MAX_WAITS)
        self._turn_of: set[Any] = set()  # spares that hold a turn to wait
        self.deferred = False  # a cancellation held back until the primitive is done
        self._hold: _Hold | None = None  # held()'s, reused

    # -- the driver's part -----------------------------------------------------------------------

    async def connect(self, spare: bool) -> Any:
        raise NotImplementedError

    async def execute(self, session: Any, statement: Statement, params: Any) -> Any:
        raise NotImplementedError

    async def wait(self, session: Any, statement: Statement, params: Any) -> Any:
        raise NotImplementedError

    async def hung_up(self, session: Any) -> bool:
        raise NotImplementedError

    def fresh(self, session: Any) -> bool:
        """Whether ``session`` was used so recently that :meth:`hung_up` need not be asked."""
        return False

    def usable(self, session: Any, exc: BaseException) -> bool:
        """After ``exc`` (a driver error, not a timeout): whether the session is still usable."""
        return False

    async def disconnect(self, session: Any) -> None:
        raise NotImplementedError

    def forget(self, session: Any) -> None:
        """``session`` leaves this driver's hands (closed, given back, let go): undo what
        :meth:`execute` keeps set up on it between statements (a watch on its socket)."""

    async def give_back(self, session: Any) -> None:
        """See :meth:`latchkey.stores.io.sessions.SessionDriver.give_back`."""
        await self.disconnect(session)

    async def let_go(self, session: Any, keys: list[Any]) -> None:
        """See :meth:`latchkey.stores.io.sessions.SessionDriver.let_go`."""
        await self.disconnect(session)

    async def after_primitive(self) -> None:
        """After each primitive, under the mutex, when :attr:`lending`."""

    def no_answer(self, exc: BaseException) -> bool:
        """See :meth:`latchkey.stores.io.sessions.SessionDriver.no_answer`."""
        return isinstance(exc, (TimeoutError, asyncio.TimeoutError))

    async def interrupt(self, session: Any) -> None:
        """End the wait another task is in on ``session`` (it then fails, and closes it)."""
        raise NotImplementedError

    # -- running primitives ----------------------------------------------------------------------

    async def run(self, steps: Steps[T], action: str) -> T:
        mutex = self.mutex
        if mutex._locked or mutex._waiters:  # (Mutex.take, inline)
            await mutex.acquire()  # (cancelled while waiting for it: nothing was started)
        else:
            mutex._locked = True
        try:
            self.deferred = False
            try:
                # adrive(steps, self.answer), written out here: one coroutine less a primitive
                value: Any = None
                error: BaseException | None = None
                while True:
                    try:
                        request = steps.send(value) if error is None else steps.throw(error)
                    except StopIteration as stop:
                        result: T = stop.value
                        break
                    try:
                        value, error = await self.answer(request), None
                    except BaseException as exc:  # thrown into the store's generator
                        value, error = None, exc
            except StoreUnavailable:
                raise
            except self.errors as exc:
                self.backend.unavailable(exc, action)
            finally:
                if self.lending:
                    await self.shielded(self.after_primitive())
                deferred, self.deferred = self.deferred, False
            if deferred:
                raise asyncio.CancelledError  # held back until the primitive was done
            return result
        finally:
            mutex._locked = False  # (Mutex.release, inline)
            if mutex._waiters:
                mutex._wake_first()

    async def shielded(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` to its end even if the caller is cancelled meanwhile: the cancellation
        is held back until the primitive is done (see the module docstring)."""
        task = asyncio.ensure_future(aw)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self.deferred = True
            while not task.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait((task,))
            return task.result()

    async def held(self, coro: Coroutine[Any, Any, T], seconds: float) -> T:
        """:meth:`shielded` for a coroutine, within ``seconds``, without a task of its own:
        ``coro`` is driven here, step by step, in the caller's task. The caller's task waits
        for what ``coro`` waits for through a :class:`_Hold`, which hands the task's wake-up
        to that future and refuses the task's cancellation: the task is then cancelled when
        the future is done, here, and the cancellation is held back until ``coro`` ends, as
        :meth:`shielded` does. The deadline, on the other hand, cuts ``coro`` (the hold
        cancels its future, so it unwinds as a cancelled task would) and is ``TimeoutError``.

        Why: a task per statement (``shielded``) costs its scheduling and two more turns of
        the loop for the shield's callbacks, ~45 µs of a ~190 µs asyncio GET_LOCK pair on
        the development VM; a stand-in future (woken by the statement's future, then waking
        the task) one more turn per wait; the hold none."""
        if sys.version_info < (3, 11):  # pragma: no cover - no Task.uncancel: the task way
            return await self.shielded(bounded(coro, seconds))
        hold: _Hold | None = None
        try:
            while True:
                try:
                    waited = coro.send(None)
                except StopIteration as stop:
                    result: T = stop.value
                    break
                if waited is None:  # a bare yield (sleep(0)): give the loop a turn
                    try:
                        await asyncio.sleep(0)
                    except asyncio.CancelledError:
                        self.deferred = True  # the caller's (a deadline cancels no task)
                    continue
                # Taken over, as a task would: the flag is the protocol by which a Task knows
                # a yielded future (asyncio.futures.isfuture), set by Future.__await__.
                waited._asyncio_future_blocking = False
                if hold is None:  # the first wait: the deadline starts
                    hold = self._hold
                    loop = waited.get_loop()
                    if hold is None or hold.busy or hold._loop is not loop:
                        hold = _Hold(loop)
                        if self._hold is None or not self._hold.busy:
                            self._hold = hold
                    hold.start(loop.time() + seconds)
                elif hold.expired:  # it came during a bare yield
                    waited.cancel()
                hold.waited = waited
                hold.add_done_callback = waited.add_done_callback  # what the task calls
                try:
                    await hold
                except asyncio.CancelledError:
                    # ``waited`` is done. Cancelled: by the deadline (``coro`` unwinds at the
                    # next send; the caller's too if it refused one). Otherwise this is the
                    # caller's cancellation, held back until the end.
                    if hold.refused or not waited.cancelled():
                        self.deferred = True
        except BaseException as exc:
            if hold is not None:
                hold.end()
                cut = hold.expired and isinstance(exc, asyncio.CancelledError)
                if cut and not (hold.refused or self.deferred):  # by the deadline alone
                    raise TimeoutError(f"no answer within {seconds:g}s") from exc
            raise
        if hold is not None:
            hold.end()
        return result

    async def _relock(self) -> None:
        """Take the mutex back after a wait, whatever happens (a cancellation is held back)."""
        cancelled = False
        while True:
            try:
                await self.mutex.acquire()
                break
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            self.deferred = True

    async def answer(self, request: Any) -> Any:
        kind = type(request)
        if kind is Run:
            statement, params, session = request
            if session is None:
                session = self.main
                if session is None or not self.fresh(session):
                    session = await self._main()
            elif session.closed:
                raise SessionEnded("the session holding the lock has ended")
            if statement.answer == WAIT:
                return await self._wait(session, statement, params), session
            try:
                return await self.execute(session, statement, params), session
            except BaseException as exc:
                if (
                    isinstance(exc, self.driver_errors)
                    and not isinstance(exc, asyncio.TimeoutError)
                    and self.usable(session, exc)
                ):
                    raise
                await self._end(session)  # failed, timed out, or cut short: out of step
                if (
                    request.session is None
                    or not isinstance(exc, self.driver_errors)
                    or self.no_answer(exc)
                ):
                    raise  # the main session's statement failed, cut short, or no answer
                raise SessionEnded(str(exc)) from exc
        if kind is Free:
            return await self._free(request.session)
        if kind is Alive:
            session = request.session
            if session.closed:
                return False
            if await self.hung_up(session):
                await self._end(session)
                return False
            return True
        if kind is Spare:
            return await self._spare(request.seconds)
        if kind is Reach:
            await self._main()
            return None
        if kind is End:
            await self._end(request.session)
            return None
        raise TypeError(f"not a session-lock request: {request!r}")

    async def _main(self) -> Any:
        main = self.main
        if main is not None:
            if not await self.hung_up(main):
                return main
            await self._end(main)
        main = self.main = await self.connect(False)
        return main

    async def _end(self, session: Any, holds_nothing: bool = False) -> None:
        if session is self.main:
            self.main = None
        self.spares.discard(session)
        if session in self.idle:
            self.idle.remove(session)
        self._give_turn(session)
        self.store.session_ended(session)
        self.forget(session)
        if not session.closed:
            session.closed = True
            await (self.give_back if holds_nothing else self.disconnect)(session)

    def _give_turn(self, session: Any) -> None:
        if session in self._turn_of:
            self._turn_of.discard(session)
            self.turns.release()

    async def _spare(self, seconds: float) -> Any:
        if self.deferred:  # cancelled already: no wait
            raise asyncio.CancelledError
        self.mutex.release()  # waiting for a turn, or connecting: the others go on
        try:
            try:
                await bounded(self.turns.acquire(), max(seconds, 0.001))
            except asyncio.TimeoutError:
                return None  # MAX_WAITS others waited in the server all along
            try:
                session = None
                while self.idle and session is None:
                    session = self.idle.pop()
                    if await self.hung_up(session):  # a killed one is never reused
                        await self._end(session)
                        session = None
                if session is None:
                    session = await self.connect(True)
                    self.spares.add(session)
            except BaseException:
                self.turns.release()
                raise
            self._turn_of.add(session)
            return session
        finally:
            await self._relock()

    async def _free(self, session: Any) -> None:
        self._give_turn(session)
        if session is self.main or session.closed or session in self.idle:
            return
        keep = session in self.spares and len(self.idle) < self.idle_spares
        if keep and not await self.hung_up(session):
            self.idle.append(session)
            return
        await self._end(session, holds_nothing=True)

    async def _wait(self, session: Any, statement: Statement, params: Any) -> Any:
        if self.deferred:  # cancelled already: no wait
            await self._end(session)
            raise asyncio.CancelledError
        self.waiting.add(session)
        self.mutex.release()
        try:
            got = await self.wait(session, statement, params)
        except BaseException:
            await self._relock()
            self.waiting.discard(session)
            await self._end(session)  # failed or cancelled: whatever it took ends with it
            raise
        await self._relock()
        self.waiting.discard(session)
        self._give_turn(session)
        if session not in self.spares:  # aclose() meanwhile: what it got goes with it
            await self._end(session)
            raise SessionEnded("the store was closed")
        return got

    # -- lifecycle -------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Closing the sessions ends every lock they hold; a wait in progress fails with
        StoreUnavailable."""
        async with self.mutex:
            sessions = list(self.spares)
            if self.main is not None:
                sessions.append(self.main)
            waiting = set(self.waiting)
            keys = held_keys(self.store)
            self.main, self.idle, self.spares = None, [], set()
            self.store.forget_all()
            for session in sessions:
                if session in waiting:
                    await self.interrupt(session)  # its task closes it
                    continue
                session.closed = True
                self.forget(session)
                await self.let_go(session, keys.get(session, []))


class _Hold:
    """The deadline of a statement in :meth:`AsyncSessionDriver.held`, and what the caller's
    task waits on while the statement waits for ``waited``: future-like to the task, which
    registers its wake-up straight on ``waited`` (no turn of the loop in between) and calls
    :meth:`cancel` to cancel it.

    That cancel is refused while the deadline has not come: asyncio's Task then remembers it
    and throws CancelledError in at its next step, which comes when ``waited`` is done, so
    the statement is never cut. The deadline, once come, cancels ``waited`` itself
    (:meth:`expire`, called by the loop's :class:`~latchkey.stores.io.deadlines.Keeper`):
    the statement unwinds as if cancelled, and ``held`` makes that a TimeoutError; the task
    is never cancelled for it.

    One per driver, reused statement after statement (:meth:`start`, :meth:`end`: an entry
    in the keeper, no object, no ``current_task``); the deadline starts at the statement's
    first wait, from that future's loop (on Python 3.11 ``asyncio.get_running_loop`` makes a
    getpid system call)."""

    __slots__ = ("_asyncio_future_blocking", "_loop", "add_done_callback", "busy", "calls",
                 "deadline", "expired", "keeper", "refused", "waited")  # fmt: skip

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop  # the task asks a future-like for its loop: _loop, no get_loop()
        self.keeper = keeper(loop)
        self.calls = self.keeper.calls
        self.busy = self.expired = self.refused = False
        self.deadline = math.inf
        self.waited: Any = None

    def start(self, deadline: float) -> None:
        self.busy, self.expired, self.refused, self.deadline = True, False, False, deadline
        self.calls[self] = None
        if deadline < self.keeper.at:
            self.keeper.arm(deadline)

    def end(self) -> None:
        self.calls.pop(self, None)
        self.busy, self.waited = False, None

    def expire(self) -> None:
        """The deadline came (the keeper no longer holds this entry): cut the statement."""
        self.expired = True
        if self.waited is not None:
            self.waited.cancel()

    def cancel(self, msg: Any = None) -> bool:
        """The caller's cancellation (a task's, on its ``_fut_waiter``)."""
        self.refused = True
        if self.expired:
            return bool(self.waited.cancel(msg))
        return False  # held back: the task is cancelled once ``waited`` is done

    def __await__(self) -> Generator[Any, None, None]:
        self._asyncio_future_blocking = True
        yield self


class Mutex:
    """One primitive at a time, first come, first served: :class:`asyncio.Lock`'s rules, with
    :meth:`take`, which takes it free of charge (no coroutine) when it is free and nobody
    waits — every time but under contention."""

    __slots__ = ("_locked", "_waiters")

    def __init__(self) -> None:
        self._locked = False
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def locked(self) -> bool:
        return self._locked

    def take(self) -> bool:
        """Take it if it is free and nobody waits for it; whether it was taken."""
        if self._locked or self._waiters:
            return False
        self._locked = True
        return True

    async def acquire(self) -> bool:
        if self.take():
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            try:
                await waiter
            finally:
                self._waiters.remove(waiter)
        except asyncio.CancelledError:
            if not self._locked:  # woken, then cancelled: the next one's turn
                self._wake_first()
            raise
        self._locked = True
        return True

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()

    def release(self) -> None:
        if not self._locked:
            raise RuntimeError("Mutex released while not held")
        self._locked = False
        self._wake_first()

    def _wake_first(self) -> None:
        if self._waiters:
            first = self._waiters[0]
            if not first.done():
                first.set_result(None)
