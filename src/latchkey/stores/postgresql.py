"""The ``postgresql://`` store: leases in a table, fencing tokens from a sequence.

Layout (``?table=`` default ``latchkey_locks``, in ``?schema=`` or the connection's current
schema), created on first use or by :meth:`PostgreSQLBackend.init`:

- ``<table>``: one row per live (or expired, not yet reused) lease: ``name`` (the name's UTF-8
  bytes as ``bytea``, so NUL and any character round-trip), ``slot`` (0 … limit-1; a mutex is
  slot 0), ``owner`` (the owner token), ``owner_info`` (JSON text), ``token`` (fencing),
  ``acquired_at``/``expires_at`` by the server's clock. Primary key ``(name, slot)``.
- ``<table>_fence``: the sequence fencing tokens come from. It is global, so tokens strictly
  increase per name across release, expiry, purge and restart.
- ``<table>_records``: versioned records. ``<table>_meta``: the schema version.
- ``<table>_waiters`` (UNLOGGED: no WAL, emptied by a crash): the owners blocked in acquire
  of a mutex, in arrival order, each with its process's listener key (below).

Every primitive is one statement in autocommit mode (one round trip, one commit).

Waiting is a queue with hand-off. A blocked mutex acquire puts its owner in ``<table>_waiters``
and ``LISTEN``s on one extra connection per backend (:class:`Listener`), which holds a session
advisory lock on a random 64-bit *listener key* for as long as it lives. Release, in its one
statement, gives the lease straight to the oldest waiter whose listener key is still held
(its process is alive: ``pg_try_advisory_xact_lock`` fails), with a new fencing token and its
own TTL, committed durably, and sends a notification naming that waiter's ticket; the
waiter's acquire returns on it without another round trip. With no live waiter, release
deletes the lease (committed asynchronously) and notifies every waiter of the name, which
retry. Waiters also retry on their own (capped backoff), so a lost notification or listener
only slows them down.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import secrets
import select
import selectors
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any, ClassVar

import psycopg
from psycopg import sql

from latchkey._owner import Owner
from latchkey._types import Busy, Grant, Holder, LockInfo
from latchkey._url import Option, StoreURL, choice, identifier
from latchkey.errors import StoreUnavailable
from latchkey.stores.base import Backend, Capabilities, EventWaiter, Waiter

log = logging.getLogger("latchkey")

SCHEMA_VERSION = 1
DRIVER_ERRORS: tuple[type[BaseException], ...] = (psycopg.Error, OSError)
TUPLES_OK = psycopg.pq.ExecStatus.TUPLES_OK
COMMAND_OK = psycopg.pq.ExecStatus.COMMAND_OK
SQLSTATE = psycopg.pq.DiagnosticField.SQLSTATE
#: Where binary timestamptz values count microseconds from.
PG_EPOCH = datetime(2000, 1, 1, tzinfo=timezone.utc)

# A fixed advisory-lock key ("latchkey" in ASCII) that serialises table creation, so that
# several processes starting at once do not race in CREATE … IF NOT EXISTS.
DDL_LOCK_KEY = 0x6C6174636B6B6579

# -- SQL ---------------------------------------------------------------------------------------
# Templates: {locks} {fence} {records} {meta} {expires_idx} are the validated identifiers;
# %(…)s are parameters. Names are always bytea parameters (the UTF-8 bytes of the name).

# Creates the tables, index and sequence if absent (run in one transaction under DDL_LOCK_KEY).
CREATE_STATEMENTS = (
    """CREATE TABLE IF NOT EXISTS {locks} (
        name bytea NOT NULL,
        slot integer NOT NULL,
        owner text NOT NULL,
        owner_info text NOT NULL,
        token bigint NOT NULL,
        acquired_at timestamptz NOT NULL,
        expires_at timestamptz NOT NULL,
        PRIMARY KEY (name, slot))""",
    "CREATE INDEX IF NOT EXISTS {expires_idx} ON {locks} (expires_at)",
    "CREATE SEQUENCE IF NOT EXISTS {fence} AS bigint",
    """CREATE TABLE IF NOT EXISTS {records} (
        name bytea PRIMARY KEY,
        value text NOT NULL,
        version bigint NOT NULL)""",
    "CREATE TABLE IF NOT EXISTS {meta} (key text PRIMARY KEY, value text NOT NULL)",
    """CREATE UNLOGGED TABLE IF NOT EXISTS {waiters} (
        name bytea NOT NULL,
        owner text NOT NULL,
        owner_info text NOT NULL,
        ttl float8 NOT NULL,
        ticket bigint NOT NULL,
        listener_key bigint NOT NULL,
        queued_at timestamptz NOT NULL,
        expires_at timestamptz NOT NULL,
        PRIMARY KEY (name, owner))""",
    """INSERT INTO {meta} (key, value) VALUES ('schema_version', %(version)s)
        ON CONFLICT (key) DO NOTHING""",
)

# The schema version the tables were created with; newer than ours means we must not write.
SELECT_VERSION = "SELECT value FROM {meta} WHERE key = 'schema_version'"

# Inputs: name, owner, owner_info, ttl (s). A mutex is slot 0: takes it if free or expired
# (the ON CONFLICT … WHERE re-checks expiry on the newest row version, so a live lease is
# never taken over). Result: (token, expires_at) when granted, no row when busy. Kept to one
# plain INSERT so the uncontended path costs what a raw INSERT … ON CONFLICT does; the
# holder is looked up (HOLDER) only when busy.
ACQUIRE_MUTEX = """
INSERT INTO {locks} AS l (name, slot, owner, owner_info, token, acquired_at, expires_at)
VALUES (%(name)s, 0, %(owner)s, %(owner_info)s, nextval({fence_regclass}), now(),
        now() + %(ttl)s::float8 * interval '1 second')
ON CONFLICT (name, slot) DO UPDATE SET
    owner = excluded.owner, owner_info = excluded.owner_info, token = excluded.token,
    acquired_at = excluded.acquired_at, expires_at = excluded.expires_at
WHERE l.expires_at <= now()
RETURNING l.token, l.expires_at
"""

# Inputs: name, owner. The live holder of a mutex, for a Busy answer: (token, owner_info,
# acquired_at, expires_at, seconds left, whether it is ``owner``: a release handed it to us
# while we were not looking); no row if it was released in between.
HOLDER = """
SELECT token, owner_info, acquired_at, expires_at, extract(epoch FROM expires_at - now())::float8,
       owner = %(owner)s
