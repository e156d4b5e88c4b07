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

from latchkey.stores.io import Driver, Steps, drive
from latchkey.stores.io.aio import AsyncDriver

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

    def _connection(self) -> sqlite3.Connection:
        if self._conn is not None and self._pid == os.getpid():
            return self._conn
        store = self.store
        conn = sqlite3.connect(
            store.path, timeout=store.timeout, isolation_level=None, check_same_thread=False
        )
        try:
            _set_wal(conn, store.timeout)
            for statement in store.setup():
                conn.executescript(statement)
        except BaseException:
            conn.close()
            raise
        self._conn, self._pid = conn, os.getpid()
        return conn

    def answer(self, request: Any) -> Any:
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

    def close(self) -> None:
        with self._mutex:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None


class AsyncSQLiteDriver(AsyncDriver):
    """Runs each primitive with a :class:`SQLiteDriver` on one worker thread of its own."""

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
        return await loop.run_in_executor(self._thread, self._sync.run, steps, action)

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
