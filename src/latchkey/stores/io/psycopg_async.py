"""PostgreSQL through psycopg 3's :class:`psycopg.AsyncConnection`: the asyncio twin of
:mod:`latchkey.stores.io.psycopg`, answering the same requests of the same store.

- ``Query`` and :class:`~latchkey.stores.io.psycopg.Prepared` run on connections of an
  :class:`~latchkey.stores.io.aio.AsyncPool` (:class:`AsyncLink`). Opening one is bounded by
  ``timeout`` as a whole, whatever the hosts (:mod:`latchkey.stores.io.pgconnect`, the event
  loop watching libpq's non-blocking connect). Each statement is bounded twice: by the server
  (``statement_timeout``, TCP keepalives and ``tcp_user_timeout``, as the sync driver sets
  them) and by a local deadline a second past ``timeout``. A connection that timed out,
  failed, or whose coroutine was cancelled mid-statement is closed, never reused half-read;
  the next call opens a new one.
- ``Prepared`` skips psycopg's ``execute`` as the sync driver does: libpq directly
  (``psycopg.pq``), prepared once per connection, ``send_query_prepared``, the event loop
  watching the socket (:meth:`AsyncSession.run_prepared`).
- ``Listen``: one ``LISTEN`` connection per backend (:class:`AsyncListener`) read by one task
  through ``AsyncConnection.notifies()``; it wakes the waiters (:class:`AsyncHandoffWaiter`,
  each an :class:`asyncio.Event`) of a released name, or hands a lease to the queued waiter
  whose ticket a release names. A waiting coroutine holds no thread and no connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import select
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg import pq, sql

from latchkey._types import Busy, Grant
from latchkey.errors import StoreUnavailable
from latchkey.stores.base import AsyncWaiter
from latchkey.stores.io import Steps
from latchkey.stores.io.aio import (
    GRANTING,
    AsyncDriver,
    AsyncPinned,
    AsyncPool,
    adrive,
    awoken,
    cut_after,
    to_the_end,
)
from latchkey.stores.io.pgconnect import Resolve, Wait, addresses, connecting
from latchkey.stores.io.psycopg import (
    COMMAND_OK,
    DRIVER_ERRORS,
    IDLE,
    MISSING,
    TUPLES_OK,
    Listen,
    Prepared,
    connection_params,
    deallocated,
    input_waiting,
    kept_cursor,
    queue_order,
    queued_ahead,
    read_notice,
    result_columns,
    result_error,
    user_error,
    wake,
)
from latchkey.stores.rows_sql import Statement
from latchkey.stores.sql import Query

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase

log = logging.getLogger("latchkey")
T = TypeVar("T")

#: The local deadline of one network await: this much past the server-side bound.
MARGIN = 1.0
#: What a failed network await raises: the driver's errors, or our local deadline.
NET_ERRORS: tuple[type[BaseException], ...] = (*DRIVER_ERRORS, asyncio.TimeoutError)


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


# -- opening a connection: the asyncio shell of pgconnect.connecting ----------------------------


async def aconnect_pgconn(params: Mapping[str, Any], timeout: float) -> pq.abc.PGconn:
    """:func:`~latchkey.stores.io.pgconnect.connecting`, the event loop watching the socket
    (never blocking the loop but for libpq's own non-blocking calls) and resolving host names
    within each host's share; a cancellation finishes the half-open connection."""
    loop = asyncio.get_running_loop()
    gen = connecting(params, timeout)
    try:
        request = next(gen)
        while True:
            if isinstance(request, Wait):
                answer: Any = await _aready(loop, request)
            else:
                answer = await _alookup(loop, request)
            request = gen.send(answer)
    except StopIteration as done:
        pgconn: pq.abc.PGconn = done.value
        return pgconn
    finally:
        gen.close()


async def _aready(loop: asyncio.AbstractEventLoop, wait: Wait) -> bool:
    """:func:`_ready` within ``wait.seconds``: True if the socket became ready in time."""
    watch = (
        (loop.add_writer, loop.remove_writer)
        if wait.write
        else (loop.add_reader, loop.remove_reader)
    )
    try:
        await asyncio.wait_for(_ready(loop, wait.fd, *watch), wait.seconds)
    except asyncio.TimeoutError:
        return False
    return True


async def _alookup(loop: asyncio.AbstractEventLoop, resolve: Resolve) -> list[str] | OSError:
    lookup = loop.getaddrinfo(
        resolve.host, resolve.port, proto=socket.IPPROTO_TCP, type=socket.SOCK_STREAM
    )
    try:
        found = await asyncio.wait_for(lookup, resolve.seconds)
    except asyncio.TimeoutError:
        return TimeoutError(f"no answer within {resolve.seconds:.2f}s")
    except OSError as exc:
        return exc
    return addresses(found)


async def aconnect(params: Mapping[str, Any], timeout: float) -> Conn:
    """A new autocommit connection, opened within ``timeout`` seconds whatever the hosts
    (:func:`aconnect_pgconn`), then wrapped by psycopg's
    documented constructor with psycopg's defaults (``prepare_threshold`` 5)."""
    conn = psycopg.AsyncConnection(await aconnect_pgconn(params, timeout))
    await conn.set_autocommit(True)  # on a new, idle connection: no round trip
    return conn


class AsyncSession:
    """One autocommit :class:`psycopg.AsyncConnection` guarded by an asyncio lock, opened
    lazily and replaced after a failure (the asyncio twin of ``psycopg.Session``)."""

    def __init__(self, params: Mapping[str, Any], timeout: float) -> None:
        self.params = params
        self.lock = asyncio.Lock()
        self.conn: Conn | None = None
        self.generation = 0
        """Counts connections opened: a session-tied lock is valid only in its generation."""
        self.statement_guard = timeout + MARGIN
        self.timeout = timeout  # opening a connection takes at most this long
        self.prepared: set[bytes] = set()
        """Names of the statements :meth:`run_prepared` prepared on :attr:`conn`."""
        self._poller: Any = None  # a poll() object on conn's socket, made once per connection

    async def open(self) -> Conn:
        """A new autocommit connection (not the shared one), within the timeout."""
        return await aconnect(self.params, self.timeout)

    async def connection(self) -> Conn:
        """The shared connection, opened if needed; call with :attr:`lock` held."""
        if not self.alive():
            await self.discard()
            self.conn = await self.open()
            self.generation += 1
            self.prepared = set()
            self._poller = None
            if hasattr(select, "poll"):  # (Windows: input_waiting's select() every time)
                self._poller = select.poll()
                self._poller.register(self.conn.pgconn.socket, select.POLLIN)
        assert self.conn is not None
        return self.conn

    def alive(self) -> bool:
        """Whether the shared connection is usable, without a round trip: an idle connection
        has nothing to read unless the server ended it (as ``psycopg.Session.alive``)."""
        conn = self.conn
        if conn is None or conn.closed or conn.broken:
            return False
        if self._poller is not None and not self._poller.poll(0):
            return True  # nothing to read: the usual case, one syscall
        pgconn = conn.pgconn
        for _ in range(4):  # a goodbye message, then EOF, arrive as separate reads
            if pgconn.status != psycopg.pq.ConnStatus.OK:
                return False
            if not input_waiting(pgconn.socket):
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

        return await cut_after(run(), self.statement_guard, conn.pgconn.socket)

    async def run_prepared(
        self, conn: Conn, name: bytes, query: bytes, params: Sequence[bytes],
        formats: Sequence[int] | None = None, binary: bool = False,
    ) -> psycopg.pq.abc.PGresult:  # fmt: skip
        """The asyncio twin of ``psycopg.Session.run_prepared`` (same statements, same
        answers, same errors), within the statement deadline: libpq directly (``psycopg.pq``),
        the statement prepared once per connection, then one ``send_query_prepared`` per call
        while the event loop watches the socket. Skips psycopg's ``execute`` machinery (a
        cursor, parameter adaptation, the prepared-statement cache): most of an uncontended
        acquire+release's CPU. Call under :attr:`lock`; a connection left mid-statement (a
        timeout, a cancellation) must be discarded, as every caller here does."""
        return await cut_after(
            self._run_prepared(conn.pgconn, name, query, params, formats, binary),
            self.statement_guard,
            conn.pgconn.socket,
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
    its ticket hands it the lease (the twin of ``psycopg.HandoffWaiter``)."""

    def __init__(
        self, listener: AsyncListener, key: str, ticket: int | None,
        on_close: Callable[[AsyncHandoffWaiter], Awaitable[None]] | None = None,
    ) -> None:  # fmt: skip
        self.listener, self.key, self.ticket = listener, key, ticket
        self.seq = next(queue_order)  # the order waiters of this process joined the queue
        self.event = asyncio.Event()
        self.listener_key = 0
        self.grant: Grant | None = None
        self.handed_over = False  # the core took the grant a release handed us
        self.left_line = False  # an attempt of its owner took the name and left the queue
        self.rung = False  # a release rang it: it is first in the server's line
        self.acquired = False  # the wait ended with the lease ours (however it came)
        self._on_close = on_close

    def deliver(self, grant: Grant) -> None:
        self.grant = grant
        self.event.set()

    async def wait(self, timeout: float) -> bool:
        """True if a notice woke it (or a release handed it the lease): read from the event
        itself after the wait, never from how the wait ended. ``wait_for`` can time out with
        the event set (at once with a timeout of 0; or when its timer and the set fall in one
        turn of the loop), and clearing it then lost the wake-up and left a handed-over lease
        untaken until it expired."""
        pending = self.grant is not None  # handed the lease already: no need to wait
        return await awoken(self.event, 0.0 if pending else timeout) or pending

    async def take_grant(self) -> Grant | None:
        if self.grant is not None:
            self.handed_over = self.acquired = True
        return self.grant

    async def finish(self, result: Grant | Busy) -> None:
        self.acquired = isinstance(result, Grant)

    @property
    def ahead(self) -> int:
        return queued_ahead(self.listener.waiters_of(self.key), self)

    def unsubscribe(self) -> None:
        self.listener.unsubscribe(self)

    async def close(self) -> None:
        self.unsubscribe()
        if self._on_close is not None:
            await self._on_close(self)


class AsyncListener:
    """One ``LISTEN`` connection per backend, shared by the waiters of every name, read by one
    task (the twin of ``psycopg.Listener``: same payloads, same listener key).

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
    ) -> AsyncHandoffWaiter:  # fmt: skip
        """A waiter for ``key`` (handed a lease by a release naming ``ticket``, if given), with
        the listener key to queue it with; the connection listens before this returns."""
        async with self._start_lock:
            if self._conn is None:
                await self._start()
        waiter = AsyncHandoffWaiter(self, key, ticket, on_close)
        self._waiters.setdefault(key, set()).add(waiter)
        waiter.listener_key = self.listener_key
        return waiter

    def waiters_of(self, key: str) -> set[AsyncHandoffWaiter]:
        return self._waiters.get(key, set())

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
        notice = read_notice(payload)
        if notice is None:
            return
        key, ticket, grant = notice
        woken = wake(list(self._waiters.get(key, ())), ticket, grant)
        if woken is not None and self._unclaimed is not None:
            await self._unclaimed(woken)

    async def close(self) -> None:
        """Stop the task and close its connection."""
        task, self._task, self._conn = self._task, None, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class AsyncLink(AsyncSession):
    """One pooled connection of an :class:`AsyncPsycopgDriver`: an :class:`AsyncSession`
    whose lock is the pool's, answering the store's requests."""

    def __init__(self, driver: AsyncPsycopgDriver) -> None:
        super().__init__(driver.params, driver.timeout)
        self.driver = driver
        #: As Link.kept: the cursor of a take's statements (kept_cursor).
        self.kept: tuple[Any, psycopg.AsyncCursor[Any], str] | None = None

    async def answer(self, request: Any) -> Any:
        """One request; creates the tables if they are missing."""
        try:
            return await self._answer(request)
        except MISSING:  # first use
            await adrive(self.driver.store.create(), self._answer)
            return await self._answer(request)

    async def _answer(self, request: Any) -> Any:
        if type(request) is Prepared:
            assert self.conn is not None
            return await self.run_prepared(self.conn, *request, True)
        if type(request) is Query:
            return await self.execute(request[0], request[1])
        return await self.driver.listen(request)

    async def execute(self, query: str, params: Sequence[Any] | None) -> tuple[list[Any], int]:
        """One statement through psycopg, ``$n`` placeholders: (rows, rowcount)."""
        conn = self.conn
        assert conn is not None

        async def run() -> tuple[list[Any], int]:
            cur = psycopg.AsyncRawCursor(conn)
            await cur.execute(query, params, prepare=params is not None)  # None: a script
            result = cur.pgresult
            tuples = result is not None and result.status == TUPLES_OK
            return (await cur.fetchall() if tuples else []), cur.rowcount

        return await cut_after(run(), self.statement_guard, conn.pgconn.socket)

    async def run_statement(self, cur: psycopg.AsyncCursor[Any], sql: str, params: Any) -> None:
        """A take's or a lease's statement in the application's style, on ``cur``."""
        await cur.execute(sql, params)

    def usable(self) -> bool:
        """After an error: whether the connection is idle and sound (else it is closed)."""
        conn = self.conn
        return not (
            conn is None
            or conn.closed
            or conn.broken
            or conn.pgconn.status != psycopg.pq.ConnStatus.OK
            or conn.pgconn.transaction_status != IDLE
        )


class AsyncPsycopgDriver(AsyncDriver):
    """The asyncio driver of the ``postgresql://`` store: the twin of
    :class:`latchkey.stores.io.psycopg.PsycopgDriver`."""

    errors = NET_ERRORS

    def __init__(self, backend: BackendBase, store: Any) -> None:
        super().__init__(backend, store)
        self.timeout = backend.timeout
        self.params = connection_params(backend.url, backend.config, "latchkey")
        self.pool: AsyncPool[AsyncLink] = AsyncPool(self._open, _close, alive=_alive)
        # Callers take turns for the pool's connections first come, first served (asyncio's
        # Semaphore is fair; the pool alone lets a newcomer take a connection freed for a
        # caller already waiting, and 1,000 polling waiters starved some past the timeout).
        self.turns = asyncio.Semaphore(self.pool.size)
        if backend.client is not None:  # the application's pool, connection or engine
            from latchkey.stores.io.psycopg import _FROM_THE_URL
            from latchkey.stores.io.psycopg_borrowed import listener_params
            from latchkey.stores.io.psycopg_borrowed_async import AsyncBorrowedLinks

            self.pool = AsyncBorrowedLinks(self, backend.client)  # type: ignore[assignment]
            self.turns = asyncio.Semaphore(self.pool.size)
            own = {k: v for k, v in self.params.items() if k not in _FROM_THE_URL | {"password"}}
            theirs = listener_params(backend.client)  # the client's own win, but for options:
            if "options" in theirs:  # ours after theirs (statement_timeout, TimeZone)
                theirs["options"] = f"{theirs['options']} {own['options']}"
            self.params = {**own, **theirs}
        session = AsyncSession(self.params, self.timeout)  # the listener's connect and deadlines
        self.listener = AsyncListener(session, store.channel, self._unclaimed)

    async def _open(self) -> AsyncLink:
        link = AsyncLink(self)
        await link.connection()
        return link

    async def answer(self, request: Any) -> Any:  # pragma: no cover - run() answers on a link
        raise NotImplementedError

    async def run(self, steps: Steps[T], action: str) -> T:
        """The primitive on one pooled link. One that may grant (``GRANTING``) runs to its
        end if its caller is cancelled (:func:`~latchkey.stores.io.aio.to_the_end`): its
        connection closed, the server would still run a statement waiting for a row lock
        (PostgreSQL does not notice a client gone while it waits) and could grant after the
        core's release that follows a cancellation. Any other is cut, its link discarded."""
        if action in GRANTING:
            return await to_the_end(self._run(steps, action))
        return await self._run(steps, action)

    async def _run(self, steps: Steps[T], action: str) -> T:
        pool = self.pool
        try:
            async with self.turns:
                link = await pool.get(self.timeout)
                try:
                    result = await adrive(steps, link.answer)
                except Exception as exc:
                    if link.usable() and not isinstance(exc, asyncio.TimeoutError):
                        await pool.put(link)
                    else:
                        await pool.discard(link)  # half-read: never reused
                    raise
                except BaseException:  # cancelled mid-statement: never reused
                    await asyncio.shield(pool.discard(link))
                    raise
                await pool.put(link)
                return result
        except StoreUnavailable:
            raise
        except self.errors as exc:
            self.backend.unavailable(exc, action)

    async def listen(self, request: Listen) -> AsyncHandoffWaiter:
        key, ticket, name, owner = request
        if ticket is None:
            return await self.listener.queue(key, None)

        async def leave(waiter: AsyncHandoffWaiter) -> None:
            try:
                steps = self.store.leave_queue(name, owner, waiter)
                await self.run(steps, f"leave the queue for {name!r}")
            except StoreUnavailable as exc:
                log.info("%s", exc)  # the wait's outcome stands; the outage is the caller's

        return await self.listener.queue(key, ticket, leave)

    async def _unclaimed(self, ticket: int) -> None:
        with contextlib.suppress(StoreUnavailable):
            await self.run(self.store.unclaimed(ticket), "release")

    async def aclose(self) -> None:
        await self.listener.close()
        await self.pool.close()

    async def pin(self) -> AsyncPinned:
        """A pooled connection held for a take (see :func:`apin_link`)."""
        return await apin_link(self)


async def _alive(link: AsyncLink) -> bool:
    return link.alive()


async def _close(link: AsyncLink) -> None:
    await link.discard()


# -- a connection held for a rows.take ---------------------------------------------------------


async def apin_link(driver: AsyncPsycopgDriver) -> AsyncPinned:
    """The twin of :func:`latchkey.stores.io.psycopg.pin_link`: one pooled
    :class:`AsyncLink` held across calls, ``Statement`` requests through a plain psycopg
    cursor."""
    pool = driver.pool
    with driver.backend.translate("connect", driver.errors):
        async with driver.turns:
            link = await pool.get(driver.timeout)

    async def answer(request: Any) -> Any:
        if type(request) is not Statement:
            return await link.answer(request)
        try:
            return await astatement(link, request)
        except MISSING:  # the lease table, on first use (never inside a take's transaction)
            assert link.conn is not None
            if link.conn.pgconn.transaction_status != IDLE:
                raise
            await adrive(driver.store.create(), link._answer)
            return await astatement(link, request)

    async def give_back(link: AsyncLink, reuse: bool) -> None:
        await (pool.put if reuse and link.usable() else pool.discard)(link)

    return AsyncPinned(driver, link, answer, give_back, user_error, bound=False)


async def astatement(link: AsyncLink, request: Statement) -> tuple[list[str] | None, list[Any]]:
    """One statement of a take on its held link, within the statement deadline."""
    conn = link.conn
    assert conn is not None

    async def run() -> tuple[list[str] | None, list[Any]]:
        cur, encoding = kept_cursor(link)
        await link.run_statement(cur, request.sql, request.params)  # params None: sent as is
        columns = result_columns(cur, encoding)
        return (None, []) if columns is None else (columns, await cur.fetchall())

    return await cut_after(run(), link.statement_guard, conn.pgconn.socket)
