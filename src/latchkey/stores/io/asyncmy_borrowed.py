"""MySQL and MariaDB over the application's own asyncio client (``connect_async(client=…)``):
the asyncio twin of :mod:`latchkey.stores.io.pymysql_borrowed`, with the same rules.

:class:`AsyncBorrowedPool` stands where :class:`~latchkey.stores.io.aio.AsyncPool` stands for
the asyncmy driver (``get``/``put``/``discard``/``connection``/``close``), so every primitive
and a take's pinned transaction run as on latchkey's own connections, on a connection
borrowed for that one call:

- an ``asyncmy.Pool`` or ``aiomysql.Pool``: ``await pool.acquire()`` per call, waited for up
  to the store's timeout, ``pool.release(conn)`` after it; a connection left in an unknown
  state (an error mid-request, a cancellation) is closed first, so the pool drops it and
  opens another;
- a SQLAlchemy ``AsyncEngine`` (``mysql+asyncmy``, ``mysql+aiomysql``, ``mariadb+…``):
  ``await engine.connect()`` per call, its driver's connection used
  (``get_raw_connection().driver_connection``), the SQLAlchemy connection's ``close()``
  giving it back to the engine's pool (``invalidate()`` first after an unknown state); no
  transaction of SQLAlchemy's is begun;
- a single ``asyncmy.Connection`` or ``aiomysql.Connection``: used serially under an asyncio
  lock of latchkey's, waited for up to the store's timeout.

latchkey never closes the client; ``aclose()`` has nothing of its own to close.

**Session and transactions** as on a borrowed PyMySQL connection: each request goes as one
multi-statement query (one round trip) that saves the application's ``autocommit``,
``innodb_lock_wait_timeout`` and ``time_zone``, sets latchkey's, runs the request and sets
the application's back (sent on its own after a statement the server refused); a take's
transaction runs with latchkey's settings from its start to its end. A connection inside a
transaction of the application's is refused (StoreUnavailable naming that), not joined.
MariaDB's prepared statements are not used. The restore being the last statement also keeps
the server's notes quiet: aiomysql turns the last statement's warnings into Python warnings
and asyncmy logs them, and the notes of latchkey's CREATE TABLE IF NOT EXISTS come before it.

**Multi-statements.** asyncmy and aiomysql always ask for them (whatever ``client_flag``
says), as latchkey's statements need. A connection of a subclass that clears the flag (a
"read-only" connection) tells that nowhere public: the server refusing latchkey's query as a
syntax error (1064, with nothing run) is the ConfigError that says so.

**Database.** asyncmy's connections and both pools keep their connection arguments private:
the store URL shows what they tell (an asyncmy connection's host and port), and a client
without a database is the ConfigError of error 1046 at the first call (at
``connect_async()`` for an aiomysql connection or an engine, which say).

**Timeouts.** Every call is bounded by the store's ``timeout``
(:func:`~latchkey.stores.io.aio.bounded`, as on latchkey's own asyncmy connections), so a server
that stops answering is StoreUnavailable within it. Both drivers close a connection cancelled in
the middle of a read: a pool's or an engine's is replaced; a single connection stays closed, the
application's to replace.

**aiomysql and bytes.** aiomysql escapes ``bytes`` with a PyMySQL function that PyMySQL 1.2
replaced by a placeholder string, so latchkey renders an aiomysql request's parameters
itself, as aiomysql would: bytes as hexadecimal literals (``X'…'``, binary whatever the
connection's character set), everything else with the connection's own ``escape()``; the
query then goes with no parameters.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

import asyncmy
import pymysql

from latchkey.errors import ConfigError
from latchkey.stores.io.aio import bounded
from latchkey.stores.io.mysql_dsn import no_database
from latchkey.stores.io.mysql_session import REFUSED, SESSION_ENDING, Refused
from latchkey.stores.io.pymysql_borrowed import OURS, RESTORE, SAVE, UNDO, inner_result
from latchkey.stores.rows_sql import Statement

if TYPE_CHECKING:
    from latchkey.stores.io.asyncmy import AsyncmyDriver

#: The errors of both drivers (aiomysql raises PyMySQL's).
MYSQL_ERRORS: tuple[type[BaseException], ...] = (asyncmy.errors.MySQLError, pymysql.err.MySQLError)
#: Every error a call on a borrowed connection can raise, for StoreUnavailable.
BORROWED_ERRORS: tuple[type[BaseException], ...] = (
    *MYSQL_ERRORS, OSError, asyncio.TimeoutError, Refused,
)  # fmt: skip
NO_DATABASE = 1046  # ER_NO_DB_ERROR
SYNTAX = 1064  # ER_PARSE_ERROR


def no_multi_statements(conn: Any, exc: BaseException) -> ConfigError:
    return ConfigError(
        f"latchkey needs a {type(conn).__module__}.{type(conn).__qualname__} that allows "
        "multi-statements (CLIENT.MULTI_STATEMENTS, which asyncmy and aiomysql ask for unless "
        "a subclass clears it): latchkey's statements are multi-statement, and the server "
        f"refused one as a syntax error ({exc.args[1] if len(exc.args) > 1 else exc})"
    )


def user_error(exc: BaseException) -> bool:
    """As :func:`latchkey.stores.io.asyncmy.user_error`, for either driver's errors."""
    if isinstance(exc, Refused):
        return True
    code = exc.args[0] if isinstance(exc, MYSQL_ERRORS) and exc.args else None
    return isinstance(code, int) and code < 2000 and code not in SESSION_ENDING


