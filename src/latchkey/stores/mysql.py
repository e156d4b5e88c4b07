"""``mysql://user:pass@host:3306/database``: leases in an InnoDB table (MySQL 8, MariaDB ≥ 10.6).

Also registered as ``mariadb://``. The lease table is the SQL design SQLite and PostgreSQL
share (:mod:`latchkey.stores.sql`): one row per lease slot keyed by (name, slot), with the
owner token, the owner's JSON, the fencing token and the server-clock times
(``UTC_TIMESTAMP(6)``). Names are stored as their UTF-8 bytes (``VARBINARY(255)``, compared
bytewise), so any character, NUL included, round-trips.

Every primitive is one round trip, and acquire is one autocommitted statement: an ``INSERT … ON
DUPLICATE KEY UPDATE`` whose every assignment is conditional on the old lease having expired; on
MariaDB it ends in ``RETURNING`` the row as it now stands and runs as a statement prepared once
per connection (acquire and release are then short ``EXECUTE`` statements); on MySQL it is
followed, in the same multi-statement query, by a plain read of the name's live leases. Either
tells whether we won and, if not, who holds it until when. The row's X lock makes concurrent
takers of one slot queue; the second sees the first's live lease and changes nothing, so two
owners never hold one slot whatever the isolation level (REPEATABLE READ, the default, is
fine). A deadlock or lock-wait timeout (the driver raises :class:`Contended` into the
primitive) is a lost race (``Busy`` with fewer holders than the limit): the core retries at once.

Fencing tokens are the lease table's ``AUTO_INCREMENT`` column: the upsert draws a fresh value
for every row it inserts and copies it (``VALUES(token)``) into every row it takes over, so a
grant needs no second statement. InnoDB keeps that counter across DELETE, purge and restart on
MySQL 8 and MariaDB ≥ 10.2.4 and values are never reused. An INSERT draws its values when it
starts, before it waits for a row lock; so every upsert names one row (a batch claim is one
upsert per name, in one transaction: CLAIM): it waits only for that row, whose holder's grant,
if any, drew its value before ours, and tokens increase per name (and across a semaphore's
slots) in grant order.

Several hosts (``mysql://user@h1:3306,h2:3306/db``): each new connection goes to the first that
takes writes, so the store follows a failover by itself (:mod:`latchkey.stores.io.mysql_dsn`).
A failover keeps the token counter's order: a replica's InnoDB raises its ``AUTO_INCREMENT``
past every token it replicates, inserted or updated (MariaDB 10.11, row-based and mixed
binary logs: ``tests/failover/test_mysql_failover.py``).

Options: ``?table=``, ``?timeout=`` (connect/read/write, default 5 s). Drivers, imported only
by the API that uses them: PyMySQL (:mod:`latchkey.stores.io.pymysql`; docs/stores/mysql.md
says why) and asyncmy (:mod:`latchkey.stores.io.asyncmy`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from latchkey._owner import Owner
from latchkey._types import Busy, Grant, Holder
from latchkey.stores.base import BackendBase, Capabilities
from latchkey.stores.io import Steps
from latchkey.stores.io.mysql_dsn import MYSQL_DRIVER, store_connect_args
from latchkey.stores.io.mysql_session import SESSION, Contended, Duplicate
from latchkey.stores.mysql_bells import Bells, heir_of, ours_marked
from latchkey.stores.mysql_tables import Tables
from latchkey.stores.mysql_tables import micros as _us
from latchkey.stores.primitives import AsyncStoreBackend, StoreBackend
from latchkey.stores.rows_sql import MYSQL, RowClaims
from latchkey.stores.sql import LeaseTable, Query

# The takeover clause of every upsert: on a duplicate key each column changes only if the old
# lease has expired. expires_at is assigned last, so every test still sees the old value
# (MySQL assigns left to right); the token becomes the value this INSERT drew from
# AUTO_INCREMENT. A live lease is left untouched (affected rows 0).
TAKE_EXPIRED = """
    owner       = IF(expires_at <= UTC_TIMESTAMP(6), VALUES(owner), owner),
    owner_info  = IF(expires_at <= UTC_TIMESTAMP(6), VALUES(owner_info), owner_info),
    token       = IF(expires_at <= UTC_TIMESTAMP(6), VALUES(token), token),
    acquired_at = IF(expires_at <= UTC_TIMESTAMP(6), VALUES(acquired_at), acquired_at),
    expires_at  = IF(expires_at <= UTC_TIMESTAMP(6), VALUES(expires_at), expires_at)"""

# One lease as one tab-joined text column: ours → '1', token, expires_at, microseconds until it
# ends (the owner's own live lease found again is answered as it is); another owner's →
# '0', token, expires_at, acquired_at, microseconds until it ends, owner_info (last: the JSON
# never holds a raw tab). One column, not six: PyMySQL parses every column descriptor in
# Python, which cost more than the statement itself; and a grant (the usual answer) carries
# neither the owner JSON nor the times it does not need. The alias keeps the column's name
# (otherwise this text, sent and parsed at every call) short. {me}: the owner token's marker;
# {waited}: on MariaDB, the lease's ``waited`` mark after the time left (mysql_bells.py).
LEASE_TEXT = """IF(owner = {me},
    CONCAT_WS(CHAR(9 USING utf8mb4), 1, token, expires_at,
              TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at){waited}),
    CONCAT_WS(CHAR(9 USING utf8mb4), 0, token, expires_at, acquired_at,
              TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at), owner_info)) AS lease"""

# The live leases of a name, soonest-expiring first, each as LEASE_TEXT. In: owner, name.
LIVE_OF = f"""
SELECT {LEASE_TEXT.format(me="%(owner)s", waited="")}
  FROM {{t}} WHERE name = %(name)s AND expires_at > UTC_TIMESTAMP(6) ORDER BY expires_at"""

# Mutex acquire: one statement. In: name, owner, info, ttl_us. Takes slot 0 if it is absent
# or expired; then LIVE_OF tells whether we hold it (our token, expiry) or who does.
ACQUIRE = f"""
INSERT INTO {{t}} (name, slot, owner, owner_info, token, acquired_at, expires_at)
VALUES (%(name)s, 0, %(owner)s, %(info)s, NULL, UTC_TIMESTAMP(6),
        UTC_TIMESTAMP(6) + INTERVAL %(ttl_us)s MICROSECOND)
