"""``memcached://`` for asyncio: the sync store's commands, keys, lease JSON, reply parsing and
server choice (:mod:`latchkey.stores.memcached`, whose docstring explains the layout, the
tokens and the clock), with the bytes moved by an :class:`asyncio.Protocol` of our own.

A connection is a Protocol with its own receive buffer: ``data_received`` appends, and the
request in progress parses complete replies from the buffer, waiting on one future whenever
it needs more bytes. That is the cheapest way through asyncio (streams add a reader, a
``drain`` and a ``readuntil`` per reply: measured in ``bench/asyncfloor.py``), and, as in the
sync store, bytes found in the buffer before a request are replies nobody asked for: the
request fails and the connection is dropped instead of taking them for its own answer.

Each server has a small pool of connections (at most :data:`POOL_MAX` out at once, so that a
thousand polling waiters do not open a thousand sockets). Every primitive runs within
``?timeout=`` (one ``asyncio.timeout``), waiting for a pooled connection and opening one
included; a connection that errored, timed out or was cancelled mid-request is closed, never
pooled again. memcached has no push: ``subscribe`` stays None and the core polls.
"""

from __future__ import annotations

import asyncio
import math
import random
import select
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import datetime
from typing import Concatenate, ParamSpec, TypeVar

from latchkey._types import Busy, Grant, LockInfo
from latchkey._url import StoreURL
from latchkey.errors import Unsupported
from latchkey.stores.base import AsyncBackend
from latchkey.stores.memcached import (
    _FRESH,
    ADD,
    DELETE,
    DELETE_IF,
    EPOCH,
    NEW_LEASE,
    PROBE_ADD,
    READ,
    REPLACE_IF,
    REWRITTEN_LEASE,
    SET_FOREVER,
    STATS,
    MemcachedBackend,
    ProtocolError,
    _Clock,
    _dt,
    _handshake_request,
    _Held,
    _json,
    _Layout,
    _Lease,
    _lease,
    _limit,
    _ms,
    _Names,
    _new_cas,
    _record_of,
    _record_value,
    _Reply,
    _reply_head,
    _server_instance,
    _server_times,
    _stored,
    _token,
    _ttl_arg,
)

P = ParamSpec("P")
T = TypeVar("T")

POOL_MAX = 32  # connections to one server out at once; the idle ones stay open for reuse
# What a dead or confused connection raises, and a timeout (on Python 3.10, asyncio's own
# TimeoutError is not the built-in one).
_ERRORS = (OSError, ProtocolError, asyncio.TimeoutError)


async def _within(seconds: float, work: Awaitable[T]) -> T:
    """Await ``work`` for at most ``seconds``; a TimeoutError says how long it waited."""
    try:
        if sys.version_info >= (3, 11):
            async with asyncio.timeout(seconds):
                return await work
        return await asyncio.wait_for(work, seconds)
    except asyncio.TimeoutError:
        raise TimeoutError(f"memcached did not answer within {seconds}s") from None