FROM {locks} WHERE name = %(name)s AND slot = 0 AND expires_at > now()
"""

# Inputs: name, owner, owner_info, ttl (s), limit. A semaphore: takes the lowest free slot
# of ``name`` if fewer than ``limit`` leases are live (expired rows are taken over, live ones
# never) and ``owner`` holds none of them. Always one result row: (token, expires_at) when
# granted, else NULLs; then the live count and the soonest-expiring live holder (token,
# owner_info, acquired_at, expires_at, seconds until it expires); then owner's own live lease
# if it already had one (token, expires_at, seconds left), which is the answer: never a
# second slot.
ACQUIRE_SLOT = """
WITH live AS (
    SELECT slot, owner, token, owner_info, acquired_at, expires_at FROM {locks}
    WHERE name = %(name)s AND expires_at > now()
), mine AS (
    SELECT token, expires_at FROM live WHERE owner = %(owner)s ORDER BY slot LIMIT 1
), pick AS (
    SELECT s.slot FROM generate_series(0, %(limit)s::integer - 1) AS s (slot)
    WHERE (SELECT count(*) FROM live) < %(limit)s::integer
      AND NOT EXISTS (SELECT 1 FROM mine)
      AND s.slot NOT IN (SELECT slot FROM live)
    ORDER BY s.slot LIMIT 1
), taken AS (
    INSERT INTO {locks} AS l (name, slot, owner, owner_info, token, acquired_at, expires_at)
    SELECT %(name)s, pick.slot, %(owner)s, %(owner_info)s, nextval({fence_regclass}), now(),
           now() + %(ttl)s::float8 * interval '1 second'
    FROM pick
    ON CONFLICT (name, slot) DO UPDATE SET
        owner = excluded.owner, owner_info = excluded.owner_info, token = excluded.token,
        acquired_at = excluded.acquired_at, expires_at = excluded.expires_at
    WHERE l.expires_at <= now()
    RETURNING l.token, l.expires_at
)
SELECT taken.token, taken.expires_at, (SELECT count(*) FROM live),
       soonest.token, soonest.owner_info, soonest.acquired_at, soonest.expires_at,
       extract(epoch FROM soonest.expires_at - now())::float8,
       mine.token, mine.expires_at, extract(epoch FROM mine.expires_at - now())::float8
FROM (SELECT 1) AS one
LEFT JOIN taken ON true
LEFT JOIN mine ON true
LEFT JOIN LATERAL (SELECT * FROM live ORDER BY expires_at LIMIT 1) AS soonest ON true
"""

# Inputs: name, owner, channel. Ends owner's lease on ``name`` (live or expired; an owner
# token holds at most one slot). If it is a mutex (slot 0) and a waiter is queued whose process
# is alive (its listener still holds its listener key, so our try-lock on the key fails), the
# lease row goes to the oldest such waiter — new owner, fencing token, times — and that waiter
# leaves the queue; the notification carries its ticket, token and expiry (µs since the
# epoch): ``<name hex>:<ticket>:<token>:<expires>``. Otherwise the row is deleted and the
# notification is the name's hex: every waiter retries. Queue rows being removed by their
# waiter right now are skipped (SKIP LOCKED): that waiter is leaving.
# Result: (whether our lease was still live, whether it was handed over); no row if we had none.
# A plain release commits asynchronously (synchronous_commit off for this transaction only):
# one lost in a crash leaves the lease to expire by its TTL — a delay, never a second holder —
# and the next durable commit flushes it anyway. A hand-over is a grant, so it commits durably
# like acquire: losing it could let two holders overlap.
RELEASE = """
WITH gone AS (
    SELECT name, slot, expires_at > now() AS live FROM {locks}
    WHERE name = %(name)s AND owner = %(owner)s
    FOR UPDATE
), heir AS (
    SELECT w.owner, w.owner_info, w.ttl, w.ticket FROM {waiters} AS w JOIN gone USING (name)
    WHERE gone.slot = 0 AND w.owner <> %(owner)s AND w.expires_at > now()
      AND NOT pg_try_advisory_xact_lock(w.listener_key)
    ORDER BY w.queued_at, w.ticket
    LIMIT 1
    FOR UPDATE OF w SKIP LOCKED
), dequeued AS (
    DELETE FROM {waiters} AS w USING heir WHERE w.name = %(name)s AND w.owner = heir.owner
), handed AS (
    UPDATE {locks} AS l SET
        owner = heir.owner, owner_info = heir.owner_info, token = nextval({fence_regclass}),
        acquired_at = now(), expires_at = now() + heir.ttl * interval '1 second'
    FROM heir WHERE l.name = %(name)s AND l.slot = 0 AND l.owner = %(owner)s
    RETURNING heir.ticket, l.token, l.expires_at
), deleted AS (
    DELETE FROM {locks} AS l
    WHERE l.name = %(name)s AND l.owner = %(owner)s AND NOT EXISTS (SELECT 1 FROM heir)
)
SELECT gone.live, handed.token IS NOT NULL,
       set_config('synchronous_commit',
                  CASE WHEN handed.token IS NULL THEN 'off'
                       ELSE current_setting('synchronous_commit') END, true),
       pg_notify(%(channel)s, encode(gone.name, 'hex') || coalesce(
           ':' || handed.ticket || ':' || handed.token || ':'
               || (extract(epoch FROM handed.expires_at) * 1000000)::bigint, ''))
FROM gone LEFT JOIN handed ON true
"""

# Inputs: name, owner, owner_info, ttl, ticket, listener_key. Puts a blocked mutex acquire in
# the queue (again: the same owner keeps its place but gets the new key). The backstop expiry
# only bounds a row nobody removed; a dead process's rows are skipped by their listener key.
ENQUEUE = """
INSERT INTO {waiters} AS w
    (name, owner, owner_info, ttl, ticket, listener_key, queued_at, expires_at)
VALUES (%(name)s, %(owner)s, %(owner_info)s, %(ttl)s, %(ticket)s, %(listener_key)s,
        clock_timestamp(), now() + interval '1 hour')
ON CONFLICT (name, owner) DO UPDATE SET
    ticket = excluded.ticket, listener_key = excluded.listener_key,
    expires_at = excluded.expires_at
