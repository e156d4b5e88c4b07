"""The ``postgresql://`` store for asyncio, on psycopg 3's :class:`psycopg.AsyncConnection`.

The same tables, statements and reply parsing as :mod:`latchkey.stores.postgresql` (imported
from there); only how the bytes move differs:

- Every primitive runs its one statement on one shared autocommit connection
  (:class:`AsyncSession`), serialised by an :class:`asyncio.Lock`. Each network await is
  bounded twice: by the server (``statement_timeout``, ``connect_timeout``, TCP keepalives and
  ``tcp_user_timeout``, as the sync store sets them) and by a local deadline a second past
  ``timeout``. A connection that timed out, failed, or whose coroutine was cancelled
  mid-statement is closed, never reused half-read; the next call opens a new one.
- The uncontended acquire and release skip psycopg's ``execute`` as the sync store's do:
  libpq directly (``psycopg.pq``), prepared once per connection, ``send_query_prepared``, the
  event loop watching the socket (:meth:`AsyncSession.run_prepared`), binary results decoded
  by the sync module's functions.
- Waiting is the sync store's queue with hand-off: one ``LISTEN`` connection per backend
  (:class:`AsyncListener`) read by one task through ``AsyncConnection.notifies()``; it wakes
  the waiters (:class:`AsyncHandoffWaiter`, each an :class:`asyncio.Event`) of a released
  name, or hands a lease to the queued waiter whose ticket a release names. A waiting
  coroutine holds no thread and no connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import select
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar, TypeVar

import psycopg
from psycopg import sql

from latchkey._types import Busy, Grant, LockInfo
from latchkey._url import Option, StoreURL
from latchkey.errors import StoreUnavailable
from latchkey.stores.base import AsyncBackend, AsyncWaiter, group_by_name
from latchkey.stores.postgresql import (
    COMMAND_OK,
    CREATE_STATEMENTS,
    DDL_LOCK_KEY,
    DRIVER_ERRORS,
    MUTEX_FORMATS,
    RELEASE_FORMATS,
    SCHEMA_VERSION,
    SELECT_VERSION,
    TUPLES_OK,
    PostgreSQLBackend,
    _handoff_grant,
    _input_waiting,
    _successor,
    check_schema_version,
    connection_params,
    deallocated,
    holder,
    mutex_busy,
    mutex_granted,
    mutex_values,
    render,
    render_all,
    result_error,
    slot_answer,
    utc,
    was_live,
)

log = logging.getLogger("latchkey")
T = TypeVar("T")

#: The local deadline of one network await: this much past the server-side bound.
MARGIN = 1.0
#: What a failed network await raises: the driver's errors, or our local deadline.
NET_ERRORS: tuple[type[BaseException], ...] = (*DRIVER_ERRORS, asyncio.TimeoutError)


async def guarded(aw: Awaitable[T], seconds: float) -> T:
    """Await ``aw`` for at most ``seconds``; asyncio.TimeoutError after that."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await aw
    return await asyncio.wait_for(aw, seconds)  # pragma: no cover (Python 3.10)


Conn = psycopg.AsyncConnection[Any]
_ACTIVE = psycopg.pq.TransactionStatus.ACTIVE


async def reply(pgconn: psycopg.pq.abc.PGconn) -> psycopg.pq.abc.PGresult:
    """The result of the one statement just sent on ``pgconn`` (psycopg opens connections in
    libpq's nonblocking mode): flushes it, then reads the whole reply, the event loop
    waking us when the socket has something (no thread, no busy loop). Raises psycopg's
    OperationalError if the connection fails."""
    loop = asyncio.get_running_loop()
    fd = pgconn.socket
    while pgconn.flush():  # only if the socket's buffer is full (never for our statements)
        await _ready(loop, fd, loop.add_writer, loop.remove_writer)
    last: psycopg.pq.abc.PGresult | None = None
    while True:
        while pgconn.is_busy():
            await _ready(loop, fd, loop.add_reader, loop.remove_reader)
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:  # the end of the reply: the connection is idle again
            assert last is not None
            return last
        last = result


