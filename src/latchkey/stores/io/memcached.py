"""memcached's meta protocol over plain sockets: the sync driver of ``memcached://``, and the
framing and reply-line helpers its asyncio twin (``memcached_async``) and the store share.

**Requests** (the store, :mod:`latchkey.stores.memcached`, yields them; plain tuples, built
without formatting): ``node`` (an int, the server's index in the URL) — use one connection to
that server for the rest of the primitive, answered with the connection's *session*;
``(node, commands, count, probe, session)`` (:func:`trip`) — write ``commands`` in one write
(one round trip) on the primitive's connection to ``node`` and read ``count`` replies, each
``(line, data)``: the line without CRLF, and the data block of a ``VA`` or the STAT lines of a
``stats`` reply, else None; with ``probe``, the first command is a quiet read, whose reply is
None when it missed (a miss sends nothing); with a ``session`` (else None), the commands are
sent only if the connection's session is that one, and otherwise nothing is sent and the
answer is the connection's session (a tuple, where replies are a list). A primitive's
connections go back to their pools when it ends, or are closed when it fails (their stream
may be mid-reply).

**Per-server state.** A new connection runs the store's ``greet(node)`` steps on itself (one
round trip: ``stats`` and the instance id) and keeps the answer, the session (the server's
start ``S`` and instance id): what it means is the store's, that it holds for exactly this
connection is the I/O's (a TCP connection never outlives its server process). The clock
reading of the greeting is the store's too (its store clock). So the driver keeps no
semantics: sockets, framing, pools, deadlines, fork safety and error mapping.

**Pool.** Per server, a list of idle connections popped and appended (atomic in CPython, no
lock), unbounded (in use: at most one per thread). Not :class:`latchkey.stores.io.Pool`: its
``get`` + ``put`` cost 4.0 µs a primitive against 0.24 µs here (a condition variable, a
``getpid`` and a ``notify`` each way; measured with timeit on the development VM), about 8 µs
of an uncontended acquire + release of 60 to 100 µs, more than the 5 % the issue allows. A
connection idle for :data:`_FRESH` or more is polled before reuse: a server restarted since
(tests restart memcached in milliseconds) closed it, and the call goes to a fresh connection
rather than fail; no server stops, starts again and listens within that millisecond. A forked
child drops its parent's connections (:func:`latchkey.stores.io.after_fork`).

**Deadline.** On Linux the kernel enforces ``?timeout=`` on each send and receive of a blocking
socket (SO_SNDTIMEO/SO_RCVTIMEO), which saves Python's ``poll()`` before every call (a third of
a round trip's system calls); elsewhere Python's socket timeout. The first ``recv`` of a reply
asks for :data:`_FIRST_READ` bytes (a buffer from Python's small-object allocator, where
``recv(65536)`` mallocs 64 KiB: a sixth of the call's cost); a reply of one whole ``HD`` line,
the common answer, is taken as is, anything else goes through :func:`take`. Bytes found in the
buffer before a request are replies nobody asked for: the request fails (ProtocolError) rather
than take them for its answer. OSError and ProtocolError become StoreUnavailable.

**A borrowed client** (``latchkey.connect(client=pymemcache Client / PooledClient /
HashClient)``): latchkey follows its servers (every server of a HashClient) and nothing else —
pymemcache speaks no meta commands, so its sockets are of no use here. Connections are
latchkey's own, made and bounded as above by the store's ``timeout`` (a client's
``connect_timeout`` / ``timeout``, None by default in pymemcache, would let a call block for
ever), and closed by ``store.close()``; the client is never touched. A client with a
``tls_context`` or of a UNIX socket is a ConfigError (plain TCP only).
"""

from __future__ import annotations

import contextlib
import math
import select
import socket
import struct
import sys
import time
from typing import TYPE_CHECKING, Any, TypeVar

from latchkey.errors import StoreUnavailable
from latchkey.stores.io import Driver, Steps, after_fork, drive, green

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase

T = TypeVar("T")
Reply = tuple[bytes, "bytes | None"]
_KERNEL_TIMEOUTS = sys.platform.startswith("linux")
_FRESH = 0.001  # seconds a pooled connection is reused without polling it
_FIRST_READ = 448  # bytes asked of the first recv of a reply: a short reply or a lease fits
_ERROR_LINES = (b"ERROR", b"CLIENT_ERROR", b"SERVER_ERROR")


