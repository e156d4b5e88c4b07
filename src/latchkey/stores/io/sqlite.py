"""SQLite through the standard library's ``sqlite3``: the sync driver and its asyncio twin.

One connection per process and backend (SQLite serialises writers across processes anyway,
with its file lock; readers never block in WAL mode), opened on first use, set to WAL and
the store's ``synchronous`` level, its tables created; a forked child opens its own. A
primitive holds the connection for all its statements, so a transaction's statements are
never interleaved with another thread's.

sqlite3 has no non-blocking interface (every asyncio SQLite library, aiosqlite included,
runs it on a thread), so :class:`AsyncSQLiteDriver` runs each whole primitive — every
statement of it — on one worker thread of its own: one hop per primitive, and the event
loop never blocks on the database.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from latchkey.stores.io import Driver, Pinned, Pool, Steps, drive
from latchkey.stores.io.aio import AsyncDriver, AsyncPinned
from latchkey.stores.io.doorbell import AsyncBell, Bell, Doorbells, First, Listen, Ring
from latchkey.stores.rows_sql import Statement

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase

T = TypeVar("T")


class SQLiteDriver(Driver):
    errors = (sqlite3.Error, OSError)

    def __init__(self, backend: BackendBase, store: Any) -> None:
        super().__init__(backend, store)
        self._conn: sqlite3.Connection | None = None
        self._pid = 0
        self._mutex = threading.RLock()
        #: Connections of their own for takes (rows.take): a take's write transaction must
        #: not hold the shared connection, nor share it with another thread's primitives.
        self._pins: Pool[sqlite3.Connection] = Pool(self._open, _close, size=PIN_POOL_SIZE)
        #: Wake-ups between processes on this machine (none for an in-memory database).
        self.bells = Doorbells(store.path) if store.path != ":memory:" else None

    def _connection(self) -> sqlite3.Connection:
        if self._conn is not None and self._pid == os.getpid():
            return self._conn
        conn = self._open()
        self._conn, self._pid = conn, os.getpid()
        return conn

    def _open(self) -> sqlite3.Connection:
        store = self.store
        conn = sqlite3.connect(
            store.path, timeout=store.timeout, isolation_level=None, check_same_thread=False
        )
        try:
            _set_wal(conn, store.timeout)
            for statement in store.setup():
                conn.executescript(statement)
            count, create = store.tables()
            if conn.execute(count).fetchone()[0] < 3:
                try:
                    conn.executescript(create)
                except sqlite3.OperationalError as exc:
                    # Writers kept the lock past the busy timeout: fine if one of them made
                    # the tables meanwhile (a new file opened by many processes at once).
                    if "locked" not in str(exc) or conn.execute(count).fetchone()[0] < 3:
                        raise
        except BaseException:
            conn.close()
            raise
        return conn

    def answer(self, request: Any) -> Any:
        kind = type(request)
        if kind is Ring or kind is Listen or kind is First:
            return doorbell(self.bells, request)
        sql, params, many = request
        conn = self._conn
        assert conn is not None
        if many:
            return [], conn.executemany(sql, params).rowcount
        cur = conn.execute(sql, params)
        return cur.fetchall(), cur.rowcount

    def run(self, steps: Steps[T], action: str) -> T:
        with self._mutex:
            try:
                self._connection()
                return drive(steps, self.answer)
            except self.errors as exc:
                self.backend.unavailable(exc, action)

    def pin(self) -> Pinned:
        """A connection of its own for a take's transaction (see :class:`Pinned`)."""
        pins = self._pins
        with self.backend.translate("connect", self.errors):
            conn = pins.get(self.store.timeout)

        def give_back(conn: sqlite3.Connection, reuse: bool) -> None:
            (pins.put if reuse and not conn.in_transaction else pins.discard)(conn)

        bells = self.bells
        return Pinned(
            self, conn, lambda request: answer_on(conn, request, bells), give_back, user_error
        )

    def close(self) -> None:
        with self._mutex:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None
            if self.bells is not None:
                self.bells.close()
        self._pins.close()


