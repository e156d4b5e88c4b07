"""What only the MySQL/MariaDB stores have to show: table layout, key hashing, failure modes.

The shared semantics are tested by the rest of tests/contract on every store. Tests that stop
a server start their own disposable one, so the shared server stays up for the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pymysql
import pytest

import latchkey
from latchkey import ConfigError, LockLost, StoreUnavailable
from latchkey._types import Busy, Grant
from latchkey.stores import open_backend
from latchkey.stores.io.mysql_dsn import connect_args
from latchkey.stores.mysql import AsyncMySQLBackend, MySQLBackend
from latchkey.stores.mysql_getlock import (
    MAX_WAIT,
    WAIT_LOCK,
    AsyncGetLockBackend,
    GetLockBackend,
    lock_key,
    wait_seconds,
)
from tests import asyncmode
from tests.conftest import ServerPool
from tests.helpers import HOSTILE_NAMES, eventually
from tests.servers import RunningServer, ServerUnavailable, mariadb, replace_scheme, with_query

_selected = {s.strip() for s in os.environ.get("LATCHKEY_TEST_STORES", "").split(",") if s}
if _selected and not _selected & {"mysql", "mysql+getlock"}:
    pytest.skip("no mysql row is selected (LATCHKEY_TEST_STORES)", allow_module_level=True)

INFO = '{"host":"h","pid":1}'
PASSWORD = "S3cret-pw;'x"


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"mysql: server required in CI but unavailable: {reason}")
    pytest.skip(f"mysql: not run: {reason}")


def _owner() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def base(server_pool: ServerPool) -> str:
    """The shared server's mysql:// URL (no options)."""
    try:
        return server_pool.base_url("mysql")
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
        raise


@pytest.fixture
def table_url(base: str) -> str:
    return with_query(base, table=f"t_{uuid.uuid4().hex[:12]}")


@pytest.fixture
def backend(table_url: str) -> Iterator[MySQLBackend]:
    b = open_backend(table_url)
    assert isinstance(b, MySQLBackend)
    yield b
    b.close()


@pytest.fixture
def getlock(base: str) -> Iterator[GetLockBackend]:
    b = open_backend(with_query(replace_scheme(base, "mysql+getlock"), prefix="t:"))
    assert isinstance(b, GetLockBackend)
    yield b
    b.close()


def _root(url: str) -> pymysql.connections.Connection:
    b = open_backend(url)
    assert isinstance(b, MySQLBackend)
    return pymysql.connect(**connect_args(b))


@pytest.fixture(scope="module")
def own_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A private server that the fault tests stop and restart."""
    try:
        server = mariadb.start(tmp_path_factory.mktemp("mariadb"))
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
        raise
    yield server
    server.stop()


# -- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "query", ["table=x;drop", "table=1abc", f"table={'t' * 64}", "table=", "tabel=x"]
)
def test_bad_table_option_is_a_config_error(query: str) -> None:
    with pytest.raises(ConfigError, match=r"table|tabel"):
        open_backend(f"mysql://root@127.0.0.1:1/db?{query}")


def test_a_database_is_required() -> None:
    with pytest.raises(ConfigError, match="database"):
        open_backend("mysql://root@127.0.0.1:1")
    with pytest.raises(ConfigError, match="database"):
        open_backend("mariadb://root@127.0.0.1:1/")


def test_getlock_prefix_must_leave_room_for_names() -> None:
    with pytest.raises(ConfigError, match="prefix"):
        open_backend(f"mysql+getlock://root@127.0.0.1:1/db?prefix={'p' * 25}")
    with pytest.raises(ConfigError, match="prefix"):
        open_backend("mysql+getlock://root@127.0.0.1:1/db?prefix=a~b")


# -- table layout ----------------------------------------------------------------------------


def test_tables_and_names_as_utf8_bytes(backend: MySQLBackend, table_url: str) -> None:
    backend.init()
    grant = backend.acquire("ünï\x00", _owner(), INFO, 30)
    assert isinstance(grant, Grant)
    conn = _root(table_url)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT name, slot, token FROM {backend.store.table}")
            assert cur.fetchall() == (("ünï\x00".encode(), 0, grant.token),)
            cur.execute(f"SELECT k, v FROM {backend.store.table}_meta")
            assert dict(cur.fetchall()) == {"schema_version": 1}
            cur.execute(
                "SELECT table_name, engine FROM information_schema.tables "
                "WHERE table_schema = DATABASE() AND table_name LIKE %s",
                (backend.store.table + "%",),
            )
            engines = {str(row[0]): row[1] for row in cur.fetchall()}
            bells = f"{backend.store.table}_bells"  # waiters' connection ids: gone at restart
            assert engines.pop(bells) == "MEMORY"
            assert set(engines.values()) == {"InnoDB"}  # the leases, meta and records
    finally:
        conn.close()


def test_tables_created_by_processes_starting_at_once(table_url: str) -> None:
    backends = [open_backend(table_url) for _ in range(6)]
    errors: list[BaseException] = []

    def first_use(b: latchkey.stores.Backend) -> None:
        try:
            b.acquire("x", _owner(), INFO, 30)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=first_use, args=(b,)) for b in backends]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert len(backends[0].inspect("x").holders) == 1  # type: ignore[union-attr]
    for b in backends:
        b.close()


@pytest.mark.parametrize("hostile", HOSTILE_NAMES)
def test_hostile_names_round_trip(backend: MySQLBackend, hostile: str) -> None:
    owner = _owner()
    assert isinstance(backend.acquire(hostile, owner, INFO, 30), Grant)
    info = backend.inspect(hostile)
    assert info is not None and info.name == hostile
    assert [i.name for i in backend.list(prefix=hostile)] == [hostile]
    assert backend.release(hostile, owner) is True
    assert backend.inspect(hostile) is None


def test_names_and_owners_are_escaped_for_the_sessions_sql_mode(backend: MySQLBackend) -> None:
    """PyMySQL escapes parameters on the client: with NO_BACKSLASH_ESCAPES a backslash is a
    plain character and only quotes are doubled. Every statement, the hot EXECUTEs included,
    must follow the session's mode."""
    for mode in ("STRICT_ALL_TABLES", "STRICT_ALL_TABLES,NO_BACKSLASH_ESCAPES"):
        backend.close()  # the pool's connections closed: the next call opens one
        backend.init()  # a new connection, set as a server whose sql_mode is ``mode`` would
        pooled = backend.io.pool.get(5)  # that one: the pool gives it out again next
        pooled.cur.execute("SET SESSION sql_mode = %s", (mode,))
        backend.io.pool.put(pooled)
        for name in HOSTILE_NAMES:
            owner = f"{_owner()[:30]}\\'"  # ours are hex, but the path must not care
            info = '{"host": "it\'s \\\\ h", "pid": 1}'
            grant = backend.acquire(name, owner, info, 30)
            assert isinstance(grant, Grant), (mode, name)
            found = backend.inspect(name)
            assert found is not None and found.name == name
            assert found.holders[0].owner.host == "it's \\ h"
            assert backend.release(name, owner) is True, (mode, name)
            assert backend.inspect(name) is None


def test_lock_wait_timeout_is_a_lost_race_not_an_error(base: str) -> None:
    """A row locked by a stalled transaction: acquire gives up as Busy(0) within the
    session's innodb_lock_wait_timeout (half the store timeout), never StoreUnavailable."""
    url = with_query(base, table=f"t_{uuid.uuid4().hex[:12]}", timeout="2s")
    backend = open_backend(url)
    backend.acquire("stalled", _owner(), INFO, 0.001)
    conn = _root(url)
    try:
        with conn.cursor() as cur:
            cur.execute("START TRANSACTION")
            cur.execute(
                f"SELECT * FROM {backend.config['table']} WHERE name = %s FOR UPDATE",
                (b"stalled",),
            )
            started = time.monotonic()
            result = backend.acquire("stalled", _owner(), INFO, 30)
            assert isinstance(result, Busy) and result.holders == 0
            assert time.monotonic() - started < 5
            cur.execute("ROLLBACK")
        assert isinstance(backend.acquire("stalled", _owner(), INFO, 30), Grant)
    finally:
        conn.close()
        backend.close()


