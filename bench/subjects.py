"""What the benchmarks measure: latchkey itself and the raw client doing the same round trips.

Every *subject* is built from ``env`` (the servers' URLs and a scratch directory) by a
module-level builder registered in :data:`REGISTRY`, so that a benchmark child process can build
its own from a spec key. A subject makes one *handle* per lock use (``make(name)``): the
scenarios create a lock object per acquisition, as applications do.

A handle has ``acquire(timeout) -> bool`` (blocks up to ``timeout`` seconds) and ``release()``.
Every wait is bounded, so no benchmark can hang on a lost wake-up.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

#: Lease length every subject asks for (seconds), far longer than any hold in the scenarios.
TTL = 30


class Handle(Protocol):
    def acquire(self, timeout: float) -> bool: ...
    def release(self) -> None: ...


class Subject(Protocol):
    def make(self, name: str) -> Handle: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class Spec:
    """One row of the result tables."""

    key: str  # registry key, e.g. "redis/latchkey"
    store: str  # redis, postgresql, mysql, memcached, sqlite, local
    label: str  # what the table prints
    kind: str  # "latchkey", "raw" or "peer"
    build: Callable[[dict[str, str]], Subject]
    scenarios: frozenset[str] = field(default=frozenset("ABCD"))
    note: str = ""


REGISTRY: dict[str, Spec] = {}


def register(spec: Spec) -> None:
    REGISTRY[spec.key] = spec


def token() -> str:
    return os.urandom(16).hex()


def key64(name: str) -> int:
    """A signed 64-bit advisory-lock key for ``name`` (blake2b, as a careful user would)."""
    return int.from_bytes(
        hashlib.blake2b(name.encode(), digest_size=8).digest(), "big", signed=True
    )


# -- latchkey ---------------------------------------------------------------------------------


class LatchkeyHandle:
    def __init__(self, lock: Any) -> None:
        self.lock = lock

    def acquire(self, timeout: float) -> bool:
        return bool(self.lock.acquire(wait=timeout))

    def release(self) -> None:
        self.lock.release()


class LatchkeySubject:
    def __init__(self, url: str) -> None:
        import latchkey

        self.store = latchkey.connect(url)
        self.store.init()

    def make(self, name: str) -> Handle:
        return LatchkeyHandle(self.store.lock(name, ttl=TTL))

    def close(self) -> None:
        self.store.close()


class LatchkeyAsyncHandle:
    def __init__(self, subject: LatchkeyAsyncSubject, lock: Any) -> None:
        self.subject, self.lock = subject, lock

    def acquire(self, timeout: float) -> bool:
        return bool(self.subject.loop.run_until_complete(self.lock.acquire(wait=timeout)))

    def release(self) -> None:
        self.subject.loop.run_until_complete(self.lock.release())


class LatchkeyAsyncSubject:
    """latchkey's asyncio API for the hand-off scenario (B): the waiter awaits its acquire in
    an event loop. (Uncontended pairs are measured inside one coroutine instead, by
    bench/asyncrows.py, so that no loop entry is counted per call.)"""

    def __init__(self, url: str) -> None:
        import asyncio

        import latchkey

        self.loop = asyncio.new_event_loop()
        self.store = latchkey.connect_async(url)
        self.loop.run_until_complete(self.store.init())

    def make(self, name: str) -> Handle:
        return LatchkeyAsyncHandle(self, self.store.lock(name, ttl=TTL))

    def close(self) -> None:
        self.loop.run_until_complete(self.store.aclose())
        self.loop.close()


#: latchkey's URL for each store, given the servers' base URLs.
LATCHKEY_URLS: dict[str, Callable[[dict[str, str]], str]] = {
    "redis": lambda env: env["redis"] + "?prefix=bench:",
    "postgresql": lambda env: env["postgresql"] + "?table=bench_locks",
    "postgresql+advisory": lambda env: env["postgresql"].replace(
        "postgresql://", "postgresql+advisory://", 1
    ),
    "mysql": lambda env: env["mysql"] + "?table=bench_locks",
    "mysql+getlock": lambda env: env["mysql"].replace("mysql://", "mysql+getlock://", 1),
    "memcached": lambda env: env["memcached"] + "?prefix=bench:",
    "sqlite": lambda env: f"sqlite:///{env['tmp']}/latchkey-bench.db",
}
SERVER_OF = {
    "redis": "redis",
    "postgresql": "postgresql",
    "postgresql+advisory": "postgresql",
    "mysql": "mysql",
    "mysql+getlock": "mysql",
    "memcached": "memcached",
    "sqlite": None,
}
for _store, _url in LATCHKEY_URLS.items():
    register(
        Spec(
            f"{_store}/latchkey",
            _store,
            "latchkey",
            "latchkey",
            lambda env, _url=_url: LatchkeySubject(_url(env)),  # type: ignore[misc]
            frozenset({"A", "B", "C", "D", "claim"}),
        )
    )
    register(
        Spec(
            f"{_store}/latchkey-async",
            _store,
            "latchkey (asyncio)",
            "latchkey-async",  # a kind run.py does not select: bench/asyncrows.py uses it
            lambda env, _url=_url: LatchkeyAsyncSubject(_url(env)),  # type: ignore[misc]
            frozenset({"B"}),
        )
    )


# -- Redis: SET NX PX + compare-and-delete, and a BLPOP hand-off --------------------------------

# KEYS[1] lock key; ARGV[1] owner token. Deletes the key only if it still holds our token.
REDIS_CAD = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""

# KEYS[1] lock key, KEYS[2] its signal list; ARGV[1] owner token. Compare-and-delete, then
# push one wake-up onto the signal list (expiring, so an unread one does not linger).
REDIS_CAD_SIGNAL = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  redis.call('del', KEYS[1], KEYS[2])
  redis.call('lpush', KEYS[2], 1)
  redis.call('pexpire', KEYS[2], 1000)
  return 1
end
return 0
"""