class AsyncSQLiteDriver(AsyncDriver):
    """Runs each primitive with a :class:`SQLiteDriver` on one worker thread of its own."""

    errors = (sqlite3.Error, OSError, asyncio.TimeoutError)

    def __init__(self, backend: BackendBase, store: Any) -> None:
        super().__init__(backend, store)
        self._sync = SQLiteDriver(backend, store)
        self._thread: ThreadPoolExecutor | None = None

    async def answer(self, request: Any) -> Any:  # pragma: no cover - run() does it all
        raise NotImplementedError

    async def run(self, steps: Steps[T], action: str) -> T:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="latchkey-sqlite")
        loop = asyncio.get_running_loop()
        answer = await loop.run_in_executor(self._thread, self._sync.run, steps, action)
        if isinstance(answer, Bell):  # wait_in_line's doorbell: the loop watches its socket
            return AsyncBell(  # type: ignore[return-value]
                answer.sock, answer.bells, answer.name, answer.line
            )
        return answer

    async def pin(self) -> AsyncPinned:
        """A take's connection (the sync driver's) with a worker thread of its own for its
        statements: never this driver's one thread, where another primitive may be waiting
        for the take's write lock, nor a shared executor, whose threads could all be taken
        by other takes waiting for that lock while this one waits to commit."""
        loop = asyncio.get_running_loop()
        thread = ThreadPoolExecutor(1, thread_name_prefix="latchkey-sqlite-take")
        try:
            pinned = await loop.run_in_executor(thread, self._sync.pin)
        except BaseException:
            thread.shutdown(wait=False)
            raise

        bells = self._sync.bells

        async def answer(request: Any) -> Any:
            return await loop.run_in_executor(thread, answer_on, pinned.conn, request, bells)

        async def give_back(conn: Any, reuse: bool) -> None:
            pinned.broken = not reuse
            try:
                await loop.run_in_executor(thread, pinned.release, reuse)
            finally:
                thread.shutdown(wait=False)

        # Every call is one hop to the take's thread, bounded by SQLite's own busy timeout: no
        # second deadline around it.
        return AsyncPinned(self, pinned.conn, answer, give_back, user_error, bound=False)

    async def aclose(self) -> None:
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(self._thread, self._sync.close)
            self._thread.shutdown(wait=False)
            self._thread = None


def _set_wal(conn: sqlite3.Connection, timeout: float) -> None:
    """Put the file in WAL mode (it stays so). Two processes opening a new file at once can
    both try; the loser gets "database is locked" at once, without SQLite's busy handler, so
    it tries again (within the store's timeout): the other one's change is as good."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


#: Take connections one SQLite backend keeps (takes beyond that wait for one).
PIN_POOL_SIZE = 8


def _close(conn: sqlite3.Connection) -> None:
    conn.close()


def doorbell(bells: Doorbells | None, request: Ring | Listen | First) -> Any:
    """Ring: wake waiters (answers whether one was rung). First: the first waiter in line
    (an ``InLine``), or None. Listen: a waiter's Bell, or None (no bells here)."""
    if isinstance(request, Ring):
        return bells is not None and bells.ring(*request)
    if isinstance(request, First):
        return None if bells is None else bells.first(request.name)
    sock = None if bells is None else bells.listen(request.name)
    return None if sock is None or bells is None else Bell(sock, bells, request.name)


def answer_on(conn: sqlite3.Connection, request: Any, bells: Doorbells | None) -> Any:
    """One request on ``conn``: a Query (``(rows, rowcount)``), a Statement (``(columns,
    rows)``), or a doorbell's (see :func:`doorbell`)."""
    kind = type(request)
    if kind is Ring or kind is Listen or kind is First:
        return doorbell(bells, request)
    if kind is Statement:
        cur = conn.execute(request.sql, () if request.params is None else request.params)
        columns = [column[0] for column in cur.description] if cur.description else None
        return columns, cur.fetchall()
    sql, params, many = request
    if many:
        return [], conn.executemany(sql, params).rowcount
    cur = conn.execute(sql, params)
    return cur.fetchall(), cur.rowcount


def user_error(exc: BaseException) -> bool:
    """An application statement's own error (bad SQL, a constraint), not a busy database."""
    text = str(exc).lower()
    return isinstance(exc, sqlite3.Error) and "locked" not in text and "busy" not in text
