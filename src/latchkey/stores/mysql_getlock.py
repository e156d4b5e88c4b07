"""``mysql+getlock://user:pass@host:3306/database``: MySQL/MariaDB user-level locks (GET_LOCK).

A lock is ``GET_LOCK(key, 0)`` on one dedicated connection per backend. It lives exactly as
long as that session: no TTL, no fencing tokens, released by the server when the connection
ends (crash, network loss, server restart). When our connection fails, every lock it held is
reported lost (``extend`` returns None so the core raises LockLost, ``release`` returns False)
and never silently re-taken on the next connection.

Lock keys are server-wide (not per database), at most 64 characters on MySQL, compared
case-insensitively, and cut at a NUL byte. So the key is ``prefix + name`` only when the name
is plain (lowercase ASCII letters, digits and ``_ : . - /``) and short enough; any other name
gets a readable stem, ``~`` and 96 bits of SHA-256 of its UTF-8 bytes, e.g.
``latchkey:report_2024_~3f9c…``. ``~`` never appears in a plain key, so a plain key and a
hashed one never meet.

GET_LOCK is re-entrant per session, and every thread of a process shares the session, so the
backend keeps a local map ``key -> (owner, owner_info)``: one owner can neither take nor
release another owner's lock through the shared session.

A blocked acquire waits in the server: its waiter runs ``GET_LOCK(key, t)`` on a connection
of its own and hands the lock straight back, only to learn the moment it was released (push).

Not offered: semaphores (``inspect`` could not enumerate slot keys without knowing the
limit), listing and purging (the server exposes lock keys, not names, and only through
optional instrumentation), versioned records.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar, NoReturn

import pymysql

from latchkey._owner import Owner
from latchkey._types import Busy, Grant, Holder, LockInfo
from latchkey._url import Option, StoreURL, key_prefix
from latchkey.errors import Unsupported
from latchkey.stores.base import Backend, Capabilities, Waiter
from latchkey.stores.mysql import DRIVER_ERRORS, connect_args, server_hung_up, utc

#: What a granted (or still held) lock is: no token, no expiry. Immutable, so shared.
HELD = Grant(None, None)
#: MySQL's limit on a user-level lock name (MariaDB accepts longer ones).
MAX_KEY = 64
PREFIX_MAX = 24
_PLAIN = re.compile(r"^[a-z0-9_:./-]+$")
_UNREADABLE = re.compile(r"[^a-z0-9_:./-]")
HASH_HEX = 24  # 96 bits of SHA-256

# The hot statements answer in their row count (an OK packet), not in a result set: PyMySQL
# parses a result set (column descriptors, rows) in Python, which cost more than the server's
# work on these calls (~12 µs a call here). SELECT … INTO a session variable returns no rows,
# and its row count is 1 if the WHERE held, else 0.
#
# Tries the lock without waiting. In: key. Row count 1: taken. 0: busy, or GET_LOCK returned
# NULL (session killed, out of memory); @latchkey_got keeps its answer for HOLDER_OF, on our
# own session. GET_LOCK is evaluated once (a second evaluation would count a re-entry).
TRY_LOCK = "SELECT 1 INTO @latchkey_row FROM DUAL WHERE (@latchkey_got := GET_LOCK(%s, 0)) = 1"
# After a TRY_LOCK that took nothing: GET_LOCK's answer (0 busy, NULL failed) and the holding
# connection's id (NULL if released in between). In: key. A process-list look-up here would
# cost more than the lock itself, so only inspect() names the holder's client host. Short
# column aliases here and below: a column's name is otherwise its expression's text.
HOLDER_OF = "SELECT @latchkey_got AS g, IS_USED_LOCK(%s) AS r"
# Ends the lock if this session holds it. In: key. Row count 1: released; 0: not ours (held by
# another session, or no such lock).
RELEASE_LOCK = "SELECT 1 INTO @latchkey_row FROM DUAL WHERE RELEASE_LOCK(%s) = 1"
# Whether this very session (not a reconnected one) still holds the key. In: key. Row count
# 1: it does.
HOLDS = "SELECT 1 INTO @latchkey_row FROM DUAL WHERE IS_USED_LOCK(%s) = CONNECTION_ID()"
# Who holds a key: the connection id (NULL: free), whether it is us, its client host.
# In: key, key, key.
INSPECT = """
SELECT IS_USED_LOCK(%s), IS_USED_LOCK(%s) = CONNECTION_ID(),
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
# A waiter's wake-up, on its own connection. In: key, seconds, key. Blocks server-side until
# the key is free (or the time is up), then gives it straight back in the same row: the
# waiter never keeps it, it only learns the moment it was released. Out: 1 woken, 0 timed out.
WAIT_FREE = "SELECT GET_LOCK(%s, %s), RELEASE_LOCK(%s)"


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


