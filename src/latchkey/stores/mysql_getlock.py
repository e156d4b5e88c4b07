"""``mysql+getlock://user:pass@host:3306/database``: MySQL/MariaDB user-level locks (GET_LOCK).

A lock lives exactly as long as the session that took it: no TTL, no fencing tokens, released
by the server when the connection ends (crash, network loss, server restart). When one of our
sessions fails, every lock it held is reported lost (``extend`` returns None so the core raises
LockLost, ``release`` returns False) and never silently re-taken on another connection; the
locks of our other sessions stay.

Sessions. A lock that is free is taken with ``GET_LOCK(key, 0)`` on the backend's main
session, which also runs the other quick statements (claims, inspect, the clock). A blocked
acquire waits in the server: ``GET_LOCK(key, t)`` on an extra session that holds no lock,
taken from a small pool (opened when first needed; at most ``MAX_IDLE`` kept idle). The server
grants the lock to that session the moment the holder releases, and that session keeps it: a
hand-off is the server's own wake-up, with no second statement. The session goes back to the
pool when the lock is released. A session that holds a lock never waits, so a release never
queues behind a wait.

Lock keys are server-wide (not per database), at most 64 characters on MySQL, compared
case-insensitively, and cut at a NUL byte. So the key is ``prefix + name`` only when the name
is plain (lowercase ASCII letters, digits and ``_ : . - /``) and short enough; any other name
gets a readable stem, ``~`` and 96 bits of SHA-256 of its UTF-8 bytes, e.g.
``latchkey:report_2024_~3f9c…``. ``~`` never appears in a plain key, so a plain key and a
hashed one never meet.

GET_LOCK is re-entrant per session, and every thread of a process shares the main session, so
the backend keeps a local map ``key -> (owner, owner_info, session)``: one owner can neither
take nor release another owner's lock. A second owner in the same process that waits for the
name waits in the server, like any other client.

Not offered: semaphores (``inspect`` could not enumerate slot keys without knowing the
limit), listing and purging (the server exposes lock keys, not names, and only through
optional instrumentation), versioned records.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import re
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar, NoReturn

import pymysql

from latchkey._owner import Owner
from latchkey._types import Busy, Grant, Holder, LockInfo
from latchkey._url import Option, StoreURL, key_prefix
from latchkey.errors import Unsupported
from latchkey.stores.base import SESSION_LOCKS, Backend
from latchkey.stores.mysql import DRIVER_ERRORS, connect_args, server_hung_up, utc

#: What a granted (or still held) lock is: no token, no expiry. Immutable, so shared.
HELD = Grant(None, None)
#: MySQL's limit on a user-level lock name (MariaDB accepts longer ones).
MAX_KEY = 64
PREFIX_MAX = 24
_PLAIN = re.compile(r"^[a-z0-9_:./-]+$")
_UNREADABLE = re.compile(r"[^a-z0-9_:./-]")
HASH_HEX = 24  # 96 bits of SHA-256
#: The longest one blocked GET_LOCK waits; the core calls again with what is left. For the
#: call, the session's read timeout is this wait plus the store's ``timeout``: a long wait is
#: not taken for a hung server, and a hung server is still noticed.
MAX_WAIT = 30.0
#: Idle extra sessions kept for the next blocked acquire; the others are closed.
MAX_IDLE = 2

# The hot statements answer in their row count (an OK packet), not in a result set: PyMySQL
# parses a result set (column descriptors, rows) in Python, which cost more than the server's
# work on these calls (~12 µs a call here). SELECT … INTO a session variable returns no rows,
# and its row count is 1 if the WHERE held, else 0.
#
# Tries the lock without waiting, on the main session. In: key. Row count 1: taken. 0: busy,
# or GET_LOCK returned NULL (session killed, out of memory); @latchkey_got keeps its answer
# for HOLDER_OF. GET_LOCK is evaluated once (a second evaluation would count a re-entry).
TRY_LOCK = "SELECT 1 INTO @latchkey_row FROM DUAL WHERE (@latchkey_got := GET_LOCK(%s, 0)) = 1"
# A blocked acquire, on an extra session that holds no lock. In: key, seconds. Waits in the
# server until the key is free, then takes it for this session (row count 1), or until the
# seconds pass (0). @latchkey_got keeps GET_LOCK's answer for HOLDER_OF: 0 timed out, NULL
# failed (KILL QUERY). A session holding nothing cannot be part of a deadlock.
WAIT_LOCK = "SELECT 1 INTO @latchkey_row FROM DUAL WHERE (@latchkey_got := GET_LOCK(%s, %s)) = 1"
# After a TRY_LOCK or WAIT_LOCK that took nothing, on the same session: GET_LOCK's answer
# (0 busy, NULL failed) and the holding connection's id (NULL if released in between). In:
# key. A process-list look-up here would cost more than the lock itself, so only inspect()
# names the holder's client host. Short column aliases here and below: a column's name is
# otherwise its expression's text.
HOLDER_OF = "SELECT @latchkey_got AS g, IS_USED_LOCK(%s) AS r"
# Ends the lock if this session holds it. In: key. Row count 1: released; 0: not ours (held by
# another session, or no such lock).
RELEASE_LOCK = "SELECT 1 INTO @latchkey_row FROM DUAL WHERE RELEASE_LOCK(%s) = 1"
# Whether this very session (not a reconnected one) still holds the key. In: key. Row count
# 1: it does.
HOLDS = "SELECT 1 INTO @latchkey_row FROM DUAL WHERE IS_USED_LOCK(%s) = CONNECTION_ID()"
# Who holds a key: the connection id (NULL: free; compared with our sessions' ids) and its
# client host. In: key, key.
INSPECT = """
SELECT IS_USED_LOCK(%s),
       (SELECT HOST FROM information_schema.PROCESSLIST WHERE ID = IS_USED_LOCK(%s))"""
# Ends another session (and so every lock it holds): the only way to take its lock. In: id.
KILL = "KILL CONNECTION %s"
# Batch claim: {calls} is one "GET_LOCK(%s, 0)" per key, each evaluated once, in one row.
CLAIM = "SELECT {calls}"
CLAIM_CALL = "GET_LOCK(%s, 0)"
# Batch release: {calls} is one "RELEASE_LOCK(%s)" per key.
RELEASE_MANY = "SELECT {calls}"
RELEASE_CALL = "RELEASE_LOCK(%s)"
NOW = "SELECT UTC_TIMESTAMP(6)"


def getlock_prefix(text: str) -> str:
    """A key prefix short enough to leave room for the name within 64 characters."""
    key_prefix(text)
    if len(text) > PREFIX_MAX:
        raise ValueError(f"at most {PREFIX_MAX} characters (lock keys are ≤ 64 characters)")
    return text


@functools.lru_cache(maxsize=1024)  # a name's key is computed at each acquire and release
def lock_key(name: str, prefix: str = "latchkey:") -> str:
    """The GET_LOCK key of ``name``: ``prefix + name`` if plain and short, else hashed."""
    room = MAX_KEY - len(prefix)
    if _PLAIN.match(name) and len(name) <= room:
        return prefix + name
    digest = hashlib.sha256(name.encode()).hexdigest()[:HASH_HEX]
    stem = _UNREADABLE.sub("_", name.lower())[: room - HASH_HEX - 1]
    return f"{prefix}{stem}~{digest}"


def wait_seconds(timeout: float | None, fractions: bool) -> float:
    """How long one blocked GET_LOCK may wait, given the seconds left (None: no limit).

    At most MAX_WAIT. MariaDB (≥ 10.1.2) honours fractions of a second; MySQL rounds the wait
    to the nearest whole second, so there it is rounded down here: a wait never ends after the
    caller's deadline. With less than a second left, MySQL's GET_LOCK only tries, and the core
    tries again after a short backoff until the deadline.
    """
    seconds = MAX_WAIT if timeout is None else min(max(timeout, 0.0), MAX_WAIT)
    return seconds if fractions else float(math.floor(seconds))


class _Session:
    """One connection and its one cursor, reused by every call on it."""

    __slots__ = ("conn", "cur", "fractions", "id")

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.cur = conn.cursor()
        self.id: int = conn.thread_id()  # CONNECTION_ID(), from the handshake
        self.fractions = "mariadb" in conn.get_server_info().lower()

    def close(self) -> None:
        with contextlib.suppress(*DRIVER_ERRORS):
            self.conn.close()

    def interrupt(self) -> None:
        """End a wait another thread is in: its read fails at once (it then closes us)."""
        sock = getattr(self.conn, "_sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class GetLockBackend(Backend):
    """Session-tied GET_LOCK locks; see the module docstring for what it can't do."""

    scheme = "mysql+getlock"
    capabilities = SESSION_LOCKS
    options: ClassVar[Mapping[str, Option]] = {
        "prefix": Option(
            getlock_prefix, "latchkey:", "prepended to each lock key (keys are server-wide)"
        ),
    }

    def __init__(self, url: StoreURL) -> None:
        super().__init__(url)
        self.prefix: str = self.config["prefix"]
        self._connect_args = connect_args(self)
        # Everything below is guarded by the mutex, and belongs to the process in _pid.
        self._mutex = threading.Lock()
        self._pid = os.getpid()
        self._main: _Session | None = None
        self._idle: list[_Session] = []  # extra sessions holding nothing, for the next wait
        self._waiting: set[_Session] = set()  # extra sessions in a wait (used without the mutex)
        # key -> (owner token, owner_info, the session holding it): this process's locks.
        self._held: dict[str, tuple[str, str, _Session]] = {}

    def key(self, name: str) -> str:
        return lock_key(name, self.prefix)

    # -- sessions ------------------------------------------------------------------------------

    def _session(self) -> _Session:
        """The main session, open (call under the mutex). A new one after a failure or a fork
        starts with no locks: those of the old one died with it (or belong to the parent). No
        round trip: a session the server ended shows as input on the idle socket."""
        main = self._main
        if main is not None and self._pid == os.getpid():
            if not server_hung_up(main.conn):
                return main
            self._lose(main)  # the server ended it: its locks are gone
        if self._pid != os.getpid():
            self._forget()
        main = self._main = _Session(pymysql.connect(**self._connect_args))
        return main

    def _forget(self) -> None:
        """In a forked child: drop the parent's sessions and locks, unclosed (closing would
        end the parent's sessions)."""
        self._main, self._idle, self._waiting, self._held = None, [], set(), {}
        self._pid = os.getpid()

    def _lose(self, session: _Session) -> None:
        """Close a failed session (under the mutex): the server ends its locks, so they are
        lost to us. The other sessions' locks stay."""
        self._held = {key: entry for key, entry in self._held.items() if entry[2] is not session}
        if session is self._main:
            self._main = None
        if self._pid == os.getpid():
            session.close()

    def _failed(self, exc: BaseException, action: str) -> NoReturn:
        """The main session failed: lose it and raise StoreUnavailable."""
        if self._main is not None:
            self._lose(self._main)
        self.unavailable(exc, action)

    def _reachable(self, action: str) -> None:
        """One of our sessions died: raise StoreUnavailable if the server cannot be reached
        either (an outage); return if it can (the lock is lost: killed session, restart)."""
        try:
            self._session()
        except DRIVER_ERRORS as exc:
            self._failed(exc, action)

    def _checkout(self, action: str) -> _Session:
        """An extra session holding no lock, for one blocked acquire: an idle one the server
        has not ended (a killed one is never reused), else a new one."""
        with self._mutex:
            if self._pid != os.getpid():
                self._forget()
            while self._idle:
                session = self._idle.pop()
                if not server_hung_up(session.conn):
                    self._waiting.add(session)
                    return session
                session.close()
        try:
            session = _Session(pymysql.connect(**self._connect_args))
        except DRIVER_ERRORS as exc:
            self.unavailable(exc, action)
        with self._mutex:
            self._waiting.add(session)
        return session

    def _rest(self, session: _Session) -> None:
        """An extra session that holds nothing any more (under the mutex): kept for the next
        wait, or closed if enough are idle."""
        self._waiting.discard(session)
        if len(self._idle) < MAX_IDLE:
            self._idle.append(session)
        else:
            session.close()

    def _discard(self, session: _Session) -> None:
        """Close an extra session whose wait failed or was interrupted: the server frees
        whatever it had taken."""
        with self._mutex:
            self._waiting.discard(session)
            session.close()

    @staticmethod
    def _rows(session: _Session, sql: str, params: Any = None) -> Sequence[tuple[Any, ...]]:
        """Run one single-statement query on an open session (under the mutex); its rows."""
        session.cur.execute(sql, params)
        rows: Sequence[tuple[Any, ...]] = session.cur.fetchall()
        return rows

    # -- leases --------------------------------------------------------------------------------

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        if limit != 1:
            raise Unsupported(f"the {self.scheme} store does not support semaphores")
        key = self.key(name)
        with self._mutex:
            try:
                main = self._session()
                entry = self._held.get(key)
                if entry is not None and entry[0] == owner:  # this owner's own hold, as it is
                    return HELD
                if entry is not None:  # ours already, for another owner (no re-entry)
                    return Busy(1, Holder(None, Owner.from_json(entry[1]), None, None))
                if main.cur.execute(TRY_LOCK, (key,)) == 1:
                    self._held[key] = (owner, owner_info, main)
                    return HELD
                got, holder_id = self._rows(main, HOLDER_OF, (key,))[0]
                if got is None:
                    self._failed(RuntimeError("GET_LOCK returned NULL"), f"acquire {name!r}")
            except DRIVER_ERRORS as exc:
                self._failed(exc, f"acquire {name!r}")
        if holder_id is None:
            return Busy(0)  # released between our attempt and the look-up: retry at once
        return Busy(1, _other_holder(holder_id, None))

    def acquire_blocking(
        self,
        name: str,
        owner: str,
        owner_info: str,
        ttl: float,
        limit: int,
        timeout: float | None,
    ) -> Grant | Busy:
        """``GET_LOCK(key, t)`` on an extra session that holds nothing: the server grants the
        lock to that session when it is free, and the session keeps it until release."""
        if limit != 1:
            raise Unsupported(f"the {self.scheme} store does not support semaphores")
        key = self.key(name)
        action = f"wait for {name!r}"
        session = self._checkout(action)
        seconds = wait_seconds(timeout, session.fractions)
        conn = session.conn
        try:
            conn._read_timeout = self.timeout + seconds  # PyMySQL reads it at each packet
            try:
                taken = session.cur.execute(WAIT_LOCK, (key, seconds))
            finally:
                conn._read_timeout = self.timeout
            if taken == 1:
                with self._mutex:
                    self._waiting.discard(session)
                    stale = self._held.get(key)
                    if stale is not None and stale[2] is not self._main:
                        # Only its session's end frees a key an extra session held, and it
                        # held no other: lose it, nothing else is lost.
                        self._lose(stale[2])
                    self._held[key] = (owner, owner_info, session)
                return HELD
            got, holder_id = self._rows(session, HOLDER_OF, (key,))[0]
        except DRIVER_ERRORS as exc:
            self._discard(session)
            self.unavailable(exc, action)
        except BaseException:
            self._discard(session)  # Ctrl-C: the server frees whatever the wait got
            raise
        if got is None:  # KILL QUERY, out of memory
            self._discard(session)
            self.unavailable(RuntimeError("GET_LOCK returned NULL"), action)
        with self._mutex:
            self._rest(session)
            entry = self._held.get(key)
            if entry is not None:  # held by another owner in this process
                return Busy(1, Holder(None, Owner.from_json(entry[1]), None, None))
        if holder_id is None:
            return Busy(0)  # released just as the wait ended
        return Busy(1, _other_holder(holder_id, None))

    def release(self, name: str, owner: str) -> bool:
        key = self.key(name)
        with self._mutex:
            entry = self._held.get(key)
            if entry is None or entry[0] != owner:
                return False
            if self._pid != os.getpid():
                self._forget()  # a fork's copy of the parent's lock: not ours
                return False
            session = entry[2]
            # No liveness check first: on a session the server ended, RELEASE_LOCK fails and
            # the answer is the same, False (its locks ended with it).
            try:
                released: int = session.cur.execute(RELEASE_LOCK, (key,))
            except DRIVER_ERRORS:
                self._lose(session)  # the session is gone, and its locks with it
                return False
            del self._held[key]
            if session is not self._main:
                self._rest(session)
            return released == 1

    def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        """No TTL to move: checks that the session holding the lock is alive and still
        holds it.

        If the check fails, that session is closed and every lock in it is lost. Then, if the
        server answers, the lock was lost (killed session, restart): None, so the holder sees
        LockLost; if it does not, StoreUnavailable (an outage), and the next extend returns
        None."""
        key = self.key(name)
        action = f"check the lock {name!r}"
        with self._mutex:
            entry = self._held.get(key)
            if entry is None or entry[0] != owner:
                return None
            session = entry[2]
            # No round trip: a session the server ended shows as input on the idle socket.
            if self._pid != os.getpid() or server_hung_up(session.conn):
                self._lose(session)
                self._reachable(action)
                return None
            try:
                holds = session.cur.execute(HOLDS, (key,))
            except DRIVER_ERRORS:
                self._lose(session)
                self._reachable(action)
                return None
            if holds != 1:  # the session lives on but no longer holds it
                del self._held[key]
                if session is not self._main:
                    self._rest(session)
                return None
        return HELD

    def inspect(self, name: str) -> LockInfo | None:
        key = self.key(name)
        with self._mutex:
            try:
                main = self._session()
                holder_id, host = self._rows(main, INSPECT, (key, key))[0]
            except DRIVER_ERRORS as exc:
                self._failed(exc, f"inspect {name!r}")
            if holder_id is None:
                return None
            entry = self._held.get(key)
            if entry is not None and entry[2].id == int(holder_id):
                holder = Holder(None, Owner.from_json(entry[1]), None, None)
            else:
                holder = _other_holder(holder_id, host)
        return LockInfo(name, (holder,))

    def list(self, prefix: str = "") -> Iterator[LockInfo]:
        raise Unsupported(
            f"the {self.scheme} store cannot list locks: the server shows keys, not names"
        )

    def force_release(self, name: str) -> bool:
        """Release it if this process holds it; otherwise end the connection that does
        (which ends every lock of that session: its holders will see LockLost)."""
        key = self.key(name)
        action = f"force-release {name!r}"
        with self._mutex:
            try:
                main = self._session()  # a session found ended takes its locks with it
            except DRIVER_ERRORS as exc:
                self._failed(exc, action)
            entry = self._held.get(key)
            if entry is not None:  # ours: released on the session holding it
                session = entry[2]
                try:
                    released: int = session.cur.execute(RELEASE_LOCK, (key,))
                except DRIVER_ERRORS:
                    self._lose(session)  # its locks ended with it
                    self._reachable(action)
                    return False
                del self._held[key]
                if session is not self._main:
                    self._rest(session)
                return released == 1
            try:
                holder_id, _ = self._rows(main, INSPECT, (key, key))[0]
                if holder_id is None or int(holder_id) == main.id:
                    return False
                main.cur.execute(KILL, (int(holder_id),))
            except pymysql.err.OperationalError as exc:
                if exc.args[0] == UNKNOWN_THREAD:
                    return False  # it ended on its own in between
                self._failed(exc, action)
            except DRIVER_ERRORS as exc:
                self._failed(exc, action)
        return True

    def purge_expired(self) -> int:
        return 0  # nothing expires: locks end with their session

    # -- batch claims --------------------------------------------------------------------------

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        with self._mutex:
            try:
                main = self._session()
                candidates: dict[str, str] = {}
                for name in names:
                    key = self.key(name)
                    if key not in self._held and key not in candidates:
                        candidates[key] = name
                if not candidates:
                    return {}
                keys = list(candidates)
                calls = ", ".join([CLAIM_CALL] * len(keys))
                row = self._rows(main, CLAIM.format(calls=calls), keys)[0]
            except DRIVER_ERRORS as exc:
                self._failed(exc, f"claim {len(names)} names")
            if any(got is None for got in row):  # an error inside the batch: give all back
                self._failed(RuntimeError("GET_LOCK returned NULL"), f"claim {len(names)} names")
            taken = {candidates[key] for key, got in zip(keys, row, strict=True) if int(got) == 1}
            for name in taken:
                self._held[self.key(name)] = (owner, owner_info, main)
        return {name: HELD for name in names if name in taken}

    def release_many(self, names: Sequence[str], owner: str) -> int:
        """One RELEASE_LOCK batch per session holding some of ``names`` (claims are all on
        the main session)."""
        with self._mutex:
            if self._pid != os.getpid():
                self._forget()
                return 0
            by_session: dict[_Session, list[str]] = {}
            for key in dict.fromkeys(self.key(n) for n in names):
                entry = self._held.get(key)
                if entry is not None and entry[0] == owner:
                    by_session.setdefault(entry[2], []).append(key)
            released = 0
            for session, keys in by_session.items():
                if server_hung_up(session.conn):  # ended while idle: its locks are gone
                    self._lose(session)
                    continue
                calls = ", ".join([RELEASE_CALL] * len(keys))
                try:
                    row = self._rows(session, RELEASE_MANY.format(calls=calls), keys)[0]
                except DRIVER_ERRORS:
                    self._lose(session)
                    continue
                for key in keys:
                    del self._held[key]
                if session is not self._main:
                    self._rest(session)
                released += sum(1 for answer in row if answer == 1)
            return released

    # -- health, lifecycle ---------------------------------------------------------------------

    def now(self) -> datetime:
        with self._mutex:
            try:
                return utc(self._rows(self._session(), NOW)[0][0])
            except DRIVER_ERRORS as exc:
                self._failed(exc, "read the clock")

    def init(self) -> None:
        with self._mutex:
            try:
                self._session()
            except DRIVER_ERRORS as exc:
                self._failed(exc, "connect")

    def close(self) -> None:
        """Closing the sessions ends every lock they hold; a wait in progress in another
        thread fails with StoreUnavailable."""
        with self._mutex:
            if self._pid != os.getpid():
                self._forget()
                return
            sessions = {entry[2] for entry in self._held.values()} | set(self._idle)
            if self._main is not None:
                sessions.add(self._main)
            for session in self._waiting:
                session.interrupt()  # its thread closes it
            self._main, self._idle, self._waiting, self._held = None, [], set(), {}
            for session in sessions:
                session.close()


UNKNOWN_THREAD = 1094  # KILL of a connection that no longer exists


def _other_holder(connection_id: Any, host: Any) -> Holder:
    """Another session's lock: all the server tells is its connection id and client host."""
    client = str(host.decode() if isinstance(host, bytes) else host or "")
    owner = Owner(host=client.rsplit(":", 1)[0], metadata={"connection_id": int(connection_id)})
    return Holder(None, owner, None, None)
