"""asyncmy under the session-lock driver (``mysql+getlock://``, asyncio): open a session, run
one statement (the statements' row forms, ``Statement.extra``: see
:mod:`latchkey.stores.mysql_getlock`), tell whether the server ended an idle one.

Every call is bounded by one deadline (:func:`~latchkey.stores.io.aio.bounded`; asyncmy's own
``read_timeout`` wraps every packet read in ``wait_for``, ~250 µs a pair); a wait in the server
by its length plus the store's ``timeout``. A session idle for ``IDLE_PING`` seconds or more is
pinged before use (the server may have ended it: restart, idle timeout, KILL) and replaced if it
does not answer. Closing a waiting session's connection (``aclose``) makes its wait fail at
once.

One deadline per call, as in the sync flavour (:mod:`latchkey.stores.io.sessions_pymysql`):
opening a session, the idle ping and each statement of a primitive get what the call has left
of the store's timeout (a per-task context variable, set by :meth:`AsyncmySessions.run`); a
wait in the server moves the deadline to its length plus the timeout from when it starts.
Past the deadline before a statement is sent: ``Overdue``, the session kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import asyncmy

from latchkey.stores.io import Steps
from latchkey.stores.io.aio import bounded
from latchkey.stores.io.mysql_dsn import async_args, connect_args
from latchkey.stores.io.mysql_session import Overdue
from latchkey.stores.io.sessions import Session
from latchkey.stores.io.sessions_async import AsyncSessionDriver
from latchkey.stores.sessionlocks import DONE, ROWS, Statement

ERRORS: tuple[type[BaseException], ...] = (asyncmy.errors.MySQLError, OSError, asyncio.TimeoutError)
#: A session idle this long is pinged before use.
IDLE_PING = 1.0
T = TypeVar("T")
#: When the call in progress in this task ends (loop time; None: no call in progress).
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "latchkey_getlock_deadline", default=None
)


class AsyncmySession(Session):
    __slots__ = ("cur",)

    def __init__(self, conn: Any, spare: bool) -> None:
        super().__init__(conn, conn.thread_id(), conn.get_server_info(), spare)
        self.cur = conn.cursor()
        self.used = time.monotonic()


class AsyncmySessions(AsyncSessionDriver):
    driver_errors = ERRORS
    #: The refusal a DONE statement's error code is read from (a borrowed pool's driver
    #: may be aiomysql, whose errors are PyMySQL's).
    operational: tuple[type[BaseException], ...] = (asyncmy.errors.OperationalError,)

    def __init__(self, backend: Any, store: Any) -> None:
        super().__init__(backend, store)
        self.args = async_args(connect_args(backend))  # timeouts: asyncio's, per call

    async def run(self, steps: Steps[T], action: str) -> T:
        token = _DEADLINE.set(asyncio.get_running_loop().time() + self.timeout)
        try:
            return await super().run(steps, action)
        finally:
            _DEADLINE.reset(token)

    def left(self) -> float:
        """What the call in progress has left of its timeout; ``Overdue`` if nothing."""
        deadline = _DEADLINE.get()
        if deadline is None:  # outside a call (aclose() unlocking): a timeout a statement
            return self.timeout
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise Overdue(f"no answer within {self.timeout:g}s")
        return left

    def usable(self, session: AsyncmySession, exc: BaseException) -> bool:
        return isinstance(exc, Overdue)  # nothing was sent

    async def connect(self, spare: bool) -> AsyncmySession:
        conn = await bounded(asyncmy.connect(**self.args), self.left())
        return AsyncmySession(conn, spare)

    def execute(
        self, session: AsyncmySession, statement: Statement, params: Any
    ) -> Coroutine[Any, Any, Any]:
        # (held()'s coroutine itself, awaited by the caller: one coroutine less a statement)
        return self.held(self._execute(session, statement, params), self.left())

    async def _execute(self, session: AsyncmySession, statement: Statement, params: Any) -> Any:
        cur = session.cur
        answer, extra = statement.answer, statement.extra
        try:  # the row form where there is one
            await cur.execute(extra if isinstance(extra, str) else statement.text, params)
        except self.operational as exc:
            if answer == DONE and exc.args[:1] == (extra,):
                return False  # refused with the code that means "nothing to do"
            raise
        session.used = time.monotonic()
        if answer == DONE:
            return True
        rows = list(await cur.fetchall())  # buffered: no I/O
        return rows if answer == ROWS else rows[0][0]  # YES, WAIT: 1, 0, or NULL (None)

    async def wait(self, session: AsyncmySession, statement: Statement, params: Any) -> Any:
        # The wait's length plus the timeout, from now: for the wait and what follows it.
        seconds = self.timeout + params[1]
        _DEADLINE.set(asyncio.get_running_loop().time() + seconds)
        return await bounded(self._execute(session, statement, params), seconds)

    def fresh(self, session: AsyncmySession) -> bool:
        return time.monotonic() - session.used < IDLE_PING

    async def hung_up(self, session: AsyncmySession) -> bool:
        if time.monotonic() - session.used < IDLE_PING:
            return False
        try:
            seconds = self.left()
        except Overdue:  # no time left to ask: a statement now is Overdue (nothing sent), a
            return False  # session kept idle is pinged at its next use
        try:
            await self.shielded(bounded(session.conn.ping(reconnect=False), seconds))
        except ERRORS:
            return True
        session.used = time.monotonic()
        return False

    async def disconnect(self, session: AsyncmySession) -> None:
        with contextlib.suppress(Exception):
            session.conn.close()

    async def interrupt(self, session: AsyncmySession) -> None:
        with contextlib.suppress(Exception):
            session.conn.close()  # its wait fails at once
