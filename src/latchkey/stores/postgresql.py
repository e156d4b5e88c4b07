"""The ``postgresql://`` store: leases in a table, fencing tokens from a sequence.

Tables (``?table=``, default ``latchkey_locks``, in ``?schema=`` or the current schema; made
on first use or by ``init()``): ``<table>``, one row per lease slot keyed by ``(name, slot)``
(the name's UTF-8 bytes as ``bytea``, so NUL and any character round-trip; a mutex is slot 0)
with the owner token, the owner's JSON, the fencing token and the server-clock times;
``<table>_fence``, the one sequence tokens come from (so they strictly increase per name across
release, expiry, purge and restart); ``<table>_records``; ``<table>_meta`` (schema version);
``<table>_waiters`` (UNLOGGED: no WAL, emptied by a crash), the owners blocked in acquire of a
mutex, in arrival order, each with its process's listener key (below).

Every primitive is one statement in autocommit mode (one round trip, one commit); the
uncontended acquire and release go through libpq's prepared-statement call (``Prepared``).

Waiting is a line with turns (:mod:`latchkey.stores.postgresql_line` has its rules and
statements): the release of a lease just taken frees the name and rings the first live
waiter, and the first release after its 10 ms turn hands it the lease; a lease held a turn
or longer, or a waiter queued for a second, is handed over at once.

The tables' DDL and schema version: :mod:`latchkey.stores.postgresql_tables`. The I/O
(connections, the libpq fast path, the listener): :mod:`latchkey.stores.io.psycopg`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from latchkey._owner import Owner
from latchkey._types import Busy, Grant, Holder
from latchkey._url import Option, identifier
from latchkey.stores.base import BackendBase, Capabilities
from latchkey.stores.io import Steps
from latchkey.stores.io.psycopg import (
    CONNECTION_OPTIONS,
    LIBPQ,
    Prepared,
    int8,
    timestamptz,
    utc,
)
from latchkey.stores.postgresql_line import MUTEX_FORMATS, Line
from latchkey.stores.postgresql_rows import RowLeases
from latchkey.stores.postgresql_tables import COLUMNS, TAKE_MUTEX, TAKE_OVER, Tables, table_name
from latchkey.stores.primitives import AsyncStoreBackend, StoreBackend
from latchkey.stores.rows_sql import POSTGRESQL, RowClaims
from latchkey.stores.sql import LeaseTable, Query

#: The parameter formats of the release's Prepared statement: the name in binary, the owner text.
RELEASE_FORMATS = (1, 0)


def mutex_busy(row: Sequence[Any] | None) -> Grant | Busy:
    """The answer of a mutex acquire that found the name held, from its HOLDER ``row``."""
    if row is None:
        return Busy(holders=0)  # released in between: the core retries at once
    token, info, acquired, expires, left, mine = row
    if mine:  # a release handed it to us (we are queued): since when, we can't tell
        return Grant(token=token, expires_at=utc(expires), remaining=max(0.0, left))
    holder = Holder(token, Owner.from_json(info), utc(acquired), utc(expires))
    return Busy(holders=1, holder=holder, retry_after=max(0.0, left))


def slot_answer(row: Sequence[Any]) -> Grant | Busy:
    """The answer of a semaphore acquire, from ACQUIRE_SLOT's one row."""
    token, expires, live, h_token, h_info, h_acquired, h_expires, left, *mine = row
    if mine[0] is not None:  # owner already holds a slot: that lease, as it is
        return Grant(token=mine[0], expires_at=utc(mine[1]), remaining=max(0.0, mine[2]))
    if token is not None:
        return Grant(token=token, expires_at=utc(expires))
    if h_token is None:
        return Busy(holders=live)
    soonest = Holder(h_token, Owner.from_json(h_info), utc(h_acquired), utc(h_expires))
    return Busy(holders=live, holder=soonest, retry_after=max(0.0, left))


