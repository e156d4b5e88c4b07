"""``memcached://host:port[,host:port…]``: leases as memcached items that expire by their TTL.

Seed 000 locked rows with a bare ``add``, which answers "not stored" both when the key exists
and when the server is down. This store speaks memcached's *meta* protocol (``mg``/``ms``/
``md``/``ma``, memcached ≥ 1.6) over its own small connection pool, so that every reply is
read and checked: a server that does not answer is :class:`StoreUnavailable`, never "busy".
pymemcache supplies the rendezvous hash that picks a server per name; its own clients are not
used because they have no meta commands and no mixed pipelines, and because pymemcache's
``HashClient`` answers a default value (``False``: "not stored") while a server is marked
failed and then moves its keys to another server, where a second holder could take a lock.
Here a name always lives on one server, and that server being down is an error.

Layout (``P`` is ``?prefix=``, default ``latchkey:``; ``N`` the name, or ``#`` + its SHA-256
when it is not plain printable ASCII, starts with ``#``, or would make a key too long):

- ``P lock:N`` (and ``P slotI:N`` for semaphore slots I ≥ 1): one lease, as JSON
  (name, owner token, owner info, fencing token, acquired/expires ms), with the lease's TTL;
- ``P fence:N``: the name's fencing counter, no TTL;
- ``P limit:N``: a semaphore's slot count, no TTL (absent: 1);
- ``P record:N``: a versioned record, no TTL.

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
import random
import re
import select
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

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

# -- commands: %b is a key (prefixed, plain ASCII, ≤ 250 bytes); replies as noted -------------

# Next fencing token of a name: +1, or create the counter (no TTL, N0) at J (the store clock
# in ms, so that a counter lost to a restart or eviction most likely restarts above its old
# values). Reply ``VA <len>`` + the new value. Tokens never repeat while the counter lives.
NEXT_TOKEN = b"ma %b N0 J%d v\r\n"
# Read an item: value (v), remaining TTL in whole seconds (t), CAS unique (c).
# Reply ``VA <len> t<ttl> c<cas>`` + value, or ``EN`` when absent or expired.
READ = b"mg %b v t c\r\n"
# Take a lease slot only if it is absent (ME: add mode), TTL T. ``HD`` stored, ``NS`` taken.
# Mutual exclusion: memcached adds atomically, and an expired item counts as absent.
ADD = b"ms %b %d T%d ME\r\n%b\r\n"
# Rewrite an item only if its CAS unique is the one we read (extend, record update).
# ``HD`` written, ``EX`` changed since we read it, ``NF`` gone: a newer holder is never touched.
REPLACE_IF = b"ms %b %d T%d C%d\r\n%b\r\n"
# Delete an item only if its CAS unique is the one we read: the owner-checked release (never
# get-then-delete, which can delete a newer holder's lease). ``HD``, ``EX`` changed, ``NF``.
DELETE_IF = b"md %b C%d\r\n"
# Delete whatever is there (force_release only). ``HD`` deleted, ``NF`` absent.
DELETE = b"md %b\r\n"
# Write an item with no TTL (a semaphore's slot count). ``HD``.
SET_FOREVER = b"ms %b %d T0\r\n%b\r\n"
# The server's clock: ``STAT time <unix seconds>`` among the general stats, then ``END``.
STATS = b"stats\r\n"


class ProtocolError(Exception):
    """memcached answered something we did not expect (an error line, a bad value)."""


@dataclass(frozen=True)
class _Reply:
    code: bytes  # HD, NS, EX, NF, EN, VA
    flags: dict[str, bytes]
    value: bytes | None = None

    def flag(self, name: str) -> int:
        try:
            return int(self.flags[name])
        except (KeyError, ValueError):
            raise ProtocolError(f"reply {self.code!r} lacks a numeric {name} flag") from None


class _Connection:
    """One socket to one server, with a read buffer. Not thread-safe: pooled per server."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray()

    def stale(self) -> bool:
        """True if the server closed this idle connection (it never speaks unasked)."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionResetError("memcached closed the connection")
        self._buf += chunk

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

    def _reply(self) -> _Reply:
        words = self._line().split()
        if not words or words[0] in (b"ERROR", b"CLIENT_ERROR", b"SERVER_ERROR"):
            raise ProtocolError(b" ".join(words).decode("ascii", "replace") or "empty reply")
        code, rest = words[0], words[1:]
        value = None
        if code == b"VA":
            if not rest or not rest[0].isdigit():
                raise ProtocolError(f"bad VA reply: {words!r}")
            value, rest = self._exact(int(rest[0])), rest[1:]
        return _Reply(code, {w[:1].decode(): w[1:] for w in rest}, value)

    def exchange(self, commands: Sequence[bytes]) -> list[_Reply]:
        """Send ``commands`` in one write and read one reply each: one round trip."""
        self.sock.sendall(b"".join(commands))
        return [self._reply() for _ in commands]

    def server_time(self) -> int:
        self.sock.sendall(STATS)
        found = None
        while (line := self._line()) != b"END":
            if line.startswith(b"STAT time "):
                found = int(line.split()[2])
            elif not line.startswith(b"STAT "):
                raise ProtocolError(f"unexpected stats line {line!r}")
        if found is None:
            raise ProtocolError("stats has no time")
        return found

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class _Server:
    """A pool of connections to one server, and that server's clock."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._idle: list[_Connection] = []
        self._clock: tuple[float, float] | None = None  # (server time, local monotonic)
        self._mutex = threading.Lock()

    @contextlib.contextmanager
    def connection(self) -> Iterator[_Connection]:
        conn = None
        with self._mutex:
            while self._idle and conn is None:
                conn = self._idle.pop()
                if conn.stale():  # the server restarted: use a fresh socket, not an error
                    conn.close()
                    conn = None
        if conn is None:
            conn = _Connection(self.host, self.port, self.timeout)
            try:
                self._set_clock(conn)
            except BaseException:
                conn.close()
                raise
        try:
            yield conn
        except BaseException:
            conn.close()  # its stream may be mid-reply
            raise
        with self._mutex:
            self._idle.append(conn)

    def _set_clock(self, conn: _Connection) -> None:
        before = time.monotonic()
        seconds = conn.server_time()
        # memcached's clock ticks in whole seconds: the true time is within the second after.
        self._clock = (seconds + 0.5, (before + time.monotonic()) / 2)

    def exchange(self, commands: Sequence[bytes]) -> list[_Reply]:
        with self.connection() as conn:
            return conn.exchange(commands)

    def now(self) -> float:
        """The server's clock (Unix seconds), estimated from its last reading."""
        if self._clock is None:
            with self.connection():
                pass
        assert self._clock is not None
        return self._clock[0] + time.monotonic() - self._clock[1]

    def read_clock(self) -> float:
        """Read the server's clock now (one round trip) and return it."""
        with self.connection() as conn:
            self._set_clock(conn)
        return self.now()

    def close(self) -> None:
        with self._mutex:
            idle, self._idle = self._idle, []
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


