"""The asyncio floor of each store: the raw client doing latchkey's round trips, sync against
asyncio, on the same connection settings. Used by ``bench/asyncrows.py`` (its ``F`` column).

latchkey's asyncio A / sync A cannot beat what the same round trips cost through asyncio
against a blocking call: an event loop pays a selector wake-up, a callback and a future per
reply, where a blocking socket pays one ``recv``. Each store's pair here is the minimum its
lease needs (the round trips latchkey sends per acquire + release; not its statements'
exact text where that does not change the round-trip count):

- redis: ``SET NX PX`` + ``EVALSHA`` compare-and-delete (redis-py against ``redis.asyncio``);
- postgresql: ``INSERT … ON CONFLICT DO NOTHING RETURNING`` + ``DELETE`` (psycopg,
  autocommit, prepared, sync against async connection);
- postgresql+advisory: ``pg_try_advisory_lock`` + ``pg_advisory_unlock`` (same);
- mysql: ``INSERT IGNORE`` + ``DELETE`` (PyMySQL against asyncmy);
- mysql+getlock: ``GET_LOCK(name, 0)`` + ``RELEASE_LOCK`` (PyMySQL against asyncmy);
- memcached: one ``ms … ME`` add + one ``md``, the meta protocol latchkey speaks (a blocking
  socket against an ``asyncio.Protocol``, the cheapest way through asyncio:
  ``bench/asyncfloor.py``);
- sqlite: ``INSERT OR IGNORE`` + ``DELETE`` (sqlite3 in the caller's thread against one
  ``run_in_executor`` hop per statement: SQLite has no non-blocking interface).

Each ``make_*`` returns ``(sync_pair, async_pair, close)``: two callables doing one pair on a
fresh name, and a cleanup.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import sqlite3
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

Pair = Callable[[], None]
APair = Callable[[], Awaitable[None]]
Made = tuple[Pair, APair, Callable[[], Awaitable[None]]]

_counter = itertools.count()


def _name(tag: str) -> str:
    return f"raw-floor:{tag}:{next(_counter) % 1000}"


REDIS_CAD = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


def make_redis(env: dict[str, str]) -> Made:
    import redis
    import redis.asyncio as aredis

    sync_r = redis.Redis.from_url(env["redis"])
    async_r = aredis.Redis.from_url(env["redis"])
    sha = sync_r.script_load(REDIS_CAD)

    def pair() -> None:
        key = _name("r")
        if not sync_r.set(key, "me", nx=True, px=30_000):
            raise RuntimeError("raw redis: busy")
        sync_r.evalsha(sha, 1, key, "me")

    async def apair() -> None:
        key = _name("r")
        if not await async_r.set(key, "me", nx=True, px=30_000):
            raise RuntimeError("raw redis: busy")
        await async_r.evalsha(sha, 1, key, "me")

    async def close() -> None:
        sync_r.close()
        await async_r.aclose()

    return pair, apair, close


PG_CREATE = """CREATE TABLE IF NOT EXISTS bench_floor
(name text PRIMARY KEY, owner text NOT NULL, expires_at timestamptz NOT NULL)"""
PG_INSERT = """INSERT INTO bench_floor (name, owner, expires_at)
VALUES (%s, %s, now() + interval '30 seconds') ON CONFLICT DO NOTHING RETURNING name"""
PG_DELETE = "DELETE FROM bench_floor WHERE name = %s AND owner = %s"
PG_LOCK = "SELECT pg_try_advisory_lock(hashtextextended(%s, 0))"
PG_UNLOCK = "SELECT pg_advisory_unlock(hashtextextended(%s, 0))"


def _make_pg(env: dict[str, str], advisory: bool, loop: asyncio.AbstractEventLoop) -> Made:
    import psycopg

    url = env["postgresql"]
    conn = psycopg.connect(url, autocommit=True)
    conn.execute(PG_CREATE)
    aconn = loop.run_until_complete(psycopg.AsyncConnection.connect(url, autocommit=True))
    first, second = (PG_LOCK, PG_UNLOCK) if advisory else (PG_INSERT, PG_DELETE)

    def pair() -> None:
        name = _name("p")
        args = (name,) if advisory else (name, "me")
        if not conn.execute(first, args, prepare=True).fetchone():
            raise RuntimeError("raw postgresql: busy")
        cur = conn.execute(second, args, prepare=True)
        if advisory:
            cur.fetchall()

    async def apair() -> None:
        name = _name("p")
        args = (name,) if advisory else (name, "me")
        cur = await aconn.execute(first, args, prepare=True)
        if not await cur.fetchone():
            raise RuntimeError("raw postgresql: busy")
        cur = await aconn.execute(second, args, prepare=True)
        if advisory:
            await cur.fetchall()

    async def close() -> None:
        conn.close()
        await aconn.close()

    return pair, apair, close


MY_CREATE = """CREATE TABLE IF NOT EXISTS bench_floor
(name VARCHAR(255) PRIMARY KEY, owner VARCHAR(64) NOT NULL, expires_at DATETIME(6) NOT NULL)"""
MY_INSERT = """INSERT IGNORE INTO bench_floor (name, owner, expires_at)
VALUES (%s, %s, NOW(6) + INTERVAL 30 SECOND)"""
MY_DELETE = "DELETE FROM bench_floor WHERE name = %s AND owner = %s"
MY_GET_LOCK = "SELECT GET_LOCK(%s, 0)"
MY_RELEASE_LOCK = "SELECT RELEASE_LOCK(%s)"


def _make_my(env: dict[str, str], getlock: bool, loop: asyncio.AbstractEventLoop) -> Made:
    import asyncmy
    import pymysql

    u = urlsplit(env["mysql"])
    kwargs: dict[str, Any] = dict(
        host=u.hostname, port=u.port or 3306, user=u.username or "root",
        password=u.password or "", database=u.path.lstrip("/"), autocommit=True,
    )  # fmt: skip
    conn = pymysql.connect(**kwargs)
    cur = conn.cursor()
    cur.execute(MY_CREATE)
    aconn = loop.run_until_complete(asyncmy.connect(**kwargs))
    acur = aconn.cursor()

    def pair() -> None:
        name = _name("m")
        if getlock:
            cur.execute(MY_GET_LOCK, (name,))
            if cur.fetchone()[0] != 1:
                raise RuntimeError("raw mysql: busy")
            cur.execute(MY_RELEASE_LOCK, (name,))
            cur.fetchall()
        else:
            if cur.execute(MY_INSERT, (name, "me")) != 1:
                raise RuntimeError("raw mysql: busy")
            cur.execute(MY_DELETE, (name, "me"))

    async def apair() -> None:
        name = _name("m")
        if getlock:
            await acur.execute(MY_GET_LOCK, (name,))
            if (await acur.fetchone())[0] != 1:
                raise RuntimeError("raw mysql: busy")
            await acur.execute(MY_RELEASE_LOCK, (name,))
            await acur.fetchall()
        else:
            if await acur.execute(MY_INSERT, (name, "me")) != 1:
                raise RuntimeError("raw mysql: busy")
            await acur.execute(MY_DELETE, (name, "me"))

    async def close() -> None:
        conn.close()
        await acur.close()
        aconn.close()

    return pair, apair, close


MC_ADD = b"ms %b 2 T30 ME c\r\nme\r\n"
MC_DELETE = b"md %b\r\n"


class _MCReplies(asyncio.Protocol):
    def __init__(self) -> None:
        self.buffer = bytearray()
        self.waiter: asyncio.Future[None] | None = None

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


def make_memcached(env: dict[str, str], loop: asyncio.AbstractEventLoop) -> Made:
    host, port = env["memcached"].split("://", 1)[1].split("/")[0].split(":")
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    transport, replies = loop.run_until_complete(
        loop.create_connection(_MCReplies, host, int(port))
    )

    def trip(request: bytes) -> bytes:
        sock.sendall(request)
        reply = sock.recv(256)
        while not reply.endswith(b"\r\n"):
            reply += sock.recv(256)
        return reply

    async def atrip(request: bytes) -> bytes:
        transport.write(request)
        while not replies.buffer.endswith(b"\r\n"):
            replies.waiter = loop.create_future()
            await replies.waiter
        reply = bytes(replies.buffer)
        replies.buffer.clear()
        return reply

    def pair() -> None:
        key = _name("c").encode()
        if not trip(MC_ADD % key).startswith(b"HD"):
            raise RuntimeError("raw memcached: busy")
        trip(MC_DELETE % key)

    async def apair() -> None:
        key = _name("c").encode()
        if not (await atrip(MC_ADD % key)).startswith(b"HD"):
            raise RuntimeError("raw memcached: busy")
        await atrip(MC_DELETE % key)

    async def close() -> None:
        sock.close()
        transport.close()

    return pair, apair, close


SQLITE_CREATE = (
    "CREATE TABLE IF NOT EXISTS bench_floor (name TEXT PRIMARY KEY, owner TEXT, exp REAL)"
)
SQLITE_INSERT = "INSERT OR IGNORE INTO bench_floor (name, owner, exp) VALUES (?, ?, ?)"
SQLITE_DELETE = "DELETE FROM bench_floor WHERE name = ? AND owner = ?"


def make_sqlite(env: dict[str, str], loop: asyncio.AbstractEventLoop) -> Made:
    path = f"{env['tmp']}/latchkey-floor.db"
    # check_same_thread=False: the asyncio side runs its statements on the executor's thread.
    conn = sqlite3.connect(path, timeout=5, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute(SQLITE_CREATE)

    def insert(name: str) -> int:
        return conn.execute(SQLITE_INSERT, (name, "me", time.time() + 30)).rowcount

    def delete(name: str) -> None:
        conn.execute(SQLITE_DELETE, (name, "me"))

    def pair() -> None:
        name = _name("s")
        if insert(name) != 1:
            raise RuntimeError("raw sqlite: busy")
        delete(name)

    async def apair() -> None:
        name = _name("s")
        if await loop.run_in_executor(None, insert, name) != 1:
            raise RuntimeError("raw sqlite: busy")
        await loop.run_in_executor(None, delete, name)

    async def close() -> None:
        conn.close()

    return pair, apair, close


def make(store: str, env: dict[str, str], loop: asyncio.AbstractEventLoop) -> Made:
    """The raw sync and asyncio pairs of ``store`` (a name of ``subjects.LATCHKEY_URLS``)."""
    if store == "redis":
        return make_redis(env)
    if store in ("postgresql", "postgresql+advisory"):
        return _make_pg(env, store.endswith("advisory"), loop)
    if store in ("mysql", "mysql+getlock"):
        return _make_my(env, store.endswith("getlock"), loop)
    if store == "memcached":
        return make_memcached(env, loop)
    if store == "sqlite":
        return make_sqlite(env, loop)
    raise ValueError(f"no raw asyncio floor for {store!r}")