class _Connection(asyncio.Protocol):
    """One connection to one server process (``started`` and ``instance``: see the sync
    ``_Connection``), with its receive buffer. Not shared: pooled, one request at a time.

    The loop calls :meth:`data_received` (appends to the buffer and wakes the request
    waiting for bytes, if any) and :meth:`connection_lost`; the request's coroutine reads
    whole replies from the buffer, awaiting :meth:`_more` while one is incomplete."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.lost: BaseException | None = None  # why the connection ended, once it has
        self.done: asyncio.Future[None] = loop.create_future()  # set when it has ended
        self._waiter: asyncio.Future[None] | None = None  # the request waiting for bytes
        self.started = 0
        self.instance: bytes | None = None
        self.idle_since = -math.inf  # when it went back to the pool (monotonic)
        self._poll = select.poll()

    # -- the loop's side -------------------------------------------------------------------

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

    # -- the request's side ----------------------------------------------------------------

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
        """True if the server closed this idle connection (it never speaks unasked).

        The loop notices an end of stream only when it next polls its sockets, which a
        server restarted while this coroutine ran (a test's restart, say) has not let it do:
        like the sync pool, a connection idle for more than ``_FRESH`` is polled itself."""
        if self.lost is not None or self.buffer or self.is_closing():
            return True
        if now - self.idle_since < _FRESH:
            return False
        try:
            return bool(self._poll.poll(0))
        except (OSError, ValueError):
            return True

    def send(self, data: bytes) -> None:
        """Write one batch of commands: each call starts one round trip. Bytes already in
        the buffer were never asked for: they would be taken for this request's replies."""
        if self.buffer:
            raise ProtocolError(f"{len(self.buffer)} unread bytes before a request")
        if self.lost is not None or self.transport is None:
            raise ConnectionResetError(f"memcached connection lost: {self.lost}")
        self.transport.write(data)

    async def request(self, commands: bytes) -> bytes:
        """Send ``commands`` and return the first bytes that come back: usually the whole
        reply, one short line (the caller compares it with the one reply it expects, and
        hands anything else back to :meth:`unread`, to be parsed by :meth:`reply`)."""
        self.send(commands)
        await self._more()
        chunk = bytes(self.buffer)
        self.buffer.clear()
        return chunk

    def unread(self, chunk: bytes) -> None:
        """Put back what :meth:`request` returned, to be parsed by :meth:`reply`."""
        self.buffer[:0] = chunk

    async def _line(self) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            await self._more()
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 2]
        return line

    async def reply(self) -> _Reply:
        """Read and parse the next reply (a value block of any length, in as many reads as
        it takes; an error line is a ProtocolError)."""
        code, flags, size = _reply_head(await self._line())
        if size is None:
            return _Reply(code, flags, None)
        while len(self.buffer) < size + 2:
            await self._more()
        value = bytes(self.buffer[:size])
        del self.buffer[: size + 2]
        return _Reply(code, flags, value)

    async def exchange(self, commands: Sequence[bytes]) -> list[_Reply]:
        """Send ``commands`` in one write and read one reply each: one round trip."""
        self.send(b"".join(commands))
        return [await self.reply() for _ in commands]

    async def probe_add_replies(self) -> tuple[_Reply | None, _Reply]:
        """Read the replies to a PROBE_ADD: (the read's hit, or None when it missed silently,
        and the write's reply)."""
        first = await self.reply()
        if first.code != b"VA":  # the probe missed silently: this is the write's reply
            return None, first
        return first, await self.reply()

    async def stats(self) -> tuple[int, int]:
        """Read a ``stats`` reply: the server's Unix time and its start."""
        lines = []
        while (line := await self._line()) != b"END":
            lines.append(line)
        return _server_times(lines)

    def is_closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def close(self) -> None:
        """Drop the connection now (unsent bytes and unread replies with it)."""
        if self.transport is not None:
            self.transport.abort()


class _Server(_Clock):
    """A pool of connections to one server, and that server's clock."""

    def __init__(self, host: str, port: int, instance_key: bytes) -> None:
        super().__init__()
        self.host, self.port, self.instance_key = host, port, instance_key
        self.idle: list[_Connection] = []
        self.room = asyncio.Semaphore(POOL_MAX)
        self.closed = False

    async def checkout(self) -> _Connection:
        """An idle connection the server has not closed, or a new one (which reads the
        server's clock). The caller gives it back with :meth:`checkin`, or :meth:`discard`."""
        await self.room.acquire()
        try:
            now = time.monotonic()
            while self.idle:
                conn = self.idle.pop()
                if not conn.stale(now):
                    return conn
                conn.close()  # the server restarted or dropped it: a fresh one, not an error
            return await self._open()
        except BaseException:
            self.room.release()
            raise

    def checkin(self, conn: _Connection) -> None:
        """Give back a checked-out connection whose request went through."""
        self.room.release()
        if self.closed:
            conn.close()
        else:
            conn.idle_since = time.monotonic()
            self.idle.append(conn)

    def discard(self, conn: _Connection) -> None:
        """Close a checked-out connection whose request failed or was cancelled: its
        stream may be mid-reply."""
        conn.close()
        self.room.release()

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: _Connection(loop), self.host, self.port)
        try:
            before = time.monotonic()
            conn.send(_handshake_request(self.instance_key))
            now, started = await conn.stats()
            conn.started = max(0, started - EPOCH)
            conn.instance = _server_instance(await conn.reply(), await conn.reply())
        except BaseException:
            conn.close()
            raise
        self._set_clock(now, before)
        return conn

    def now(self) -> float:
        """The server's clock (Unix seconds), from the reading of a connection checked out."""
        return self.clock_offset + time.monotonic()

    async def read_clock(self, conn: _Connection) -> float:
        """Read the server's clock now on ``conn`` (one round trip) and return it."""
        before = time.monotonic()
        conn.send(STATS)
        self._set_clock((await conn.stats())[0], before)
        return self.now()

    async def aclose(self) -> None:
        self.closed = True
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.close()
        for conn in idle:
            await conn.done