class ProtocolError(Exception):
    """memcached answered something we did not expect (an error line, a bad value)."""


# -- the meta protocol: replies as the store reads them -----------------------------------------


def trip(node: int, commands: list[bytes]) -> tuple[int, bytes, int, bool, None]:
    """A request: ``commands`` to ``node`` in one write, one reply each."""
    return node, b"".join(commands), len(commands), False, None


def flag(line: bytes, name: bytes) -> int:
    """A numeric flag of a reply line (``c`` of ``HD c42``)."""
    for word in line.split()[1:]:
        if word[:1] == name and word[1:].isdigit():
            return int(word[1:])
    raise ProtocolError(f"reply {line!r} lacks a numeric {name!r} flag")


def written(reply: Reply) -> bool:
    """A write's reply: HD written; NS, EX, NF its condition did not hold; else an error."""
    if (code := reply[0].split(b" ", 1)[0]) in (b"HD", b"NS", b"EX", b"NF"):
        return code == b"HD"
    raise ProtocolError(f"unexpected reply {reply[0]!r} to a write")


def stats(block: bytes | None, *names: bytes) -> list[int]:
    """The named numbers of a ``stats`` reply's STAT lines."""
    try:
        found = dict(line.split()[1:3] for line in (block or b"").split(b"\r\n") if line)
        return [int(found[name]) for name in names]
    except (KeyError, ValueError):
        raise ProtocolError(f"stats lacks {b', '.join(names).decode()}") from None


def take(buf: bytearray) -> Reply | None:
    """The next whole reply at the start of ``buf``, removed from it; None while incomplete.
    A ``VA`` brings its data block; a ``stats`` reply, its STAT lines up to ``END``."""
    end = buf.find(b"\r\n")
    if end < 0:
        return None
    line = bytes(buf[:end])
    if line[:3] == b"VA ":
        size = line.split(b" ", 2)[1]
        if not size.isdigit():
            raise ProtocolError(f"bad VA reply: {line!r}")
        stop = end + 2 + int(size)
        if len(buf) < stop + 2:
            return None
        data = bytes(buf[end + 2 : stop])
        del buf[: stop + 2]
        return line, data
    if line[:5] == b"STAT ":
        stop = buf.find(b"\r\nEND\r\n")
        if stop < 0:
            return None
        data = bytes(buf[:stop])
        del buf[: stop + 7]
        return b"END", data
    if not line or line.split(b" ", 1)[0] in _ERROR_LINES:
        raise ProtocolError(line.decode("ascii", "replace") or "empty reply")
    del buf[: end + 2]
    return line, None


def started(first: Reply, probe: bool) -> list[Reply | None]:
    """A request's replies so far, from its first: with a probe, a first reply that is not
    the probe's hit (``VA``) means that the probe missed (None) and this is the next one."""
    return [first] if not probe or first[0][:2] == b"VA" else [None, first]


# -- the sync driver ------------------------------------------------------------------------------