def test_claim_that_loses_a_deadlock_takes_nothing(base: str) -> None:
    """A claim chosen as a deadlock victim is rolled back whole: it reports nothing taken
    (every name was contended just then) and raises nothing."""
    url = with_query(base, table=f"t_{uuid.uuid4().hex[:12]}")
    backend = open_backend(url)
    backend.init()
    table = backend.config["table"]
    conn = _root(url)
    result: list[object] = []
    try:
        with conn.cursor() as cur:
            cur.execute("START TRANSACTION")
            # A heavier transaction (many rows) is not the one InnoDB picks as the victim.
            rows = [(f"junk{i}".encode(), _owner()) for i in range(200)]
            cur.executemany(
                f"INSERT INTO {table} (name, slot, owner, owner_info, acquired_at, expires_at) "
                "VALUES (%s, 0, %s, '{}', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))",
                rows,
            )
            cur.execute(
                f"INSERT INTO {table} (name, slot, owner, owner_info, acquired_at, expires_at) "
                "VALUES ('b', 0, %s, '{}', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))",
                (_owner(),),
            )
            claimer = threading.Thread(
                target=lambda: result.append(backend.claim(["a", "b"], _owner(), INFO, 30))
            )
            claimer.start()
            time.sleep(0.5)  # the claim now holds 'a' and waits for 'b'
            cur.execute(
                f"INSERT INTO {table} (name, slot, owner, owner_info, acquired_at, expires_at) "
                "VALUES ('a', 0, %s, '{}', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))",
                (_owner(),),
            )
            claimer.join(timeout=30)
            cur.execute("ROLLBACK")
        assert result == [{}]
    finally:
        conn.close()
        backend.close()


def _lock_waits(conn: pymysql.connections.Connection, table: str) -> int:
    """How many transactions wait for a row lock in an upsert into ``table`` right now."""
    with conn.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT' "
            "AND trx_query LIKE %s",
            (f"INSERT INTO {table} %",),
        )
        return int(cur.fetchone()[0])


def _hold_uncommitted(cur: Any, table: str, name: bytes) -> None:
    """Insert a live lease row of ``name`` in a transaction left open: upserts of that name
    wait for it."""
    cur.execute("START TRANSACTION")
    cur.execute(
        f"INSERT INTO {table} (name, slot, owner, owner_info, acquired_at, expires_at) "
        "VALUES (%s, 0, %s, '{}', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 1 HOUR)",
        (name, _owner()),
    )


def test_a_claim_draws_each_token_after_waiting_for_the_names_before_it(base: str) -> None:
    """A claim of 'a' and 'b' waits for 'a' (another transaction's uncommitted row); in the
    meantime another owner claims 'b' and releases it. The claim then takes 'b' with a token
    above that owner's: fencing tokens increase per name in grant order. (A multi-row upsert
    drew every name's token when it started, before its wait: 'b' got a smaller one.)"""
    url = with_query(base, table=f"t_{uuid.uuid4().hex[:12]}", timeout="30s")
    backend = open_backend(url)
    backend.init()
    table = backend.config["table"]
    blocker, observer = _root(url), _root(url)
    result: list[object] = []
    try:
        with blocker.cursor() as cur:
            _hold_uncommitted(cur, table, b"a")
            claimer = threading.Thread(
                target=lambda: result.append(backend.claim(["b", "a"], _owner(), INFO, 30))
            )
            claimer.start()
            eventually(lambda: _lock_waits(observer, table) == 1, what="the claim waiting")
            other = _owner()
            between = backend.claim(["b"], other, INFO, 30)
            assert backend.release_many(["b"], other) == 1
            assert _lock_waits(observer, table) == 1  # still waiting: all that was between
            cur.execute("ROLLBACK")
        claimer.join(30)
        (grants,) = result
        assert isinstance(grants, dict) and sorted(grants) == ["a", "b"]
        assert grants["b"].token > between["b"].token
        info = backend.inspect("b")
        assert info is not None and info.holder.token == grants["b"].token
    finally:
        blocker.close()
        observer.close()
        backend.close()


def test_a_claim_that_waits_out_the_lock_wait_timeout_takes_nothing(base: str) -> None:
    """A claim that took 'a' and then waited out the lock-wait timeout on 'b' (which rolls
    back that one statement, not the transaction) takes nothing: 'a' is not left leased,
    neither now nor when the connection's next claim commits."""
    url = with_query(base, table=f"t_{uuid.uuid4().hex[:12]}", timeout="2s")
    backend = open_backend(url)
    backend.init()
    table = backend.config["table"]
    blocker = _root(url)
    try:
        with blocker.cursor() as cur:
            _hold_uncommitted(cur, table, b"b")
            started = time.monotonic()
            assert backend.claim(["a", "b"], _owner(), INFO, 30) == {}
            assert time.monotonic() - started < 5
            cur.execute("ROLLBACK")
        assert sorted(backend.claim(["c"], _owner(), INFO, 30)) == ["c"]  # same connection
        assert backend.inspect("a") is None
        with blocker.cursor() as cur:
            cur.execute(f"SELECT name FROM {table} ORDER BY name")
            assert [bytes(row[0]) for row in cur.fetchall()] == [b"c"]
    finally:
        blocker.close()
        backend.close()


def test_mariadb_runs_the_hot_statements_prepared(backend: MySQLBackend, table_url: str) -> None:
    """On MariaDB acquire and release are EXECUTEs of statements prepared per connection; a
    connection the server ended is replaced and its statements prepared again."""
    backend.init()
    conn = _root(table_url)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT VERSION()")
            if "mariadb" not in str(cur.fetchone()[0]).lower():
                pytest.skip("MySQL server: the statements are sent as text")
            assert backend.store.prepared  # acquire and release EXECUTE
            owner = _owner()
            first = backend.acquire("prepared", owner, INFO, 30)
            assert isinstance(first, Grant)
            busy = backend.acquire("prepared", _owner(), INFO, 30)
            assert isinstance(busy, Busy) and busy.holders == 1 and busy.holder is not None
            assert busy.holder.token == first.token and busy.holder.owner.host == "h"
            assert 29 < (busy.retry_after or 0) <= 30
            pooled = backend.io.pool.get(5)  # the one connection in use
            backend.io.pool.put(pooled)
            thread_id = pooled.conn.thread_id()
            cur.execute("KILL CONNECTION %s", (thread_id,))
        time.sleep(0.2)
        assert backend.release("prepared", owner) is True  # a new connection, prepared again
        again = backend.acquire("prepared", owner, INFO, 30)
        assert isinstance(again, Grant) and again.token and first.token
        assert again.token > first.token
    finally:
        conn.close()


def test_the_text_statements_mysql_gets(backend: MySQLBackend) -> None:
    """MySQL has neither INSERT … RETURNING nor EXECUTE … USING with values: there a mutex
    acquire is the upsert then a read of the name's live leases, in one round trip. MariaDB
    accepts those statements too, so they are checked here."""
    backend.init()
    backend.store.prepared = False  # what setup() leaves for a MySQL server
    first, second = _owner(), _owner()
    grant = backend.acquire("text", first, INFO, 30)
    assert isinstance(grant, Grant) and grant.token is not None
    busy = backend.acquire("text", second, INFO, 30)
    assert isinstance(busy, Busy) and busy.holders == 1 and busy.holder is not None
    assert busy.holder.token == grant.token
    assert backend.release("text", second) is False
    assert backend.release("text", first) is True
    short = backend.acquire("text", second, INFO, 0.01)
    assert isinstance(short, Grant) and short.token is not None and short.token > grant.token
    time.sleep(0.05)
    taken = backend.acquire("text", first, INFO, 30)  # over the expired row
    assert isinstance(taken, Grant) and taken.token is not None and taken.token > short.token
    assert backend.release("text", second) is False


def test_a_forked_child_uses_its_own_connection(backend: MySQLBackend) -> None:
    owner = _owner()
    assert isinstance(backend.acquire("forked", owner, INFO, 30), Grant)
    pid = os.fork()
    if pid == 0:  # the child: a fresh connection; the parent's lease is not ours to release
        code = 0
        try:
            backend.now()
            code = 0 if backend.release("forked", _owner()) is False else 1
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    backend.now()  # the parent's connection was neither used nor closed by the child
    assert backend.release("forked", owner) is True


