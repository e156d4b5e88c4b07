"""psycopg 3 under the session-lock drivers (``postgresql+advisory://``): open a session, run
one statement, tell whether the server hung up — sync and asyncio.

Connections are autocommit, with the libpq parameters of :func:`latchkey.stores.postgresql.
connection_params` (statement timeout, TCP keepalives and ``tcp_user_timeout``), opened within
the timeout as a whole whatever the hosts (:mod:`latchkey.stores.io.pgconnect`), and every
statement is bounded locally too, a second past ``timeout`` (a blocking wait: past
its ``lock_timeout``): by the watchdog (:mod:`latchkey.stores.io.watchdog`) in sync code, by
the event loop in asyncio — a frozen server leaves neither hanging. Statements with a prepared
name (``extra``) go to libpq directly (``psycopg.pq``): prepared once per connection, then one
``exec_prepared`` (sync) or ``send_query_prepared`` with the event loop watching the socket
(asyncio; it stays watched between statements, :mod:`latchkey.stores.io.pgwatch`, and is let
go before psycopg's own calls and when the session leaves us): psycopg's ``execute`` builds a
cursor, adapts every parameter and looks the query up in its cache at each call, ~35 µs of
CPU per acquire+release pair, more than the rest of latchkey. If the statement disappeared
(psycopg sends ``DEALLOCATE ALL`` after a ROLLBACK or DROP it ran) it is prepared again, once.

An idle connection has nothing to read unless the server ended it (terminated the session,
shut down, restarted): one ``poll()`` tells, no round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import psycopg

from latchkey.stores.io import psycopg_green
from latchkey.stores.io.aio import cut_after
from latchkey.stores.io.pgwatch import Watch
from latchkey.stores.io.psycopg import (
    COMMAND_OK,
    MARGIN,
    TUPLES_OK,
    connection_params,
    deallocated,
    open_connection,
    prepared_already,
    result_error,
    server_ended,
)
from latchkey.stores.io.psycopg_async import aconnect
from latchkey.stores.io.sessions import Session, SessionDriver
from latchkey.stores.io.sessions_async import AsyncSessionDriver
from latchkey.stores.io.watchdog import WATCHDOG
from latchkey.stores.pg_advisory import application_name
from latchkey.stores.sessionlocks import YES, Statement

OK = psycopg.pq.ConnStatus.OK
ACTIVE = psycopg.pq.TransactionStatus.ACTIVE
ERRORS = (psycopg.Error, OSError)
T = TypeVar("T")


class PgSession(Session):
    __slots__ = ("cut", "poller", "prepared", "watch")

    def __init__(self, conn: Any, spare: bool) -> None:
        super().__init__(conn, conn.pgconn.backend_pid, str(conn.info.server_version), spare)
        self.prepared: set[bytes] = set()  # names prepared on this connection
        self.cut = False  # the watchdog shut its socket down (the session is over)
        self.poller: Any = None
        self.watch: Watch | None = None  # asyncio: its socket's watch (io/pgwatch.py)
        if hasattr(select, "poll"):  # (Windows: select() every time)
            self.poller = select.poll()
            self.poller.register(conn.pgconn.socket, select.POLLIN)


def hung_up(session: PgSession) -> bool:
    conn = session.conn
    if conn.closed:
        return True
    if session.poller is not None and not session.poller.poll(0):
        return False  # nothing to read: the usual case, one syscall
    return server_ended(conn.pgconn)


def usable(session: PgSession) -> bool:
    conn = session.conn
    return not (
        session.cut or conn.closed or conn.broken or conn.pgconn.status != OK
        or conn.pgconn.transaction_status == ACTIVE
    )  # fmt: skip


def _yes(result: psycopg.pq.abc.PGresult) -> bool:
    return result.get_value(0, 0) == b"t"


class PsycopgSessions(SessionDriver):
    driver_errors: ClassVar[tuple[type[BaseException], ...]] = ERRORS

    def __init__(self, backend: Any, store: Any) -> None:
        super().__init__(backend, store)
        self.params = connection_params(backend.url, backend.config, application_name())
        self.guard = self.timeout + MARGIN
        self.green = psycopg_green.patched()  # gevent/eventlet: statements wait on the hub

    def connect(self, spare: bool) -> PgSession:
        return PgSession(open_connection(self.params, self.timeout), spare)

    def execute(self, session: PgSession, statement: Statement, params: Any) -> Any:
        return _watched(session, self.guard, self._execute, session, statement, params)

    def _execute(self, session: PgSession, statement: Statement, params: Any) -> Any:
        name = statement.extra
        if name is not None:
            pgconn = session.conn.pgconn
            for again in (True, False):
                if name not in session.prepared:
                    if self.green:  # libpq's blocking calls would stop every greenlet
                        prepared = psycopg_green.prepare(pgconn, name, statement.text.encode())
                    else:
                        prepared = pgconn.prepare(name, statement.text.encode())
                    if prepared.status != COMMAND_OK and not prepared_already(prepared):
                        raise result_error(prepared)
                    session.prepared.add(name)
                if self.green:
                    result = psycopg_green.exec_prepared(pgconn, name, params)
                else:
                    result = pgconn.exec_prepared(name, params)
                if result.status == TUPLES_OK:
                    return _yes(result)
                if not (again and deallocated(result)):
                    break
                session.prepared.discard(name)  # deallocated behind our back
            raise result_error(result)
        rows = session.conn.execute(statement.text, params, prepare=True).fetchall()
        if statement.answer == YES:
            return bool(rows and rows[0][0])
        return rows

    def wait(self, session: PgSession, statement: Statement, params: Any) -> bool:
        bound = self.store.wait_cap_ms / 1000 + self.guard
        try:
            _watched(session, bound, session.conn.execute, statement.text, prepare=False)
        except psycopg.errors.LockNotAvailable:  # lock_timeout passed first
            return False
        return True

    hung_up = staticmethod(hung_up)  # one call less on the hot path

    def usable(self, session: PgSession, exc: BaseException) -> bool:
        return usable(session)

    def disconnect(self, session: PgSession) -> None:
        with contextlib.suppress(*ERRORS):
            session.conn.close()

    def interrupt(self, session: PgSession) -> None:
        with contextlib.suppress(*ERRORS):  # the wait ends by lock_timeout anyway
            session.conn.cancel_safe(timeout=self.timeout)


def _watched(session: PgSession, seconds: float, call: Callable[..., T], *args: Any,
             **kwargs: Any) -> T:  # fmt: skip
    """``call`` under the watchdog (see :mod:`latchkey.stores.io.watchdog`): past ``seconds``
    the session's socket is shut down and this raises TimeoutError — also when the answer
    came just in time, since the session, and every lock it held, ended with its socket."""
    fileno = session.conn.pgconn.socket
    WATCHDOG.arm(session, seconds, lambda: fileno)
    try:
        result = call(*args, **kwargs)
    except BaseException:
        if WATCHDOG.disarm(session):
            session.cut = True
            raise TimeoutError(f"no answer within {seconds:g}s") from None
        raise
    if WATCHDOG.disarm(session):
        session.cut = True
        raise TimeoutError(f"no answer within {seconds:g}s")
    return result


class AsyncPsycopgSessions(AsyncSessionDriver):
    driver_errors: ClassVar[tuple[type[BaseException], ...]] = (*ERRORS, asyncio.TimeoutError)

    def __init__(self, backend: Any, store: Any) -> None:
        super().__init__(backend, store)
        self.params = connection_params(backend.url, backend.config, application_name())
        self.guard = self.timeout + MARGIN

    async def connect(self, spare: bool) -> PgSession:
        return PgSession(await aconnect(self.params, self.timeout), spare)

    async def execute(self, session: PgSession, statement: Statement, params: Any) -> Any:
        name = statement.extra
        watch = session.watch
        if name is None:
            if watch is not None:
                watch.unwatch()  # psycopg's own wait registers the socket itself
            fd = session.conn.pgconn.socket  # (OperationalError once libpq let it go)
            call = self._execute(session, statement, params)
            return await self.shielded(cut_after(call, self.guard, fd))
        # The hot path: libpq, the loop watching the socket (pgwatch.Watch); a cancellation
        # is held back right there (reply), without a task of its own.
        pgconn = session.conn.pgconn
        if watch is None:
            watch = session.watch = Watch(pgconn)
        loop = asyncio.get_running_loop()
        watch.watch(loop)
        watch.start(loop.time() + self.guard)
        try:
            for again in (True, False):
                if name not in session.prepared:
                    pgconn.send_prepare(name, statement.text.encode())
                    prepared = await reply(pgconn, watch, self)
                    if prepared.status != COMMAND_OK and not prepared_already(prepared):
                        raise result_error(prepared)
                    session.prepared.add(name)
                pgconn.send_query_prepared(name, params)
                result = await reply(pgconn, watch, self)
                if result.status == TUPLES_OK:
                    return _yes(result)
                if not (again and deallocated(result)):
                    break
                session.prepared.discard(name)  # deallocated behind our back
            raise result_error(result)
        finally:
            watch.end()

    async def _execute(self, session: PgSession, statement: Statement, params: Any) -> Any:
        cur = await session.conn.execute(statement.text, params, prepare=True)
        rows = await cur.fetchall()
        if statement.answer == YES:
            return bool(rows and rows[0][0])
        return rows

    async def wait(self, session: PgSession, statement: Statement, params: Any) -> bool:
        self.forget(session)
        fd = session.conn.pgconn.socket
        try:
            await cut_after(session.conn.execute(statement.text, prepare=False),
                            self.store.wait_cap_ms / 1000 + self.guard, fd)  # fmt: skip
        except psycopg.errors.LockNotAvailable:
            return False
        return True

    async def hung_up(self, session: PgSession) -> bool:
        return hung_up(session)

    def fresh(self, session: PgSession) -> bool:
        return not hung_up(session)  # as cheap as asking (one poll), without a coroutine

    def usable(self, session: PgSession, exc: BaseException) -> bool:
        return usable(session)

    def forget(self, session: PgSession) -> None:
        if session.watch is not None:
            session.watch.unwatch()

    async def disconnect(self, session: PgSession) -> None:
        self.forget(session)
        with contextlib.suppress(*ERRORS):
            await session.conn.close()

    async def interrupt(self, session: PgSession) -> None:
        with contextlib.suppress(*ERRORS):  # the wait ends by lock_timeout anyway
            await session.conn.cancel_safe(timeout=self.timeout)


async def reply(
    pgconn: psycopg.pq.abc.PGconn, watch: Watch, driver: AsyncSessionDriver
) -> psycopg.pq.abc.PGresult:
    """The result of the one statement just sent on ``pgconn`` (psycopg opens connections in
    libpq's nonblocking mode): flushes it, then reads the whole reply, ``watch`` waking us when
    the socket has something. A cancellation meanwhile is held back (``driver.deferred``): the
    reply is read to its end. TimeoutError after the watch's deadline (CancelledError if a
    cancellation was held back: the caller's comes first); psycopg's OperationalError if the
    connection fails."""
    if pgconn.flush():  # only if the socket's buffer is full (never for our statements)
        loop = asyncio.get_running_loop()
        while pgconn.flush():
            await _ready(loop, pgconn.socket, watch.deadline, driver)
        watch.watch(loop)  # (again if it let go meanwhile: see Watch._readable)
    last: psycopg.pq.abc.PGresult | None = None
    while True:
        while pgconn.is_busy():
            if watch.expired:
                if driver.deferred:
                    raise asyncio.CancelledError
                raise TimeoutError("no reply within the timeout")
            try:
                await watch
            except asyncio.CancelledError:  # the caller's, now that the socket is readable
                driver.deferred = True  # held back: the reply is read to its end
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:  # the end of the reply: the connection is idle again
            assert last is not None
            return last
        last = result


async def _ready(
    loop: asyncio.AbstractEventLoop, fd: int, deadline: float, driver: AsyncSessionDriver
) -> None:
    """Wait until ``fd`` is writable."""
    while True:
        ready = loop.create_future()
        loop.add_writer(fd, _set, ready)
        timer = loop.call_at(deadline, _expire, ready)
        try:
            await ready
            return
        except asyncio.CancelledError:  # the caller's (the deadline is a TimeoutError)
            driver.deferred = True  # held back: the statement is sent and read to its end
        finally:
            timer.cancel()
            loop.remove_writer(fd)


def _set(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


def _expire(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_exception(TimeoutError("no reply within the timeout"))