"""

# Inputs: name, owner. Leaves the queue. Result: a row if we were still in it (no row: a
# release handed us the lease, or the row is gone with a crash or a purge).
DEQUEUE = """
DELETE FROM {waiters} WHERE name = %(name)s AND owner = %(owner)s RETURNING 1
"""


# Inputs: name, owner, ttl. Moves the expiry of owner's *live* lease; the token stays.
# Result: (token, expires_at), or no row if the lease is not live.
EXTEND = """
UPDATE {locks} SET expires_at = now() + %(ttl)s::float8 * interval '1 second'
WHERE name = %(name)s AND owner = %(owner)s AND expires_at > now()
RETURNING token, expires_at
"""

# Input: name. Result: the live holders, oldest first.
INSPECT = """
SELECT token, owner_info, acquired_at, expires_at FROM {locks}
WHERE name = %(name)s AND expires_at > now()
ORDER BY acquired_at, slot
"""

# Inputs: low, high (byte range of the prefix; high NULL: no upper bound). Result: live rows
# in name order (bytea order is UTF-8 byte order, which is code point order).
LIST = """
SELECT name, token, owner_info, acquired_at, expires_at FROM {locks}
WHERE expires_at > now() AND name >= %(low)s AND (%(high)s::bytea IS NULL OR name < %(high)s)
ORDER BY name, acquired_at, slot
"""

# Inputs: name, channel. Deletes every lease of ``name`` whoever holds it and notifies
# waiters. Result: one row per lease dropped, true if it was live.
FORCE_RELEASE = """
DELETE FROM {locks} WHERE name = %(name)s
RETURNING expires_at > now(), pg_notify(%(channel)s, encode(name, 'hex'))
"""

# Deletes expired rows (rows being taken over right now are skipped, not waited for; rows
# are locked in key order like CLAIM so the two never deadlock). Result: the count.
# The same statement drops queue rows of processes that are gone (their listener key is
# free) or past their backstop.
PURGE = """
WITH expired AS (
    SELECT ctid FROM {locks} WHERE expires_at <= now()
    ORDER BY name, slot FOR UPDATE SKIP LOCKED
), purged AS (
    DELETE FROM {locks} AS l USING expired WHERE l.ctid = expired.ctid AND l.expires_at <= now()
    RETURNING 1
), stale_waiters AS (
    DELETE FROM {waiters} WHERE expires_at <= now() OR pg_try_advisory_xact_lock(listener_key)
)
SELECT count(*) FROM purged
"""

# Inputs: names (distinct, bytea[]), owner, owner_info, ttl. Takes slot 0 of every name that
# has no live lease, in name order (so concurrent claims lock rows in the same order and never
# deadlock); one expiry for the batch. Result: (name, token, expires_at) per name taken.
CLAIM = """
INSERT INTO {locks} AS l (name, slot, owner, owner_info, token, acquired_at, expires_at)
SELECT n.name, 0, %(owner)s, %(owner_info)s, nextval({fence_regclass}), now(),
       now() + %(ttl)s::float8 * interval '1 second'
FROM unnest(%(names)s::bytea[]) AS n (name)
WHERE NOT EXISTS (
    SELECT 1 FROM {locks} AS o WHERE o.name = n.name AND o.slot > 0 AND o.expires_at > now())
ORDER BY n.name
ON CONFLICT (name, slot) DO UPDATE SET
    owner = excluded.owner, owner_info = excluded.owner_info, token = excluded.token,
    acquired_at = excluded.acquired_at, expires_at = excluded.expires_at
WHERE l.expires_at <= now()
RETURNING l.name, l.token, l.expires_at
"""

# Inputs: names (bytea[]), owner, channel. Deletes owner's rows of those names (locked in
# name order, like CLAIM) and notifies waiters. Result: how many were live.
RELEASE_MANY = """
WITH mine AS (
    SELECT ctid FROM {locks} WHERE name = ANY(%(names)s::bytea[]) AND owner = %(owner)s
    ORDER BY name, slot FOR UPDATE
), gone AS (
    DELETE FROM {locks} AS l USING mine WHERE l.ctid = mine.ctid
    RETURNING l.name, l.expires_at > now() AS live
)
SELECT count(*) FILTER (WHERE live)
FROM (SELECT live, pg_notify(%(channel)s, encode(name, 'hex')) FROM gone) AS notified
"""

# Input: name. Result: (value, version) or no row.
RECORD_GET = "SELECT value, version FROM {records} WHERE name = %(name)s"

# Inputs: name, value. Creates the record at version 1 unless it exists. Result: 1 or no row.
RECORD_INSERT = """
INSERT INTO {records} (name, value, version) VALUES (%(name)s, %(value)s, 1)
ON CONFLICT (name) DO NOTHING RETURNING version
"""

# Inputs: name, value, version. Writes only if the version is unchanged; bumps it.
# Result: the new version, or no row if it moved.
RECORD_UPDATE = """
UPDATE {records} SET value = %(value)s, version = version + 1
WHERE name = %(name)s AND version = %(version)s RETURNING version
"""

# Inputs: name, version. Deletes only if the version is unchanged; version 0 means "absent",
# which is still true if no row exists. Result: whether that held.
RECORD_DELETE = """
WITH gone AS (DELETE FROM {records} WHERE name = %(name)s AND version = %(version)s RETURNING 1)
SELECT EXISTS (SELECT 1 FROM gone)
    OR (%(version)s = 0 AND NOT EXISTS (SELECT 1 FROM {records} WHERE name = %(name)s))
"""

NOW = "SELECT now()"

STATEMENTS: Mapping[str, str] = {
    "acquire_mutex": ACQUIRE_MUTEX,
    "holder": HOLDER,
    "acquire_slot": ACQUIRE_SLOT,
    "release": RELEASE,
    "extend": EXTEND,
    "inspect": INSPECT,
    "list": LIST,
    "force_release": FORCE_RELEASE,
    "purge": PURGE,
    "claim": CLAIM,
    "release_many": RELEASE_MANY,
    "record_get": RECORD_GET,
    "record_insert": RECORD_INSERT,
    "enqueue": ENQUEUE,
    "dequeue": DEQUEUE,
    "record_update": RECORD_UPDATE,
    "record_delete": RECORD_DELETE,
    "now": NOW,
}

# The statements run through Session.run_prepared (the uncontended acquire+release), with
# their parameters in $n order; the name (bytea) goes in binary, the rest as text.
FAST_PARAMS: Mapping[str, tuple[str, ...]] = {
    "acquire_mutex": ("name", "owner", "owner_info", "ttl"),
    "release": ("name", "owner", "channel"),
}


#: The parameter formats of the fast statements (FAST_PARAMS order): the name in binary.
MUTEX_FORMATS = (1, 0, 0, 0)
RELEASE_FORMATS = (1, 0, 0)


def mutex_values(name: str, owner: str, owner_info: str, ttl: float) -> tuple[bytes, ...]:
    """ACQUIRE_MUTEX's parameters for ``run_prepared``, encoded (MUTEX_FORMATS)."""
    return (name.encode(), owner.encode(), owner_info.encode(), repr(float(ttl)).encode())