# -- failures --------------------------------------------------------------------------------


def test_wrong_password_is_unavailable_and_never_shown(base: str) -> None:
    user = f"lk_{uuid.uuid4().hex[:8]}"
    database = base.rsplit("/", 1)[1].split("?")[0]
    conn = _root(base)
    try:
        with conn.cursor() as cur:
            cur.execute(f"CREATE USER '{user}'@'%%' IDENTIFIED BY %s", (PASSWORD,))
            cur.execute(f"GRANT ALL ON {database}.* TO '{user}'@'%'")
    except pymysql.err.MySQLError as exc:
        conn.close()
        pytest.skip(f"cannot create a user on this server: {exc}")
    try:
        assert base.startswith("mysql://root@")
        right = base.replace("root@", f"{user}:S3cret-pw%3B%27x@")  # PASSWORD, URL-quoted
        wrong = base.replace("root@", f"{user}:Wr0ng-Secret%3B@")
        for scheme in ("mysql", "mysql+getlock"):
            url = replace_scheme(right, scheme)
            good = latchkey.connect(with_query(url, table="t_pw") if scheme == "mysql" else url)
            good.backend.now()
            assert PASSWORD not in repr(good) and PASSWORD not in repr(good.backend)
            good.close()
            bad = latchkey.connect(replace_scheme(wrong, scheme))
            with pytest.raises(StoreUnavailable) as caught:
                bad.lock("x", ttl="1s", wait=0).acquire()
            message = str(caught.value)
            assert "Wr0ng-Secret" not in message and "Wr0ng-Secret" not in repr(caught.value)
            assert "Access denied" in message
            bad.close()
    finally:
        with conn.cursor() as cur:
            cur.execute(f"DROP USER '{user}'@'%'")
        conn.close()


@pytest.mark.parametrize("scheme", ["mysql", "mysql+getlock"])
def test_unreachable_port_is_unavailable(scheme: str) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    store = latchkey.connect(f"{scheme}://root@127.0.0.1:{port}/db?timeout=1s")
    with pytest.raises(StoreUnavailable, match=r"127\.0\.0\.1"):
        store.lock("x", ttl="1s", wait=0).acquire()
    store.close()


@pytest.mark.parametrize("scheme", ["mysql", "mysql+getlock"])
def test_silent_server_times_out_within_the_timeout(scheme: str) -> None:
    """A peer that accepts and never answers: StoreUnavailable after about ``timeout``."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        store = latchkey.connect(f"{scheme}://root@127.0.0.1:{port}/db?timeout=1s")
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            store.lock("x", ttl="1s", wait=0).acquire()
        assert time.monotonic() - started < 4
        store.close()


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])  # closed again: nothing listens there


def test_a_host_list_where_none_answers_names_every_host(api: str) -> None:
    first, second = _closed_port(), _closed_port()
    url = f"mysql://app:S3cret@127.0.0.1:{first},127.0.0.1:{second}/db?timeout=1s"

    async def in_asyncio() -> None:
        async with latchkey.connect_async(url) as store:
            await store.lock("x", ttl="1s", wait=0).acquire()

    with pytest.raises(StoreUnavailable) as caught:
        if api == "sync":
            with latchkey.connect(url) as store:
                store.lock("x", ttl="1s", wait=0).acquire()
        else:
            asyncio.run(in_asyncio())
    message = str(caught.value)
    assert "no writable server among 2 hosts" in message
    for port in (first, second):
        assert f"127.0.0.1:{port}: Can't connect" in message, message
    assert "S3cret" not in message


def test_a_listed_host_that_never_answers_leaves_the_next_one_its_time(
    base: str, api: str
) -> None:
    """A peer that accepts and never answers, first in the host list: it gets its share of
    the timeout (half, of two hosts), the server after it the rest, and the call is granted
    within the timeout."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        address = base.split("@", 1)[1].split("/", 1)[0]
        url = with_query(base.replace(address, f"127.0.0.1:{port},{address}"), timeout="2s",
                         table=f"t_{uuid.uuid4().hex[:12]}")  # fmt: skip

        async def in_asyncio() -> bool:
            async with latchkey.connect_async(url) as store:
                return await store.lock("x", ttl="10s", wait=0).acquire()

        started = time.monotonic()
        if api == "sync":
            with latchkey.connect(url) as store:
                assert store.lock("x", ttl="10s", wait=0).acquire()
        else:
            assert asyncio.run(in_asyncio())
        assert time.monotonic() - started < 2.5


def test_a_connection_found_through_a_host_list_has_the_whole_timeout(base: str) -> None:
    """Each host of a list waits at most its share of the timeout while it is tried (the
    server here, first of three: a third); the connection kept has the whole timeout back for
    its statements: a take's statement of a second and a half runs, within 2 s."""
    table = f"ev_{uuid.uuid4().hex[:12]}"
    root = _root(base)
    try:
        with root.cursor() as cur:
            cur.execute(f"CREATE TABLE {table} (id INT PRIMARY KEY) ENGINE=InnoDB")
            cur.execute(f"INSERT INTO {table} VALUES (1)")
        root.commit()
        address = base.split("@", 1)[1].split("/", 1)[0]
        hosts = f"{address},127.0.0.1:{_closed_port()},127.0.0.1:{_closed_port()}"
        url = with_query(base.replace(address, hosts), timeout="2s")
        with latchkey.connect(url) as store, store.rows(table).take(limit=1) as batch:
            assert batch.execute("SELECT SLEEP(1.5)") == [(0,)]
    finally:
        with root.cursor() as cur:
            cur.execute(f"DROP TABLE IF EXISTS {table}")
        root.close()


def test_restart_keeps_leases_and_the_fencing_counter(own_server: RunningServer) -> None:
    """Tokens keep increasing across release, purge and restart, even when every row was
    deleted (AUTO_INCREMENT is persistent on MySQL 8 / MariaDB ≥ 10.2.4); a lease held
    across the restart is still held, and never granted twice."""
    url = with_query(own_server.url, table="restart", timeout="2s")
    store, other = latchkey.connect(url), latchkey.connect(url)
    seen = []
    for _ in range(3):
        with store.lock("fenced", ttl="30s") as lock:
            seen.append(lock.token)
    short = store.lock("gone", ttl="10ms")
    short.acquire()
    seen.append(short.token)
    time.sleep(0.05)
    store.purge_expired()
    assert list(store.list()) == []  # every lease row is gone
    holder = store.lock("held", ttl="60s")
    holder.acquire()
    seen.append(holder.token)
    own_server.stop()
    try:
        with pytest.raises(StoreUnavailable):
            other.lock("held", ttl="60s", wait=0).acquire()
    finally:
        own_server.start()
    assert other.lock("held", ttl="60s", wait=0).acquire() is False
    with store.lock("fenced", ttl="30s", wait="5s") as lock:
        assert lock.token is not None and lock.token > max(t for t in seen if t)
    holder.extend()
    assert holder.release() is True
    store.close()
    other.close()


def test_getlock_session_lost_on_restart_is_lock_lost(own_server: RunningServer) -> None:
    url = with_query(replace_scheme(own_server.url, "mysql+getlock"), timeout="2s")
    store, other = latchkey.connect(url), latchkey.connect(url)
    holder = store.lock("held", ttl="60s")
    assert holder.acquire()
    own_server.stop()
    try:
        with pytest.raises(StoreUnavailable):
            holder.extend()
    finally:
        own_server.start()
    with pytest.raises(LockLost):
        holder.extend()  # never silently re-taken on the new connection
    assert holder.release() is False
    with other.lock("held", ttl="60s", wait="5s"):  # the server ended the old session's lock
        pass
    store.close()
    other.close()


# -- GET_LOCK keys ---------------------------------------------------------------------------