class Connection:
    """One socket to one server process, with its read buffer and session. Pooled: one
    primitive at a time."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.timeout = timeout
        # The kernel's per-call timeouts (a timed-out call is EAGAIN); not under green threads,
        # whose sockets are nonblocking underneath: they wait on their hub, by the socket's
        # own timeout, which stays set.
        if _KERNEL_TIMEOUTS and not green.patched():
            whole = int(timeout)
            limit = struct.pack("@ll", whole, int((timeout - whole) * 1_000_000))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
            self.sock.settimeout(None)
        self.buf = bytearray()
        self.session: Any = None
        self.idle_since = -math.inf  # when it was last taken from the pool (monotonic)
        self._poll: Any = None
        if hasattr(select, "poll"):  # (not under eventlet, which removes it: select())
            self._poll = select.poll()
            self._poll.register(self.sock, select.POLLIN)

    def stale(self) -> bool:
        """True if the server closed this idle connection (it never speaks unasked)."""
        try:
            if self._poll is None:
                return bool(select.select([self.sock], [], [], 0)[0])
            return bool(self._poll.poll(0))
        except (OSError, ValueError):
            return True

    def _recv(self, size: int) -> bytes:
        try:
            chunk = self.sock.recv(size)
        except BlockingIOError:  # SO_RCVTIMEO expired
            raise TimeoutError(f"memcached did not answer within {self.timeout}s") from None
        if not chunk:
            raise ConnectionResetError("memcached closed the connection")
        return chunk

    def trip(self, commands: bytes, count: int, probe: bool) -> list[Reply | None]:
        """Send ``commands`` in one write and read ``count`` replies: one round trip."""
        if self.buf:  # replies never read: they would be taken for this request's
            raise ProtocolError(f"{len(self.buf)} unread bytes before a request")
        try:
            self.sock.sendall(commands)
        except BlockingIOError:  # SO_SNDTIMEO expired
            raise TimeoutError(f"memcached did not take a command within {self.timeout}s") from None
        try:
            chunk = self.sock.recv(_FIRST_READ)
        except BlockingIOError:  # SO_RCVTIMEO expired
            raise TimeoutError(f"memcached did not answer within {self.timeout}s") from None
        if not chunk:
            raise ConnectionResetError("memcached closed the connection")
        if chunk[:2] == b"HD" and chunk.find(b"\r\n") == len(chunk) - 2:  # one whole HD line
            if count == 1:
                return [(chunk[:-2], None)]
            if probe and count == 2:  # the probe missed silently
                return [None, (chunk[:-2], None)]
        self.buf += chunk
        got = started(self.reply(), probe)
        while len(got) < count:
            got.append(self.reply())
        return got

    def reply(self) -> Reply:
        while (reply := take(self.buf)) is None:
            self.buf += self._recv(65536)
        return reply

    def answer(self, request: Any) -> list[Reply | None]:
        return self.trip(request[1], request[2], request[3])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class Server:
    """The idle connections to one server (see "Pool" in the module docstring)."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.idle: list[Connection] = []

    def checkout(self, store: Any, node: int) -> Connection:
        """An idle connection the server has not closed, or a new one (greeted)."""
        now = time.monotonic()
        while True:
            try:
                conn = self.idle.pop()
            except IndexError:
                break
            if now - conn.idle_since < _FRESH or not conn.stale():
                conn.idle_since = now  # a little early: the safe side for the no-poll window
                return conn
            conn.close()  # the server restarted or dropped it: a fresh socket, not an error
        conn = Connection(self.host, self.port, self.timeout)
        try:
            conn.session = drive(store.greet(node), conn.answer)
        except BaseException:
            conn.close()
            raise
        conn.idle_since = now
        return conn

    def forget(self) -> None:
        """In a forked child: drop the parent's connections (closing the child's copies of
        their descriptors leaves the parent's sockets open and undisturbed)."""
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.close()


class MemcachedDriver(Driver):
    errors = (OSError, ProtocolError)

    def __init__(self, backend: BackendBase, store: Any) -> None:
        super().__init__(backend, store)
        self.servers = [Server(host, port, backend.timeout) for host, port in store.servers]
        after_fork(self)

    def forget_after_fork(self) -> None:
        for server in self.servers:
            server.forget()

    def answer(self, request: Any) -> Any:  # pragma: no cover - run() answers with its own
        raise NotImplementedError

    def run(self, steps: Steps[T], action: str) -> T:
        """Run a primitive: :func:`~latchkey.stores.io.drive` written out, each request
        answered on the primitive's connection to its server. (A closure called per request,
        and a dict of connections, cost 5,000 instructions a primitive, callgrind: 10 % of an
        uncontended acquire + release.)"""
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
                        new = more.pop(to, None) or self.servers[to].checkout(self.store, to)
                        if conn is not None:
                            more[node] = conn
                        conn, node = new, to
                    if request.__class__ is int or (
                        request[4] is not None and request[4] != conn.session
                    ):
                        value, error = conn.session, None
                    else:
                        value, error = conn.trip(request[1], request[2], request[3]), None
                except BaseException as exc:  # thrown into the store's generator
                    value, error = None, exc
        except BaseException as exc:
            for each in (conn, *more.values()):
                if each is not None:
                    each.close()  # its stream may be mid-reply
            if isinstance(exc, self.errors) and not isinstance(exc, StoreUnavailable):
                self.backend.unavailable(exc, action)
            raise
        if conn is not None:
            self.servers[node].idle.append(conn)
        for other, each in more.items():
            self.servers[other].idle.append(each)
        return result

    def close(self) -> None:
        for server in self.servers:
            idle, server.idle = server.idle, []
            for conn in idle:
                conn.close()
