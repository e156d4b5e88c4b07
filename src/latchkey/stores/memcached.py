"""``memcached://host:port[,host:port…]``: leases as memcached items that expire by their TTL.

Seed 000 locked rows with a bare ``add``, which answers "not stored" both when the key exists
and when the server is down. This store speaks memcached's *meta* protocol (``mg``/``ms``/
``md``, memcached ≥ 1.6) over its own small connection pool, so that every reply is read and
checked: a server that does not answer is :class:`StoreUnavailable`, never "busy".
pymemcache supplies the rendezvous hash that picks a server per name; its own clients are not
used because they have no meta commands and no mixed pipelines, and because pymemcache's
``HashClient`` answers a default value (``False``: "not stored") while a server is marked
failed and then moves its keys to another server, where a second holder could take a lock.
Here a name always lives on one server, and that server being down is an error.

Layout (``P`` is ``?prefix=``, default ``latchkey:``; ``N`` the name, or ``#`` + its SHA-256
when it is not plain printable ASCII, starts with ``#``, or would make a key too long):

- ``P lock:N`` (and ``P slotI:N`` for semaphore slots I ≥ 1): one lease, as JSON
  (name, owner token, owner info, acquired/expires ms, and the token's parts), with its TTL;
- ``P limit:N``: a semaphore's slot count, no TTL (absent: 1);
- ``P record:N``: a versioned record, no TTL;
- ``P instance``: a random id written once per server lifetime (see "release" below).

Fencing tokens are the lease item's CAS unique: memcached gives every stored item the next
value of one server-wide counter, so a name's leases get strictly increasing values for as
long as the server runs, with no counter item of our own to read, evict or lose. The token is
``(S << 32) + CAS`` where ``S`` is the server's start time (``stats``: ``time - uptime``) in
seconds since 2020: a restarted server starts its CAS counter again at 1, but its ``S`` is
higher by the seconds it ran, and no memcached stores 2³² items a second. A lease stores
``S`` (``"s"``); a rewritten lease (extend) gets a new CAS and so stores its token (``"t"``).

Acquire is one round trip (``mg … q`` probe + ``ms … ME c`` add; when the add finds the slot
taken, the probe has read who holds it, and an owner that holds it already gets that lease
back, as ``Backend.acquire`` requires, with no further request); release is one
(``md key C<cas>``) with the CAS this backend remembers from its acquire or extend, guarded by
the server's instance id so that a remembered CAS is never used on a restarted server (whose
counter may hand the same value to someone else's lease). Without it, release reads first.

The store clock is memcached's: it only reports whole seconds (``stats`` ``time``), so each
connection reads it once and the backend keeps it running on the local monotonic clock
(error ≤ 0.5 s). Expiry itself is memcached's TTL, by the server's own clock: whole seconds,
and an item set with TTL ``T`` lives between ``T - 1`` and ``T`` seconds. A lease of ``ttl``
seconds is therefore stored with ``T = ceil(ttl) + 1``: it never ends before ``ttl`` (the
holder's safety), and may outlive it by up to 2 s (1 s for whole-second TTLs).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import re
import select
import socket
import struct
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from json.encoder import encode_basestring_ascii as _quote  # a str as a JSON literal (C)
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

from pymemcache.client.rendezvous import RendezvousHash

from latchkey._owner import Owner
from latchkey._types import Busy, Grant, Holder, LockInfo
from latchkey._url import Option, StoreURL, key_prefix
from latchkey.errors import ConfigError, Unsupported
from latchkey.stores.base import Backend, Capabilities

DEFAULT_PORT = 11211
MAX_KEY = 250  # memcached's key length limit, bytes
_KIND_ROOM = 24  # bytes kept free in a key for the kind ("slot12345:")
_MONTH = 30 * 24 * 3600  # memcached reads larger TTLs as absolute Unix times
_PLAIN = re.compile(r"[!-~]+")  # printable ASCII without space: usable in a key as is
EPOCH = 1_577_836_800  # 2020-01-01T00:00:00Z: server start times count from here (tokens)
_fromtimestamp, _UTC = datetime.fromtimestamp, timezone.utc  # the hot path's, looked up once
_ceil, _monotonic = math.ceil, time.monotonic
_KERNEL_TIMEOUTS = sys.platform.startswith("linux")  # see _Connection.__init__
_FRESH = 0.001  # seconds a pooled connection is reused without polling it (see checkout)
# Bytes asked of the first recv of a reply: a short reply or a lease read fits, and a buffer
# this small comes from Python's small-object allocator (up to 512 bytes with its header) where
# recv(65536) mallocs 64 KiB and shrinks it: a sixth of the recv's cost. More is read as needed.
_FIRST_READ = 448
_HELD_MAX = 4096  # leases whose CAS a backend remembers for one-round-trip release/extend

# -- commands: %b is a key (prefixed, plain ASCII, ≤ 250 bytes); replies as noted -------------

# Read an item: value (v), remaining TTL in whole seconds (t), CAS unique (c).
# Reply ``VA <len> t<ttl> c<cas>`` + value, or ``EN`` when absent or expired.
READ = b"mg %b v t c\r\n"
# The same read, quiet (q): a miss sends nothing. Sent just before ADD on the same key, it
# tells who holds the key when the add fails, with no reply (no bytes) when the key is free.
PROBE = b"mg %b v t c q\r\n"
# Take a lease slot only if it is absent (ME: add mode), TTL T; c: return the new item's CAS.
# ``HD c<cas>`` stored, ``NS`` taken. Mutual exclusion: memcached adds atomically, an expired
# item counts as absent, and the CAS comes from the server-wide counter (the fencing token).
ADD = b"ms %b %d T%d ME c\r\n%b\r\n"
# PROBE then ADD of the same key (key, key, length, T, value), sent as one: an acquire.
PROBE_ADD = PROBE + ADD
# Rewrite an item only if its CAS unique is the one we know (extend, record update).
# ``HD c<new cas>`` written, ``EX`` changed since, ``NF`` gone: a newer holder is never touched.
REPLACE_IF = b"ms %b %d T%d C%d c\r\n%b\r\n"
# Delete an item only if its CAS unique is the one we know: the owner-checked release (never
# get-then-delete, which can delete a newer holder's lease). ``HD``, ``EX`` changed, ``NF``.
DELETE_IF = b"md %b C%d\r\n"
# Delete whatever is there (force_release only). ``HD`` deleted a live item, ``NF`` absent.
DELETE = b"md %b\r\n"
# Write an item with no TTL (a semaphore's slot count). ``HD c<cas>``.
SET_FOREVER = b"ms %b %d T0 c\r\n%b\r\n"
# A lease's value (JSON): name, owner token, owner info (a JSON text, as a string), then the
# server's start S (a new lease: its token is derived from its CAS) or the token itself (a
# rewritten lease, whose CAS changed), then when it was acquired and when it expires (ms).
NEW_LEASE = b'{"n":%b,"o":%b,"i":%b,"s":%d,"a":%d,"e":%d}'
REWRITTEN_LEASE = b'{"n":%b,"o":%b,"i":%b,"t":%d,"a":%d,"e":%d}'
# The server's clock and start: ``STAT time <unix s>``, ``STAT uptime <s>``…, then ``END``.
STATS = b"stats\r\n"


P = ParamSpec("P")
T = TypeVar("T")


class _ForkAware(Protocol):
    def after_fork(self) -> None: ...


_FORK_AWARE: weakref.WeakSet[_ForkAware] = weakref.WeakSet()  # pools and backends


def _after_fork_in_child() -> None:
    for thing in list(_FORK_AWARE):
        thing.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class ProtocolError(Exception):
    """memcached answered something we did not expect (an error line, a bad value)."""


class _Reply:
    """One reply: its code (HD, NS, EX, NF, EN, VA), its flags (b"c" → b"42"), its value."""

    __slots__ = ("code", "flags", "value")

    def __init__(self, code: bytes, flags: dict[bytes, bytes], value: bytes | None) -> None:
        self.code, self.flags, self.value = code, flags, value

    def flag(self, name: bytes) -> int:
        try:
            return int(self.flags[name])
        except (KeyError, ValueError):
            raise ProtocolError(f"reply {self.code!r} lacks a numeric {name!r} flag") from None


class _Connection:
    """One socket to one server process, with a read buffer. Not thread-safe: pooled.

    ``started`` (the token's ``S``) and ``instance`` describe the server process this socket
    talks to; a TCP connection never outlives it, so they hold for every reply read here.
    """

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.timeout = timeout
        if _KERNEL_TIMEOUTS:
            # The kernel enforces the timeout on each send and receive (SO_SNDTIMEO/RCVTIMEO)
            # of a blocking socket, which saves Python's poll() before every call: a third of
            # the system calls of a round trip. A timed-out call fails with EAGAIN.
            whole = int(timeout)
            limit = struct.pack("@ll", whole, int((timeout - whole) * 1_000_000))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
            self.sock.settimeout(None)
        self._buf = bytearray()
        self.started = 0
        self.instance: bytes | None = None
        self.idle_since = -math.inf  # when it went back to the pool (monotonic)
        self._poll = select.poll()
        self._poll.register(self.sock, select.POLLIN)

    def stale(self) -> bool:
        """True if the server closed this idle connection (it never speaks unasked)."""
        try:
            return bool(self._poll.poll(0))
        except (OSError, ValueError):
            return True

    def _send(self, data: bytes) -> None:
        """Write one batch of commands: each call starts one round trip."""
        try:
            self.sock.sendall(data)
        except BlockingIOError:  # SO_SNDTIMEO expired
            raise TimeoutError(f"memcached did not take a command within {self.timeout}s") from None

    def _fill(self) -> None:
        try:
            chunk = self.sock.recv(65536)
        except BlockingIOError:  # SO_RCVTIMEO expired
            raise TimeoutError(f"memcached did not answer within {self.timeout}s") from None
        if not chunk:
            raise ConnectionResetError("memcached closed the connection")
        self._buf += chunk

    def request(self, commands: bytes) -> bytes:
        """Send ``commands`` in one write (one round trip) and return what the first ``recv``
        brings: usually the whole reply, one short line in one TCP segment.

        The caller compares it with the one reply it expects, CRLF included (one comparison
        of bytes, no parsing); anything else it hands back to :meth:`unread` and parses with
        :meth:`reply`, so that no byte is skipped or read twice."""
        if self._buf:  # replies never read: they would be taken for this request's
            raise ProtocolError(f"{len(self._buf)} unread bytes before a request")
        sock = self.sock  # _send() and _fill(), inline: the hot path
        try:
            sock.sendall(commands)
        except BlockingIOError:  # SO_SNDTIMEO expired
            raise TimeoutError(f"memcached did not take a command within {self.timeout}s") from None
        try:
            chunk = sock.recv(_FIRST_READ)
        except BlockingIOError:  # SO_RCVTIMEO expired
            raise TimeoutError(f"memcached did not answer within {self.timeout}s") from None
        if not chunk:
            raise ConnectionResetError("memcached closed the connection")
        return chunk

    def unread(self, chunk: bytes) -> None:
        """Put back what :meth:`request` returned, to be parsed by :meth:`reply`."""
        self._buf[:0] = chunk

    def _line(self) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self._buf[:end])
        del self._buf[: end + 2]
        return line

    def _exact(self, size: int) -> bytes:
        while len(self._buf) < size + 2:
            self._fill()
        data = bytes(self._buf[:size])
        del self._buf[: size + 2]
        return data

    def reply(self) -> _Reply:
        """Read and parse the next reply."""
        code, flags, size = _reply_head(self._line())
        return _Reply(code, flags, None if size is None else self._exact(size))

    def exchange(self, commands: Sequence[bytes]) -> list[_Reply]:
        """Send ``commands`` in one write and read one reply each: one round trip."""
        self._send(b"".join(commands))
        return [self.reply() for _ in commands]

    def probe_add_replies(self) -> tuple[_Reply | None, _Reply]:
        """Read the replies to a PROBE_ADD: (the read's hit, or None when it missed silently,
        and the write's reply)."""
        first = self.reply()
        if first.code != b"VA":  # the probe missed silently: this is the write's reply
            return None, first
        return first, self.reply()

    def _stats(self) -> tuple[int, int]:
        """Read a ``stats`` reply: the server's Unix time and its start (time - uptime)."""
        lines = []
        while (line := self._line()) != b"END":
            lines.append(line)
        return _server_times(lines)

    def server_time(self) -> int:
        """The server's Unix time, whole seconds (one round trip)."""
        self._send(STATS)
        return self._stats()[0]

    def handshake(self, instance_key: bytes) -> int:
        """Read the server's clock and start time, and its instance id (creating it if this
        server process has none yet), in one round trip. Returns the server's Unix time."""
        self._send(_handshake_request(instance_key))
        now, started = self._stats()
        self.started = max(0, started - EPOCH)
        self.instance = _server_instance(self.reply(), self.reply())
        return now

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class _Clock:
    """One server's clock: memcached reports whole seconds, so a reading is kept running on
    the local monotonic clock (shared by the sync and asyncio pools)."""

    def __init__(self) -> None:
        self.clock_offset = 0.0  # server time - local monotonic time, seconds…
        self._clock_read = False  # …once a connection has read the server's clock

    def _set_clock(self, seconds: int, before: float) -> None:
        # memcached's clock ticks in whole seconds: the true time is within the second after.
        self.clock_offset = seconds + 0.5 - (before + time.monotonic()) / 2
        self._clock_read = True


class _Server(_Clock):
    """A pool of connections to one server, and that server's clock.

    The idle list is only popped and appended to (atomic in CPython): no lock on the hot path.
    A forked child empties it (:func:`_after_fork`): the parent's sockets are the parent's.
    """

    def __init__(self, host: str, port: int, timeout: float, instance_key: bytes) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.instance_key = instance_key
        self.idle: list[_Connection] = []
        super().__init__()
        _FORK_AWARE.add(self)

    def after_fork(self) -> None:
        """In a forked child: drop the parent's connections (closing the child's copies of
        their file descriptors leaves the parent's sockets open and undisturbed)."""
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.close()

    def checkout(self, now: float) -> _Connection:
        """An idle connection that the server has not closed, or a new one. ``now``: the
        local monotonic time (the caller's, read once per call).

        A reuse polls the socket first (a system call, a tenth of a round trip): a server
        restarted since (tests restart memcached in a few milliseconds) closed it, and the
        call must go to a fresh connection rather than fail; a command is never sent twice.
        A connection back in the pool for less than :data:`_FRESH` is not polled: no server
        stops, starts again and listens within that time. (A server that only stopped is
        StoreUnavailable either way: a refused reconnection, or a reset on this socket.)"""
        while True:
            try:
                conn = self.idle.pop()
            except IndexError:
                return self._open()
            if now - conn.idle_since < _FRESH or not conn.stale():
                return conn
            conn.close()  # the server restarted or dropped it: a fresh socket, not an error

    def checkin(self, conn: _Connection, now: float) -> None:
        conn.idle_since = now
        self.idle.append(conn)

    @contextlib.contextmanager
    def connection(self) -> Iterator[_Connection]:
        conn = self.checkout(_monotonic())
        try:
            yield conn
        except BaseException:
            conn.close()  # its stream may be mid-reply
            raise
        self.checkin(conn, _monotonic())

    def _open(self) -> _Connection:
        conn = _Connection(self.host, self.port, self.timeout)
        try:
            before = time.monotonic()
            self._set_clock(conn.handshake(self.instance_key), before)
        except BaseException:
            conn.close()
            raise
        return conn

    def now(self) -> float:
        """The server's clock (Unix seconds), estimated from its last reading."""
        if not self._clock_read:
            with self.connection():  # a new connection reads the clock
                pass
        return self.clock_offset + time.monotonic()

    def read_clock(self, conn: _Connection) -> float:
        """Read the server's clock now on ``conn`` (one round trip) and return it."""
        before = time.monotonic()
        self._set_clock(conn.server_time(), before)
        return self.now()

    def close(self) -> None:
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.close()


@dataclass(frozen=True)
class _Lease:
    key: bytes
    owner: str
    token: int
    acquired: float
    expires: float
    data: dict[str, Any]
    ttl_left: int  # memcached's remaining TTL, whole seconds
    cas: int

    def holder(self) -> Holder:
        return Holder(
            self.token, Owner.from_json(self.data.get("i")), _dt(self.acquired), _dt(self.expires)
        )

    def grant(self, server_now: float) -> Grant:
        """This lease as the answer to its own owner's acquire, as it is: its token, its
        expiry (not renewed), and the seconds it has left by the server's clock, capped by
        memcached's own count (the item lives at least ``ttl_left - 1`` seconds more)."""
        left = min(self.expires - server_now, self.ttl_left - 1.0)
        return Grant(self.token, _dt(self.expires), max(0.0, left))


# What a backend remembers of a lease it took or extended, to release or extend it in one
# trip: (key, CAS, instance: the server process whose counter gave the CAS, token, owner info,
# acquired ms). A plain tuple: a NamedTuple's constructor costs 20 times more, on every acquire.
_Held = tuple[bytes, int, bytes, int, str, int]


def _json(text: str) -> bytes:
    """``text`` as a JSON string literal (ASCII, quoted, escaped)."""
    return _quote(text).encode("ascii")


def _dt(seconds: float) -> datetime:
    return _fromtimestamp(seconds, _UTC)


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _ttl_arg(ttl: float, server_now: float) -> int:
    """memcached's TTL for a lease of ``ttl`` seconds: long enough that it never ends early."""
    whole = math.ceil(ttl) + 1
    return whole if whole <= _MONTH else int(server_now) + whole


def _token(started: int, cas: int) -> int:
    """The fencing token of a lease stored with CAS ``cas`` by a server started at ``S``."""
    return (started << 32) + cas


def _lease(key: bytes, reply: _Reply | None) -> _Lease | None:
    if reply is None or reply.code == b"EN":
        return None
    if reply.code != b"VA" or reply.value is None:
        raise ProtocolError(f"unexpected reply {reply.code!r} to a read")
    try:
        data = json.loads(reply.value)
        cas = reply.flag(b"c")
        token = int(data["t"]) if "t" in data else _token(int(data["s"]), cas)
        return _Lease(
            key,
            str(data["o"]),
            token,
            data["a"] / 1000,
            data["e"] / 1000,
            data,
            reply.flag(b"t"),
            cas,
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ProtocolError(f"unreadable lease at {key!r}: {exc}") from None


def _limit(reply: _Reply) -> int:
    """A semaphore's slot count from a read of ``P limit:N`` (absent: 1, a mutex)."""
    if reply.code == b"VA" and reply.value and reply.value.isdigit():
        return int(reply.value)
    return 1


def _stored(reply: _Reply) -> bool:
    """HD: written. NS/EX/NF: the condition did not hold. Anything else is an error."""
    if reply.code == b"HD":
        return True
    if reply.code in (b"NS", b"EX", b"NF"):
        return False
    raise ProtocolError(f"unexpected reply {reply.code!r} to a write")


def _new_cas(reply: _Reply) -> int:
    """The CAS unique of the item a successful ``ms … c`` just wrote (never 0 with CAS on)."""
    cas = reply.flag(b"c")
    if cas <= 0:
        raise ProtocolError("memcached returned no CAS value (is it running with -C?)")
    return cas


# -- reading replies: pure functions of the bytes read, shared with memcached_async -----------


def _reply_head(line: bytes) -> tuple[bytes, dict[bytes, bytes], int | None]:
    """A reply's first line (CRLF removed): its code, its flags, and the length of the value
    block that follows (``VA`` only, else None). An error line is a ProtocolError."""
    words = line.split()
    if not words or words[0] in (b"ERROR", b"CLIENT_ERROR", b"SERVER_ERROR"):
        raise ProtocolError(b" ".join(words).decode("ascii", "replace") or "empty reply")
    code, rest = words[0], words[1:]
    size = None
    if code == b"VA":
        if not rest or not rest[0].isdigit():
            raise ProtocolError(f"bad VA reply: {words!r}")
        size, rest = int(rest[0]), rest[1:]
    return code, {w[:1]: w[1:] for w in rest}, size


def _server_times(lines: Sequence[bytes]) -> tuple[int, int]:
    """The lines of a ``stats`` reply (before ``END``) → the server's Unix time and its start
    (time - uptime)."""
    stats: dict[bytes, bytes] = {}
    for line in lines:
        words = line.split()
        if len(words) < 3 or words[0] != b"STAT":
            raise ProtocolError(f"unexpected stats line {line!r}")
        stats[words[1]] = words[2]
    try:
        now, uptime = int(stats[b"time"]), int(stats[b"uptime"])
    except (KeyError, ValueError):
        raise ProtocolError("stats lacks time or uptime") from None
    return now, now - uptime


def _handshake_request(instance_key: bytes) -> bytes:
    """A new connection's first request: the server's clock and start (``stats``), the add of
    a fresh instance id (kept if this server process has none yet), and the id's read."""
    fresh = os.urandom(8).hex().encode("ascii")
    return STATS + ADD % (instance_key, len(fresh), 0, fresh) + READ % instance_key


def _server_instance(added: _Reply, current: _Reply) -> bytes | None:
    """The server's instance id from the handshake's add and read replies."""
    _stored(added)  # HD: we wrote the id; NS: it was there
    if current.code != b"VA":
        return None
    if current.flag(b"c") == 0:
        raise ConfigError(
            "memcached store: the server runs with CAS disabled (memcached -C); "
            "latchkey needs CAS values for its owner checks and fencing tokens"
        )
    return current.value


def _record_of(key: bytes, reply: _Reply) -> tuple[str | None, int, int]:
    """A record's JSON text, version and CAS from a read of ``P record:N`` (absent: 0, 0)."""
    if reply.code == b"EN":
        return None, 0, 0
    if reply.code != b"VA" or reply.value is None:
        raise ProtocolError(f"unexpected reply {reply.code!r} to a read")
    try:
        data = json.loads(reply.value)
        return str(data["d"]), int(data["v"]), reply.flag(b"c")
    except (ValueError, KeyError, TypeError) as exc:
        raise ProtocolError(f"unreadable record at {key!r}: {exc}") from None


def _record_value(value: str, version: int) -> bytes:
    """A record's item: ``{"v": version, "d": the JSON text}``."""
    return json.dumps({"v": version, "d": value}, separators=(",", ":")).encode()


_ERRORS = (OSError, ProtocolError)
_Names = list[str]  # (the class below has a method named list)


S = TypeVar("S")  # a server's pool: _Server here, the asyncio module's own there


class _Layout(Generic[S]):
    """What the sync backend and its asyncio twin (``memcached_async``) share besides the
    commands and the reply parsing: the URL's checks, the key layout, which server holds a
    name, the lease's JSON, and the bounded memory of our own leases' CAS."""

    prefix: bytes
    _servers: dict[str, S]  # node ("host:port") → its pool, in the URL's order
    _only: S | None  # the one server, when there is one (no hashing)

    def _lay_out(self, url: StoreURL, prefix: str) -> bytes:
        """Check ``url``, set up the ring and the caches; return the instance id's key."""
        if not url.hosts:
            raise ConfigError("memcached store: the URL names no server (memcached://host:port)")
        if url.username or url.password:
            raise ConfigError("memcached store: the text protocol has no login; remove user:pass@")
        if url.path.strip("/"):
            raise ConfigError(f"memcached store: unexpected path {url.path!r} in the URL")
        self.prefix = prefix.encode("ascii")
        self._nodes: dict[str, tuple[str, int]] = {}
        self._ring = RendezvousHash()
        for host, port in url.hosts:
            node = f"{host}:{port or DEFAULT_PORT}"
            self._nodes[node] = (host, port or DEFAULT_PORT)
            self._ring.add_node(node)
        self._limits: dict[str, int] = {}  # slot counts of semaphores seen by this backend
        self._hot_names: dict[str, tuple[bytes, bytes]] = {}  # name → (lock key, JSON literal)
        self._held: dict[tuple[str, str], _Held] = {}  # (name, owner) → our lease's CAS, …
        self._info = ("", b'""')  # the last owner_info and its JSON string literal
        self._ttls: dict[float, tuple[int, int]] = {}  # ttl → (ms, memcached TTL): _ttl_parts
        return self.prefix + b"instance"

    # -- keys and routing ----------------------------------------------------------------------

    def _encode(self, name: str) -> bytes:
        """The name's part of its keys: itself when plain, else ``#`` + SHA-256 hex."""
        raw = name.encode("utf-8")
        if (
            _PLAIN.fullmatch(name)
            and not name.startswith("#")
            and len(self.prefix) + len(raw) + _KIND_ROOM <= MAX_KEY
        ):
            return raw
        return b"#" + hashlib.sha256(raw).hexdigest().encode("ascii")

    def _key(self, kind: str, name: str, slot: int = 0) -> bytes:
        label = kind if slot == 0 else f"slot{slot}"
        return self.prefix + label.encode("ascii") + b":" + self._encode(name)

    def _hot_name(self, name: str) -> tuple[bytes, bytes]:
        """``P lock:N`` and the name as a JSON string literal, remembered for the names used
        lately (the hot path's)."""
        known = self._hot_names.get(name)
        if known is None:
            if len(self._hot_names) >= _HELD_MAX:
                self._hot_names = {}
            known = self._hot_names[name] = (self._key("lock", name), _json(name))
        return known

    def _ttl_parts(self, ttl: float) -> tuple[int, int]:
        """``ttl`` in ms, and memcached's TTL for it (relative; over 30 days, see _ttl_arg),
        remembered for the few TTLs an application uses."""
        if len(self._ttls) >= 64:
            self._ttls = {}
        parts = self._ttls[ttl] = (round(ttl * 1000), _ceil(ttl) + 1)
        return parts

    def _server(self, name: str) -> S:
        if self._only is not None:
            return self._only
        return self._servers[self._ring.get_node(self._encode(name).decode("ascii"))]

    def _by_server(self, names: Sequence[str]) -> dict[S, _Names]:
        groups: dict[S, _Names] = {}
        for name in names:
            groups.setdefault(self._server(name), []).append(name)
        return groups

    def _lease_value(
        self, template: bytes, quoted_name: bytes, owner: str, info: str, number: int,
        acquired_ms: int, expires_ms: int,
    ) -> bytes:  # fmt: skip
        """The lease's JSON: :data:`NEW_LEASE` (``number`` is S) or :data:`REWRITTEN_LEASE`
        (``number`` is the token). ``quoted_name``: the name as a JSON string literal."""
        last, quoted = self._info
        if info is not last:  # the core passes the same owner JSON text again and again
            quoted = _json(info)
            self._info = (info, quoted)
        return template % (
            quoted_name,
            _quote(owner).encode("ascii"),
            quoted,
            number,
            acquired_ms,
            expires_ms,
        )

    # -- the remembered CAS of our own leases (process-local, bounded) -------------------------

    def _remember(self, name: str, owner: str, held: _Held) -> None:
        if len(self._held) >= _HELD_MAX:
            self._forget_oldest()
        self._held[name, owner] = held

    def _forget_oldest(self) -> None:
        """Make room in the bounded memory: drop the oldest (a lease never released, say)."""
        with contextlib.suppress(StopIteration, KeyError, RuntimeError):
            del self._held[next(iter(self._held))]

    def _taken(
        self, live: Sequence[_Lease], name: str, owner: str, instance: bytes | None,
        server_now: float,
    ) -> Grant | Busy:  # fmt: skip
        """The answer to an acquire that added no lease (``live``: the live leases it saw):
        ``owner``'s own lease if it holds one — the rule of ``Backend.acquire``: that lease
        back as it is, never a second slot — remembered for a one-trip release; else Busy."""
        mine = next((s for s in live if s.owner == owner), None)
        if mine is None:
            return _busy(live)
        if instance is not None:
            info, acquired_ms = str(mine.data["i"]), int(mine.data["a"])
            held = (mine.key, mine.cas, instance, mine.token, info, acquired_ms)
            self._remember(name, owner, held)
        return mine.grant(server_now)

    def _forget(self, name: str, owner: str, instance: bytes | None) -> _Held | None:
        """Take what we remember of (name, owner), if it is valid on the server process
        ``instance`` (the id read by the connection at hand)."""
        held = self._held.pop((name, owner), None)
        if held is None or instance is None or held[2] != instance:
            return None  # unknown, or from another server lifetime: its CAS proves nothing
        return held


class MemcachedBackend(_Layout[_Server], Backend):
    """Leases in memcached: ``add`` to take, CAS-checked meta commands to extend and release."""

    scheme = "memcached"
    capabilities = Capabilities(durable=False, listing=False, survives_eviction=False)
    options = {
        "prefix": Option(key_prefix, "latchkey:", "prefix of every key latchkey writes"),
    }

    def __init__(self, url: StoreURL) -> None:
        super().__init__(url)
        instance_key = self._lay_out(url, self.config["prefix"])
        self._servers = {
            node: _Server(host, port, self.timeout, instance_key)
            for node, (host, port) in self._nodes.items()
        }
        self._only = next(iter(self._servers.values())) if len(self._servers) == 1 else None
        _FORK_AWARE.add(self)

    def after_fork(self) -> None:
        self._held = {}  # a child remembers nothing (its parent may release those leases)

    # -- running one primitive on one server's connection -------------------------------------

    def _on(
        self, server: _Server, action: str, op: Callable[Concatenate[_Connection, P], T],
        *args: P.args, **kwargs: P.kwargs,
    ) -> T:  # fmt: skip
        """Run ``op(conn, …)`` on a pooled connection to ``server``; a socket or protocol
        error closes the connection (its stream may be mid-reply) and is StoreUnavailable.
        One clock read: the connection goes back to the pool stamped with the time it was
        taken (a little early: the safe side for checkout's no-poll window)."""
        now = _monotonic()
        try:
            conn = server.checkout(now)
            try:
                result = op(conn, *args, **kwargs)
            except BaseException:
                conn.close()
                raise
            server.checkin(conn, now)
            return result
        except _ERRORS as exc:
            self.unavailable(exc, action)

    # -- reading slots -----------------------------------------------------------------------

    def _slots(self, conn: _Connection, name: str) -> list[_Lease | None]:
        """Every slot of ``name`` (the live lease in it, or None): one round trip, two when
        the name turns out to be a semaphore with more slots than we knew."""
        known = self._limits.get(name, 1)
        keys = [self._key("lock", name, i) for i in range(known)]
        replies = conn.exchange([READ % self._key("limit", name), *(READ % k for k in keys)])
        limit = _limit(replies[0])
        if limit > known:
            self._limits[name] = limit
            more = [self._key("lock", name, i) for i in range(known, limit)]
            keys += more
            replies += conn.exchange([READ % k for k in more])
        return [_lease(k, r) for k, r in zip(keys, replies[1:], strict=True)]

    def _mine(self, conn: _Connection, name: str, owner: str) -> _Lease | None:
        return next((s for s in self._slots(conn, name) if s and s.owner == owner), None)

    # -- leases ------------------------------------------------------------------------------

    # acquire and release are the hot path (a lock per use, uncontended: two round trips of
    # ~20 µs each, a few µs of Python around them), so they run _on() written out (without its
    # *args, one clock read for the pool and the lease), and acquire formats and parses a lease
    # inline. The rest may take its time.

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        server = self._only or self._server(name)
        return self._on(server, "acquire", self._add, server, name, owner, owner_info, ttl, limit)

    def _add(
        self, conn: _Connection, server: _Server, name: str, owner: str, owner_info: str,
        ttl: float, limit: int,
    ) -> Grant | Busy:  # fmt: skip
        """Add a lease in a free slot of ``name`` (one round trip; a semaphore reads its
        slots first, a second); else ``owner``'s own lease if it holds one (the probe read
        the slot's lease), or Busy with the live leases found."""
        started = _monotonic()
        if limit == 1:  # a mutex: try the add at once
            key, quoted_name = self._hot_names.get(name) or self._hot_name(name)
            live: Sequence[_Lease] = ()
        else:
            live = []
            free = self._free_slots(conn, name, limit, live)
            if not free or any(s.owner == owner for s in live):
                return self._taken(live, name, owner, conn.instance, server.now())
            key = random.choice(free)  # contenders spread over the free slots
            quoted_name = _json(name)
            started = _monotonic()
        # _lease_value(), _ttl_arg(), _token(), _remember() and _dt(), inline:
        now = server.clock_offset + started  # server.now(): its clock was read (checkout)
        acquired = int(now * 1000)
        ttl_ms, expiry = self._ttls.get(ttl) or self._ttl_parts(ttl)
        if expiry > _MONTH:
            expiry = _ttl_arg(ttl, now)
        last, quoted_info = self._info
        if owner_info is not last:
            quoted_info = _json(owner_info)
            self._info = (owner_info, quoted_info)
        expires = acquired + ttl_ms
        value = NEW_LEASE % (
            quoted_name, _quote(owner).encode("ascii"), quoted_info, conn.started, acquired,
            expires,
        )  # fmt: skip
        chunk = conn.request(PROBE_ADD % (key, key, len(value), expiry, value))
        if (
            chunk[:4] == b"HD c"  # stored, and the probe missed silently: "HD c<cas>\r\n"
            and chunk[-2:] == b"\r\n"
            and (digits := chunk[4:-2]).isdigit()  # (so the chunk holds no other reply)
            and (cas := int(digits)) > 0
        ):
            pass  # the common reply, taken as is
        else:
            conn.unread(chunk)
            probe, added = conn.probe_add_replies()
            if not _stored(added):
                winner = _lease(key, probe)  # who holds the slot (None: it was taken just now)
                live = [*live, winner] if winner else live
                return self._taken(live, name, owner, conn.instance, server.now())
            cas = _new_cas(added)
        token = (conn.started << 32) + cas
        if conn.instance is not None:
            held = self._held
            if len(held) >= _HELD_MAX:
                self._forget_oldest()
            held[name, owner] = (key, cas, conn.instance, token, owner_info, acquired)
        return Grant(token, _fromtimestamp(expires / 1000, _UTC))  # the lease's, to the ms

    def _free_slots(
        self, conn: _Connection, name: str, limit: int, live: list[_Lease]
    ) -> list[bytes]:
        """A semaphore's free slots (keys), after writing its limit (one round trip); its
        live leases are appended to ``live``."""
        count = str(limit).encode("ascii")
        keys = [self._key("lock", name, i) for i in range(limit)]
        replies = conn.exchange(
            [SET_FOREVER % (self._key("limit", name), len(count), count)] + [READ % k for k in keys]
        )
        slots = [_lease(k, r) for k, r in zip(keys, replies[1:], strict=True)]
        live.extend(s for s in slots if s is not None)
        return [k for k, s in zip(keys, slots, strict=True) if s is None]

    def release(self, name: str, owner: str) -> bool:
        server = self._only or self._server(name)
        held = self._held.pop((name, owner), None)
        return self._on(server, "release", self._delete, name, owner, held)

    def _delete(self, conn: _Connection, name: str, owner: str, held: _Held | None) -> bool:
        """Release by the CAS we remember (``held``) in one round trip, else by reading."""
        # The CAS we remember is valid only on the server process that gave it.
        if held is not None and held[2] == conn.instance:
            chunk = conn.request(DELETE_IF % (held[0], held[1]))
            # HD: the item with our CAS was there, live: our lease, now gone.
            if chunk == b"HD\r\n":
                return True
            conn.unread(chunk)
            if _stored(conn.reply()):
                return True
        return self._release_read(conn, name, owner)

    def _release_read(self, conn: _Connection, name: str, owner: str) -> bool:
        """Release a lease we do not remember, or that changed since we wrote it (EX) or is
        gone (NF): read once to decide, then delete by the CAS read."""
        mine = self._mine(conn, name, owner)
        if mine is None:
            return False
        return _stored(conn.exchange([DELETE_IF % (mine.key, mine.cas)])[0])

    def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        server = self._server(name)
        return self._on(server, "extend", self._extend, server, name, owner, ttl)

    def _extend(
        self, conn: _Connection, server: _Server, name: str, owner: str, ttl: float
    ) -> Grant | None:
        held = self._forget(name, owner, conn.instance)
        if held is not None and (grant := self._rewrite(conn, server, name, owner, held, ttl)):
            return grant
        # Unknown, or changed since we wrote it (EX) or gone (NF): read once to decide.
        mine = self._mine(conn, name, owner)
        if mine is None:
            return None
        held = (mine.key, mine.cas, b"", mine.token, mine.data["i"], _ms(mine.acquired))
        return self._rewrite(conn, server, name, owner, held, ttl)

    def _rewrite(
        self, conn: _Connection, server: _Server, name: str, owner: str, held: _Held, ttl: float
    ) -> Grant | None:
        """Give our lease ``held`` a new expiry if its CAS is still the one held (one trip).
        The item gets a new CAS, so the value now carries its token; we remember the CAS."""
        key, cas, _, token, info, acquired_ms = held
        now = server.now()
        value = self._lease_value(
            REWRITTEN_LEASE, _json(name), owner, info, token, acquired_ms, _ms(now + ttl)
        )
        reply = conn.exchange([REPLACE_IF % (key, len(value), _ttl_arg(ttl, now), cas, value)])[0]
        if not _stored(reply):
            return None
        if conn.instance is not None:
            new_cas = _new_cas(reply)
            self._remember(name, owner, (key, new_cas, conn.instance, token, info, acquired_ms))
        return Grant(token, _dt(now + ttl))

    def inspect(self, name: str) -> LockInfo | None:
        live = [s for s in self._on(self._server(name), "inspect", self._slots, name) if s]
        if not live:
            return None
        live.sort(key=lambda s: (s.acquired, s.token))
        return LockInfo(name, tuple(s.holder() for s in live))

    def list(self, prefix: str = "") -> Iterator[LockInfo]:
        raise Unsupported(
            "the memcached store cannot list locks: memcached has no reliable way to "
            "enumerate keys; inspect(name) works"
        )

    def force_release(self, name: str) -> bool:
        return self._on(self._server(name), "force_release", self._force_release, name)

    def _force_release(self, conn: _Connection, name: str) -> bool:
        known = self._limits.get(name, 1)
        keys = [self._key("lock", name, i) for i in range(known)]
        replies = conn.exchange([READ % self._key("limit", name), *(DELETE % k for k in keys)])
        deleted = [_stored(r) for r in replies[1:]]
        limit = _limit(replies[0])
        if limit > known:  # a semaphore with more slots than we knew
            self._limits[name] = limit
            more = [self._key("lock", name, i) for i in range(known, limit)]
            deleted += [_stored(r) for r in conn.exchange([DELETE % k for k in more])]
        return any(deleted)  # md answers HD only for a live item

    def purge_expired(self) -> int:
        """memcached drops expired items itself: there is never anything to purge."""
        return 0

    # -- batch claims: one round trip per server involved, whatever the number of names ----

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        grants: dict[str, Grant] = {}
        for server, group in self._by_server(names).items():
            grants.update(
                self._on(server, "claim", self._claim, server, group, owner, owner_info, ttl)
            )
        return grants

    def _claim(
        self, conn: _Connection, server: _Server, names: _Names, owner: str, owner_info: str,
        ttl: float,
    ) -> dict[str, Grant]:  # fmt: skip
        """Add every name's lease in one pipelined batch; the names held already are skipped."""
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
        for name, key, reply in zip(names, keys, conn.exchange(adds), strict=True):
            if not _stored(reply):
                continue  # held by someone else: skipped
            cas = _new_cas(reply)
            token = _token(conn.started, cas)
            if conn.instance is not None:
                self._remember(name, owner, (key, cas, conn.instance, token, owner_info, acquired))
            grants[name] = Grant(token, _dt(now + ttl))
        return grants

    def release_many(self, names: Sequence[str], owner: str) -> int:
        return sum(
            self._on(server, "release_many", self._release_group, group, owner)
            for server, group in self._by_server(names).items()
        )

    def _release_group(self, conn: _Connection, names: _Names, owner: str) -> int:
        """Release our leases among ``names`` on one server: one round trip when this backend
        claimed them all; two for the others (read, then delete ours); a remembered lease that
        changed since is read once, so three at most."""
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
            replies = conn.exchange(
                [DELETE_IF % (k, cas) for k, cas, _ in deletes] + [READ % k for k in reads]
            )
            done = [_stored(r) for r in replies[: len(deletes)]]
            released += sum(done)
            leases = [_lease(k, r) for k, r in zip(reads, replies[len(deletes) :], strict=True)]
            reads = [k for (k, _, mem), ok in zip(deletes, done, strict=True) if mem and not ok]
            deletes = [(s.key, s.cas, False) for s in leases if s and s.owner == owner]
        return released

    # -- versioned records: {"v": version, "d": JSON text}, CAS-checked writes ---------------

    def _record(self, conn: _Connection, key: bytes) -> tuple[str | None, int, int]:
        return _record_of(key, conn.exchange([READ % key])[0])

    def record_get(self, name: str) -> tuple[str | None, int]:
        key = self._key("record", name)
        value, version, _ = self._on(self._server(name), "record_get", self._record, key)
        return value, version

    def record_set(self, name: str, value: str, version: int) -> int | None:
        key = self._key("record", name)
        return self._on(self._server(name), "record_set", self._record_set, key, value, version)

    def _record_set(self, conn: _Connection, key: bytes, value: str, version: int) -> int | None:
        data = _record_value(value, version + 1)
        if version == 0:
            written = _stored(conn.exchange([ADD % (key, len(data), 0, data)])[0])
        else:
            _, current, cas = self._record(conn, key)
            if current != version:
                return None
            reply = conn.exchange([REPLACE_IF % (key, len(data), 0, cas, data)])[0]
            written = _stored(reply)
        return version + 1 if written else None

    def record_delete(self, name: str, version: int) -> bool:
        key = self._key("record", name)
        return self._on(self._server(name), "record_delete", self._record_delete, key, version)

    def _record_delete(self, conn: _Connection, key: bytes, version: int) -> bool:
        _, current, cas = self._record(conn, key)
        if version == 0 or current != version:
            return False
        return _stored(conn.exchange([DELETE_IF % (key, cas)])[0])

    # -- clock and lifecycle -----------------------------------------------------------------

    def now(self) -> datetime:
        """The first server's clock: its whole-second ``stats`` time, ± 0.5 s."""
        server = next(iter(self._servers.values()))
        return _dt(self._on(server, "now", server.read_clock))

    def close(self) -> None:
        for server in self._servers.values():
            server.close()


def _busy(live: Sequence[_Lease]) -> Busy:
    """Busy with the lease that ends soonest; memcached's remaining TTL caps the wait."""
    if not live:
        return Busy(0)
    soonest = min(live, key=lambda s: (s.ttl_left, s.expires))
    return Busy(len(live), soonest.holder(), float(max(soonest.ttl_left, 0)))
