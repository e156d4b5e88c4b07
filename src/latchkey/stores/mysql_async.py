"""The asyncio backend of ``mysql://`` (and ``mariadb://``): the lease table of
:mod:`latchkey.stores.mysql`, the same named statements and reply parsing, over asyncmy.

Driver: asyncmy (Cython, PyMySQL's protocol rewritten for asyncio), not aiomysql. Measured on
the uncontended acquire+release pair (the MariaDB ``EXECUTE`` statements below, one
connection, MariaDB 10.11 on loopback, CPython 3.11, a 2-core machine shared with other
work, so the client CPU per pair is the steadier figure): asyncmy ~160 µs of client CPU a
pair (~1,400-1,700 pairs/s when the machine was quiet), ~200 µs with each call bounded by
``asyncio.timeout``; aiomysql 0.3.2 ~210-275 µs (~1,000-1,500 pairs/s). aiomysql also fails
on ``bytes`` parameters with PyMySQL ≥ 1.2 (it imports ``escape_bytes_prefixed``, which
PyMySQL 1.2 turned into a placeholder string) and turns server notes into Python warnings.
asyncmy's own ``read_timeout`` is not used: it wraps every packet read in ``wait_for``
(~250 µs a pair); one ``asyncio.timeout`` per call bounds the whole exchange instead.

Connections: a small pool (at most ``POOL_SIZE``), each with its cursor and, on MariaDB, the
hot statements prepared on it. A connection that failed, timed out or was cancelled in the
middle of a call is closed, never put back; one idle for ``IDLE_PING`` seconds or more is
pinged before use (the server may have ended it: restart, idle timeout, KILL), and replaced
if it does not answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from datetime import datetime
from typing import Any, TypeVar

import asyncmy
from asyncmy.constants import CLIENT

from latchkey._owner import Owner
from latchkey._types import Busy, Grant, Holder, LockInfo
from latchkey._url import StoreURL
from latchkey.stores.base import AsyncBackend, group_by_name
from latchkey.stores.mysql import (
    _STATEMENTS,
    CLAIM_ROW,
    CONTENTION,
    CREATE,
    DUPLICATE_KEY,
    EXECUTE_ACQUIRE,
    EXECUTE_ACQUIRE_ARGS,
    EXECUTE_RELEASE,
    PREPARE,
    SCHEMA_VERSION,
    SESSION,
    MySQLBackend,
    _datetime,
    _holder,
    _like_prefix,
    _text,
    _us,
    connect_args,
    utc,
)

T = TypeVar("T")

#: Every error a driver call can raise (a timeout is asyncio's, and OSError's on 3.11+).
ASYNC_DRIVER_ERRORS: tuple[type[BaseException], ...] = (
    asyncmy.errors.MySQLError,
    OSError,
    asyncio.TimeoutError,
)
#: Connections one backend opens at most; more concurrent calls queue for one.
POOL_SIZE = 8
#: A connection idle this long is pinged before use (the server may have ended it).
IDLE_PING = 1.0
# asyncmy logs the server's notes (CREATE TABLE IF NOT EXISTS on an existing table) at
# warning level; they are expected at every connect, so the session does not raise them.
QUIET = "SET sql_notes = 0"


async def bounded(aw: Awaitable[T], seconds: float) -> T:
    """Await ``aw`` for at most ``seconds`` (asyncio.TimeoutError after that)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await aw
    return await asyncio.wait_for(aw, seconds)


def async_connect_args(backend: AsyncBackend) -> dict[str, Any]:
    """asyncmy connect() arguments for a store URL: PyMySQL's, with the timeouts that are
    asyncio's here (every call runs under :func:`bounded`)."""
    args = connect_args(backend)
    del args["read_timeout"], args["write_timeout"]
    return args


async def drain(cur: Any, sql: str, params: Any = None) -> tuple[list[tuple[Any, ...]], int]:
    """Execute ``sql`` and read every result; the last result set and row count (the async
    twin of ``mysql._drain``)."""
    await cur.execute(sql, params)
    rows: list[tuple[Any, ...]] = []
    count: int = cur.rowcount
    while True:
        if cur.description:
            rows = list(await cur.fetchall())
        else:
            count = cur.rowcount
        if not await cur.nextset():
            return rows, count


class _Conn:
    """One pooled connection, its one cursor and the statements it runs."""

    __slots__ = ("conn", "cur", "sql", "used")

    def __init__(self, conn: Any, sql: dict[str, str]) -> None:
        self.conn = conn
        self.cur = conn.cursor()
        self.sql = sql
        self.used = time.monotonic()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()


