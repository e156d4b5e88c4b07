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
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from latchkey._owner import Owner
from latchkey._types import Busy, Grant, Holder, LockInfo
from latchkey._url import Option, StoreURL, choice, identifier
from latchkey.errors import ConfigError
from latchkey.stores.base import Backend, Capabilities, group_by_name

T = TypeVar("T")

SCHEMA_VERSION = 1
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
# Takes the next fencing token(s). In: how many. Out: the last token taken.
NEXT_FENCE = "UPDATE {t}_meta SET value = value + ? WHERE key = 'fence' RETURNING value"
# Records a lease in a free slot. In: name, slot, owner, info, token, acquired, expires.
INSERT_LEASE = "INSERT OR REPLACE INTO {t} VALUES (?, ?, ?, ?, ?, ?, ?)"
# Ends our lease (live or not). In: name, owner. Out: whether it was live. Never another's.
RELEASE = f"DELETE FROM {{t}} WHERE name = ? AND owner = ? RETURNING expires_at > {NOW_MS}"
# Moves our live lease's end. In: ttl ms, name, owner. Out: token, expires_at. Not if expired.
EXTEND = (
    f"UPDATE {{t}} SET expires_at = {NOW_MS} + ? "
    f"WHERE name = ? AND owner = ? AND expires_at > {NOW_MS} RETURNING token, expires_at"
)
# Live holders of a name, oldest first. In: name.
INSPECT = (
    f"SELECT name, owner_info, token, acquired_at, expires_at FROM {{t}} "
    f"WHERE name = ? AND expires_at > {NOW_MS} ORDER BY acquired_at, token"
)
# Live holders of every name with a byte prefix. In: prefix length, prefix.
LIST = (
    f"SELECT name, owner_info, token, acquired_at, expires_at FROM {{t}} "
    f"WHERE substr(name, 1, ?) = ? AND expires_at > {NOW_MS} ORDER BY name, acquired_at, token"
)
# Drops every lease on a name. Out: one row per dropped lease, whether it was live.
FORCE_RELEASE = f"DELETE FROM {{t}} WHERE name = ? RETURNING expires_at > {NOW_MS}"
PURGE = f"DELETE FROM {{t}} WHERE expires_at <= {NOW_MS}"
RECORD_GET = "SELECT value, version FROM {t}_records WHERE name = ?"
# version 0: create only if absent.
RECORD_INSERT = "INSERT OR IGNORE INTO {t}_records (name, value, version) VALUES (?, ?, 1)"
# Compare-and-set: writes only if the version is still the one read. In: value, name, version.
RECORD_UPDATE = (
    "UPDATE {t}_records SET value = ?, version = version + 1 WHERE name = ? AND version = ?"
)
RECORD_DELETE = "DELETE FROM {t}_records WHERE name = ? AND version = ?"
SELECT_NOW = f"SELECT {NOW_MS}"


def _dt(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, timezone.utc)


def _holder(row: Sequence[Any]) -> Holder:
    return Holder(int(row[2]), Owner.from_json(row[1]), _dt(row[3]), _dt(row[4]))