def test_getlock_keys_fit_and_stay_readable() -> None:
    assert lock_key("jobs:nightly", "app:") == "app:jobs:nightly"  # plain: as is
    for name in ["x" * 255, "é" * 127, "Report 2024", "nul\x00inside", "a~b"]:
        key = lock_key(name, "app:")
        assert len(key) <= 64 and key.startswith("app:") and "~" in key
    assert lock_key("x" * 255, "app:").startswith("app:xxxxxxxx")  # the stem stays readable
    assert lock_key("x" * 60, "app:") == "app:" + "x" * 60  # exactly 64: still plain
    assert "~" in lock_key("x" * 61, "app:")
    # Names the server would confuse (case folded, cut at NUL) get distinct keys.
    assert lock_key("Job", "") != lock_key("job", "")
    assert lock_key("a\x00b", "") != lock_key("a\x00c", "") != lock_key("a", "")


def test_getlock_names_the_server_would_confuse_are_distinct(getlock: GetLockBackend) -> None:
    owners = {name: _owner() for name in ["Job", "job", "a\x00b", "a\x00c", "x" * 255, "x" * 254]}
    for name, owner in owners.items():
        assert isinstance(getlock.acquire(name, owner, INFO, 1), Grant), name
    for name, owner in owners.items():
        info = getlock.inspect(name)
        assert info is not None and info.name == name
        assert getlock.release(name, owner) is True


def test_getlock_plain_key_is_visible_to_other_tools(getlock: GetLockBackend, base: str) -> None:
    owner = _owner()
    getlock.acquire("jobs:nightly", owner, INFO, 1)
    conn = _root(base)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT IS_USED_LOCK('t:jobs:nightly') IS NOT NULL")
            assert cur.fetchone() == (1,)
    finally:
        conn.close()
    getlock.release("jobs:nightly", owner)


def test_getlock_one_take_one_count(getlock: GetLockBackend, base: str) -> None:
    """The take answers in its row count, with GET_LOCK inside a WHERE: it must run once (a
    second run would count a re-entry, and one release would leave the key held)."""
    owner = _owner()
    assert isinstance(getlock.acquire("counted", owner, INFO, 1), Grant)
    conn = _root(base)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT IS_USED_LOCK('t:counted') IS NOT NULL")
            assert cur.fetchone() == (1,)
            assert getlock.release("counted", owner) is True
            cur.execute("SELECT IS_USED_LOCK('t:counted')")
            assert cur.fetchone() == (None,)
            assert getlock.release("counted", owner) is False
    finally:
        conn.close()


