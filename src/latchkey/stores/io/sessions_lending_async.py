"""Session locks over the application's own asyncio pool or engine: the asyncio twin of
:mod:`latchkey.stores.io.sessions_lending`, with the same rules. Lenders:

- a ``psycopg_pool.AsyncConnectionPool``: ``await getconn(timeout)``, ``await putconn()``; a
  connection in an unknown state is closed first (the pool discards it);
- an ``asyncmy.Pool`` or ``aiomysql.Pool``: ``await acquire()`` (bounded by the store's
  timeout), ``release()``; closed first to discard (the pool drops a closed connection);
- a SQLAlchemy ``AsyncEngine``: ``await engine.connect()``, its driver's connection used
  (``get_raw_connection().driver_connection``), the SQLAlchemy connection's ``close()``
  giving it back to the engine's pool; ``invalidate()`` first to discard it. No transaction
  of SQLAlchemy's is begun.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from typing import TYPE_CHECKING, Any, ClassVar

from latchkey.stores.io.aio import bounded
from latchkey.stores.io.sessions_lending import DEAD_TRIES, DeadOnArrival, application_error


async def _settled(value: Any) -> Any:
    """A driver's answer that is awaitable in one driver and plain in the other."""
    return await value if inspect.isawaitable(value) else value


class AsyncPoolLender:
    """A psycopg_pool AsyncConnectionPool."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    async def take(self, timeout: float) -> Any:
        return await self.pool.getconn(timeout)

    async def give_back(self, conn: Any) -> None:
        await self.pool.putconn(conn)

    async def discard(self, conn: Any) -> None:
        with contextlib.suppress(Exception):
            await conn.close()  # the pool discards a closed connection and opens another
        await self.pool.putconn(conn)


class AsyncMySQLPoolLender:
    """An asyncmy or aiomysql Pool."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    async def take(self, timeout: float) -> Any:
        try:
            return await bounded(self.pool.acquire(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no connection of the pool came free within {timeout:g}s") from None
        except RuntimeError as exc:  # "Cannot acquire connection after closing pool"
            raise application_error(exc, "pool") from None

    async def give_back(self, conn: Any) -> None:
        await _settled(self.pool.release(conn))

    async def discard(self, conn: Any) -> None:
        with contextlib.suppress(Exception):
            conn.close()  # the pool drops a closed connection and opens another
        await _settled(self.pool.release(conn))


class AsyncEngineLender:
    """A SQLAlchemy AsyncEngine."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.holders: dict[int, Any] = {}  # id(driver connection) -> SQLAlchemy connection

    async def take(self, timeout: float) -> Any:
        try:
            holder = await bounded(self.engine.connect(), timeout)
        except Exception as exc:
            if type(exc).__module__.startswith("sqlalchemy"):
                raise application_error(exc, "engine") from exc
            raise
        try:
            conn = (await holder.get_raw_connection()).driver_connection
        except BaseException:
            await asyncio.shield(holder.close())
            raise
        self.holders[id(conn)] = holder
        return conn

    async def give_back(self, conn: Any) -> None:
        await self.holders.pop(id(conn)).close()

    async def discard(self, conn: Any) -> None:
        holder = self.holders.pop(id(conn))
        with contextlib.suppress(Exception):
            await holder.invalidate()
        with contextlib.suppress(Exception):
            await holder.close()


def async_lender(client: Any) -> AsyncPoolLender | AsyncMySQLPoolLender | AsyncEngineLender:
    if hasattr(client, "sync_engine"):
        return AsyncEngineLender(client)
    if hasattr(client, "getconn"):
        return AsyncPoolLender(client)
    return AsyncMySQLPoolLender(client)


class AsyncLending:
    """Sessions borrowed from the application's asyncio pool or engine; mixed in before an
    :class:`~latchkey.stores.io.sessions_async.AsyncSessionDriver` subclass, which supplies
    :meth:`lent`, :meth:`sound` and :meth:`tidy` (as in
    :class:`~latchkey.stores.io.sessions_lending.Lending`)."""

    idle_spares = 0
    lending = True
    main: Any
    store: Any
    timeout: float
    driver_errors: ClassVar[tuple[type[BaseException], ...]]

    def __init__(self, backend: Any, store: Any) -> None:
        super().__init__(backend, store)  # type: ignore[call-arg]
        self.lender = async_lender(backend.client)

    async def lent(self, conn: Any, spare: bool) -> Any:
        raise NotImplementedError

    def sound(self, session: Any) -> bool:
        raise NotImplementedError

    async def tidy(self, session: Any) -> None:
        """Make ``session``'s connection as it was lent, before it goes back."""

    if TYPE_CHECKING:  # the AsyncSessionDriver's

        async def execute(self, session: Any, statement: Any, params: Any) -> Any: ...
        async def _end(self, session: Any, holds_nothing: bool = False) -> None: ...

    async def after_primitive(self) -> None:
        """The main session goes back when no lock lives on it."""
        main = self.main
        if main is not None and not any(h.session is main for h in self.store.held.values()):
            await self._end(main, holds_nothing=True)

    async def connect(self, spare: bool) -> Any:
        for attempt in range(DEAD_TRIES, 0, -1):
            conn = await self.lender.take(self.timeout)
            try:
                return await self.lent(conn, spare)
            except DeadOnArrival:
                await asyncio.shield(self.lender.discard(conn))
                if attempt == 1:
                    raise
            except BaseException:
                await asyncio.shield(self.lender.discard(conn))
                raise
        raise AssertionError("unreachable")

    async def give_back(self, session: Any) -> None:
        if not self.sound(session):
            await self.disconnect(session)
            return
        try:
            await bounded(self.tidy(session), self.timeout)
        except self.driver_errors:
            await self.disconnect(session)
            return
        await self.lender.give_back(session.conn)

    async def disconnect(self, session: Any) -> None:
        with contextlib.suppress(Exception):
            await self.lender.discard(session.conn)

    async def let_go(self, session: Any, keys: list[Any]) -> None:
        if keys and self.sound(session):
            run = self.store.release_many_run(keys, session)
            try:
                await self.execute(session, run.statement, run.params)
            except self.driver_errors:
                await self.disconnect(session)
                return
        elif keys:
            await self.disconnect(session)
            return
        await self.give_back(session)
