"""MySQL and MariaDB through asyncmy: the asyncio driver of ``mysql://`` (and the helpers
the GET_LOCK store's asyncio backend shares).

Driver: asyncmy (Cython, PyMySQL's protocol rewritten for asyncio), not aiomysql. Measured on
the uncontended acquire+release pair (the MariaDB ``EXECUTE`` statements, one connection,
MariaDB 10.11 on loopback, CPython 3.11, a 2-core machine shared with other work, so the
client CPU per pair is the steadier figure): asyncmy ~160 µs of client CPU a pair (~1,400-1,700
pairs/s when the machine was quiet), ~200 µs with each call bounded by ``asyncio.timeout``;
aiomysql 0.3.2 ~210-275 µs (~1,000-1,500 pairs/s). aiomysql also fails on ``bytes`` parameters
with PyMySQL ≥ 1.2 (it imports ``escape_bytes_prefixed``, which PyMySQL 1.2 turned into a
placeholder string) and turns server notes into Python warnings. asyncmy's own
``read_timeout`` is not used: it wraps every packet read in ``wait_for`` (~250 µs a pair); one
deadline per primitive (:func:`~latchkey.stores.io.aio.bounded`: one timer per event loop,
:mod:`latchkey.stores.io.deadlines`) bounds the whole exchange instead.

Connections: an :class:`~latchkey.stores.io.aio.AsyncPool` (at most ``POOL_SIZE``), each with
its cursor and the store's ``setup()`` run on it. A connection that failed, timed out or was
cancelled in the middle of a call is closed, never put back; one idle for ``IDLE_PING``
seconds or more is pinged before use (the server may have ended it: restart, idle timeout,
KILL; asyncmy offers no public way to see that without a round trip), and replaced if it does
not answer. Opening a connection or that ping, and the primitive after it, share one deadline:
the call ends within the store's timeout from when it began to use its connection. Requests
and answers are the sync driver's (:mod:`latchkey.stores.io.pymysql`), and so is the choice
of a host from a host list (the first that takes writes).
Over the application's own asyncmy or aiomysql connection, pool or SQLAlchemy AsyncEngine
(``connect_async(client=…)``) the pool is a
:class:`~latchkey.stores.io.asyncmy_borrowed.AsyncBorrowedPool` (that module says how it
borrows).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import asyncmy
from asyncmy.constants import CLIENT

from latchkey.errors import StoreUnavailable
from latchkey.stores.io import Steps
from latchkey.stores.io.aio import (
    GRANTING,
    AsyncDriver,
    AsyncPinned,
    AsyncPool,
    adrive,
    bounded,
    to_the_end,
)
from latchkey.stores.io.mysql_bell import AsyncBell
from latchkey.stores.io.mysql_dsn import (
    WRITABLE,
    Hosts,
    address_text,
    async_args,
    connect_args,
    hosts_of,
    read_only,
    reason,
)
from latchkey.stores.io.mysql_session import READ_ONLY, REFUSED, SESSION_ENDING, Refused
from latchkey.stores.rows_sql import Statement

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase

T = TypeVar("T")

#: Every error a driver call can raise (a timeout is asyncio's, and OSError's on 3.11+).
ASYNC_DRIVER_ERRORS: tuple[type[BaseException], ...] = (
    asyncmy.errors.MySQLError,
    OSError,
    asyncio.TimeoutError,
)
#: Connections one backend opens at most; more concurrent calls queue for one.
POOL_SIZE = 8
#: A connection idle this long is pinged before use (the server may have ended it).
IDLE_PING = 1.0
# asyncmy logs the server's notes (CREATE TABLE IF NOT EXISTS on an existing table) at
# warning level; they are expected at every connect, so the session does not raise them.
QUIET = "SET sql_notes = 0"

#: When the call in progress in this task began to use its connection: set by the pool's
#: check or opening of one (the first of them, if a check failed and another was tried), so
#: that they and the primitive after them end within one timeout. None: neither was needed.
_STARTED: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "latchkey_mysql_started", default=None
)

__all__ = ["ASYNC_DRIVER_ERRORS", "IDLE_PING", "AsyncmyDriver", "async_connect_args", "bounded"]


def async_connect_args(backend: BackendBase) -> dict[str, Any]:
    """asyncmy connect() arguments for a store URL: PyMySQL's, with the timeouts that are
    asyncio's here (every call runs under :func:`bounded`)."""
    return async_args(connect_args(backend, failover=True))