def test_getlock_zero_is_busy_and_null_is_unavailable(
    getlock: GetLockBackend, base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = open_backend(with_query(replace_scheme(base, "mysql+getlock"), prefix="t:"))
    owner = _owner()
    assert isinstance(getlock.acquire("held", owner, INFO, 1), Grant)
    busy = other.acquire("held", _owner(), INFO, 1)  # GET_LOCK returned 0
    assert isinstance(busy, Busy) and busy.holders == 1 and busy.holder is not None
    # An empty key makes GET_LOCK return NULL on MariaDB (an error on MySQL): unavailable,
    # never busy.
    monkeypatch.setattr(other.store, "key", lambda name: "")
    with pytest.raises(StoreUnavailable):
        other.acquire("anything", _owner(), INFO, 1)
    other.close()
    getlock.release("held", owner)


def test_getlock_one_owner_cannot_use_anothers_lock_in_one_session(
    getlock: GetLockBackend,
) -> None:
    first, second = _owner(), _owner()
    assert isinstance(getlock.acquire("shared", first, INFO, 1), Grant)
    assert isinstance(getlock.acquire("shared", second, INFO, 1), Busy)  # no re-entry
    assert getlock.release("shared", second) is False
    assert getlock.extend("shared", second, 1) is None
    assert getlock.extend("shared", first, 1) == Grant(None, None)
    assert getlock.release("shared", first) is True


def test_getlock_force_release_ends_the_holders_session(getlock: GetLockBackend, base: str) -> None:
    holder = open_backend(with_query(replace_scheme(base, "mysql+getlock"), prefix="t:"))
    owner = _owner()
    assert isinstance(holder.acquire("victim", owner, INFO, 1), Grant)
    assert getlock.force_release("victim") is True
    assert holder.extend("victim", owner, 1) is None  # server reachable: the lock is lost
    assert holder.release("victim", owner) is False
    assert isinstance(getlock.acquire("victim", owner, INFO, 1), Grant)
    holder.close()


def test_getlock_claim_takes_the_free_and_releases_in_one_round_trip(
    getlock: GetLockBackend, base: str
) -> None:
    other = open_backend(with_query(replace_scheme(base, "mysql+getlock"), prefix="t:"))
    first, second = _owner(), _owner()
    names = [f"c{i}" for i in range(50)]
    assert set(getlock.claim(names[:10], first, INFO, 1)) == set(names[:10])
    taken = other.claim(names, second, INFO, 1)
    assert set(taken) == set(names[10:])
    assert other.release_many(names, second) == 40
    assert getlock.release_many(names, first) == 10
    other.close()


# -- GET_LOCK: waiting in the server -----------------------------------------------------------


class _Interrupted(BaseException):
    """Stands for Ctrl-C in a test (a real KeyboardInterrupt would stop pytest if it escaped)."""


def _getlock_url(base: str) -> str:
    return with_query(replace_scheme(base, "mysql+getlock"), prefix="t:")


def _waiting_ids(conn: pymysql.connections.Connection, key: str) -> list[int]:
    """The connections waiting in the server for ``key`` (state "User lock", in GET_LOCK)."""
    with conn.cursor() as cur:
        cur.execute(
            "SELECT ID FROM information_schema.PROCESSLIST "
            "WHERE STATE = 'User lock' AND LOCATE(%s, INFO) > 0",
            (f"GET_LOCK('{key}',",),
        )
        return [int(row[0]) for row in cur.fetchall()]


def _holder_id(conn: pymysql.connections.Connection, key: str) -> int | None:
    with conn.cursor() as cur:
        cur.execute("SELECT IS_USED_LOCK(%s)", (key,))
        found = cur.fetchone()[0]
    return None if found is None else int(found)


def _in_thread(call: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``call`` in a thread; its result (or the exception it raised) lands in the list."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # reported by the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _wait_in_another_process(url: str, name: str, conn: Any) -> None:
    """Spawned: block on ``name``, counting the try-acquires; report how the lock was got."""
    store = latchkey.connect(url)
    backend = store.backend
    assert isinstance(backend, GetLockBackend)
    tries: list[str] = []
    try_acquire = backend.acquire

    def counted(*args: Any) -> Any:
        tries.append(args[0])
        return try_acquire(*args)

    backend.acquire = counted  # type: ignore[method-assign,assignment]
    lock = store.lock(name, ttl="60s", wait="30s")
    ok = lock.acquire()
    session = backend.store.held[backend.store.key(name)].session
    assert backend.io.main is not None
    conn.send((ok, len(tries), session.id, backend.io.main.id))
    conn.recv()
    conn.send(lock.release())
    store.close()


def test_getlock_wait_seconds_never_pass_the_deadline() -> None:
    assert wait_seconds(0.7, fractions=True) == 0.7  # MariaDB: as asked
    assert wait_seconds(None, fractions=True) == MAX_WAIT
    assert wait_seconds(MAX_WAIT * 3, fractions=True) == MAX_WAIT
    assert wait_seconds(2.7, fractions=False) == 2.0  # MySQL rounds: whole seconds, down
    assert wait_seconds(0.7, fractions=False) == 0.0  # under a second left: a try only
    assert wait_seconds(-1.0, fractions=True) == 0.0


def test_getlock_a_waiter_in_another_process_is_granted_by_the_server(base: str) -> None:
    """The waiter blocks inside GET_LOCK (the server shows it in "User lock"); the release
    hands the lock to that very session: one try on the main session, never a retry."""
    url, name = _getlock_url(base), f"handoff-{uuid.uuid4().hex[:8]}"
    key = lock_key(name, "t:")
    store = latchkey.connect(url)
    holder = store.lock(name, ttl="60s")
    assert holder.acquire()
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_wait_in_another_process, args=(url, name, theirs), daemon=True)
    proc.start()
    root = _root(base)
    try:
        waiting = eventually(lambda: _waiting_ids(root, key), timeout=60, what="a wait")
        assert holder.release() is True
        assert ours.poll(30), "the waiter never acquired"
        ok, tries, holding_id, main_id = ours.recv()
        assert ok is True and tries == 1
        assert waiting == [holding_id] and holding_id != main_id
        assert _holder_id(root, key) == holding_id  # held where it was granted
        ours.send("release")
        assert ours.poll(30) and ours.recv() is True
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        root.close()
        store.close()


def test_getlock_two_locks_of_one_store_on_one_name(base: str) -> None:
    """A second Lock on a name this process holds waits in the server (no re-entry through
    the shared session) and is granted when the first releases."""
    store, name = latchkey.connect(_getlock_url(base)), "two-threads"
    backend = store.backend
    assert isinstance(backend, GetLockBackend)
    key = backend.store.key(name)
    first, second = store.lock(name, ttl="60s"), store.lock(name, ttl="60s", wait="30s")
    assert first.acquire()
    root = _root(base)
    try:
        thread, outcome = _in_thread(second.acquire)
        waiting = eventually(lambda: _waiting_ids(root, key), what="the second lock waiting")
        assert outcome == [] and _holder_id(root, key) == backend.io.main.id  # type: ignore[union-attr]
        assert first.release() is True
        thread.join(30)
        assert outcome == [True]
        assert _holder_id(root, key) == waiting[0]
        info = store.inspect(name)
        assert info is not None and info.holders[0].owner.pid == os.getpid()  # named as ours
        with pytest.raises(LockLost):
            first.extend()  # released: the second owner's lock is not the first's
        assert second.release() is True
        assert _holder_id(root, key) is None
        assert [s.id for s in backend.io.idle] == waiting  # lockless again: kept for reuse
    finally:
        root.close()
        store.close()


def test_getlock_wait_times_out_naming_the_holder(base: str) -> None:
    url, name = _getlock_url(base), "timed-out"
    other = open_backend(url)
    assert isinstance(other, GetLockBackend)
    assert isinstance(other.acquire(name, _owner(), INFO, 1), Grant)
    store = latchkey.connect(url)
    backend = store.backend
    assert isinstance(backend, GetLockBackend)
    lock = store.lock(name, ttl="60s", wait="400ms")
    started = time.monotonic()
    assert lock.acquire() is False
    elapsed = time.monotonic() - started
    assert 0.4 <= elapsed < 0.9  # MariaDB waits fractions of a second
    assert other.io.main is not None and lock.holder is not None
    assert lock.holder.owner.metadata == {"connection_id": other.io.main.id}
    assert len(backend.io.idle) == 1 and not backend.io.waiting  # the session is kept
    mine = store.lock(name + "-mine", ttl="60s")
    assert mine.acquire()
    again = store.lock(name + "-mine", ttl="60s", wait="200ms")
    assert again.acquire() is False  # held by another owner here: named as that owner
    assert again.holder is not None and again.holder.owner.pid == os.getpid()
    mine.release()
    other.close()
    store.close()


def test_getlock_whole_second_waits_on_mysql_never_pass_the_deadline(
    base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MySQL rounds GET_LOCK's wait to the nearest second: there the waits are whole seconds
    rounded down, and the last fraction is tried, not waited past the deadline."""
    url, name = _getlock_url(base), "whole-seconds"
    other = open_backend(url)
    assert isinstance(other.acquire(name, _owner(), INFO, 1), Grant)
    backend = open_backend(url)
    assert isinstance(backend, GetLockBackend)
    assert isinstance(backend.acquire_blocking(name, _owner(), INFO, 1, 1, 0.01), Busy)
    (session,) = backend.io.idle
    session.server = "8.0.36"  # as on MySQL
    sent: list[float] = []
    execute = session.cur.execute

    def spy(sql: str, params: Any = None) -> Any:
        if sql == WAIT_LOCK.text:
            sent.append(params[1])
        return execute(sql, params)

    monkeypatch.setattr(session.cur, "execute", spy)
    store = latchkey.Store(backend)
    started = time.monotonic()
    assert store.lock(name, ttl="60s", wait="1.5s").acquire() is False
    elapsed = time.monotonic() - started
    assert 1.5 <= elapsed < 2.5  # (the whole-second rounding itself: `sent`, below)
    assert sent[0] == 1.0 and set(sent[1:]) == {0.0}
    other.close()
    backend.close()


def test_getlock_killed_waiting_session_is_not_reused(base: str) -> None:
    url, name = _getlock_url(base), "killed-waiter"
    other = open_backend(url)
    owner = _owner()
    assert isinstance(other.acquire(name, owner, INFO, 1), Grant)
    store = latchkey.connect(url)
    backend = store.backend
    assert isinstance(backend, GetLockBackend)
    key = backend.store.key(name)
    root = _root(base)
    try:
        thread, outcome = _in_thread(store.lock(name, ttl="60s", wait="30s").acquire)
        (killed,) = eventually(lambda: _waiting_ids(root, key), what="a wait")
        with root.cursor() as cur:
            cur.execute("KILL CONNECTION %s", (killed,))
        thread.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], StoreUnavailable)
        assert not backend.io.idle and not backend.io.waiting
        # Killed while idle in the pool: found ended, closed, replaced.
        assert isinstance(backend.acquire_blocking(name, _owner(), INFO, 1, 1, 0.01), Busy)
        (idle,) = backend.io.idle
        with root.cursor() as cur:
            cur.execute("KILL CONNECTION %s", (idle.id,))
        eventually(lambda: backend.io.hung_up(idle), what="the kill seen")
        thread, outcome = _in_thread(store.lock(name, ttl="60s", wait="30s").acquire)
        (waiting,) = eventually(lambda: _waiting_ids(root, key), what="a new wait")
        assert waiting not in (killed, idle.id)
        assert other.release(name, owner) is True
        thread.join(30)
        assert outcome == [True] and _holder_id(root, key) == waiting
    finally:
        root.close()
        other.close()
        store.close()


def test_getlock_one_session_dying_loses_only_its_own_locks(base: str) -> None:
    url = _getlock_url(base)
    other = open_backend(url)
    store = latchkey.connect(url)
    backend = store.backend
    assert isinstance(backend, GetLockBackend)
    root = _root(base)

    def waited_for(name: str) -> tuple[latchkey.Lock, int]:
        """A lock this store got by waiting: held on an extra session."""
        owner = _owner()
        assert isinstance(other.acquire(name, owner, INFO, 1), Grant)
        lock = store.lock(name, ttl="60s", wait="30s")
        thread, outcome = _in_thread(lock.acquire)
        (session_id,) = eventually(lambda: _waiting_ids(root, backend.store.key(name)), what="wait")
        assert other.release(name, owner) is True
        thread.join(30)
        assert outcome == [True]
        return lock, session_id

    def kill(session_id: int) -> None:
        with root.cursor() as cur:
            cur.execute("KILL CONNECTION %s", (session_id,))

    try:
        on_main = store.lock("on-main", ttl="60s")
        assert on_main.acquire()
        on_extra, extra_id = waited_for("on-extra")
        kill(extra_id)
        eventually(lambda: _holder_id(root, backend.store.key("on-extra")) is None, what="the kill")
        with pytest.raises(LockLost):
            on_extra.extend()
        assert on_extra.release() is False
        on_main.extend()  # the main session's lock is untouched
        assert on_main.release() is True

        on_main = store.lock("on-main", ttl="60s")
        assert on_main.acquire()
        on_extra, extra_id = waited_for("on-extra")
        assert backend.io.main is not None
        kill(backend.io.main.id)
        eventually(lambda: _holder_id(root, backend.store.key("on-main")) is None, what="the kill")
        with pytest.raises(LockLost):
            on_main.extend()
        on_extra.extend()  # the extra session's lock is untouched
        assert _holder_id(root, backend.store.key("on-extra")) == extra_id
        assert on_extra.release() is True
    finally:
        root.close()
        other.close()
        store.close()


def test_getlock_interrupted_wait_closes_its_session(base: str) -> None:
    """Ctrl-C (any BaseException) in a wait closes that session, so nothing it might have
    been granted stays held; it never goes back to the pool."""
    url, name = _getlock_url(base), "interrupted"
    other = open_backend(url)
    owner = _owner()
    assert isinstance(other.acquire(name, owner, INFO, 1), Grant)
    store = latchkey.connect(url)
    backend = store.backend
    assert isinstance(backend, GetLockBackend)
    key = backend.store.key(name)
    root = _root(base)
    main_thread = threading.get_ident()

    def interrupt() -> None:
        eventually(lambda: _waiting_ids(root, key), what="a wait")
        signal.pthread_kill(main_thread, signal.SIGUSR1)

    def raise_interrupted(signum: int, frame: object) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGUSR1, raise_interrupted)
    try:
        thread = threading.Thread(target=interrupt, daemon=True)
        thread.start()
        with pytest.raises(_Interrupted):
            store.lock(name, ttl="60s", wait="30s").acquire()
        thread.join(30)
        assert not backend.io.idle and not backend.io.waiting
        eventually(lambda: not _waiting_ids(root, key), what="the session closed")
        assert other.release(name, owner) is True
        assert _holder_id(root, key) is None  # the closed wait took nothing
    finally:
        signal.signal(signal.SIGUSR1, previous)
        root.close()
        other.close()
        store.close()


def test_getlock_wait_longer_than_the_read_timeout(base: str) -> None:
    """A wait in the server is not a hung server: it may outlast the store's timeout."""
    url, name = with_query(_getlock_url(base), timeout="1s"), "long-wait"
    other = open_backend(url)
    owner = _owner()
    assert isinstance(other.acquire(name, owner, INFO, 1), Grant)
    store = latchkey.connect(url)
    root = _root(base)
    key = lock_key(name, "t:")
    try:
        thread, outcome = _in_thread(store.lock(name, ttl="60s", wait="30s").acquire)

        def waited_two_seconds() -> bool:
            with root.cursor() as cur:
                cur.execute(
                    "SELECT TIME FROM information_schema.PROCESSLIST WHERE ID IN %s",
                    (_waiting_ids(root, key) or [0],),
                )
                return any(row[0] >= 2 for row in cur.fetchall())

        eventually(waited_two_seconds, what="two seconds of waiting")
        assert other.release(name, owner) is True
        thread.join(30)
        assert outcome == [True]
    finally:
        root.close()
        other.close()
        store.close()


def test_getlock_close_ends_a_wait_in_progress(base: str) -> None:
    url, name = _getlock_url(base), "closed-while-waiting"
    other = open_backend(url)
    owner = _owner()
    assert isinstance(other.acquire(name, owner, INFO, 1), Grant)
    store = latchkey.connect(url)
    root = _root(base)
    try:
        thread, outcome = _in_thread(store.lock(name, ttl="60s", wait="30s").acquire)
        eventually(lambda: _waiting_ids(root, lock_key(name, "t:")), what="a wait")
        store.close()
        thread.join(10)
        assert len(outcome) == 1 and isinstance(outcome[0], StoreUnavailable)
        eventually(lambda: not _waiting_ids(root, lock_key(name, "t:")), what="the wait gone")
        assert other.release(name, owner) is True
    finally:
        root.close()
        other.close()
        store.close()


def test_getlock_a_forked_child_uses_none_of_the_parents_sessions(base: str) -> None:
    url = _getlock_url(base)
    other = open_backend(url)
    backend = open_backend(url)
    assert isinstance(backend, GetLockBackend)
    first, second, third = _owner(), _owner(), _owner()
    assert isinstance(backend.acquire("fork-main", first, INFO, 1), Grant)
    assert isinstance(other.acquire("fork-extra", third, INFO, 1), Grant)
    root = _root(base)
    try:
        thread, outcome = _in_thread(
            lambda: backend.acquire_blocking("fork-extra", second, INFO, 1, 1, 30)
        )
        eventually(lambda: _waiting_ids(root, backend.store.key("fork-extra")), what="a wait")
        assert other.release("fork-extra", third) is True
        thread.join(30)
        assert outcome == [Grant(None, None)]
        pid = os.fork()
        if pid == 0:  # the child: the parent's locks are not its own; its sessions are new
            code = 1
            try:
                taken = backend.acquire_blocking("fork-child", third, INFO, 1, 1, 5)
                if (
                    backend.release("fork-main", first) is False
                    and backend.release("fork-extra", second) is False
                    and taken == Grant(None, None)
                    and backend.release("fork-child", third) is True
                ):
                    code = 0
                backend.close()
            except BaseException:
                code = 2
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        assert backend.extend("fork-main", first, 1) == Grant(None, None)
        assert backend.extend("fork-extra", second, 1) == Grant(None, None)
        assert backend.release("fork-main", first) is True
        assert backend.release("fork-extra", second) is True
    finally:
        root.close()
        other.close()
        backend.close()


# -- the asyncio backends ----------------------------------------------------------------------


async def _until(probe: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    """``eventually`` for a coroutine: poll a (quick, blocking) probe, yielding to the loop."""
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(0.01)


def _counting(backend: Any, method: str) -> list[object]:
    """Count the calls of one backend primitive (wrapped on the instance)."""
    calls: list[object] = []
    original = getattr(backend, method)

    async def counted(*args: Any) -> Any:
        calls.append(args[0])
        return await original(*args)

    setattr(backend, method, counted)
    return calls


def _inserting(conn: pymysql.connections.Connection, table: str) -> int:
    """Other sessions running an INSERT into ``table`` now (not INNODB_LOCK_WAITS: InnoDB
    refreshes it only after 100 ms without a read, so a fast poll would never see a change)."""
    with conn.cursor() as cur:
        cur.execute(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
            "WHERE ID != CONNECTION_ID() AND LOCATE(%s, INFO) > 0",
            (f"INSERT INTO {table} ",),
        )
        return int(cur.fetchone()[0])


def test_async_cancelled_wait_leaves_nothing_held(table_url: str) -> None:
    """A waiting acquire() cancelled between attempts: nothing held, the backend still works."""
    holder, owner, name = open_backend(table_url), _owner(), "async-cancelled-wait"
    assert isinstance(holder.acquire(name, owner, INFO, 60), Grant)

    async def scenario() -> None:
        store = latchkey.connect_async(table_url)
        backend = store.backend
        assert isinstance(backend, AsyncMySQLBackend)
        attempts = _counting(backend, "acquire")
        task = asyncio.ensure_future(store.lock(name, ttl="60s", wait="30s").acquire())
        await _until(lambda: len(attempts) >= 3, "three attempts")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not backend.io.pool._busy  # no connection left checked out
        info = await store.inspect(name)
        assert info is not None and [h.owner.host for h in info.holders] == ["h"]  # only INFO's
        assert holder.release(name, owner) is True
        assert await store.inspect(name) is None  # the cancelled owner holds nothing
        lock = store.lock(name, ttl="60s", wait=0)
        assert await lock.acquire() is True
        assert await lock.release() is True
        await store.aclose()

    try:
        asyncio.run(scenario())
    finally:
        holder.close()


def _running(conn: pymysql.connections.Connection, text: str) -> int:
    """Other sessions whose statement (as the server shows it) contains ``text`` now."""
    with conn.cursor() as cur:
        cur.execute(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
            "WHERE ID != CONNECTION_ID() AND LOCATE(%s, INFO) > 0",
            (text,),
        )
        return int(cur.fetchone()[0])


def test_async_cancelled_statement_discards_its_connection(base: str, table_url: str) -> None:
    """A call that cannot grant (an extend) cancelled while its statement waits for a row
    lock in the server ends at once: that connection is closed, never pooled again, and the
    next call works on another."""
    url, name, owner = with_query(table_url, timeout="10s"), "async-cancelled-extend", _owner()
    root = _root(base)
    table = table_url.rsplit("table=", 1)[1]

    async def scenario() -> None:
        store = latchkey.connect_async(url)
        backend = store.backend
        assert isinstance(backend, AsyncMySQLBackend)
        assert isinstance(await backend.acquire(name, owner, INFO, 60.0, 1), Grant)
        with root.cursor() as cur:  # the lease row locked: the extend waits for it
            cur.execute("BEGIN")
            cur.execute(f"SELECT * FROM {table} WHERE name = %s FOR UPDATE", (name.encode(),))
        task = asyncio.ensure_future(backend.extend(name, owner, 60.0))
        await _until(lambda: _running(root, f"UPDATE {table} "), "a row-lock wait")
        pool = backend.io.pool
        (waiting,) = pool._busy  # id() of the connection in the row-lock wait
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not pool._busy and waiting not in [id(conn) for conn, _ in pool._idle]
        root.rollback()
        assert await backend.release(name, owner) is True
        await store.aclose()

    try:
        asyncio.run(scenario())
    finally:
        root.close()


def test_async_acquire_cancelled_in_the_server_runs_to_its_end(
    base: str, table_url: str
) -> None:
    """An acquire cancelled while its statement waits in the server (here for a gap lock
    another session holds) is not dropped: the statement runs to its end, then the core's
    release after the cancellation ends what it granted. Dropped (its connection closed), it
    would still run in the server after that release — which waits for nothing: there is no
    row to lock — and grant a lease to nobody for its TTL."""
    url, name = with_query(table_url, timeout="10s"), "\U0010ffff gap"  # sorts last
    root = _root(base)
    table = table_url.rsplit("table=", 1)[1]

    async def scenario() -> None:
        store = latchkey.connect_async(url)
        await store.init()  # the tables exist
        with root.cursor() as cur:  # the gap before the index's end locked: inserts wait
            cur.execute("BEGIN")
            cur.execute(f"SELECT * FROM {table} WHERE name = %s FOR UPDATE", (name.encode(),))
        task = asyncio.ensure_future(store.lock(name, ttl="60s", wait=0).acquire())
        await _until(lambda: _inserting(root, table), "the acquire waiting in the server")
        task.cancel()
        # Dropped, it would end at once (the release waits for nothing); run to its end, it
        # waits for the gap. Either way, then the gap is freed:
        await asyncio.wait({task}, timeout=1.0)
        root.rollback()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until(lambda: not _inserting(root, table), "the acquire's statement done")
        assert await store.inspect(name) is None, "a cancelled acquire left a lease to nobody"
        await store.aclose()

    try:
        asyncio.run(scenario())
    finally:
        root.close()


def test_async_a_row_lease_cancelled_in_the_server_gives_its_rows_back(
    base: str, table_url: str
) -> None:
    """A lease of rows cancelled while its claim waits in the server (here for a gap lock
    another session holds) runs to its end, then gives back what it leased, found by the
    batch's owner: the rows are due again at once. Dropped (its connection closed), the claim
    would still run in the server and commit leases that nobody holds, the rows out of reach
    for their TTL."""
    url = with_query(table_url, timeout="10s")
    root = _root(base)
    table = table_url.rsplit("table=", 1)[1]
    events = f"ev_{uuid.uuid4().hex[:12]}"
    with root.cursor() as cur:
        cur.execute(f"CREATE TABLE {events} (id INT PRIMARY KEY, processed_at INT)")
        cur.execute(f"INSERT INTO {events} (id) VALUES (1), (2), (3)")
    root.commit()

    def claiming() -> int:  # the lease's claim running in another session
        with root.cursor() as cur:
            cur.execute(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
                "WHERE ID != CONNECTION_ID() AND LOCATE(%s, INFO) > 0 AND LOCATE(%s, INFO) > 0",
                ("@lk_own", table),
            )
            return int(cur.fetchone()[0])

    async def scenario() -> None:
        store = latchkey.connect_async(url)
        await store.init()  # the tables exist
        queue = store.rows(events, order_by="id")
        with root.cursor() as cur:  # the gap before the index's end locked: inserts wait
            cur.execute("BEGIN")
            cur.execute(f"SELECT * FROM {table} WHERE name = %s FOR UPDATE", (b"\xff",))
        task = asyncio.ensure_future(queue.lease(limit=3, ttl="60s").__aenter__())
        await _until(claiming, "the lease's claim waiting in the server")
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)  # dropped, it would end at once
        root.rollback()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until(lambda: not claiming(), "the lease's claim done")
        for key in (1, 2, 3):
            assert await store.inspect(f"{events}:{key}") is None, "a cancelled lease left one"
        async with queue.lease(limit=3, ttl="60s") as again:
            assert [row["id"] for row in again] == [1, 2, 3]
        await store.aclose()

    try:
        asyncio.run(scenario())
    finally:
        with root.cursor() as cur:
            cur.execute(f"DROP TABLE {events}")
        root.close()


@pytest.mark.parametrize("scheme", ["mysql", "mysql+getlock"])
def test_async_silent_server_times_out_within_the_timeout(scheme: str) -> None:
    """A peer that accepts and never answers: StoreUnavailable after about ``timeout``."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]

        async def scenario() -> float:
            store = latchkey.connect_async(f"{scheme}://root@127.0.0.1:{port}/db?timeout=1s")
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await store.lock("x", ttl="1s", wait=0).acquire()
            elapsed = time.monotonic() - started
            await store.aclose()
            return elapsed

        assert asyncio.run(scenario()) < 4


def test_async_getlock_waiter_is_granted_by_the_server_in_one_wait(base: str) -> None:
    """A blocked acquire waits in the server and is granted on release: one try, one wait."""
    url, name = _getlock_url(base), "async-granted"
    other, owner = open_backend(url), _owner()
    assert isinstance(other.acquire(name, owner, INFO, 1), Grant)
    root = _root(base)

    async def scenario() -> None:
        store = latchkey.connect_async(url)
        backend = store.backend
        assert isinstance(backend, AsyncGetLockBackend)
        tries, waits = _counting(backend, "acquire"), _counting(backend, "acquire_blocking")
        lock = store.lock(name, ttl="60s", wait="30s")
        task = asyncio.ensure_future(lock.acquire())
        await _until(lambda: _waiting_ids(root, backend.store.key(name)), "a wait in the server")
        assert other.release(name, owner) is True
        assert await task is True
        assert (len(tries), len(waits)) == (1, 1)
        main = backend.io.main
        assert _holder_id(root, backend.store.key(name)) not in (None, main and main.id)
        assert await lock.release() is True
        await store.aclose()

    try:
        asyncio.run(scenario())
    finally:
        root.close()
        other.close()


def test_async_getlock_cancelled_wait_closes_its_session(base: str) -> None:
    """Cancelling a waiting acquire() closes its session: the server drops the wait, nothing
    is held, and the backend's other locks and later calls are unaffected."""
    url, name = _getlock_url(base), "async-cancelled"
    other, owner = open_backend(url), _owner()
    assert isinstance(other.acquire(name, owner, INFO, 1), Grant)
    root = _root(base)

    async def scenario() -> None:
        store = latchkey.connect_async(url)
        backend = store.backend
        assert isinstance(backend, AsyncGetLockBackend)
        key = backend.store.key(name)
        kept = store.lock("async-kept", ttl="60s", wait=0)
        assert await kept.acquire() is True
        task = asyncio.ensure_future(store.lock(name, ttl="60s", wait="30s").acquire())
        await _until(lambda: _waiting_ids(root, key), "a wait in the server")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not backend.io.waiting and not backend.io.idle
        await _until(lambda: not _waiting_ids(root, key), "the wait dropped")
        assert other.release(name, owner) is True
        assert _holder_id(root, key) is None  # the closed wait took nothing
        await kept.extend()  # still held: its session was not touched
        again = store.lock(name, ttl="60s", wait=0)
        assert await again.acquire() is True
        assert await again.release() is True
        assert await kept.release() is True
        await store.aclose()

    try:
        asyncio.run(scenario())
    finally:
        root.close()
        other.close()


def test_async_getlock_cancelled_acquire_keeps_the_other_locks(base: str) -> None:
    """A caller cancelled at any point of a quick acquire on the shared main session: the
    session (and the other locks in it) survives, and the cancelled owner holds nothing.

    The cancel comes after 0, 1, 2, … turns of the loop, until the acquire is done before
    it comes (then it holds the lock, on the main session): every point in between is tried,
    however many turns the acquire takes on this machine."""
    url = _getlock_url(base)
    root = _root(base)

    async def scenario(yields: int) -> bool:
        """Whether the cancel cut the acquire (False: the acquire was done first)."""
        name = f"async-cut-{yields}"
        store = latchkey.connect_async(url)
        backend = store.backend
        assert isinstance(backend, AsyncGetLockBackend)
        kept = store.lock(f"async-cut-kept-{yields}", ttl="60s", wait=0)
        assert await kept.acquire() is True
        assert backend.io.main is not None
        main_id = backend.io.main.id
        lock = store.lock(name, ttl="60s", wait=0)
        task = asyncio.ensure_future(lock.acquire())
        for _ in range(yields):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await store.inspect(name)  # after whatever the cancelled acquire left running
        assert backend.io.main is not None and backend.io.main.id == main_id
        assert _holder_id(root, backend.store.key(kept.name)) == main_id
        cut = task.cancelled()
        if cut:
            assert _holder_id(root, backend.store.key(name)) is None
        else:  # done before the cancel came: held, as any acquire that returned True
            assert task.result() is True
            assert _holder_id(root, backend.store.key(name)) == main_id
            assert await lock.release() is True
        assert await kept.release() is True
        await store.aclose()
        return cut

    try:
        cuts = []
        for yields in range(200):
            cuts.append(asyncio.run(scenario(yields)))
            if not cuts[-1]:
                break
        assert not cuts[-1], "the acquire never finished before the cancel"
        assert sum(cuts) >= 2  # cut before it began, and at least once on its way
    finally:
        root.close()


def test_async_aclose_ends_a_wait_in_progress(base: str) -> None:
    url, name = _getlock_url(base), "async-closed-while-waiting"
    other, owner = open_backend(url), _owner()
    assert isinstance(other.acquire(name, owner, INFO, 1), Grant)
    root = _root(base)

    async def scenario() -> None:
        store = latchkey.connect_async(url)
        key = lock_key(name, "t:")
        task = asyncio.ensure_future(store.lock(name, ttl="60s", wait="30s").acquire())
        await _until(lambda: _waiting_ids(root, key), "a wait in the server")
        await store.aclose()
        with pytest.raises(StoreUnavailable):
            await task
        await _until(lambda: not _waiting_ids(root, key), "the wait dropped")

    try:
        asyncio.run(scenario())
        assert other.release(name, owner) is True
    finally:
        root.close()
        other.close()


@pytest.mark.parametrize("kind", ["mysql", "mysql+getlock"])
@pytest.mark.parametrize("mode", ["sync", "asyncio"])
def test_driver_options_in_the_url_reach_the_connection(
    table_url: str, base: str, kind: str, mode: str
) -> None:
    """PyMySQL's own options pass through (issue 15): an ``init_command`` runs on every
    connection latchkey opens, seen here from outside as the named lock it takes."""
    marker = f"lk-init-{uuid.uuid4().hex[:8]}"
    url = table_url if kind == "mysql" else with_query(replace_scheme(base, kind), prefix="t:")
    url = with_query(url, init_command=f"DO GET_LOCK('{marker}', 0)", connect_timeout="3",
                     program_name="lk-test")  # fmt: skip
    with _root(table_url) as outside:

        def held() -> bool:
            with outside.cursor() as cur:
                cur.execute("SELECT IS_USED_LOCK(%s)", (marker,))
                return cur.fetchone()[0] is not None

        if mode == "sync":
            with latchkey.connect(url) as store, store.lock("n", ttl="30s"):
                assert held()
        else:

            async def body() -> bool:
                async with latchkey.connect_async(url) as store, store.lock("n", ttl="30s"):
                    return held()

            assert asyncio.run(body())


def _rows(server: RunningServer, table: str) -> int:
    """How many rows ``table`` of ``server``'s database has (a plain connection of its own)."""
    b = open_backend(server.url)
    args = connect_args(b)
    b.close()
    conn = pymysql.connect(**args, ssl_disabled=True)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT COUNT(*) FROM {table}")
            return int(cur.fetchone()[0])
    finally:
        conn.close()


def test_tls_is_used_as_pymysql_prefers_it_with_one_context_per_process(
    tmp_path: Path, base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``ssl_*`` options PyMySQL uses TLS when the server offers it (unverified) and
    falls back to plain when it does not, building a context for every connection (the
    system's CA bundle read each time: tens of milliseconds). latchkey's connections do the
    same with one context per process: to a server that offers TLS (started here with a
    certificate) each goes over TLS, to one that offers none (the shared server) each in
    plain, and ten of them, through both, build one context at most; the store works over
    TLS end to end."""
    from latchkey.stores.io import pymysql as driver
    from tests.servers.redis import make_certificates

    files = make_certificates(tmp_path / "tls")
    try:
        server = mariadb.start(
            tmp_path / "db",
            options=(f"--ssl-cert={files['server.pem']}", f"--ssl-key={files['server.key']}",
                     f"--ssl-ca={files['ca.pem']}"),
        )  # fmt: skip
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
        raise
    made: list[object] = []
    real = ssl.create_default_context

    def counted(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        made.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", counted)
    monkeypatch.setattr(driver, "_PREFERRED", [])
    monkeypatch.setattr(driver, "_NO_TLS", set())
    try:
        for url, over_tls in ((server.url, True), (base, False)):
            b = open_backend(url)
            args = connect_args(b)
            b.close()
            for _ in range(5):
                conn = driver.connect(args)
                try:
                    with conn.cursor() as cur:
                        cur.execute("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
                        cipher = cur.fetchone()[1]
                finally:
                    conn.close()
                assert bool(cipher) is over_tls, (url, cipher)
        assert len(made) <= 1, f"{len(made)} TLS contexts for ten connections"
        # End to end over TLS: a lease, a waiter in another store woken by its release (the
        # bell's own connection), a session lock; then the URL's options, as PyMySQL reads
        # them: a CA that signed the server's certificate, and one that did not.
        url = with_query(server.url, table="tls_locks")
        with latchkey.connect(url) as holding, latchkey.connect(url) as waiting:
            lock = holding.lock("over tls", ttl="30s")
            assert lock.acquire()
            assert holding.inspect("over tls").token == lock.token  # type: ignore[union-attr]
            got: list[bool] = []
            waiter = threading.Thread(
                target=lambda: got.append(waiting.lock("over tls", ttl="30s").acquire(wait=20))
            )
            waiter.start()
            try:
                eventually(lambda: _rows(server, "tls_locks_bells"), timeout=10,
                           what="the waiter's bell in place")  # fmt: skip
            finally:
                lock.release()
                waiter.join(30)
            assert got == [True]
        getlock = replace_scheme(server.url, "mysql+getlock")
        with latchkey.connect(getlock) as store, store.lock("session over tls"):
            assert store.inspect("session over tls") is not None
        verified = with_query(url, ssl_ca=str(files["ca.pem"]), ssl_verify_identity="true")
        with latchkey.connect(verified) as store, store.lock("verified", ttl="30s"):
            pass
        # asyncio, on the suite's long-lived loop: a TLS connection closed just before its
        # loop ends leaves its socket to the collector (the TLS goodbye needs the loop)
        store = asyncmode.connect(verified)
        try:
            with store.lock("verified async", ttl="30s"):
                pass
        finally:
            store.close()
        other = make_certificates(tmp_path / "other")
        refused = with_query(url, ssl_ca=str(other["ca.pem"]))  # a CA given: verified
        with latchkey.connect(refused) as store, pytest.raises(StoreUnavailable, match="certif"):
            store.lock("refused", ttl="30s").acquire()
    finally:
        server.stop()


def test_tls_options_read_as_pymysql_reads_them() -> None:
    from latchkey.stores.io.mysql_dsn import async_args, async_tls

    b = open_backend("mysql://u:pw@h/db?ssl_ca=/nonexistent/ca.pem&ssl_verify_identity=true")
    try:
        args = connect_args(b)
    finally:
        b.close()
    assert args["ssl_ca"] == "/nonexistent/ca.pem" and args["ssl_verify_identity"] is True
    with pytest.raises(FileNotFoundError):  # asyncmy's context loads the CA as PyMySQL would
        async_args(args)
    context = async_tls({"ssl_verify_cert": False})
    assert context is not None and context.verify_mode == ssl.CERT_NONE
    assert async_tls({"ssl_disabled": True, "ssl_ca": "x"}) is None
    assert async_tls({}) is None
    for bad in ("ssl_verify_cert=maybe", "connect_timeout=-1", "sql_mode=ANSI", "charset=latin1"):
        with pytest.raises(ConfigError):
            open_backend(f"mysql://u@h/db?{bad}")
