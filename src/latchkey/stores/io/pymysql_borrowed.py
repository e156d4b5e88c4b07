"""MySQL and MariaDB over the application's own PyMySQL connection or SQLAlchemy Engine
(``mysql+pymysql`` / ``mariadb+pymysql``): ``latchkey.connect(client=…)``.

:class:`BorrowedPool` stands where the driver's own :class:`~latchkey.stores.io.Pool` stands
(``get``/``put``/``discard``/``close``), so every primitive and a take's pinned transaction
run as on latchkey's own connections, on a connection borrowed for that one call:

- a SQLAlchemy ``Engine``: ``engine.raw_connection()`` per call, its PyMySQL connection used,
  the proxy's ``close()`` giving it back to the engine's pool (a connection left in an unknown
  state is invalidated instead: the pool replaces it);
- a single ``pymysql.connections.Connection``: used serially under a lock of latchkey's,
  waited for up to the store's timeout (don't use the same connection from another thread at
  the same time).

**Multi-statements.** latchkey's hot statements (a MySQL acquire, a semaphore's, a claim, an
extend) are multi-statement queries, one round trip each: a borrowed connection must have been
opened with ``client_flag=pymysql.constants.CLIENT.MULTI_STATEMENTS`` (for an engine:
``connect_args={"client_flag": …}``). One without it is a ConfigError saying so — at
``connect()`` for a connection, at the first call for an engine (whose flags show only on a
connection it opened).

**Session.** latchkey's own connections run with ``autocommit=1``, ``time_zone='+00:00'`` and
``innodb_lock_wait_timeout`` half the store's timeout. On a borrowed connection each request
goes as one multi-statement query (still one round trip): the application's three values are
saved in user variables (``@lk_ac``, ``@lk_lwt``, ``@lk_tz``), latchkey's set, the request
run, and the application's set back; when a statement fails, the restore is sent on its own
after the error. So the connection goes back with the application's settings and latchkey's
statements never depend on them. A connection inside a transaction of the application's
(PyMySQL's own status flag, no round trip) is refused — StoreUnavailable naming that —
rather than joined: a lease written inside someone else's transaction would be rolled back
with it, and switching autocommit on would commit it. A take's transaction (``store.rows``)
runs with latchkey's settings from its start to its end, then the application's come back.
MariaDB's prepared statements (per session) are not used on a borrowed connection.

**Timeouts.** The client's socket timeouts are the client's (PyMySQL's default is none): a
server that stops answering blocks a call as long as it blocks the application's own. A row
lock held by a stalled peer is bounded by ``innodb_lock_wait_timeout`` as on latchkey's own.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any

import pymysql
from pymysql.constants import CLIENT, SERVER_STATUS

from latchkey.errors import ConfigError
from latchkey.stores.io.mysql_session import REFUSED
from latchkey.stores.io.pymysql import DRIVER_ERRORS, drain, statement
from latchkey.stores.rows_sql import Statement

if TYPE_CHECKING:
    from latchkey.stores.io.pymysql import PyMySQLDriver

#: Save the application's session settings, then set latchkey's ({lwt}: whole seconds).
SAVE = (
    "SET @lk_ac = @@SESSION.autocommit, @lk_lwt = @@SESSION.innodb_lock_wait_timeout, "
    "@lk_tz = @@SESSION.time_zone"
)
OURS = "SET SESSION autocommit = 1, innodb_lock_wait_timeout = {lwt}, time_zone = '+00:00'"
#: Give the application's settings back.
RESTORE = "SET SESSION autocommit = @lk_ac, innodb_lock_wait_timeout = @lk_lwt, time_zone = @lk_tz"
#: After a request the server refused: first end the transaction the request may have left
#: open (a batch claim's, whose lock-wait timeout rolls back only the statement: switching
#: autocommit back on would commit the rest), then the application's settings back.
UNDO = f"ROLLBACK;\n{RESTORE}"
_IN_TRANS = SERVER_STATUS.SERVER_STATUS_IN_TRANS


def multi_statements(conn: Any) -> bool:
    """Whether a PyMySQL connection was opened with CLIENT.MULTI_STATEMENTS."""
    return bool(getattr(conn, "client_flag", 0) & CLIENT.MULTI_STATEMENTS)


def no_multi_statements(shown: str) -> ConfigError:
    return ConfigError(
        f"latchkey needs a {shown} opened with client_flag=CLIENT.MULTI_STATEMENTS (from "
        "pymysql.constants import CLIENT; pymysql.connect(…, client_flag=CLIENT."
        'MULTI_STATEMENTS), or create_engine(url, connect_args={"client_flag": '
        "CLIENT.MULTI_STATEMENTS | CLIENT.FOUND_ROWS})): its statements are multi-statement"
    )


def drain_inner(cur: Any, sql: str, params: Any, head: int, tail: int) -> tuple[list[Any], int]:
    """As :func:`~latchkey.stores.io.pymysql.drain`, for a query wrapped in ``head``
    statements before and ``tail`` after: the request's own last result set and row count."""
    cur.execute(sql, params or None)
    results: list[tuple[list[Any] | None, int]] = []
    while True:
        results.append((list(cur.fetchall()) if cur.description else None, cur.rowcount))
        if not cur.nextset():
            break
    return inner_result(results[head : len(results) - tail])