class RawRedisHandle:
    def __init__(self, subject: RawRedis, name: str) -> None:
        self.s, self.key, self.token = subject, "raw:" + name, token()

    def acquire(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            if self.s.r.set(self.key, self.token, nx=True, px=TTL * 1000):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self.s.signal:  # wait for the holder's LPUSH (BLPOP takes whole/fractional s)
                self.s.r.blpop([self.key + ":signal"], timeout=max(0.01, min(1.0, left)))
            else:
                time.sleep(min(0.01, left))

    def release(self) -> None:
        if self.s.signal:
            self.s.cad_signal(keys=[self.key, self.key + ":signal"], args=[self.token])
        else:
            self.s.cad(keys=[self.key], args=[self.token])


class RawRedis:
    def __init__(self, url: str, signal: bool) -> None:
        import redis

        self.r = redis.Redis.from_url(url)
        self.signal = signal
        self.cad = self.r.register_script(REDIS_CAD)  # EVALSHA (EVAL once if not cached)
        self.cad_signal = self.r.register_script(REDIS_CAD_SIGNAL)

    def make(self, name: str) -> Handle:
        return RawRedisHandle(self, name)

    def close(self) -> None:
        self.r.close()


register(
    Spec(
        "redis/raw",
        "redis",
        "raw SET NX PX + EVALSHA compare-and-delete",
        "raw",
        lambda env: RawRedis(env["redis"], signal=False),
        frozenset("AD"),
    )
)
register(
    Spec(
        "redis/raw-blpop",
        "redis",
        "raw BLPOP hand-off (SET NX; release = CAD + LPUSH)",
        "raw",
        lambda env: RawRedis(env["redis"], signal=True),
        frozenset("BC"),
    )
)


# -- PostgreSQL: INSERT … ON CONFLICT / DELETE, and pg_advisory_lock ----------------------------

# Inputs: name, owner. Takes the name if no row exists; one autocommit (durable) statement.
PG_INSERT = """INSERT INTO bench_raw (name, owner, expires_at)
VALUES (%s, %s, now() + interval '30 seconds') ON CONFLICT DO NOTHING RETURNING name"""
# Inputs: name, owner. Deletes the row only if we own it.
PG_DELETE = "DELETE FROM bench_raw WHERE name = %s AND owner = %s"
PG_CREATE = """CREATE TABLE IF NOT EXISTS bench_raw (
    name text PRIMARY KEY, owner text NOT NULL, expires_at timestamptz NOT NULL)"""
# Input: 64-bit key. Blocks in the server until the session holds the advisory lock.
PG_ADV_LOCK = "SELECT pg_advisory_lock(%s)"
# Input: 64-bit key. Releases the session's advisory lock; true if it was held.
PG_ADV_UNLOCK = "SELECT pg_advisory_unlock(%s)"


class RawPGHandle:
    def __init__(self, subject: RawPG, name: str) -> None:
        self.s, self.name, self.token = subject, name, token()

    def acquire(self, timeout: float) -> bool:
        import psycopg

        conn = self.s.conn
        if self.s.advisory:
            try:
                conn.execute(PG_ADV_LOCK, (key64(self.name),), prepare=True)
                return True
            except psycopg.errors.QueryCanceled:  # statement_timeout bounds the wait
                return False
        deadline = time.monotonic() + timeout
        while True:
            if conn.execute(PG_INSERT, (self.name, self.token), prepare=True).fetchone():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def release(self) -> None:
        if self.s.advisory:
            self.s.conn.execute(PG_ADV_UNLOCK, (key64(self.name),), prepare=True)
        else:
            self.s.conn.execute(PG_DELETE, (self.name, self.token), prepare=True)


class RawPG:
    def __init__(self, url: str, advisory: bool) -> None:
        import psycopg

        self.conn = psycopg.connect(url, autocommit=True)
        self.conn.execute("SET statement_timeout = 15000")
        self.advisory = advisory
        if not advisory:
            # Scenario C's 8 processes start at once: CREATE TABLE IF NOT EXISTS races in the
            # catalog (a unique violation on pg_type); whoever lost finds the table made.
            lost = (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateTable)
            with contextlib.suppress(*lost):
                self.conn.execute(PG_CREATE)

    def make(self, name: str) -> Handle:
        return RawPGHandle(self, name)

    def close(self) -> None:
        self.conn.close()


register(
    Spec(
        "postgresql/raw",
        "postgresql",
        "raw INSERT … ON CONFLICT DO NOTHING / DELETE",
        "raw",
        lambda env: RawPG(env["postgresql"], advisory=False),
        frozenset("AD"),
    )
)
register(
    Spec(
        "postgresql/raw-advisory",
        "postgresql",
        "raw pg_advisory_lock / unlock",
        "raw",
        lambda env: RawPG(env["postgresql"], advisory=True),
        frozenset("ABCD"),
    )
)

# Inputs: name, owner. Deletes our row and, in the same statement (one commit), wakes the
# waiters listening on channel bench_raw (payload: the name).
PG_DELETE_NOTIFY = """WITH gone AS (DELETE FROM bench_raw WHERE name = %s AND owner = %s
RETURNING name) SELECT pg_notify('bench_raw', name) FROM gone"""


class RawPGNotifyHandle(RawPGHandle):
    """The least a durable lease-table hand-off needs: INSERT; if taken, wait for a NOTIFY
    on a second connection (LISTEN), then INSERT again; release = DELETE + pg_notify."""

    def acquire(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        s = self.s
        assert isinstance(s, RawPGNotify)
        while True:
            if s.conn.execute(PG_INSERT, (self.name, self.token), prepare=True).fetchone():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            for _ in s.listener.notifies(timeout=min(left, 1.0), stop_after=1):
                pass

    def release(self) -> None:
        self.s.conn.execute(PG_DELETE_NOTIFY, (self.name, self.token), prepare=True).fetchall()


class RawPGNotify(RawPG):
    def __init__(self, url: str) -> None:
        import psycopg

        super().__init__(url, advisory=False)
        self.listener = psycopg.connect(url, autocommit=True)
        self.listener.execute("LISTEN bench_raw")

    def make(self, name: str) -> Handle:
        return RawPGNotifyHandle(self, name)

    def close(self) -> None:
        self.listener.close()
        super().close()


register(
    Spec(
        "postgresql/raw-notify",
        "postgresql",
        "raw INSERT … ON CONFLICT / DELETE + LISTEN/NOTIFY hand-off",
        "raw",
        lambda env: RawPGNotify(env["postgresql"]),
        frozenset("BC"),
    )
)


# -- the durable floor: one durable commit, then an in-memory wake-up ---------------------------
# Any hand-off that a crash cannot undo must make the new holder durable (one WAL flush)
# before the waiter may go on. This is the least such a hand-off can cost on a server: the
# waiter blocks in pg_advisory_lock; release commits a one-row write (synchronous_commit on)
# and only then unlocks, in one round trip. Not a usable lock (a reference, not a peer): it
# measures what a flush adds to the raw advisory hand-off on this disk.

# Input, spliced in as an int by str.format (``:d``): the name's 64-bit key. One simple-query
# message, so one round trip: the durable write (as a hand-over records the new holder),
# COMMIT (flushed), and only then the unlock that wakes the waiter.
PG_FLOOR_RELEASE = """BEGIN;
INSERT INTO bench_floor (key, handoffs) VALUES ({key:d}, 1)
ON CONFLICT (key) DO UPDATE SET handoffs = bench_floor.handoffs + 1;
COMMIT;
SELECT pg_advisory_unlock({key:d})"""
PG_FLOOR_CREATE = """CREATE TABLE IF NOT EXISTS bench_floor (
    key bigint PRIMARY KEY, handoffs bigint NOT NULL)"""


class RawPGFloorHandle(RawPGHandle):
    def release(self) -> None:
        self.s.conn.execute(PG_FLOOR_RELEASE.format(key=key64(self.name)), prepare=False)


class RawPGFloor(RawPG):
    def __init__(self, url: str) -> None:
        super().__init__(url, advisory=True)
        self.conn.execute(PG_FLOOR_CREATE)

    def make(self, name: str) -> Handle:
        return RawPGFloorHandle(self, name)


register(
    Spec(
        "postgresql/raw-durable-floor",
        "postgresql",
        "raw floor: durable one-row commit, then pg_advisory_unlock wakes the waiter",
        "raw",
        lambda env: RawPGFloor(env["postgresql"]),
        frozenset("B"),
    )
)


# -- latchkey's own SQL, sent raw ---------------------------------------------------------------
# "The raw statements it is made of" (issue 3): latchkey's acquire and release statements for
# its lease table, rendered by latchkey and sent straight through the same driver with the same
# settings (prepared; the release's asynchronous commit included), without latchkey around
# them. latchkey / this = what the library itself costs; latchkey / the minimal rows above =
# what the lease row (owner JSON, fencing token, server-clock expiry) costs on top.


class RawSameSQLHandle:
    def __init__(self, subject: Any, name: str) -> None:
        self.s, self.name, self.token = subject, name, token()

    def acquire(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.s.take(self.name, self.token):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def release(self) -> None:
        self.s.give_back(self.name, self.token)


class RawPGSameSQL:
    def __init__(self, url: str) -> None:
        import psycopg

        import latchkey
        from latchkey._owner import Owner
        from latchkey.stores import postgresql

        store = latchkey.connect(url + "?table=bench_same_sql")
        store.init()
        backend = store.backend
        assert isinstance(backend, postgresql.PostgreSQLBackend)
        self.conn = psycopg.connect(url, autocommit=True)
        # The store's statements as it renders them: $n placeholders, run by a RawCursor.
        self.acquire_sql = backend.store.ACQUIRE_MUTEX  # type: ignore[attr-defined]
        self.release_sql = backend.store.RELEASE  # type: ignore[attr-defined]
        self.info = Owner.current().to_json()
        self.cursor = psycopg.RawCursor
        store.close()

    def take(self, name: str, owner: str) -> bool:
        params = (name.encode(), owner, self.info, 30.0)
        cur = self.cursor(self.conn)
        return bool(cur.execute(self.acquire_sql, params, prepare=True).fetchall())

    def give_back(self, name: str, owner: str) -> None:
        params = (name.encode(), owner)
        self.cursor(self.conn).execute(self.release_sql, params, prepare=True).fetchall()

    def make(self, name: str) -> Handle:
        return RawSameSQLHandle(self, name)

    def close(self) -> None:
        self.conn.close()


class RawMySameSQL:
    """On MariaDB latchkey PREPAREs its upsert … RETURNING and DELETE once per connection and
    EXECUTEs them; this does the same on its own connection."""

    def __init__(self, url: str) -> None:
        from urllib.parse import urlsplit

        import pymysql
        from pymysql.constants import CLIENT

        import latchkey
        from latchkey._owner import Owner
        from latchkey.stores import mysql

        store = latchkey.connect(url + "?table=bench_same_sql")
        store.init()
        store.close()
        u = urlsplit(url)
        self.conn = pymysql.connect(
            host=u.hostname, port=u.port or 3306, user=u.username or "root",
            password=u.password or "", database=u.path.lstrip("/"), autocommit=True,
            charset="utf8mb4", client_flag=CLIENT.MULTI_STATEMENTS,
        )  # fmt: skip
        self.cur = self.conn.cursor()
        if "mariadb" not in str(self.conn.get_server_info()).lower():
            raise RuntimeError("raw-same-sql mirrors latchkey's MariaDB path only")
        texts = [
            t.replace("{t}", "bench_same_sql")
            # every statement latchkey's setup prepares (PREPARE names three)
            for t in (
                mysql.ACQUIRE_RETURNING, mysql.MySQL.RELEASE_PREPARED, mysql.CLAIM_ROW_PREPARED
            )
        ]
        self.cur.execute(mysql.PREPARE, texts)
        while self.cur.nextset():
            pass
        self.info = Owner.current().to_json()
        self.execute_acquire = (
            "EXECUTE latchkey_acquire USING %(name)s, %(owner)s, %(info)s, %(ttl_us)s, %(owner)s"
        )
        from latchkey.stores.mysql_bells import EXECUTE_RELEASE

        self.execute_release = EXECUTE_RELEASE

    def take(self, name: str, owner: str) -> bool:
        params = {"name": name.encode(), "owner": owner, "info": self.info, "ttl_us": 30_000_000}
        self.cur.execute(self.execute_acquire, params)
        rows = self.cur.fetchall()
        return bool(rows) and str(rows[0][0]).startswith("1")

    def give_back(self, name: str, owner: str) -> None:
        # latchkey's release as it sends it uncontended: quiet, no bell, nobody's heir
        self.cur.execute(self.execute_release, (name.encode(), owner, 0, 0, 1))
        while self.cur.nextset():
            pass

    def make(self, name: str) -> Handle:
        return RawSameSQLHandle(self, name)

    def close(self) -> None:
        self.conn.close()


register(
    Spec(
        "postgresql/raw-same-sql",
        "postgresql",
        "raw: latchkey's own INSERT … ON CONFLICT / DELETE, sent bare",
        "raw",
        lambda env: RawPGSameSQL(env["postgresql"]),
        frozenset("A"),
    )
)
register(
    Spec(
        "mysql/raw-same-sql",
        "mysql",
        "raw: latchkey's own prepared upsert … RETURNING / DELETE, sent bare",
        "raw",
        lambda env: RawMySameSQL(env["mysql"]),
        frozenset("A"),
    )
)


# The same statements sent the way latchkey sends them (PostgreSQL: prepared once and run
# through libpq directly, psycopg.pq; MariaDB: the EXECUTEs with positional parameters).
# latchkey / these = the library's own cost over the cheapest use of the same driver; the rows
# above are how a user of the driver would write them.


class RawPGSameSQLPQ(RawPGSameSQL):
    def __init__(self, url: str) -> None:
        super().__init__(url)
        pg = self.conn.pgconn
        self.pg = pg
        for stmt, text in ((b"acq", self.acquire_sql), (b"rel", self.release_sql)):
            if pg.prepare(stmt, text.encode()).status != 1:  # COMMAND_OK
                raise RuntimeError(pg.error_message)

    def take(self, name: str, owner: str) -> bool:
        values = [name.encode(), owner.encode(), self.info.encode(), b"30.0"]
        return bool(self.pg.exec_prepared(b"acq", values, [1, 0, 0, 0], 1).ntuples)

    def give_back(self, name: str, owner: str) -> None:
        self.pg.exec_prepared(b"rel", [name.encode(), owner.encode()], [1, 0], 1)


class RawPGAdvisoryPQHandle(RawPGHandle):
    def acquire(self, timeout: float) -> bool:
        pg = self.s.conn.pgconn
        return pg.exec_prepared(b"lock", [b"%d" % key64(self.name)]).status == 2  # TUPLES_OK

    def release(self) -> None:
        self.s.conn.pgconn.exec_prepared(b"unlock", [b"%d" % key64(self.name)])


class RawPGAdvisoryPQ(RawPG):
    def __init__(self, url: str) -> None:
        super().__init__(url, advisory=True)
        pg = self.conn.pgconn
        pg.prepare(b"lock", b"SELECT pg_advisory_lock($1::bigint)")
        pg.prepare(b"unlock", b"SELECT pg_advisory_unlock($1::bigint)")

    def make(self, name: str) -> Handle:
        return RawPGAdvisoryPQHandle(self, name)


class RawMySameSQLArgs(RawMySameSQL):
    def take(self, name: str, owner: str) -> bool:
        from latchkey.stores import mysql

        args = (name.encode(), owner, self.info, 30_000_000, owner)
        self.cur.execute(mysql.EXECUTE_ACQUIRE_ARGS, args)
        rows = self.cur.fetchall()
        return bool(rows) and str(rows[0][0]).startswith("1")

    def give_back(self, name: str, owner: str) -> None:
        # latchkey's release as it sends it uncontended: quiet, no bell, nobody's heir
        self.cur.execute(self.execute_release, (name.encode(), owner, 0, 0, 1))
        while self.cur.nextset():
            pass


register(
    Spec(
        "postgresql/raw-same-sql-pq",
        "postgresql",
        "raw: latchkey's own INSERT … ON CONFLICT / DELETE via psycopg.pq, as latchkey sends it",
        "raw",
        lambda env: RawPGSameSQLPQ(env["postgresql"]),
        frozenset("A"),
    )
)
register(
    Spec(
        "postgresql/raw-advisory-pq",
        "postgresql",
        "raw pg_advisory_lock / unlock via psycopg.pq, as latchkey sends it",
        "raw",
        lambda env: RawPGAdvisoryPQ(env["postgresql"]),
        frozenset("A"),
    )
)
register(
    Spec(
        "mysql/raw-same-sql-args",
        "mysql",
        "raw: latchkey's own EXECUTEs with positional parameters, as latchkey sends them",
        "raw",
        lambda env: RawMySameSQLArgs(env["mysql"]),
        frozenset("A"),
    )
)

# -- MariaDB: INSERT IGNORE / DELETE, and GET_LOCK ----------------------------------------------

MY_CREATE = """CREATE TABLE IF NOT EXISTS bench_raw (
    name varbinary(255) PRIMARY KEY, owner char(32) NOT NULL, expires_at datetime(6) NOT NULL
) ENGINE=InnoDB"""
# Inputs: name, owner. Takes the name if no row exists (rowcount 1); one durable commit.
MY_INSERT = """INSERT IGNORE INTO bench_raw (name, owner, expires_at)
VALUES (%s, %s, UTC_TIMESTAMP(6) + INTERVAL 30 SECOND)"""
# Inputs: name, owner. Deletes the row only if we own it.
MY_DELETE = "DELETE FROM bench_raw WHERE name = %s AND owner = %s"
# Inputs: name, timeout (s). Blocks in the server; 1 when the session holds the lock.
MY_GET_LOCK = "SELECT GET_LOCK(%s, %s)"
# Input: name. 1 if this session held it.
MY_RELEASE_LOCK = "SELECT RELEASE_LOCK(%s)"


class RawMyHandle:
    def __init__(self, subject: RawMy, name: str) -> None:
        self.s, self.name, self.token = subject, name, token()

    def acquire(self, timeout: float) -> bool:
        cur = self.s.cur
        if self.s.getlock:
            cur.execute(MY_GET_LOCK, (self.name, max(1, int(timeout))))
            return bool(cur.fetchone()[0] == 1)
        deadline = time.monotonic() + timeout
        while True:
            if cur.execute(MY_INSERT, (self.name, self.token)) == 1:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def release(self) -> None:
        if self.s.getlock:
            self.s.cur.execute(MY_RELEASE_LOCK, (self.name,))
            self.s.cur.fetchall()
        else:
            self.s.cur.execute(MY_DELETE, (self.name, self.token))


class RawMy:
    def __init__(self, url: str, getlock: bool) -> None:
        from urllib.parse import urlsplit

        import pymysql

        u = urlsplit(url)
        self.conn = pymysql.connect(
            host=u.hostname, port=u.port or 3306, user=u.username or "root",
            password=u.password or "", database=u.path.lstrip("/"), autocommit=True,
        )  # fmt: skip
        self.cur = self.conn.cursor()
        self.getlock = getlock
        if not getlock:
            self.cur.execute(MY_CREATE)

    def make(self, name: str) -> Handle:
        return RawMyHandle(self, name)

    def close(self) -> None:
        self.conn.close()


register(
    Spec(
        "mysql/raw",
        "mysql",
        "raw INSERT IGNORE / DELETE",
        "raw",
        lambda env: RawMy(env["mysql"], getlock=False),
        frozenset("AD"),
    )
)
register(
    Spec(
        "mysql/raw-getlock",
        "mysql",
        "raw GET_LOCK / RELEASE_LOCK",
        "raw",
        lambda env: RawMy(env["mysql"], getlock=True),
        frozenset("ABCD"),
    )
)


# -- memcached: add / delete ------------------------------------------------------------------


class RawMCHandle:
    def __init__(self, subject: RawMC, name: str) -> None:
        self.s, self.key, self.token = subject, "raw:" + name, token()

    def acquire(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            if self.s.mc.add(self.key, self.token, expire=TTL, noreply=False):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def release(self) -> None:
        self.s.mc.delete(self.key, noreply=False)


class RawMC:
    def __init__(self, url: str) -> None:
        from pymemcache.client.base import Client

        host, port = url.split("://", 1)[1].split("/")[0].split(":")
        self.mc = Client((host, int(port)), default_noreply=False)

    def make(self, name: str) -> Handle:
        return RawMCHandle(self, name)

    def close(self) -> None:
        self.mc.close()


register(
    Spec(
        "memcached/raw",
        "memcached",
        "raw add / delete (pymemcache)",
        "raw",
        lambda env: RawMC(env["memcached"]),
        frozenset("AD"),
    )
)


# -- SQLite and local files ---------------------------------------------------------------------

# Inputs: name, owner. Takes the name if free; autocommit, WAL, synchronous=NORMAL like latchkey.
SQLITE_INSERT = "INSERT OR IGNORE INTO bench_raw (name, owner, expires_at) VALUES (?, ?, ?)"
# Inputs: name, owner. Deletes our row.
SQLITE_DELETE = "DELETE FROM bench_raw WHERE name = ? AND owner = ?"


class RawSQLiteHandle:
    def __init__(self, subject: RawSQLite, name: str) -> None:
        self.s, self.name, self.token = subject, name, token()

    def acquire(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            cur = self.s.conn.execute(SQLITE_INSERT, (self.name, self.token, time.time() + TTL))
            if cur.rowcount == 1:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def release(self) -> None:
        self.s.conn.execute(SQLITE_DELETE, (self.name, self.token))


class RawSQLite:
    def __init__(self, path: str) -> None:
        self.conn = sqlite3.connect(path, timeout=5, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute(
            "CREATE TABLE IF NOT EXISTS bench_raw"
            " (name TEXT PRIMARY KEY, owner TEXT, expires_at REAL)"
        )

    def make(self, name: str) -> Handle:
        return RawSQLiteHandle(self, name)

    def close(self) -> None:
        self.conn.close()


class FlockHandle:
    def __init__(self, directory: str, name: str) -> None:
        self.path = os.path.join(directory, hashlib.sha1(name.encode()).hexdigest())
        self.fd = -1

    def acquire(self, timeout: float) -> bool:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)  # kernel wait; the holders here always release
        return True

    def release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


class Flock:
    def __init__(self, directory: str) -> None:
        self.dir = directory
        os.makedirs(directory, exist_ok=True)

    def make(self, name: str) -> Handle:
        return FlockHandle(self.dir, name)

    def close(self) -> None:
        pass


register(
    Spec(
        "sqlite/raw",
        "sqlite",
        "raw INSERT OR IGNORE / DELETE (WAL, synchronous=NORMAL)",
        "raw",
        lambda env: RawSQLite(f"{env['tmp']}/raw-bench.db"),
        frozenset("AD"),
    )
)
register(
    Spec(
        "local/flock",
        "local",
        "raw open + flock + close",
        "raw",
        lambda env: Flock(f"{env['tmp']}/flock"),
        frozenset("ABCD"),
    )
)
