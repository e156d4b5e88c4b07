"""The ``postgresql+advisory://`` store: PostgreSQL session-level advisory locks.

A lock is a session-level advisory lock on ``key``, the first 8 bytes of BLAKE2b over
``prefix NUL name`` (UTF-8) read as a signed bigint. It lives exactly as long as the session
(connection) that took it: no TTL, no fencing tokens, gone when that connection dies (crash,
network loss, server restart) — and then every lock that session held is reported lost
(``extend`` returns None, ``release`` False), never silently re-taken.

Sessions. A backend tries locks (``pg_try_advisory_lock``) and runs every quick statement on
its *main* session. A blocked acquire waits inside the server instead
(:meth:`AdvisoryBackend.acquire_blocking`): it takes a *spare* session that holds no lock
(from a small pool, opened on demand) and runs ``pg_advisory_lock`` there under
``lock_timeout``; the server grants it the moment the holder unlocks, and the lock then lives
on that spare until it is released, when the spare goes back to the pool. A session that holds
a lock never waits, so an unlock never queues behind a wait and the server never sees a
deadlock; a spare that dies takes only its own lock with it.

Advisory locks are re-entrant per session, and every thread of a process shares the main
session, so the backend keeps a map ``key -> _Hold`` (owner, session, connection): one owner
can neither take nor release another owner's lock, and every statement about a lock runs on
the session that holds it.

Not offered: semaphores (slots would need keys ``inspect`` cannot enumerate), listing and
purging (``pg_locks`` holds keys, not names), versioned records.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar, NamedTuple, NoReturn

import psycopg

from latchkey._owner import Owner
from latchkey._types import Busy, Grant, Holder, LockInfo
from latchkey._url import Option, StoreURL, key_prefix
from latchkey.errors import Unsupported
from latchkey.stores.base import SESSION_LOCKS, Backend
from latchkey.stores.postgresql import (
    CONNECTION_OPTIONS,
    DRIVER_ERRORS,
    Session,
    connection_params,
    forget_in_forked_child,
    positional,
    utc,
)

#: Idle spare sessions kept open for the next wait; a spare set free beyond these is closed.
IDLE_SPARES = 2
#: One server-side wait lasts at most this share of the session's statement_timeout (the
#: ``timeout`` option), so the server ends it (lock_timeout) well before it would be cancelled
#: as a hung statement; a longer wait is several in a row.
WAIT_SHARE = 0.9

# Rows of pg_locks for one bigint advisory key (classid: high 32 bits, objid: low 32 bits,
# objsubid 1 marks the one-bigint form) in this database, granted, with the holding session.
_HOLDERS = """
    SELECT a.pid, a.application_name, a.client_addr::text, a.backend_start
    FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
      AND l.classid = %(hi)s::bigint::oid AND l.objid = %(lo)s::bigint::oid
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""

# Input: key. Tries the lock without waiting. Result: whether it was taken. (Looking the
# holder up in the same statement cost ~40% of an uncontended acquire even when it was
# skipped, so the busy path asks HOLDER separately.)
TRY_LOCK = "SELECT pg_try_advisory_lock(%(key)s::bigint)"
# Inputs: hi, lo. The session holding the key, for a busy answer.
# Result: (holder pid, application_name, client address) or no row.
HOLDER = f"""
SELECT h.pid, h.application_name, h.client_addr FROM ({_HOLDERS} LIMIT 1) AS h
"""  # only the constant _HOLDERS is spliced in

# Inputs, spliced in by str.format as ints (``:d`` refuses anything else): ms > 0, key.
# Waits in the server up to ms milliseconds, then holds the key on this session; raises
# LockNotAvailable (SQLSTATE 55P03) when lock_timeout passes first. Without parameters
# psycopg sends both statements in one simple-protocol message: one round trip. Run only on
# a session that holds no lock, so it can never re-enter one, and no unlock waits behind it.
WAIT_LOCK = "SET lock_timeout = {ms:d}; SELECT pg_advisory_lock({key:d})"

