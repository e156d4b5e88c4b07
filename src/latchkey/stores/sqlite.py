"""``sqlite:///path/locks.db``: the embedded default, safe for many processes on one machine.

The lease table is the SQL design PostgreSQL and MySQL share: one row per live lease slot,
keyed by (name, slot), with the owner token, the owner's JSON, the fencing token and the
store-clock times. Names are stored as their UTF-8 bytes (BLOB) so that any character,
NUL included, round-trips. Fencing tokens come from one counter in ``<table>_meta``, so they
increase per name across release, expiry, purge and restart.

Each primitive is one statement, or one short ``BEGIN IMMEDIATE`` transaction that SQLite
serialises across processes (WAL mode; readers never block). URL: ``sqlite:///relative.db``,
``sqlite:////absolute/path.db``; options ``?table=``, ``?synchronous=normal|full``,
``?timeout=`` (how long to wait for another process's write transaction).

Waiting: a release rings the first waiter's doorbell (``stores/io/doorbell.py``), and takes
turns as PostgreSQL's line does (``postgresql_line.py``): the rung waiter has ``TURN_MS`` to
win the free name by its own attempt, while anyone else (most often the holder looping on the
name, which pays no wake-up) may still take it, and releases within the turn ring nobody. The
first release after the turn, or any release once first has waited ``STARVED_MS``, *reserves*
the name for first instead of freeing it: the lease row becomes ``~<first's ticket>`` for
``RESERVE_MS`` (a lease nobody holds: ``inspect`` and ``ls`` do not show it, an attempt finds
the name busy, a purge or the next attempt after it lapses removes it) and first is rung; its
attempt takes the reserved slot. A waiter whose process is gone is not rung but passed over.

``latchkey.connect(client=engine)`` with a SQLAlchemy Engine over ``sqlite+pysqlite``: the
engine's file, opened by latchkey's own connections as from a URL (the engine's pool is not
used: latchkey's locking needs its own ``BEGIN IMMEDIATE`` transactions and WAL mode, which
stays on the file); an in-memory database or a URI filename is a ConfigError.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from latchkey._types import Busy, Grant
from latchkey._url import Option, choice
from latchkey.errors import ConfigError
from latchkey.stores.base import BackendBase, Capabilities
from latchkey.stores.io import Steps
from latchkey.stores.io.doorbell import First, InLine, Listen, Ring
from latchkey.stores.primitives import AsyncStoreBackend, BusyMemory, StoreBackend
from latchkey.stores.rows_sql import SQLITE, RowClaims
from latchkey.stores.sql import LeaseTable, Query, chunks

SCHEMA_VERSION = 1
#: The rung waiter's turn to take the free name by its own attempt (module docstring).
TURN_MS = 50
#: A first waiter that came this long ago gets the name reserved at the next release.
STARVED_MS = 1000
#: How long a reservation keeps the name for its waiter (then anyone may take it).
RESERVE_MS = 500
#: A reservation's owner: this, then the waiter's ticket. Owner tokens are hex.
RESERVED = "~"
#: Variables per statement for batch operations (SQLite allows 32766 since 3.32).
CHUNK = 500

# The store's clock in integer milliseconds since the epoch ('now' is fixed within a statement).
NOW_MS = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)"

# {t}: the validated table name. Created at connect; IF NOT EXISTS makes that safe to race.
CREATE = """
CREATE TABLE IF NOT EXISTS {t} (
    name        BLOB    NOT NULL,   -- the lock name's UTF-8 bytes
    slot        INTEGER NOT NULL,   -- 0 for a mutex; 0..limit-1 for a semaphore
    owner       TEXT    NOT NULL,   -- the holder's secret owner token
    owner_info  TEXT    NOT NULL,   -- JSON: host, pid, started, thread, metadata
    token       INTEGER NOT NULL,   -- fencing token
    acquired_at INTEGER NOT NULL,   -- ms since epoch, store clock
    expires_at  INTEGER NOT NULL,   -- ms since epoch, store clock; <= now means free
    PRIMARY KEY (name, slot)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS {t}_expires ON {t} (expires_at);
CREATE TABLE IF NOT EXISTS {t}_meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO {t}_meta (key, value) VALUES ('schema_version', {version}), ('fence', 0);
CREATE TABLE IF NOT EXISTS {t}_records (
    name    BLOB    PRIMARY KEY,
    value   TEXT    NOT NULL,       -- JSON
    version INTEGER NOT NULL        -- 1 after the first write, +1 per write
);
"""

# Frees the expired slots of one name (inside acquire's transaction). In: name, now.
DELETE_EXPIRED_OF = "DELETE FROM {t} WHERE name = ? AND expires_at <= ?"
# The live slots of one name, soonest-expiring first. In: name. Out: slot, info, token, times,
# owner.
LIVE_OF = (
    "SELECT slot, owner_info, token, acquired_at, expires_at, owner FROM {t} "
    "WHERE name = ? ORDER BY expires_at"
)
# The same as a read, no write lock taken, with the clock: how an attempt at a name found busy
# a moment ago looks first (a waiter's retry; BEGIN IMMEDIATE only if it looks free). In: name.
# Out: as LIVE_OF, live rows only, then now (one 'now' for the whole statement).
PEEK_LIVE = (
    f"SELECT slot, owner_info, token, acquired_at, expires_at, owner, {NOW_MS} FROM {{t}} "
    f"WHERE name = ? AND expires_at > {NOW_MS} ORDER BY expires_at"
)
# Takes the next fencing token(s). In: how many. Out: the last token taken.
NEXT_FENCE = "UPDATE {t}_meta SET value = value + ? WHERE key = 'fence' RETURNING value"
# Records a lease in a free slot. In: name, slot, owner, info, token, acquired, expires.
INSERT_LEASE = "INSERT OR REPLACE INTO {t} VALUES (?, ?, ?, ?, ?, ?, ?)"
# Ends our lease (live or not). In: name, owner. Out: whether it was live. Never another's.
RELEASE = f"DELETE FROM {{t}} WHERE name = ? AND owner = ? RETURNING expires_at > {NOW_MS}"
# Keeps our live lease's row for a waiter instead of ending it (module docstring). In:
# reservation owner, ms, name, owner. Out: a row if it was live (else RELEASE ends it).
RESERVE = (
    f"UPDATE {{t}} SET owner = ?, expires_at = {NOW_MS} + ? "
    f"WHERE name = ? AND owner = ? AND expires_at > {NOW_MS} RETURNING 1"
)
# Moves our live lease's end. In: ttl ms, name, owner. Out: token, expires_at. Not if expired.
EXTEND = (
    f"UPDATE {{t}} SET expires_at = {NOW_MS} + ? "
    f"WHERE name = ? AND owner = ? AND expires_at > {NOW_MS} RETURNING token, expires_at"
)
# Live holders of a name, oldest first. In: name.
INSPECT = (
    f"SELECT name, owner_info, token, acquired_at, expires_at FROM {{t}} "
    f"WHERE name = ? AND expires_at > {NOW_MS} AND substr(owner, 1, 1) <> '{RESERVED}' "
    "ORDER BY acquired_at, token"
)
# Live holders of every name with a byte prefix. In: prefix length, prefix.
LIST = (
    f"SELECT name, owner_info, token, acquired_at, expires_at FROM {{t}} "
    f"WHERE substr(name, 1, ?) = ? AND expires_at > {NOW_MS} "
    f"AND substr(owner, 1, 1) <> '{RESERVED}' ORDER BY name, acquired_at, token"
)
# Drops every lease on a name. Out: one row per dropped lease, whether it was live.
FORCE_RELEASE = f"DELETE FROM {{t}} WHERE name = ? RETURNING expires_at > {NOW_MS}"
# In: limit. Deletes up to limit expired rows, oldest first, found through the expiry index
# (one short write transaction: the purge's caller rests between batches). Rowcount.
PURGE = f"""DELETE FROM {{t}} WHERE (name, slot) IN (
    SELECT name, slot FROM {{t}} WHERE expires_at <= {NOW_MS} ORDER BY expires_at LIMIT ?)"""
RECORD_GET = "SELECT value, version FROM {t}_records WHERE name = ?"
# version 0: create only if absent.
RECORD_INSERT = "INSERT OR IGNORE INTO {t}_records (name, value, version) VALUES (?, ?, 1)"
# Compare-and-set: writes only if the version is still the one read. In: value, name, version.
RECORD_UPDATE = (
    "UPDATE {t}_records SET value = ?, version = version + 1 WHERE name = ? AND version = ?"
)
RECORD_DELETE = "DELETE FROM {t}_records WHERE name = ? AND version = ?"
SELECT_NOW = f"SELECT {NOW_MS}"


class SQLite(RowClaims, LeaseTable):
    """The lease table in one SQLite file (see the module docstring)."""

    scheme = "sqlite"
    capabilities = Capabilities(rows=True, push=True)
    ROWS = SQLITE
    options = {
        **LeaseTable.options,
        "synchronous": Option(
            choice("normal", "full"), "normal", "full: fsync every commit (survives power loss)"
        ),
    }
    sync_driver = "latchkey.stores.io.sqlite:SQLiteDriver"
    async_driver = "latchkey.stores.io.sqlite:AsyncSQLiteDriver"
    BEGIN = "BEGIN IMMEDIATE"  # takes the write lock up front: no two processes interleave
    RELEASE, INSPECT, LIST, FORCE_RELEASE, PURGE = RELEASE, INSPECT, LIST, FORCE_RELEASE, PURGE
    RECORD_GET, RECORD_INSERT, RECORD_UPDATE = RECORD_GET, RECORD_INSERT, RECORD_UPDATE
    RECORD_DELETE, NOW = RECORD_DELETE, SELECT_NOW
    DELETE_EXPIRED_OF, LIVE_OF, NEXT_FENCE = DELETE_EXPIRED_OF, LIVE_OF, NEXT_FENCE
    INSERT_LEASE, EXTEND, PEEK_LIVE, RESERVE = INSERT_LEASE, EXTEND, PEEK_LIVE, RESERVE

    def __init__(self, backend: BackendBase) -> None:
        super().__init__(backend)
        #: Names an attempt found busy lately: the next attempt reads before it writes. Eight
        #: processes on one name made ~6 write transactions per waiting acquisition, each
        #: holding the one write lock that the holder's release and next acquire wait for.
        self.busy_keys = BusyMemory()
        #: This process's waiters (their doorbells) by (name, owner), while they wait.
        self.in_line: dict[tuple[str, str], Any] = {}
        url = self.url
        if url.hosts:
            raise ConfigError(
                f"sqlite store URL {url.redacted()!r} has a host; use sqlite:///relative.db "
                "or sqlite:////absolute/path.db"
            )
        self.path = url.path[1:] if url.path.startswith("/") else url.path
        if not self.path:
            raise ConfigError("sqlite store URL has no file path (sqlite:///path/locks.db)")
        if self.path != ":memory:":
            parent = Path(self.path).parent
            if not parent.is_dir():
                raise ConfigError(f"sqlite store: directory {str(parent)!r} does not exist")

    def setup(self) -> list[str]:
        """Run at each connect (the driver's): the durability level."""
        return [f"PRAGMA synchronous={self.config['synchronous'].upper()}"]

    def write_lock_busy(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.OperationalError) and (
            "locked" in str(exc) or "busy" in str(exc)
        )

    def tables(self) -> tuple[str, str]:
        """(a query counting the store's tables, the script creating them): the driver runs
        the script at connect only when the count is short, since creating takes the write
        lock, which a take may hold for as long as its batch lasts."""
        t = self.table
        count = (
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' "
            f"AND name IN ('{t}', '{t}_meta', '{t}_records')"
        )
        return count, CREATE.format(t=t, version=SCHEMA_VERSION)

    def time(self, value: Any) -> datetime:
        return _dt(value)

    def was_live(self, result: tuple[list[Any], int]) -> bool:
        return any(row[0] for row in result[0])  # RETURNING: one flag per deleted lease

    def prefix_params(self, prefix: bytes) -> Sequence[Any]:
        return (len(prefix), prefix)

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Steps[Grant | Busy]:
        key = name.encode()
        bell = self.in_line.get((name, owner)) if self.in_line else None
        mine = None if bell is None else RESERVED + bell.ticket  # a reservation for us
        if self.busy_keys.recent(key):  # contended: look before taking the write lock
            live, _ = yield Query(self.PEEK_LIVE, (key,))
            if len(live) >= limit and all(row[5] != owner and row[5] != mine for row in live):
                return self._busy(live, live[0][6])
        result = yield from self.transaction(
            self._acquire(key, owner, owner_info, ttl, limit, mine)
        )
        if type(result) is Busy:
            self.busy_keys.mark(key)
        return result

    def _acquire(
        self, key: bytes, owner: str, owner_info: str, ttl: float, limit: int, mine: str | None
    ) -> Steps[Grant | Busy]:
        now = (yield Query(self.NOW))[0][0][0]
        yield Query(self.DELETE_EXPIRED_OF, (key, now))
        live, _ = yield Query(self.LIVE_OF, (key,))
        slot = None
        for row in live:
            if row[5] == owner:  # already ours: that lease, as it is
                return Grant(row[2], _dt(row[4]), (row[4] - now) / 1000)
            if row[5] == mine:  # reserved for us: its slot is ours
                slot = row[0]
        if slot is None:
            if len(live) >= limit:
                return self._busy(live, now)
            used = {row[0] for row in live}
            slot = next(s for s in range(limit) if s not in used)
        token = (yield Query(self.NEXT_FENCE, (1,)))[0][0][0]
        expires = now + _ms(ttl)
        yield Query(self.INSERT_LEASE, (key, slot, owner, owner_info, token, now, expires))
        return Grant(token, _dt(expires))

    def _busy(self, live: list[Any], now: int) -> Busy:
        """Busy, naming the soonest-expiring holder (a reservation is nobody's lease), with
        the time until the soonest slot ends (a reservation's too)."""
        held = next((row for row in live if not row[5].startswith(RESERVED)), None)
        holder = None if held is None else self.holder(held)
        return Busy(len(live), holder, (live[0][4] - now) / 1000)

    def release(self, name: str, owner: str) -> Steps[bool]:
        """End our lease; what comes next is the line's (the module docstring)."""
        key = name.encode()
        first: InLine | None = yield First(name)
        if first is not None and (
            (first.rung is not None and first.rung * 1000 >= TURN_MS)
            or first.waited * 1000 >= STARVED_MS
        ):
            reserved = RESERVED + first.ticket
            rows, _ = yield Query(self.RESERVE, (reserved, RESERVE_MS, key, owner))
            if rows:
                if not (yield Ring((name,), ticket=first.ticket)):  # its process is gone
                    yield Query(self.RELEASE, (key, reserved))
                    yield Ring((name,))
                return True
        result = yield Query(self.RELEASE, (key, owner))
        if result[0] and (first is None or first.rung is None):  # else: first's turn
            yield Ring((name,))
        return self.was_live(result)

    def extend(self, name: str, owner: str, ttl: float) -> Steps[Grant | None]:
        rows, _ = yield Query(self.EXTEND, (_ms(ttl), name.encode(), owner))
        return Grant(rows[0][0], _dt(rows[0][1])) if rows else None

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> Steps[dict[str, Grant]]:
        keys = [name.encode() for name in names]
        return (yield from self.transaction(self._claim(keys, owner, owner_info, ttl)))

    def _claim(
        self, keys: list[bytes], owner: str, owner_info: str, ttl: float
    ) -> Steps[dict[str, Grant]]:
        now = (yield Query(self.NOW))[0][0][0]
        busy: set[bytes] = set()
        for chunk in chunks(keys, CHUNK):
            marks = ",".join("?" * len(chunk))
            sql = f"DELETE FROM {self.table} WHERE expires_at <= ? AND name IN ({marks})"
            yield Query(sql, (now, *chunk))
            sql = f"SELECT DISTINCT name FROM {self.table} WHERE name IN ({marks})"
            rows, _ = yield Query(sql, chunk)
            busy.update(bytes(row[0]) for row in rows)
        free = [key for key in keys if key not in busy]
        if not free:
            return {}
        last = (yield Query(self.NEXT_FENCE, (len(free),)))[0][0][0]
        expires = now + _ms(ttl)
        first = last - len(free) + 1
        rows = [(key, 0, owner, owner_info, first + i, now, expires) for i, key in enumerate(free)]
        yield Query(self.INSERT_LEASE, rows, True)
        return {key.decode(): Grant(first + i, _dt(expires)) for i, key in enumerate(free)}

    def release_many(self, names: Sequence[str], owner: str) -> Steps[int]:
        keys = [name.encode() for name in names]
        live = yield from self.transaction(self._release_many(keys, owner))
        yield Ring(tuple(names))  # after the commit: a waiter woken sooner would find it held
        return live

    def released(self, names: tuple[str, ...], everyone: bool = False) -> Steps[None]:
        yield Ring(names, everyone)

    def claim_open(
        self, names: list[str], owner: str, owner_info: str, ttl: float
    ) -> Steps[dict[str, Grant]]:
        """The claim inside a lease's own ``BEGIN IMMEDIATE`` transaction."""
        return (yield from self._claim([name.encode() for name in names], owner, owner_info, ttl))

    def release_fenced(self, names: Sequence[str], owner: str, tokens: Sequence[int]) -> Steps[int]:
        """Inside a ``complete``'s transaction: delete our live leases of ``names`` that still
        carry ``tokens``; how many (the caller rolls back unless it is every one)."""
        ended = 0
        pairs = list(zip((name.encode() for name in names), tokens, strict=True))
        for chunk in chunks(pairs, CHUNK):
            marks = ",".join("?" * len(chunk))
            sql = (
                f"DELETE FROM {self.table} WHERE owner = ? AND slot = 0 AND name IN ({marks}) "
                f"AND token IN ({marks}) AND expires_at > {NOW_MS} RETURNING 1"
            )
            params = (owner, *(key for key, _ in chunk), *(token for _, token in chunk))
            rows, _ = yield Query(sql, params)
            ended += len(rows)
        return ended

    def wait_in_line(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Steps[Any]:
        """A doorbell for ``name`` (``stores/io/doorbell.py``): releases by any process on this
        machine wake the waiter at once; the core's backoff covers the rest (expiry). While
        it waits, ``in_line`` has it, for a reservation the release may make for it."""
        bell = yield Listen(name)
        if bell is not None:
            self.in_line[name, owner] = bell
            bell.line = (self.in_line, (name, owner))
        return bell

    def _release_many(self, keys: list[bytes], owner: str) -> Steps[int]:
        live = 0
        for chunk in chunks(keys, CHUNK):
            marks = ",".join("?" * len(chunk))
            sql = (
                f"DELETE FROM {self.table} WHERE owner = ? AND name IN ({marks}) "
                f"RETURNING expires_at > {NOW_MS}"
            )
            rows, _ = yield Query(sql, (owner, *chunk))
            live += sum(1 for row in rows if row[0])
        return live

    def init(self) -> Steps[None]:
        yield Query(self.NOW)  # the driver connects (and creates the tables) first


class SQLiteBackend(StoreBackend):
    store_class = SQLite


class AsyncSQLiteBackend(AsyncStoreBackend):
    store_class = SQLite


def _dt(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, timezone.utc)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