def mutex_granted(result: psycopg.pq.abc.PGresult) -> Grant | None:
    """ACQUIRE_MUTEX's binary result: the new lease, or None when the name is held."""
    if not result.ntuples:
        return None
    return Grant(token=_int8(result.get_value(0, 0)),
                 expires_at=_timestamptz(result.get_value(0, 1)))  # fmt: skip


def was_live(result: psycopg.pq.abc.PGresult) -> bool:
    """RELEASE's binary result: whether the owner's lease was still live."""
    return bool(result.ntuples) and result.get_value(0, 0) == b"\x01"


def _int8(value: bytes | None) -> int:
    """A binary bigint."""
    assert value is not None
    return int.from_bytes(value, "big", signed=True)


def _timestamptz(value: bytes | None) -> datetime:
    """A binary timestamptz: microseconds since 2000-01-01 UTC."""
    return PG_EPOCH + timedelta(microseconds=_int8(value))


# -- connections -------------------------------------------------------------------------------


def table_name(text: str) -> str:
    """A table name short enough that ``<table>_records`` fits PostgreSQL's 63-byte limit."""
    identifier(text)
    if len(text) > 55:
        raise ValueError("must be at most 55 characters (63 minus the '_records' suffix)")
    return text


def _text(value: str) -> str:
    return value


