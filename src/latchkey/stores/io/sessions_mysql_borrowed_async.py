"""``mysql+getlock`` over the application's own asyncio pool or engine — an ``asyncmy.Pool``,
an ``aiomysql.Pool``, a SQLAlchemy ``AsyncEngine`` (``mysql+asyncmy``, ``mysql+aiomysql``,
``mariadb+…``) — with ``connect_async(client=…, locks="session")``: the asyncmy session driver
(:mod:`latchkey.stores.io.sessions_asyncmy`) on connections borrowed as
:mod:`latchkey.stores.io.sessions_lending_async` says.

As on the sync driver (:mod:`latchkey.stores.io.sessions_mysql_borrowed`): the application's
settings and autocommit are left as they are (GET_LOCK is not transactional) and a connection
that would go back inside a transaction is rolled back first, which ends no lock; the row
forms of the statements run (no warnings for either driver to report). Every call is bounded
by the store's ``timeout`` (``asyncio.timeout``), a wait in the server by its length plus
that; a call cut short closes the connection (both drivers do), and it is discarded: a pool
drops a closed connection, an engine's is invalidated.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import asyncmy
import pymysql

from latchkey.stores.io.aio import bounded
from latchkey.stores.io.sessions import Session
from latchkey.stores.io.sessions_async import AsyncSessionDriver
from latchkey.stores.io.sessions_asyncmy import IDLE_PING, AsyncmySessions
from latchkey.stores.io.sessions_lending_async import AsyncLending, _settled, async_lender

#: Both drivers' errors (aiomysql raises PyMySQL's).
ERRORS: tuple[type[BaseException], ...] = (
    asyncmy.errors.MySQLError, pymysql.err.MySQLError, OSError, asyncio.TimeoutError,
)  # fmt: skip
OPERATIONAL = (asyncmy.errors.OperationalError, pymysql.err.OperationalError)


class BorrowedAsyncSession(Session):
    __slots__ = ("cur",)

    def __init__(self, conn: Any, cur: Any, spare: bool) -> None:
        super().__init__(conn, conn.thread_id(), conn.get_server_info(), spare)
        self.cur = cur
        self.used = time.monotonic()


def _open(conn: Any) -> bool:
    closed = getattr(conn, "closed", None)  # aiomysql
    if closed is not None:
        return not closed
    return bool(getattr(conn, "connected", True))  # asyncmy


class AsyncBorrowedMySQLSessions(AsyncLending, AsyncmySessions):
    driver_errors = ERRORS
    operational = OPERATIONAL

    def __init__(self, backend: Any, store: Any) -> None:
        # (not AsyncmySessions': it reads connection arguments, which are the pool's here)
        AsyncSessionDriver.__init__(self, backend, store)
        self.lender = async_lender(backend.client)

    async def lent(self, conn: Any, spare: bool) -> BorrowedAsyncSession:
        cur = await _settled(conn.cursor())
        return BorrowedAsyncSession(conn, cur, spare)

    def sound(self, session: Any) -> bool:
        return _open(session.conn)

    async def tidy(self, session: Any) -> None:
        with contextlib.suppress(Exception):
            await _settled(session.cur.close())
        if session.conn.get_transaction_status():
            await session.conn.rollback()

    def fresh(self, session: Any) -> bool:
        return _open(session.conn) and time.monotonic() - session.used < IDLE_PING

    async def hung_up(self, session: Any) -> bool:
        if not _open(session.conn):
            return True
        if time.monotonic() - session.used < IDLE_PING:
            return False
        try:
            await self.shielded(bounded(session.conn.ping(reconnect=False), self.timeout))
        except ERRORS:
            return True
        session.used = time.monotonic()
        return False