class AsyncMemcachedBackend(_Layout[_Server], AsyncBackend):
    """Leases in memcached, for asyncio: the sync store's operations, awaited."""

    scheme = MemcachedBackend.scheme
    capabilities = MemcachedBackend.capabilities
    options = MemcachedBackend.options

    def __init__(self, url: StoreURL) -> None:
        super().__init__(url)
        instance_key = self._lay_out(url, self.config["prefix"])
        self._servers = {
            node: _Server(host, port, instance_key) for node, (host, port) in self._nodes.items()
        }
        self._only = next(iter(self._servers.values())) if len(self._servers) == 1 else None

    async def _on(
        self, server: _Server, action: str,
        op: Callable[Concatenate[_Connection, P], Awaitable[T]], *args: P.args, **kwargs: P.kwargs,
    ) -> T:  # fmt: skip
        """Run ``op(conn, …)`` on a pooled connection to ``server`` within the timeout. An
        error, a timeout or a cancellation closes the connection (its stream may be
        mid-reply); a driver error or a timeout is StoreUnavailable."""
        try:
            return await _within(self.timeout, self._run(server, op, *args, **kwargs))
        except _ERRORS as exc:
            self.unavailable(exc, action)

    async def _run(
        self, server: _Server, op: Callable[Concatenate[_Connection, P], Awaitable[T]],
        *args: P.args, **kwargs: P.kwargs,
    ) -> T:  # fmt: skip
        conn = await server.checkout()
        try:
            result = await op(conn, *args, **kwargs)
        except BaseException:
            server.discard(conn)
            raise
        server.checkin(conn)
        return result

    # -- reading slots -----------------------------------------------------------------------

    async def _slots(self, conn: _Connection, name: str) -> list[_Lease | None]:
        """Every slot of ``name`` (the live lease in it, or None): one round trip, two when
        the name turns out to be a semaphore with more slots than we knew."""
        known = self._limits.get(name, 1)
        keys = [self._key("lock", name, i) for i in range(known)]
        replies = await conn.exchange([READ % self._key("limit", name), *(READ % k for k in keys)])
        limit = _limit(replies[0])
        if limit > known:
            self._limits[name] = limit
            more = [self._key("lock", name, i) for i in range(known, limit)]
            keys += more
            replies += await conn.exchange([READ % k for k in more])
        return [_lease(k, r) for k, r in zip(keys, replies[1:], strict=True)]

    async def _mine(self, conn: _Connection, name: str, owner: str) -> _Lease | None:
        return next((s for s in await self._slots(conn, name) if s and s.owner == owner), None)

    # -- leases ------------------------------------------------------------------------------

    async def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        server = self._server(name)
        return await self._on(
            server, "acquire", self._add, server, name, owner, owner_info, ttl, limit
        )

    async def _add(
        self, conn: _Connection, server: _Server, name: str, owner: str, owner_info: str,
        ttl: float, limit: int,
    ) -> Grant | Busy:  # fmt: skip
        """Add a lease in a free slot of ``name`` (one round trip; a semaphore reads its
        slots first, a second); else ``owner``'s own lease if it holds one (the probe read
        the slot's lease), or Busy with the live leases found."""
        live: list[_Lease] = []
        if limit == 1:
            key, quoted_name = self._hot_names.get(name) or self._hot_name(name)
        else:
            free = await self._free_slots(conn, name, limit, live)
            if not free or any(s.owner == owner for s in live):
                return self._taken(live, name, owner, conn.instance, server.now())
            key, quoted_name = random.choice(free), _json(name)  # spread over the free slots
        now = server.now()
        acquired, expires = _ms(now), _ms(now + ttl)
        value = self._lease_value(
            NEW_LEASE, quoted_name, owner, owner_info, conn.started, acquired, expires
        )
        chunk = await conn.request(PROBE_ADD % (key, key, len(value), _ttl_arg(ttl, now), value))
        if chunk[:4] == b"HD c" and chunk[-2:] == b"\r\n" and chunk[4:-2].isdigit():
            cas = int(chunk[4:-2])  # stored, and the probe missed silently: the common reply
        else:
            conn.unread(chunk)
            probe, added = await conn.probe_add_replies()
            if not _stored(added):
                winner = _lease(key, probe)  # None: the slot was taken just now
                live = [*live, winner] if winner else live
                return self._taken(live, name, owner, conn.instance, server.now())
            cas = _new_cas(added)
        if cas <= 0:
            raise ProtocolError("memcached returned no CAS value (is it running with -C?)")
        token = _token(conn.started, cas)
        if conn.instance is not None:
            self._remember(name, owner, (key, cas, conn.instance, token, owner_info, acquired))
        return Grant(token, _dt(expires / 1000))  # the lease's expiry, to the ms

    async def _free_slots(
        self, conn: _Connection, name: str, limit: int, live: list[_Lease]
    ) -> list[bytes]:
        """A semaphore's free slots (keys), after writing its limit (one round trip); its
        live leases are appended to ``live``."""
        count = str(limit).encode("ascii")
        keys = [self._key("lock", name, i) for i in range(limit)]
        replies = await conn.exchange(
            [SET_FOREVER % (self._key("limit", name), len(count), count)] + [READ % k for k in keys]
        )
        slots = [_lease(k, r) for k, r in zip(keys, replies[1:], strict=True)]
        live.extend(s for s in slots if s is not None)
        return [k for k, s in zip(keys, slots, strict=True) if s is None]

    async def release(self, name: str, owner: str) -> bool:
        return await self._on(self._server(name), "release", self._delete, name, owner)

    async def _delete(self, conn: _Connection, name: str, owner: str) -> bool:
        """Release by the CAS we remember in one round trip, else by reading first."""
        held = self._forget(name, owner, conn.instance)
        if held is not None:
            chunk = await conn.request(DELETE_IF % (held[0], held[1]))
            if chunk == b"HD\r\n":  # the item with our CAS was there, live: ours, now gone
                return True
            conn.unread(chunk)
            if _stored(await conn.reply()):
                return True
        mine = await self._mine(conn, name, owner)
        if mine is None:
            return False
        return _stored((await conn.exchange([DELETE_IF % (mine.key, mine.cas)]))[0])

    async def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        server = self._server(name)
        return await self._on(server, "extend", self._extend, server, name, owner, ttl)

    async def _extend(
        self, conn: _Connection, server: _Server, name: str, owner: str, ttl: float
    ) -> Grant | None:
        held = self._forget(name, owner, conn.instance)
        if held is not None and (
            grant := await self._rewrite(conn, server, name, owner, held, ttl)
        ):
            return grant
        # Unknown, or changed since we wrote it (EX) or gone (NF): read once to decide.
        mine = await self._mine(conn, name, owner)
        if mine is None:
            return None
        held = (mine.key, mine.cas, b"", mine.token, mine.data["i"], _ms(mine.acquired))
        return await self._rewrite(conn, server, name, owner, held, ttl)

    async def _rewrite(
        self, conn: _Connection, server: _Server, name: str, owner: str, held: _Held, ttl: float
    ) -> Grant | None:
        """Give our lease ``held`` a new expiry if its CAS is still the one held (one trip);
        the value now carries the token (the CAS changes), and we remember the new CAS."""
        key, cas, _, token, info, acquired_ms = held
        now = server.now()
        value = self._lease_value(
            REWRITTEN_LEASE, _json(name), owner, info, token, acquired_ms, _ms(now + ttl)
        )
        command = REPLACE_IF % (key, len(value), _ttl_arg(ttl, now), cas, value)
        reply = (await conn.exchange([command]))[0]
        if not _stored(reply):
            return None
        if conn.instance is not None:
            new = (key, _new_cas(reply), conn.instance, token, info, acquired_ms)
            self._remember(name, owner, new)
        return Grant(token, _dt(now + ttl))

    async def inspect(self, name: str) -> LockInfo | None:
        slots = await self._on(self._server(name), "inspect", self._slots, name)
        live = sorted((s for s in slots if s), key=lambda s: (s.acquired, s.token))
        return LockInfo(name, tuple(s.holder() for s in live)) if live else None

    def list(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        raise Unsupported(
            "the memcached store cannot list locks: memcached has no reliable way to "
            "enumerate keys; inspect(name) works"
        )

    async def force_release(self, name: str) -> bool:
        return await self._on(self._server(name), "force_release", self._force_release, name)

    async def _force_release(self, conn: _Connection, name: str) -> bool:
        known = self._limits.get(name, 1)
        keys = [self._key("lock", name, i) for i in range(known)]
        replies = await conn.exchange(
            [READ % self._key("limit", name), *(DELETE % k for k in keys)]
        )
        deleted = [_stored(r) for r in replies[1:]]
        limit = _limit(replies[0])
        if limit > known:  # a semaphore with more slots than we knew
            self._limits[name] = limit
            more = [self._key("lock", name, i) for i in range(known, limit)]
            deleted += [_stored(r) for r in await conn.exchange([DELETE % k for k in more])]
        return any(deleted)  # md answers HD only for a live item

    async def purge_expired(self) -> int:
        """memcached drops expired items itself: there is never anything to purge."""
        return 0

    # -- batch claims: one round trip per server involved ------------------------------------

    async def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        grants: dict[str, Grant] = {}
        for server, group in self._by_server(names).items():
            grants.update(
                await self._on(server, "claim", self._claim, server, group, owner, owner_info, ttl)
            )
        return grants

    async def _claim(
        self, conn: _Connection, server: _Server, names: _Names, owner: str, owner_info: str,
        ttl: float,
    ) -> dict[str, Grant]:  # fmt: skip
        now = server.now()
        acquired, expires, expiry = _ms(now), _ms(now + ttl), _ttl_arg(ttl, now)
        keys, adds = [], []
        for name in names:
            key, quoted = self._hot_name(name)
            value = self._lease_value(
                NEW_LEASE, quoted, owner, owner_info, conn.started, acquired, expires
            )
            keys.append(key)
            adds.append(ADD % (key, len(value), expiry, value))
        grants: dict[str, Grant] = {}
        for name, key, reply in zip(names, keys, await conn.exchange(adds), strict=True):
            if not _stored(reply):
                continue  # held by someone else: skipped
            cas = _new_cas(reply)
            token = _token(conn.started, cas)
            if conn.instance is not None:
                self._remember(name, owner, (key, cas, conn.instance, token, owner_info, acquired))
            grants[name] = Grant(token, _dt(now + ttl))
        return grants

    async def release_many(self, names: Sequence[str], owner: str) -> int:
        released = 0
        for server, group in self._by_server(names).items():
            released += await self._on(server, "release_many", self._release_group, group, owner)
        return released

    async def _release_group(self, conn: _Connection, names: _Names, owner: str) -> int:
        """Our leases among ``names`` on one server: remembered ones deleted by CAS, the
        others (and remembered ones that changed) read, then deleted by the CAS read."""
        released = 0
        deletes: list[tuple[bytes, int, bool]] = []  # key, CAS, remembered (not just read)?
        reads: list[bytes] = []
        for name in names:
            held = self._forget(name, owner, conn.instance)
            if held is None:
                reads.append(self._key("lock", name))
            else:
                deletes.append((held[0], held[1], True))
        while deletes or reads:
            replies = await conn.exchange(
                [DELETE_IF % (k, cas) for k, cas, _ in deletes] + [READ % k for k in reads]
            )
            done = [_stored(r) for r in replies[: len(deletes)]]
            released += sum(done)
            leases = [_lease(k, r) for k, r in zip(reads, replies[len(deletes) :], strict=True)]
            reads = [k for (k, _, mem), ok in zip(deletes, done, strict=True) if mem and not ok]
            deletes = [(s.key, s.cas, False) for s in leases if s and s.owner == owner]
        return released

    # -- versioned records: {"v": version, "d": JSON text}, CAS-checked writes ---------------

    async def _record(self, conn: _Connection, key: bytes) -> tuple[str | None, int, int]:
        reply = (await conn.exchange([READ % key]))[0]
        return _record_of(key, reply)

    async def record_get(self, name: str) -> tuple[str | None, int]:
        key = self._key("record", name)
        value, version, _ = await self._on(self._server(name), "record_get", self._record, key)
        return value, version

    async def record_set(self, name: str, value: str, version: int) -> int | None:
        key = self._key("record", name)
        return await self._on(
            self._server(name), "record_set", self._record_set, key, value, version
        )

    async def _record_set(
        self, conn: _Connection, key: bytes, value: str, version: int
    ) -> int | None:
        data = _record_value(value, version + 1)
        if version == 0:
            command = ADD % (key, len(data), 0, data)
        else:
            _, current, cas = await self._record(conn, key)
            if current != version:
                return None
            command = REPLACE_IF % (key, len(data), 0, cas, data)
        return version + 1 if _stored((await conn.exchange([command]))[0]) else None

    async def record_delete(self, name: str, version: int) -> bool:
        key = self._key("record", name)
        return await self._on(
            self._server(name), "record_delete", self._record_delete, key, version
        )

    async def _record_delete(self, conn: _Connection, key: bytes, version: int) -> bool:
        _, current, cas = await self._record(conn, key)
        if version == 0 or current != version:
            return False
        return _stored((await conn.exchange([DELETE_IF % (key, cas)]))[0])

    # -- clock and lifecycle -----------------------------------------------------------------

    async def now(self) -> datetime:
        """The first server's clock: its whole-second ``stats`` time, ± 0.5 s."""
        server = next(iter(self._servers.values()))
        return _dt(await self._on(server, "now", server.read_clock))

    async def aclose(self) -> None:
        for server in self._servers.values():
            await server.aclose()