class GetLockBackend(Backend):
    """Session-tied GET_LOCK locks; see the module docstring for what it can't do."""

    scheme = "mysql+getlock"
    capabilities = Capabilities(
        ttl=False,
        fencing=False,
        durable=False,
        listing=False,
        push=True,
        semaphores=False,
        claims=True,
        records=False,
        force_release=True,
        session_tied=True,
    )
    options: ClassVar[Mapping[str, Option]] = {
        "prefix": Option(
            getlock_prefix, "latchkey:", "prepended to each lock key (keys are server-wide)"
        ),
    }

    def __init__(self, url: StoreURL) -> None:
        super().__init__(url)
        self.prefix: str = self.config["prefix"]
        self._connect_args = connect_args(self)
        self._conn: Any = None
        self._cur: Any = None  # the session's one cursor, reused by every call
        self._pid = 0
        self._mutex = threading.Lock()
        # key -> (owner token, owner_info): the locks this process holds through _conn.
        self._held: dict[str, tuple[str, str]] = {}

    def key(self, name: str) -> str:
        return lock_key(name, self.prefix)

    # -- connection ----------------------------------------------------------------------------

    def _session(self) -> None:
        """Make sure the session is open (call under the mutex). A new one after a failure or
        a fork starts with no locks: those of the old session died with it (or belong to the
        parent). No round trip: a session the server ended shows as input on the idle socket."""
        if self._conn is not None and self._pid == os.getpid():
            if not server_hung_up(self._conn):
                return
            self._lose_session()  # the server ended our session: its locks are gone
        self._conn, self._cur, self._held = None, None, {}  # after fork: the parent's
        self._conn = pymysql.connect(**self._connect_args)
        self._cur = self._conn.cursor()
        self._pid = os.getpid()

    def _query(self, sql: str, params: Any = None) -> Sequence[tuple[Any, ...]]:
        """Run one single-statement query on the session (under the mutex, after _session()
        or a true _mine() in the same hold); return its rows."""
        self._cur.execute(sql, params)
        rows: Sequence[tuple[Any, ...]] = self._cur.fetchall()
        return rows

    def _count(self, sql: str, params: Any = None) -> int:
        """Like _query, for the statements that answer in their row count."""
        count: int = self._cur.execute(sql, params)
        return count

    def _lose_session(self) -> None:
        """Close a failed session: the server ends its locks, so they are lost to us."""
        conn, self._conn, self._cur, self._held = self._conn, None, None, {}
        if conn is not None and self._pid == os.getpid():
            with contextlib.suppress(*DRIVER_ERRORS):
                conn.close()

    def _failed(self, exc: BaseException, action: str) -> NoReturn:
        self._lose_session()
        self.unavailable(exc, action)

    def _mine(self, key: str, owner: str) -> bool:
        """True if ``owner`` took ``key`` through the current, still open session (under the
        mutex). No round trip: a session the server ended shows as input on the idle socket."""
        if self._conn is None or self._pid != os.getpid() or server_hung_up(self._conn):
            self._lose_session()
            return False
        entry = self._held.get(key)
        return entry is not None and entry[0] == owner

    # -- leases --------------------------------------------------------------------------------

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        if limit != 1:
            raise Unsupported(f"the {self.scheme} store does not support semaphores")
        key = self.key(name)
        with self._mutex:
            try:
                self._session()
                if key in self._held:  # ours already, for another owner: re-entry would succeed
                    return Busy(1, Holder(None, Owner.from_json(self._held[key][1]), None, None))
                if self._count(TRY_LOCK, (key,)) == 1:
                    self._held[key] = (owner, owner_info)
                    return HELD
                got, holder_id = self._query(HOLDER_OF, (key,))[0]
                if got is None:
                    self._failed(RuntimeError("GET_LOCK returned NULL"), f"acquire {name!r}")
            except DRIVER_ERRORS as exc:
                self._failed(exc, f"acquire {name!r}")
        if holder_id is None:
            return Busy(0)  # released between our attempt and the look-up: retry at once
        return Busy(1, _other_holder(holder_id, None))

    def release(self, name: str, owner: str) -> bool:
        key = self.key(name)
        with self._mutex:
            entry = self._held.get(key)
            if entry is None or entry[0] != owner:
                return False
            if self._conn is None or self._pid != os.getpid():
                self._lose_session()  # a fork's copy of the parent's session: not ours
                return False
            # No liveness check first: on a session the server ended, RELEASE_LOCK fails and
            # the answer is the same, False (its locks ended with it).
            try:
                released = self._count(RELEASE_LOCK, (key,))
            except DRIVER_ERRORS:
                self._lose_session()  # the session is gone, and the lock with it
                return False
            del self._held[key]
            return released == 1

    def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        """No TTL to move: checks that our session is alive and still holds the lock.

        If the check fails, the session is closed and every lock in it is lost. Then, if the
        server answers a new connection, the lock was lost (killed session, restart): None,
        so the holder sees LockLost; if it does not, StoreUnavailable (an outage), and the
        next extend returns None."""
        key = self.key(name)
        with self._mutex:
            entry = self._held.get(key)
            if entry is None or entry[0] != owner:
                return None
            if not self._mine(key, owner):  # the session ended while idle
                self._reachable(f"check the lock {name!r}")
                return None
            try:
                holds = self._count(HOLDS, (key,))
            except DRIVER_ERRORS:
                self._lose_session()
                self._reachable(f"check the lock {name!r}")
                return None
            if holds != 1:  # the session lives on but no longer holds it
                del self._held[key]
                return None
        return HELD

    def _reachable(self, action: str) -> None:
        """Our session died: raise StoreUnavailable if the server cannot be reached either
        (an outage); return if it can (the lock is lost: killed session, or a restart)."""
        try:
            self._session()
        except DRIVER_ERRORS as exc:
            self._failed(exc, action)

    def inspect(self, name: str) -> LockInfo | None:
        key = self.key(name)
        with self._mutex:
            try:
                self._session()
                holder_id, ours, host = self._query(INSPECT, (key, key, key))[0]
            except DRIVER_ERRORS as exc:
                self._failed(exc, f"inspect {name!r}")
            if holder_id is None:
                return None
            if ours == 1 and key in self._held:
                holder = Holder(None, Owner.from_json(self._held[key][1]), None, None)
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
        with self._mutex:
            try:
                self._session()  # a session found ended takes its locks (and _held) with it
                if key in self._held:
                    del self._held[key]
                    return self._count(RELEASE_LOCK, (key,)) == 1
                holder_id, ours, _ = self._query(INSPECT, (key, key, key))[0]
                if holder_id is None or ours == 1:
                    return False
                self._query(KILL, (int(holder_id),))
            except pymysql.err.OperationalError as exc:
                if exc.args[0] == UNKNOWN_THREAD:
                    return False  # it ended on its own in between
                self._failed(exc, f"force-release {name!r}")
            except DRIVER_ERRORS as exc:
                self._failed(exc, f"force-release {name!r}")
        return True

    def purge_expired(self) -> int:
        return 0  # nothing expires: locks end with their session

    # -- batch claims --------------------------------------------------------------------------

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        with self._mutex:
            try:
                self._session()
                candidates: dict[str, str] = {}
                for name in names:
                    key = self.key(name)
                    if key not in self._held and key not in candidates:
                        candidates[key] = name
                if not candidates:
                    return {}
                keys = list(candidates)
                calls = ", ".join([CLAIM_CALL] * len(keys))
                row = self._query(CLAIM.format(calls=calls), keys)[0]
            except DRIVER_ERRORS as exc:
                self._failed(exc, f"claim {len(names)} names")
            if any(got is None for got in row):  # an error inside the batch: give all back
                self._failed(RuntimeError("GET_LOCK returned NULL"), f"claim {len(names)} names")
            taken = {candidates[key] for key, got in zip(keys, row, strict=True) if int(got) == 1}
            for name in taken:
                self._held[self.key(name)] = (owner, owner_info)
        return {name: HELD for name in names if name in taken}

    def release_many(self, names: Sequence[str], owner: str) -> int:
        with self._mutex:
            keys = [k for k in dict.fromkeys(self.key(n) for n in names) if self._mine(k, owner)]
            if not keys:
                return 0
            calls = ", ".join([RELEASE_CALL] * len(keys))
            try:
                row = self._query(RELEASE_MANY.format(calls=calls), keys)[0]
            except DRIVER_ERRORS:
                self._lose_session()
                return 0
            for key in keys:
                del self._held[key]
            return sum(1 for released in row if released == 1)

    # -- waiting, health, lifecycle ------------------------------------------------------------

    def subscribe(self, name: str) -> Waiter:
        """A waiter that blocks in the server (GET_LOCK with a timeout, on a connection of its
        own) until the holder releases, so a blocked acquire wakes at once, not at a poll."""
        return _FreeWaiter(self, self.key(name))

    def now(self) -> datetime:
        with self._mutex:
            try:
                self._session()
                return utc(self._query(NOW)[0][0])
            except DRIVER_ERRORS as exc:
                self._failed(exc, "read the clock")

    def init(self) -> None:
        with self._mutex:
            try:
                self._session()
            except DRIVER_ERRORS as exc:
                self._failed(exc, "connect")

    def close(self) -> None:
        """Closing the session ends every lock it holds."""
        with self._mutex:
            self._lose_session()