class PostgreSQL(Line, RowLeases, RowClaims, Tables, LeaseTable):
    """The lease table in PostgreSQL. Statements: ``{t}`` is the table's name (validated: an
    identifier, so quoting is enclosing it in quotes), ``{s}`` the quoted schema and a dot, or
    nothing; ``$n`` are parameters; names are always bytea parameters (their UTF-8 bytes)."""

    scheme = "postgresql"
    capabilities, ROWS = Capabilities(push=True, rows=True), POSTGRESQL
    options = {
        "table": Option(table_name, "latchkey_locks", "lease table (also <table>_records …)"),
        "schema": Option(identifier, None, "schema of the tables (default: current schema)"),
        **CONNECTION_OPTIONS,
    }
    driver_options = LIBPQ
    sync_driver = "latchkey.stores.io.psycopg:PsycopgDriver"
    async_driver = "latchkey.stores.io.psycopg_async:AsyncPsycopgDriver"

    # In: name, owner, owner_info, ttl (s). A mutex is slot 0: taken if free or expired, never
    # from a live lease. Out: (token, expires_at) if granted, no row if busy. One plain INSERT,
    # so the uncontended path costs a raw INSERT … ON CONFLICT; HOLDER only when busy.
    ACQUIRE_MUTEX = TAKE_MUTEX
    # In: name, owner. The live holder of a mutex, for a Busy answer: (token, owner_info,
    # acquired_at, expires_at, seconds left, whether it is ``owner``: a release handed it to us
    # while we were not looking); no row if it was released in between.
    HOLDER = """SELECT token, owner_info, acquired_at, expires_at,
    extract(epoch FROM expires_at - now())::float8, owner = $2
FROM {s}"{t}" WHERE name = $1 AND slot = 0 AND expires_at > now()"""
    # In: name, owner, owner_info, ttl (s), limit. A semaphore: takes the lowest free slot if
    # fewer than ``limit`` leases are live (expired rows are taken over, live ones never) and
    # ``owner`` holds none. Out: one row: (token, expires_at) if granted, else NULLs; the live
    # count; the soonest-expiring live holder (token, owner_info, acquired_at, expires_at,
    # seconds left); owner's own live lease (token, expires_at, seconds left) if it already
    # had one: that is the answer, never a second slot.
    ACQUIRE_SLOT = f"""WITH live AS (
    SELECT slot, owner, token, owner_info, acquired_at, expires_at FROM {{s}}"{{t}}"
    WHERE name = $1 AND expires_at > now()
), mine AS (SELECT token, expires_at FROM live WHERE owner = $2 ORDER BY slot LIMIT 1
), pick AS (
    SELECT s.slot FROM generate_series(0, $5::integer - 1) AS s (slot)
    WHERE (SELECT count(*) FROM live) < $5::integer AND NOT EXISTS (SELECT 1 FROM mine)
      AND s.slot NOT IN (SELECT slot FROM live) ORDER BY s.slot LIMIT 1
), taken AS (
    INSERT INTO {{s}}"{{t}}" AS l {COLUMNS}
    SELECT $1, pick.slot, $2, $3, nextval('{{s}}"{{t}}_fence"'), now(),
           now() + $4::float8 * interval '1s'
    FROM pick {TAKE_OVER} RETURNING l.token, l.expires_at)
SELECT taken.token, taken.expires_at, (SELECT count(*) FROM live),
       soonest.token, soonest.owner_info, soonest.acquired_at, soonest.expires_at,
       extract(epoch FROM soonest.expires_at - now())::float8,
       mine.token, mine.expires_at, extract(epoch FROM mine.expires_at - now())::float8
FROM (SELECT 1) AS one LEFT JOIN taken ON true LEFT JOIN mine ON true
LEFT JOIN LATERAL (SELECT * FROM live ORDER BY expires_at LIMIT 1) AS soonest ON true"""
    # In: name, owner, ttl. Moves the expiry of owner's *live* lease; the token stays.
    # Out: (token, expires_at), or no row if the lease is not live.
    EXTEND = """UPDATE {s}"{t}" SET expires_at = now() + $3::float8 * interval '1 second'
WHERE name = $1 AND owner = $2 AND expires_at > now() RETURNING token, expires_at"""
    # In: name. Out: the live holders, oldest first.
    INSPECT = """SELECT name, owner_info, token, acquired_at, expires_at FROM {s}"{t}"
WHERE name = $1 AND expires_at > now() ORDER BY acquired_at, slot"""
    # In: low, high (the prefix's byte range; high NULL: no bound). Out: live rows in name
    # order (bytea order is UTF-8 byte order, which is code point order).
    LIST = """SELECT name, owner_info, token, acquired_at, expires_at FROM {s}"{t}"
WHERE expires_at > now() AND name >= $1 AND ($2::bytea IS NULL OR name < $2)
ORDER BY name, acquired_at, slot"""
    # In: name. Deletes every lease of ``name`` whoever holds it and notifies waiters.
    # Out: one row per lease dropped, true if it was live.
    FORCE_RELEASE = """DELETE FROM {s}"{t}" WHERE name = $1
RETURNING expires_at > now(), pg_notify('{t}', encode(name, 'hex'))"""
    # In: limit. Deletes up to limit expired rows, oldest first through the expiry index (rows
    # being taken over right now are skipped, not waited for, so a purge never waits for a row
    # and cannot deadlock with CLAIM): its row count. Also drops queue rows of processes that
    # are gone (their listener key is free) or past their backstop.
    PURGE = """WITH expired AS (
    SELECT ctid FROM {s}"{t}" WHERE expires_at <= now() ORDER BY expires_at LIMIT $1
    FOR UPDATE SKIP LOCKED
), stale_waiters AS (
    DELETE FROM {s}"{t}_waiters"
    WHERE expires_at <= now() OR pg_try_advisory_xact_lock(listener_key)
)
DELETE FROM {s}"{t}" AS l USING expired WHERE l.ctid = expired.ctid AND l.expires_at <= now()"""
    # In: names (distinct, bytea[]), owner, owner_info, ttl. Takes slot 0 of every name with no
    # live lease, in name order (so concurrent claims lock rows in the same order and never
    # deadlock); one expiry for the batch. Out: (name, token, expires_at) per name taken.
    CLAIM = f"""INSERT INTO {{s}}"{{t}}" AS l {COLUMNS}
SELECT n.name, 0, $2, $3, nextval('{{s}}"{{t}}_fence"'), now(), now() + $4::float8 * interval '1s'
FROM unnest($1::bytea[]) AS n (name)
WHERE NOT EXISTS (SELECT 1 FROM {{s}}"{{t}}" AS o
                  WHERE o.name = n.name AND o.slot > 0 AND o.expires_at > now())
ORDER BY n.name {TAKE_OVER} RETURNING l.name, l.token, l.expires_at"""
    # In: names (bytea[]), owner. Deletes owner's rows of those names (locked in name order,
    # like CLAIM) and notifies waiters. Out: how many were live.
    RELEASE_MANY = """WITH mine AS (
    SELECT ctid FROM {s}"{t}" WHERE name = ANY($1::bytea[]) AND owner = $2
    ORDER BY name, slot FOR UPDATE
), gone AS (
    DELETE FROM {s}"{t}" AS l USING mine WHERE l.ctid = mine.ctid
    RETURNING l.name, l.expires_at > now() AS live
)
SELECT count(*) FILTER (WHERE live)
FROM (SELECT live, pg_notify('{t}', encode(name, 'hex')) FROM gone) AS notified"""
    # In: names (bytea[]), owner, tokens (bigint[]). A row lease's work commits with its end
    # (rows ``complete``, inside the work's transaction): deletes owner's leases of those
    # names that still carry those tokens and are live at this statement's start (not the
    # transaction's: the work took time), locked in name order like CLAIM; notifies waiters
    # at commit. Out: one row per lease ended (the caller rolls back unless it got them all).
    RELEASE_FENCED = """WITH mine AS (
    SELECT ctid FROM {s}"{t}" WHERE name = ANY($1::bytea[]) AND slot = 0 AND owner = $2
      AND token = ANY($3::bigint[]) AND expires_at > statement_timestamp()
    ORDER BY name FOR UPDATE
)
DELETE FROM {s}"{t}" AS l USING mine WHERE l.ctid = mine.ctid
RETURNING pg_notify('{t}', encode(l.name, 'hex'))"""
    # In: name. Out: (value, version) or no row.
    RECORD_GET = """SELECT value, version FROM {s}"{t}_records" WHERE name = $1"""
    # In: name, value. Creates the record at version 1 unless it exists. Out: a row or none.
    RECORD_INSERT = """INSERT INTO {s}"{t}_records" (name, value, version) VALUES ($1, $2, 1)
ON CONFLICT (name) DO NOTHING RETURNING version"""
    # In: value, name, version. Writes only if the version is unchanged, bumping it.
    RECORD_UPDATE = """UPDATE {s}"{t}_records" SET value = $1, version = version + 1
WHERE name = $2 AND version = $3 RETURNING version"""
    # In: name, version. Deletes only if the version is unchanged; version 0 means "absent",
    # still true if no row exists. Out: whether that held.
    RECORD_DELETE = """WITH gone AS (
    DELETE FROM {s}"{t}_records" WHERE name = $1 AND version = $2 RETURNING 1)
SELECT EXISTS (SELECT 1 FROM gone)
    OR ($2 = 0 AND NOT EXISTS (SELECT 1 FROM {s}"{t}_records" WHERE name = $1))"""
    NOW = "SELECT now()"

    def __init__(self, backend: BackendBase) -> None:
        super().__init__(backend)  # every statement with its {t} in, as an instance attribute
        self.schema: str | None = self.config["schema"]
        self.channel = self.table  # NOTIFY channel: payload is the name's UTF-8 bytes in hex
        schema = f'"{self.schema}".' if self.schema else ""
        for key, value in list(vars(self).items()):
            if key.isupper():
                setattr(self, key, value.replace("{s}", schema))
        self.acquire_pq, self.release_pq = self.ACQUIRE_MUTEX.encode(), self.RELEASE.encode()
        self.acquire_queued_pq = self.ACQUIRE_QUEUED.encode()
        self.in_line, self.orphans = {}, {}

    def time(self, value: Any) -> datetime:
        return utc(value)

    def was_live(self, result: tuple[list[Any], int]) -> bool:
        return any(row[0] for row in result[0])  # FORCE_RELEASE: one flag per lease dropped

    def prefix_params(self, prefix: bytes) -> Sequence[Any]:
        stripped = prefix.rstrip(b"\xff")  # the least string above all that start with prefix
        return (prefix, stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else None)

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Steps[Grant | Busy]:
        key = name.encode()
        if limit != 1:
            rows, _ = yield Query(self.ACQUIRE_SLOT, (key, owner, owner_info, float(ttl), limit))
            return slot_answer(rows[0])
        values = (key, owner.encode(), owner_info.encode(), repr(float(ttl)).encode())
        waiter = self.in_line.get((name, owner)) if self.in_line else None
        if waiter is None:
            result = yield Prepared(
                b"latchkey_acquire_mutex", self.acquire_pq, values, MUTEX_FORMATS
            )
        else:  # a queued waiter's attempt: taking the name takes it out of the queue
            # An attempt supersedes a hand-over not yet taken: a lease still ours is its
            # answer (HOLDER: mine), and one no longer ours (expired, taken since) must never
            # be returned later. A hand-over during the attempt is delivered again after.
            waiter.grant = None
            result = yield self.queued_attempt(values)
        if result.ntuples:
            if waiter is not None:
                waiter.left_line = True
            return Grant(int8(result.get_value(0, 0)), timestamptz(result.get_value(0, 1)))
        rows, _ = yield Query(self.HOLDER, (key, owner))
        return mutex_busy(rows[0] if rows else None)

    def release(self, name: str, owner: str) -> Steps[bool]:
        values = (name.encode(), owner.encode())
        result = yield Prepared(b"latchkey_release", self.release_pq, values, RELEASE_FORMATS)
        return bool(result.ntuples) and result.get_value(0, 0) == b"\x01"

    def extend(self, name: str, owner: str, ttl: float) -> Steps[Grant | None]:
        rows, _ = yield Query(self.EXTEND, (name.encode(), owner, float(ttl)))
        return Grant(token=rows[0][0], expires_at=utc(rows[0][1])) if rows else None

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> Steps[dict[str, Grant]]:
        rows, _ = yield Query(self.CLAIM, ([n.encode() for n in names], owner, owner_info, ttl))
        taken = {bytes(raw).decode(): Grant(token, utc(exp)) for raw, token, exp in rows}
        return {n: taken[n] for n in names if n in taken}

    def release_many(self, names: Sequence[str], owner: str) -> Steps[int]:
        rows, _ = yield Query(self.RELEASE_MANY, ([n.encode() for n in names], owner))
        return int(rows[0][0])

    def release_fenced(self, names: Sequence[str], owner: str, tokens: Sequence[int]) -> Steps[int]:
        params = ([n.encode() for n in names], owner, list(tokens))
        rows, _ = yield Query(self.RELEASE_FENCED, params)
        return len(rows)

    def record_delete(self, name: str, version: int) -> Steps[bool]:
        rows, _ = yield Query(self.RECORD_DELETE, (name.encode(), version))
        return bool(rows[0][0])


class PostgreSQLBackend(StoreBackend):
    store_class = PostgreSQL


class AsyncPostgreSQLBackend(AsyncStoreBackend):
    store_class = PostgreSQL
