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

One deadline per call, as on ``mysql://`` (:mod:`latchkey.stores.io.pymysql`): a primitive
that makes several round trips (a busy GET_LOCK, then who holds it; opening the main session
first) ends within the store's timeout, each statement's socket timeout being the time the
call has left; a wait in the server moves the deadline to the wait's length plus the timeout
from when it starts. Past the deadline, before a statement is sent: ``Overdue`` with the
session kept (nothing was sent); a statement that timed out ends its session (PyMySQL closes
it), and the locks in it with it, as before.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from typing import Any, TypeVar

import pymysql

from latchkey.stores.io import Steps
from latchkey.stores.io.mysql_dsn import connect_args
from latchkey.stores.io.mysql_session import Overdue
from latchkey.stores.io.pymysql import SLACK, connect, socket_of
from latchkey.stores.io.sessions import Session, SessionDriver
from latchkey.stores.sessionlocks import ROWS, YES, Statement

T = TypeVar("T")
ERRORS = (pymysql.err.MySQLError, OSError)


class _Call(threading.local):
    """This thread's call in progress: the monotonic time it ends (None: no call)."""

    deadline: float | None = None


class MySession(Session):
    """A session and its one cursor, reused by every call on it, on our own socket."""

    __slots__ = ("cur", "current", "poller", "sock")

    def __init__(self, conn: Any, sock: socket.socket, spare: bool, timeout: float) -> None:
        super().__init__(conn, conn.thread_id(), conn.get_server_info(), spare)
        self.cur = conn.cursor()
        self.sock = sock
        self.current = timeout  # the socket's timeout now
        self.poller = select.poll() if hasattr(select, "poll") else None
        if self.poller is not None:
            self.poller.register(sock, select.POLLIN)


class PyMySQLSessions(SessionDriver):
    driver_errors = ERRORS

    def __init__(self, backend: Any, store: Any) -> None:
        super().__init__(backend, store)
        self.args = connect_args(backend)
        self.call = _Call()

    def run(self, steps: Steps[T], action: str) -> T:
        call = self.call
        outer = call.deadline
        call.deadline = time.monotonic() + self.timeout
        try:
            return super().run(steps, action)
        finally:
            call.deadline = outer

    def connect(self, spare: bool) -> MySession:
        # on a socket of our own (latchkey.stores.io.pymysql), by the call's deadline
        conn = connect(self.args, self.call.deadline)
        sock = socket_of(conn)
        assert sock is not None
        return MySession(conn, sock, spare, self.timeout)

    def bound(self, session: MySession) -> None:
        """Before a statement: the socket's timeout is the time the call has left (set only
        when off by more than ``SLACK``); past the deadline, ``Overdue``."""
        deadline = self.call.deadline
        if deadline is None:  # outside a call (close() unlocking), or borrowed (Lending.run):
            return  # the socket's timeouts as they are
        left = deadline - time.monotonic()
        if left <= 0:
            raise Overdue(f"no answer within {self.timeout:g}s")
        if not -SLACK <= session.current - left <= SLACK:
            session.sock.settimeout(left)
            session.current = left

    def usable(self, session: MySession, exc: BaseException) -> bool:
        return isinstance(exc, Overdue)  # nothing was sent

    def execute(self, session: MySession, statement: Statement, params: Any) -> Any:
        self.bound(session)
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
        # The wait's length plus the timeout, from now: for the wait and what follows it.
        self.call.deadline = time.monotonic() + self.timeout + params[1]
        session.sock.settimeout(self.timeout + params[1])
        session.current = self.timeout + params[1]
        return session.cur.execute(statement.text, params)

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
