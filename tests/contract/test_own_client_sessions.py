"""Session locks over the application's own pool or engine: ``connect(client=…,
locks="session")`` gives ``postgresql+advisory`` or ``mysql+getlock`` on connections borrowed
from it.

Each case runs on the real server the suite starts for its store: the session-lock slice
(acquire, busy, release, a blocked waiter woken in the server, inspect, a claim), with the
pool's count of connections checked out at each step — one while a lock lives on a connection,
none once every lock is released, and none after ``store.close()`` with locks still held (they
are unlocked: another store takes them at once), the pool still working; a single connection
is refused naming what to pass instead; ``locks`` takes only "lease" and "session"; a server
that stops answering is StoreUnavailable within the timeout and the connection it broke is
discarded, the pool's next one used.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pytest

import latchkey
from latchkey import ConfigError, StoreUnavailable
from tests.conftest import ServerPool
from tests.helpers import eventually
from tests.servers import ServerUnavailable


@dataclass
class Case:
    """One lending client: its server, whether it is asyncio, how to make it (a pool of at
    most ``size`` connections) and close it, how many of its connections are out, and how
    many it keeps idle (a connection latchkey closed or discarded is not among them)."""

    id: str
    server: str
    asyncio: bool
    scheme: str
    make: Callable[[str, int], Any]
    out: Callable[[Any], int]
    kept: Callable[[Any], int]
    close: Callable[[Any], Any]


def _mysql_args(base: str) -> dict[str, Any]:
    url = urlsplit(base)
    return {"host": url.hostname, "port": url.port, "user": url.username or "root",
            "password": url.password or "", "database": url.path.strip("/")}  # fmt: skip


def _pg_pool(base: str, size: int) -> Any:
    import psycopg_pool

    # The application's own session settings: a statement_timeout far shorter than a wait.
    kwargs = {"options": "-c statement_timeout=300"}
    pool = psycopg_pool.ConnectionPool(base, kwargs=kwargs, min_size=1, max_size=size,
                                       open=False)  # fmt: skip
    pool.open(wait=True, timeout=30)
    return pool


def _pg_pool_out(pool: Any) -> int:
    stats = pool.get_stats()
    return int(stats["pool_size"] - stats["pool_available"])


def _pg_pool_kept(pool: Any) -> int:
    return int(pool.get_stats()["pool_available"])


def _pg_engine(base: str, size: int) -> Any:
    import sqlalchemy

    url = base.replace("postgresql://", "postgresql+psycopg://")
    return sqlalchemy.create_engine(url, pool_size=size, max_overflow=0)


def _engine_out(engine: Any) -> int:
    pool = getattr(engine, "sync_engine", engine).pool
    return int(pool.checkedout())


def _engine_kept(engine: Any) -> int:
    pool = getattr(engine, "sync_engine", engine).pool
    return int(pool.checkedin())


async def _apg_pool(base: str, size: int) -> Any:
    import psycopg_pool

    kwargs = {"options": "-c statement_timeout=300"}
    pool = psycopg_pool.AsyncConnectionPool(base, kwargs=kwargs, min_size=1, max_size=size,
                                            open=False)  # fmt: skip
    await pool.open(wait=True, timeout=30)
    return pool


def _apg_engine(base: str, size: int) -> Any:
    from sqlalchemy.ext.asyncio import create_async_engine

    url = base.replace("postgresql://", "postgresql+psycopg://")
    return create_async_engine(url, pool_size=size, max_overflow=0)


def _mysql_engine(base: str, size: int) -> Any:
    import sqlalchemy

    url = base.replace("mysql://", "mysql+pymysql://")
    return sqlalchemy.create_engine(url, pool_size=size, max_overflow=0)


async def _asyncmy_pool(base: str, size: int) -> Any:
    import asyncmy

    return await asyncmy.create_pool(**_mysql_args(base), minsize=1, maxsize=size)


async def _aiomysql_pool(base: str, size: int) -> Any:
    import aiomysql

    args = _mysql_args(base)
    args["db"] = args.pop("database")
    return await aiomysql.create_pool(**args, minsize=1, maxsize=size)


def _amysql_out(pool: Any) -> int:
    return int(pool.size - pool.freesize)


def _amysql_kept(pool: Any) -> int:
    return int(pool.freesize)


async def _amysql_close(pool: Any) -> None:
    pool.close()
    await pool.wait_closed()


def _amysql_engine(driver: str) -> Callable[[str, int], Any]:
    def make(base: str, size: int) -> Any:
        from sqlalchemy.ext.asyncio import create_async_engine

        url = base.replace("mysql://", f"{driver}://")
        return create_async_engine(url, pool_size=size, max_overflow=0)

    return make


PG, MY = "postgresql+advisory", "mysql+getlock"
CASES = [
    Case("psycopg-pool", "postgresql", False, PG, _pg_pool, _pg_pool_out, _pg_pool_kept,
         lambda c: c.close()),
    Case("sqlalchemy-psycopg", "postgresql", False, PG, _pg_engine, _engine_out, _engine_kept,
         lambda c: c.dispose()),
    Case("psycopg-pool-asyncio", "postgresql", True, PG, _apg_pool, _pg_pool_out,
         _pg_pool_kept, lambda c: c.close()),
    Case("sqlalchemy-psycopg-asyncio", "postgresql", True, PG, _apg_engine, _engine_out,
         _engine_kept, lambda c: c.dispose()),
    Case("sqlalchemy-pymysql", "mysql", False, MY, _mysql_engine, _engine_out, _engine_kept,
         lambda c: c.dispose()),
    Case("asyncmy-pool", "mysql", True, MY, _asyncmy_pool, _amysql_out, _amysql_kept,
         _amysql_close),
    Case("aiomysql-pool", "mysql", True, MY, _aiomysql_pool, _amysql_out, _amysql_kept,
         _amysql_close),
    Case("sqlalchemy-asyncmy-asyncio", "mysql", True, MY, _amysql_engine("mysql+asyncmy"),
         _engine_out, _engine_kept, lambda c: c.dispose()),
    Case("sqlalchemy-aiomysql-asyncio", "mysql", True, MY, _amysql_engine("mariadb+aiomysql"),
         _engine_out, _engine_kept, lambda c: c.dispose()),
]  # fmt: skip


def _params(cases: list[Case]) -> list[Any]:
    return [pytest.param(c, id=c.id, marks=pytest.mark.xdist_group(c.server)) for c in cases]


def _base(server_pool: ServerPool, server: str) -> str:
    try:
        return server_pool.base_url(server)
    except ServerUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"{server}: server required in CI but unavailable: {exc}")
        pytest.skip(f"{server}: not run: {exc}")


@pytest.fixture(params=_params(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return request.param  # type: ignore[no-any-return]


def _tag() -> str:
    return uuid.uuid4().hex[:12]


async def _settle(value: Any) -> Any:
    return await value if asyncio.iscoroutine(value) else value


def test_session_locks_over_a_pool_hold_a_connection_per_lock_and_give_it_back(
    case: Case, server_pool: ServerPool
) -> None:
    base = _base(server_pool, case.server)
    prefix = f"t{_tag()}:"
    if not case.asyncio:
        _sync_slice(case, base, prefix)
    else:
        asyncio.run(_async_slice(case, base, prefix))


def _sync_slice(case: Case, base: str, prefix: str) -> None:
    client = case.make(base, 4)
    try:
        store = latchkey.connect(client=client, locks="session", prefix=prefix, timeout="10s")
        assert store.url.startswith(f"{case.scheme}://")
        assert store.backend.scheme == case.scheme and store.backend.client is client
        other = latchkey.connect(client=client, locks="session", prefix=prefix, timeout="10s")
        try:
            lock = store.lock("a", wait=0)
            assert lock.acquire() and lock.token is None  # session locks: no fencing
            assert case.out(client) == 1  # the connection the lock lives on
            assert not other.lock("a", wait=0).acquire()  # busy, seen by another store
            assert case.out(client) == 1  # (that store's look gave its connection back)
            info = store.inspect("a")
            assert info is not None and len(info.holders) == 1
            got: list[bool] = []

            def wait() -> None:  # blocked in the server, on a spare of its own
                waiter = other.lock("a", wait="30s")
                got.append(waiter.acquire())
                got.append(waiter.release())

            thread = threading.Thread(target=wait)
            thread.start()
            eventually(lambda: case.out(client) == 2, timeout=10, what="the waiter's spare")
            assert lock.release()
            thread.join(30)
            assert got == [True, True]
            assert case.out(client) == 0  # every lock released: every connection back
            claim = store.claim(["c1", "c2", "c3"])
            assert claim.acquired == ["c1", "c2", "c3"]
            assert case.out(client) == 1
            claim.release_all()
            assert case.out(client) == 0
            held = [store.lock("h1", wait=0), store.lock("h2", wait=0)]
            assert all(h.acquire() for h in held)
        finally:
            store.close()  # with h1 and h2 held: unlocked, their connection given back
            assert case.out(client) == 0
            assert other.lock("h1", wait=0).acquire()  # free at once
            other.close()
        assert case.out(client) == 0
        assert case.kept(client) >= 2  # the two used at once went back, neither was closed
    finally:
        case.close(client)


async def _async_slice(case: Case, base: str, prefix: str) -> None:
    client = await _settle(case.make(base, 4))
    try:
        store = latchkey.connect_async(client=client, locks="session", prefix=prefix,
                                       timeout="10s")  # fmt: skip
        assert store.url.startswith(f"{case.scheme}://")
        other = latchkey.connect_async(client=client, locks="session", prefix=prefix,
                                       timeout="10s")  # fmt: skip
        try:
            lock = store.lock("a", wait=0)
            assert await lock.acquire() and lock.token is None
            assert case.out(client) == 1
            assert not await other.lock("a", wait=0).acquire()
            assert case.out(client) == 1
            info = await store.inspect("a")
            assert info is not None and len(info.holders) == 1

            async def wait() -> list[bool]:
                waiter = other.lock("a", wait="30s")
                return [await waiter.acquire(), await waiter.release()]

            task = asyncio.ensure_future(wait())
            for _ in range(2000):  # until the waiter waits on a spare of its own
                if case.out(client) == 2:
                    break
                await asyncio.sleep(0.005)
            assert case.out(client) == 2 and not task.done()
            assert await lock.release()
            assert await asyncio.wait_for(task, 30) == [True, True]
            assert case.out(client) == 0
            async with store.claim(["c1", "c2", "c3"]) as claim:
                assert claim.acquired == ["c1", "c2", "c3"]
                assert case.out(client) == 1
            assert case.out(client) == 0
            held = [store.lock("h1", wait=0), store.lock("h2", wait=0)]
            assert [await h.acquire() for h in held] == [True, True]
        finally:
            await store.aclose()
            assert case.out(client) == 0
            assert await other.lock("h1", wait=0).acquire()
            await other.aclose()
        assert case.out(client) == 0
        assert case.kept(client) >= 2  # the two used at once went back, neither was closed
    finally:
        await _settle(case.close(client))


# -- what is refused -------------------------------------------------------------------------


def test_a_single_connection_or_another_kind_of_lock_is_refused_naming_what_to_pass(
    server_pool: ServerPool,
) -> None:
    import psycopg
    import redis

    base = _base(server_pool, "postgresql")
    conn = psycopg.connect(base)
    try:
        with pytest.raises(ConfigError) as caught:
            latchkey.connect(client=conn, locks="session")
        message = str(caught.value)
        assert "psycopg.Connection, a single connection" in message
        assert "pass a psycopg_pool.ConnectionPool or a SQLAlchemy Engine" in message
        for bad in ("sessions", "advisory", 1):
            with pytest.raises(ConfigError, match=r"locks must be 'lease' .* or 'session'"):
                latchkey.connect(client=conn, locks=bad)
        store = latchkey.connect(client=conn, locks="lease", table=f"t{_tag()}")
        assert store.url.startswith("postgresql://")  # the default, said aloud
        store.close()
    finally:
        conn.close()

    async def asyncio_connection() -> None:
        aconn = await psycopg.AsyncConnection.connect(base)
        try:
            with pytest.raises(ConfigError, match=r"pass a psycopg_pool\.AsyncConnectionPool"):
                latchkey.connect_async(client=aconn, locks="session")
        finally:
            await aconn.close()

    asyncio.run(asyncio_connection())
    plain = redis.Redis(port=1)
    try:
        with pytest.raises(ConfigError, match=r"session locks are PostgreSQL's advisory locks"):
            latchkey.connect(client=plain, locks="session")
    finally:
        plain.close()
    with pytest.raises(ConfigError, match=r"with a URL the scheme chooses: postgresql\+advisory"):
        latchkey.connect(base, locks="session")
    with pytest.raises(ConfigError, match="locks= chooses the store of a client"):
        latchkey.connect_async(base, locks="session")


def test_a_single_mysql_connection_is_refused_naming_what_to_pass(server_pool: ServerPool) -> None:
    import pymysql

    args = _mysql_args(_base(server_pool, "mysql"))
    conn = pymysql.connect(**args)
    try:
        with pytest.raises(ConfigError, match=r"pass a SQLAlchemy Engine \(mysql\+pymysql"):
            latchkey.connect(client=conn, locks="session")
    finally:
        conn.close()

    async def asyncio_connections() -> None:
        import aiomysql
        import asyncmy

        aconn = await asyncmy.connect(**args)
        margs = dict(args)
        margs["db"] = margs.pop("database")
        mconn = await aiomysql.connect(**margs)
        try:
            for client in (aconn, mconn):
                with pytest.raises(ConfigError, match=r"pass an asyncmy.Pool, an aiomysql.Pool"):
                    latchkey.connect_async(client=client, locks="session")
        finally:
            aconn.close()
            mconn.close()

    asyncio.run(asyncio_connections())


@pytest.mark.xdist_group("postgresql")
def test_an_asyncio_advisory_connection_goes_back_to_the_pool_unwatched(
    server_pool: ServerPool,
) -> None:
    """While latchkey has it, a lent connection's socket is watched by the event loop between
    statements (``stores/io/pgwatch.py``); it lets go before the connection goes back, so the
    application's psycopg finds the socket as it left it."""
    base = _base(server_pool, "postgresql")

    async def main() -> None:
        pool = await _apg_pool(base, 1)  # one connection: the one lent is the one got back
        try:
            store = latchkey.connect_async(client=pool, locks="session", prefix=f"t{_tag()}:",
                                           timeout="10s")  # fmt: skip
            lock = store.lock("a", wait=0)
            assert await lock.acquire()
            assert await lock.release()  # no lock lives on it: given back
            conn = await pool.getconn(10)
            try:
                assert not asyncio.get_running_loop().remove_reader(conn.pgconn.socket)
                assert await (await conn.execute("SELECT 1")).fetchone() == (1,)
            finally:
                await pool.putconn(conn)
            assert await lock.acquire() and await lock.release()  # and lent again
            await store.aclose()
        finally:
            await pool.close()

    asyncio.run(main())


