"""PostgreSQL over the application's own psycopg pool or connection (``connect(client=…)``).

:class:`BorrowedLinks` stands where the driver's own :class:`~latchkey.stores.io.Pool` of
links stands (``get``/``put``/``discard``/``close``), so every primitive and a take's pinned
transaction run as they do on latchkey's own connections, on a connection borrowed for that
one call:

- a ``psycopg_pool.ConnectionPool``: ``getconn(timeout)`` per call (the store's timeout: a
  full pool is StoreUnavailable after it), ``putconn`` after it, also after an error (the
  pool checks the connection and replaces a broken one: latchkey never closes it);
- a SQLAlchemy ``Engine`` (postgresql+psycopg): ``engine.raw_connection()`` per call, its
  psycopg connection used, the proxy's ``close()`` giving it back to the engine's pool
  (which resets it on return); transactions stay the application's (below);
- a single ``psycopg.Connection``: used serially under a lock of latchkey's (callers of one
  store take turns; the application's own use of the connection is not serialised with
  latchkey's: give latchkey a connection no other thread uses at the same time).

While borrowed, a connection is switched to autocommit (each lease statement commits by
itself, as on latchkey's own connections) and switched back when given back; a connection
inside a transaction of the application's cannot be switched and the call fails with
StoreUnavailable naming that (latchkey never joins the application's transaction). Hot
statements are prepared once per connection (remembered per connection, weakly).

Session settings: latchkey's own connections run with ``statement_timeout`` = the store's
timeout and ``TimeZone=UTC``; a borrowed one has the application's (any statement_timeout,
none, or one shorter than a lease statement's wait for a row lock; any TimeZone, which the
``where`` of ``store.rows`` would otherwise read naive timestamps in). latchkey neither
changes nor restores them: each of its statements on a borrowed connection runs in one
implicit transaction (one libpq pipeline, one round trip) that begins with ``SELECT
set_config('statement_timeout', …, true), set_config('TimeZone', 'UTC', true)`` — settings
local to that transaction, gone at its end, so the connection goes back to the application's
pool with the application's settings untouched. Inside a take's explicit transaction (begun
the same way) the settings last until its COMMIT or ROLLBACK. A script (the tables' creation)
goes as one simple query whose first statements are the same ``SET LOCAL``.

The local watchdog stays: a statement still running a second past the store's timeout — the
server stopped answering altogether, as the server's own ``statement_timeout`` ends any
statement of a running server first — has its socket shut down, which breaks that one
connection of the application's: libpq marks it bad and the application's pool (or SQLAlchemy
at its next checkout) discards it and opens another; a single borrowed connection stays broken
for the application to replace. No gentler way unblocks libpq's blocking read of a server that
does not answer (a cancel request needs the same server to answer).

Waiting (LISTEN/NOTIFY and the hand-over queue) needs a connection that stays with latchkey:
the listener opens one of its own, from the pool's connection settings (or the single
connection's parameters and password), and closes it on ``store.close()``.
"""

from __future__ import annotations

import contextlib
import select
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import pq

from latchkey.stores.io.psycopg import (
    DRIVER_ERRORS,
    IDLE,
    Link,
    _libpq_keywords,
    deallocated,
    result_error,
)

if TYPE_CHECKING:
    from latchkey.stores.io.psycopg import PsycopgDriver


def is_pool(client: Any) -> bool:
    """A psycopg_pool pool (as opposed to a single connection)."""
    return hasattr(client, "getconn") and hasattr(client, "putconn")


def is_engine(client: Any) -> bool:
    """A SQLAlchemy Engine (its pool lends DB-API connections through raw_connection())."""
    return hasattr(client, "raw_connection") and hasattr(client, "dialect")


def listener_params(client: Any) -> dict[str, Any]:
    """libpq parameters of a connection of our own like the client's, for the listener."""
    if hasattr(client, "url") and hasattr(client, "dialect"):  # an Engine, an AsyncEngine
        url = client.url
        params = {"host": url.host, "port": url.port, "user": url.username,
                  "password": url.password, "dbname": url.database}  # fmt: skip
        params = {k: v for k, v in params.items() if v is not None}
    elif is_pool(client):
        params = psycopg.conninfo.conninfo_to_dict(client.conninfo, **(client.kwargs or {}))
    else:
        params = dict(client.info.get_parameters())
        if client.info.password:
            params["password"] = client.info.password
    known = _libpq_keywords() | {"host", "port", "dbname", "user"}
    return {key: value for key, value in params.items() if key in known}


