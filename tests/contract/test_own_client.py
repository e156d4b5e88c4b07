"""Bring your own client: ``latchkey.connect(client=…)`` / ``connect_async(client=…)``.

A store built over a client the application holds keeps a representative slice of the
semantics (acquire, busy, release, fencing tokens, a semaphore, a record), in the sync and the
asyncio API where the client has both flavours; ``store.close()`` leaves the client working
(latchkey never closes what it did not open); a client of the wrong mode, or of a type latchkey
cannot use, is a ConfigError naming it; the client's password never shows in ``repr(store)``,
``store.url`` or an error. Each case runs on the real server the suite starts for its store.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import latchkey
from latchkey import ConfigError, StoreUnavailable
from tests.conftest import ServerPool
from tests.servers import ServerUnavailable


def _skip_or_fail(kind: str, reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{kind}: server required in CI but unavailable: {reason}")
    pytest.skip(f"{kind}: not run: {reason}")


@dataclass
class Case:
    """One kind of client: the server it needs, how to make it from the server's base URL,
    the keyword options that isolate a test (a key prefix, a table), and how to check that
    it still works (``alive``) and to close it — the application's business, not latchkey's.
    ``required``: keyword arguments connect() needs with this client (a Sentinel's service),
    also in ``isolate``'s."""

    id: str
    server: str
    asyncio: bool
    make: Callable[[str], Any]
    isolate: Callable[[str], dict[str, Any]]
    alive: Callable[[Any], Any]
    close: Callable[[Any], Any]
    required: dict[str, Any] = field(default_factory=dict)


def _redis_sync(base: str) -> Any:
    import redis

    return redis.Redis.from_url(base)


def _redis_async(base: str) -> Any:
    import redis.asyncio

    return redis.asyncio.Redis.from_url(base)


def _node(base: str) -> tuple[str, int]:
    host, _, port = base.split("://", 1)[1].split(",")[0].partition(":")
    return host, int(port)


def _cluster_sync(base: str) -> Any:
    import redis.cluster

    host, port = _node(base)
    return redis.cluster.RedisCluster(host=host, port=port)


def _cluster_async(base: str) -> Any:
    import redis.asyncio.cluster

    host, port = _node(base)
    return redis.asyncio.cluster.RedisCluster(host=host, port=port)


#: The service the suite's Sentinel setup watches (tests/servers/redis_sentinel.py).
SERVICE = {"service": "latchkey"}


def _sentinel_sync(base: str) -> Any:
    import redis.sentinel

    return redis.sentinel.Sentinel([_node(base.split("/latchkey")[0])], socket_timeout=5)


def _sentinel_async(base: str) -> Any:
    import redis.asyncio.sentinel

    return redis.asyncio.sentinel.Sentinel([_node(base.split("/latchkey")[0])], socket_timeout=5)


def _sentinel_alive(client: Any) -> bool:
    return client.discover_master("latchkey") is not None


async def _asentinel_alive(client: Any) -> bool:
    return await client.discover_master("latchkey") is not None


def _pg_pool(base: str) -> Any:
    import psycopg_pool

    pool = psycopg_pool.ConnectionPool(base, min_size=1, max_size=4, open=False)
    pool.open(wait=True, timeout=30)
    return pool


def _pg_pool_alive(pool: Any) -> bool:
    with pool.connection(timeout=30) as conn:
        return conn.execute("SELECT 1").fetchone() == (1,)  # type: ignore[no-any-return]


def _pg_connection(base: str) -> Any:
    import psycopg

    return psycopg.connect(base)


def _pg_alive(conn: Any) -> bool:
    return conn.execute("SELECT 1").fetchone() == (1,)  # type: ignore[no-any-return]


def _engine(base: str) -> Any:
    import sqlalchemy

    return sqlalchemy.create_engine(base.replace("postgresql://", "postgresql+psycopg://"))


def _engine_alive(engine: Any) -> bool:
    import sqlalchemy

    with engine.connect() as conn:
        return conn.execute(sqlalchemy.text("SELECT 1")).scalar() == 1  # type: ignore[no-any-return]


async def _aping(client: Any) -> Any:
    return await client.ping()


async def _apg_pool(base: str) -> Any:
    import psycopg_pool

    pool = psycopg_pool.AsyncConnectionPool(base, min_size=1, max_size=4, open=False)
    await pool.open(wait=True, timeout=30)
    return pool


async def _apg_pool_alive(pool: Any) -> bool:
    async with pool.connection(timeout=30) as conn:
        cur = await conn.execute("SELECT 1")
        return await cur.fetchone() == (1,)  # type: ignore[no-any-return]


async def _apg_connection(base: str) -> Any:
    import psycopg

    return await psycopg.AsyncConnection.connect(base)


async def _apg_alive(conn: Any) -> bool:
    cur = await conn.execute("SELECT 1")
    return await cur.fetchone() == (1,)  # type: ignore[no-any-return]


def _async_engine(base: str) -> Any:
    from sqlalchemy.ext.asyncio import create_async_engine

    return create_async_engine(base.replace("postgresql://", "postgresql+psycopg://"))


async def _async_engine_alive(engine: Any) -> bool:
    import sqlalchemy

    async with engine.connect() as conn:
        return (await conn.execute(sqlalchemy.text("SELECT 1"))).scalar() == 1  # type: ignore[no-any-return]


def _mongo(base: str) -> Any:
    import pymongo

    return pymongo.MongoClient(base)  # its URI's database (latchkey_test) is the store's


def _mongo_database(base: str) -> Any:
    import pymongo

    return pymongo.MongoClient(base)["latchkey_own"]


def _mongo_alive(client: Any) -> bool:
    import pymongo.database

    db = client if isinstance(client, pymongo.database.Database) else client.admin
    return bool(db.command("ping")["ok"])


def _mongo_close(client: Any) -> None:
    import pymongo.database

    (client.client if isinstance(client, pymongo.database.Database) else client).close()


def _amongo(base: str) -> Any:
    import pymongo

    return pymongo.AsyncMongoClient(base)


async def _amongo_alive(client: Any) -> bool:
    return bool((await client.admin.command("ping"))["ok"])


def _mongo_isolate(tag: str) -> dict[str, Any]:
    # timeout: the suite's mongod may be an emulated one (tests/servers/mongodb.py)
    return {"collection": f"t_{tag}", "timeout": "20s"}


def _memcache_server(base: str) -> tuple[str, int]:
    host, _, port = base.split("://", 1)[1].split("?")[0].partition(":")
    return host, int(port)


def _memcache(base: str) -> Any:
    from pymemcache.client.base import Client

    return Client(_memcache_server(base), connect_timeout=30, timeout=30)


def _memcache_hash(base: str) -> Any:
    from pymemcache.client.hash import HashClient

    return HashClient([_memcache_server(base)], connect_timeout=30, timeout=30)


def _memcache_alive(client: Any) -> bool:
    key = f"app:{_tag()}"
    client.set(key, b"v", expire=60)
    return client.get(key) == b"v"  # type: ignore[no-any-return]


def _mysql_args(base: str) -> dict[str, Any]:
    from urllib.parse import urlsplit

    url = urlsplit(base)
    return {"host": url.hostname, "port": url.port, "user": url.username or "root",
            "password": url.password or "", "database": url.path.strip("/")}  # fmt: skip


def _pymysql(base: str) -> Any:
    import pymysql
    from pymysql.constants import CLIENT

    return pymysql.connect(**_mysql_args(base), client_flag=CLIENT.MULTI_STATEMENTS)


def _pymysql_alive(conn: Any) -> bool:
    with conn.cursor() as cur:
        cur.execute("SELECT 1")
        return cur.fetchone() == (1,)  # type: ignore[no-any-return]


def _mysql_engine(base: str) -> Any:
    import sqlalchemy
    from pymysql.constants import CLIENT

    flags = CLIENT.MULTI_STATEMENTS | CLIENT.FOUND_ROWS
    url = base.replace("mysql://", "mysql+pymysql://")
    return sqlalchemy.create_engine(url, connect_args={"client_flag": flags})


async def _asyncmy(base: str) -> Any:
    import asyncmy
    from asyncmy.constants import CLIENT

    return await asyncmy.connect(**_mysql_args(base), client_flag=CLIENT.MULTI_STATEMENTS)


async def _asyncmy_pool(base: str) -> Any:
    import asyncmy
    from asyncmy.constants import CLIENT

    flag = CLIENT.MULTI_STATEMENTS
    return await asyncmy.create_pool(**_mysql_args(base), client_flag=flag, maxsize=4)


async def _aiomysql(base: str) -> Any:
    import aiomysql

    args = _mysql_args(base)
    args["db"] = args.pop("database")
    return await aiomysql.connect(**args)  # (MULTI_STATEMENTS: aiomysql always asks)


async def _aiomysql_pool(base: str) -> Any:
    import aiomysql

    args = _mysql_args(base)
    args["db"] = args.pop("database")
    return await aiomysql.create_pool(**args, maxsize=4)


async def _amysql_alive(client: Any) -> bool:
    """An asyncmy or aiomysql connection, or a connection of such a pool, answers."""
    if hasattr(client, "acquire"):
        async with client.acquire() as conn:
            return await _amysql_alive(conn)
    async with client.cursor() as cur:
        await cur.execute("SELECT 1")
        return await cur.fetchone() == (1,)  # type: ignore[no-any-return]


async def _amysql_close(client: Any) -> None:
    if hasattr(client, "acquire"):  # a pool
        client.close()
        await client.wait_closed()
    else:
        await client.ensure_closed()


def _mysql_async_engine(driver: str) -> Callable[[str], Any]:
    def make(base: str) -> Any:
        from asyncmy.constants import CLIENT
        from sqlalchemy.ext.asyncio import create_async_engine

        # (aiomysql always asks for multi-statements; asyncmy is told, SQLAlchemy adds
        # FOUND_ROWS by itself only without connect_args' client_flag)
        flags = {"client_flag": CLIENT.MULTI_STATEMENTS | CLIENT.FOUND_ROWS}
        url = base.replace("mysql://", f"{driver}://")
        return create_async_engine(url, connect_args=flags if "asyncmy" in driver else {})

    return make


def _sqlite_engine(base: str) -> Any:
    import sqlalchemy

    return sqlalchemy.create_engine(base)


async def _amake(case: Case, base: str) -> Any:
    """The case's client; awaited if making it is a coroutine (an asyncio pool's opening)."""
    made = case.make(base)
    return await made if asyncio.iscoroutine(made) else made


CASES = [
    Case(
        "redis", "redis", False, _redis_sync, lambda tag: {"prefix": f"t{tag}:"},
        lambda c: c.ping(), lambda c: c.close(),
    ),
    Case(
        "redis-asyncio", "redis", True, _redis_async, lambda tag: {"prefix": f"t{tag}:"},
        _aping, lambda c: c.aclose(),
    ),
    Case(
        "redis-cluster", "redis_cluster", False, _cluster_sync,
        lambda tag: {"prefix": f"t{tag}:"}, lambda c: c.ping(), lambda c: c.close(),
    ),
    Case(
        "redis-cluster-asyncio", "redis_cluster", True, _cluster_async,
        lambda tag: {"prefix": f"t{tag}:"}, _aping, lambda c: c.aclose(),
    ),
    Case(
        "redis-sentinel", "redis_sentinel", False, _sentinel_sync,
        lambda tag: {"prefix": f"t{tag}:", **SERVICE}, _sentinel_alive, lambda c: c.close(),
        SERVICE,
    ),
    Case(
        "redis-sentinel-asyncio", "redis_sentinel", True, _sentinel_async,
        lambda tag: {"prefix": f"t{tag}:", **SERVICE}, _asentinel_alive, lambda c: c.aclose(),
        SERVICE,
    ),
    Case(
        "psycopg-pool", "postgresql", False, _pg_pool, lambda tag: {"table": f"t{tag}"},
        _pg_pool_alive, lambda c: c.close(),
    ),
    Case(
        "psycopg-connection", "postgresql", False, _pg_connection,
        lambda tag: {"table": f"t{tag}"}, _pg_alive, lambda c: c.close(),
    ),
    Case(
        "sqlalchemy-psycopg", "postgresql", False, _engine, lambda tag: {"table": f"t{tag}"},
        _engine_alive, lambda c: c.dispose(),
    ),
    Case(
        "psycopg-pool-asyncio", "postgresql", True, _apg_pool, lambda tag: {"table": f"t{tag}"},
        _apg_pool_alive, lambda c: c.close(),
    ),
    Case(
        "psycopg-connection-asyncio", "postgresql", True, _apg_connection,
        lambda tag: {"table": f"t{tag}"}, _apg_alive, lambda c: c.close(),
    ),
    Case(
        "sqlalchemy-psycopg-asyncio", "postgresql", True, _async_engine,
        lambda tag: {"table": f"t{tag}"}, _async_engine_alive, lambda c: c.dispose(),
    ),
    Case(
        "pymongo", "mongodb", False, _mongo, _mongo_isolate, _mongo_alive, _mongo_close,
    ),
    Case(
        "pymongo-database", "mongodb", False, _mongo_database, _mongo_isolate, _mongo_alive,
        _mongo_close,
    ),
    Case(
        "pymongo-asyncio", "mongodb", True, _amongo, _mongo_isolate, _amongo_alive,
        lambda c: c.close(),
    ),
    Case(
        "pymemcache", "memcached", False, _memcache, lambda tag: {"prefix": f"t{tag}:"},
        _memcache_alive, lambda c: c.close(),
    ),
    Case(
        "pymemcache-hash", "memcached", False, _memcache_hash,
        lambda tag: {"prefix": f"t{tag}:"}, _memcache_alive, lambda c: c.close(),
    ),
    Case(
        "pymysql", "mysql", False, _pymysql, lambda tag: {"table": f"t_{tag}"},
        _pymysql_alive, lambda c: c.close(),
    ),
    Case(
        "sqlalchemy-pymysql", "mysql", False, _mysql_engine, lambda tag: {"table": f"t_{tag}"},
        _engine_alive, lambda c: c.dispose(),
    ),
    Case(
        "asyncmy-connection", "mysql", True, _asyncmy, lambda tag: {"table": f"t_{tag}"},
        _amysql_alive, _amysql_close,
    ),
    Case(
        "asyncmy-pool", "mysql", True, _asyncmy_pool, lambda tag: {"table": f"t_{tag}"},
        _amysql_alive, _amysql_close,
    ),
    Case(
        "aiomysql-connection", "mysql", True, _aiomysql, lambda tag: {"table": f"t_{tag}"},
        _amysql_alive, _amysql_close,
    ),
    Case(
        "aiomysql-pool", "mysql", True, _aiomysql_pool, lambda tag: {"table": f"t_{tag}"},
        _amysql_alive, _amysql_close,
    ),
    Case(
        "sqlalchemy-asyncmy-asyncio", "mysql", True, _mysql_async_engine("mysql+asyncmy"),
        lambda tag: {"table": f"t_{tag}"}, _async_engine_alive, lambda c: c.dispose(),
    ),
    Case(
        "sqlalchemy-aiomysql-asyncio", "mysql", True, _mysql_async_engine("mariadb+aiomysql"),
        lambda tag: {"table": f"t_{tag}"}, _async_engine_alive, lambda c: c.dispose(),
    ),
    Case(
        "sqlalchemy-sqlite", "sqlite", False, _sqlite_engine, lambda tag: {"table": f"t_{tag}"},
        _engine_alive, lambda c: c.dispose(),
    ),
]  # fmt: skip


def _params() -> list[Any]:
    return [pytest.param(c, id=c.id, marks=pytest.mark.xdist_group(c.server)) for c in CASES]


@pytest.fixture(params=_params())
def case(request: pytest.FixtureRequest) -> Case:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def base(case: Case, server_pool: ServerPool, tmp_path: Path) -> str:
    if case.server == "sqlite":  # embedded: the application's database file
        return f"sqlite:///{tmp_path / 'app.db'}"
    try:
        return server_pool.base_url(case.server)
    except ServerUnavailable as exc:
        _skip_or_fail(case.server, str(exc))
        raise AssertionError("unreachable") from exc


def _tag() -> str:
    return uuid.uuid4().hex[:12]


def _sync_slice(store: latchkey.Store, name: str) -> None:
    lock = store.lock(name, ttl="30s", wait=0)
    assert lock.acquire()
    first = lock.token
    assert first is not None
    other = store.lock(name, ttl="30s", wait=0)
    assert not other.acquire()  # busy
    assert not store.is_free(name)
    assert lock.release()
    assert other.acquire()
    assert other.token is not None and other.token > first
    assert other.release()
    slots = [store.semaphore(f"{name}:sem", limit=2, ttl="30s", wait=0) for _ in range(3)]
    assert [s.acquire() for s in slots] == [True, True, False]
    for s in slots[:2]:
        assert s.release()
    record = store.record(f"{name}:rec")
    assert record.get() == (None, 0)
    version = record.set({"n": 1}, version=0)
    assert record.get() == ({"n": 1}, version)


async def _async_slice(store: Any, name: str) -> None:
    lock = store.lock(name, ttl="30s", wait=0)
    assert await lock.acquire()
    first = lock.token
    assert first is not None
    other = store.lock(name, ttl="30s", wait=0)
    assert not await other.acquire()
    assert not await store.is_free(name)
    assert await lock.release()
    assert await other.acquire()
    assert other.token is not None and other.token > first
    assert await other.release()
    slots = [store.semaphore(f"{name}:sem", limit=2, ttl="30s", wait=0) for _ in range(3)]
    assert [await s.acquire() for s in slots] == [True, True, False]
    for s in slots[:2]:
        assert await s.release()
    record = store.record(f"{name}:rec")
    assert await record.get() == (None, 0)
    version = await record.set({"n": 1}, version=0)
    assert await record.get() == ({"n": 1}, version)


def _run(coro: Awaitable[Any]) -> Any:
    async def main() -> Any:
        return await coro

    return asyncio.run(main())


def test_a_store_over_the_client_keeps_the_semantics_and_leaves_the_client_open(
    case: Case, base: str
) -> None:
    name = f"own:{_tag()}"
    if not case.asyncio:
        client = case.make(base)
        try:
            store = latchkey.connect(client=client, **case.isolate(_tag()))
            try:
                _sync_slice(store, name)
            finally:
                store.close()
            assert case.alive(client)  # latchkey closed only what it opened
        finally:
            case.close(client)
        return

    async def main() -> None:
        client = await _amake(case, base)
        try:
            store = latchkey.connect_async(client=client, url_options=case.isolate(_tag()))
            try:
                await _async_slice(store, name)
            finally:
                await store.aclose()
            assert await case.alive(client)
        finally:
            await case.close(client)

    _run(main())


def test_the_store_names_the_client_and_takes_its_options(case: Case, base: str) -> None:
    async def main() -> None:
        client = await _amake(case, base)
        opts = {**case.isolate(_tag()), "timeout": 7}
        try:
            if case.asyncio:
                store: Any = latchkey.connect_async(client=client, **opts)
            else:
                store = latchkey.connect(client=client, **opts)
            assert store.backend.config["timeout"] == 7.0
            assert store.backend.client is client
            assert f"(client {type(client).__module__}." in store.url
            assert "timeout=7" in store.url
            if case.asyncio:
                await store.aclose()
            else:
                store.close()
        finally:
            closed = case.close(client)
            if asyncio.iscoroutine(closed):
                await closed

    _run(main())


def test_a_bad_option_is_a_config_error_naming_it(case: Case, base: str) -> None:
    async def main() -> None:
        client = await _amake(case, base)
        connect: Any = latchkey.connect_async if case.asyncio else latchkey.connect
        try:
            needed = case.required
            with pytest.raises(ConfigError, match="nonsense"):
                connect(client=client, nonsense="1", **needed)
            with pytest.raises(ConfigError, match="timeout"):
                connect(client=client, timeout="soon", **needed)
            with pytest.raises(ConfigError, match="given twice"):
                connect(client=client, url_options={"timeout": 1}, timeout=2, **needed)
        finally:
            closed = case.close(client)
            if asyncio.iscoroutine(closed):
                await closed

    _run(main())


def test_a_client_of_the_other_mode_is_refused(case: Case, base: str) -> None:
    async def main() -> None:
        client = await _amake(case, base)
        shown = f"{type(client).__module__}.{type(client).__qualname__}"
        try:
            if case.asyncio:
                with pytest.raises(ConfigError, match="an asyncio client") as caught:
                    latchkey.connect(client=client)
                assert "connect_async" in str(caught.value)
            else:
                with pytest.raises(ConfigError, match="a sync client") as caught:
                    latchkey.connect_async(client=client)
            assert shown in str(caught.value)
        finally:
            closed = case.close(client)
            if asyncio.iscoroutine(closed):
                await closed

    _run(main())


# -- without a server ------------------------------------------------------------------------


def test_url_and_client_together_are_refused() -> None:
    import redis

    client = redis.Redis()
    try:
        with pytest.raises(ConfigError, match="not both"):
            latchkey.connect("redis://localhost/0", client=client)
        with pytest.raises(ConfigError, match="not both"):
            latchkey.connect_async("redis://localhost/0", client=client)
    finally:
        client.close()


@pytest.mark.parametrize("thing", [object(), "redis://localhost", 42, Path("x")])
def test_an_unsupported_client_names_its_type_and_what_is_accepted(thing: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        latchkey.connect(client=thing)
    message = str(caught.value)
    assert type(thing).__qualname__ in message
    assert "accepted: " in message and "redis.Redis" in message
    with pytest.raises(ConfigError) as caught:
        latchkey.connect_async(client=thing)
    assert "redis.asyncio.Redis" in str(caught.value)


def test_a_memcache_client_latchkey_cannot_reach_as_it_does_is_refused_saying_why() -> None:
    import ssl

    from pymemcache.client.base import Client
    from pymemcache.client.hash import HashClient

    with pytest.raises(ConfigError, match=r"UNIX socket '/run/memcached\.sock'"):
        latchkey.connect(client=Client("/run/memcached.sock"))
    tls = ssl.create_default_context()
    with pytest.raises(ConfigError, match=r"HashClient with a tls_context"):
        latchkey.connect(client=HashClient([("127.0.0.1", 1)], tls_context=tls))
    store = latchkey.connect(client=HashClient([("127.0.0.1", 1), ("127.0.0.2", 2)]))
    assert store.url.startswith("memcached://127.0.0.1:1,127.0.0.2:2 (client ")  # every server
    store.close()


@pytest.mark.parametrize("kind", ["redis", "redis_sentinel"])
def test_a_client_decoding_another_encoding_leaves_latchkeys_utf8(
    server_pool: ServerPool, kind: str
) -> None:
    """The application's client may read replies as latin-1: latchkey's connections, made
    from its settings, still read owner records and record values (UTF-8) right."""
    import redis
    import redis.sentinel

    try:
        base = server_pool.base_url(kind)
    except ServerUnavailable as exc:
        _skip_or_fail(kind, str(exc))
    metadata = {"who": "ünïcødé ✓ 锁"}
    if kind == "redis":
        client: Any = redis.Redis.from_url(base, encoding="latin-1", decode_responses=True)
        needed: dict[str, Any] = {}
    else:
        client = _sentinel_sync(base)
        client.connection_kwargs.update(encoding="latin-1", decode_responses=True)
        needed = SERVICE
    try:
        store = latchkey.connect(client=client, prefix=f"t{_tag()}:", **needed)
        with store.lock("enc", ttl="10s", wait=0, metadata=metadata):
            info = store.inspect("enc")
            assert info is not None and dict(info.owner.metadata) == metadata
        record = store.record("enc")
        record.set(metadata, version=0)
        assert record.get()[0] == metadata
        store.close()
    finally:
        client.close()


def test_a_sentinel_needs_its_service_and_no_other_client_takes_one() -> None:
    import redis
    import redis.asyncio.sentinel
    import redis.sentinel

    sentinel = redis.sentinel.Sentinel([("127.0.0.1", 1)])
    asentinel = redis.asyncio.sentinel.Sentinel([("127.0.0.1", 1)])
    plain = redis.Redis(port=1)
    try:
        for connect, client in ((latchkey.connect, sentinel), (latchkey.connect_async, asentinel)):
            with pytest.raises(ConfigError, match=r"Sentinel: give service='…' too, the name of"):
                connect(client=client)
            for bad in ("", "a/b", 7):
                with pytest.raises(ConfigError, match="service must be a master's name"):
                    connect(client=client, service=bad)
            with pytest.raises(ConfigError, match="unknown URL option 'nonsense'"):
                connect(client=client, service="mymaster", nonsense=1)
        with pytest.raises(ConfigError, match=r"service is the name of the master a "
                           r"redis\.sentinel\.Sentinel watches; a redis\.client\.Redis has none"):
            latchkey.connect(client=plain, service="mymaster")
        with pytest.raises(ConfigError, match="a sync client"):  # the mode comes first
            latchkey.connect_async(client=sentinel, service="mymaster")
        with pytest.raises(ConfigError, match="an asyncio client"):
            latchkey.connect(client=asentinel, service="mymaster")
    finally:
        sentinel.close()
        plain.close()


def test_a_sentinel_is_followed_with_latchkeys_timeouts_and_its_password_masked() -> None:
    import redis.sentinel

    app = redis.sentinel.Sentinel(
        [("127.0.0.1", 1), ("127.0.0.1", 2)],
        sentinel_kwargs={"password": PASSWORD, "socket_timeout": None},
        password=PASSWORD, db=4, min_other_sentinels=1,
    )  # fmt: skip
    store = latchkey.connect(client=app, service="mymaster", timeout="1s")
    try:
        assert store.url.startswith(
            "redis+sentinel://:***@127.0.0.1:1,127.0.0.1:2/mymaster?timeout=1s&db=4 (client "
        )
        assert store.backend.store.db == 4 and store.backend.store.service == "mymaster"
        ours = store.backend.io.sentinel
        assert ours is not app and ours.min_other_sentinels == 1
        for sentinel in ours.sentinels:  # the application's AUTH, latchkey's timeout
            kwargs = sentinel.connection_pool.connection_kwargs
            assert kwargs["password"] == PASSWORD and kwargs["socket_timeout"] == 1.0
        for shown in (repr(store), store.url, repr(store.backend)):
            assert PASSWORD not in shown
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as caught:  # no sentinel listens there
            store.lock("n", wait=0).acquire()
        assert time.monotonic() - started < 3
        assert PASSWORD not in str(caught.value)
    finally:
        store.close()
    assert app.sentinels[0].connection_pool.connection_kwargs["socket_timeout"] is None
    # TLS to the master (tested against TLS servers in test_redis_tls.py): rediss+sentinel
    tls_app = redis.sentinel.Sentinel([("127.0.0.1", 1)], ssl=True, ssl_ca_certs="/ca.pem")
    tls = latchkey.connect(client=tls_app, service="mymaster")
    try:
        assert tls.url.startswith("rediss+sentinel://127.0.0.1:1/mymaster")
        pool = tls.backend.io.client.connection_pool
        assert issubclass(pool.connection_class, redis.SSLConnection)
        assert pool.connection_kwargs["ssl_ca_certs"] == "/ca.pem"
    finally:
        tls.close()


def test_keyword_options_also_ride_with_a_url() -> None:
    store = latchkey.connect("memory://kw", timeout="2s")
    assert store.backend.config["timeout"] == 2.0
    store.close()
    with pytest.raises(ConfigError, match="given twice"):
        latchkey.connect("memory://kw?timeout=1", timeout=2)
    with pytest.raises(ConfigError, match="timeout"):
        latchkey.connect("memory://kw", timeout=object())


# -- passwords -------------------------------------------------------------------------------

PASSWORD = "pw-in-client-Zq81"


@pytest.fixture
def redis_with_password(tmp_path: Path) -> Iterator[int]:
    from tests.servers.redis import start_redis

    try:
        server = start_redis(tmp_path / "auth", password=PASSWORD)
    except ServerUnavailable as exc:
        _skip_or_fail("redis", str(exc))
    try:
        yield server.port
    finally:
        server.stop()


def test_the_clients_password_is_never_shown(redis_with_password: int) -> None:
    import redis
    import redis.asyncio

    port = redis_with_password
    client = redis.Redis(host="127.0.0.1", port=port, username="default", password=PASSWORD)
    try:
        store = latchkey.connect(client=client, prefix=f"t{_tag()}:")
        for shown in (repr(store), store.url, repr(store.backend), repr(store.backend.url)):
            assert PASSWORD not in shown
        assert "default:***@" in store.url
        with store.lock("n", ttl="10s", wait=0) as lock:  # AUTH taken from the client
            assert lock.token is not None
        store.close()
        assert client.ping()
    finally:
        client.close()
    wrong = redis.Redis(host="127.0.0.1", port=port, password=PASSWORD + "-wrong")
    try:
        store = latchkey.connect(client=wrong)
        with pytest.raises(StoreUnavailable) as caught:
            store.lock("n", wait=0).acquire()
        assert PASSWORD not in str(caught.value) and "***" in str(caught.value)
        store.close()
    finally:
        wrong.close()

    async def main() -> None:
        aclient = redis.asyncio.Redis(host="127.0.0.1", port=port, password=PASSWORD)
        try:
            astore = latchkey.connect_async(client=aclient, prefix=f"t{_tag()}:")
            assert PASSWORD not in repr(astore) and PASSWORD not in astore.url
            async with astore.lock("n", ttl="10s", wait=0) as lock:
                assert lock.token is not None
            await astore.aclose()
            assert await aclient.ping()
        finally:
            await aclient.aclose()

    _run(main())


def test_a_blocked_waiter_is_woken_by_the_release(case: Case, base: str) -> None:
    if case.asyncio:
        pytest.skip("the sync API's wait through a borrowed client; asyncio: the slice above")
    client = case.make(base)
    store = latchkey.connect(client=client, **case.isolate(_tag()))
    try:
        holder = store.lock("w", ttl="30s", wait=0)
        assert holder.acquire()
        first = holder.token
        assert first is not None
        got: list[int | None] = []

        def wait() -> None:
            with store.lock("w", ttl="30s", wait="60s") as lock:
                got.append(lock.token)

        thread = threading.Thread(target=wait)
        thread.start()
        assert not store.lock("w", wait=0).acquire()  # still held: the waiter waits
        assert holder.release()
        thread.join(60)
        assert got and got[0] is not None and got[0] > first
    finally:
        store.close()
        case.close(client)


def test_a_connection_inside_the_applications_transaction_is_not_joined(
    server_pool: ServerPool,
) -> None:
    import psycopg

    try:
        base = server_pool.base_url("postgresql")
    except ServerUnavailable as exc:
        _skip_or_fail("postgresql", str(exc))
    conn = psycopg.connect(base)
    try:
        store = latchkey.connect(client=conn, table=f"t{_tag()}")
        conn.execute("SELECT 1")  # the application's transaction is open now
        with pytest.raises(StoreUnavailable, match="transaction"):
            store.lock("n", wait=0).acquire()
        conn.rollback()
        with store.lock("n", ttl="10s", wait=0) as lock:  # idle again: usable
            assert lock.token is not None
        assert not conn.autocommit  # given back as it was lent
        store.close()
        assert not conn.closed
    finally:
        conn.close()


def test_an_engine_of_another_dialect_is_refused_naming_it() -> None:
    import pymysql
    import sqlalchemy

    engine = sqlalchemy.create_engine("mysql+mysqldb://app@db/app", module=pymysql)
    try:
        with pytest.raises(ConfigError, match=r"mysql\+mysqldb.*accepted: postgresql\+psycopg"):
            latchkey.connect(client=engine)
    finally:
        engine.dispose()


def test_an_engine_over_sqlite_is_the_engines_file_opened_by_latchkey(tmp_path: Path) -> None:
    import sqlalchemy

    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'app.db'}")
    try:
        store = latchkey.connect(client=engine, table="locks")
        assert store.url.startswith(f"sqlite:///{tmp_path / 'app.db'}?table=locks (client ")
        with store.lock("n", ttl="10s", wait=0) as lock:
            assert lock.token is not None
        store.close()
        with engine.connect() as conn:  # the same file: the application sees latchkey's table
            tables = conn.execute(sqlalchemy.text("SELECT name FROM sqlite_master")).scalars()
            assert "locks" in set(tables)
    finally:
        engine.dispose()
    for memory in ("sqlite://", "sqlite:///:memory:"):
        engine = sqlalchemy.create_engine(memory)
        try:
            with pytest.raises(ConfigError, match="in-memory"):
                latchkey.connect(client=engine)
        finally:
            engine.dispose()
