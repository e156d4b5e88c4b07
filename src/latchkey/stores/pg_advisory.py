"""The ``postgresql+advisory://`` store: PostgreSQL session-level advisory locks.

A lock is ``pg_try_advisory_lock(key)`` on one dedicated connection per backend, where
``key`` is the first 8 bytes of BLAKE2b over ``prefix NUL name`` (UTF-8) read as a signed
bigint. The lock lives exactly as long as that session: no TTL, no fencing tokens, gone when
the connection dies (crash, network loss, server restart) — and then every lock this backend
held is reported lost (``extend`` returns None, ``release`` False), never silently re-taken.

Advisory locks are re-entrant per session, and every thread of a process shares the session,
so the backend keeps a local map ``key -> (owner, session generation)``: one owner can
neither take nor release another owner's lock through the shared session.

Not offered: semaphores (slots would need keys ``inspect`` cannot enumerate), listing and
purging (``pg_locks`` holds keys, not names), versioned records.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar, NoReturn

import psycopg

from latchkey._owner import Owner
from latchkey._types import Busy, Grant, Holder, LockInfo
from latchkey._url import Option, StoreURL, key_prefix
from latchkey.errors import Unsupported
from latchkey.stores.base import Backend, Capabilities, Waiter
from latchkey.stores.postgresql import (
    CONNECTION_OPTIONS,
    DRIVER_ERRORS,
    Listener,
    Session,
    connection_params,
    forget_in_forked_child,
    utc,
)

CHANNEL = "latchkey_advisory"  # NOTIFY channel; the payload is the key in decimal

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

# Inputs: key, channel. Unlocks (only this session's own lock can be unlocked) and wakes
# waiters at commit. Result: whether this session held it.
UNLOCK = """
SELECT pg_advisory_unlock(%(key)s::bigint), pg_notify(%(channel)s, %(key)s::bigint::text)
"""

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

# Inputs: keys (bigint[]), channel. Unlocks each and wakes their waiters.
# Result: how many this session held.
UNLOCK_MANY = """
SELECT count(*) FILTER (WHERE unlocked)
FROM (SELECT pg_advisory_unlock(k) AS unlocked, pg_notify(%(channel)s, k::text)
      FROM unnest(%(keys)s::bigint[]) AS k) AS u