class SQLiteBackend(Backend):
    scheme = "sqlite"
    capabilities = Capabilities()
    options = {
        "table": Option(identifier, "latchkey_locks", "lease table name"),
        "synchronous": Option(
            choice("normal", "full"), "normal", "full: fsync every commit (survives power loss)"
        ),
    }

    def __init__(self, url: StoreURL) -> None:
        super().__init__(url)
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
        self.table: str = self.config["table"]
        self._sql = {k: v.replace("{t}", self.table) for k, v in _STATEMENTS.items()}
        self._conn: sqlite3.Connection | None = None
        self._pid = 0
        self._mutex = threading.RLock()

    # -- connection --------------------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._conn is not None and self._pid == os.getpid():
            return self._conn
        with self.translate("opening the database", (sqlite3.Error,)):
            conn = sqlite3.connect(
                self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False
            )
            try:
                _set_wal(conn, self.timeout)
                conn.execute(f"PRAGMA synchronous={self.config['synchronous'].upper()}")
                conn.executescript(CREATE.format(t=self.table, version=SCHEMA_VERSION))
            except sqlite3.Error:
                conn.close()
                raise
        self._conn, self._pid = conn, os.getpid()
        return conn

    def _run(self, action: str, key: str, params: Sequence[Any] = ()) -> list[Any]:
        with self._mutex, self.translate(action, (sqlite3.Error,)):
            return self._connection().execute(self._sql[key], params).fetchall()

    def _transaction(self, action: str) -> _Tx:
        return _Tx(self, action)

    # -- leases ------------------------------------------------------------------------------

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        key = name.encode()
        with self._transaction("acquire") as tx:
            now = tx.one("now")[0]
            tx.run("delete_expired_of", (key, now))
            live = tx.run("live_of", (key,))
            for row in live:
                if row[5] == owner:  # already ours: that lease, as it is
                    return Grant(row[2], _dt(row[4]), (row[4] - now) / 1000)
            if len(live) >= limit:
                soonest = live[0]
                return Busy(len(live), _holder(soonest), (soonest[4] - now) / 1000)
            used = {row[0] for row in live}
            slot = next(s for s in range(limit) if s not in used)
            token = tx.one("next_fence", (1,))[0]
            expires = now + _ms(ttl)
            tx.run("insert_lease", (key, slot, owner, owner_info, token, now, expires))
        return Grant(token, _dt(expires))

    def release(self, name: str, owner: str) -> bool:
        return any(row[0] for row in self._run("release", "release", (name.encode(), owner)))

    def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        rows = self._run("extend", "extend", (_ms(ttl), name.encode(), owner))
        return Grant(rows[0][0], _dt(rows[0][1])) if rows else None

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        keys = [name.encode() for name in names]
        with self._transaction("claim") as tx:
            now = tx.one("now")[0]
            busy: set[bytes] = set()
            for chunk in _chunks(keys):
                marks = ",".join("?" * len(chunk))
                tx.raw(
                    f"DELETE FROM {self.table} WHERE expires_at <= ? AND name IN ({marks})",
                    (now, *chunk),
                )
                rows = tx.raw(
                    f"SELECT DISTINCT name FROM {self.table} WHERE name IN ({marks})", chunk
                )
                busy.update(bytes(row[0]) for row in rows)
            free = [key for key in keys if key not in busy]
            if not free:
                return {}
            last = tx.one("next_fence", (len(free),))[0]
            expires = now + _ms(ttl)
            first = last - len(free) + 1
            tx.many(
                "insert_lease",
                [
                    (key, 0, owner, owner_info, first + i, now, expires)
                    for i, key in enumerate(free)
                ],
            )
        return {key.decode(): Grant(first + i, _dt(expires)) for i, key in enumerate(free)}

    def release_many(self, names: Sequence[str], owner: str) -> int:
        live = 0
        with self._transaction("release") as tx:
            for chunk in _chunks([name.encode() for name in names]):
                marks = ",".join("?" * len(chunk))
                rows = tx.raw(
                    f"DELETE FROM {self.table} WHERE owner = ? AND name IN ({marks}) "
                    f"RETURNING expires_at > {NOW_MS}",
                    (owner, *chunk),
                )
                live += sum(1 for row in rows if row[0])
        return live

    def inspect(self, name: str) -> LockInfo | None:
        rows = self._run("inspect", "inspect", (name.encode(),))
        return LockInfo(name, tuple(_holder(r) for r in rows)) if rows else None

    def list(self, prefix: str = "") -> Iterator[LockInfo]:
        key = prefix.encode()
        rows = self._run("list", "list", (len(key), key))
        yield from group_by_name(rows, _holder)

    def force_release(self, name: str) -> bool:
        return any(row[0] for row in self._run("force release", "force_release", (name.encode(),)))

    def purge_expired(self) -> int:
        with self._mutex, self.translate("purge", (sqlite3.Error,)):
            return self._connection().execute(self._sql["purge"]).rowcount

    # -- records -----------------------------------------------------------------------------

    def record_get(self, name: str) -> tuple[str | None, int]:
        rows = self._run("record read", "record_get", (name.encode(),))
        return (rows[0][0], int(rows[0][1])) if rows else (None, 0)

    def record_set(self, name: str, value: str, version: int) -> int | None:
        with self._mutex, self.translate("record write", (sqlite3.Error,)):
            conn = self._connection()
            if version == 0:
                cur = conn.execute(self._sql["record_insert"], (name.encode(), value))
            else:
                cur = conn.execute(self._sql["record_update"], (value, name.encode(), version))
            return version + 1 if cur.rowcount == 1 else None

    def record_delete(self, name: str, version: int) -> bool:
        with self._mutex, self.translate("record delete", (sqlite3.Error,)):
            cur = self._connection().execute(self._sql["record_delete"], (name.encode(), version))
            return cur.rowcount == 1

    # -- health and lifecycle ----------------------------------------------------------------

    def now(self) -> datetime:
        return _dt(self._run("clock read", "now")[0][0])

    def init(self) -> None:
        with self._mutex:
            self._connection()

    def close(self) -> None:
        with self._mutex:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None