def send_after_settings(
    pgconn: pq.abc.PGconn, statement_timeout: str, name: bytes, query: bytes,
    params: Sequence[bytes], formats: Sequence[int] | None, binary: bool, prepare: bool,
) -> None:  # fmt: skip
    """Enter pipeline mode and send latchkey's settings, the PREPARE if ``prepare``, the
    prepared statement and a sync: one round trip (the sync and asyncio links read it back)."""
    pgconn.enter_pipeline_mode()
    pgconn.send_query_params(SETTINGS, [statement_timeout.encode()])
    if prepare:
        pgconn.send_prepare(name, query)
    pgconn.send_query_prepared(name, params, formats, 1 if binary else 0)
    pgconn.pipeline_sync()


def leave_pipeline(pgconn: pq.abc.PGconn) -> None:
    """Leave pipeline mode; left mid-pipeline, the connection is broken, its pool's to
    replace."""
    with contextlib.suppress(*DRIVER_ERRORS):
        pgconn.exit_pipeline_mode()


def statement_result(
    results: list[pq.abc.PGresult], prepared: set[bytes], name: bytes, prepare: bool,
    again: bool,
) -> pq.abc.PGresult | None:  # fmt: skip
    """The statement's result from a pipeline of :func:`send_after_settings`; None when its
    prepared statement was deallocated behind our back and may be prepared again (``again``).
    A failure of the settings, the PREPARE or the statement is raised."""
    for result in results[:-1]:  # the settings, the PREPARE: both must have worked
        if result.status in FAILED:
            raise result_error(result)
    if prepare:
        prepared.add(name)
    result = results[-1]
    if result.status not in FAILED:
        return result
    if not (again and deallocated(result)):
        raise result_error(result)
    prepared.discard(name)  # prepare it again, once
    return None


class BorrowedLinks:
    """Links over connections borrowed from the application, one call at a time (see the
    module docstring); the driver's ``pool``."""

    size = 1

    def __init__(self, driver: PsycopgDriver, client: Any) -> None:
        self.driver, self.client = driver, client
        self.pooled = is_pool(client)
        self.engine = is_engine(client)
        self._fairies: dict[int, Any] = {}  # id(psycopg connection) -> SQLAlchemy's proxy
        self._turn = threading.Lock()  # a single connection: one call at a time
        self._prepared: weakref.WeakKeyDictionary[Any, set[bytes]] = weakref.WeakKeyDictionary()
        self._was_autocommit: dict[int, bool] = {}

    def get(self, timeout: float | None = None) -> Link:
        if self.engine:  # checked out of the engine's pool: "transactions left to the app"
            fairy = self.client.raw_connection()
            conn = fairy.driver_connection
            self._fairies[id(conn)] = fairy
        elif self.pooled:
            conn = self.client.getconn(timeout)
        else:
            if not self._turn.acquire(timeout=-1 if timeout is None else timeout):
                raise TimeoutError(f"the connection stayed busy for {timeout:g}s")
            conn = self.client
        try:
            was = conn.autocommit
            if not was:
                conn.autocommit = True  # ProgrammingError inside the application's transaction
        except BaseException:
            self._give_back(conn)
            raise
        link = BorrowedLink(self.driver)
        link.conn = conn
        link.prepared = self._prepared.setdefault(conn, set())
        self._was_autocommit[id(link)] = was
        return link

    def put(self, link: Link) -> None:
        conn, link.conn = link.conn, None
        was = self._was_autocommit.pop(id(link), True)
        if conn is None:
            return
        if not was and not (conn.closed or conn.broken):
            with contextlib.suppress(*DRIVER_ERRORS):
                conn.autocommit = False
        self._give_back(conn)

    def discard(self, link: Link) -> None:
        """A link in an unknown state: given back all the same (the application's pool checks
        and replaces it; a single connection is the application's to close)."""
        self.put(link)

    def _give_back(self, conn: Any) -> None:
        if self.engine:
            self._fairies.pop(id(conn)).close()  # back to the engine's pool (never closed)
        elif self.pooled:
            self.client.putconn(conn)
        else:
            self._turn.release()

    def close(self) -> None:
        """Nothing of ours is held between calls; the client is never closed."""