# -- the application's settings, a server that stops answering ------------------------------


def test_a_wait_outlasts_the_applications_statement_timeout_and_leaves_its_settings(
    server_pool: ServerPool,
) -> None:
    """The pool's sessions cancel statements after 300 ms; latchkey's wait in the server runs
    with its own lock_timeout and statement_timeout, local to the wait's transaction, so it
    outlasts them, and the connection goes back with the application's settings."""
    import psycopg

    base = _base(server_pool, "postgresql")
    prefix = f"t{_tag()}:"
    pool = _pg_pool(base, 2)
    store = latchkey.connect(client=pool, locks="session", prefix=prefix, timeout="20s")
    holder = latchkey.connect(base.replace("postgresql://", "postgresql+advisory://"),
                              prefix=prefix)  # fmt: skip
    watcher = psycopg.connect(base, autocommit=True)
    try:
        held = holder.lock("n", wait=0)
        assert held.acquire()
        got: list[Any] = []

        def wait() -> None:
            lock = store.lock("n", wait="30s")
            try:
                got.append(lock.acquire() and lock.release())
            except Exception as exc:  # reported below
                got.append(exc)

        thread = threading.Thread(target=wait)
        thread.start()
        try:
            eventually(
                lambda: got or watcher.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND "
                    "state = 'active' AND clock_timestamp() - query_start > interval '1.5 s' "
                    "AND query LIKE '%pg_advisory_lock%'"
                ).fetchone(),
                timeout=30, what="latchkey's wait in the server past 300 ms",
            )  # fmt: skip
            assert not got  # not cancelled by the application's statement_timeout
        finally:
            held.release()
            thread.join(30)
        assert got == [True]
    finally:
        store.close()
        holder.close()
        watcher.close()
    try:
        with pool.connection(timeout=30) as conn:
            settings = conn.execute("SELECT current_setting('statement_timeout'), "
                                    "current_setting('lock_timeout')").fetchone()  # fmt: skip
            assert settings == ("300ms", "0") and not conn.autocommit
    finally:
        pool.close()


