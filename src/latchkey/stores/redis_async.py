"""The Redis store for asyncio (``redis://``, ``rediss://``), on ``redis.asyncio``.

The scripts, the key layout and the reply parsing are the sync store's
(:mod:`latchkey.stores.redis`); only how bytes move differs. Scripts run with EVALSHA over
connections of the client's settings (see :class:`_Connections`); a connection that errored,
timed out or was cancelled mid-command is disconnected, never reused half-read.

Timeouts: every network await runs under a deadline of the store's ``timeout``
(``asyncio.timeout``), and connecting also under redis-py's ``socket_connect_timeout``. The
connections have no ``socket_timeout`` of their own: on Python 3.11 redis-py enforces it with
``asyncio.wait_for`` around every send (a task each) and a second timer around every read,
which tripled the cost of a round trip; the one deadline per primitive bounds the same awaits.

Waiting: one pub/sub connection per backend, read by one task (:class:`_Listener`), wakes
every waiter of the backend through its own :class:`asyncio.Event`; a waiting coroutine holds
no thread and no pooled connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import datetime, timezone
from typing import Any

import redis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from latchkey._types import Busy, Grant, LockInfo
from latchkey._url import StoreURL
from latchkey.stores.base import AsyncBackend, AsyncWaiter
from latchkey.stores.redis import (
    _BATCH,
    ACQUIRE,
    CLAIM,
    EXTEND,
    FORCE_RELEASE,
    INSPECT,
    PURGE,
    RECORD_DELETE,
    RECORD_SET,
    RELEASE,
    RELEASE_MANY,
    KeyLayout,
    PackedScript,
    RedisBackend,
    _dt,
    _grant,
    _holder,
    _info,
    _ttl_ms,
    connection_settings,
)

if sys.version_info >= (3, 11):
    from asyncio import timeout as _deadline
else:  # redis-py itself depends on async-timeout before Python 3.11.3
    from async_timeout import timeout as _deadline  # type: ignore[import-not-found,unused-ignore]

# asyncio.TimeoutError is TimeoutError (an OSError) from Python 3.11 on, a class of its own before
_ERRORS: tuple[type[BaseException], ...] = (redis.RedisError, OSError, asyncio.TimeoutError)


class AsyncRedisBackend(KeyLayout, AsyncBackend):
    """Leases, claims and records in Redis for asyncio, one Lua script per primitive."""

    scheme = RedisBackend.scheme
    capabilities = RedisBackend.capabilities
    options = RedisBackend.options

    def __init__(self, url: StoreURL) -> None:
        super().__init__(url)
        self.prefix = self.config["prefix"]
        self.client = redis.asyncio.Redis(
            **{**connection_settings(url, self.config), "socket_timeout": None},
            retry=Retry(NoBackoff(), 0),  # a primitive never retries: the core decides
        )
        self._connections = _Connections(self.client)
        register = self._connections.script
        self._acquire = register(ACQUIRE)
        self._claim = register(CLAIM)
        self._release = register(RELEASE)
        self._release_many = register(RELEASE_MANY)
        self._extend = register(EXTEND)
        self._inspect = register(INSPECT)
        self._force_release = register(FORCE_RELEASE)
        self._purge = register(PURGE)
        self._record_set = register(RECORD_SET)
        self._record_delete = register(RECORD_DELETE)
        self._scripts = (self._acquire, self._claim, self._release, self._release_many,
                         self._extend, self._inspect, self._force_release, self._purge,
                         self._record_set, self._record_delete)  # fmt: skip
        self._listener: _Listener | None = None
        self._listener_lock = asyncio.Lock()

    async def _run(self, action: str, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """One script call within the store's timeout; driver errors become StoreUnavailable."""
        try:
            async with _deadline(self.timeout):
                return await script(keys, args)
        except _ERRORS as exc:
            self.unavailable(exc, action)

    async def _scan_names(self, prefix: str) -> list[str]:
        """Names with a lease key, in name order (one deadline per SCAN step)."""
        pattern, cursor, keys = self._scan_pattern(prefix), 0, list[str]()
        while True:
            async with _deadline(self.timeout):
                cursor, found = await self.client.scan(cursor, match=pattern, count=1000)
            keys += map(str, found)  # decoded already (decode_responses)
            if cursor == 0:
                return self._names(keys, prefix)

    # -- leases ----------------------------------------------------------------------------

    async def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        args: list[str | int] = [owner, owner_info, _ttl_ms(ttl)]
        if limit != 1:  # the script's default: one ARGV less on the hot path
            args.append(limit)
        reply = await self._run("acquire", self._acquire, [self._base(name)], args)
        if isinstance(reply, str):
            return _grant(reply)
        expires, now = int(reply[2]), int(reply[3])
        return Busy(int(reply[0]), _holder(reply[1], expires), max(0, expires - now) / 1000)

    async def release(self, name: str, owner: str) -> bool:
        return int(await self._run("release", self._release, [self._base(name)], [owner])) == 1

    async def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        reply = await self._run("extend", self._extend, [self._base(name)], [owner, _ttl_ms(ttl)])
        return None if reply is None else _grant(reply)

    async def inspect(self, name: str) -> LockInfo | None:
        reply = await self._run("inspect", self._inspect, [self._base(name)], [])
        return _info(name, reply[1])

    async def list(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        with self.translate("list", _ERRORS):
            names = await self._scan_names(prefix)
        for start in range(0, len(names), _BATCH):
            chunk = names[start : start + _BATCH]
            reply = await self._run("list", self._inspect, [self._base(n) for n in chunk], [])
            for n, flat in zip(chunk, reply[1:], strict=True):
                if (info := _info(n, flat)) is not None:
                    yield info

    async def force_release(self, name: str) -> bool:
        reply = await self._run("force_release", self._force_release, [self._base(name)], [])
        return int(reply) == 1

    async def purge_expired(self) -> int:
        with self.translate("purge_expired", _ERRORS):
            names = await self._scan_names("")
        count = 0
        for start in range(0, len(names), _BATCH):
            keys = [self._base(n) for n in names[start : start + _BATCH]]
            count += int(await self._run("purge_expired", self._purge, keys, []))
        return count

    # -- batch claims ----------------------------------------------------------------------

    async def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        if not names:
            return {}
        keys = [self._base(n) for n in names]
        reply = await self._run("claim", self._claim, keys, [owner, owner_info, _ttl_ms(ttl)])
        expires = _dt(reply[0])
        tokens = [int(t) for t in reply[1:]]
        return {n: Grant(t, expires) for n, t in zip(names, tokens, strict=True) if t > 0}

    async def release_many(self, names: Sequence[str], owner: str) -> int:
        if not names:
            return 0
        keys = [self._base(n) for n in names]
        return int(await self._run("release_many", self._release_many, keys, [owner]))

    # -- versioned records -----------------------------------------------------------------

    async def record_get(self, name: str) -> tuple[str | None, int]:
        with self.translate("record_get", _ERRORS):
            async with _deadline(self.timeout):
                key = self._record_key(name)
                value, version = await self.client.hmget(key, ["value", "version"])
        return (None, 0) if version is None else (str(value), int(version))

    async def record_set(self, name: str, value: str, version: int) -> int | None:
        key = [self._record_key(name)]
        new = int(await self._run("record_set", self._record_set, key, [value, version]))
        return None if new < 0 else new

    async def record_delete(self, name: str, version: int) -> bool:
        key = [self._record_key(name)]
        return int(await self._run("record_delete", self._record_delete, key, [version])) == 1

    # -- waiting, health, lifecycle --------------------------------------------------------

    async def subscribe(self, name: str) -> AsyncWaiter:
        """A waiter already subscribed (confirmed by the server) to ``name``'s channel."""
        channel = self._keys(name)[0]
        with self.translate("subscribe", _ERRORS):
            async with _deadline(self.timeout):
                listener = await self._get_listener()
            event = await listener.add(channel)
        return _PushWaiter(listener, channel, event)

    async def _get_listener(self) -> _Listener:
        async with self._listener_lock:
            current = self._listener
            if current is None or current.error is not None:
                if current is not None:
                    await current.close()
                self._listener = None
                pool = self.client.connection_pool  # a connection of its settings, not in it
                conn = pool.connection_class(**pool.connection_kwargs)
                current = _Listener(conn, self.timeout)
                await current.start()
                self._listener = current
            return current

    async def now(self) -> datetime:
        with self.translate("now", _ERRORS):
            async with _deadline(self.timeout):
                seconds, micros = await self.client.time()
        return datetime.fromtimestamp(seconds + micros / 1e6, tz=timezone.utc)

    async def init(self) -> None:
        """Load the scripts now (they are also loaded on first use, after NOSCRIPT)."""
        with self.translate("init", _ERRORS):
            for script in self._scripts:
                async with _deadline(self.timeout):
                    await self.client.script_load(script.text)

    async def aclose(self) -> None:
        async with self._listener_lock:
            if self._listener is not None:
                await self._listener.close()
            self._listener = None
        await self._connections.aclose()
        await self.client.aclose()


#: Commands in flight at once per store (each on a connection of its own).
MAX_CONNECTIONS = 32


class _Connections:
    """The connections scripts go over: redis-py connections made from the client pool's
    settings (host, db, AUTH, TLS, RESP2), used without the client.

    The client's per-command machinery (the pool's lock and bookkeeping, observability hooks,
    the retry wrapper, response callbacks) costs about as long as the loopback round trip
    itself; a script call needs none of it. An idle connection (LIFO) is checked before reuse
    with redis-py's ``can_read()``: if the server closed it while it sat idle (restart,
    ``CLIENT KILL``, ``timeout``) or it has bytes nobody asked for, it is reconnected. A
    connection that failed, timed out or was cancelled mid-command is disconnected and
    dropped, never reused half-read.
    """

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.client = client
        pool = client.connection_pool
        self._new: Callable[[], Any] = functools.partial(
            pool.connection_class, **pool.connection_kwargs
        )
        self.idle: list[Any] = []
        # At most this many commands in flight, so a thousand coroutines retrying at once
        # share a few connections instead of opening a thousand; the rest wait their turn.
        self._turns = asyncio.Semaphore(MAX_CONNECTIONS)

    def script(self, text: str) -> _Script:
        return _Script(self, text)

    async def call(self, packed: bytes) -> Any:
        """Send one packed command, read its reply."""
        async with self._turns:
            return await self._call(packed)

    async def _call(self, packed: bytes) -> Any:
        conn = self.idle.pop() if self.idle else self._new()
        try:
            if conn.is_connected and await _stale(conn):
                await conn.disconnect()
            await conn.send_packed_command(packed, check_health=False)  # connects if it must
            reply = await conn.read_response()
        except redis.ResponseError:  # an error reply, read in full: the connection is fine
            self.idle.append(conn)
            raise
        except BaseException:
            with contextlib.suppress(Exception):
                await conn.disconnect(nowait=True)
            raise
        self.idle.append(conn)
        return reply

    async def aclose(self) -> None:
        idle, self.idle = self.idle, []
        for conn in idle:
            with contextlib.suppress(Exception):
                await conn.disconnect()


async def _stale(conn: Any) -> bool:
    """Is there something to read on an idle connection (EOF, stray bytes)?"""
    try:
        return bool(await conn.can_read())
    except (redis.ConnectionError, OSError):
        return True


class _Script(PackedScript):
    """A script run with EVALSHA over :class:`_Connections`, loaded with SCRIPT LOAD only when
    the server answers NOSCRIPT (first use, restart, SCRIPT FLUSH)."""

    def __init__(self, connections: _Connections, text: str) -> None:
        super().__init__(text)
        self.connections = connections

    async def __call__(self, keys: Sequence[str], args: Sequence[str | int] = ()) -> Any:
        packed = self.pack(keys, args)
        try:
            return await self.connections.call(packed)
        except redis.exceptions.NoScriptError:
            await self.connections.client.script_load(self.text)
            return await self.connections.call(packed)


class _Listener:
    """One pub/sub connection shared by every waiter of a backend, read by one task.

    Each waiter is an :class:`asyncio.Event` in the set of its channel; the reader sets the
    events of a channel when a release is announced on it. Replies to SUBSCRIBE/UNSUBSCRIBE
    come back in order, so each command sent gets a sequence number and the future of its
    reply: :meth:`add` returns once the reply to its channel's SUBSCRIBE was read, and from
    then on the server delivers every PUBLISH on the channel. A channel is unsubscribed when
    its last waiter leaves. If the connection fails (or a SUBSCRIBE goes unanswered within
    the timeout), every waiter wakes once, later waits just sleep (the core polls), and the
    backend opens a new listener for the next subscribe.
    """

    def __init__(self, conn: Any, timeout: float) -> None:
        self.conn = conn  # made by the pool but not in it: nobody else sends on it
        self.timeout = timeout
        self.channels: dict[str, set[asyncio.Event]] = {}
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
                if kind == "message":
                    for event in self.channels.get(reply[1], ()):
                        event.set()
                elif kind in ("subscribe", "unsubscribe"):
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

    async def add(self, channel: str) -> asyncio.Event:
        """Subscribe a new waiter to ``channel``; returns once the server confirmed it."""
        if self.error is not None:
            raise self.error
        event = asyncio.Event()
        self.channels.setdefault(channel, set()).add(event)
        try:
            subscribed = self.subscribed.get(channel)
            if subscribed is None:  # the channel's first waiter (since its last UNSUBSCRIBE)
                subscribed = asyncio.get_running_loop().create_future()
                self.subscribed[channel] = subscribed
                await self._send("SUBSCRIBE", channel, subscribed)
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

    async def remove(self, channel: str, event: asyncio.Event) -> None:
        events = self.channels.get(channel)
        if events is None:
            return
        events.discard(event)
        if events or self.error is not None:
            return
        del self.channels[channel]
        self.subscribed.pop(channel, None)
        with contextlib.suppress(*_ERRORS):  # the listener failed (see _send): the next
            await self._send("UNSUBSCRIBE", channel, None)  # subscribe opens a new one

    async def close(self) -> None:
        self._fail(ConnectionError("the backend was closed"))
        if self.task is not None:
            await asyncio.wait([self.task])
        await self.conn.disconnect()


class _PushWaiter(AsyncWaiter):
    """Woken by a PUBLISH from a release script; sleeps (the core polls) if the listener
    failed."""

    def __init__(self, listener: _Listener, channel: str, event: asyncio.Event) -> None:
        self._listener = listener
        self._channel = channel
        self._event = event

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
        await self._listener.remove(self._channel, self._event)