CONNECTION_OPTIONS: Mapping[str, Option] = {
    "sslmode": Option(
        choice("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
        None,
        "libpq sslmode",
    ),
    "sslrootcert": Option(_text, None, "CA certificate file (libpq sslrootcert)"),
    "sslcert": Option(_text, None, "client certificate file (libpq sslcert)"),
    "sslkey": Option(_text, None, "client key file (libpq sslkey)"),
}


def connection_params(
    url: StoreURL, config: Mapping[str, Any], application_name: str
) -> dict[str, Any]:
    """libpq parameters from the URL: timeouts and keepalives bound every wait on the network."""
    timeout: float = config["timeout"]
    params: dict[str, Any] = {
        "connect_timeout": max(2, math.ceil(timeout)),
        "keepalives": 1,
        "keepalives_idle": max(1, math.ceil(timeout / 2)),
        "keepalives_interval": 1,
        "keepalives_count": 3,
        "tcp_user_timeout": max(1, int(timeout * 1000)),
        "application_name": application_name,
        "options": f"-c statement_timeout={max(1, int(timeout * 1000))} -c TimeZone=UTC",
    }
    if url.hosts:
        params["host"] = ",".join(host for host, _ in url.hosts)
        if any(port for _, port in url.hosts):
            params["port"] = ",".join(str(port or 5432) for _, port in url.hosts)
    if url.username:
        params["user"] = url.username
    if url.password:
        params["password"] = url.password
    if url.path.strip("/"):
        params["dbname"] = url.path.strip("/")
    for key in CONNECTION_OPTIONS:
        if config.get(key):
            params[key] = config[key]
    return params


def utc(value: datetime) -> datetime:
    return value.astimezone(timezone.utc)


# Connections left behind by a fork: the child must neither use nor close them (closing would
# end the parent's session), and keeping them referenced avoids "deleted while open" warnings.
_FORKED_AWAY: list[object] = []
_AT_FORK: weakref.WeakSet[Any] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for backend in list(_AT_FORK):
        backend._forget_after_fork()


def forget_in_forked_child(backend: Any) -> None:
    """Call ``backend._forget_after_fork()`` in a child process right after a fork."""
    _AT_FORK.add(backend)


os.register_at_fork(after_in_child=_after_fork_in_child)


class HandoffWaiter(EventWaiter):
    """A queued mutex waiter: woken by its name's notifications, and handed the lease by a
    release that names its ticket (see :class:`Listener`)."""

    def __init__(
        self, listener: Listener, key: str, ticket: int | None,
        on_close: Callable[[HandoffWaiter], None] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(threading.Event())
        self.listener, self.key, self.ticket = listener, key, ticket
        self.grant: Grant | None = None
        self.handed_over = False  # the core took the grant a release handed us
        self.acquired = False  # the wait ended with the lease ours (however it came)
        self._on_leave = on_close

    def deliver(self, grant: Grant) -> None:
        self.grant = grant
        self.event.set()

    def take_grant(self) -> Grant | None:
        if self.grant is not None:
            self.handed_over = self.acquired = True
        return self.grant

    def finish(self, result: Grant | Busy) -> None:
        self.acquired = isinstance(result, Grant)

    def unsubscribe(self) -> None:
        self.listener.unsubscribe(self)

    def close(self) -> None:
        self.unsubscribe()
        if self._on_leave is not None:
            self._on_leave(self)


class Listener:
    """One ``LISTEN`` connection per backend, shared by the waiters of every name.

    A daemon thread reads notifications and wakes the waiters of their key (the payload up to
    the first ``:``). A payload ``key:ticket:token:expires_us`` hands a lease to the waiter
    holding that ticket, and wakes only it. The connection also holds a session advisory lock
    on a random 64-bit *listener key* for its whole life: releases hand leases only to queued
    owners whose key is held, so a dead process (its connection closed) is never handed one.
    If the connection is lost, every waiter is woken once (so it retries and sees the store's
    state) and later waits poll; the next subscribe reconnects with a new key.
    """

    def __init__(
        self, connect: Callable[[], psycopg.Connection[Any]], channel: str,
        unclaimed: Callable[[int], None] | None = None,
    ) -> None:  # fmt: skip
        self._connect = connect
        self._channel = channel
        self._unclaimed = unclaimed
        self._lock = threading.Lock()
        self._waiters: dict[str, set[HandoffWaiter]] = {}
        self._conn: psycopg.Connection[Any] | None = None
        self._stop_fd = -1
        self.listener_key = 0

    def subscribe(self, key: str) -> Waiter:
        """A waiter for ``key``; the connection is listening before this returns."""
        return self.queue(key, None)[0]

    def queue(
        self, key: str, ticket: int | None,
        on_close: Callable[[HandoffWaiter], None] | None = None,
    ) -> tuple[HandoffWaiter, int]:  # fmt: skip
        """A waiter for ``key`` that a release naming ``ticket`` hands its lease to, and the
        listener key to queue it with; listening before this returns."""
        waiter = HandoffWaiter(self, key, ticket, on_close)
        with self._lock:
            if self._conn is None:
                self._start()
            self._waiters.setdefault(key, set()).add(waiter)
            return waiter, self.listener_key

    def unsubscribe(self, waiter: HandoffWaiter) -> None:
        with self._lock:
            waiters = self._waiters.get(waiter.key)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[waiter.key]

    def _start(self) -> None:
        conn = self._connect()
        listener_key = secrets.randbits(64) - (1 << 63)
        try:
            conn.execute("SELECT pg_advisory_lock(%s)", (listener_key,))
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
        except BaseException:
            conn.close()
            raise
        stop_r, stop_w = os.pipe()
        self._conn, self._stop_fd, self.listener_key = conn, stop_w, listener_key
        thread = threading.Thread(
            target=self._run, args=(conn, stop_r, stop_w), name="latchkey-pg-listen", daemon=True
        )
        thread.start()

    def _run(self, conn: psycopg.Connection[Any], stop_r: int, stop_w: int) -> None:
        pid = os.getpid()
        selector = selectors.DefaultSelector()
        try:
            selector.register(conn.fileno(), selectors.EVENT_READ)
            selector.register(stop_r, selectors.EVENT_READ)
            while True:
                if any(key.fd == stop_r for key, _ in selector.select()):
                    break
                conn.pgconn.consume_input()
                while (note := conn.pgconn.notifies()) is not None:
                    self._wake(note.extra.decode("ascii", "replace"))
        except (psycopg.Error, OSError, ValueError):
            pass  # connection lost: wake everyone below; later waits poll
        finally:
            selector.close()
            if os.getpid() == pid:
                with self._lock:
                    if self._conn is conn:
                        self._conn = None
                    everyone = [w for waiters in self._waiters.values() for w in waiters]
                for waiter in everyone:
                    waiter.event.set()
                conn.close()
                os.close(stop_r)
                os.close(stop_w)

    def _wake(self, payload: str) -> None:
        key, _, handoff = payload.partition(":")
        with self._lock:
            waiters = list(self._waiters.get(key, ()))
        if handoff:
            grant = _handoff_grant(handoff)
            if grant is None:
                return
            for waiter in waiters:
                if waiter.ticket == grant[0]:
                    waiter.deliver(grant[1])
                    return  # the name is held again: nobody else needs to wake
            if self._unclaimed is not None:
                self._unclaimed(grant[0])
            return
        for waiter in waiters:
            waiter.event.set()

    def close(self) -> None:
        """Stop the thread (it closes its connection)."""
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None:
                with contextlib.suppress(OSError):
                    os.write(self._stop_fd, b"x")

    def forget_after_fork(self) -> None:
        """In a forked child: the thread is gone and the connection is the parent's."""
        self._lock = threading.Lock()
        if self._conn is not None:
            _FORKED_AWAY.append(self._conn)
        self._conn = None
        self._waiters = {}


def _handoff_grant(text: str) -> tuple[int, Grant] | None:
    """``ticket:token:expires_us`` → (ticket, the grant); None if malformed."""
    try:
        ticket, token, expires_us = (int(part) for part in text.split(":"))
    except ValueError:
        return None
    expires = datetime.fromtimestamp(expires_us / 1e6, timezone.utc)
    return ticket, Grant(token=token, expires_at=expires)


def _input_waiting(fd: int) -> bool:
    """Whether ``fd`` has something to read (or hung up), without blocking."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))
    return bool(select.select([fd], [], [], 0)[0])  # Windows: no poll()


def positional(query: bytes) -> tuple[bytes, tuple[str, ...]]:
    """A psycopg-style query (``%(name)s`` placeholders) as a server-side one (``$1`` …) and
    the parameter names in ``$`` order; a name used twice is one parameter."""
    names: list[str] = []

    def number(match: re.Match[bytes]) -> bytes:
        name = match.group(1).decode()
        if name not in names:
            names.append(name)
        return b"$%d" % (names.index(name) + 1)

    out = re.sub(rb"%\((\w+)\)s", number, query)
    if b"%" in out.replace(b"%%", b""):
        raise ValueError("only %(name)s placeholders and %% are supported")
    return out.replace(b"%%", b"%"), tuple(names)


def result_error(result: psycopg.pq.abc.PGresult) -> psycopg.Error:
    """The psycopg exception for a failed result, chosen by its SQLSTATE as psycopg does."""
    state = (result.error_field(SQLSTATE) or b"").decode("ascii", "replace")
    message = (result.error_message or b"").decode("utf-8", "replace").strip()
    try:
        cls: type[psycopg.Error] = psycopg.errors.lookup(state)
    except KeyError:
        cls = psycopg.OperationalError  # no SQLSTATE: libpq's own (the connection failed)
    return cls(message or "the statement failed")


def deallocated(result: psycopg.pq.abc.PGresult) -> bool:
    """Whether a prepared statement failed because it no longer exists (SQLSTATE 26000):
    psycopg sends DEALLOCATE ALL after a DROP or a ROLLBACK it ran on the connection."""
    return result.error_field(SQLSTATE) == b"26000"


class Session:
    """One autocommit connection guarded by a lock, reconnected lazily after failures/forks."""

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.params = params
        self.lock = threading.Lock()
        self.conn: psycopg.Connection[Any] | None = None
        self.generation = 0
        """Counts connections opened: a session-tied lock is valid only in its generation."""
        self.prepared: set[bytes] = set()
        """Names of the statements :meth:`run_prepared` prepared on :attr:`conn`."""
        self._poller: Any = None  # a poll() object on conn's socket, made once per connection
        self._pid = os.getpid()

    def run_prepared(
        self, name: bytes, query: bytes, params: Sequence[bytes],
        formats: Sequence[int] | None = None, binary: bool = False,
    ) -> psycopg.pq.abc.PGresult:  # fmt: skip
        """Run a hot statement through libpq directly (``psycopg.pq``): prepared once per
        connection under ``name`` (server-side ``$n`` placeholders), then one
        ``PQexecPrepared`` per call, parameters already encoded (text, or binary where
        ``formats`` says 1), results as text or, with ``binary``, binary. Call under
        :attr:`lock` with the connection open.

        psycopg's ``Connection.execute`` builds a cursor, adapts every parameter and looks the
        query up in its prepared-statement cache on each call: ~35 µs of CPU per
        acquire+release pair on this path, more than the rest of latchkey. libpq's call
        releases the GIL while it waits; like every statement of ours it is bounded by the
        server's ``statement_timeout`` and by the connection's TCP keepalives and
        ``tcp_user_timeout``, but Ctrl-C takes effect only when it returns, so only short
        statements go this way (never a wait for a lock). Raises psycopg's exception for the
        SQLSTATE, as ``execute`` would.
        """
        assert self.conn is not None
        pgconn = self.conn.pgconn
        for again in (True, False):
            if name not in self.prepared:
                prepared = pgconn.prepare(name, query)
                if prepared.status != COMMAND_OK:
                    raise result_error(prepared)
                self.prepared.add(name)
            result = pgconn.exec_prepared(name, params, formats, 1 if binary else 0)
            status = result.status
            if status in (TUPLES_OK, COMMAND_OK):
                return result
            if not (again and deallocated(result)):
                break
            # Deallocated behind our back (psycopg sends DEALLOCATE ALL after a DROP or a
            # ROLLBACK it ran on this connection): prepare it again, once.
            self.prepared.discard(name)
        raise result_error(result)

    def open(self) -> psycopg.Connection[Any]:
        """A new autocommit connection (not the shared one), for listeners."""
        return psycopg.connect(autocommit=True, **self.params)

    def connection(self) -> psycopg.Connection[Any]:
        """The shared connection, opened if needed; call with :attr:`lock` held."""
        if not self.alive():
            self.conn = self.open()
            self.generation += 1
            self.prepared = set()
            self._poller = None
            if hasattr(select, "poll"):  # (Windows: _input_waiting's select() every time)
                self._poller = select.poll()
                self._poller.register(self.conn.pgconn.socket, select.POLLIN)
        assert self.conn is not None
        return self.conn

    def alive(self) -> bool:
        """Whether the shared connection is usable, without a round trip (call under lock).

        An idle connection has nothing to read unless the server ended it (terminated the
        session, shut down, restarted): such a connection is dropped here, so the next
        statement goes to a new session instead of failing on the dead one.
        """
        if self._pid != os.getpid():
            self.forget_after_fork()
        conn = self.conn
        if conn is None or conn.closed:
            return False
        if self._poller is not None and not self._poller.poll(0):
            return True  # nothing to read: the usual case, one syscall
        pgconn = conn.pgconn
        for _ in range(4):  # a goodbye message, then EOF, arrive as separate reads
            if pgconn.status != psycopg.pq.ConnStatus.OK:
                self.broken()
                return False
            if not _input_waiting(pgconn.socket):
                return True
            with contextlib.suppress(*DRIVER_ERRORS):
                pgconn.consume_input()
        return pgconn.status == psycopg.pq.ConnStatus.OK

    def broken(self) -> bool:
        """After an error: drop the connection if it is no longer usable (call under lock)."""
        conn = self.conn
        if conn is not None and (
            conn.closed or conn.broken or conn.pgconn.status != psycopg.pq.ConnStatus.OK
        ):
            self.conn = None
            with contextlib.suppress(*DRIVER_ERRORS):
                conn.close()
            return True
        return conn is None

    def forget_after_fork(self) -> None:
        self.lock = threading.Lock()
        if self.conn is not None:
            _FORKED_AWAY.append(self.conn)
        self.conn = None
        self.prepared = set()
        self._poller = None
        self._pid = os.getpid()

    def close(self) -> None:
        with self.lock:
            conn, self.conn = self.conn, None
        if conn is not None and self._pid == os.getpid():
            with contextlib.suppress(*DRIVER_ERRORS):
                conn.close()


def holder(token: int | None, owner_info: str | None, acquired: Any, expires: Any) -> Holder:
    return Holder(
        token=token,
        owner=Owner.from_json(owner_info),
        acquired_at=utc(acquired) if acquired is not None else None,
        expires_at=utc(expires) if expires is not None else None,
    )


# -- what the sync and asyncio backends share: rendering, schema check, reply parsing ---------


def render(context: Any, table: str, schema: str | None, template: str) -> bytes:
    """A statement template (see STATEMENTS) with the table's identifiers filled in, for a
    connection (sync or async: only its encoding and escaping are used)."""

    def ident(name: str) -> sql.Identifier:
        return sql.Identifier(schema, name) if schema else sql.Identifier(name)

    fence = ident(f"{table}_fence")
    return (
        sql.SQL(template)
        .format(
            locks=ident(table),
            fence=fence,
            fence_regclass=sql.Literal(fence.as_string(context)),
            records=ident(f"{table}_records"),
            waiters=ident(f"{table}_waiters"),
            meta=ident(f"{table}_meta"),
            expires_idx=sql.Identifier(f"{table}_expires"),
        )
        .as_bytes(context)
    )


def render_all(
    context: Any, table: str, schema: str | None
) -> tuple[dict[str, bytes], dict[str, tuple[bytes, bytes]]]:
    """Every statement rendered (key -> query), and the hot ones (FAST_PARAMS) in server-side
    form for ``run_prepared`` (key -> (prepared statement name, query with $n placeholders))."""
    rendered = {key: render(context, table, schema, text) for key, text in STATEMENTS.items()}
    fast: dict[str, tuple[bytes, bytes]] = {}
    for key, names in FAST_PARAMS.items():
        query, order = positional(rendered[key])
        assert order == names, (key, order)
        fast[key] = (b"latchkey_" + key.encode(), query)
    return rendered, fast


def check_schema_version(backend: Any, row: Sequence[Any] | None) -> None:
    """Refuse tables (SELECT_VERSION's ``row``) from a newer latchkey."""
    found = int(row[0]) if row else SCHEMA_VERSION
    if found > SCHEMA_VERSION:
        raise StoreUnavailable(
            f"{backend.scheme} store at {backend.url.redacted()}: table {backend.table} has "
            f"schema version {found}, newer than this latchkey ({SCHEMA_VERSION}); upgrade latchkey"
        )


def mutex_busy(row: Sequence[Any] | None) -> Grant | Busy:
    """The answer of a mutex acquire that found the name held, from its HOLDER ``row``."""
    if row is None:
        return Busy(holders=0)  # released in between: the core retries at once
    token, info, acquired, expires, left, mine = row
    if mine:  # a release handed it to us (we are queued): since when, we can't tell
        return Grant(token=token, expires_at=utc(expires), remaining=max(0.0, left))
    return Busy(holders=1, holder=holder(token, info, acquired, expires),
                retry_after=max(0.0, left))  # fmt: skip


def slot_answer(row: Sequence[Any]) -> Grant | Busy:
    """The answer of a semaphore acquire, from ACQUIRE_SLOT's one row."""
    token, expires, live, h_token, h_info, h_acquired, h_expires, left, *mine = row
    if mine[0] is not None:  # owner already holds a slot: that lease, as it is
        return Grant(token=mine[0], expires_at=utc(mine[1]), remaining=max(0.0, mine[2]))
    if token is not None:
        return Grant(token=token, expires_at=utc(expires))
    soonest = holder(h_token, h_info, h_acquired, h_expires) if h_token is not None else None
    return Busy(holders=live, holder=soonest,
                retry_after=max(0.0, left) if left is not None else None)  # fmt: skip


class PostgreSQLBackend(Backend):
    """Leases in a PostgreSQL table; see the module docstring for the layout."""

    scheme = "postgresql"
    capabilities = Capabilities(push=True)
    options: ClassVar[Mapping[str, Option]] = {
        "table": Option(table_name, "latchkey_locks", "lease table (also <table>_records …)"),
        "schema": Option(identifier, None, "schema of the tables (default: current schema)"),
        **CONNECTION_OPTIONS,
    }

    def __init__(self, url: StoreURL) -> None:
        super().__init__(url)
        self.table: str = self.config["table"]
        self.schema: str | None = self.config["schema"]
        self.channel = self.table  # NOTIFY channel: payload is the name's UTF-8 bytes in hex
        self._channel = self.channel.encode()
        self._session = Session(connection_params(url, self.config, "latchkey"))
        self._listener = Listener(self._session.open, self.channel, self._unclaimed)
        self._orphans: dict[int, tuple[str, str]] = {}  # ticket -> (name, owner)
        self._sql: dict[str, bytes] = {}
        # The hot statements in server-side form, for Session.run_prepared: name -> (prepared
        # statement name, query with $n placeholders).
        self._pq: dict[str, tuple[bytes, bytes]] = {}
        forget_in_forked_child(self)

    # -- plumbing ------------------------------------------------------------------------------

    def _render(self, conn: psycopg.Connection[Any], template: str) -> bytes:
        return render(conn, self.table, self.schema, template)

    def _render_all(self, conn: psycopg.Connection[Any]) -> None:
        """Render every statement once (:attr:`_sql`), and the hot ones in server-side form
        for :meth:`Session.run_prepared` (:attr:`_pq`)."""
        self._sql, self._pq = render_all(conn, self.table, self.schema)

    def _create(self, conn: psycopg.Connection[Any]) -> None:
        """Create what is missing, one process at a time; refuse tables from a newer version."""
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (DDL_LOCK_KEY,))
            if self.schema:
                conn.execute(
                    sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self.schema))
                )
            for statement in CREATE_STATEMENTS:
                conn.execute(self._render(conn, statement), {"version": str(SCHEMA_VERSION)})
            row = conn.execute(self._render(conn, SELECT_VERSION)).fetchone()
        check_schema_version(self, row)

    def _run(
        self, action: str, statement: str, params: Mapping[str, Any]
    ) -> tuple[list[tuple[Any, ...]], int]:
        """Run one named statement: (rows, rowcount). Creates the tables on first use."""
        session = self._session
        with session.lock:
            try:
                conn = session.connection()
                if not self._pq:
                    self._render_all(conn)
                query = self._sql[statement]
                try:
                    cur = conn.execute(query, params, prepare=True)
                except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName):
                    self._create(conn)  # first use: the tables are missing
                    cur = conn.execute(query, params, prepare=True)
                # Whether it returned rows, read off the result's status: cur.description
                # would build a Column object per column on every call (~10 µs a pair).
                result = cur.pgresult
                tuples = result is not None and result.status == TUPLES_OK
                return (cur.fetchall() if tuples else []), cur.rowcount
            except DRIVER_ERRORS as exc:
                session.broken()
                self.unavailable(exc, action)

    def _fast(
        self, statement: str, values: Sequence[bytes], formats: Sequence[int], what: str,
        name: str,
    ) -> psycopg.pq.abc.PGresult:  # fmt: skip
        """Run one of the hot statements (FAST_PARAMS) through libpq directly
        (:meth:`Session.run_prepared`), binary results; ``values`` encoded in FAST_PARAMS
        order. Creates the tables on first use, like :meth:`_run`."""
        session = self._session
        with session.lock:
            try:
                conn = session.connection()
                if not self._pq:
                    self._render_all(conn)
                prepared, query = self._pq[statement]
                try:
                    return session.run_prepared(prepared, query, values, formats, True)
                except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName):
                    self._create(conn)  # first use: the tables are missing
                    return session.run_prepared(prepared, query, values, formats, True)
            except DRIVER_ERRORS as exc:
                session.broken()
                self.unavailable(exc, f"{what} {name!r}")

    def _forget_after_fork(self) -> None:
        self._session.forget_after_fork()
        self._listener.forget_after_fork()

    # -- leases --------------------------------------------------------------------------------

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        if limit == 1:
            values = mutex_values(name, owner, owner_info, ttl)
            result = self._fast("acquire_mutex", values, MUTEX_FORMATS, "acquire", name)
            grant = mutex_granted(result)
            if grant is not None:
                return grant
            rows, _ = self._run(f"acquire {name!r}", "holder",
                                {"name": values[0], "owner": owner})  # fmt: skip
            return mutex_busy(rows[0] if rows else None)
        params = {
            "name": name.encode(),
            "owner": owner,
            "owner_info": owner_info,
            "ttl": float(ttl),
            "limit": limit,
        }
        rows, _ = self._run(f"acquire {name!r}", "acquire_slot", params)
        return slot_answer(rows[0])

    def release(self, name: str, owner: str) -> bool:
        result = self._fast("release", (name.encode(), owner.encode(), self._channel),
                            RELEASE_FORMATS, "release", name)  # fmt: skip
        return was_live(result)

    def wait_in_line(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Waiter:
        """Listen for releases of ``name`` and, for a mutex, queue ``owner`` so that a release
        hands the lease straight over (see the module docstring)."""
        if limit != 1:
            return self.subscribe(name)
        ticket = secrets.randbits(63)
        with self.translate(f"listen for releases of {name!r}", DRIVER_ERRORS):
            waiter, listener_key = self._listener.queue(
                name.encode().hex(), ticket, lambda w: self._leave_queue(name, owner, w)
            )
        params = {
            "name": name.encode(),
            "owner": owner,
            "owner_info": owner_info,
            "ttl": float(ttl),
            "ticket": ticket,
            "listener_key": listener_key,
        }
        try:
            self._run(f"queue for {name!r}", "enqueue", params)
        except BaseException:
            waiter.unsubscribe()
            raise
        return waiter

    def _leave_queue(self, name: str, owner: str, waiter: HandoffWaiter) -> None:
        """The end of a wait: leave the queue. If the wait ended without the lease (it timed
        out, or raised) but a release handed it over meanwhile, release it: that hands it to
        the next waiter. A lease the core returned is never touched."""
        if waiter.handed_over:
            return  # the release that handed it over also took us out of the queue
        try:
            rows, _ = self._run(
                f"leave the queue for {name!r}", "dequeue", {"name": name.encode(), "owner": owner}
            )
            if not rows and not waiter.acquired:  # handed over as we gave up: pass it on
                self.release(name, owner)
        except StoreUnavailable as exc:
            # The wait's outcome stands (and an outage is the caller's to see, not ours to
            # report twice). Our queue row may outlive it: should a release hand it a lease —
            # even after we took the lock by retrying and let it go — the listener hears of a
            # ticket nobody waits for, and _unclaimed releases that lease.
            if waiter.ticket is not None:
                self._orphans[waiter.ticket] = (name, owner)
            log.info("%s", exc)

    def _unclaimed(self, ticket: int) -> None:
        """A release handed a lease to a queue row whose waiter has left (see _leave_queue)."""
        orphan = self._orphans.pop(ticket, None)
        if orphan is not None:
            with contextlib.suppress(StoreUnavailable):
                self.release(*orphan)

    def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        params = {"name": name.encode(), "owner": owner, "ttl": float(ttl)}
        rows, _ = self._run(f"extend {name!r}", "extend", params)
        return Grant(token=rows[0][0], expires_at=utc(rows[0][1])) if rows else None

    def inspect(self, name: str) -> LockInfo | None:
        rows, _ = self._run(f"inspect {name!r}", "inspect", {"name": name.encode()})
        if not rows:
            return None
        return LockInfo(name=name, holders=tuple(holder(*row) for row in rows))

    def list(self, prefix: str = "") -> Iterator[LockInfo]:
        low = prefix.encode()
        high = _successor(low)
        rows, _ = self._run("list", "list", {"low": low, "high": high})
        infos: list[LockInfo] = []
        current: bytes | None = None
        holders: list[Holder] = []
        for raw, *rest in rows:
            raw = bytes(raw)
            if raw != current and current is not None:
                infos.append(LockInfo(current.decode(), tuple(holders)))
                holders = []
            current = raw
            holders.append(holder(*rest))
        if current is not None:
            infos.append(LockInfo(current.decode(), tuple(holders)))
        return iter(infos)

    def force_release(self, name: str) -> bool:
        params = {"name": name.encode(), "channel": self.channel}
        rows, _ = self._run(f"force-release {name!r}", "force_release", params)
        return any(live for live, _ in rows)

    def purge_expired(self) -> int:
        rows, _ = self._run("purge expired leases", "purge", {})
        return int(rows[0][0])

    # -- batch claims --------------------------------------------------------------------------

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        if not names:
            return {}
        params = {
            "names": [n.encode() for n in names],
            "owner": owner,
            "owner_info": owner_info,
            "ttl": float(ttl),
        }
        rows, _ = self._run(f"claim {len(names)} names", "claim", params)
        taken = {bytes(raw).decode(): Grant(token, utc(exp)) for raw, token, exp in rows}
        return {n: taken[n] for n in names if n in taken}

    def release_many(self, names: Sequence[str], owner: str) -> int:
        if not names:
            return 0
        params = {"names": [n.encode() for n in names], "owner": owner, "channel": self.channel}
        rows, _ = self._run(f"release {len(names)} names", "release_many", params)
        return int(rows[0][0])

    # -- versioned records ---------------------------------------------------------------------

    def record_get(self, name: str) -> tuple[str | None, int]:
        rows, _ = self._run(f"read record {name!r}", "record_get", {"name": name.encode()})
        return (rows[0][0], int(rows[0][1])) if rows else (None, 0)

    def record_set(self, name: str, value: str, version: int) -> int | None:
        params = {"name": name.encode(), "value": value, "version": version}
        statement = "record_insert" if version == 0 else "record_update"
        rows, _ = self._run(f"write record {name!r}", statement, params)
        return int(rows[0][0]) if rows else None

    def record_delete(self, name: str, version: int) -> bool:
        params = {"name": name.encode(), "version": version}
        rows, _ = self._run(f"delete record {name!r}", "record_delete", params)
        return bool(rows[0][0])

    # -- waiting, health, lifecycle ------------------------------------------------------------

    def subscribe(self, name: str) -> Waiter:
        with self.translate(f"listen for releases of {name!r}", DRIVER_ERRORS):
            return self._listener.subscribe(name.encode().hex())

    def now(self) -> datetime:
        rows, _ = self._run("read the clock", "now", {})
        return utc(rows[0][0])

    def init(self) -> None:
        session = self._session
        with session.lock, self.translate("create tables", DRIVER_ERRORS):
            try:
                self._create(session.connection())
            except DRIVER_ERRORS:
                session.broken()
                raise

    def close(self) -> None:
        self._listener.close()
        self._session.close()


def _successor(prefix: bytes) -> bytes | None:
    """The smallest byte string greater than every string starting with ``prefix``."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])