async def drain(cur: Any, sql: str, params: Any) -> tuple[list[Any], int]:
    """Execute ``sql`` and read every result; the last result set and row count."""
    await cur.execute(sql, params or None)
    rows: list[Any] = []
    count: int = cur.rowcount
    while True:
        if cur.description:
            rows = list(await cur.fetchall())
        else:
            count = cur.rowcount
        if not await cur.nextset():
            return rows, count


class Connection:
    """One pooled connection and its one cursor."""

    __slots__ = ("conn", "cur")

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.cur = conn.cursor()

    async def answer(self, request: Any) -> Any:
        sql, params, _ = request
        try:
            return await drain(self.cur, sql, params)
        except asyncmy.errors.MySQLError as exc:
            refused = REFUSED.get(exc.args[0]) if exc.args else None
            if refused is None:
                raise
            raise refused(*exc.args) from exc

    async def statement(self, request: Statement) -> tuple[list[str] | None, list[Any]]:
        return await statement(self.cur, request)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()


class AsyncmyDriver(AsyncDriver):
    errors = (*ASYNC_DRIVER_ERRORS, Refused)
    #: MariaDB's wake-up for this loop's waiters (None over a borrowed client: it polls).
    bell: AsyncBell | None = None

    def __init__(self, backend: BackendBase, store: Any) -> None:
        super().__init__(backend, store)
        self.user_error: Callable[[BaseException], bool] = user_error
        self.hosts: Hosts | None = None  # several in the URL: where to look for the primary
        if backend.client is not None:  # the application's connection, pool or engine
            from latchkey.stores.io import asyncmy_borrowed as borrowed

            self.pool: AsyncPool[Connection] = borrowed.AsyncBorrowedPool(self, backend.client)  # type: ignore[assignment]
            self.errors = borrowed.BORROWED_ERRORS  # type: ignore[misc]  # (aiomysql's too)
            self.user_error = borrowed.user_error
            return
        self.connect_args = async_connect_args(backend)
        if len(addresses := hosts_of(backend.url)) > 1:
            self.hosts = Hosts(addresses)
        self.pool = AsyncPool(
            self._open,
            Connection.close,
            alive=self._alive,
            keep=lambda exc: isinstance(exc, Refused),
            size=POOL_SIZE,
            check_after=IDLE_PING,
        )
        self.bell = AsyncBell(self, self._open)

    async def _open(self) -> Connection:
        return await bounded(self._connect(), self.backend.timeout, _started())

    async def _connect(self) -> Connection:
        if self.hosts is None:
            conn = await asyncmy.connect(**self.connect_args, client_flag=CLIENT.MULTI_STATEMENTS)
        else:
            conn = await self._writable(self.hosts)
        try:
            pooled = Connection(conn)
            await pooled.cur.execute(QUIET)
            for sql, params, _ in self.store.setup(conn.get_server_info()):
                await drain(pooled.cur, sql, params)
        except BaseException:
            conn.close()
            raise
        return pooled

    async def _writable(self, hosts: Hosts) -> Any:
        """The twin of ``PyMySQLDriver._writable``: a connection to the first host, in
        ``hosts``' order, that takes writes; each gets its share of the time left (the whole
        open is bounded by the store's timeout)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.backend.timeout
        order = hosts.order()
        tried: list[str] = []  # host:port: why not, one each
        for step, index in enumerate(order):
            left = deadline - loop.time()
            if tried and left <= 0:
                break
            address = hosts.addresses[index]
            share = max(left, 0.001) / (len(order) - step)
            try:
                conn, why = await bounded(self._reach(*address), share)
            except ASYNC_DRIVER_ERRORS as exc:
                tried.append(f"{address_text(address)}: {reason(exc)}")
                continue
            if why is None:
                hosts.found(index)
                return conn
            tried.append(f"{address_text(address)}: {why}")
        hosts.missed(order, len(tried))
        raise asyncmy.errors.OperationalError(2003, hosts.none_writable(tried))

    async def _reach(self, host: str, port: int) -> tuple[Any, str | None]:
        """A connection to ``host`` and why it takes no writes (None: it does; closed then)."""
        args = {**self.connect_args, "host": host, "port": port}
        conn = await asyncmy.connect(**args, client_flag=CLIENT.MULTI_STATEMENTS)
        try:
            async with conn.cursor() as cur:
                await cur.execute(WRITABLE)
                why = read_only(await cur.fetchone())
        except BaseException:
            conn.close()
            raise
        if why is not None:
            conn.close()
        return conn, why

    async def _alive(self, pooled: Connection) -> bool:
        try:
            await bounded(pooled.conn.ping(reconnect=False), self.backend.timeout, _started())
        except ASYNC_DRIVER_ERRORS:
            return False
        return True

    async def answer(self, request: Any) -> Any:  # pragma: no cover - run() answers
        raise NotImplementedError

    async def run(self, steps: Steps[T], action: str) -> T:
        """The primitive on one pooled connection, connected before the primitive starts (so
        it knows whether the server prepared its statements). Opening or the idle ping, and
        the primitive after it, end within one store timeout, counted from when the first of
        them began; the turn for a connection is not bounded (it waits behind this loop's
        other calls, each of them bounded): 1,000 coroutines polling one name queue for 8
        connections for longer than a timeout under load.

        A primitive that may grant (``GRANTING``) is not dropped when its caller is
        cancelled: it runs to its end first (:func:`~latchkey.stores.io.aio.to_the_end`).
        Dropped, its connection closed, its statement would still run in the server — one
        waiting for a row lock, for as long as that wait — and could grant after the core's
        release that follows a cancellation, leaving the lease held by nobody until its TTL."""
        if action in GRANTING:
            return await to_the_end(self._run(steps, action))
        return await self._run(steps, action)

    async def _run(self, steps: Steps[T], action: str) -> T:
        token = _STARTED.set(None)
        try:
            async with self.pool.connection(math.inf) as pooled:
                started = _STARTED.get()
                return await bounded(adrive(steps, pooled.answer), self.backend.timeout, started)
        except StoreUnavailable:
            raise
        except self.errors as exc:
            if self.hosts is not None and exc.args and exc.args[0] in READ_ONLY:
                await self.pool.close()  # the others to the demoted primary (see pymysql.py)
            self.backend.unavailable(exc, action)
        finally:
            _STARTED.reset(token)

    async def aclose(self) -> None:
        if self.bell is not None:
            await self.bell.aclose()
        await self.pool.close()

    async def pin(self) -> AsyncPinned:
        """The twin of ``PyMySQLDriver.pin``: one pooled connection held across calls."""
        pool = self.pool
        with self.backend.translate("connect", self.errors):
            token = _STARTED.set(None)  # (its calls are bounded one by one: AsyncPinned)
            try:
                pooled = await pool.get(self.backend.timeout)
            finally:
                _STARTED.reset(token)
            if hasattr(pooled, "hold"):  # borrowed: latchkey's settings for the transaction
                try:
                    await bounded(pooled.hold(), self.backend.timeout)
                except BaseException:
                    await asyncio.shield(pool.discard(pooled))
                    raise

        async def answer(request: Any) -> Any:
            if type(request) is Statement:
                return await pooled.statement(request)
            return await pooled.answer(request)

        async def give_back(pooled: Connection, reuse: bool) -> None:
            await (pool.put if reuse else pool.discard)(pooled)

        return AsyncPinned(self, pooled, answer, give_back, self.user_error)


async def statement(cur: Any, request: Statement) -> tuple[list[str] | None, list[Any]]:
    await cur.execute(request.sql, request.params)
    columns = [column[0] for column in cur.description] if cur.description else None
    rows = list(await cur.fetchall()) if columns is not None else []
    while await cur.nextset():
        pass
    return columns, rows


def _started() -> float:
    """The loop time the call in progress began to use a connection (now, if it had not)."""
    started = _STARTED.get()
    if started is None:
        started = asyncio.get_running_loop().time()
        _STARTED.set(started)
    return started


def user_error(exc: BaseException) -> bool:
    """As ``pymysql.user_error`` (same error numbers): the application's statement failed,
    the connection is sound."""
    if isinstance(exc, Refused):
        return True
    code = exc.args[0] if isinstance(exc, asyncmy.errors.MySQLError) and exc.args else None
    return isinstance(code, int) and code < 2000 and code not in SESSION_ENDING