async def _ready(
    loop: asyncio.AbstractEventLoop, fd: int,
    watch: Callable[..., None], unwatch: Callable[[int], object],
) -> None:  # fmt: skip
    """Wait until ``fd`` is readable (or writable: ``watch`` says which)."""
    ready = loop.create_future()
    watch(fd, _set, ready)
    try:
        await ready
    finally:
        unwatch(fd)


def _set(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


class AsyncSession:
    """One autocommit :class:`psycopg.AsyncConnection` guarded by an asyncio lock, opened
    lazily and replaced after a failure (the asyncio twin of ``postgresql.Session``)."""

    def __init__(self, params: Mapping[str, Any], timeout: float) -> None:
        self.params = params
        self.lock = asyncio.Lock()
        self.conn: Conn | None = None
        self.generation = 0
        """Counts connections opened: a session-tied lock is valid only in its generation."""
        self.statement_guard = timeout + MARGIN
        self.connect_guard = params["connect_timeout"] + MARGIN
        self.prepared: set[bytes] = set()
        """Names of the statements :meth:`run_prepared` prepared on :attr:`conn`."""
        self._poller: Any = None  # a poll() object on conn's socket, made once per connection

    async def open(self) -> Conn:
        """A new autocommit connection (not the shared one), within the connect deadline."""
        return await guarded(
            psycopg.AsyncConnection.connect(autocommit=True, **self.params), self.connect_guard
        )

    async def connection(self) -> Conn:
        """The shared connection, opened if needed; call with :attr:`lock` held."""
        if not self.alive():
            await self.discard()
            self.conn = await self.open()
            self.generation += 1
            self.prepared = set()
            self._poller = None
            if hasattr(select, "poll"):  # (Windows: _input_waiting's select() every time)
                self._poller = select.poll()
                self._poller.register(self.conn.pgconn.socket, select.POLLIN)
        assert self.conn is not None
        return self.conn

    def alive(self) -> bool:
        """Whether the shared connection is usable, without a round trip: an idle connection
        has nothing to read unless the server ended it (as ``postgresql.Session.alive``)."""
        conn = self.conn
        if conn is None or conn.closed or conn.broken:
            return False
        if self._poller is not None and not self._poller.poll(0):
            return True  # nothing to read: the usual case, one syscall
        pgconn = conn.pgconn
        for _ in range(4):  # a goodbye message, then EOF, arrive as separate reads
            if pgconn.status != psycopg.pq.ConnStatus.OK:
                return False
            if not _input_waiting(pgconn.socket):
                return True
            try:
                pgconn.consume_input()
            except DRIVER_ERRORS:
                return False
        return pgconn.status == psycopg.pq.ConnStatus.OK

    async def query(
        self, conn: Conn, query: Any, params: Any = None, prepare: bool | None = True
    ) -> list[tuple[Any, ...]]:
        """Run one statement on ``conn`` within the statement deadline: its rows (or [])."""

        async def run() -> list[tuple[Any, ...]]:
            cur = await conn.execute(query, params, prepare=prepare)
            result = cur.pgresult
            return await cur.fetchall() if result is not None and result.status == TUPLES_OK else []

        return await guarded(run(), self.statement_guard)

    async def run_prepared(
        self, conn: Conn, name: bytes, query: bytes, params: Sequence[bytes],
        formats: Sequence[int] | None = None, binary: bool = False,
    ) -> psycopg.pq.abc.PGresult:  # fmt: skip
        """The asyncio twin of ``postgresql.Session.run_prepared`` (same statements, same
        answers, same errors), within the statement deadline: libpq directly (``psycopg.pq``),
        the statement prepared once per connection, then one ``send_query_prepared`` per call
        while the event loop watches the socket. Skips psycopg's ``execute`` machinery (a
        cursor, parameter adaptation, the prepared-statement cache): most of an uncontended
        acquire+release's CPU. Call under :attr:`lock`; a connection left mid-statement (a
        timeout, a cancellation) must be discarded, as every caller here does."""
        return await guarded(
            self._run_prepared(conn.pgconn, name, query, params, formats, binary),
            self.statement_guard,
        )

    async def _run_prepared(
        self, pgconn: psycopg.pq.abc.PGconn, name: bytes, query: bytes,
        params: Sequence[bytes], formats: Sequence[int] | None, binary: bool,
    ) -> psycopg.pq.abc.PGresult:  # fmt: skip
        for again in (True, False):
            if name not in self.prepared:
                pgconn.send_prepare(name, query)
                prepared = await reply(pgconn)
                if prepared.status != COMMAND_OK:
                    raise result_error(prepared)
                self.prepared.add(name)
            pgconn.send_query_prepared(name, params, formats, 1 if binary else 0)
            result = await reply(pgconn)
            if result.status in (TUPLES_OK, COMMAND_OK):
                return result
            if not (again and deallocated(result)):
                break
            self.prepared.discard(name)  # deallocated behind our back: prepare it again, once
        raise result_error(result)

    def broken(self) -> bool:
        """After a driver error: whether the connection is no longer usable (then it must be
        discarded): lost, or left in the middle of a statement."""
        conn = self.conn
        return (
            conn is None
            or conn.closed
            or conn.broken
            or (conn.pgconn.status != psycopg.pq.ConnStatus.OK)
            or conn.pgconn.transaction_status == _ACTIVE
        )

    async def discard(self) -> None:
        """Close the connection (after a timeout, a cancellation or a lost connection)."""
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(*DRIVER_ERRORS):
                await conn.close()

    async def close(self) -> None:
        await self.discard()


class AsyncHandoffWaiter(AsyncWaiter):
    """A waiter woken by its name's notifications; if queued (``ticket``), a release naming
    its ticket hands it the lease (the twin of ``postgresql.HandoffWaiter``)."""

    def __init__(
        self, listener: AsyncListener, key: str, ticket: int | None,
        on_close: Callable[[AsyncHandoffWaiter], Awaitable[None]] | None = None,
    ) -> None:  # fmt: skip
        self.listener, self.key, self.ticket = listener, key, ticket
        self.event = asyncio.Event()
        self.grant: Grant | None = None
        self.handed_over = False  # the core took the grant a release handed us
        self.acquired = False  # the wait ended with the lease ours (however it came)
        self._on_close = on_close

    def deliver(self, grant: Grant) -> None:
        self.grant = grant
        self.event.set()

    async def wait(self, timeout: float) -> bool:
        try:
            await guarded(self.event.wait(), max(0.0, timeout))
            woke = True
        except asyncio.TimeoutError:
            woke = False
        self.event.clear()
        return woke

    async def take_grant(self) -> Grant | None:
        if self.grant is not None:
            self.handed_over = self.acquired = True
        return self.grant

    async def finish(self, result: Grant | Busy) -> None:
        self.acquired = isinstance(result, Grant)

    async def close(self) -> None:
        self.listener.unsubscribe(self)
        if self._on_close is not None:
            await self._on_close(self)


class AsyncListener:
    """One ``LISTEN`` connection per backend, shared by the waiters of every name, read by one
    task (the twin of ``postgresql.Listener``: same payloads, same listener key).

    If the connection is lost, every waiter is woken once (so it retries and sees the store's
    state) and later waits poll; the next waiter reconnects with a new key.
    """

    def __init__(
        self, session: AsyncSession, channel: str,
        unclaimed: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:  # fmt: skip
        self._session = session  # for its connect parameters and deadlines only
        self._channel = channel
        self._unclaimed = unclaimed
        self._start_lock = asyncio.Lock()
        self._waiters: dict[str, set[AsyncHandoffWaiter]] = {}
        self._conn: Conn | None = None
        self._task: asyncio.Task[None] | None = None
        self.listener_key = 0
        self.connections = 0  # how many LISTEN connections were opened (tests count them)

    async def queue(
        self, key: str, ticket: int | None,
        on_close: Callable[[AsyncHandoffWaiter], Awaitable[None]] | None = None,
    ) -> tuple[AsyncHandoffWaiter, int]:  # fmt: skip
        """A waiter for ``key`` (handed a lease by a release naming ``ticket``, if given) and
        the listener key to queue it with; the connection listens before this returns."""
        async with self._start_lock:
            if self._conn is None:
                await self._start()
        waiter = AsyncHandoffWaiter(self, key, ticket, on_close)
        self._waiters.setdefault(key, set()).add(waiter)
        return waiter, self.listener_key

    def unsubscribe(self, waiter: AsyncHandoffWaiter) -> None:
        waiters = self._waiters.get(waiter.key)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self._waiters[waiter.key]

    async def _start(self) -> None:
        session = self._session
        conn = await session.open()
        listener_key = secrets.randbits(64) - (1 << 63)
        try:
            await session.query(conn, "SELECT pg_advisory_lock(%s)", (listener_key,), False)
            await session.query(conn, sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)),
                                prepare=False)  # fmt: skip
        except BaseException:
            with contextlib.suppress(*DRIVER_ERRORS):
                await conn.close()
            raise
        self._conn, self.listener_key = conn, listener_key
        self.connections += 1
        self._task = asyncio.get_running_loop().create_task(
            self._run(conn), name="latchkey-pg-listen"
        )

    async def _run(self, conn: Conn) -> None:
        try:
            async for note in conn.notifies():
                await self._wake(note.payload)
        except DRIVER_ERRORS:
            pass  # connection lost: wake everyone below; later waits poll
        finally:
            if self._conn is conn:
                self._conn = None
            for waiters in list(self._waiters.values()):
                for waiter in waiters:
                    waiter.event.set()
            with contextlib.suppress(*DRIVER_ERRORS):
                await conn.close()

    async def _wake(self, payload: str) -> None:
        key, _, handoff = payload.partition(":")
        waiters = list(self._waiters.get(key, ()))
        if handoff:
            grant = _handoff_grant(handoff)
            if grant is None:
                return
            for waiter in waiters:
                if waiter.ticket == grant[0]:
                    waiter.deliver(grant[1])
                    return  # the name is held again: nobody else needs to wake
            if self._unclaimed is not None:
                await self._unclaimed(grant[0])
            return
        for waiter in waiters:
            waiter.event.set()

    async def close(self) -> None:
        """Stop the task and close its connection."""
        task, self._task, self._conn = self._task, None, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class AsyncPostgreSQLBackend(AsyncBackend):
    """Leases in a PostgreSQL table, for asyncio; see the module docstring."""

    scheme = PostgreSQLBackend.scheme
    capabilities = PostgreSQLBackend.capabilities
    options: ClassVar[Mapping[str, Option]] = PostgreSQLBackend.options

    def __init__(self, url: StoreURL) -> None:
        super().__init__(url)
        self.table: str = self.config["table"]
        self.schema: str | None = self.config["schema"]
        self.channel = self.table  # NOTIFY channel: payload is the name's UTF-8 bytes in hex
        self._channel = self.channel.encode()
        self._session = AsyncSession(connection_params(url, self.config, "latchkey"), self.timeout)
        self._listener = AsyncListener(self._session, self.channel, self._unclaimed)
        self._orphans: dict[int, tuple[str, str]] = {}  # ticket -> (name, owner)
        self._sql: dict[str, bytes] = {}
        self._pq: dict[str, tuple[bytes, bytes]] = {}  # see PostgreSQLBackend._pq

    # -- plumbing ------------------------------------------------------------------------------

    async def _create(self, conn: Conn) -> None:
        """Create what is missing, one process at a time; refuse tables from a newer version."""
        session = self._session

        async def create() -> tuple[Any, ...] | None:
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock(%s)", (DDL_LOCK_KEY,))
                if self.schema:
                    await conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
                        sql.Identifier(self.schema)))  # fmt: skip
                for statement in CREATE_STATEMENTS:
                    await conn.execute(render(conn, self.table, self.schema, statement),
                                       {"version": str(SCHEMA_VERSION)})  # fmt: skip
                cur = await conn.execute(render(conn, self.table, self.schema, SELECT_VERSION))
                return await cur.fetchone()

        check_schema_version(self, await guarded(create(), session.statement_guard))

    async def _run(
        self, action: str, statement: str, params: Mapping[str, Any]
    ) -> list[tuple[Any, ...]]:
        """Run one named statement: its rows. Creates the tables on first use."""
        session = self._session
        async with session.lock:
            try:
                conn = await session.connection()
                if not self._sql:
                    self._sql, self._pq = render_all(conn, self.table, self.schema)
                query = self._sql[statement]
                try:
                    return await session.query(conn, query, params)
                except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName):
                    await self._create(conn)  # first use: the tables are missing
                    return await session.query(conn, query, params)
            except DRIVER_ERRORS as exc:
                if session.broken():
                    await session.discard()
                self.unavailable(exc, action)
            except asyncio.TimeoutError as exc:
                await session.discard()  # half-read: never reused
                self.unavailable(exc, action)
            except BaseException:
                await session.discard()  # cancelled mid-statement: never reused
                raise

    async def _fast(
        self, action: str, statement: str, values: Sequence[bytes], formats: Sequence[int]
    ) -> psycopg.pq.abc.PGresult:
        """Run one of the hot statements (FAST_PARAMS) through libpq directly
        (:meth:`AsyncSession.run_prepared`), binary results, as ``PostgreSQLBackend._fast``
        does; the same errors, deadline and discarding as :meth:`_run`."""
        session = self._session
        async with session.lock:
            try:
                conn = await session.connection()
                if not self._pq:
                    self._sql, self._pq = render_all(conn, self.table, self.schema)
                prepared, query = self._pq[statement]
                try:
                    return await session.run_prepared(conn, prepared, query, values, formats, True)
                except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName):
                    await self._create(conn)  # first use: the tables are missing
                    return await session.run_prepared(conn, prepared, query, values, formats, True)
            except DRIVER_ERRORS as exc:
                if session.broken():
                    await session.discard()
                self.unavailable(exc, action)
            except asyncio.TimeoutError as exc:
                await session.discard()  # half-read: never reused
                self.unavailable(exc, action)
            except BaseException:
                await session.discard()  # cancelled mid-statement: never reused
                raise

    # -- leases --------------------------------------------------------------------------------

    async def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        action = f"acquire {name!r}"
        if limit == 1:
            values = mutex_values(name, owner, owner_info, ttl)
            grant = mutex_granted(await self._fast(action, "acquire_mutex", values, MUTEX_FORMATS))
            if grant is not None:
                return grant
            rows = await self._run(action, "holder", {"name": values[0], "owner": owner})
            return mutex_busy(rows[0] if rows else None)
        params = {"name": name.encode(), "owner": owner, "owner_info": owner_info,
                  "ttl": float(ttl), "limit": limit}  # fmt: skip
        return slot_answer((await self._run(action, "acquire_slot", params))[0])

    async def release(self, name: str, owner: str) -> bool:
        values = (name.encode(), owner.encode(), self._channel)
        return was_live(await self._fast(f"release {name!r}", "release", values, RELEASE_FORMATS))

    async def wait_in_line(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int
    ) -> AsyncWaiter:
        """Listen for releases of ``name`` and, for a mutex, queue ``owner`` so that a release
        hands the lease straight over (see ``latchkey.stores.postgresql``)."""
        if limit != 1:
            return await self.subscribe(name)
        ticket = secrets.randbits(63)

        async def leave(waiter: AsyncHandoffWaiter) -> None:
            await self._leave_queue(name, owner, waiter)

        waiter, listener_key = await self._listen(name, ticket, leave)
        params = {"name": name.encode(), "owner": owner, "owner_info": owner_info,
                  "ttl": float(ttl), "ticket": ticket, "listener_key": listener_key}  # fmt: skip
        try:
            await self._run(f"queue for {name!r}", "enqueue", params)
        except BaseException:
            self._listener.unsubscribe(waiter)
            raise
        return waiter

    async def _listen(
        self, name: str, ticket: int | None,
        on_close: Callable[[AsyncHandoffWaiter], Awaitable[None]] | None = None,
    ) -> tuple[AsyncHandoffWaiter, int]:  # fmt: skip
        action = f"listen for releases of {name!r}"
        try:
            return await self._listener.queue(name.encode().hex(), ticket, on_close)
        except NET_ERRORS as exc:
            self.unavailable(exc, action)

    async def _leave_queue(self, name: str, owner: str, waiter: AsyncHandoffWaiter) -> None:
        """The end of a wait: leave the queue; a lease handed over as the wait gave up is
        released (which hands it to the next waiter). See ``PostgreSQLBackend._leave_queue``."""
        if waiter.handed_over:
            return  # the release that handed it over also took us out of the queue
        try:
            rows = await self._run(f"leave the queue for {name!r}", "dequeue",
                                   {"name": name.encode(), "owner": owner})  # fmt: skip
            if not rows and not waiter.acquired:  # handed over as we gave up: pass it on
                await self.release(name, owner)
        except StoreUnavailable as exc:
            # The wait's outcome stands; should a release later hand our stale queue row a
            # lease, the listener hears of a ticket nobody waits for and _unclaimed releases it.
            if waiter.ticket is not None:
                self._orphans[waiter.ticket] = (name, owner)
            log.info("%s", exc)

    async def _unclaimed(self, ticket: int) -> None:
        """A release handed a lease to a queue row whose waiter has left (see _leave_queue)."""
        orphan = self._orphans.pop(ticket, None)
        if orphan is not None:
            with contextlib.suppress(StoreUnavailable):
                await self.release(*orphan)

    async def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        params = {"name": name.encode(), "owner": owner, "ttl": float(ttl)}
        rows = await self._run(f"extend {name!r}", "extend", params)
        return Grant(token=rows[0][0], expires_at=utc(rows[0][1])) if rows else None

    async def inspect(self, name: str) -> LockInfo | None:
        rows = await self._run(f"inspect {name!r}", "inspect", {"name": name.encode()})
        return LockInfo(name=name, holders=tuple(holder(*row) for row in rows)) if rows else None

    async def list(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        low = prefix.encode()
        rows = await self._run("list", "list", {"low": low, "high": _successor(low)})
        for info in group_by_name(rows, lambda row: holder(*row[1:])):
            yield info

    async def force_release(self, name: str) -> bool:
        params = {"name": name.encode(), "channel": self.channel}
        rows = await self._run(f"force-release {name!r}", "force_release", params)
        return any(live for live, _ in rows)

    async def purge_expired(self) -> int:
        rows = await self._run("purge expired leases", "purge", {})
        return int(rows[0][0])

    # -- batch claims --------------------------------------------------------------------------

    async def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        if not names:
            return {}
        params = {"names": [n.encode() for n in names], "owner": owner,
                  "owner_info": owner_info, "ttl": float(ttl)}  # fmt: skip
        rows = await self._run(f"claim {len(names)} names", "claim", params)
        taken = {bytes(raw).decode(): Grant(token, utc(exp)) for raw, token, exp in rows}
        return {n: taken[n] for n in names if n in taken}

    async def release_many(self, names: Sequence[str], owner: str) -> int:
        if not names:
            return 0
        params = {"names": [n.encode() for n in names], "owner": owner, "channel": self.channel}
        rows = await self._run(f"release {len(names)} names", "release_many", params)
        return int(rows[0][0])

    # -- versioned records ---------------------------------------------------------------------

    async def record_get(self, name: str) -> tuple[str | None, int]:
        rows = await self._run(f"read record {name!r}", "record_get", {"name": name.encode()})
        return (rows[0][0], int(rows[0][1])) if rows else (None, 0)

    async def record_set(self, name: str, value: str, version: int) -> int | None:
        params = {"name": name.encode(), "value": value, "version": version}
        statement = "record_insert" if version == 0 else "record_update"
        rows = await self._run(f"write record {name!r}", statement, params)
        return int(rows[0][0]) if rows else None

    async def record_delete(self, name: str, version: int) -> bool:
        params = {"name": name.encode(), "version": version}
        rows = await self._run(f"delete record {name!r}", "record_delete", params)
        return bool(rows[0][0])

    # -- waiting, health, lifecycle ------------------------------------------------------------

    async def subscribe(self, name: str) -> AsyncWaiter:
        return (await self._listen(name, None))[0]

    async def now(self) -> datetime:
        rows = await self._run("read the clock", "now", {})
        return utc(rows[0][0])

    async def init(self) -> None:
        session = self._session
        async with session.lock:
            try:
                await self._create(await session.connection())
            except NET_ERRORS as exc:
                await session.discard()
                self.unavailable(exc, "create tables")
            except BaseException:
                await session.discard()
                raise

    async def aclose(self) -> None:
        await self._listener.close()
        async with self._session.lock:
            await self._session.close()
