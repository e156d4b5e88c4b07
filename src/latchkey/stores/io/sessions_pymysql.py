"""PyMySQL under the session-lock driver (``mysql+getlock://``, sync): open a session, run one
statement, tell whether the server hung up, end a wait from another thread.

Each session is opened on a socket of our own, handed to PyMySQL's public
``Connection.connect(sock=...)``: so the driver never reaches for PyMySQL's private socket
attribute. With it in hand, an idle session the server ended (a restart, an idle timeout, a
KILL) is found by one ``poll()`` — an idle MySQL connection has nothing to read — with no
round trip; ``close()`` shuts a waiting session's socket down, so its thread's read fails at
once; and a wait in the server gets its own read timeout: ``settimeout`` on our socket for
that one call (the store's ``timeout`` plus the wait's length: a long wait is not taken for a
hung server, and a hung server is still noticed), back to ``timeout`` after it. PyMySQL sets
a socket's timeout only when its own read and write timeouts differ from the one it set last;
both are ``timeout`` here, so it never undoes ours (were it to, a long wait would fail after
``timeout``, loudly). Cost: none on the hot path (opening the socket ourselves is what
PyMySQL does); ``poll()`` is a third of the ``select()`` the store used before.
"""

from __future__ import annotations

import contextlib
import select
import socket
from typing import Any

import pymysql

from latchkey.stores.io.mysql_dsn import connect_args
from latchkey.stores.io.pymysql import connect, socket_of
from latchkey.stores.io.sessions import Session, SessionDriver
from latchkey.stores.sessionlocks import ROWS, YES, Statement

ERRORS = (pymysql.err.MySQLError, OSError)


class MySession(Session):
    """A session and its one cursor, reused by every call on it, on our own socket."""

    __slots__ = ("cur", "poller", "sock")

    def __init__(self, conn: Any, sock: socket.socket, spare: bool) -> None:
        super().__init__(conn, conn.thread_id(), conn.get_server_info(), spare)
        self.cur = conn.cursor()
        self.sock = sock
        self.poller = select.poll() if hasattr(select, "poll") else None
        if self.poller is not None:
            self.poller.register(sock, select.POLLIN)


class PyMySQLSessions(SessionDriver):
    driver_errors = ERRORS

    def __init__(self, backend: Any, store: Any) -> None:
        super().__init__(backend, store)
        self.args = connect_args(backend)

    def connect(self, spare: bool) -> MySession:
        conn = connect(self.args)  # on a socket of our own (latchkey.stores.io.pymysql)
        sock = socket_of(conn)
        assert sock is not None
        return MySession(conn, sock, spare)

    def execute(self, session: MySession, statement: Statement, params: Any) -> Any:
        cur = session.cur
        answer = statement.answer
        if answer == YES:
            return cur.execute(statement.text, params)  # the row count: 1 yes, 0 no
        if answer == ROWS:
            cur.execute(statement.text, params)
            return cur.fetchall()
        try:  # DONE
            cur.execute(statement.text, params)
        except pymysql.err.OperationalError as exc:
            if exc.args and exc.args[0] == statement.extra:
                return False
            raise
        return True

    def wait(self, session: MySession, statement: Statement, params: Any) -> Any:
        session.sock.settimeout(self.timeout + params[1])
        try:
            return session.cur.execute(statement.text, params)
        finally:
            with contextlib.suppress(OSError):
                session.sock.settimeout(self.timeout)

    def no_answer(self, exc: BaseException) -> bool:
        # PyMySQL reports its socket's timeout as error 2013, "Lost connection … (timed out)".
        return isinstance(exc, TimeoutError) or (
            isinstance(exc, pymysql.err.OperationalError)
            and bool(exc.args) and exc.args[0] == 2013 and "timed out" in str(exc)
        )  # fmt: skip

    def hung_up(self, session: MySession) -> bool:
        if not session.conn.open:
            return True
        if session.poller is not None:
            return bool(session.poller.poll(0))
        try:  # Windows: no poll()
            return bool(select.select([session.sock], [], [], 0)[0])
        except (OSError, ValueError):
            return True

    def disconnect(self, session: MySession) -> None:
        with contextlib.suppress(*ERRORS):
            session.conn.close()

    def interrupt(self, session: MySession) -> None:
        with contextlib.suppress(OSError):
            session.sock.shutdown(socket.SHUT_RDWR)
