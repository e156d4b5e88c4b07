"""memcached's meta protocol for asyncio: the asyncio driver of ``memcached://``.

The twin of :mod:`latchkey.stores.io.memcached` (whose docstring describes the requests, the
sessions and the framing, shared from there): the same store steps, each request awaited.

A connection is an :class:`asyncio.Protocol` with its own receive buffer: ``data_received``
appends, and the request in progress takes whole replies from the buffer (:func:`take`),
waiting on one future whenever it needs more bytes. That is the cheapest way through asyncio
(streams add a reader, a ``drain`` and a ``readuntil`` per reply: ``bench/asyncfloor.py``).
Bytes in the buffer before a request are replies nobody asked for: such a connection is never
reused (dropped when taken from the pool).

Each server has a pool of connections, at most :data:`POOL_MAX` out at once (a thousand polling
waiters do not open a thousand sockets); the idle ones stay open. Not
:class:`latchkey.stores.io.aio.AsyncPool`: its ``get`` + ``put`` cost 3.8 µs a primitive against
1.1 µs here (an ``asyncio.Condition`` taken on every put, the ``alive`` coroutine awaited on
every reuse to see unread bytes; timeit on the development VM). Every primitive runs within
``?timeout=`` (one deadline around it, :func:`~latchkey.stores.io.aio.bounded`, waiting for a
pooled connection and opening one included); a connection that errored, timed out or was
cancelled mid-request is closed, never pooled again. memcached has no push: the core polls.
"""

from __future__ import annotations

import asyncio
import math
import select
import time
from typing import TYPE_CHECKING, Any, TypeVar

from latchkey.errors import StoreUnavailable
from latchkey.stores.io import Steps
from latchkey.stores.io.aio import AsyncDriver, adrive, bounded
from latchkey.stores.io.memcached import _FRESH, ProtocolError, Reply, started, take

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase

T = TypeVar("T")
POOL_MAX = 32  # connections to one server out at once; the idle ones stay open for reuse


class Connection(asyncio.Protocol):
    """One connection to one server process, with its receive buffer and session. The loop
    calls :meth:`data_received` and :meth:`connection_lost`; the request's coroutine reads
    whole replies from the buffer, awaiting :meth:`_more` while one is incomplete."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.lost: BaseException | None = None  # why the connection ended, once it has
        self.done: asyncio.Future[None] = loop.create_future()  # set when it has ended
        self._waiter: asyncio.Future[None] | None = None  # the request waiting for bytes
        self.session: Any = None
        self.idle_since = -math.inf  # when it went back to the pool (monotonic)
        self._poll = select.poll()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._poll.register(transport.get_extra_info("socket").fileno(), select.POLLIN)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def eof_received(self) -> bool:
        self._end(ConnectionResetError("memcached closed the connection"))
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(exc or ConnectionResetError("memcached connection closed"))
        if not self.done.done():
            self.done.set_result(None)

    def _end(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _more(self) -> None:
        """Wait until more bytes are in the buffer, or the connection ended (an error)."""
        if self.lost is not None:
            raise ConnectionResetError(f"memcached connection lost: {self.lost}")
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self.lost is not None and not self.buffer:
            raise ConnectionResetError(f"memcached connection lost: {self.lost}")

    def stale(self, now: float) -> bool:
        """True if the server closed this idle connection (it never speaks unasked), or it
        holds bytes nobody asked for. The loop notices an end of stream only when it next
        polls its sockets, which a server restarted while this coroutine ran has not let it
        do: like the sync pool, a connection idle for :data:`_FRESH` or more is polled."""
        if self.lost is not None or self.buffer or self.is_closing():
            return True
        if now - self.idle_since < _FRESH:
            return False
        try:
            return bool(self._poll.poll(0))
        except (OSError, ValueError):
            return True

    def send(self, data: bytes) -> None:
        if self.buffer:  # replies never read: they would be taken for this request's
            raise ProtocolError(f"{len(self.buffer)} unread bytes before a request")
        if self.lost is not None or self.transport is None:
            raise ConnectionResetError(f"memcached connection lost: {self.lost}")
        self.transport.write(data)

    async def trip(self, commands: bytes, count: int, probe: bool) -> list[Reply | None]:
        """Send ``commands`` in one write and read ``count`` replies: one round trip."""
        self.send(commands)
        await self._more()
        buf = self.buffer
        whole = buf[:2] == b"HD" and buf.find(b"\r\n") == len(buf) - 2  # one whole HD line
        if whole and (count == 1 or (probe and count == 2)):
            line = (bytes(buf[:-2]), None)
            buf.clear()
            return [line] if count == 1 else [None, line]
        got = started(await self.reply(), probe)
        while len(got) < count:
            got.append(await self.reply())
        return got

    async def reply(self) -> Reply:
        while (reply := take(self.buffer)) is None:
            await self._more()
        return reply

    async def answer(self, request: Any) -> list[Reply | None]:
        return await self.trip(request[1], request[2], request[3])

    def is_closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def close(self) -> None:
        """Drop the connection now (unsent bytes and unread replies with it)."""
        if self.transport is not None:
            self.transport.abort()


class Server:
    """A pool of connections to one server (see the module docstring)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[Connection] = []
        self.room = asyncio.Semaphore(POOL_MAX)
        self.closed = False

    async def checkout(self, store: Any, node: int) -> Connection:
        """An idle connection the server has not closed, or a new one (greeted). Given back
        with :meth:`checkin`, or :meth:`discard`."""
        await self.room.acquire()
        try:
            now = time.monotonic()
            while self.idle:
                conn = self.idle.pop()
                if not conn.stale(now):
                    return conn
                conn.close()  # the server restarted or dropped it: a fresh one, not an error
            loop = asyncio.get_running_loop()
            _, conn = await loop.create_connection(lambda: Connection(loop), self.host, self.port)
            try:
                conn.session = await adrive(store.greet(node), conn.answer)
            except BaseException:
                conn.close()
                raise
            return conn
        except BaseException:
            self.room.release()
            raise

    def checkin(self, conn: Connection) -> None:
        self.room.release()
        if self.closed:
            conn.close()
        else:
            conn.idle_since = time.monotonic()
            self.idle.append(conn)

    def discard(self, conn: Connection) -> None:
        conn.close()  # its stream may be mid-reply
        self.room.release()

    async def aclose(self) -> None:
        self.closed = True
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.close()
        for conn in idle:
            await conn.done