UNKNOWN_THREAD = 1094  # KILL of a connection that no longer exists


class _FreeWaiter(Waiter):
    """Wakes when a key is released: GET_LOCK(key, t) then RELEASE_LOCK on its own connection,
    opened on the first wait (only contended acquires pay for it) and closed with the wait."""

    def __init__(self, backend: GetLockBackend, key: str) -> None:
        self.backend = backend
        self.key = key
        self._conn: Any = None

    def wait(self, timeout: float) -> bool:
        started = time.monotonic()
        # A server-side wait never outlasts the connection's read timeout (one second more).
        seconds = max(0.0, min(timeout, self.backend.timeout))
        try:
            if self._conn is None:
                args = dict(self.backend._connect_args)
                args["read_timeout"] = self.backend.timeout + 1.0
                self._conn = pymysql.connect(**args)
            with self._conn.cursor() as cur:
                cur.execute(WAIT_FREE, (self.key, seconds, self.key))
                row = cur.fetchone()
        except DRIVER_ERRORS:
            self.close()  # a wake-up hint only: the next acquire reports the failure
            row = None
        if row is not None and row[0] == 1:
            return True
        # Timed out, or the server rounds timeouts to whole seconds (MySQL): sleep the rest.
        time.sleep(max(0.0, timeout - (time.monotonic() - started)))
        return False

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(*DRIVER_ERRORS):
                conn.close()


def _other_holder(connection_id: Any, host: Any) -> Holder:
    """Another session's lock: all the server tells is its connection id and client host."""
    client = str(host.decode() if isinstance(host, bytes) else host or "")
    owner = Owner(host=client.rsplit(":", 1)[0], metadata={"connection_id": int(connection_id)})
    return Holder(None, owner, None, None)