def _dt(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, timezone.utc)


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _ttl_arg(ttl: float, server_now: float) -> int:
    """memcached's TTL for a lease of ``ttl`` seconds: long enough that it never ends early."""
    whole = math.ceil(ttl) + 1
    return whole if whole <= _MONTH else int(server_now) + whole


def _lease(key: bytes, reply: _Reply) -> _Lease | None:
    if reply.code == b"EN":
        return None
    if reply.code != b"VA" or reply.value is None:
        raise ProtocolError(f"unexpected reply {reply.code!r} to a read")
    try:
        data = json.loads(reply.value)
        return _Lease(
            key,
            str(data["o"]),
            int(data["t"]),
            data["a"] / 1000,
            data["e"] / 1000,
            data,
            reply.flag("t"),
            reply.flag("c"),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ProtocolError(f"unreadable lease at {key!r}: {exc}") from None


def _counter(reply: _Reply) -> int:
    if reply.code != b"VA" or reply.value is None or not reply.value.isdigit():
        raise ProtocolError(f"unexpected reply {reply.code!r} to a counter increment")
    return int(reply.value)


def _stored(reply: _Reply) -> bool:
    """HD: written. NS/EX/NF: the condition did not hold. Anything else is an error."""
    if reply.code == b"HD":
        return True
    if reply.code in (b"NS", b"EX", b"NF"):
        return False
    raise ProtocolError(f"unexpected reply {reply.code!r} to a write")


_ERRORS = (OSError, ProtocolError)
_Names = list[str]  # (the class below has a method named list)


class MemcachedBackend(Backend):
    """Leases in memcached: ``add`` to take, CAS-checked meta commands to extend and release."""

    scheme = "memcached"
    capabilities = Capabilities(durable=False, listing=False, survives_eviction=False)
    options = {
        "prefix": Option(key_prefix, "latchkey:", "prefix of every key latchkey writes"),
    }

    def __init__(self, url: StoreURL) -> None:
        super().__init__(url)
        if not url.hosts:
            raise ConfigError("memcached store: the URL names no server (memcached://host:port)")
        if url.username or url.password:
            raise ConfigError("memcached store: the text protocol has no login; remove user:pass@")
        if url.path.strip("/"):
            raise ConfigError(f"memcached store: unexpected path {url.path!r} in the URL")
        self.prefix: bytes = self.config["prefix"].encode("ascii")
        self._servers: dict[str, _Server] = {}
        self._ring = RendezvousHash()
        for host, port in url.hosts:
            node = f"{host}:{port or DEFAULT_PORT}"
            self._servers[node] = _Server(host, port or DEFAULT_PORT, self.timeout)
            self._ring.add_node(node)
        self._limits: dict[str, int] = {}  # slot counts of semaphores seen by this backend

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

    def _server(self, name: str) -> _Server:
        if len(self._servers) == 1:
            return next(iter(self._servers.values()))
        return self._servers[self._ring.get_node(self._encode(name).decode("ascii"))]

    def _lease_value(
        self, name: str, owner: str, owner_info: str, token: int, acquired: float, expires: float
    ) -> bytes:
        data = {"n": name, "o": owner, "i": owner_info, "t": token}
        data.update(a=_ms(acquired), e=_ms(expires))
        return json.dumps(data, separators=(",", ":")).encode("utf-8")

    def _slots(self, server: _Server, name: str) -> list[_Lease | None]:
        """Every slot of ``name`` (the live lease in it, or None): one round trip, two when
        the name turns out to be a semaphore with more slots than we knew."""
        known = self._limits.get(name, 1)
        keys = [self._key("lock", name, i) for i in range(known)]
        replies = server.exchange([READ % self._key("limit", name), *(READ % k for k in keys)])
        limit = int(replies[0].value) if replies[0].code == b"VA" and replies[0].value else 1
        if limit > known:
            self._limits[name] = limit
            more = [self._key("lock", name, i) for i in range(known, limit)]
            keys += more
            replies += server.exchange([READ % k for k in more])
        return [_lease(k, r) for k, r in zip(keys, replies[1:], strict=True)]

    def _mine(self, server: _Server, name: str, owner: str) -> _Lease | None:
        return next((s for s in self._slots(server, name) if s and s.owner == owner), None)

    # -- leases ------------------------------------------------------------------------------

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        server = self._server(name)
        keys = [self._key("lock", name, i) for i in range(limit)]
        with self.translate("acquire", _ERRORS):
            commands = [NEXT_TOKEN % (self._key("fence", name), _ms(server.now()))]
            if limit > 1:
                count = str(limit).encode("ascii")
                commands.append(SET_FOREVER % (self._key("limit", name), len(count), count))
            replies = server.exchange([*commands, *(READ % k for k in keys)])
            token = _counter(replies[0])
            slots = [_lease(k, r) for k, r in zip(keys, replies[len(commands) :], strict=True)]
            live = [s for s in slots if s is not None]
            free = [k for k, s in zip(keys, slots, strict=True) if s is None]
            if not free:
                return _busy(live)
            key = random.choice(free)  # contenders for a semaphore spread over its free slots
            now = server.now()
            value = self._lease_value(name, owner, owner_info, token, now, now + ttl)
            added, current = server.exchange(
                [ADD % (key, len(value), _ttl_arg(ttl, now), value), READ % key]
            )
            if _stored(added):
                return Grant(token, _dt(now + ttl))
            winner = _lease(key, current)  # who took the free slot first (None: gone again)
            return _busy([*live, winner] if winner else live)

    def release(self, name: str, owner: str) -> bool:
        server = self._server(name)
        with self.translate("release", _ERRORS):
            mine = self._mine(server, name, owner)
            if mine is None:
                return False
            return _stored(server.exchange([DELETE_IF % (mine.key, mine.cas)])[0])

    def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        server = self._server(name)
        with self.translate("extend", _ERRORS):
            mine = self._mine(server, name, owner)
            if mine is None:
                return None
            now = server.now()
            data = mine.data
            value = self._lease_value(name, owner, data["i"], mine.token, mine.acquired, now + ttl)
            args = (mine.key, len(value), _ttl_arg(ttl, now), mine.cas, value)
            if not _stored(server.exchange([REPLACE_IF % args])[0]):
                return None
            return Grant(mine.token, _dt(now + ttl))

    def inspect(self, name: str) -> LockInfo | None:
        with self.translate("inspect", _ERRORS):
            live = [s for s in self._slots(self._server(name), name) if s is not None]
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
        server = self._server(name)
        with self.translate("force_release", _ERRORS):
            live = [s for s in self._slots(server, name) if s is not None]
            if not live:
                return False
            replies = server.exchange([DELETE % s.key for s in live])
            return any(_stored(r) for r in replies)

    def purge_expired(self) -> int:
        """memcached drops expired items itself: there is never anything to purge."""
        return 0

    # -- batch claims: two round trips per server involved, whatever the number of names ---

    def _by_server(self, names: Sequence[str]) -> dict[_Server, _Names]:
        groups: dict[_Server, _Names] = {}
        for name in names:
            groups.setdefault(self._server(name), []).append(name)
        return groups

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        grants: dict[str, Grant] = {}
        with self.translate("claim", _ERRORS):
            for server, group in self._by_server(names).items():
                stamp = _ms(server.now())
                counters = [NEXT_TOKEN % (self._key("fence", n), stamp) for n in group]
                tokens = [_counter(r) for r in server.exchange(counters)]
                now = server.now()
                expiry = _ttl_arg(ttl, now)
                adds = []
                for name, token in zip(group, tokens, strict=True):
                    value = self._lease_value(name, owner, owner_info, token, now, now + ttl)
                    adds.append(ADD % (self._key("lock", name), len(value), expiry, value))
                replies = server.exchange(adds)
                for name, token, reply in zip(group, tokens, replies, strict=True):
                    if _stored(reply):
                        grants[name] = Grant(token, _dt(now + ttl))
        return grants

    def release_many(self, names: Sequence[str], owner: str) -> int:
        released = 0
        with self.translate("release_many", _ERRORS):
            for server, group in self._by_server(names).items():
                keys = [self._key("lock", n) for n in group]
                replies = server.exchange([READ % k for k in keys])
                leases = [_lease(k, r) for k, r in zip(keys, replies, strict=True)]
                mine = [s for s in leases if s is not None and s.owner == owner]
                if mine:
                    replies = server.exchange([DELETE_IF % (s.key, s.cas) for s in mine])
                    released += sum(_stored(r) for r in replies)
        return released

    # -- versioned records: {"v": version, "d": JSON text}, CAS-checked writes ---------------

    def _record(self, server: _Server, key: bytes) -> tuple[str | None, int, int]:
        reply = server.exchange([READ % key])[0]
        if reply.code == b"EN":
            return None, 0, 0
        if reply.code != b"VA" or reply.value is None:
            raise ProtocolError(f"unexpected reply {reply.code!r} to a read")
        try:
            data = json.loads(reply.value)
            return str(data["d"]), int(data["v"]), reply.flag("c")
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"unreadable record at {key!r}: {exc}") from None

    def record_get(self, name: str) -> tuple[str | None, int]:
        with self.translate("record_get", _ERRORS):
            value, version, _ = self._record(self._server(name), self._key("record", name))
        return value, version

    def record_set(self, name: str, value: str, version: int) -> int | None:
        server, key = self._server(name), self._key("record", name)
        data = json.dumps({"v": version + 1, "d": value}, separators=(",", ":")).encode()
        with self.translate("record_set", _ERRORS):
            if version == 0:
                written = _stored(server.exchange([ADD % (key, len(data), 0, data)])[0])
            else:
                _, current, cas = self._record(server, key)
                if current != version:
                    return None
                reply = server.exchange([REPLACE_IF % (key, len(data), 0, cas, data)])[0]
                written = _stored(reply)
        return version + 1 if written else None

    def record_delete(self, name: str, version: int) -> bool:
        server, key = self._server(name), self._key("record", name)
        with self.translate("record_delete", _ERRORS):
            _, current, cas = self._record(server, key)
            if version == 0 or current != version:
                return False
            return _stored(server.exchange([DELETE_IF % (key, cas)])[0])

    # -- clock and lifecycle -----------------------------------------------------------------

    def now(self) -> datetime:
        """The first server's clock: its whole-second ``stats`` time, ± 0.5 s."""
        with self.translate("now", _ERRORS):
            return _dt(next(iter(self._servers.values())).read_clock())

    def close(self) -> None:
        for server in self._servers.values():
            server.close()


def _busy(live: Sequence[_Lease]) -> Busy:
    """Busy with the lease that ends soonest; memcached's remaining TTL caps the wait."""
    if not live:
        return Busy(0)
    soonest = min(live, key=lambda s: (s.ttl_left, s.expires))
    return Busy(len(live), soonest.holder(), float(max(soonest.ttl_left, 0)))
