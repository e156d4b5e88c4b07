"""Redis through ``redis.asyncio``: the asyncio driver of :mod:`latchkey.stores.redis`.

The twin of :mod:`latchkey.stores.io.redis`: the same requests, packed the same way (RESP
built there), sent over ``redis.asyncio`` connections of the client's settings with their
public ``send_packed_command`` / ``read_response``: at most :data:`POOL_SIZE` commands in
flight, first come first served (so a thousand coroutines retrying at once share a few
connections), each on an idle connection (last-in first-out) checked with ``can_read()`` when
idle for :data:`~latchkey.stores.io.redis.CHECK_AFTER` or more. A connection that errored,
timed out or was cancelled mid-command is closed, never reused half-read. Not
:class:`~latchkey.stores.io.aio.AsyncPool`: its get + put (a condition notified at every
give-back) cost 16 µs against 5 µs for this semaphore and list (loaded 2-core VM), and
under a herd (a release wakes a thousand waiters, each acquires once) its wait let
newcomers take the connections woken waiters were promised, until some ran out of time.

Timeouts: each request runs under one deadline of the store's ``timeout``
(``stores/io/deadlines.py``), connecting also under redis-py's ``socket_connect_timeout``. The
connections have no ``socket_timeout`` of their own: on Python 3.11 redis-py enforces it with
``asyncio.wait_for`` around every send (a task each) and a second timer around every read, which
tripled the cost of a round trip; the one deadline per request bounds the same awaits.

Waiting: one pub/sub connection per backend, read by one task (:class:`Listener`), wakes
every waiter of the backend through its own :class:`asyncio.Event`; a waiting coroutine holds
no thread and no pooled connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import redis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from latchkey._types import Busy, Grant
from latchkey.errors import StoreUnavailable
from latchkey.stores.base import AsyncWaiter
from latchkey.stores.io import Steps
from latchkey.stores.io.aio import AsyncDriver
from latchkey.stores.io.lines import place_in_line
from latchkey.stores.io.redis import (
    CHECK_AFTER,
    borrowed_settings,
    pack,
    pack_script,
    settings,
)
from latchkey.stores.redis import Command, Subscribe

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase
    from latchkey.stores.redis import Redis

if sys.version_info >= (3, 11):
    from latchkey.stores.io.deadlines import Deadline as _deadline  # asyncio.timeout, cheaper
else:  # redis-py itself depends on async-timeout before Python 3.11.3
    from async_timeout import timeout as _deadline  # type: ignore[import-not-found,unused-ignore]

log = logging.getLogger("latchkey")
#: Commands in flight at once per backend (each on a connection of its own).
POOL_SIZE = 32
_monotonic = time.monotonic
T = TypeVar("T")
# asyncio.TimeoutError is TimeoutError (an OSError) from Python 3.11 on, a class of its own before
ERRORS: tuple[type[BaseException], ...] = (redis.RedisError, OSError, asyncio.TimeoutError)


async def _alive(conn: Any) -> bool:
    """Nothing to read on an idle connection (no EOF, no stray bytes)."""
    try:
        return not await conn.can_read()
    except (redis.ConnectionError, OSError):
        return False


async def _close(conn: Any) -> None:
    with contextlib.suppress(Exception):
        await conn.disconnect(nowait=True)


class AsyncRedisDriver(AsyncDriver):
    """Sends each request over a pooled connection; answers Subscribe with a waiter."""

    errors = ERRORS
    borrows_settings = True  # see the sync driver

    def __init__(self, backend: BackendBase, store: Redis) -> None:
        super().__init__(backend, store)
        self.timeout = backend.timeout
        if backend.client is not None and self.borrows_settings:  # (see io.redis)
            self.client: redis.asyncio.Redis | None = None
            cls, kwargs = borrowed_settings(backend.client, self.timeout, Retry(NoBackoff(), 0))
            kwargs["socket_timeout"] = None  # one deadline per request (module docstring)
        else:
            self.client = self.make_client(store)  # its settings make our connections
            cls = self.client.connection_pool.connection_class
            kwargs = self.client.connection_pool.connection_kwargs
        self.new_connection: Callable[[], Any] = functools.partial(cls, **kwargs)
        self.check_health = bool(kwargs.get("health_check_interval"))  # see the sync driver

        self.idle: list[tuple[Any, float]] = []  # (connection, when it was given back)
        self.closed = False
        self._turns = asyncio.Semaphore(POOL_SIZE)  # fair: first come first served
        self._listener: Listener | None = None
        self._listener_lock = asyncio.Lock()

    def make_client(self, store: Redis) -> redis.asyncio.Redis:
        """The client whose connection pool's class and settings make ours (see the sync
        driver's); no socket timeout: each request has one deadline (module docstring)."""
        return redis.asyncio.Redis(
            **{**settings(store), "socket_timeout": None},
            retry=Retry(NoBackoff(), 0),  # a primitive never retries: the core decides
        )

    async def run(self, steps: Steps[T], action: str) -> T:
        """:meth:`AsyncDriver.run` with :func:`~latchkey.stores.io.aio.adrive` written in: one
        coroutine less per primitive, on the hot path of every acquire and release."""
        answer = self.answer
        try:
            request = steps.send(None)
            while True:
                try:
                    value = await answer(request)
                except BaseException as exc:  # thrown into the store's generator
                    request = steps.throw(exc)
                else:
                    request = steps.send(value)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        except StoreUnavailable:
            raise
        except ERRORS as exc:
            self.backend.unavailable(exc, action)

    async def answer(self, request: Any) -> Any:
        kind = type(request)
        if kind is Subscribe:
            return passes_on(await self.subscribe(request.channel), self, request)
        async with _deadline(self.timeout):
            if kind is tuple:  # a Script
                packed = pack_script(request)
                try:
                    return await self.call(packed)
                except redis.exceptions.NoScriptError:
                    await self.call(pack(("SCRIPT", "LOAD", request[0].text)))
                    return await self.call(packed)
            if kind is Command:
                return await self.call(pack(request.words))
        raise TypeError(f"not a Redis request: {request!r}")

    async def call(self, packed: bytes) -> Any:
        """Send one packed command on a pooled connection, read its reply."""
        async with self._turns:
            idle = self.idle  # the last given back first; checked if idle a while
            try:
                conn, since = idle.pop()
            except IndexError:
                conn = self.new_connection()
            else:
                if _monotonic() - since >= CHECK_AFTER and not await _alive(conn):
                    await conn.disconnect()  # closed by the server, or stray bytes
            try:
                await conn.send_packed_command(packed, check_health=self.check_health)
                reply = await conn.read_response()
            except redis.ResponseError:  # an error reply, read in full: the connection is fine
                idle.append((conn, _monotonic()))
                raise
            except BaseException:  # cancelled or failed mid-command: its state is unknown
                await _close(conn)
                raise
            if self.closed:  # closed while this call ran (a give-back in the background)
                await _close(conn)
            else:
                idle.append((conn, _monotonic()))
        return reply

    async def subscribe(self, channel: str) -> AsyncWaiter:
        """A waiter already subscribed (confirmed by the server) to ``channel``."""
        try:
            async with _deadline(self.timeout):
                listener = await self._get_listener()
            event = await listener.add(channel)
        except ERRORS as exc:
            self.backend.unavailable(exc, "subscribe")
        return PushWaiter(listener, channel, event)

    async def _get_listener(self) -> Listener:
        async with self._listener_lock:
            current = self._listener
            if current is None or current.error is not None:
                if current is not None:
                    await current.close()
                self._listener = None
                current = Listener(self.new_connection(), self.timeout)
                await current.start()
                self._listener = current
            return current

    async def aclose(self) -> None:
        """Close every connection, whatever the server's state: a step that fails (a server
        gone or frozen while a connection closes) does not leave the later ones open."""
        self.closed = True
        async with self._listener_lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(*ERRORS):
                await listener.close()
        idle, self.idle = self.idle, []
        for conn, _ in idle:
            await _close(conn)
        if self.client is not None:  # ours, never a borrowed one
            with contextlib.suppress(*ERRORS):
                await self.client.aclose()