ON DUPLICATE KEY UPDATE {TAKE_EXPIRED};
{LIVE_OF}"""

# Mutex acquire on MariaDB (≥ 10.5 has INSERT … RETURNING): the same upsert returns the row as
# it now stands, ours (taken) or the live holder's (busy: a mutex has one), so the read-back
# statement and its result set are saved. Prepared once per connection (PREPARE below): the
# server then parses only the short EXECUTE, not this text, at each acquire. In (?): name,
# owner, info, ttl_us, owner. Out: one row, LEASE_TEXT.
ACQUIRE_RETURNING = f"""
INSERT INTO {{t}} (name, slot, owner, owner_info, token, acquired_at, expires_at)
VALUES (?, 0, ?, ?, NULL, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)
ON DUPLICATE KEY UPDATE {TAKE_EXPIRED}
RETURNING {LEASE_TEXT.format(me="?", waited=", waited")}"""

# Semaphore acquire. In: name, owner, info, ttl_us, limit. First a plain read picks the slot
# the owner already holds live, if any (the upsert then leaves it as it is), else the lowest
# free slot below the limit (an expired row, or a missing slot number); that is only
# a hint: the upsert takes it only if it is still free, and when none was free it targets
# slot 0, which changes nothing unless slot 0 has just expired (then it is free: fine).
ACQUIRE_SLOT = f"""
SET @lk_name = %(name)s;
SET @lk_slot = IFNULL((
    SELECT MIN(slot) FROM {{t}}
     WHERE name = @lk_name AND owner = %(owner)s AND expires_at > UTC_TIMESTAMP(6)
), IFNULL((
    SELECT MIN(f.slot) FROM (
        SELECT slot FROM {{t}}
         WHERE name = @lk_name AND slot < %(limit)s AND expires_at <= UTC_TIMESTAMP(6)
        UNION ALL
        SELECT 0 FROM DUAL
         WHERE NOT EXISTS (SELECT 1 FROM {{t}} WHERE name = @lk_name AND slot = 0)
        UNION ALL
        SELECT a.slot + 1 FROM {{t}} a
         WHERE a.name = @lk_name AND a.slot + 1 < %(limit)s
           AND NOT EXISTS (SELECT 1 FROM {{t}} b WHERE b.name = @lk_name AND b.slot = a.slot + 1)
    ) AS f), 0));
