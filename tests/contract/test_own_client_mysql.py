"""A store over the application's own PyMySQL connection or SQLAlchemy engine
(``mysql+pymysql``): latchkey's statements run with its own session settings (autocommit,
time_zone UTC, its innodb_lock_wait_timeout) and the application's come back after every
call, also after a statement the server refused; a connection inside the application's
transaction is refused, not joined; a connection or engine without multi-statements is a
ConfigError saying how to make one; a take (``store.rows``) over a borrowed engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
import warnings
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

import latchkey
from latchkey import ConfigError, StoreUnavailable
from tests.conftest import ServerPool
from tests.servers import ServerUnavailable

pytestmark = pytest.mark.xdist_group("mysql")

#: The application's session: no autocommit, a local time zone, a long lock wait.
APP = {"autocommit": 0, "time_zone": "+05:30", "innodb_lock_wait_timeout": 77}


@pytest.fixture
def args(server_pool: ServerPool) -> dict[str, Any]:
    try:
        base = server_pool.base_url("mysql")
    except ServerUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"mysql: server required in CI but unavailable: {exc}")
        pytest.skip(f"mysql: not run: {exc}")
    url = urlsplit(base)
    return {"host": url.hostname, "port": url.port, "user": url.username or "root",
            "password": url.password or "", "database": url.path.strip("/")}  # fmt: skip


def _app_connection(args: dict[str, Any], multi: bool = True) -> Any:
    import pymysql
    from pymysql.constants import CLIENT

    init = "SET time_zone = '+05:30', innodb_lock_wait_timeout = 77"
    flag = CLIENT.MULTI_STATEMENTS if multi else 0
    return pymysql.connect(**args, client_flag=flag, autocommit=False, init_command=init)


def _session(conn: Any) -> dict[str, Any]:
    with conn.cursor() as cur:
        cur.execute("SELECT @@autocommit, @@time_zone, @@innodb_lock_wait_timeout")
        autocommit, zone, wait = cur.fetchone()
    conn.commit()  # (the SELECT began a transaction: autocommit is off)
    return {"autocommit": autocommit, "time_zone": zone, "innodb_lock_wait_timeout": wait}


@contextlib.contextmanager
def _sync_connection(args: dict[str, Any]) -> Iterator[Any]:
    import pymysql

    conn = pymysql.connect(**args)
    try:
        yield conn
    finally:
        conn.close()


@pytest.fixture
def conn(args: dict[str, Any]) -> Iterator[Any]:
    conn = _app_connection(args)
    try:
        yield conn
    finally:
        conn.close()


def _table() -> str:
    return f"t_{uuid.uuid4().hex[:12]}"


def test_latchkey_runs_with_its_settings_and_gives_the_applications_back(conn: Any) -> None:
    assert _session(conn) == APP
    store = latchkey.connect(client=conn, table=_table(), timeout="8s")
    try:
        lock = store.lock("n", ttl="30s", wait=0)
        assert lock.acquire()
        assert _session(conn) == APP
        info = store.inspect("n")
        assert info is not None and info.holder.token == lock.token
        assert abs((info.holder.expires_at - store.now()).total_seconds() - 30) < 5  # UTC both
        record = store.record("r")
        assert record.set({"n": 1}, version=0) == 1
        with pytest.raises(latchkey.Conflict):  # refused by the server: a duplicate key
            record.set({"n": 2}, version=0)
        assert _session(conn) == APP  # restored after the refused statement too
        assert lock.release()
        semaphore = [store.semaphore("s", limit=2, ttl="30s", wait=0) for _ in range(3)]
        assert [s.acquire() for s in semaphore] == [True, True, False]  # multi-statement
        assert _session(conn) == APP
    finally:
        store.close()
    assert conn.open


def test_a_connection_inside_the_applications_transaction_is_not_joined(conn: Any) -> None:
    store = latchkey.connect(client=conn, table=_table())
    try:
        with store.lock("n", ttl="10s", wait=0):  # tables created, idle connection
            pass
        conn.begin()  # the application's transaction is open
        with conn.cursor() as cur:
            cur.execute(f"SELECT COUNT(*) FROM {store.backend.store.table}")
        with pytest.raises(StoreUnavailable, match="transaction"):
            store.lock("n", wait=0).acquire()
        conn.rollback()
        with store.lock("n", ttl="10s", wait=0) as lock:
            assert lock.token is not None
        assert _session(conn) == APP
    finally:
        store.close()


def test_without_multi_statements_a_config_error_says_how(args: dict[str, Any]) -> None:
    import sqlalchemy

    conn = _app_connection(args, multi=False)
    try:
        with pytest.raises(ConfigError, match=r"CLIENT\.MULTI_STATEMENTS"):
            latchkey.connect(client=conn)
    finally:
        conn.close()
    engine = sqlalchemy.create_engine(
        sqlalchemy.engine.URL.create(
            "mysql+pymysql", username=args["user"], password=args["password"] or None,
            host=args["host"], port=args["port"], database=args["database"],
        )
    )  # fmt: skip
    try:
        store = latchkey.connect(client=engine, table=_table())
        with pytest.raises(ConfigError, match="connect_args"):
            store.lock("n", wait=0).acquire()
        store.close()
        with engine.connect() as c:  # the connection went back to the engine's pool
            assert c.execute(sqlalchemy.text("SELECT 1")).scalar() == 1
    finally:
        engine.dispose()


def _hold_uncommitted(args: dict[str, Any], table: str, name: bytes) -> Any:
    """Another connection with a live lease row of ``name`` inserted and not committed: an
    upsert of that name waits for it. Roll it back (and close it) when done."""
    import pymysql

    blocker = pymysql.connect(**args)  # autocommit off: the INSERT opens the transaction
    with blocker.cursor() as cur:
        cur.execute(
            f"INSERT INTO {table} (name, slot, owner, owner_info, acquired_at, expires_at) "
            "VALUES (%s, 0, %s, '{}', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 1 HOUR)",
            (name, uuid.uuid4().hex),
        )
    return blocker


def _names(args: dict[str, Any], table: str) -> list[bytes]:
    with _sync_connection(args) as conn, conn.cursor() as cur:
        cur.execute(f"SELECT name FROM {table} ORDER BY name")
        return [bytes(row[0]) for row in cur.fetchall()]


def test_a_claim_refused_midway_commits_nothing_of_it(conn: Any, args: dict[str, Any]) -> None:
    """A claim takes 'a', then waits out the lock-wait timeout on 'b' (the server rolls
    back that statement only, the claim's transaction stays open): on the application's
    connection, without autocommit, nothing of it is committed — not when its settings come
    back, not at the next call — and the connection goes back as it came."""
    table = _table()
    store = latchkey.connect(client=conn, table=table, timeout="2s")  # lock waits of 1 s
    try:
        store.init()
        blocker = _hold_uncommitted(args, table, b"b")
        try:
            claim = store.claim(["a", "b"], ttl="30s")
            assert claim.acquired == [] and claim.busy == ["a", "b"]
        finally:
            blocker.rollback()
            blocker.close()
        assert _session(conn) == APP
        assert store.claim(["c"], ttl="30s").acquired == ["c"]
        assert store.inspect("a") is None and _names(args, table) == [b"c"]
        assert _session(conn) == APP
    finally:
        store.close()


def test_rows_over_a_borrowed_connection(conn: Any) -> None:
    jobs = f"jobs_{uuid.uuid4().hex[:8]}"
    with conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {jobs} (id INT PRIMARY KEY, done BOOL NOT NULL, "
                    "due_at DATETIME NOT NULL) ENGINE=InnoDB")  # fmt: skip
        # Job 2 is due in the application's time zone (+05:30), not in UTC.
        cur.execute(f"INSERT INTO {jobs} VALUES (1, false, UTC_TIMESTAMP() - INTERVAL 1 MINUTE),"
                    " (2, false, UTC_TIMESTAMP() + INTERVAL 1 HOUR)")  # fmt: skip
    conn.commit()
    store = latchkey.connect(client=conn, table=_table(), timeout="20s")
    try:
        rows = store.rows(jobs, key="id", where="NOT done AND due_at <= NOW()", order_by="id")
        with rows.take(limit=10) as batch:  # NOW() read in UTC, as on latchkey's connections
            assert [row["id"] for row in batch] == [1]
            batch.execute(f"UPDATE {jobs} SET done = true WHERE id = %s", (1,))
        assert _session(conn) == APP
        with rows.take(limit=10) as batch:
            assert list(batch) == []
        with rows.lease(limit=10, ttl="30s") as leased:
            assert list(leased) == []
        assert _session(conn) == APP
        with conn.cursor() as cur:  # the take's update was committed
            cur.execute(f"SELECT done FROM {jobs} WHERE id = 1")
            assert cur.fetchone() == (1,)
        conn.commit()
    finally:
        store.close()
        with conn.cursor() as cur:
            cur.execute(f"DROP TABLE {jobs}")


# -- asyncio: asyncmy and aiomysql connections and pools, SQLAlchemy AsyncEngines ------------

#: The application's session, asyncio: also its sql_notes (left as they are).
AAPP = {**APP, "sql_notes": 1}
INIT = "SET time_zone = '+05:30', innodb_lock_wait_timeout = 77"
#: The asyncio clients: one connection, a pool, an engine, of each driver.
AKINDS = ["asyncmy-connection", "asyncmy-pool", "aiomysql-connection", "aiomysql-pool",
          "sqlalchemy-asyncmy", "sqlalchemy-aiomysql"]  # fmt: skip
POOLED = [kind for kind in AKINDS if not kind.endswith("-connection")]
SINGLE = [kind for kind in AKINDS if kind.endswith("-connection")]


async def _aclient(
    kind: str, args: dict[str, Any], *, size: int = 1, multi: bool = True, init: str = INIT
) -> Any:
    """The application's client of ``kind``: autocommit off, its own time zone and lock wait;
    a pool or engine of at most ``size`` connections (1: every call sees the same one)."""
    import asyncmy
    from asyncmy.constants import CLIENT

    args = dict(args)
    flag = CLIENT.MULTI_STATEMENTS if multi else 0
    if kind == "asyncmy-connection":
        return await asyncmy.connect(**args, client_flag=flag, autocommit=False,
                                     init_command=init)  # fmt: skip
    if kind == "asyncmy-pool":
        return await asyncmy.create_pool(**args, client_flag=flag, autocommit=False,
                                         init_command=init, minsize=1, maxsize=size)  # fmt: skip
    if kind.startswith("aiomysql"):
        import aiomysql

        args["db"] = args.pop("database")
        if kind == "aiomysql-connection":
            return await aiomysql.connect(**args, autocommit=False, init_command=init)
        return await aiomysql.create_pool(**args, autocommit=False, init_command=init,
                                          minsize=1, maxsize=size)  # fmt: skip
    from sqlalchemy.engine import URL
    from sqlalchemy.ext.asyncio import create_async_engine

    driver = {"sqlalchemy-asyncmy": "mysql+asyncmy", "sqlalchemy-aiomysql": "mariadb+aiomysql"}
    url = URL.create(driver[kind], username=args["user"], password=args["password"] or None,
                     host=args["host"], port=args["port"], database=args["database"])  # fmt: skip
    connect_args: dict[str, Any] = {"init_command": init}
    if kind == "sqlalchemy-asyncmy":  # (SQLAlchemy's own FOUND_ROWS, replaced by connect_args)
        connect_args["client_flag"] = flag | CLIENT.FOUND_ROWS
    return create_async_engine(url, connect_args=connect_args, pool_size=size, max_overflow=0)


async def _aclose(client: Any) -> None:
    if hasattr(client, "sync_engine"):
        await client.dispose()
    elif hasattr(client, "acquire"):
        client.close()
        await client.wait_closed()
    else:
        await client.ensure_closed()


SESSION_SQL = "SELECT @@autocommit, @@time_zone, @@innodb_lock_wait_timeout, @@sql_notes"


async def _asession(client: Any) -> dict[str, Any]:
    """The session settings the application's next query would run with."""
    if hasattr(client, "sync_engine"):
        import sqlalchemy

        async with client.connect() as conn:  # (rolled back when closed)
            row = (await conn.execute(sqlalchemy.text(SESSION_SQL))).one()
    elif hasattr(client, "acquire"):
        async with client.acquire() as conn:
            return await _asession(conn)
    else:
        cur = client.cursor()
        cur = await cur if asyncio.iscoroutine(cur) or hasattr(cur, "__await__") else cur
        await cur.execute(SESSION_SQL)
        row = await cur.fetchone()
        await client.commit()  # (the SELECT began a transaction: autocommit is off)
    autocommit, zone, wait, notes = row
    return {"autocommit": autocommit, "time_zone": zone, "innodb_lock_wait_timeout": wait,
            "sql_notes": notes}  # fmt: skip


def _idle(client: Any) -> bool:
    """Every connection of the application's pool or engine is back in it."""
    if hasattr(client, "sync_engine"):
        return client.sync_engine.pool.checkedout() == 0  # type: ignore[no-any-return]
    return client.freesize == client.size  # type: ignore[no-any-return]


@pytest.fixture(params=AKINDS)
def akind(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


def _arun(coro: Any) -> Any:
    return asyncio.run(coro)


def test_asyncio_latchkey_runs_with_its_settings_and_gives_the_applications_back(
    akind: str, args: dict[str, Any]
) -> None:
    async def main() -> None:
        client = await _aclient(akind, args)
        try:
            assert await _asession(client) == AAPP
            store = latchkey.connect_async(client=client, table=_table(), timeout="8s")
            try:
                lock = store.lock("n", ttl="30s", wait=0)
                assert await lock.acquire()
                first = lock.token
                assert await _asession(client) == AAPP
                info = await store.inspect("n")
                assert info is not None and info.holder.token == first
                left = (info.holder.expires_at - await store.now()).total_seconds()
                assert abs(left - 30) < 5  # both read in UTC, not in the application's zone
                assert not await store.lock("n", wait=0).acquire()  # busy
                await lock.extend("60s")
                assert await lock.release()
                again = store.lock("n", ttl="30s", wait=0)
                assert await again.acquire() and again.token is not None and again.token > first
                assert await again.release()
                record = store.record("r")
                assert await record.set({"n": 1}, version=0) == 1
                with pytest.raises(latchkey.Conflict):  # refused by the server: a duplicate
                    await record.set({"n": 2}, version=0)
                assert await _asession(client) == AAPP  # restored after the refusal too
                slots = [store.semaphore("s", limit=2, ttl="30s", wait=0) for _ in range(3)]
                assert [await s.acquire() for s in slots] == [True, True, False]
                assert await _asession(client) == AAPP
            finally:
                await store.aclose()
            assert await _asession(client) == AAPP  # latchkey closed nothing of the client's
            if akind not in SINGLE:
                assert _idle(client)
        finally:
            await _aclose(client)

    _arun(main())


def test_asyncio_a_claim_refused_midway_commits_nothing_of_it(
    akind: str, args: dict[str, Any]
) -> None:
    """As test_a_claim_refused_midway_commits_nothing_of_it, over each asyncio client."""
    table = _table()

    async def main() -> None:
        client = await _aclient(akind, args)
        try:
            store = latchkey.connect_async(client=client, table=table, timeout="2s")
            try:
                await store.init()
                blocker = _hold_uncommitted(args, table, b"b")
                try:
                    claim = await store.claim(["a", "b"], ttl="30s")
                    assert claim.acquired == [] and claim.busy == ["a", "b"]
                finally:
                    blocker.rollback()
                    blocker.close()
                assert await _asession(client) == AAPP
                assert (await store.claim(["c"], ttl="30s")).acquired == ["c"]
                assert await store.inspect("a") is None and _names(args, table) == [b"c"]
                assert await _asession(client) == AAPP
            finally:
                await store.aclose()
        finally:
            await _aclose(client)

    _arun(main())


def test_asyncio_the_applications_pool_gets_every_connection_back(
    akind: str, args: dict[str, Any]
) -> None:
    """Many concurrent calls, more than the pool has connections, busy answers and refused
    statements among them: every connection goes back (a single connection serves them one
    at a time), and a waiter is woken by the release it waits for."""

    async def main() -> None:
        client = await _aclient(akind, args, size=3)
        store = latchkey.connect_async(client=client, table=_table(), timeout="20s")
        try:

            async def work(rnd: int, i: int) -> bool:
                lock = store.lock(f"n{i % 7}", ttl="30s", wait=0)
                got = await lock.acquire()
                if got:
                    assert await lock.release()
                record = store.record(f"r{rnd}:{i}")
                await record.set({"i": i}, version=0)
                with pytest.raises(latchkey.Conflict):
                    await record.set({"i": i}, version=0)
                return got

            for rnd in range(3):
                results = await asyncio.gather(*(work(rnd, i) for i in range(24)))
                assert any(results)
                if akind in POOLED:
                    assert _idle(client)
                    if hasattr(client, "size"):
                        assert 1 <= client.size <= 3
            holder = store.lock("w", ttl="30s", wait=0)
            assert await holder.acquire()
            first = holder.token
            assert first is not None

            async def wait() -> int | None:
                async with store.lock("w", ttl="30s", wait="30s") as lock:
                    return lock.token

            waiter = asyncio.ensure_future(wait())
            assert not await store.lock("w", wait=0).acquire()  # still held: the waiter waits
            assert not waiter.done()
            assert await holder.release()
            token = await asyncio.wait_for(waiter, 30)
            assert token is not None and token > first
        finally:
            await store.aclose()
        try:
            if akind in POOLED:
                assert _idle(client)
            assert await _asession(client) == AAPP
        finally:
            await _aclose(client)

    _arun(main())


def test_asyncio_a_store_failure_is_unavailable_within_the_timeout(
    akind: str, args: dict[str, Any]
) -> None:
    """The server stops answering (a proxy swallows the traffic): every call is
    StoreUnavailable within the store's timeout; a pool or engine replaces the connection
    the timeout broke, a single connection stays broken (the application's to replace)."""
    from tests.faults.proxy import Proxy

    async def main() -> None:
        proxy = Proxy(args["host"], args["port"])
        client = await _aclient(akind, {**args, "host": "127.0.0.1", "port": proxy.port})
        store = latchkey.connect_async(client=client, table=_table(), timeout="2s")
        try:
            async with store.lock("n", ttl="30s", wait=0) as lock:  # the tables, warmed up
                assert lock.token is not None
            proxy.set("blackhole")
            for call in ("acquire", "inspect"):
                started = time.monotonic()
                with pytest.raises(StoreUnavailable):
                    if call == "acquire":
                        await store.lock("n", ttl="30s", wait=0).acquire()
                    else:
                        await store.inspect("n")
                assert time.monotonic() - started < 6, call  # 2s, with room for a busy CI
            proxy.heal()
            if akind in SINGLE:  # the driver closed it when the call was cut short
                with pytest.raises(StoreUnavailable):
                    await store.lock("n", wait=0).acquire()
                return
            # (another name: the swallowed acquire of "n" reaches the server once the proxy
            # forwards again, a lease nobody holds until its TTL ends)
            async with store.lock("after", ttl="30s", wait=0) as lock:
                assert lock.token is not None
            assert _idle(client)
            assert await _asession(client) == AAPP
        finally:
            await store.aclose()
            await _aclose(client)
            proxy.close()

    _arun(main())


@pytest.mark.parametrize("akind", SINGLE)
def test_asyncio_a_connection_inside_the_applications_transaction_is_not_joined(
    akind: str, args: dict[str, Any]
) -> None:
    async def main() -> None:
        conn = await _aclient(akind, args)
        store = latchkey.connect_async(client=conn, table=_table())
        try:
            async with store.lock("n", ttl="10s", wait=0):  # tables created, idle connection
                pass
            await conn.begin()  # the application's transaction is open
            with pytest.raises(StoreUnavailable, match="transaction"):
                await store.lock("n", wait=0).acquire()
            await conn.rollback()
            async with store.lock("n", ttl="10s", wait=0) as lock:
                assert lock.token is not None
            assert await _asession(conn) == AAPP
        finally:
            await store.aclose()
            await _aclose(conn)

    _arun(main())


def test_asyncio_a_connection_without_multi_statements_is_a_config_error_saying_so(
    args: dict[str, Any],
) -> None:
    """asyncmy and aiomysql always ask for multi-statements; a subclass that clears the flag
    (a "read-only" connection, as some applications make) says so nowhere public: the first
    call finds out, and the connection is left as it was (the server ran nothing)."""
    import asyncmy.connection
    from asyncmy.constants import CLIENT

    class SingleStatements(asyncmy.connection.Connection):  # type: ignore[misc]
        async def connect(self) -> None:
            self._client_flag &= ~CLIENT.MULTI_STATEMENTS
            await super().connect()

    async def main() -> None:
        conn = SingleStatements(**args, autocommit=False, init_command=INIT)
        await conn.connect()
        try:
            store = latchkey.connect_async(client=conn, table=_table())
            with pytest.raises(ConfigError, match=r"multi-statements.*syntax error"):
                await store.lock("n", wait=0).acquire()
            await store.aclose()
            assert await _asession(conn) == AAPP
        finally:
            await conn.ensure_closed()

    _arun(main())


def test_asyncio_a_client_without_a_database_is_a_config_error(args: dict[str, Any]) -> None:
    """An aiomysql connection says it has none (at connect_async); an asyncmy one does not
    say, and the first call finds out (the server's "No database selected")."""
    import aiomysql
    import asyncmy
    from asyncmy.constants import CLIENT

    bare = {k: v for k, v in args.items() if k != "database"}

    async def main() -> None:
        conn = await aiomysql.connect(**bare)
        try:
            with pytest.raises(ConfigError, match="names no database"):
                latchkey.connect_async(client=conn)
        finally:
            await conn.ensure_closed()
        conn = await asyncmy.connect(**bare, client_flag=CLIENT.MULTI_STATEMENTS)
        try:
            store = latchkey.connect_async(client=conn, table=_table())
            with pytest.raises(ConfigError, match="names no database"):
                await store.lock("n", wait=0).acquire()
            await store.aclose()
            cur = conn.cursor()
            await cur.execute("SELECT 1")
            assert await cur.fetchone() == (1,)
        finally:
            await conn.ensure_closed()

    _arun(main())


@pytest.mark.parametrize("akind", ["asyncmy-connection", "aiomysql-pool", "sqlalchemy-aiomysql"])
def test_asyncio_rows_over_a_borrowed_client(akind: str, args: dict[str, Any]) -> None:
    async def main() -> None:
        client = await _aclient(akind, args)
        jobs = f"jobs_{uuid.uuid4().hex[:8]}"
        with _sync_connection(args) as app:
            with app.cursor() as cur:
                cur.execute(f"CREATE TABLE {jobs} (id INT PRIMARY KEY, done BOOL NOT NULL, "
                            "due_at DATETIME NOT NULL) ENGINE=InnoDB")  # fmt: skip
                # Job 2 is due in the application's time zone (+05:30), not in UTC.
                cur.execute(f"INSERT INTO {jobs} VALUES (1, false, UTC_TIMESTAMP() - INTERVAL "
                            "1 MINUTE), (2, false, UTC_TIMESTAMP() + INTERVAL 1 HOUR)")  # fmt: skip
            app.commit()
        store = latchkey.connect_async(client=client, table=_table(), timeout="20s")
        try:
            rows = store.rows(jobs, key="id", where="NOT done AND due_at <= NOW()", order_by="id")
            async with rows.take(limit=10) as batch:  # NOW() in UTC, as on latchkey's own
                assert [row["id"] for row in batch] == [1]
                await batch.execute(f"UPDATE {jobs} SET done = true WHERE id = %s", (1,))
            assert await _asession(client) == AAPP
            async with rows.take(limit=10) as batch:
                assert list(batch) == []
            async with rows.lease(limit=10, ttl="30s") as leased:
                assert list(leased) == []
            assert await _asession(client) == AAPP
            if akind not in SINGLE:
                assert _idle(client)
        finally:
            await store.aclose()
            await _aclose(client)
            with _sync_connection(args) as app:
                with app.cursor() as cur:
                    cur.execute(f"SELECT done FROM {jobs} WHERE id = 1")
                    assert cur.fetchone() == (1,)  # the take's update was committed
                    cur.execute(f"DROP TABLE {jobs}")

    _arun(main())


@pytest.mark.parametrize("akind", ["aiomysql-connection", "asyncmy-pool"])
def test_asyncio_any_name_round_trips(akind: str, args: dict[str, Any]) -> None:
    """Names go as their UTF-8 bytes (aiomysql's are rendered by latchkey, as hexadecimal
    literals): quotes, backslashes, percent signs, NUL and non-ASCII survive, and a prefix
    lists exactly its names."""
    names = ["it's", "back\\slash", "100%", "nul\x00byte", "ünï €", "_under"]

    async def main() -> None:
        client = await _aclient(akind, args)
        store = latchkey.connect_async(client=client, table=_table())
        try:
            for name in names:
                lock = store.lock(f"p:{name}", ttl="30s", wait=0)
                assert await lock.acquire(), name
                info = await store.inspect(f"p:{name}")
                assert info is not None and info.name == f"p:{name}"
            assert await store.lock("p:x", ttl="30s", wait=0).acquire()
            listed = [info.name async for info in store.list("p:1")]
            assert listed == ["p:100%"]  # '%' is no wildcard in a prefix
            listed = sorted([info.name async for info in store.list("p:")])
            assert listed == sorted(f"p:{n}" for n in [*names, "x"])
            assert await _asession(client) == AAPP
        finally:
            await store.aclose()
            await _aclose(client)

    _arun(main())


# -- asyncio, without a server ----------------------------------------------------------------


def test_asyncio_mysql_clients_in_the_wrong_mode_or_driver_are_refused_saying_why() -> None:
    import sqlalchemy
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = sqlalchemy.create_engine("mysql+aiomysql://app@db/app")  # an async driver, sync
    try:
        with pytest.raises(ConfigError, match=r"engine of mysql\+aiomysql; accepted: .*pymysql"):
            latchkey.connect(client=engine)
    finally:
        engine.dispose()
    aengine = create_async_engine("mariadb+asyncmy://app@db/app")
    with pytest.raises(ConfigError, match="an asyncio client") as caught:
        latchkey.connect(client=aengine)
    assert "connect_async" in str(caught.value)
    store = latchkey.connect_async(client=aengine, table="locks")
    assert store.url.startswith("mysql://app@db/app?table=locks (client sqlalchemy.ext.")
    import pymysql

    conn = pymysql.connections.Connection(host="db", defer_connect=True)
    with pytest.raises(ConfigError, match="a sync client") as caught:
        latchkey.connect_async(client=conn)
    assert "aiomysql.Pool" in str(caught.value) and "asyncmy.Connection" in str(caught.value)


@pytest.mark.parametrize("akind", SINGLE)
def test_asyncio_the_servers_notes_are_neither_warned_nor_logged(
    akind: str, args: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A second store on the same table meets it existing: CREATE TABLE IF NOT EXISTS and
    INSERT IGNORE leave a note and a warning in the session. aiomysql turns the last
    statement's warnings into Python warnings and asyncmy logs them; latchkey's last statement
    is the restore of the application's settings, so neither happens."""

    async def main() -> None:
        conn = await _aclient(akind, args)
        table = _table()
        try:
            for _ in range(2):  # the second store's first call meets the existing table
                store = latchkey.connect_async(client=conn, table=table)
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    with caplog.at_level(logging.INFO):
                        assert await store.is_free("n")
                await store.aclose()
            assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
            assert await _asession(conn) == AAPP
        finally:
            await _aclose(conn)

    _arun(main())