class Listener:
    """One pub/sub connection shared by every waiter of a backend, read by one task.

    Each waiter is an :class:`asyncio.Event` in the set of its channel; the reader sets the
    events of a channel when a release is announced on it. Replies to SUBSCRIBE/UNSUBSCRIBE
    come back in order, so each command sent gets a sequence number and the future of its
    reply: :meth:`add` returns once the reply to its channel's SUBSCRIBE was read, and from
    then on the server delivers every PUBLISH on the channel. A channel is unsubscribed when
    its last waiter leaves. If the connection fails (or a SUBSCRIBE goes unanswered within
    the timeout), every waiter wakes once, later waits just sleep (the core polls), and the
    backend opens a new listener for the next subscribe.

    The commands and reply kinds are class attributes: the Redis Cluster driver's listener
    speaks sharded pub/sub (SSUBSCRIBE, ``smessage``) with the same code.
    """

    SUBSCRIBE = "SUBSCRIBE"
    UNSUBSCRIBE = "UNSUBSCRIBE"
    ACKS: tuple[str, ...] = ("subscribe", "unsubscribe")
    MESSAGE = "message"

    def __init__(self, conn: Any, timeout: float) -> None:
        self.conn = conn  # made with the pool's settings but not in it: nobody else sends on it
        self.timeout = timeout
        self.channels: dict[str, dict[Bell, None]] = {}  # in the order the waiters came
        self.subscribed: dict[str, asyncio.Future[None]] = {}  # channel -> its SUBSCRIBE's reply
        self.replies: dict[int, asyncio.Future[None]] = {}  # sequence number -> reply read
        self.sent = 0
        self.acked = 0
        self.send_lock = asyncio.Lock()  # sequence numbers follow the order on the wire
        self.error: BaseException | None = None
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        try:
            await self.conn.connect()
        except BaseException:
            await self.conn.disconnect(nowait=True)
            raise
        self.task = asyncio.get_running_loop().create_task(
            self._read(), name="latchkey-redis-listener"
        )

    async def _read(self) -> None:
        try:
            while True:
                reply = await self.conn.read_response()  # no socket timeout: waits for news
                kind = reply[0]
                if kind == self.MESSAGE:  # one waiter: see the sync Listener
                    _wake_first(self.channels.get(reply[1], {}))
                elif kind in self.ACKS:
                    self.acked += 1
                    done = self.replies.pop(self.acked, None)
                    if done is not None and not done.done():
                        done.set_result(None)
        except Exception as exc:  # the connection is gone (redis-py disconnected it)
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        """Mark the listener failed: wake every waiter and every pending reply, stop reading."""
        if self.error is None:
            self.error = exc
        for events in self.channels.values():
            for event in events:
                event.set()
        for done in self.replies.values():
            if not done.done():
                done.set_result(None)
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()  # its read is interrupted: redis-py disconnects the connection

    async def _send(self, command: str, channel: str, done: asyncio.Future[None] | None) -> None:
        """Send SUBSCRIBE or UNSUBSCRIBE; ``done`` is set when its reply has been read."""
        async with self.send_lock:
            self.sent += 1
            if done is not None:
                self.replies[self.sent] = done
            try:
                async with _deadline(self.timeout):
                    await self.conn.send_command(command, channel, check_health=False)
            except BaseException as exc:  # half sent, maybe: redis-py disconnected it
                self._fail(exc if isinstance(exc, Exception) else ConnectionError("cancelled"))
                raise

    async def add(self, channel: str) -> Bell:
        """Subscribe a new waiter to ``channel``; returns once the server confirmed it."""
        if self.error is not None:
            raise self.error
        event = Bell()
        self.channels.setdefault(channel, {})[event] = None
        try:
            subscribed = self.subscribed.get(channel)
            if subscribed is None:  # the channel's first waiter (since its last UNSUBSCRIBE)
                subscribed = asyncio.get_running_loop().create_future()
                self.subscribed[channel] = subscribed
                await self._send(self.SUBSCRIBE, channel, subscribed)
            try:
                async with _deadline(self.timeout):
                    await asyncio.shield(subscribed)  # shared by the channel's waiters
            except asyncio.TimeoutError as exc:  # no reply in time: this connection is done
                self._fail(exc)
                unanswered = f"no reply to SUBSCRIBE within {self.timeout:g}s"
                raise redis.TimeoutError(unanswered) from None
            if self.error is not None:
                raise self.error
        except BaseException:
            await self.remove(channel, event)
            raise
        return event

    async def remove(self, channel: str, event: Bell, pass_on: bool = False) -> bool:
        """``event``'s waiter leaves; ``pass_on``: it was woken and did not get the lease, so
        the next waiter is woken in its place. True if ``pass_on`` found no waiter here to
        wake (the store's turn must pass on: see PushWaiter.close)."""
        events = self.channels.get(channel)
        if events is None:
            return pass_on
        events.pop(event, None)
        if pass_on and _wake_first(events):
            pass_on = False
        if events or self.error is not None:
            return pass_on
        del self.channels[channel]
        self.subscribed.pop(channel, None)
        with contextlib.suppress(*ERRORS):  # the listener failed (see _send): the next
            await self._send(self.UNSUBSCRIBE, channel, None)  # subscribe opens a new one
        return pass_on

    async def close(self) -> None:
        self._fail(ConnectionError("the backend was closed"))
        if self.task is not None:
            await asyncio.wait([self.task])
        await _close(self.conn)  # at once: nothing is left to read or send on it


