"""``postgresql+advisory`` over the application's own psycopg pool or SQLAlchemy engine
(``connect(client=…, locks="session")``), sync and asyncio: the drivers of
:mod:`latchkey.stores.io.sessions_psycopg` on connections borrowed as
:mod:`latchkey.stores.io.sessions_lending` says (checked out while a lock lives on them,
given back when none does, discarded when they failed).

While lent, a connection is switched to autocommit (latchkey's statements never run inside a
transaction of the application's: one in a transaction cannot be switched, and the call is
StoreUnavailable naming that), and switched back when it goes back. The application's
session settings stay as they are: the quick statements need none (a try never waits, and the
local watchdog still bounds each statement a second past the store's timeout), and a wait in
the server sets its ``lock_timeout`` and ``statement_timeout`` local to its own implicit
transaction (:data:`latchkey.stores.pg_advisory.WAIT_LOCK_LOCAL`). The sessions keep the
application's ``application_name``, so another process's ``inspect()`` names the holder by
the client address and that name, not by latchkey's ``pid@host``. Prepared statements are
remembered per connection (weakly, for every store of the process: a connection lent again,
or to another store, is not prepared twice; one prepared by a store of another process that
shared it cannot be, and its PREPARE's "already exists" is taken as done).
"""

from __future__ import annotations

import weakref
from typing import Any

from latchkey.stores.io.psycopg import IDLE
from latchkey.stores.io.sessions_lending import DeadOnArrival, Lending
from latchkey.stores.io.sessions_lending_async import AsyncLending
from latchkey.stores.io.sessions_psycopg import (
    AsyncPsycopgSessions,
    PgSession,
    PsycopgSessions,
    hung_up,
    usable,
)

#: The statements prepared on each borrowed connection, by any store of this process.
PREPARED: weakref.WeakKeyDictionary[Any, set[bytes]] = weakref.WeakKeyDictionary()


class BorrowedPgSession(PgSession):
    __slots__ = ("was_autocommit",)
    was_autocommit: bool  # the connection's autocommit as lent


def _session(conn: Any, spare: bool, was: bool) -> BorrowedPgSession:
    session = BorrowedPgSession(conn, spare)
    session.was_autocommit = was
    session.prepared = PREPARED.setdefault(conn, set())
    return session


def _sound(session: Any) -> bool:
    return usable(session) and session.conn.pgconn.transaction_status == IDLE


class BorrowedPsycopgSessions(Lending, PsycopgSessions):
    """Sync: a psycopg_pool ConnectionPool or a SQLAlchemy Engine (postgresql+psycopg)."""

    def lent(self, conn: Any, spare: bool) -> BorrowedPgSession:
        was = conn.autocommit
        if not was:
            conn.autocommit = True  # ProgrammingError inside the application's transaction
        session = _session(conn, spare, was)
        if hung_up(session):  # the server ended it while it sat in the pool
            raise DeadOnArrival("the pool lent a connection the server had closed")
        return session

    def sound(self, session: Any) -> bool:
        return _sound(session)

    def tidy(self, session: Any) -> None:
        if not session.was_autocommit:
            session.conn.autocommit = False


class AsyncBorrowedPsycopgSessions(AsyncLending, AsyncPsycopgSessions):
    """asyncio: a psycopg_pool AsyncConnectionPool or a SQLAlchemy AsyncEngine."""

    async def lent(self, conn: Any, spare: bool) -> BorrowedPgSession:
        was = conn.autocommit
        if not was:
            await conn.set_autocommit(True)  # refused inside the application's transaction
        session = _session(conn, spare, was)
        if hung_up(session):
            raise DeadOnArrival("the pool lent a connection the server had closed")
        return session

    def sound(self, session: Any) -> bool:
        return _sound(session)

    async def tidy(self, session: Any) -> None:
        if not session.was_autocommit:
            await session.conn.set_autocommit(False)