def inner_result(inner: list[tuple[list[Any] | None, int]]) -> tuple[list[Any], int]:
    """The request's own answer among its statements' (result set or None, row count): the
    last result set, and the row count of the last statement without one."""
    rows: list[Any] = []
    count = inner[0][1]
    for found, rowcount in inner:
        if found is not None:
            rows = found
        else:
            count = rowcount
    return rows, count


class BorrowedConnection:
    """A borrowed PyMySQL connection, a cursor of ours, and how a request runs on it."""

    __slots__ = ("conn", "cur", "held", "ours")

    def __init__(self, conn: Any, lock_wait: int) -> None:
        self.conn = conn
        self.cur = conn.cursor()
        self.ours = OURS.format(lwt=int(lock_wait))
        self.held = False  # latchkey's settings on for a take's transaction (hold())

    def answer(self, request: Any) -> Any:
        sql, params, _ = request
        try:
            if self.held:
                return drain(self.cur, sql, params)
            sql = sql.strip().rstrip(";")  # (a script's last ';' would leave an empty one)
            return drain_inner(self.cur, f"{SAVE};\n{self.ours};\n{sql};\n{RESTORE}", params, 2, 1)
        except pymysql.err.MySQLError as exc:
            if not self.held:
                self.restore(UNDO)
            refused = REFUSED.get(exc.args[0]) if exc.args else None
            if refused is None:
                raise
            raise refused(*exc.args) from exc

    def begin(self) -> None:
        """A call starts: nothing to bound (the client's own socket timeouts apply)."""

    def statement(self, request: Statement) -> tuple[list[str] | None, list[Any]]:
        return statement(self.cur, request)

    def hold(self) -> None:
        """latchkey's settings until :meth:`restore` (a take's transaction)."""
        drain(self.cur, f"{SAVE};\n{self.ours}", None)
        self.held = True

    def restore(self, sql: str = RESTORE) -> None:
        """The application's settings back (errors ignored: a connection that cannot take
        them is broken, its owner's to replace); ``sql``: UNDO after a refused request."""
        self.held = False
        with contextlib.suppress(*DRIVER_ERRORS):
            if self.conn.open:
                drain(self.cur, sql, None)

    def close(self) -> None:
        with contextlib.suppress(*DRIVER_ERRORS):
            self.cur.close()


class BorrowedPool:
    """Connections borrowed from the application one call at a time (module docstring):
    the driver's ``pool``."""

    size = 1

    def __init__(self, driver: PyMySQLDriver, client: Any) -> None:
        self.driver, self.client = driver, client
        self.engine = hasattr(client, "raw_connection") and hasattr(client, "dialect")
        self.shown = type(client).__qualname__
        if not self.engine and not multi_statements(client):
            raise no_multi_statements(f"pymysql {self.shown}")
        self._fairies: dict[int, Any] = {}  # id(PyMySQL connection) -> SQLAlchemy's proxy
        self._turn = threading.Lock()  # a single connection: one call at a time
        self._tables = False  # created (IF NOT EXISTS) by this store's first call

    def get(self, timeout: float | None = None) -> BorrowedConnection:
        if self.engine:
            fairy = self.client.raw_connection()
            conn = fairy.driver_connection
            self._fairies[id(conn)] = fairy
        else:
            wait = self.driver.backend.timeout if timeout is None else timeout
            if not self._turn.acquire(timeout=wait):
                raise TimeoutError(f"the connection stayed busy for {wait:g}s")
            conn = self.client
        try:
            if not multi_statements(conn):
                raise no_multi_statements(f"SQLAlchemy engine whose {type(conn).__qualname__}")
            if conn.server_status & _IN_TRANS:
                raise pymysql.err.InterfaceError(
                    "the connection is inside a transaction of the application's: latchkey "
                    "does not join it (commit or roll back first, or give latchkey another)"
                )
            store = self.driver.store
            borrowed = BorrowedConnection(conn, store.lock_wait_timeout())
            if not self._tables:
                store.prepared = False  # MariaDB's PREPAREd statements: per session, not here
                borrowed.answer(store.tables())
                self._tables = True
        except BaseException:
            self._give_back(conn, reuse=True)
            raise
        return borrowed

    def put(self, borrowed: BorrowedConnection) -> None:
        if borrowed.held:
            borrowed.restore()
        borrowed.close()
        self._give_back(borrowed.conn, reuse=True)

    def discard(self, borrowed: BorrowedConnection) -> None:
        """A connection in an unknown state (an error mid-request, maybe inside a take's
        transaction): an engine's is invalidated (its pool opens another); a single
        connection is rolled back if it can be and its settings restored."""
        conn = borrowed.conn
        if not self.engine:
            with contextlib.suppress(*DRIVER_ERRORS):
                if conn.open and conn.server_status & _IN_TRANS:
                    conn.rollback()
            if borrowed.held:
                borrowed.restore()
        borrowed.close()
        self._give_back(conn, reuse=False)

    def _give_back(self, conn: Any, *, reuse: bool) -> None:
        if self.engine:
            fairy = self._fairies.pop(id(conn))
            if not reuse:
                fairy.invalidate()
            fairy.close()  # back to the engine's pool (never closed by latchkey)
        else:
            self._turn.release()

    def close(self) -> None:
        """Nothing of ours is held between calls; the client is never closed."""
