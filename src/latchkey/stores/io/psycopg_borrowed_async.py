"""PostgreSQL over the application's own asyncio psycopg pool, connection or SQLAlchemy
AsyncEngine (``connect_async(client=…)``): the asyncio twin of
:mod:`latchkey.stores.io.psycopg_borrowed`, with the same rules:

- a ``psycopg_pool.AsyncConnectionPool``: ``await getconn(timeout)`` per call, ``await
  putconn()`` after it (also after an error: the pool checks the connection and replaces a
  broken one);
- a SQLAlchemy ``AsyncEngine`` (postgresql+psycopg): ``await engine.connect()`` per call, its
  psycopg ``AsyncConnection`` (``get_raw_connection().driver_connection``) used, the
  SQLAlchemy connection's ``close()`` giving it back to the engine's pool; no transaction of
  SQLAlchemy's is begun (transactions stay the application's);
- a single ``psycopg.AsyncConnection``: used serially under an asyncio lock of latchkey's.

While lent, a connection is in autocommit and switched back when given back; one inside a
transaction of the application's is refused (StoreUnavailable naming that). Every statement
runs with latchkey's ``statement_timeout`` and ``TimeZone=UTC`` local to its own implicit
transaction (one pipeline, one round trip), so the application's session settings are
neither relied on nor changed. A statement still running a second past the store's timeout
has its socket shut down (:func:`~latchkey.stores.io.aio.cut_after`, as on latchkey's own
connections): that one connection of the application's breaks and its pool replaces it.
The listener opens a connection of its own from the client's settings, closed by ``aclose()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import pq

from latchkey.stores.io.aio import cut_after
from latchkey.stores.io.psycopg import DRIVER_ERRORS, IDLE
from latchkey.stores.io.psycopg_async import AsyncLink, _ready
from latchkey.stores.io.psycopg_borrowed import (
    PIPELINE_SYNC,
    SETTINGS,
    leave_pipeline,
    send_after_settings,
    statement_result,
)

if TYPE_CHECKING:
    from latchkey.stores.io.psycopg_async import AsyncPsycopgDriver


def is_async_engine(client: Any) -> bool:
    """A SQLAlchemy AsyncEngine."""
    return hasattr(client, "sync_engine")


class AsyncBorrowedLinks:
    """Links over connections borrowed from the application, one call at a time; the
    asyncio driver's ``pool``."""

    def __init__(self, driver: AsyncPsycopgDriver, client: Any) -> None:
        self.driver, self.client = driver, client
        self.engine = is_async_engine(client)
        self.pooled = hasattr(client, "getconn") and hasattr(client, "putconn")
        #: Callers at once: the application's pool bounds them (a single connection: one).
        self.size = 64 if self.engine or self.pooled else 1
        self._holders: dict[int, Any] = {}  # id(psycopg connection) -> SQLAlchemy connection
        self._turn = asyncio.Lock()
        self._prepared: weakref.WeakKeyDictionary[Any, set[bytes]] = weakref.WeakKeyDictionary()
        self._was_autocommit: dict[int, bool] = {}

    async def get(self, timeout: float) -> AsyncLink:
        if self.engine:
            holder = await self.client.connect()
            try:
                conn = (await holder.get_raw_connection()).driver_connection
            except BaseException:
                await holder.close()
                raise
            self._holders[id(conn)] = holder
        elif self.pooled:
            conn = await self.client.getconn(timeout)
        else:
            try:
                await asyncio.wait_for(self._turn.acquire(), timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(f"the connection stayed busy for {timeout:g}s") from None
            conn = self.client
        try:
            was = conn.autocommit
            if not was:
                await conn.set_autocommit(True)  # refused inside the application's transaction
        except BaseException:
            await self._give_back(conn)
            raise
        link = AsyncBorrowedLink(self.driver)
        link.conn = conn
        link.prepared = self._prepared.setdefault(conn, set())
        self._was_autocommit[id(link)] = was
        return link

    async def put(self, link: AsyncLink) -> None:
        conn, link.conn = link.conn, None
        was = self._was_autocommit.pop(id(link), True)
        if conn is None:
            return
        if not was and not (conn.closed or conn.broken):
            with contextlib.suppress(*DRIVER_ERRORS):
                await conn.set_autocommit(False)
        await self._give_back(conn)

    async def discard(self, link: AsyncLink) -> None:
        """Given back all the same: the application's pool checks and replaces it."""
        await self.put(link)

    async def _give_back(self, conn: Any) -> None:
        if self.engine:
            await self._holders.pop(id(conn)).close()
        elif self.pooled:
            await self.client.putconn(conn)
        else:
            self._turn.release()

    async def close(self) -> None:
        """Nothing of ours is held between calls; the client is never closed."""


class AsyncBorrowedLink(AsyncLink):
    """An :class:`AsyncLink` over a borrowed connection: each statement after latchkey's
    settings, local to its transaction."""

    def __init__(self, driver: AsyncPsycopgDriver) -> None:
        super().__init__(driver)
        self.statement_timeout = str(max(1, int(driver.timeout * 1000)))

    async def _run_prepared(
        self, pgconn: pq.abc.PGconn, name: bytes, query: bytes,
        params: Sequence[bytes], formats: Sequence[int] | None, binary: bool,
    ) -> pq.abc.PGresult:  # fmt: skip
        for again in (True, False):
            prepare = name not in self.prepared
            try:
                send_after_settings(
                    pgconn, self.statement_timeout, name, query, params, formats, binary, prepare
                )
                results = await _pipeline_results(pgconn)
            finally:
                leave_pipeline(pgconn)
            result = statement_result(results, self.prepared, name, prepare, again)
            if result is not None:
                return result
        raise AssertionError("unreachable")

    async def execute(self, query: str, params: Sequence[Any] | None) -> tuple[list[Any], int]:
        conn = self.conn
        assert conn is not None
        if conn.pgconn.transaction_status != IDLE:  # a take's: its BEGIN set them already
            return await super().execute(query, params)
        if params is None:
            head = f"SET LOCAL statement_timeout = {self.statement_timeout}; "
            return await super().execute(f"{head}SET LOCAL TimeZone = 'UTC'; {query}", None)

        async def run() -> tuple[list[Any], int]:
            cur = psycopg.AsyncRawCursor(conn)
            async with conn.pipeline():
                settings = psycopg.AsyncRawCursor(conn)
                await settings.execute(SETTINGS.decode(), [self.statement_timeout])
                await cur.execute(query, params, prepare=True)
            result = cur.pgresult
            tuples = result is not None and result.status == pq.ExecStatus.TUPLES_OK
            return (await cur.fetchall() if tuples else []), cur.rowcount

        return await cut_after(run(), self.statement_guard, conn.pgconn.socket)

    async def run_statement(self, cur: psycopg.AsyncCursor[Any], sql: str, params: Any) -> None:
        """A take's or a lease's statement: outside a transaction, after the settings."""
        conn = cur.connection
        if conn.pgconn.transaction_status != IDLE:
            await cur.execute(sql, params)
            return
        async with conn.pipeline():
            settings = psycopg.AsyncRawCursor(conn)
            await settings.execute(SETTINGS.decode(), [self.statement_timeout])
            await cur.execute(sql, params)


async def _pipeline_results(pgconn: pq.abc.PGconn) -> list[pq.abc.PGresult]:
    """Every result of the pipeline sent, up to its sync, the event loop watching the socket."""
    loop = asyncio.get_running_loop()
    fd = pgconn.socket
    while pgconn.flush():
        await _ready(loop, fd, loop.add_writer, loop.remove_writer)
    results: list[pq.abc.PGresult] = []
    while True:
        while pgconn.is_busy():
            await _ready(loop, fd, loop.add_reader, loop.remove_reader)
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:
            continue
        if result.status == PIPELINE_SYNC:
            return results
        results.append(result)