"""

NOW = "SELECT now()"


def advisory_key(name: str, prefix: str = "") -> int:
    """The 64-bit advisory-lock key of ``name``: BLAKE2b-64 of ``prefix NUL name``, signed."""
    digest = hashlib.blake2b(
        prefix.encode() + b"\x00" + name.encode(), digest_size=8
    ).digest()
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


class AdvisoryBackend(Backend):
    """Session-level advisory locks; see the module docstring for what it can't do."""

    scheme = "postgresql+advisory"
    capabilities = Capabilities(
        ttl=False,
        fencing=False,
        durable=False,
        listing=False,
        push=True,
        semaphores=False,
        claims=True,
        records=False,
        session_tied=True,
    )
    options: ClassVar[Mapping[str, Option]] = {
        "prefix": Option(key_prefix, "", "hashed with each name: separates applications"),
        **CONNECTION_OPTIONS,
    }

    def __init__(self, url: StoreURL) -> None:
        super().__init__(url)
        self.prefix: str = self.config["prefix"]
        # The session names itself so that other processes' inspect() can say who holds a lock.
        app = f"latchkey {os.getpid()}@{socket.gethostname()}".encode()[:63]
        self._session = Session(connection_params(url, self.config, app.decode("utf-8", "ignore")))
        self._listener = Listener(self._session.open, CHANNEL)
        # key -> (owner token, owner_info, session generation): the locks this process holds.
        self._held: dict[int, tuple[str, str, int]] = {}
        forget_in_forked_child(self)

    def key(self, name: str) -> int:
        return advisory_key(name, self.prefix)

    # -- plumbing ------------------------------------------------------------------------------

    def _conn(self) -> psycopg.Connection[Any]:
        """The session (call under its lock); forgets locks of a previous session."""
        conn = self._session.connection()
        generation = self._session.generation
        if any(gen != generation for _, _, gen in self._held.values()):
            self._held = {k: v for k, v in self._held.items() if v[2] == generation}
        return conn

    def _mine(self, key: int, owner: str) -> bool:
        """True if ``owner`` holds ``key`` in the current, still open session (under lock).

        No round trip: a session the server ended shows as input on the idle socket.
        """
        entry = self._held.get(key)
        if entry is None or entry[0] != owner:
            return False
        if not self._session.alive() or entry[2] != self._session.generation:
            self._held.clear()  # the session that held them is gone, and its locks with it
            return False
        return True

    def _failed(self, exc: BaseException, action: str) -> NoReturn:
        """After a driver error: if the session died, so did every lock it held."""
        if self._session.broken():
            self._held.clear()
        self.unavailable(exc, action)

    def _forget_after_fork(self) -> None:
        self._session.forget_after_fork()
        self._listener.forget_after_fork()
        self._held = {}  # the parent's session holds them, not ours

    def _local_holder(self, key: int) -> Holder:
        _, owner_info, _ = self._held[key]
        return Holder(token=None, owner=Owner.from_json(owner_info), acquired_at=None,
                      expires_at=None)

    # -- leases --------------------------------------------------------------------------------

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        if limit != 1:
            raise Unsupported(f"the {self.scheme} store does not support semaphores")
        key = self.key(name)
        with self._session.lock:
            try:
                conn = self._conn()
                if key in self._held:  # held through our own session: re-entry would succeed
                    return Busy(holders=1, holder=self._local_holder(key))
                row = conn.execute(TRY_LOCK, {"key": key}, prepare=True).fetchone()
                assert row is not None
                if row[0]:
                    self._held[key] = (owner, owner_info, self._session.generation)
                    return Grant(token=None, expires_at=None)
                found = conn.execute(HOLDER, _halves(key), prepare=True).fetchone()
            except DRIVER_ERRORS as exc:
                self._failed(exc, f"acquire {name!r}")
        if found is None:  # released between our attempt and the look-up: retry at once
            return Busy(holders=0)
        _pid, app, client = found
        holder = Holder(None, _owner_from_session(app, client), None, None)
        return Busy(holders=1, holder=holder)

    def release(self, name: str, owner: str) -> bool:
        key = self.key(name)
        with self._session.lock:
            if not self._mine(key, owner):
                return False
            conn = self._session.conn
            assert conn is not None
            try:
                row = conn.execute(
                    UNLOCK, {"key": key, "channel": CHANNEL}, prepare=True
                ).fetchone()
            except DRIVER_ERRORS as exc:
                if self._session.broken():  # the session ended: the lock ended with it
                    self._held.clear()
                    return False
                self.unavailable(exc, f"release {name!r}")
            del self._held[key]
            return bool(row and row[0])

    def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        """No TTL to move: checks that our session is alive and still holds the lock."""
        key = self.key(name)
        with self._session.lock:
            entry = self._held.get(key)
            if not self._mine(key, owner):
                if entry is not None and entry[0] == owner:
                    self._reachable(f"check the lock {name!r}")
                return None
            conn = self._session.conn
            assert conn is not None
            try:
                row = conn.execute(HOLDS, _halves(key), prepare=True).fetchone()
            except DRIVER_ERRORS as exc:
                if not self._session.broken():
                    self._failed(exc, f"check the lock {name!r}")
                self._held.clear()  # the session died under us
                self._reachable(f"check the lock {name!r}")
                return None
            if not (row and row[0]):  # force-released (session terminated) or unlocked
                del self._held[key]
                return None
        return Grant(token=None, expires_at=None)

    def _reachable(self, action: str) -> None:
        """Our session died: raise StoreUnavailable if the server cannot be reached either
        (an outage), return if it can (the lock is lost: force-released, or a restart)."""
        try:
            self._conn()
        except DRIVER_ERRORS as exc:
            self._failed(exc, action)

    def inspect(self, name: str) -> LockInfo | None:
        key = self.key(name)
        with self._session.lock:
            try:
                conn = self._conn()
                rows = conn.execute(INSPECT, _halves(key), prepare=True).fetchall()
                own_pid = conn.info.backend_pid
            except DRIVER_ERRORS as exc:
                self._failed(exc, f"inspect {name!r}")
            if not rows:
                return None
            pid, app, client, _started = rows[0]
            if pid == own_pid and key in self._held:
                holder = self._local_holder(key)
            else:
                holder = Holder(None, _owner_from_session(app, client), None, None)
        return LockInfo(name=name, holders=(holder,))

    def list(self, prefix: str = "") -> Iterator[LockInfo]:
        raise Unsupported(
            f"the {self.scheme} store cannot list locks: pg_locks shows hashed keys, not names"
        )

    def force_release(self, name: str) -> bool:
        """Unlock it if this process holds it; otherwise terminate the session that does
        (which ends every lock of that session: its holders will see LockLost)."""
        key = self.key(name)
        with self._session.lock:
            try:
                conn = self._conn()
                if key in self._held:
                    del self._held[key]
                    row = conn.execute(UNLOCK, {"key": key, "channel": CHANNEL}).fetchone()
                    return bool(row and row[0])
                rows = conn.execute(TERMINATE, _halves(key)).fetchall()
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
                conn = self._conn()
                candidates: dict[int, str] = {}
                for name in names:
                    key = self.key(name)
                    if key not in self._held and key not in candidates:
                        candidates[key] = name
                if not candidates:
                    return {}
                keys = list(candidates)
                rows = conn.execute(CLAIM, {"keys": keys}, prepare=True).fetchall()
            except DRIVER_ERRORS as exc:
                self._failed(exc, f"claim {len(names)} names")
            generation = self._session.generation
            taken = set()
            for (position,) in rows:
                key = keys[position - 1]
                self._held[key] = (owner, owner_info, generation)
                taken.add(candidates[key])
        return {name: Grant(None, None) for name in names if name in taken}

    def release_many(self, names: Sequence[str], owner: str) -> int:
        with self._session.lock:
            keys = [k for k in dict.fromkeys(self.key(n) for n in names) if self._mine(k, owner)]
            if not keys:
                return 0
            conn = self._session.conn
            assert conn is not None
            try:
                row = conn.execute(
                    UNLOCK_MANY, {"keys": keys, "channel": CHANNEL}, prepare=True
                ).fetchone()
            except DRIVER_ERRORS as exc:
                if self._session.broken():
                    self._held.clear()
                    return 0
                self.unavailable(exc, f"release {len(keys)} names")
            for key in keys:
                del self._held[key]
            return int(row[0]) if row else 0

    # -- waiting, health, lifecycle ------------------------------------------------------------

    def subscribe(self, name: str) -> Waiter:
        with self.translate(f"listen for releases of {name!r}", DRIVER_ERRORS):
            return self._listener.subscribe(str(self.key(name)))

    def now(self) -> datetime:
        with self._session.lock:
            try:
                row = self._conn().execute(NOW).fetchone()
            except DRIVER_ERRORS as exc:
                self._failed(exc, "read the clock")
        assert row is not None
        return utc(row[0])

    def close(self) -> None:
        """Closing the session ends every lock it holds."""
        self._listener.close()
        self._session.close()
        self._held = {}

