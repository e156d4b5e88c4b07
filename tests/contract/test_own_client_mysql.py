"""A store over the application's own PyMySQL connection or SQLAlchemy engine
(``mysql+pymysql``): latchkey's statements run with its own session settings (autocommit,
time_zone UTC, its innodb_lock_wait_timeout) and the application's come back after every
call, also after a statement the server refused; a connection inside the application's
transaction is refused, not joined; a connection or engine without multi-statements is a
ConfigError saying how to make one; a take (``store.rows``) over a borrowed engine."""

from __future__ import annotations

import os
import uuid
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
