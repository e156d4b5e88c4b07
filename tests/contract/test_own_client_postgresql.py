"""A store over the application's own psycopg pool (``connect(client=pool)``) whatever the
application's session settings: latchkey's statements run with its own ``statement_timeout``
and ``TimeZone=UTC`` local to their transaction, and the pool's connections go back with the
application's settings untouched; ``store.rows`` (take and lease) over a borrowed pool."""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import latchkey
from tests.conftest import ServerPool
from tests.helpers import eventually
from tests.servers import ServerUnavailable

pytestmark = pytest.mark.xdist_group("postgresql")

#: The application's session settings: a statement_timeout far shorter than latchkey's lock
#: wait below, and a TimeZone well away from UTC.
APP_OPTIONS = "-c statement_timeout=300 -c TimeZone=Asia/Kolkata"


@pytest.fixture
def base(server_pool: ServerPool) -> str:
    try:
        return server_pool.base_url("postgresql")
    except ServerUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"postgresql: server required in CI but unavailable: {exc}")
        pytest.skip(f"postgresql: not run: {exc}")


@pytest.fixture
def pool(base: str) -> Iterator[Any]:
    import psycopg_pool

    pool = psycopg_pool.ConnectionPool(
        base, kwargs={"options": APP_OPTIONS}, min_size=1, max_size=4, open=False
    )
    pool.open(wait=True, timeout=30)
    try:
        yield pool
    finally:
        pool.close()


def _settings(pool: Any) -> tuple[str, str, bool]:
    with pool.connection(timeout=30) as conn:
        timeout = conn.execute("SHOW statement_timeout").fetchone()[0]
        zone = conn.execute("SHOW TimeZone").fetchone()[0]
        return timeout, zone, conn.autocommit


def test_latchkey_runs_with_its_own_settings_and_leaves_the_applications(
    pool: Any, base: str
) -> None:
    import psycopg

    assert _settings(pool) == ("300ms", "Asia/Kolkata", False)
    table = f"t{uuid.uuid4().hex[:12]}"
    store = latchkey.connect(client=pool, table=table, timeout="60s")
    try:
        with store.lock("warm", ttl="30s", wait=0) as lock:  # creates the tables
            assert lock.token is not None
        # Another session holds the lease table locked for longer than the application's
        # statement_timeout: latchkey's acquire waits on that lock (bounded by its own 60s).
        holder = psycopg.connect(base)
        # (pg_stat_activity is read from an autocommit session: a transaction's view of it is
        # a snapshot taken at its first read)
        watcher = psycopg.connect(base, autocommit=True)
        got: list[Any] = []
        try:
            holder.execute(f'LOCK TABLE "{table}" IN ACCESS EXCLUSIVE MODE')

            def acquire() -> None:
                try:
                    lock = store.lock("n", ttl="30s", wait=0)
                    got.append(lock.acquire() and lock.release())
                except Exception as exc:  # reported below
                    got.append(exc)

            thread = threading.Thread(target=acquire)
            thread.start()
            try:
                eventually(  # blocked on the lock for well past 300 ms, still waiting
                    lambda: got or watcher.execute(
                        "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND "
                        "state = 'active' AND clock_timestamp() - query_start > interval '1.5 s' "
                        "AND query LIKE %s", (f"%{table}%",),
                    ).fetchone(),
                    timeout=30, what="latchkey's statement waiting past 300 ms",
                )  # fmt: skip
                assert not got  # not cancelled by the application's statement_timeout
            finally:
                holder.rollback()
                thread.join(60)
        finally:
            holder.close()
            watcher.close()
        assert got == [True]
        with store.lock("n", ttl="30s", wait=0) as lock:
            assert lock.token is not None
        record = store.record("r")
        version = record.set({"at": "x"}, version=0)
        assert record.get() == ({"at": "x"}, version)
    finally:
        store.close()
    # Given back as lent: the application's settings, its autocommit off.
    assert _settings(pool) == ("300ms", "Asia/Kolkata", False)


@pytest.fixture
def jobs(pool: Any) -> Iterator[str]:
    """A job table with naive timestamps in UTC (as latchkey's own sessions read them): job 1
    due a minute ago, job 2 due in thirty minutes."""
    table = f"jobs_{uuid.uuid4().hex[:12]}"
    with pool.connection(timeout=30) as conn:
        conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, due_at timestamp, done bool)")
        conn.execute(
            f"INSERT INTO {table} VALUES "
            "(1, (now() AT TIME ZONE 'UTC') - interval '1 minute', false), "
            "(2, (now() AT TIME ZONE 'UTC') + interval '30 minutes', false)"
        )
    try:
        yield table
    finally:
        with pool.connection(timeout=30) as conn:
            conn.execute(f"DROP TABLE {table}")


def test_rows_over_a_borrowed_pool(pool: Any, jobs: str) -> None:
    store = latchkey.connect(client=pool, table=f"t{uuid.uuid4().hex[:12]}", timeout="30s")
    try:
        # The application's TimeZone would make job 2 due (naive 'UTC+30min' read as Kolkata
        # time is five hours ago); latchkey's statements read naive timestamps in UTC, as on
        # its own connections.
        rows = store.rows(jobs, key="id", where="NOT done AND due_at <= now()", order_by="id")
        with rows.take(limit=10) as batch:
            assert [row["id"] for row in batch] == [1]
            batch.execute(f"UPDATE {jobs} SET done = true WHERE id = %s", (1,))
        with rows.take(limit=10) as batch:
            assert list(batch) == []
        with pool.connection(timeout=30) as conn:  # committed, on the application's pool
            conn.execute(f"UPDATE {jobs} SET due_at = due_at - interval '1 hour' WHERE id = 2")
        with rows.lease(limit=10, ttl="30s") as leased:
            assert [row["id"] for row in leased] == [2]
            assert not store.is_free(f"{jobs}:2")
            with rows.lease(limit=10, ttl="30s") as again:  # leased: not due to another
                assert list(again) == []
    finally:
        store.close()
    assert _settings(pool) == ("300ms", "Asia/Kolkata", False)


def test_asyncio_pool_with_other_settings_and_rows(base: str, jobs: str) -> None:
    import psycopg_pool

    async def settings(pool: Any) -> tuple[str, str, bool]:
        async with pool.connection(timeout=30) as conn:
            timeout = (await (await conn.execute("SHOW statement_timeout")).fetchone())[0]
            zone = (await (await conn.execute("SHOW TimeZone")).fetchone())[0]
            return timeout, zone, conn.autocommit

    async def main() -> None:
        pool = psycopg_pool.AsyncConnectionPool(
            base, kwargs={"options": APP_OPTIONS}, min_size=1, max_size=4, open=False
        )
        await pool.open(wait=True, timeout=30)
        try:
            store = latchkey.connect_async(client=pool, table=f"t{uuid.uuid4().hex[:12]}")
            try:
                async with store.lock("n", ttl="30s", wait=0) as lock:
                    assert lock.token is not None
                    assert not await store.lock("n", wait=0).acquire()
                rows = store.rows(jobs, key="id", where="NOT done AND due_at <= now()")
                async with rows.take(limit=10) as batch:  # job 2 is not due in UTC
                    assert [row["id"] for row in batch] == [1]
                async with rows.lease(limit=10, ttl="30s") as leased:
                    assert [row["id"] for row in leased] == [1]
            finally:
                await store.aclose()
            assert await settings(pool) == ("300ms", "Asia/Kolkata", False)
        finally:
            await pool.close()

    asyncio.run(main())
