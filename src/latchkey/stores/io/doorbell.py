"""Doorbells: a kernel wake-up from a releasing process to the processes waiting for a name, on
one machine, for a store that has no push of its own (SQLite).

A waiter binds a Unix datagram socket in the name's *room*, a directory beside the database
(``<db>.bells/<hash of the name>/``), named after the time it came; a release that ended a
lease lists the room and sends one byte to the socket of the waiter that came first, whose
``wait`` returns at once (a force-release rings them all). One, not all: a thousand waiters
woken by every release would each try the store once per release, a thousand times over. The
one woken takes the lease (or loses it to a newcomer, whose release rings the next), leaves the
room, and its own release rings the next in line. The waiter binds
before the core's second attempt (``wait_in_line``), so a release that lands between an
attempt and the wait is a byte already queued on its socket: no release is missed.

The ringer marks the socket it rang (access time the epoch, modification time the ring's), and
:meth:`Doorbells.first` tells a release who is first, since when, and when it was last rung:
the store's turns are decided from that (``stores/sqlite.py``). A waiter's *ticket* is its
socket's name in the room.

It is only a wake-up: correctness never depends on it. A waiter that is not rung (a lease that
ended by expiry, a process in another container that cannot see the room, a full socket
buffer) still wakes by the core's own backoff, capped by the holder's remaining lease. Stale
sockets (a waiter killed before it could remove its own) refuse the byte and are removed by
the ringer. A room is removed by the last waiter to leave it.

Why by hand: no library does this. ``filelock``/``portalocker`` wait by polling; ``inotify``
needs a dependency or ctypes and wakes on every write to the file; a FIFO has one reader.
Datagrams to sockets in a directory are one ``listdir`` and one ``sendto`` per waiter, and
the case of a release nobody waits for is one ``access`` of an absent room (half a
microsecond).

Sockets need paths shorter than 108 bytes: when ``<db>.bells`` is too long, the rooms live in
the temporary directory instead, under a hash of the database's real path (the same for
every process of the machine that opens that file).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import tempfile
import time
from typing import Any, NamedTuple

from latchkey._types import Busy, Grant
from latchkey.stores.base import AsyncWaiter, Waiter

#: The longest socket path we bind (sun_path is 108 bytes with its NUL, on Linux), and what
#: a room and a socket add to the rooms' directory: "/<16 hex>/<13 hex µs>-<pid>-<8 hex>".
MAX_PATH = 107
SUFFIX = 1 + 16 + 1 + 13 + 1 + 7 + 1 + 8


class Ring(NamedTuple):
    """A request: wake the first waiter of each of these names (``everyone``: all of them),
    after the release has committed; with ``ticket``, that one waiter of the one name only.
    Answered with whether a waiter was rung (with ``ticket``: that one)."""

    names: tuple[str, ...]
    everyone: bool = False
    ticket: str | None = None


class First(NamedTuple):
    """A request: the first waiter in ``name``'s room, as a :class:`InLine`, or None."""

    name: str


class InLine(NamedTuple):
    """The first waiter of a name: its ``ticket`` (its socket's name in the room), seconds
    since it came, and seconds since a release last rang it (None: never)."""

    ticket: str
    waited: float
    rung: float | None


class Listen(NamedTuple):
    """A request: a waiter for ``name`` (a :class:`Bell`), or None where there are no bells."""

    name: str


#: The access time a ringer gives the socket it rang (its modification time is when): a bound
#: socket's access time is when it was bound, never the epoch.
RUNG = 0

#: Room paths a process remembers (the names it released or waited on lately), at most.
ROOMS_KEPT = 4096