# Input: key. Unlocks it (only this session's own lock can be unlocked); the server grants
# it to a session waiting in WAIT_LOCK at once. Writes nothing: no transaction id, no WAL.
# Result: whether this session held it.
UNLOCK = "SELECT pg_advisory_unlock(%(key)s::bigint)"

# Inputs: hi, lo. Whether *this* session still holds the key (the session may have been
# terminated and replaced, or the lock force-released). Result: one boolean.
HOLDS = f"""
SELECT EXISTS ({_HOLDERS} AND l.pid = pg_backend_pid())
"""  # only the constant _HOLDERS is spliced in

# Inputs: hi, lo. Who holds the key. Result: (pid, application_name, client address) rows.
INSPECT = _HOLDERS

# Inputs: hi, lo. Ends the session holding the key (other than ours): the only way to take
# an advisory lock from another session. That session loses every lock it held.
# Result: one row per session signalled, true if it was terminated.
TERMINATE = f"""
SELECT pg_terminate_backend(h.pid) FROM ({_HOLDERS} AND l.pid <> pg_backend_pid()) AS h
"""  # only the constant _HOLDERS is spliced in

# Input: keys (bigint[], distinct, none held by this session). Tries each without waiting.
# Result: the 1-based positions of the keys taken.
CLAIM = """
SELECT k.i FROM unnest(%(keys)s::bigint[]) WITH ORDINALITY AS k (key, i)
WHERE pg_try_advisory_lock(k.key)
"""

# Input: keys (bigint[]). Unlocks each. Result: how many this session held.
UNLOCK_MANY = """
SELECT count(*) FROM unnest(%(keys)s::bigint[]) AS k WHERE pg_advisory_unlock(k)
"""

NOW = "SELECT now()"

# The two statements of an uncontended acquire+release, for Session.run_prepared (libpq
# directly: a third of this path's Python time was psycopg's cursor machinery).
TRY_LOCK_PQ = positional(TRY_LOCK.encode())[0]
UNLOCK_PQ = positional(UNLOCK.encode())[0]


def key_values(key: int) -> tuple[bytes]:
    """TRY_LOCK_PQ's and UNLOCK_PQ's one parameter, encoded (text)."""
    return (b"%d" % key,)


def said_yes(result: psycopg.pq.abc.PGresult) -> bool:
    """TRY_LOCK_PQ's or UNLOCK_PQ's text result: whether it locked (unlocked) the key."""
    return result.get_value(0, 0) == b"t"