@pytest.mark.xdist_group("mysql")
@pytest.mark.parametrize("seen", [True, False], ids=["opened-after", "opened-before"])
def test_a_getlock_wait_outlasts_the_engines_read_timeout_on_the_same_connection(
    seen: bool, server_pool: ServerPool
) -> None:
    """The engine's PyMySQL connections have a 4 s read timeout. A wait of 30 s in the
    server goes on past it on one connection, never broken by it: in waits of 3 s where
    latchkey saw the connection opened (its ``do_connect`` listener noted the timeout), in
    slices of 1 s on a connection the engine opened before latchkey was given it."""
    import pymysql
    import sqlalchemy

    from latchkey.stores.mysql_getlock import lock_key

    base = _base(server_pool, "mysql")
    prefix = f"t{_tag()}:"
    url = base.replace("mysql://", "mysql+pymysql://")
    engine = sqlalchemy.create_engine(url, pool_size=1, max_overflow=0,
                                      connect_args={"read_timeout": 4})  # fmt: skip
    if not seen:
        with engine.connect() as conn:  # the pool's one connection, opened before latchkey
            conn.exec_driver_sql("SELECT 1")
    store = latchkey.connect(client=engine, locks="session", prefix=prefix, timeout="10s")
    holder = latchkey.connect(base.replace("mysql://", "mysql+getlock://"), prefix=prefix)
    watcher = pymysql.connect(**_mysql_args(base), autocommit=True)
    key = lock_key("n", prefix)
    try:
        held = holder.lock("n", wait=0)
        assert held.acquire()
        got: list[Any] = []

        def wait() -> None:
            lock = store.lock("n", wait="30s")
            try:
                got.append(lock.acquire() and lock.release())
            except Exception as exc:  # reported below
                got.append(exc)

        waits: set[int] = set()
        longest = [0]

        def waiting_past_the_read_timeout() -> bool:
            with watcher.cursor() as cur:
                cur.execute("SELECT ID, TIME FROM information_schema.PROCESSLIST WHERE "
                            "STATE = 'User lock' AND LOCATE(%s, INFO) > 0",
                            (f"GET_LOCK('{key}',",))  # fmt: skip
                for ident, seconds in cur.fetchall():
                    waits.add(int(ident))
                    longest[0] = max(longest[0], int(seconds))
            return bool(got) or (bool(waits) and time.monotonic() - started > 5.5)

        started = time.monotonic()
        thread = threading.Thread(target=wait)
        thread.start()
        try:
            eventually(waiting_past_the_read_timeout, timeout=30,
                       what="a wait in the server past the 4 s read timeout")  # fmt: skip
            assert not got
            assert len(waits) == 1  # one connection all along: none was broken
            assert longest[0] >= 2 if seen else longest[0] <= 1
        finally:
            held.release()
            thread.join(30)
        assert got == [True]
        assert engine.pool.checkedout() == 0
    finally:
        store.close()
        holder.close()
        watcher.close()
        engine.dispose()


