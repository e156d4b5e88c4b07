"""``mysql+getlock`` over the application's own SQLAlchemy Engine (``mysql+pymysql``,
``mariadb+pymysql``; ``connect(client=engine, locks="session")``), sync: the PyMySQL session
driver (:mod:`latchkey.stores.io.sessions_pymysql`) on connections borrowed as
:mod:`latchkey.stores.io.sessions_lending` says (checked out while a lock lives on them,
given back when none does, invalidated when they failed).

GET_LOCK and RELEASE_LOCK are not transactional, so the application's session settings and
autocommit are left as they are; a connection that went back inside a transaction (one of
latchkey's statements began one: autocommit off) is rolled back first, which ends no lock.
The statements leave two user variables of latchkey's on the connection (``@latchkey_got``,
``@latchkey_row``). Each session reads with a cursor of PyMySQL's plain class, whatever
cursor class the application's connections default to.

**Timeouts.** The connection's socket is PyMySQL's, with the application's read timeout
(none, by PyMySQL's default): a server that stops answering blocks a call as long as it
blocks the application's own. A wait in the server is shortened to end a second before that
read timeout (``read_timeout`` as given to PyMySQL), so that it never ends in a timeout that
would break the connection. An idle session is pinged before use after ``IDLE_PING`` seconds
(the server may have ended it), not polled: its socket is PyMySQL's. :meth:`close` ends the
waits of other threads with ``KILL QUERY`` from another connection of the engine.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import pymysql
import pymysql.cursors
from pymysql.constants import SERVER_STATUS

from latchkey.stores.io.sessions import Session
from latchkey.stores.io.sessions_lending import Lending
from latchkey.stores.io.sessions_pymysql import ERRORS, PyMySQLSessions
from latchkey.stores.sessionlocks import Statement

#: A session idle this long is pinged before use.
IDLE_PING = 1.0
_IN_TRANS = SERVER_STATUS.SERVER_STATUS_IN_TRANS


class BorrowedMySession(Session):
    """A borrowed connection and a plain cursor of ours on it."""

    __slots__ = ("cur",)

    def __init__(self, conn: Any, spare: bool) -> None:
        super().__init__(conn, conn.thread_id(), conn.get_server_info(), spare)
        self.cur = conn.cursor(pymysql.cursors.Cursor)
        self.used = time.monotonic()


class BorrowedPyMySQLSessions(Lending, PyMySQLSessions):
    driver_errors = ERRORS

    def lent(self, conn: Any, spare: bool) -> BorrowedMySession:
        return BorrowedMySession(conn, spare)

    def sound(self, session: Any) -> bool:
        return bool(session.conn.open)

    def tidy(self, session: Any) -> None:
        with contextlib.suppress(*ERRORS):
            session.cur.close()
        if session.conn.server_status & _IN_TRANS:
            session.conn.rollback()

    def execute(self, session: Any, statement: Statement, params: Any) -> Any:
        answer = super().execute(session, statement, params)
        session.used = time.monotonic()
        return answer

    def wait(self, session: Any, statement: Statement, params: Any) -> Any:
        key, seconds = params
        read_timeout = getattr(session.conn, "_read_timeout", None)  # as given to PyMySQL
        if read_timeout:
            seconds = max(0.0, min(seconds, read_timeout - 1.0))
            if "mariadb" not in session.server.lower():
                seconds = float(math.floor(seconds))  # MySQL rounds: never past the deadline
        try:
            return session.cur.execute(statement.text, (key, seconds))
        finally:
            session.used = time.monotonic()

    def hung_up(self, session: Any) -> bool:
        if not session.conn.open:
            return True
        if time.monotonic() - session.used < IDLE_PING:
            return False
        try:
            session.conn.ping(reconnect=False)
        except ERRORS:
            return True
        session.used = time.monotonic()
        return False

    def interrupt(self, session: Any) -> None:
        with contextlib.suppress(*ERRORS, ConnectionError):
            conn = self.lender.take(self.timeout)
            try:
                with conn.cursor(pymysql.cursors.Cursor) as cur:
                    cur.execute("KILL QUERY %s", (session.id,))
            finally:
                self.lender.give_back(conn)