class Bell(asyncio.Event):
    """One waiter's wake-up; ``rung``: it has been woken at least once."""

    rung = False


def _wake_first(events: dict[Bell, None]) -> bool:
    """Wake the first waiter not woken yet; False if there is none."""
    for event in events:
        if not event.is_set():
            event.rung = True
            event.set()
            return True
    return False


def passes_on(waiter: Any, driver: Any, request: Subscribe) -> Any:
    """``waiter``, set to send ``request.passing`` through ``driver`` if it must pass its
    process's turn on (:meth:`PushWaiter.close`); errors are dropped (logged)."""
    if request.passing is not None:
        waiter.passing = functools.partial(_send_quietly, driver, request.passing)
    return waiter


async def _send_quietly(driver: Any, request: Any) -> None:
    try:
        await driver.answer(request)
    except Exception as exc:  # (a driver error or StoreUnavailable): the wait's outcome stands
        log.info("passing a turn on failed: %s", exc)


class PushWaiter(AsyncWaiter):
    """Woken by a PUBLISH from a release script; sleeps (the core polls) if the listener
    failed."""

    def __init__(self, listener: Listener, channel: str, event: Bell) -> None:
        self._listener = listener
        self._channel = channel
        self._event = event
        self._granted = False
        #: Sends the store's PASS (set by the driver for a mutex waiter): see :meth:`close`.
        self.passing: Callable[[], Awaitable[object]] | None = None

    async def finish(self, result: Grant | Busy) -> None:
        self._granted = type(result) is Grant

    @property
    def ahead(self) -> int:
        listener = self._listener
        if listener.error is not None:
            return 0
        return place_in_line(listener.channels.get(self._channel, ()), self._event)

    async def wait(self, timeout: float) -> bool:
        listener, event = self._listener, self._event
        if listener.error is not None and not event.is_set():
            await asyncio.sleep(max(0.0, timeout))
            return False
        if not event.is_set():
            try:
                async with _deadline(max(0.0, timeout)):
                    await event.wait()
            except asyncio.TimeoutError:
                return False
        event.clear()
        return listener.error is None

    async def close(self) -> None:
        """Leave; woken and leaving without the lease, wake the next waiter of this process,
        or, with none left here, pass the process's turn on in the store (see the sync
        driver's)."""
        pass_on = self._event.rung and not self._granted
        if await self._listener.remove(self._channel, self._event, pass_on) and self.passing:
            await self.passing()