class AsyncMemcachedDriver(AsyncDriver):
    errors = (OSError, ProtocolError, asyncio.TimeoutError)

    def __init__(self, backend: BackendBase, store: Any) -> None:
        super().__init__(backend, store)
        self.servers = [Server(host, port) for host, port in store.servers]

    async def answer(self, request: Any) -> Any:  # pragma: no cover - run() answers
        raise NotImplementedError

    async def run(self, steps: Steps[T], action: str) -> T:
        """Run a primitive within the store's timeout; a driver error or the timeout is
        StoreUnavailable."""
        timeout = self.backend.timeout
        try:
            return await bounded(self._steps(steps), timeout)
        except StoreUnavailable:
            raise
        except self.errors as exc:
            if isinstance(exc, asyncio.TimeoutError) and not str(exc):
                exc = TimeoutError(f"memcached did not answer within {timeout}s")
            self.backend.unavailable(exc, action)

    async def _steps(self, steps: Steps[T]) -> T:
        """:func:`~latchkey.stores.io.aio.adrive` written out, as the sync driver's ``run``
        (no coroutine made per request): each request answered on the primitive's connection
        to its server; an error, a timeout or a cancellation closes them (mid-reply)."""
        conn: Any = None  # the connection to ``node``, the server of the last request…
        node = -1
        more: dict[int, Connection] = {}  # …and those to other servers (a claim's)
        value: Any = None
        error: BaseException | None = None
        try:
            while True:
                try:
                    request = steps.send(value) if error is None else steps.throw(error)
                except StopIteration as stop:
                    result: T = stop.value
                    break
                try:
                    to = request if request.__class__ is int else request[0]
                    if to != node:
                        new = more.pop(to, None) or await self.servers[to].checkout(self.store, to)
                        if conn is not None:
                            more[node] = conn
                        conn, node = new, to
                    if request.__class__ is int or (
                        request[4] is not None and request[4] != conn.session
                    ):
                        value, error = conn.session, None  # (a request for another: not sent)
                    else:
                        value, error = await conn.trip(request[1], request[2], request[3]), None
                except BaseException as exc:  # thrown into the store's generator
                    value, error = None, exc
        except BaseException:
            if conn is not None:
                self.servers[node].discard(conn)
            for other, each in more.items():
                self.servers[other].discard(each)
            raise
        if conn is not None:
            self.servers[node].checkin(conn)
        for other, each in more.items():
            self.servers[other].checkin(each)
        return result

    async def aclose(self) -> None:
        for server in self.servers:
            await server.aclose()