def _proxied(base: str, proxy: Any) -> str:
    url = urlsplit(base)
    return base.replace(f"{url.hostname}:{url.port}", f"127.0.0.1:{proxy.port}")


@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=pytest.mark.xdist_group(s)) for k, s in
             (("psycopg-pool", "postgresql"), ("asyncmy-pool", "mysql"))],
)  # fmt: skip
def test_a_server_that_stops_answering_is_unavailable_within_the_timeout(
    kind: str, server_pool: ServerPool
) -> None:
    """A proxy swallows the traffic: every call is StoreUnavailable within the store's
    timeout, the lock held on the connection that broke is lost, that connection is
    discarded (the pool opens another), and once the network heals the store works on the
    pool's next connection and gives it back."""
    from tests.faults.proxy import Proxy

    case = next(c for c in CASES if c.id == kind)
    base = _base(server_pool, case.server)
    url = urlsplit(base)
    proxy = Proxy(str(url.hostname), int(url.port or 0))
    prefix = f"t{_tag()}:"

    async def main() -> None:
        client = await _settle(case.make(_proxied(base, proxy), 2))
        store: Any
        if case.asyncio:
            store = latchkey.connect_async(client=client, locks="session", prefix=prefix,
                                           timeout="2s")  # fmt: skip
        else:
            store = latchkey.connect(client=client, locks="session", prefix=prefix,
                                     timeout="2s")  # fmt: skip
        try:
            held = store.lock("held", wait=0)
            assert await _settle(held.acquire())
            proxy.set("blackhole")
            for name in ("n", "m"):
                started = time.monotonic()
                with pytest.raises(StoreUnavailable):
                    await _settle(store.lock(name, wait=0).acquire())
                assert time.monotonic() - started < 6, name  # 2s, with room for a busy CI
            proxy.heal()
            with pytest.raises(latchkey.LockLost):  # its connection was discarded
                await _settle(held.extend())
            lock = store.lock("after", wait=0)
            assert await _settle(lock.acquire())
            assert await _settle(lock.release())
            # The failed acquires left background give-backs (the core's, after an answer
            # that may have been lost), each a call that borrows the main connection for a
            # moment: every connection is back once they have run.
            deadline = time.monotonic() + 10
            while case.out(client) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert case.out(client) == 0
        finally:
            await _settle(store.aclose() if case.asyncio else store.close())
            await _settle(case.close(client))
            proxy.close()

    asyncio.run(main())