def _literal(conn: Any, value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return f"X'{bytes(value).hex()}'"
    if isinstance(value, tuple | list | set | frozenset):
        return f"({','.join(_literal(conn, item) for item in value)})"
    return str(conn.escape(value))


def render(conn: Any, sql: str, params: Any) -> str:
    """``sql`` with ``params`` in it, as aiomysql's cursor would (``%s`` / ``%(name)s``)."""
    if not params:
        return sql
    if isinstance(params, Mapping):
        return sql % {key: _literal(conn, value) for key, value in params.items()}
    return sql % tuple(_literal(conn, value) for value in params)


async def _settled(value: Any) -> Any:
    """A driver's answer that is awaitable in one driver and plain in the other."""
    return await value if inspect.isawaitable(value) else value


class AsyncBorrowedConnection:
    """A borrowed asyncmy or aiomysql connection, a cursor of ours, and how a request runs
    on it (the asyncio :class:`~latchkey.stores.io.pymysql_borrowed.BorrowedConnection`)."""

    __slots__ = ("conn", "cur", "held", "holder", "ours", "rendered", "timeout")

    def __init__(self, conn: Any, cur: Any, lock_wait: int, holder: Any, timeout: float) -> None:
        self.conn, self.cur, self.holder = conn, cur, holder  # holder: SQLAlchemy's connection
        self.timeout = timeout
        self.ours = OURS.format(lwt=int(lock_wait))
        self.held = False  # latchkey's settings on for a take's transaction (hold())
        self.rendered = type(conn).__module__.partition(".")[0] == "aiomysql"

    async def _execute(self, sql: str, params: Any) -> None:
        if self.rendered:
            await self.cur.execute(render(self.conn, sql, params))
        else:
            await self.cur.execute(sql, params or None)

    async def _drain(self, sql: str, params: Any, head: int, tail: int) -> tuple[list[Any], int]:
        """Every result of ``sql``: the last result set and row count of the statements
        between ``head`` statements before and ``tail`` after."""
        cur = self.cur
        await self._execute(sql, params)
        results: list[tuple[list[Any] | None, int]] = []
        while True:
            results.append((list(await cur.fetchall()) if cur.description else None, cur.rowcount))
            if not await cur.nextset():
                break
        return inner_result(results[head : len(results) - tail] or results[-1:])

    async def answer(self, request: Any) -> Any:
        sql, params, _ = request
        try:
            if self.held:
                return await self._drain(sql, params, 0, 0)
            sql = sql.strip().rstrip(";")  # (a script's last ';' would leave an empty one)
            wrapped = f"{SAVE};\n{self.ours};\n{sql};\n{RESTORE}"
            return await self._drain(wrapped, params, 2, 1)
        except MYSQL_ERRORS as exc:
            code = exc.args[0] if exc.args else None
            if code == SYNTAX and not self.held:
                # (nothing ran: without multi-statements the server parsed it all as one)
                raise no_multi_statements(self.conn, exc) from exc
            if not self.held:
                await self.restore(UNDO)
            if code == NO_DATABASE:
                raise no_database("mysql") from exc
            refused = REFUSED.get(code) if isinstance(code, int) else None
            if refused is None:
                raise
            raise refused(*exc.args) from exc

    async def statement(self, request: Statement) -> tuple[list[str] | None, list[Any]]:
        """The application's statement in a take (``params`` None: sent as is)."""
        cur = self.cur
        await self._execute(request.sql, request.params)
        columns = [column[0] for column in cur.description] if cur.description else None
        rows = list(await cur.fetchall()) if columns is not None else []
        while await cur.nextset():
            pass
        return columns, rows

    async def hold(self) -> None:
        """latchkey's settings until :meth:`restore` (a take's transaction)."""
        await self._drain(f"{SAVE};\n{self.ours}", None, 0, 0)
        self.held = True

    async def restore(self, sql: str = RESTORE) -> None:
        """The application's settings back (errors ignored: a connection that cannot take
        them is broken, its owner's to replace); ``sql``: UNDO after a refused request."""
        self.held = False
        with contextlib.suppress(*BORROWED_ERRORS):
            await bounded(self._drain(sql, None, 0, 0), self.timeout)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await _settled(self.cur.close())


class AsyncBorrowedPool:
    """Connections borrowed from the application one call at a time (module docstring): the
    asyncmy driver's ``pool``."""

    def __init__(self, driver: AsyncmyDriver, client: Any) -> None:
        self.driver, self.client = driver, client
        self.engine = hasattr(client, "sync_engine")  # a SQLAlchemy AsyncEngine
        self.pooled = not self.engine and hasattr(client, "acquire") and hasattr(client, "release")
        self._turn = asyncio.Lock()  # a single connection: one call at a time
        self._tables = False  # created (IF NOT EXISTS) by this store's first call

    async def get(self, timeout: float) -> AsyncBorrowedConnection:
        timeout = min(timeout, self.driver.backend.timeout)
        holder = None
        if self.engine:
            holder = await bounded(self.client.connect(), timeout)
            try:
                conn = (await holder.get_raw_connection()).driver_connection
            except BaseException:
                await asyncio.shield(holder.close())
                raise
        elif self.pooled:
            conn = await self._acquire(timeout)
        else:
            try:
                await bounded(self._turn.acquire(), timeout)
            except TimeoutError:
                raise TimeoutError(f"the connection stayed busy for {timeout:g}s") from None
            conn = self.client
        try:
            if conn.get_transaction_status():
                raise asyncmy.errors.InterfaceError(
                    "the connection is inside a transaction of the application's: latchkey "
                    "does not join it (commit or roll back first, or give latchkey another)"
                )
            store, limit = self.driver.store, self.driver.backend.timeout
            cur = await _settled(conn.cursor())
            borrowed = AsyncBorrowedConnection(conn, cur, store.lock_wait_timeout(), holder, limit)
            if not self._tables:
                store.prepared = False  # MariaDB's PREPAREd statements: per session, not here
                await bounded(borrowed.answer(store.tables()), limit)
                self._tables = True
        except BaseException as exc:
            known = isinstance(exc, ConfigError | Refused) or (
                isinstance(exc, MYSQL_ERRORS) and user_error(exc)
            )  # the connection is sound
            await asyncio.shield(self._give_back(conn, holder, reuse=known))
            raise
        return borrowed

    async def _acquire(self, timeout: float) -> Any:
        try:
            return await bounded(self.client.acquire(), timeout)
        except TimeoutError:
            raise TimeoutError(f"no connection of the pool came free within {timeout:g}s") from None
        except RuntimeError as exc:  # "Cannot acquire connection after closing pool"
            raise ConnectionError(f"the application's pool: {exc}") from None

    async def put(self, borrowed: AsyncBorrowedConnection) -> None:
        if borrowed.held:
            await borrowed.restore()
        await borrowed.close()
        await self._give_back(borrowed.conn, borrowed.holder, reuse=True)

    async def discard(self, borrowed: AsyncBorrowedConnection) -> None:
        """A connection in an unknown state (an error mid-request, a cancellation, maybe
        inside a take's transaction): a pool's is closed so that the pool drops it, an
        engine's invalidated; a single connection is rolled back if it can be and its
        settings restored (left to the application if the driver closed it)."""
        conn = borrowed.conn
        if not (self.engine or self.pooled):
            with contextlib.suppress(*BORROWED_ERRORS):
                if conn.get_transaction_status():
                    await bounded(conn.rollback(), self.driver.backend.timeout)
            if borrowed.held:
                await borrowed.restore()
        await borrowed.close()
        await self._give_back(conn, borrowed.holder, reuse=False)

    async def _give_back(self, conn: Any, holder: Any, *, reuse: bool) -> None:
        if self.engine:
            if not reuse:
                with contextlib.suppress(Exception):
                    await holder.invalidate()
            await holder.close()  # back to the engine's pool (never closed by latchkey)
        elif self.pooled:
            if not reuse:
                conn.close()  # the pool drops a closed connection and opens another
            await _settled(self.client.release(conn))
        else:
            self._turn.release()

    @contextlib.asynccontextmanager
    async def connection(self, timeout: float) -> AsyncIterator[AsyncBorrowedConnection]:
        """As :meth:`AsyncPool.connection`: given back after the call, discarded after an
        error that leaves it in an unknown state."""
        borrowed = await self.get(timeout)
        try:
            yield borrowed
        except Exception as exc:
            sound = isinstance(exc, ConfigError | Refused) or user_error(exc)
            await (self.put if sound else self.discard)(borrowed)
            raise
        except BaseException:  # cancelled mid-call: the protocol state is unknown
            await asyncio.shield(self.discard(borrowed))
            raise
        await self.put(borrowed)

    async def close(self) -> None:
        """Nothing of ours is held between calls; the client is never closed."""


__all__ = [
    "BORROWED_ERRORS",
    "AsyncBorrowedConnection",
    "AsyncBorrowedPool",
    "render",
    "user_error",
]
