"""Redis through redis-py: the sync driver of :mod:`latchkey.stores.redis`.

Requests (:class:`~latchkey.stores.redis.Script`, ``Command``, ``Subscribe``) go over
redis-py connections made with the client's settings (host, db, AUTH, TLS, RESP2, the store's
timeout on every socket operation), used without the client: the command is packed here in
RESP, sent with the connection's public ``send_packed_command`` and its reply read with
``read_response``. redis-py's client spends about as long per command as the loopback round
trip itself (retry wrapper, the pool's lock and bookkeeping, observability hooks, response
callbacks; ~40 µs here), and a script call needs none of it. A script is sent as EVALSHA,
and loaded with SCRIPT LOAD only when the server answers NOSCRIPT (first use, restart,
SCRIPT FLUSH).

Connections are kept in a lock-free stack of their own (:class:`Connections`: fork-safe,
last-in first-out; :class:`latchkey.stores.io.Pool` costs 12 times more per call, see there).
One idle for :data:`CHECK_AFTER` or more is checked before reuse with redis-py's public
``can_read()``: if the server closed it while it sat idle (restart, ``CLIENT KILL``,
``timeout``), or it has bytes nobody asked for, a new one is made instead of failing the
call. One put back less than a millisecond ago is not checked (the check costs ~9 % of an
uncontended pair when run every time): a server that restarted within that millisecond costs
one StoreUnavailable instead of a silent reconnect. An error reply keeps the connection (it
was read in full); any other error closes it.

Waiting: one pub/sub connection per backend, shared by every waiter (:class:`Listener`).

A borrowed client (``latchkey.connect(client=redis.Redis(…))``): its pool's connection class
and settings (host, db, AUTH or credential provider, TLS, client name) make our connections,
with latchkey's own on top (replies decoded, RESP2, the store's timeout on every socket
operation, no retries); they are kept in our stack like any others, and :meth:`close` closes
them and never the client (:func:`borrowed_settings`). Not taken from the client's pool
(``get_connection``/``release``), because: that pool's lock and bookkeeping are the cost
this driver avoids on every call (see :class:`Connections`); its connections decode replies
and speak the protocol the application chose (RESP3, bytes), which our reply parsing does
not expect; the pub/sub listener holds its connection for as long as anyone waits, which a
bounded ``BlockingConnectionPool`` would lose to the application; and a ``timeout=`` of the
store must bound our calls whatever the client's socket timeout is (none by default).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from latchkey._types import Busy, Grant
from latchkey.errors import StoreUnavailable
from latchkey.stores.base import Waiter
from latchkey.stores.io import Driver, Steps, after_fork
from latchkey.stores.io.lines import place_in_line
from latchkey.stores.io.redis_options import uses_tls
from latchkey.stores.redis import Command, Subscribe

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase
    from latchkey.stores.redis import Redis, Script

log = logging.getLogger("latchkey")
#: An idle connection older than this is checked before it is used again (seconds).
CHECK_AFTER = 0.001
ERRORS: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
T = TypeVar("T")


def borrowed_settings(
    client: Any, timeout: float | None, retry: Any = None
) -> tuple[type, dict[str, Any]]:
    """The connection class and arguments of our connections made after a borrowed client's
    (sync or asyncio redis-py): its pool's settings, latchkey's reply format, timeout and no
    retries (``retry``: the asyncio flavour's Retry object) on top."""
    pool = client.connection_pool
    return pool.connection_class, {
        **ours_after(pool.connection_kwargs, timeout),
        "retry": retry or Retry(NoBackoff(), 0),  # a primitive never retries: the core decides
    }


def ours_after(kwargs: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    """A borrowed client's connection arguments with latchkey's reply format and timeout on
    top. Not the pool's maintenance-notification state (redis-py >= 7: RESP3 only, and the
    pool's own handler): our connections speak RESP2 and belong to no pool of redis-py's."""
    kept = {k: v for k, v in kwargs.items() if not k.startswith(("maint_notifications", "orig_"))}
    return {
        **kept,
        "decode_responses": True,
        "encoding": "utf-8",  # owner records are UTF-8, whatever the application reads
        "encoding_errors": "strict",
        "protocol": 2,
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
    }


def tls_settings(store: Redis) -> dict[str, Any]:
    """``ssl=True`` and certificates required (redis-py's default, said here) if the store's
    scheme is a ``rediss`` one (``rediss://``, ``rediss+sentinel://``, ``rediss+cluster://``),
    else nothing; the URL's TLS options (``ssl_ca_certs``…) come on top of these."""
    if not uses_tls(store.url.scheme):
        return {}
    return {"ssl": True, "ssl_cert_reqs": "required"}


def settings(store: Redis) -> dict[str, Any]:
    """The redis-py client arguments of a store (the sync and asyncio clients take the same):
    one host, the db number, AUTH, TLS, the store's timeout on every socket operation, RESP2
    (from Redis 5 on; pub/sub replies are plain arrays), and redis-py's own options the URL
    carries (:mod:`latchkey.stores.io.redis_options`: ``client_name``, ``ssl_ca_certs``…)."""
    url, config = store.url, store.config
    return {
        "host": url.host or "localhost",
        "port": url.port or 6379,
        "db": store.db,
        "username": url.username,
        "password": url.password,
        **tls_settings(store),
        **config["driver"],
        "socket_timeout": config["timeout"],
        "socket_connect_timeout": config["timeout"],
        "decode_responses": True,
        "protocol": 2,
    }


# -- RESP ------------------------------------------------------------------------------------


def _bulk(value: str | int) -> bytes:
    data = value.encode() if isinstance(value, str) else b"%d" % value
    return b"$%d\r\n%s\r\n" % (len(data), data)


def pack(words: Sequence[str | int]) -> bytes:
    """A command in RESP: an array of bulk strings."""
    return b"".join([b"*%d\r\n" % len(words), *map(_bulk, words)])


_HEADS: dict[str, bytes] = {}  # a script's SHA1 -> "EVALSHA sha" in RESP


def pack_script(request: Script) -> bytes:
    """``EVALSHA sha len(keys) *keys *args`` in RESP (the shared head packed once)."""
    lua, keys, args = request
    head = _HEADS.get(lua.sha)
    if head is None:
        head = _HEADS[lua.sha] = b"$7\r\nEVALSHA\r\n" + _bulk(lua.sha)
    return b"".join(
        [
            b"*%d\r\n" % (3 + len(keys) + len(args)),
            head,
            _bulk(len(keys)),
            *[_bulk(k) for k in keys],
            *[_bulk(a) for a in args],
        ]
    )


def _alive(conn: Any) -> bool:
    """An idle connection is usable if there is nothing to read on it (no EOF, no stray
    bytes): redis-py's own check, which also sees through TLS records that carry no data."""
    try:
        return not conn.can_read()
    except (redis.ConnectionError, OSError):
        return False


_monotonic = time.monotonic


class Connections:
    """The idle connections of one server, last-in first-out, and how to make one: a list,
    whose ``pop`` and ``append`` are atomic under the GIL, so taking and giving back one needs
    no lock (see :meth:`call`). After ``fork()`` the child starts with none
    (:func:`latchkey.stores.io.after_fork`) and leaves its parent's sockets alone. The plain
    driver keeps one; the cluster driver one per master
    (:class:`~latchkey.stores.io.redis_cluster.ClusterDriver`).

    Not :class:`latchkey.stores.io.Pool`: its lock, condition and bookkeeping cost 6.7 µs per
    get + put against 0.55 µs here (timeit, loaded 2-core VM), ~12 µs of an uncontended
    acquire + release pair that costs ~150 µs of client CPU in all. No size limit: a thread
    holds a connection for one round trip, so a process has at most as many as threads
    calling at once.

    ``check_health``: ``?health_check_interval=N``, redis-py PINGs a connection idle N seconds
    before a command (off by default: the idle check of :meth:`call` covers a close by the
    server).
    """

    def __init__(self, new_connection: Callable[[], Any], check_health: bool = False) -> None:
        self.idle: list[tuple[Any, float]] = []  # (connection, when it was given back)
        self.new_connection = new_connection
        self.check_health = check_health
        after_fork(self)

    def forget_after_fork(self) -> None:
        self.idle = []  # the parent's sockets: not ours to close

    def call(self, packed: bytes) -> Any:
        """Send one packed command on an idle connection (or a new one), read its reply."""
        idle = self.idle  # the last given back first; checked if idle a while
        try:
            conn, since = idle.pop()
        except IndexError:
            conn = self.new_connection()
        else:
            if _monotonic() - since >= CHECK_AFTER and not _alive(conn):
                conn.disconnect()  # closed by the server, or bytes nobody asked for
        try:
            conn.send_packed_command((packed,), check_health=self.check_health)  # connects
            reply = conn.read_response()
        except redis.ResponseError:  # an error reply, read in full: the connection is fine
            idle.append((conn, _monotonic()))
            raise
        except BaseException:
            conn.disconnect()
            raise
        idle.append((conn, _monotonic()))
        return reply

    def close(self) -> None:
        idle, self.idle = self.idle, []
        for conn, _ in idle:
            conn.disconnect()


class RedisDriver(Driver):
    """Sends each request over a pooled connection; answers Subscribe with a waiter."""

    errors = ERRORS
    #: A borrowed client's connection settings make ours (module docstring); False: the
    #: borrowed client is read by :meth:`make_client` instead (a Sentinel's driver).
    borrows_settings = True

    def __init__(self, backend: BackendBase, store: Redis) -> None:
        super().__init__(backend, store)
        self.timeout = backend.timeout
        if backend.client is not None and self.borrows_settings:  # (module docstring)
            self.client: redis.Redis | None = None
            cls, kwargs = borrowed_settings(backend.client, self.timeout)
        else:
            self.client = self.make_client(store)  # its settings make our connections
            cls = self.client.connection_pool.connection_class
            kwargs = self.client.connection_pool.connection_kwargs
        self.new_connection: Callable[[], Any] = functools.partial(cls, **kwargs)
        self.pool = Connections(self.new_connection, bool(kwargs.get("health_check_interval")))
        self._listener: Listener | None = None
        self._listener_lock = threading.Lock()

    def make_client(self, store: Redis) -> redis.Redis:
        """The redis-py client whose connection pool's class and settings make ours (the
        Sentinel driver's makes connections that find the current master)."""
        return redis.Redis(
            **settings(store),
            retry=Retry(NoBackoff(), 0),  # a primitive never retries: the core decides
        )

    def run(self, steps: Steps[T], action: str) -> T:
        """:meth:`Driver.run` with :func:`~latchkey.stores.io.drive` written in: one call
        less per primitive, on the hot path of every acquire and release. The Redis Cluster
        driver runs its primitives with it too."""
        answer = self.answer
        try:
            request = steps.send(None)
            while True:
                try:
                    value = answer(request)
                except BaseException as exc:  # thrown into the store's generator
                    request = steps.throw(exc)
                else:
                    request = steps.send(value)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        except StoreUnavailable:
            raise
        except self.errors as exc:  # (read only on an error: a subclass's own)
            self.backend.unavailable(exc, action)

    def answer(self, request: Any) -> Any:
        if type(request) is tuple:  # a Script
            packed = pack_script(request)
            call = self.pool.call
            try:
                return call(packed)
            except redis.exceptions.NoScriptError:
                call(pack(("SCRIPT", "LOAD", request[0].text)))
                return call(packed)
        if type(request) is Command:
            return self.pool.call(pack(request.words))
        if type(request) is Subscribe:
            return passes_on(self.subscribe(request.channel), self, request)
        raise TypeError(f"not a Redis request: {request!r}")

    def call(self, packed: bytes) -> Any:
        """Send one packed command on a pooled connection, read its reply."""
        return self.pool.call(packed)

    def subscribe(self, channel: str) -> Waiter:
        """A waiter already subscribed (confirmed by the server) to ``channel``."""
        try:
            listener = self._get_listener()
            slot = listener.add(channel, self.timeout)
        except ERRORS as exc:
            self.backend.unavailable(exc, "subscribe")
        return PushWaiter(listener, channel, slot)

    def _get_listener(self) -> Listener:
        with self._listener_lock:
            current = self._listener
            if current is None or current.error is not None or current.pid != os.getpid():
                if current is not None:
                    current.close()  # in a forked child this only closes the inherited fd
                self._listener = current = Listener(self.new_connection())
            return current

    def close(self) -> None:
        with self._listener_lock:
            if self._listener is not None:
                self._listener.close()
            self._listener = None
        self.pool.close()
        if self.client is not None:  # ours, never a borrowed one
            self.client.close()


class Slot:
    """One waiter's mailbox: set when a release of its name was announced to it; ``rung``:
    it has been, at least once (see :meth:`Listener.remove`)."""

    __slots__ = ("rung", "woke")

    def __init__(self) -> None:
        self.woke = False
        self.rung = False


class Listener:
    """One pub/sub connection shared by every waiter of a backend, with no thread of its own.

    Whoever waits reads: the first waiting thread becomes the reader and blocks on the socket
    itself, so the usual hand-off (one waiter) costs no thread switch; it sets the mailboxes
    of the other waiters (who sleep on a condition) as messages come, and when its own wait
    ends another waiter takes over reading. Messages that arrive while nobody waits stay in
    the socket until the next wait.

    One announced release wakes one waiter of this process, the one that came first and is
    not woken yet: with every waiter woken, 1,000 waiters of one name tried the store 1,000
    times per release. A waiter that was woken and leaves without the lease (its deadline, a
    cancellation) passes the wake-up to the next (:meth:`remove`).

    Replies to SUBSCRIBE/UNSUBSCRIBE come back in order, so each command gets a sequence
    number and ``add`` returns only once the reply to its own SUBSCRIBE was read: from then
    on the server delivers every PUBLISH on the channel. A channel is unsubscribed when its
    last waiter leaves. If the connection fails, every waiter wakes once (its next acquire
    reports the error or succeeds), later waits just sleep, and the backend opens a new
    listener for the next subscribe.

    The commands and reply kinds are class attributes: the Redis Cluster driver's listener
    (:mod:`latchkey.stores.io.redis_cluster`) speaks sharded pub/sub with the same code.
    """

    SUBSCRIBE = "SUBSCRIBE"
    UNSUBSCRIBE = "UNSUBSCRIBE"
    ACKS: tuple[str, ...] = ("subscribe", "unsubscribe")
    MESSAGE = "message"

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.pid = os.getpid()
        self.cond = threading.Condition()
        self.channels: dict[str, dict[Slot, None]] = {}  # in the order the waiters came
        self.subscribed_at: dict[str, int] = {}  # channel -> sequence number of its SUBSCRIBE
        self.sent = 0
        self.acked = 0
        self.reading = False
        self.error: BaseException | None = None
        self.closed = False
        conn.connect()

    def _pump(self, done: Callable[[], bool], timeout: float) -> bool:
        """Read the socket, or wait for the reader, until ``done()`` or ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not done():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.error is not None:
                    return done()
                if self.reading:
                    self.cond.wait(remaining)
                    continue
                self.reading = True
                self.cond.release()
                try:
                    self._read_until(done, deadline)
                finally:
                    self.cond.acquire()
                    self.reading = False
                    self.cond.notify_all()  # a follower takes over reading
            return True

    def _read_until(self, done: Callable[[], bool], deadline: float) -> None:
        try:
            while not done():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self.conn.can_read(timeout=remaining):
                    return
                self._dispatch(self.conn.read_response())
        except Exception as exc:  # the connection is gone: fall back to polling
            with self.cond:
                self.error = exc
                for slots in self.channels.values():
                    for slot in slots:
                        slot.woke = True
                self.cond.notify_all()

    def _dispatch(self, reply: Any) -> None:
        kind = reply[0]
        with self.cond:
            if kind in self.ACKS:
                self.acked += 1
            elif kind == self.MESSAGE:
                _wake_first(self.channels.get(reply[1], {}))
            self.cond.notify_all()

    def add(self, channel: str, timeout: float) -> Slot:
        slot = Slot()
        with self.cond:
            if self.error is not None:
                raise self.error
            if channel not in self.channels:
                self.channels[channel] = {}
                self.sent += 1
                self.subscribed_at[channel] = self.sent
                self.conn.send_command(self.SUBSCRIBE, channel, check_health=False)
            self.channels[channel][slot] = None
            seq = self.subscribed_at[channel]
        if not self._pump(lambda: self.acked >= seq, timeout):
            self.remove(channel, slot)
            if self.error is not None:
                raise self.error
            raise redis.TimeoutError(f"no reply to SUBSCRIBE within {timeout:g}s")
        return slot

    def wait(self, slot: Slot, timeout: float) -> bool:
        if self.error is not None and not slot.woke:
            time.sleep(max(0.0, timeout))  # the connection failed: poll
            return False
        self._pump(lambda: slot.woke, max(0.0, timeout))
        with self.cond:
            woke, slot.woke = slot.woke, False
        return woke and self.error is None

    def remove(self, channel: str, slot: Slot, pass_on: bool = False) -> bool:
        """``slot``'s waiter leaves; ``pass_on``: it was woken and did not get the lease, so
        the next waiter is woken in its place. True if ``pass_on`` found no waiter here to
        wake (the store's turn must pass on: see PushWaiter.close)."""
        with self.cond:
            slots = self.channels.get(channel)
            if slots is None:
                return pass_on
            slots.pop(slot, None)
            if pass_on and _wake_first(slots):
                self.cond.notify_all()
                pass_on = False
            if slots or self.error is not None or self.closed:
                return pass_on
            del self.channels[channel]
            del self.subscribed_at[channel]
            self.sent += 1
            try:
                self.conn.send_command(self.UNSUBSCRIBE, channel, check_health=False)
            except ERRORS as exc:
                self.error = exc
            return pass_on

    def close(self) -> None:
        self.closed = True
        self.conn.disconnect()


def passes_on(waiter: Any, driver: Any, request: Subscribe) -> Any:
    """``waiter``, set to send ``request.passing`` through ``driver`` if it must pass its
    process's turn on (:meth:`PushWaiter.close`); errors are dropped (logged)."""
    if request.passing is not None:
        waiter.passing = functools.partial(_send_quietly, driver, request.passing)
    return waiter


def _send_quietly(driver: Any, request: Any) -> None:
    try:
        driver.answer(request)
    except Exception as exc:  # (a driver error or StoreUnavailable): the wait's outcome stands
        log.info("passing a turn on failed: %s", exc)


def _wake_first(slots: dict[Slot, None]) -> bool:
    """Wake the first waiter not woken yet; False if there is none."""
    for slot in slots:
        if not slot.woke:
            slot.woke = slot.rung = True
            return True
    return False


class PushWaiter(Waiter):
    """Woken by a PUBLISH from a release script; polls (plain sleep) if the listener failed."""

    def __init__(self, listener: Listener, channel: str, slot: Slot) -> None:
        self._listener = listener
        self._channel = channel
        self._slot = slot
        self._granted = False
        #: Sends the store's PASS (set by the driver for a mutex waiter): see :meth:`close`.
        self.passing: Callable[[], object] | None = None

    def wait(self, timeout: float) -> bool:
        return self._listener.wait(self._slot, timeout)

    @property
    def ahead(self) -> int:
        listener = self._listener
        if listener.error is not None:
            return 0
        with listener.cond:
            return place_in_line(listener.channels.get(self._channel, ()), self._slot)

    def finish(self, result: Grant | Busy) -> None:
        self._granted = type(result) is Grant

    def close(self) -> None:
        """Leave; woken and leaving without the lease, wake the next waiter of this process,
        or, with none left here, pass the process's turn on in the store (one round trip,
        only then; its failure is not the caller's: the others' polls find the name)."""
        pass_on = self._slot.rung and not self._granted
        if self._listener.remove(self._channel, self._slot, pass_on) and self.passing:
            self.passing()