#: latchkey's session settings, local to the transaction of one statement (see above).
SETTINGS = b"SELECT set_config('statement_timeout', $1, true), set_config('TimeZone', 'UTC', true)"
PIPELINE_SYNC = pq.ExecStatus.PIPELINE_SYNC
FAILED = (pq.ExecStatus.FATAL_ERROR, pq.ExecStatus.PIPELINE_ABORTED)


class BorrowedLink(Link):
    """A :class:`Link` over a borrowed connection: every statement runs with latchkey's
    session settings local to its own transaction (see the module docstring)."""

    def __init__(self, driver: PsycopgDriver) -> None:
        super().__init__(driver)
        self.statement_timeout = str(max(1, int(driver.timeout * 1000)))

    def run_prepared(
        self, name: bytes, query: bytes, params: Sequence[bytes],
        formats: Sequence[int] | None = None, binary: bool = False,
    ) -> pq.abc.PGresult:  # fmt: skip
        """As :meth:`Link.run_prepared`, in one pipeline after the settings."""
        assert self.conn is not None
        pgconn = self.conn.pgconn
        for again in (True, False):
            prepare = name not in self.prepared
            try:
                send_after_settings(
                    pgconn, self.statement_timeout, name, query, params, formats, binary, prepare
                )
                results = _pipeline_results(pgconn)
            finally:
                leave_pipeline(pgconn)
            result = statement_result(results, self.prepared, name, prepare, again)
            if result is not None:
                return result
        raise AssertionError("unreachable")

    def execute(self, query: str, params: Sequence[Any] | None) -> tuple[list[Any], int]:
        """As :meth:`Link.execute`, after the settings: a script (``params`` None) as one
        simple query that begins with them, a statement in one pipeline after them."""
        assert self.conn is not None
        conn = self.conn
        if conn.pgconn.transaction_status != IDLE:  # a take's: its BEGIN set them already
            return super().execute(query, params)
        if params is None:
            head = f"SET LOCAL statement_timeout = {self.statement_timeout}; "
            return super().execute(f"{head}SET LOCAL TimeZone = 'UTC'; {query}", None)
        cur = psycopg.RawCursor(conn)
        with conn.pipeline():
            psycopg.RawCursor(conn).execute(SETTINGS.decode(), [self.statement_timeout])
            cur.execute(query, params, prepare=True)
        result = cur.pgresult
        tuples = result is not None and result.status == pq.ExecStatus.TUPLES_OK
        return (cur.fetchall() if tuples else []), cur.rowcount

    def run_statement(self, cur: psycopg.Cursor[Any], sql: str, params: Any) -> None:
        """A take's (or a lease's) own statement on ``cur``: outside a transaction, in one
        pipeline after the settings."""
        conn = cur.connection
        if conn.pgconn.transaction_status != IDLE:
            cur.execute(sql, params)
            return
        with conn.pipeline():
            psycopg.RawCursor(conn).execute(SETTINGS.decode(), [self.statement_timeout])
            cur.execute(sql, params)


def _pipeline_results(pgconn: pq.abc.PGconn) -> list[pq.abc.PGresult]:
    """Every result of the pipeline sent, up to its sync (waiting on the socket, so that
    the GIL is free meanwhile and the watchdog's shutdown ends the wait)."""
    while pgconn.flush():  # 1: more to send (the socket's buffer was full)
        _wait(pgconn.socket, write=True)
    results: list[pq.abc.PGresult] = []
    while True:
        while pgconn.is_busy():
            _wait(pgconn.socket, write=False)
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:  # the end of one statement's results
            continue
        if result.status == PIPELINE_SYNC:
            return results
        results.append(result)


def _wait(fd: int, *, write: bool) -> None:
    """Until ``fd`` is ready (or hung up, or shut down by the watchdog)."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLOUT if write else select.POLLIN)
        poller.poll()
    else:  # Windows
        select.select([] if write else [fd], [fd] if write else [], [])