@functools.lru_cache(maxsize=4096)  # names repeat; hashing is a fifth of the Python time
def advisory_key(name: str, prefix: str = "") -> int:
    """The 64-bit advisory-lock key of ``name``: BLAKE2b-64 of ``prefix NUL name``, signed."""
    digest = hashlib.blake2b(prefix.encode() + b"\x00" + name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def _halves(key: int) -> dict[str, int]:
    """The (classid, objid) pair pg_locks shows for a bigint key."""
    unsigned = key & 0xFFFF_FFFF_FFFF_FFFF
    return {"hi": unsigned >> 32, "lo": unsigned & 0xFFFF_FFFF}


def _owner_from_session(application_name: str | None, client: str | None) -> Owner:
    """Who holds a lock in another session: our sessions name themselves ``latchkey pid@host``."""
    text = application_name or ""
    if text.startswith("latchkey ") and "@" in text:
        pid, _, host = text[len("latchkey ") :].partition("@")
        if pid.isdigit():
            return Owner(host=host, pid=int(pid))
    return Owner(host=client or "", metadata={"application_name": text} if text else {})


_GRANTED = Grant(token=None, expires_at=None)  # every grant: no token, no expiry


def local_holder(owner_info: str) -> Holder:
    """The holder of a lock this backend holds, from its owner's JSON."""
    return Holder(token=None, owner=Owner.from_json(owner_info), acquired_at=None,
                  expires_at=None)  # fmt: skip


def held_here(hold_owner: str, hold_info: str, owner: str) -> Grant | Busy:
    """The answer to an acquire of a key this backend already holds (never asked of the
    server: on the holding session, re-entry would succeed): ``owner``'s own hold back, as
    it is (the same-owner rule of ``Backend.acquire``); anyone else finds it busy."""
    if hold_owner == owner:
        return _GRANTED
    return Busy(holders=1, holder=local_holder(hold_info))


class _Hold(NamedTuple):
    """A lock this process holds, and where: valid while ``session`` is still connection
    number ``generation`` (server process ``pid``)."""

    owner: str
    owner_info: str
    session: Session
    generation: int
    pid: int


class AdvisoryBackend(Backend):
    """Session-level advisory locks; see the module docstring for what it can't do."""

    scheme = "postgresql+advisory"
    capabilities = SESSION_LOCKS
    options: ClassVar[Mapping[str, Option]] = {
        "prefix": Option(key_prefix, "", "hashed with each name: separates applications"),
        **CONNECTION_OPTIONS,
    }

    def __init__(self, url: StoreURL) -> None:
        super().__init__(url)
        self.prefix: str = self.config["prefix"]
        # Sessions name themselves so that other processes' inspect() can say who holds a lock.
        app = f"latchkey {os.getpid()}@{socket.gethostname()}".encode()[:63]
        self._params = connection_params(url, self.config, app.decode("utf-8", "ignore"))
        self._session = Session(self._params)
        self._wait_cap_ms = max(1, int(self.timeout * 1000 * WAIT_SHARE))
        # Makes compound updates of the maps below atomic (one read needs no lock); never
        # held during I/O, and the innermost lock: it is taken under a session's lock.
        self._mutex = threading.Lock()
        self._held: dict[int, _Hold] = {}
        self._spares: dict[Session, int | None] = {}  # every spare -> the key it holds
        self._idle: list[Session] = []  # spares holding nothing, not waiting
        self._waiting: set[Session] = set()  # spares in acquire_blocking
        self._swept = 0  # the main session's generation whose stale holds were dropped
        forget_in_forked_child(self)

    def key(self, name: str) -> int:
        return advisory_key(name, self.prefix)

    # -- bookkeeping (_record, _unrecord: call with _mutex held) -------------------------------

    def _record(self, key: int, hold: _Hold) -> Session | None:
        """Note a lock taken. The server granted it, so an older hold of ``key`` on another
        session is over (being released right now, or its session died): that spare holds
        nothing any more; it is returned for :meth:`_settle`."""
        old = self._held.get(key)
        self._held[key] = hold
        if hold.session is not self._session:
            self._spares[hold.session] = key
        if (
            old is not None
            and old.session is not hold.session
            and (self._spares.get(old.session) == key)
        ):
            self._spares[old.session] = None
            return old.session
        return None

    def _unrecord(self, key: int, hold: _Hold) -> None:
        """Forget ``hold`` if it is still the one recorded: when an unlock lets the server grant
        the key to one of our waiting spares at once, that grant may be recorded first."""
        if self._held.get(key) is hold:
            del self._held[key]
            if self._spares.get(hold.session) == key:
                self._spares[hold.session] = None

    def _sweep(self, session: Session) -> None:
        """Forget the locks ``session`` lost with its connection (closed, or replaced)."""
        with self._mutex:
            stale = [
                (k, h) for k, h in self._held.items()
                if h.session is session
                and (session.conn is None or h.generation != session.generation)
            ]  # fmt: skip
            for key, hold in stale:
                self._unrecord(key, hold)

    # -- sessions ------------------------------------------------------------------------------

    def _main(self) -> psycopg.Connection[Any]:
        """The main session (call under its lock); forgets locks of a previous connection."""
        conn = self._session.connection()
        if self._session.generation != self._swept:
            self._swept = self._session.generation
            self._sweep(self._session)
        return conn

    def _hold(self, key: int, owner: str) -> _Hold | None:
        hold = self._held.get(key)  # one read is atomic; the mutex is for compound updates
        return hold if hold is not None and hold.owner == owner else None

    def _check(self, key: int, hold: _Hold) -> bool:
        """Whether ``hold`` is still recorded and its session still the connection it was
        taken on (call under the session's lock). A connection the server ended is found
        out by the statement sent next: it fails, and :meth:`Session.broken` drops it."""
        if self._held.get(key) is not hold:
            return False
        session = hold.session
        if session.conn is not None and session.generation == hold.generation:
            return True
        self._sweep(session)  # the connection that held them is gone, and its locks with it
        return False

    def _spare(self) -> Session:
        """A spare session holding no lock, for one wait (it connects on first use)."""
        with self._mutex:
            session = self._idle.pop() if self._idle else Session(self._params)
            self._spares[session] = None
            self._waiting.add(session)
        return session

    def _settle(self, session: Session | None) -> None:
        """After a statement on ``session``: a spare that holds nothing any more goes back to
        the pool, or is closed (its connection died, or enough are idle). A waiting spare is
        its waiter's: only the waiter takes it out of ``_waiting``."""
        if session is None or session is self._session:
            return
        with self._mutex:
            if (session not in self._spares or self._spares[session] is not None
                    or session in self._waiting or session in self._idle):  # fmt: skip
                return
            conn = session.conn
            if (conn is not None and not conn.closed and not conn.broken
                    and len(self._idle) < IDLE_SPARES):  # fmt: skip
                self._idle.append(session)
                return
            del self._spares[session]
        session.close()

    def _discard(self, session: Session) -> None:
        """Close a spare for good; a lock it may hold ends with it (the server says so)."""
        with self._mutex:
            key = self._spares.pop(session, None)
            self._waiting.discard(session)
            if key is not None and (hold := self._held.get(key)) and hold.session is session:
                del self._held[key]
            if session in self._idle:
                self._idle.remove(session)
        session.close()

    def _failed(self, exc: BaseException, action: str) -> NoReturn:
        """After a driver error on the main session: if it died, so did every lock it held."""
        if self._session.broken():
            self._sweep(self._session)
        self.unavailable(exc, action)

    def _reachable(self, action: str) -> None:
        """A session died: raise StoreUnavailable if the server cannot be reached either (an
        outage), return if it can (the lock is lost: force-released, or a restart)."""
        with self._session.lock:
            try:
                self._main()
            except DRIVER_ERRORS as exc:
                self._failed(exc, action)

    def _forget_after_fork(self) -> None:
        self._session.forget_after_fork()
        for session in self._spares:
            session.forget_after_fork()
        self._mutex = threading.Lock()
        self._held, self._spares, self._idle, self._waiting = {}, {}, [], set()  # the parent's

    def _busy(self, key: int, found: tuple[Any, ...] | None) -> Busy:
        """A busy answer naming the holder that HOLDER ``found`` (ours if one of our sessions)."""
        if found is None:  # released between our attempt and the look-up
            return Busy(holders=0)
        pid, app, client = found
        with self._mutex:
            hold = self._held.get(key)
        if hold is not None and hold.pid == pid:
            return Busy(holders=1, holder=local_holder(hold.owner_info))
        return Busy(holders=1, holder=Holder(None, _owner_from_session(app, client), None, None))

    # -- leases --------------------------------------------------------------------------------

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        if limit != 1:
            raise Unsupported(f"the {self.scheme} store does not support semaphores")
        key = self.key(name)
        with self._session.lock:
            try:
                conn = self._main()
                local = self._held.get(key)
                if local is not None:  # on the main session, re-entry would succeed
                    return held_here(local.owner, local.owner_info, owner)
                result = self._session.run_prepared(
                    b"latchkey_try_lock", TRY_LOCK_PQ, key_values(key)
                )
                if said_yes(result):
                    hold = _Hold(owner, owner_info, self._session, self._session.generation,
                                 conn.pgconn.backend_pid)  # fmt: skip
                    with self._mutex:
                        self._record(key, hold)
                    return _GRANTED
                found = conn.execute(HOLDER, _halves(key), prepare=True).fetchone()
            except DRIVER_ERRORS as exc:
                self._failed(exc, f"acquire {name!r}")
        return self._busy(key, found)

    def acquire_blocking(
        self,
        name: str,
        owner: str,
        owner_info: str,
        ttl: float,
        limit: int,
        timeout: float | None,
    ) -> Grant | Busy:
        """Wait in the server (``pg_advisory_lock`` under ``lock_timeout``) on a spare session;
        the lock then lives on that spare. One wait lasts at most ``WAIT_SHARE`` of the
        ``timeout`` option (the statement timeout); Busy when it ends without the lock."""
        if limit != 1:
            raise Unsupported(f"the {self.scheme} store does not support semaphores")
        key = self.key(name)
        ms = self._wait_cap_ms
        if timeout is not None:
            ms = max(1, min(ms, math.ceil(timeout * 1000)))  # 0 would mean "no limit"
        session = self._spare()
        granted, stale = False, None
        try:
            with session.lock:
                conn = session.connection()
                # Made before the wait: the hand-off's latency is what runs after the grant.
                hold = _Hold(owner, owner_info, session, session.generation,
                             conn.pgconn.backend_pid)  # fmt: skip
                try:
                    conn.execute(WAIT_LOCK.format(ms=ms, key=key), prepare=False)
                except psycopg.errors.LockNotAvailable:
                    found = conn.execute(HOLDER, _halves(key), prepare=True).fetchone()
                    with self._mutex:
                        self._waiting.discard(session)
                else:
                    with self._mutex:
                        self._waiting.discard(session)
                        stale = self._record(key, hold)
                    granted = True
        except DRIVER_ERRORS as exc:
            self._discard(session)
            self.unavailable(exc, f"wait for {name!r}")
        except BaseException:
            # Interrupted (Ctrl-C): the server may have granted the lock just before the cancel
            # took effect. Closing the session ends it either way; the pool never sees it.
            self._discard(session)
            raise
        if granted:
            if stale is not None:
                self._settle(stale)  # a dead spare whose hold the server's grant proved stale
            return _GRANTED
        self._settle(session)
        return self._busy(key, found)

    def release(self, name: str, owner: str) -> bool:
        key = self.key(name)
        hold = self._held.get(key)  # (inlined _hold: this path is the hand-off's latency)
        if hold is None or hold.owner != owner:
            return False
        session = hold.session
        try:
            with session.lock:
                if not self._check(key, hold):
                    return False
                try:
                    result = session.run_prepared(b"latchkey_unlock", UNLOCK_PQ, key_values(key))
                except DRIVER_ERRORS as exc:
                    if session.broken():  # the session ended: the lock ended with it
                        self._sweep(session)
                        return False
                    self.unavailable(exc, f"release {name!r}")
                with self._mutex:
                    self._unrecord(key, hold)
                return said_yes(result)
        finally:
            self._settle(session)

    def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        """No TTL to move: checks that the holding session is alive and still holds the lock."""
        key = self.key(name)
        hold = self._hold(key, owner)
        if hold is None:
            return None
        session = hold.session
        try:
            with session.lock:
                live = self._check(key, hold)
                if live:
                    conn = session.conn
                    assert conn is not None
                    try:
                        row = conn.execute(HOLDS, _halves(key), prepare=True).fetchone()
                    except DRIVER_ERRORS as exc:
                        if not session.broken():
                            self.unavailable(exc, f"check the lock {name!r}")
                        self._sweep(session)  # the session died under us
                        live = False
                    else:
                        if not (row and row[0]):  # force-released (session terminated)
                            with self._mutex:
                                self._unrecord(key, hold)
                            return None
        finally:
            self._settle(session)
        if not live:
            self._reachable(f"check the lock {name!r}")
            return None
        return _GRANTED

    def inspect(self, name: str) -> LockInfo | None:
        key = self.key(name)
        with self._session.lock:
            try:
                rows = self._main().execute(INSPECT, _halves(key), prepare=True).fetchall()
            except DRIVER_ERRORS as exc:
                self._failed(exc, f"inspect {name!r}")
        if not rows:
            return None
        busy = self._busy(key, tuple(rows[0][:3]))
        assert busy.holder is not None
        return LockInfo(name=name, holders=(busy.holder,))

    def list(self, prefix: str = "") -> Iterator[LockInfo]:
        raise Unsupported(
            f"the {self.scheme} store cannot list locks: pg_locks shows hashed keys, not names"
        )

    def force_release(self, name: str) -> bool:
        """Unlock it if this process holds it; otherwise terminate the session that does
        (which ends every lock of that session: its holders will see LockLost)."""
        key = self.key(name)
        with self._mutex:
            hold = self._held.get(key)
        if hold is not None:
            session = hold.session
            try:
                with session.lock:
                    if self._check(key, hold):
                        conn = session.conn
                        assert conn is not None
                        try:
                            row = conn.execute(UNLOCK, {"key": key}, prepare=True).fetchone()
                        except DRIVER_ERRORS as exc:
                            if not session.broken():
                                self.unavailable(exc, f"force-release {name!r}")
                            self._sweep(session)  # gone with its session; who has it now?
                        else:
                            with self._mutex:
                                self._unrecord(key, hold)
                            return bool(row and row[0])
            finally:
                self._settle(session)
        with self._session.lock:
            try:
                rows = self._main().execute(TERMINATE, _halves(key)).fetchall()
            except DRIVER_ERRORS as exc:
                self._failed(exc, f"force-release {name!r}")
        return any(terminated for (terminated,) in rows)

    def purge_expired(self) -> int:
        return 0  # nothing expires: locks end with their session

    # -- batch claims --------------------------------------------------------------------------

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        with self._session.lock:
            try:
                conn = self._main()
                candidates: dict[int, str] = {}
                with self._mutex:
                    for name in names:
                        key = self.key(name)
                        if key not in self._held and key not in candidates:
                            candidates[key] = name
                if not candidates:
                    return {}
                keys = list(candidates)
                rows = conn.execute(CLAIM, {"keys": keys}, prepare=True).fetchall()
                pid = conn.pgconn.backend_pid
            except DRIVER_ERRORS as exc:
                self._failed(exc, f"claim {len(names)} names")
            hold = _Hold(owner, owner_info, self._session, self._session.generation, pid)
            taken = set()
            with self._mutex:
                for (position,) in rows:
                    key = keys[position - 1]
                    self._record(key, hold)
                    taken.add(candidates[key])
        return {name: Grant(None, None) for name in names if name in taken}

    def release_many(self, names: Sequence[str], owner: str) -> int:
        """One statement per session involved: the main one, and each spare holding one."""
        by_session: dict[Session, list[tuple[int, _Hold]]] = {}
        with self._mutex:
            for key in dict.fromkeys(self.key(n) for n in names):
                hold = self._held.get(key)
                if hold is not None and hold.owner == owner:
                    by_session.setdefault(hold.session, []).append((key, hold))
        released = 0
        for session, holds in by_session.items():
            try:
                with session.lock:
                    live = [(key, hold) for key, hold in holds if self._check(key, hold)]
                    if not live:
                        continue
                    keys = [key for key, _ in live]
                    conn = session.conn
                    assert conn is not None
                    try:
                        row = conn.execute(UNLOCK_MANY, {"keys": keys}, prepare=True).fetchone()
                    except DRIVER_ERRORS as exc:
                        if session.broken():
                            self._sweep(session)
                            continue
                        self.unavailable(exc, f"release {len(keys)} names")
                    with self._mutex:
                        for key, hold in live:
                            self._unrecord(key, hold)
                    released += int(row[0]) if row else 0
            finally:
                self._settle(session)
        return released

    # -- health, lifecycle ---------------------------------------------------------------------

    def now(self) -> datetime:
        with self._session.lock:
            try:
                row = self._main().execute(NOW).fetchone()
            except DRIVER_ERRORS as exc:
                self._failed(exc, "read the clock")
        assert row is not None
        return utc(row[0])

    def close(self) -> None:
        """Closing the sessions ends every lock they hold; a wait in progress is cancelled."""
        with self._mutex:
            spares, waiting = list(self._spares), self._waiting
            self._held, self._spares, self._idle, self._waiting = {}, {}, [], set()
        for session in spares:
            conn = session.conn
            if session in waiting and conn is not None:
                with contextlib.suppress(*DRIVER_ERRORS):  # it ends by lock_timeout anyway
                    conn.cancel_safe(timeout=self.timeout)
            session.close()
        self._session.close()