INSERT INTO {{t}} (name, slot, owner, owner_info, token, acquired_at, expires_at)
VALUES (@lk_name, @lk_slot, %(owner)s, %(info)s, NULL, UTC_TIMESTAMP(6),
        UTC_TIMESTAMP(6) + INTERVAL %(ttl_us)s MICROSECOND)
ON DUPLICATE KEY UPDATE {TAKE_EXPIRED};
{LIVE_OF}"""

# Batch claim: one upsert per name, in one transaction, then what we own. In (positional):
# owner, info, ttl_us, the sorted names ({rows}: one CLAIM_ROW each; sorted so that
# concurrent claims lock rows in one order), owner, the names again ({names}). One statement
# per name, not one multi-row upsert: an INSERT draws its AUTO_INCREMENT values when it
# starts, so a multi-row one drew every name's token before waiting for the first name's row;
# meanwhile another worker could lease a later name and release it, and our grant of that
# name then carried a smaller token than the one before it. Each statement draws its name's
# token after the waits for the names before it, as a single acquire does. One transaction:
# one commit for the batch. A failed statement leaves the transaction open (a lock-wait
# timeout rolls back only the statement): claim() rolls it back.
CLAIM = """
SET @lk_own = %s, @lk_info = %s, @lk_ttl = %s;
START TRANSACTION;
{rows}
SELECT name, token, expires_at FROM {t}
 WHERE owner = %s AND name IN ({names}) AND slot = 0 AND expires_at > UTC_TIMESTAMP(6);
COMMIT"""
CLAIM_ROW = f"""
INSERT INTO {{t}} (name, slot, owner, owner_info, token, acquired_at, expires_at)
VALUES (%s, 0, @lk_own, @lk_info, NULL, UTC_TIMESTAMP(6),
        UTC_TIMESTAMP(6) + INTERVAL @lk_ttl MICROSECOND)
ON DUPLICATE KEY UPDATE {TAKE_EXPIRED};"""
# On MariaDB CLAIM_ROW is prepared per connection (with ? for %s): a claim of ten names then
# sends and parses ten short EXECUTEs, not ten copies of the upsert.
CLAIM_ROW_PREPARED = CLAIM_ROW.replace("%s", "?").strip().rstrip(";")
EXECUTE_CLAIM_ROW = "\nEXECUTE latchkey_claim_row USING %s;"

# Ends our live lease. In: name, owner. Rowcount 1 if it was live; never another owner's row.
# An expired row of ours is left for the next taker or purge (it is already free). MariaDB
# releases with mysql_bells.RELEASE instead (prepared per connection).
RELEASE = "DELETE FROM {t} WHERE name = %s AND owner = %s AND expires_at > UTC_TIMESTAMP(6)"
# Ends our live leases on many names. In: owner, names. Rowcount: how many were live.
RELEASE_MANY = (
    "DELETE FROM {t} WHERE owner = %s AND name IN ({names}) AND expires_at > UTC_TIMESTAMP(6)"
)
# A row lease's work commits with its end (rows ``complete``, inside the work's transaction):
# deletes our leases of those names that still carry those tokens and are live now. In:
# owner, names (sorted: rows locked in one order, like CLAIM), tokens. Rowcount: how many
# (the caller rolls back unless it is every one).
RELEASE_FENCED = (
    "DELETE FROM {t} WHERE owner = %s AND slot = 0 AND name IN ({names}) "
    "AND token IN ({tokens}) AND expires_at > UTC_TIMESTAMP(6) ORDER BY name"
)
# Moves our live lease's end, then reads it back. In: name, owner, ttl_us. No row: not live
# (the read uses the same instant, so an expired lease is never reported extended).
EXTEND = """
SET @lk_now = UTC_TIMESTAMP(6);
UPDATE {t} SET expires_at = @lk_now + INTERVAL %(ttl_us)s MICROSECOND
 WHERE name = %(name)s AND owner = %(owner)s AND expires_at > @lk_now;