class AsyncMySQLBackend(AsyncBackend):
    """The lease table for asyncio; same statements and answers as :class:`MySQLBackend`."""

    scheme = MySQLBackend.scheme
    capabilities = MySQLBackend.capabilities
    options = MySQLBackend.options

    def __init__(self, url: StoreURL) -> None:
        super().__init__(url)
        self.table: str = self.config["table"]
        self._connect_args = async_connect_args(self)
        self._base_sql = {k: sql.replace("{t}", self.table) for k, sql in _STATEMENTS.items()}
        self._idle: list[_Conn] = []
        self._busy: set[_Conn] = set()
        self._slots = asyncio.Semaphore(POOL_SIZE)
        self._mariadb = False  # known at the first connect: acquire then EXECUTEs

    # -- connections -------------------------------------------------------------------------

    async def _open(self) -> _Conn:
        """A new connection, its session set, tables created and (MariaDB) statements
        prepared."""
        conn = await asyncmy.connect(**self._connect_args, client_flag=CLIENT.MULTI_STATEMENTS)
        try:
            cur = conn.cursor()
            await cur.execute(SESSION, (max(1, math.floor(self.timeout / 2)),))
            await cur.execute(QUIET)
            await drain(cur, CREATE.format(t=self.table, version=SCHEMA_VERSION))
            sql = dict(self._base_sql)
            self._mariadb = "mariadb" in conn.get_server_info().lower()
            if self._mariadb:
                base = self._base_sql
                await drain(cur, PREPARE, (base["acquire_returning"], base["release_prepared"]))
                sql.update(acquire=EXECUTE_ACQUIRE, acquire_args=EXECUTE_ACQUIRE_ARGS,
                           release=EXECUTE_RELEASE)  # fmt: skip
        except BaseException:
            conn.close()
            raise
        return _Conn(conn, sql)

    async def _checkout(self) -> _Conn:
        """An idle connection that still answers, or a new one (inside the call's timeout)."""
        while self._idle:
            pooled = self._idle.pop()
            if time.monotonic() - pooled.used < IDLE_PING:
                return pooled
            try:
                await pooled.conn.ping(reconnect=False)
                return pooled
            except ASYNC_DRIVER_ERRORS:
                pooled.close()  # the server ended it: open another
        return await self._open()

    async def _call(
        self,
        action: str,
        key: str,
        params: Any = None,
        *,
        tolerate: tuple[int, ...] = (),
        **splice: str,
    ) -> tuple[list[tuple[Any, ...]], int] | None:
        """Run one (possibly multi-statement) query on a pooled connection; the last result
        set's rows and the last statement's row count. None if it failed with a server error
        numbered in ``tolerate`` (rolled back; the connection is kept). Any other error, a
        timeout or a cancellation closes the connection; driver errors → StoreUnavailable."""
        pooled: _Conn | None = None

        async def run() -> tuple[list[tuple[Any, ...]], int]:
            nonlocal pooled
            pooled = await self._checkout()
            self._busy.add(pooled)
            sql = pooled.sql[key].format(**splice) if splice else pooled.sql[key]
            return await drain(pooled.cur, sql, params)

        async with self._slots:
            try:
                result = await bounded(run(), self.timeout)
            except (asyncmy.errors.OperationalError, asyncmy.errors.IntegrityError) as exc:
                if pooled is not None and exc.args and exc.args[0] in tolerate:
                    self._checkin(pooled)
                    return None
                self._discard(pooled)
                self.unavailable(exc, action)
            except ASYNC_DRIVER_ERRORS as exc:
                self._discard(pooled)
                self.unavailable(exc, action)
            except BaseException:
                self._discard(pooled)  # cancelled mid-call: its replies may still come
                raise
            assert pooled is not None
            self._checkin(pooled)
            return result

    def _checkin(self, pooled: _Conn) -> None:
        self._busy.discard(pooled)
        pooled.used = time.monotonic()
        self._idle.append(pooled)

    def _discard(self, pooled: _Conn | None) -> None:
        if pooled is not None:
            self._busy.discard(pooled)
            pooled.close()

    async def _rows(self, action: str, key: str, params: Any = None) -> list[tuple[Any, ...]]:
        answer = await self._call(action, key, params)
        assert answer is not None
        return answer[0]

    async def _count(self, action: str, key: str, params: Any = None, **splice: str) -> int:
        answer = await self._call(action, key, params, tolerate=(), **splice)
        assert answer is not None
        return answer[1]

    # -- leases ------------------------------------------------------------------------------

    async def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        args: Any
        if limit == 1 and self._mariadb:  # a tuple is cheaper to escape than a dict
            key, args = "acquire_args", (name.encode(), owner, owner_info, _us(ttl), owner)
        else:
            key = "acquire" if limit == 1 else "acquire_slot"
            args = {"name": name.encode(), "owner": owner, "info": owner_info,
                    "ttl_us": _us(ttl), "limit": limit}  # fmt: skip
        answer = await self._call("acquire", key, args, tolerate=CONTENTION)
        if answer is None:
            return Busy(0)  # lost a deadlock: a race, not a busy lock; the core retries
        leases = [_text(row[0]).split("\t", 5) for row in answer[0]]
        for lease in leases:
            if lease[0] == "1":  # ours: '1', token, expires_at, microseconds left
                return Grant(int(lease[1]), _datetime(lease[2]), int(lease[3]) / 1e6)
        if not leases:
            return Busy(0)  # the lease we found live ended before we read it: retry
        _, token, expires, acquired, micros, info = leases[0]
        holder = Holder(int(token), Owner.from_json(info), _datetime(acquired), _datetime(expires))
        return Busy(len(leases), holder, max(0.0, int(micros) / 1e6))

    async def release(self, name: str, owner: str) -> bool:
        return await self._count("release", "release", (name.encode(), owner)) > 0

    async def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        params = {"name": name.encode(), "owner": owner, "ttl_us": _us(ttl)}
        rows = await self._rows("extend", "extend", params)
        return Grant(int(rows[0][0]), utc(rows[0][1])) if rows else None

    async def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        if not names:
            return {}
        keys = sorted(name.encode() for name in names)
        answer = await self._call(
            "claim", "claim", (owner, owner_info, _us(ttl), *keys, owner, *keys),
            tolerate=CONTENTION,
            rows=", ".join([CLAIM_ROW] * len(keys)), names=", ".join(["%s"] * len(keys)),
        )  # fmt: skip
        if answer is None:
            return {}  # lost a deadlock to another claim: every name was contended just now
        return {bytes(row[0]).decode(): Grant(int(row[1]), utc(row[2])) for row in answer[0]}

    async def release_many(self, names: Sequence[str], owner: str) -> int:
        if not names:
            return 0
        keys = [name.encode() for name in names]
        marks = ", ".join(["%s"] * len(keys))
        return await self._count("release", "release_many", (owner, *keys), names=marks)

    async def inspect(self, name: str) -> LockInfo | None:
        rows = await self._rows("inspect", "inspect", (name.encode(),))
        return LockInfo(name, tuple(_holder(r) for r in rows)) if rows else None

    async def list(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        rows = await self._rows("list", "list", (_like_prefix(prefix.encode()),))
        for info in group_by_name(rows, _holder):
            yield info

    async def force_release(self, name: str) -> bool:
        return await self._count("force release", "force_release", (name.encode(),)) > 0

    async def purge_expired(self) -> int:
        return await self._count("purge", "purge")

    # -- records -----------------------------------------------------------------------------

    async def record_get(self, name: str) -> tuple[str | None, int]:
        rows = await self._rows("record read", "record_get", (name.encode(),))
        return (_text(rows[0][0]), int(rows[0][1])) if rows else (None, 0)

    async def record_set(self, name: str, value: str, version: int) -> int | None:
        if version == 0:
            answer = await self._call(
                "record write", "record_insert", (name.encode(), value), tolerate=(DUPLICATE_KEY,)
            )
            return None if answer is None else 1
        count = await self._count("record write", "record_update", (value, name.encode(), version))
        return version + 1 if count == 1 else None

    async def record_delete(self, name: str, version: int) -> bool:
        return await self._count("record delete", "record_delete", (name.encode(), version)) == 1

    # -- health and lifecycle ----------------------------------------------------------------

    async def now(self) -> datetime:
        return utc((await self._rows("clock read", "now"))[0][0])

    async def init(self) -> None:
        await self._rows("clock read", "now")

    async def aclose(self) -> None:
        """Close every connection, idle or in use (a call in progress then fails)."""
        pooled = [*self._idle, *self._busy]
        self._idle, self._busy = [], set()
        for each in pooled:
            each.close()