class Doorbells:
    """The rooms of one database file, as seen from this process."""

    def __init__(self, db_path: str) -> None:
        real = os.path.realpath(db_path)
        beside = real + ".bells"
        if len(beside) + SUFFIX > MAX_PATH:
            digest = hashlib.blake2b(real.encode(), digest_size=8).hexdigest()
            beside = os.path.join(tempfile.gettempdir(), f"latchkey-bells-{digest}")
        self.dir = beside
        self._sender: socket.socket | None = None
        self._sender_pid = 0
        self._rooms: dict[str, str] = {}  # name -> its room's path: every release rings

    def room(self, name: str) -> str:
        room = self._rooms.get(name)
        if room is None:
            if len(self._rooms) >= ROOMS_KEPT:
                self._rooms.clear()
            digest = hashlib.blake2b(name.encode(), digest_size=8).hexdigest()
            room = self._rooms[name] = os.path.join(self.dir, digest)
        return room

    def ring(
        self, names: tuple[str, ...], everyone: bool = False, ticket: str | None = None
    ) -> bool:
        """Send one byte to the first waiter of each of ``names`` (every waiter, with
        ``everyone``; the waiter ``ticket`` only, with one), and mark it rung (see
        :meth:`first`); never raises, never blocks. Whether any waiter was rung."""
        rang = False
        for name in names:
            room = self.room(name)
            if ticket is not None:
                return self._send(os.path.join(room, ticket))
            if not os.access(room, os.F_OK):
                continue  # nobody waits (the usual case): 0.5 µs, a failed listdir is 1.6
            try:
                entries = os.listdir(room)
            except OSError:
                continue  # the last waiter just left
            for entry in sorted(entries):  # by arrival time
                if self._send(os.path.join(room, entry)):
                    rang = True
                    if not everyone:
                        break
        return rang

    def _send(self, path: str) -> bool:
        """Ring the waiter at ``path``: False if it is gone (a dead one's socket is removed)."""
        try:
            self._socket().sendto(b"!", path)
        except ConnectionRefusedError:  # its process is gone
            with contextlib.suppress(OSError):
                os.unlink(path)
            return False
        except FileNotFoundError:  # it just left
            return False
        except OSError:
            pass  # full: it is rung already
        with contextlib.suppress(OSError):  # another user's socket: rung, unmarked
            os.utime(path, ns=(RUNG, time.time_ns()))
        return True

    def first(self, name: str) -> InLine | None:
        """The waiter that came first to ``name``'s room, or None (nobody waits: one
        ``access``)."""
        room = self.room(name)
        if not os.access(room, os.F_OK):
            return None
        try:
            entry = min(os.listdir(room))
            stat = os.stat(os.path.join(room, entry))
            came = int(entry.split("-", 1)[0], 16) * 1000
        except (OSError, ValueError):
            return None  # it left, or is not a waiter's
        now = time.time_ns()
        rung = (now - stat.st_mtime_ns) / 1e9 if stat.st_atime_ns == RUNG else None
        return InLine(entry, (now - came) / 1e9, rung)

    def listen(self, name: str) -> socket.socket | None:
        """A socket bound in ``name``'s room, or None if no room can be made here."""
        room = self.room(name)
        for _ in range(3):  # the last waiter may remove the room as we enter it
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            came = f"{time.time_ns() // 1000:013x}"
            path = os.path.join(room, f"{came}-{os.getpid()}-{os.urandom(4).hex()}")
            try:
                os.makedirs(room, exist_ok=True)
                sock.bind(path)
                return sock
            except FileNotFoundError:
                sock.close()
            except OSError:
                sock.close()
                return None
        return None

    def _socket(self) -> socket.socket:
        if self._sender is None or self._sender_pid != os.getpid():
            self._sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sender.setblocking(False)
            self._sender_pid = os.getpid()
        return self._sender

    def close(self) -> None:
        if self._sender is not None and self._sender_pid == os.getpid():
            self._sender.close()
        self._sender = None


def leave(sock: socket.socket) -> None:
    """Close a waiter's socket, remove it, and its room if it was the last one there."""
    path = sock.getsockname()
    sock.close()
    if isinstance(path, str) and path:
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))


def _drain(sock: socket.socket) -> None:
    """Read every byte already queued (several releases wake a waiter once). Non-blocking
    first: with a timeout set, Python would wait out the timeout for the next byte."""
    sock.setblocking(False)
    with contextlib.suppress(OSError):
        while sock.recv(64):
            pass


def ticket_of(sock: socket.socket) -> str:
    """A waiter's ticket: its socket's name in the room."""
    path = sock.getsockname()
    return os.path.basename(path) if isinstance(path, str) else ""


class Bell(Waiter):
    """A blocked acquire's doorbell (sync). A waiter that leaves without the lease (its wait
    timed out, or was cancelled) may have been the one rung: it passes the ring on. ``line``:
    where the store keeps this waiter while it waits (a dict and its key, removed at close)."""

    def __init__(self, sock: socket.socket, bells: Doorbells, name: str) -> None:
        self.sock, self.bells, self.name, self.granted = sock, bells, name, False
        self.ticket = ticket_of(sock)
        self.line: tuple[dict[Any, Any], Any] | None = None

    def finish(self, result: Grant | Busy) -> None:
        self.granted = type(result) is Grant

    def wait(self, timeout: float) -> bool:
        self.sock.settimeout(max(timeout, 0.0))
        try:
            self.sock.recv(64)
        except (TimeoutError, BlockingIOError):
            return False
        _drain(self.sock)
        return True

    def close(self) -> None:
        if self.line is not None:
            self.line[0].pop(self.line[1], None)
        leave(self.sock)
        if not self.granted:
            self.bells.ring((self.name,))


class AsyncBell(AsyncWaiter):
    """A blocked acquire's doorbell (asyncio): the loop watches the socket; no thread waits."""

    def __init__(
        self,
        sock: socket.socket,
        bells: Doorbells,
        name: str,
        line: tuple[dict[Any, Any], Any] | None = None,
    ) -> None:
        sock.setblocking(False)
        self.sock, self.bells, self.name, self.granted = sock, bells, name, False
        self.line = line

    async def finish(self, result: Grant | Busy) -> None:
        self.granted = type(result) is Grant

    async def wait(self, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.sock_recv(self.sock, 64), max(timeout, 0.0))
        except asyncio.TimeoutError:
            return False
        _drain(self.sock)
        return True

    async def close(self) -> None:
        if self.line is not None:
            self.line[0].pop(self.line[1], None)
        leave(self.sock)
        if not self.granted:
            self.bells.ring((self.name,))