SELECT token, expires_at FROM {t}
 WHERE name = %(name)s AND owner = %(owner)s AND expires_at > @lk_now"""
# Live holders of a name, oldest first. In: name.
INSPECT = (
    "SELECT name, owner_info, token, acquired_at, expires_at FROM {t} "
    "WHERE name = %s AND expires_at > UTC_TIMESTAMP(6) ORDER BY acquired_at, token"
)
# Live holders of every name with a byte prefix, by name. In: LIKE pattern ('!' escapes).
LIST = (
    "SELECT name, owner_info, token, acquired_at, expires_at FROM {t} "
    "WHERE name LIKE %s ESCAPE '!' AND expires_at > UTC_TIMESTAMP(6) "
    "ORDER BY name, acquired_at, token"
)
# Drops every live lease on a name (expired rows are already free). Rowcount: how many.
FORCE_RELEASE = "DELETE FROM {t} WHERE name = %s AND expires_at > UTC_TIMESTAMP(6)"
# In: limit. Deletes up to limit expired rows, oldest first, through the expiry index; the
# token counter (AUTO_INCREMENT) is not touched by deletes. Rowcount: how many.
PURGE = "DELETE FROM {t} WHERE expires_at <= UTC_TIMESTAMP(6) ORDER BY expires_at LIMIT %s"
RECORD_GET = "SELECT value, version FROM {t}_records WHERE name = %s"
# version 0: create only if absent (a duplicate key means someone created it first).
RECORD_INSERT = "INSERT INTO {t}_records (name, value, version) VALUES (%s, %s, 1)"
# Compare-and-set: writes only if the version is still the one read. In: value, name, version.
RECORD_UPDATE = (
    "UPDATE {t}_records SET value = %s, version = version + 1 WHERE name = %s AND version = %s"
)
RECORD_DELETE = "DELETE FROM {t}_records WHERE name = %s AND version = %s"
SELECT_NOW = "SELECT UTC_TIMESTAMP(6)"

# MariaDB: the hot statements, prepared at connect (names are per session). MariaDB's EXECUTE
# takes literal values (MySQL's only user variables), which the driver escapes as it does any
# parameter. The prepared text is itself a parameter of PREPARE. In: the three statement
# texts (the release's: mysql_bells.RELEASE, a compound statement).
PREPARE = (
    "PREPARE latchkey_acquire FROM %s; PREPARE latchkey_release FROM %s; "
    "PREPARE latchkey_claim_row FROM %s"
)
# Positional parameters (a tuple is escaped with less work than a dict). In: name, owner,
# info, ttl_us, owner.
EXECUTE_ACQUIRE_ARGS = "EXECUTE latchkey_acquire USING %s, %s, %s, %s, %s"


def utc(value: datetime) -> datetime:
    return value.replace(tzinfo=timezone.utc)


class MySQL(Tables, Bells, RowClaims, LeaseTable):
    """The lease table in MySQL or MariaDB (see the module docstring)."""

    scheme = "mysql"
    capabilities, ROWS = Capabilities(rows=True), MYSQL
    driver_options = MYSQL_DRIVER
    sync_driver = "latchkey.stores.io.pymysql:PyMySQLDriver"
    async_driver = "latchkey.stores.io.asyncmy:AsyncmyDriver"
    RELEASE, INSPECT, LIST, FORCE_RELEASE, PURGE = RELEASE, INSPECT, LIST, FORCE_RELEASE, PURGE
    RECORD_GET, RECORD_INSERT, RECORD_UPDATE = RECORD_GET, RECORD_INSERT, RECORD_UPDATE
    RECORD_DELETE, NOW = RECORD_DELETE, SELECT_NOW
    ACQUIRE, ACQUIRE_RETURNING, ACQUIRE_SLOT = ACQUIRE, ACQUIRE_RETURNING, ACQUIRE_SLOT
    CLAIM, CLAIM_ROW, RELEASE_MANY, EXTEND = CLAIM, CLAIM_ROW, RELEASE_MANY, EXTEND
    RELEASE_FENCED = RELEASE_FENCED
    CLAIM_ROW_PREPARED = CLAIM_ROW_PREPARED

    def __init__(self, backend: BackendBase) -> None:
        super().__init__(backend)
        self.prepared = False  # acquire, release, claim EXECUTE (MariaDB): set by setup()
        self.connect_args: dict[str, Any] = store_connect_args(backend)  # borrowed: none

    def setup(self, server_version: str) -> list[Query]:
        """The statements each new connection runs first (the driver's): the session's
        settings, the tables, and on MariaDB the hot statements prepared."""
        self.prepared = "mariadb" in server_version.lower()
        steps = [Query(SESSION, (self.lock_wait_timeout(),)), self.tables()]
        if self.prepared:
            texts = (self.ACQUIRE_RETURNING, self.RELEASE_PREPARED, self.CLAIM_ROW_PREPARED)
            steps += [self.add_waited(), Query(PREPARE, texts)]
        return steps

    def lock_wait_timeout(self) -> int:
        """``innodb_lock_wait_timeout`` (whole seconds): a row-lock wait ends before our
        timeout."""
        return max(1, math.floor(self.timeout / 2))

    def time(self, value: Any) -> datetime:
        return utc(value)

    def prefix_params(self, prefix: bytes) -> Sequence[Any]:
        for special in (b"!", b"%", b"_"):  # a LIKE pattern, '!' the escape
            prefix = prefix.replace(special, b"!" + special)
        return (prefix + b"%",)

    # -- primitives ------------------------------------------------------------------------------

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Steps[Grant | Busy]:
        if self.orphans:  # a lease handed to a wait that failed, never given back: first
            yield from self.give_back(name, again=False)  # (the bell gives back again)
        if limit == 1 and self.prepared:  # a tuple is cheaper to escape than a dict
            query = Query(EXECUTE_ACQUIRE_ARGS, (name.encode(), owner, owner_info, _us(ttl), owner))
        else:
            params = {"name": name.encode(), "owner": owner, "info": owner_info,
                      "ttl_us": _us(ttl), "limit": limit}  # fmt: skip
            query = Query(self.ACQUIRE if limit == 1 else self.ACQUIRE_SLOT, params)
        try:
            rows, _ = yield query
        except Contended:
            return Busy(0)  # lost a deadlock: a race, not a busy lock; the core retries
        leases = [_text(row[0]).split("\t", 5) for row in rows]
        for lease in leases:
            if lease[0] == "1":  # ours: '1', token, expires_at, microseconds left[, waited]
                if ours_marked(lease):
                    self.took_marked(name, owner)
                return Grant(int(lease[1]), _datetime(lease[2]), int(lease[3]) / 1e6)
        if not leases:
            return Busy(0)  # the lease we found live ended before we read it: retry
        _, token, expires, acquired, micros, info = leases[0]
        holder = Holder(int(token), Owner.from_json(info), _datetime(acquired), _datetime(expires))
        return Busy(len(leases), holder, max(0.0, int(micros) / 1e6))

    def release(self, name: str, owner: str) -> Steps[bool]:
        if not self.prepared:
            _, count = yield Query(self.RELEASE, (name.encode(), owner))
            return bool(count > 0)
        # The plain DELETE first, unless taken over marked, or a bell of ours may name us
        quiet = not self.marked.pop((name, owner), False) and self.heirs.get(name) != owner
        return (yield from self.release_ringing(name, owner, quiet))

    def extend(self, name: str, owner: str, ttl: float) -> Steps[Grant | None]:
        params = {"name": name.encode(), "owner": owner, "ttl_us": _us(ttl)}
        rows, _ = yield Query(self.EXTEND, params)
        return Grant(int(rows[0][0]), utc(rows[0][1])) if rows else None

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> Steps[dict[str, Grant]]:
        if not names:
            return {}
        keys = sorted(name.encode() for name in names)
        marks = ", ".join(["%s"] * len(keys))
        row = EXECUTE_CLAIM_ROW if self.prepared else self.CLAIM_ROW
        sql = self.CLAIM.format(rows="".join([row] * len(keys)), names=marks)
        try:
            rows, _ = yield Query(sql, (owner, owner_info, _us(ttl), *keys, owner, *keys))
        except Contended:
            # Lost a deadlock (the server rolled the transaction back) or waited out the
            # lock-wait timeout (it rolled back that statement only): nothing of this claim
            # may commit. Every name was contended just now.
            yield Query("ROLLBACK")
            return {}
        return {bytes(row[0]).decode(): Grant(int(row[1]), utc(row[2])) for row in rows}

    def release_many(self, names: Sequence[str], owner: str) -> Steps[int]:
        if not names:
            return 0
        keys = [name.encode() for name in names]
        sql = self.RELEASE_MANY.format(names=", ".join(["%s"] * len(keys)))
        _, count = yield Query(sql, (owner, *keys))
        return int(count)

    def release_fenced(self, names: Sequence[str], owner: str, tokens: Sequence[int]) -> Steps[int]:
        keys = sorted(name.encode() for name in names)
        sql = self.RELEASE_FENCED.format(
            names=", ".join(["%s"] * len(keys)), tokens=", ".join(["%s"] * len(tokens))
        )
        _, count = yield Query(sql, (owner, *keys, *tokens))
        return int(count)

    def record_get(self, name: str) -> Steps[tuple[str | None, int]]:
        rows, _ = yield Query(self.RECORD_GET, (name.encode(),))
        return (_text(rows[0][0]), int(rows[0][1])) if rows else (None, 0)

    def record_set(self, name: str, value: str, version: int) -> Steps[int | None]:
        if version != 0:
            return (yield from super().record_set(name, value, version))
        try:
            yield Query(self.RECORD_INSERT, (name.encode(), value))
        except Duplicate:
            return None  # created first by another
        return 1


class MySQLBackend(StoreBackend):
    store_class = MySQL

    def wait_in_line(self, name: str, owner: str, owner_info: str, ttl: float, limit: int) -> Any:
        """MariaDB: a waiter (a lease's, or a row take's: ``subscribe``) has the process's
        bell rung (``mysql_bells``)."""
        bell = self.io.bell if self.store.prepared else None  # type: ignore[attr-defined]
        if bell is None:
            return super().wait_in_line(name, owner, owner_info, ttl, limit)
        return bell.join(name, heir_of(owner, owner_info, ttl, limit))


class AsyncMySQLBackend(AsyncStoreBackend):
    store_class = MySQL

    async def wait_in_line(self, name: str, owner: str, info: str, ttl: float, limit: int) -> Any:
        """As the sync backend's: a mutex waiter is its bell's heir (``mysql_bells``)."""
        bell = self.io.bell if self.store.prepared else None  # type: ignore[attr-defined]
        if bell is None:
            return await super().wait_in_line(name, owner, info, ttl, limit)
        return await bell.join(name, heir_of(owner, info, ttl, limit))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _datetime(text: str) -> datetime:
    """'YYYY-MM-DD HH:MM:SS.ffffff' → aware UTC (with its offset: 6x faster than naive)."""
    return datetime.fromisoformat(text + "+00:00")

