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
read timeout, so that it never ends in a timeout that would break the connection. PyMySQL
has no public reader for it, so latchkey learns it where SQLAlchemy hands it to PyMySQL: a
``do_connect`` listener on the engine notes ``read_timeout`` in each new connection's
``info``. A connection the engine opened before latchkey was given it has no such note: its
waits are cut into slices of ``UNKNOWN_SLICE`` seconds, each a statement of its own, which
no read timeout over that breaks. An idle session is pinged before use after ``IDLE_PING`` seconds
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
from latchkey.stores.io.sessions_lending import EngineLender, Lending
from latchkey.stores.io.sessions_pymysql import ERRORS, PyMySQLSessions
from latchkey.stores.sessionlocks import Statement

#: A session idle this long is pinged before use.
IDLE_PING = 1.0
#: The longest wait in one statement on a connection whose read timeout latchkey has not seen.
UNKNOWN_SLICE = 1.0
#: Where a connection's ``info`` keeps the read timeout it was opened with (None: no timeout).
READ_TIMEOUT = "latchkey.read_timeout"
_UNSEEN = object()


def note_read_timeout(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> None:
    """SQLAlchemy's ``do_connect`` event: keep the read timeout PyMySQL is given."""
    record.info[READ_TIMEOUT] = cparams.get("read_timeout")


def watch_connects(engine: Any) -> None:
    """Note the read timeout of every connection ``engine`` opens from now on (once)."""
    from sqlalchemy import event

    if not event.contains(engine, "do_connect", note_read_timeout):
        event.listen(engine, "do_connect", note_read_timeout)
_IN_TRANS = SERVER_STATUS.SERVER_STATUS_IN_TRANS


class BorrowedMySession(Session):
    """A borrowed connection and a plain cursor of ours on it."""

    __slots__ = ("cur", "read_timeout")

    def __init__(self, conn: Any, spare: bool, read_timeout: Any) -> None:
        super().__init__(conn, conn.thread_id(), conn.get_server_info(), spare)
        self.cur = conn.cursor(pymysql.cursors.Cursor)
        self.used = time.monotonic()
        self.read_timeout = read_timeout  # seconds, None (no timeout) or _UNSEEN


class BorrowedPyMySQLSessions(Lending, PyMySQLSessions):
    driver_errors = ERRORS

    def __init__(self, backend: Any, store: Any) -> None:
        super().__init__(backend, store)
        assert isinstance(self.lender, EngineLender)  # mysql_getlock lends only from an Engine
        self.engine = self.lender
        watch_connects(self.engine.engine)

    def lent(self, conn: Any, spare: bool) -> BorrowedMySession:
        info = self.engine.proxies[id(conn)].info  # the connection's, kept by the engine
        return BorrowedMySession(conn, spare, info.get(READ_TIMEOUT, _UNSEEN))

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
        read_timeout = session.read_timeout
        if read_timeout is _UNSEEN:
            seconds = min(seconds, UNKNOWN_SLICE)
        elif read_timeout:
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