_STATEMENTS = {
    "delete_expired_of": DELETE_EXPIRED_OF,
    "live_of": LIVE_OF,
    "next_fence": NEXT_FENCE,
    "insert_lease": INSERT_LEASE,
    "release": RELEASE,
    "extend": EXTEND,
    "inspect": INSPECT,
    "list": LIST,
    "force_release": FORCE_RELEASE,
    "purge": PURGE,
    "record_get": RECORD_GET,
    "record_insert": RECORD_INSERT,
    "record_update": RECORD_UPDATE,
    "record_delete": RECORD_DELETE,
    "now": SELECT_NOW,
}


class _Tx:
    """A ``BEGIN IMMEDIATE`` transaction: takes SQLite's write lock up front, so that no two
    processes interleave their read-then-write; committed on success, rolled back on error."""

    def __init__(self, backend: SQLiteBackend, action: str) -> None:
        self.backend = backend
        self.action = action
        self.conn: sqlite3.Connection | None = None

    def __enter__(self) -> _Tx:
        self.backend._mutex.acquire()
        try:
            with self.backend.translate(self.action, (sqlite3.Error,)):
                self.conn = self.backend._connection()
                self.conn.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.backend._mutex.release()
            raise
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            assert self.conn is not None
            with self.backend.translate(self.action, (sqlite3.Error,)):
                if exc_type is None:
                    self.conn.execute("COMMIT")
                elif self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
        finally:
            self.backend._mutex.release()

    def _exec(self, sql: str, params: Sequence[Any]) -> list[Any]:
        assert self.conn is not None
        with self.backend.translate(self.action, (sqlite3.Error,)):
            return self.conn.execute(sql, params).fetchall()

    def run(self, key: str, params: Sequence[Any] = ()) -> list[Any]:
        return self._exec(self.backend._sql[key], params)

    def one(self, key: str, params: Sequence[Any] = ()) -> Any:
        return self.run(key, params)[0]

    def raw(self, sql: str, params: Sequence[Any]) -> list[Any]:
        return self._exec(sql, params)

    def many(self, key: str, rows: Sequence[Sequence[Any]]) -> None:
        assert self.conn is not None
        with self.backend.translate(self.action, (sqlite3.Error,)):
            self.conn.executemany(self.backend._sql[key], rows)


def _set_wal(conn: sqlite3.Connection, timeout: float) -> None:
    """Put the file in WAL mode (it stays so). Two processes opening a new file at once can
    both try; the loser gets "database is locked" at once, without SQLite's busy handler, so
    it tries again (within the store's timeout): the other one's change is as good."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _chunks(items: Sequence[bytes]) -> Iterator[Sequence[bytes]]:
    for start in range(0, len(items), CHUNK):
        yield items[start : start + CHUNK]
