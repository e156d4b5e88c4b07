"""What only the PostgreSQL stores have to show: table layout, options, connection failures,
LISTEN/NOTIFY, fork safety, and the advisory store's 64-bit keys and session ties.

The shared semantics are tested by the rest of tests/contract on both rows. Tests that stop a
server or need password authentication start their own disposable one, so the shared server
stays up for everyone else.
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import json
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import latchkey
from latchkey import ConfigError, StoreUnavailable
from latchkey._types import Busy, Grant
from latchkey.stores import open_async_backend, open_backend
from latchkey.stores.io.psycopg import Link, positional, queued_ahead
from latchkey.stores.pg_advisory import AdvisoryBackend, advisory_key
from latchkey.stores.postgresql import AsyncPostgreSQLBackend, PostgreSQLBackend
from latchkey.stores.postgresql_line import STARVED_MS, TURN_MS
from latchkey.stores.postgresql_tables import SCHEMA_VERSION
from tests.conftest import ServerPool
from tests.helpers import HOSTILE_NAMES, eventually
from tests.servers import RunningServer, ServerUnavailable, free_port
from tests.servers.postgresql import start as start_postgresql

_selected = {s.strip() for s in os.environ.get("LATCHKEY_TEST_STORES", "").split(",") if s}
if _selected and not _selected & {"postgresql", "postgresql+advisory"}:
    pytest.skip("no PostgreSQL row is selected (LATCHKEY_TEST_STORES)", allow_module_level=True)

INFO = '{"host":"h","pid":1}'


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"postgresql: server required in CI but unavailable: {reason}")
    pytest.skip(f"postgresql: not run: {reason}")


def _owner() -> str:
    return uuid.uuid4().hex


def _key_free(sql: psycopg.Connection[tuple[object, ...]], key: int) -> bool:
    """True if no session holds the advisory lock ``key`` (tried, and given back at once)."""
    row = sql.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
    if row is not None and row[0]:
        sql.execute("SELECT pg_advisory_unlock(%s)", (key,))
        return True
    return False


def _session(backend: Any) -> Any:
    """The session the next statement runs on: the lease table's most recently used pooled
    connection (a Session), the advisory store's session."""
    if isinstance(backend, PostgreSQLBackend):
        return backend.io.pool._idle[-1]
    if isinstance(backend, AsyncPostgreSQLBackend):
        return backend.io.pool._idle[-1][0]  # the asyncio pool keeps (connection, since)
    return backend.io.main


@pytest.fixture
def pg_base(server_pool: ServerPool) -> str:
    """The shared server's plain postgresql:// URL."""
    try:
        return server_pool.base_url("postgresql")
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
        raise AssertionError("unreachable") from exc


@pytest.fixture
def table() -> str:
    return f"t_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def backend(pg_base: str, table: str) -> Iterator[PostgreSQLBackend]:
    b = open_backend(f"{pg_base}?table={table}")
    assert isinstance(b, PostgreSQLBackend)
    yield b
    b.close()


@pytest.fixture
def advisory(pg_base: str) -> Iterator[AdvisoryBackend]:
    b = open_backend(f"{pg_base.replace('postgresql://', 'postgresql+advisory://')}"
                     f"?prefix=t{uuid.uuid4().hex[:12]}")
    assert isinstance(b, AdvisoryBackend)
    yield b
    b.close()


@pytest.fixture
def sql(pg_base: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A plain connection to look at what the stores wrote."""
    with psycopg.connect(pg_base, autocommit=True) as conn:
        yield conn


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RunningServer]:
    """A private server that a test may stop and restart."""
    try:
        server = start_postgresql(tmp_path / "pg")
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
        raise AssertionError("unreachable") from exc
    yield server
    server.stop()


# -- options and layout --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "query",
    ["table=x;drop", "table=a%20b", "table=1abc", f"table={'a' * 56}", "schema=pg-catalog",
     "schema=x'y", "table=", "sslmode=sometimes", "nosuch=1"],
)
def test_bad_options_are_config_errors(pg_base: str, query: str) -> None:
    with pytest.raises(ConfigError):
        open_backend(f"{pg_base}?{query}")
    with pytest.raises(ConfigError):
        open_backend(f"{pg_base.replace('postgresql://', 'postgresql+advisory://')}?{query}")


def test_a_unix_socket_directory_in_the_query_is_libpqs_host(own_server: RunningServer) -> None:
    """``postgresql:///db?host=/dir&port=N``, libpq's own URL for a Unix socket, reaches the
    server over that socket (both stores, sync and asyncio: the server sees their sessions
    with no client port); a host or port given twice — in the address and in the query — is a
    ConfigError saying so."""
    sockets = str(own_server.extra["sockets"])
    where = f"host={sockets}&port={own_server.port}"

    def over_the_socket(conn: psycopg.Connection[tuple[object, ...]]) -> int:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'latchkey%%' "
            "AND client_port = -1"  # a Unix-socket session
        ).fetchone()
        assert row is not None
        return int(row[0])  # type: ignore[call-overload]

    with psycopg.connect(
        host=sockets, port=own_server.port, user="postgres", dbname="postgres", autocommit=True
    ) as conn:
        for url in (
            f"postgresql://postgres@/postgres?{where}&table=t_socket",
            f"postgresql+advisory://postgres@/postgres?{where}&prefix=t_socket",
        ):
            store = latchkey.connect(url)
            try:
                with store.lock("over the socket", ttl="10s"):
                    assert store.inspect("over the socket") is not None
                    assert over_the_socket(conn) >= 1
            finally:
                store.close()

            async def over_asyncio(url: str = url) -> int:
                async with latchkey.connect_async(url) as astore:
                    async with astore.lock("over the socket, asyncio", ttl="10s"):
                        assert await astore.inspect("over the socket, asyncio") is not None
                        return over_the_socket(conn)

            assert asyncio.run(over_asyncio()) >= 1
    with pytest.raises(ConfigError, match="host given twice"):
        latchkey.connect(f"postgresql://127.0.0.1:{own_server.port}/postgres?host={sockets}")
    with pytest.raises(ConfigError, match="port given twice"):
        latchkey.connect(f"postgresql://127.0.0.1:{own_server.port}/postgres?port=5")


def test_tables_are_created_on_first_use_with_their_schema_version(
    backend: PostgreSQLBackend, table: str, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    assert isinstance(backend.acquire("n", _owner(), INFO, 30), Grant)
    relations = {
        row[0] for row in sql.execute(
            "SELECT relname FROM pg_class WHERE relname LIKE %s", (f"{table}%",)
        )
    }
    assert {table, f"{table}_fence", f"{table}_meta", f"{table}_records",
            f"{table}_expires", f"{table}_pkey"} <= relations
    row = sql.execute(f'SELECT value FROM "{table}_meta" WHERE key = %s',
                      ("schema_version",)).fetchone()
    assert row == (str(SCHEMA_VERSION),)


def test_tables_from_a_newer_version_are_refused(
    backend: PostgreSQLBackend, table: str, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    backend.init()
    sql.execute(f"UPDATE \"{table}_meta\" SET value = '999' WHERE key = 'schema_version'")
    with pytest.raises(StoreUnavailable, match="schema version 999"):
        backend.init()


def test_schema_option_puts_the_tables_there(
    pg_base: str, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    schema = f"S_{uuid.uuid4().hex[:8]}"  # mixed case: identifiers are quoted, not folded
    b = open_backend(f"{pg_base}?schema={schema}&table=Locks")
    try:
        assert isinstance(b.acquire("n", _owner(), INFO, 30), Grant)
        info = b.inspect("n")
        assert info is not None and info.token is not None
    finally:
        b.close()
    rows = sql.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = %s", (schema,)
    ).fetchall()
    assert {r[0] for r in rows} == {"Locks", "Locks_meta", "Locks_records", "Locks_waiters"}
    sql.execute(f'DROP SCHEMA "{schema}" CASCADE')


def test_concurrent_first_use_creates_the_tables_once(pg_base: str, table: str) -> None:
    backends = [open_backend(f"{pg_base}?table={table}") for _ in range(6)]
    results: list[object] = []

    def first_use(b: object) -> None:
        assert isinstance(b, PostgreSQLBackend)
        try:
            results.append(b.acquire(f"n{id(b)}", _owner(), INFO, 30))
        except Exception as exc:  # collected and asserted below
            results.append(exc)

    threads = [threading.Thread(target=first_use, args=(b,)) for b in backends]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for b in backends:
        b.close()
    assert all(isinstance(r, Grant) for r in results), results


def test_making_tables_that_exist_waits_for_no_release_in_progress(
    backend: PostgreSQLBackend, pg_base: str, table: str
) -> None:
    # A process that found the tables missing makes them after another process has made them
    # and started releasing: its CREATE script must take no lock on them (CREATE INDEX IF NOT
    # EXISTS does, and deadlocked with a release holding the waiters' table: CI, stop 28).
    backend.init()
    with psycopg.connect(pg_base) as busy:  # a transaction holding the tables as a release does
        busy.execute(f'LOCK TABLE "{table}", "{table}_waiters" IN ROW EXCLUSIVE MODE')
        late = open_backend(f"{pg_base}?table={table}&timeout=2")
        try:
            late.init()  # StoreUnavailable after 2 s if it waits for the transaction
        finally:
            late.close()
            busy.rollback()


def test_hostile_names_round_trip_as_utf8_bytes(
    backend: PostgreSQLBackend, table: str, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    for name in HOSTILE_NAMES:
        assert isinstance(backend.acquire(name, _owner(), INFO, 30), Grant)
    for name in HOSTILE_NAMES:
        info = backend.inspect(name)
        assert info is not None and info.name == name
    assert [i.name for i in backend.list()] == sorted(HOSTILE_NAMES, key=str.encode)
    stored = {bytes(r[0]) for r in sql.execute(f'SELECT name FROM "{table}"')}
    assert stored == {n.encode() for n in HOSTILE_NAMES}
    assert [i.name for i in backend.list("nul\x00")] == ["nul\x00inside"]


def test_positional_numbers_named_placeholders_in_first_use_order() -> None:
    query, names = positional(b"SELECT %(b)s, %(a)s, %(b)s, '100%%'")
    assert (query, names) == (b"SELECT $1, $2, $1, '100%'", ("b", "a"))
    with pytest.raises(ValueError, match="placeholders"):
        positional(b"SELECT %s")


def test_statements_sent_through_libpq_keep_the_values_psycopg_gives(
    backend: PostgreSQLBackend, table: str, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    # acquire/release go through Session.run_prepared (binary results decoded by hand):
    # the token and expiry must be what the row says, to the microsecond.
    owner = _owner()
    grant = backend.acquire("n\x00é'", owner, INFO, 12.5)
    assert isinstance(grant, Grant)
    row = sql.execute(f'SELECT token, expires_at, owner_info FROM "{table}" WHERE name = %s',
                      ("n\x00é'".encode(),)).fetchone()  # fmt: skip
    assert row is not None
    assert (grant.token, grant.expires_at, row[2]) == (row[0], row[1], INFO)
    assert grant.expires_at is not None and grant.expires_at.tzinfo is not None
    assert backend.release("n\x00é'", owner) is True
    assert backend.release("n\x00é'", owner) is False


def test_statements_dropped_behind_the_store_are_prepared_again(
    backend: PostgreSQLBackend, advisory: AdvisoryBackend
) -> None:
    for b in (backend, advisory):
        owner = _owner()
        assert isinstance(b.acquire("n", owner, INFO, 30), Grant)
        assert b.release("n", owner) is True
        conn = _session(b).conn
        assert conn is not None and _session(b).prepared  # what run_prepared made
        conn.execute("DEALLOCATE ALL")  # as psycopg does after a DROP or ROLLBACK it ran
        assert isinstance(b.acquire("n", owner, INFO, 30), Grant)
        assert b.release("n", owner) is True


def test_tables_dropped_while_in_use_are_created_again(
    backend: PostgreSQLBackend, table: str, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    owner = _owner()
    assert isinstance(backend.acquire("n", owner, INFO, 30), Grant)
    for suffix in ("", "_fence", "_meta", "_records", "_waiters"):
        sql.execute(f'DROP {"SEQUENCE" if suffix == "_fence" else "TABLE"} "{table}{suffix}"')
    assert backend.release("n", owner) is False  # the lease went with its table
    assert isinstance(backend.acquire("n", owner, INFO, 30), Grant)


def test_a_failing_statement_through_libpq_is_unavailable_with_the_servers_reason(
    backend: PostgreSQLBackend, table: str, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    owner = _owner()
    assert isinstance(backend.acquire("n", owner, INFO, 30), Grant)
    sql.execute(f'ALTER TABLE "{table}" ADD CONSTRAINT no_x CHECK (owner <> \'x\')')
    with pytest.raises(StoreUnavailable, match="no_x"):
        backend.acquire("m", "x", INFO, 30)
    assert isinstance(backend.acquire("m", owner, INFO, 30), Grant)  # the session still works


def test_each_primitive_is_one_statement(backend: PostgreSQLBackend) -> None:
    backend.init()
    backend.now()  # connected, statements rendered
    session = _session(backend)  # the one pooled connection a single thread uses
    calls: list[bytes] = []
    original = session.execute

    def counting(query: object, *args: object, **kwargs: object) -> object:
        calls.append(query)  # type: ignore[arg-type]
        return original(query, *args, **kwargs)

    session.execute = counting
    # The uncontended acquire and release go through libpq directly (prepared statements).
    run_prepared = session.run_prepared

    def counting_prepared(name: bytes, *args: object, **kwargs: object) -> object:
        calls.append(name)
        return run_prepared(name, *args, **kwargs)  # type: ignore[arg-type]

    session.run_prepared = counting_prepared
    owner = _owner()
    steps = [
        lambda: backend.acquire("n", owner, INFO, 30),
        lambda: backend.extend("n", owner, 30),
        lambda: backend.release("n", owner),
        lambda: backend.acquire("s", owner, INFO, 30, limit=3),
        lambda: backend.claim([f"c{i}" for i in range(100)], owner, INFO, 30),
        lambda: backend.release_many([f"c{i}" for i in range(100)], owner),
        lambda: backend.record_set("r", "1", 0),
        lambda: backend.record_get("r"),
        lambda: backend.record_delete("r", 1),
        lambda: backend.purge_expired(),
    ]
    for step in steps:
        calls.clear()
        step()
        assert len(calls) == 1
    # Busy costs a second statement, the holder look-up, so that a grant stays one plain
    # INSERT … ON CONFLICT (a combined statement cost ~20% of uncontended throughput).
    assert isinstance(backend.acquire("n", owner, INFO, 30), Grant)
    calls.clear()
    assert isinstance(backend.acquire("n", _owner(), INFO, 30), Busy)
    assert len(calls) == 2


# -- acquire details -------------------------------------------------------------------------


def test_busy_reports_the_holder_and_when_it_ends(backend: PostgreSQLBackend) -> None:
    assert isinstance(backend.acquire("n", _owner(), '{"host":"a","pid":7}', 30), Grant)
    busy = backend.acquire("n", _owner(), INFO, 30)
    assert isinstance(busy, Busy) and busy.holders == 1
    assert busy.holder is not None and busy.holder.owner.pid == 7
    assert busy.retry_after is not None and 25 < busy.retry_after <= 30
    for _ in range(2):
        assert isinstance(backend.acquire("s", _owner(), INFO, 30, limit=2), Grant)
    busy = backend.acquire("s", _owner(), INFO, 30, limit=2)
    assert isinstance(busy, Busy) and busy.holders == 2 and busy.holder is not None


def test_tokens_survive_purge_and_come_from_one_sequence(
    backend: PostgreSQLBackend,
) -> None:
    first = backend.acquire("a", _owner(), INFO, 0.05)
    assert isinstance(first, Grant) and first.token is not None
    eventually(lambda: backend.inspect("a") is None, what="expiry")
    assert backend.purge_expired() == 1
    second = backend.acquire("b", _owner(), INFO, 30)
    third = backend.acquire("a", _owner(), INFO, 30)
    assert isinstance(second, Grant) and isinstance(third, Grant)
    assert second.token is not None and third.token is not None
    assert first.token < second.token < third.token


def test_overlapping_claims_in_opposite_orders_never_deadlock(
    pg_base: str, table: str
) -> None:
    names = [f"c{i:03}" for i in range(60)]
    a, b = open_backend(f"{pg_base}?table={table}"), open_backend(f"{pg_base}?table={table}")
    errors: list[BaseException] = []

    def churn(backend: object, order: list[str]) -> None:
        assert isinstance(backend, PostgreSQLBackend)
        try:
            for _ in range(15):
                owner = _owner()
                taken = backend.claim(order, owner, INFO, 30)
                backend.release_many(list(taken), owner)
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(a, names)),
               threading.Thread(target=churn, args=(b, names[::-1]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a.close()
    b.close()
    assert errors == []


# -- waiting -----------------------------------------------------------------------------------


def test_release_from_another_connection_wakes_a_waiter(pg_base: str, table: str) -> None:
    url = f"{pg_base}?table={table}"
    waiting, holding = open_backend(url), open_backend(url)
    try:
        owner = _owner()
        assert isinstance(holding.acquire("n", owner, INFO, 60), Grant)
        with waiting.subscribe("n") as waiter, waiting.subscribe("other") as bystander:
            threading.Timer(0.2, lambda: holding.release("n", owner)).start()
            started = time.monotonic()
            assert waiter.wait(10) is True
            assert time.monotonic() - started < 2
            assert bystander.wait(0.05) is False  # notices are per name
    finally:
        waiting.close()
        holding.close()


def test_waiters_share_one_listening_connection(
    pg_base: str, table: str, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    b = open_backend(f"{pg_base}?table={table}&timeout=7")

    def listeners() -> int:
        row = sql.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE query ILIKE 'LISTEN%%' "
            "AND query LIKE %s", (f"%{table}%",)
        ).fetchone()
        return int(row[0]) if row else 0

    waiters = [b.subscribe(f"n{i}") for i in range(20)]
    assert listeners() == 1
    for w in waiters:
        w.close()
    b.close()
    eventually(lambda: listeners() == 0, what="listener closed")


@pytest.mark.parametrize("kind", ["postgresql", "postgresql+advisory"])
def test_handoff_to_a_blocked_waiter_is_prompt(pg_base: str, kind: str) -> None:
    url = f"{pg_base.replace('postgresql://', kind + '://')}?" + (
        f"table=t_{uuid.uuid4().hex[:12]}" if kind == "postgresql" else f"prefix=t{os.getpid()}"
    )
    a, b = latchkey.connect(url), latchkey.connect(url)
    try:
        holder = a.lock("h", ttl="60s")
        assert holder.acquire()
        got: list[float] = []

        def wait() -> None:
            lock = b.lock("h", ttl="60s", wait="20s")
            assert lock.acquire()
            got.append(time.monotonic())
            lock.release()

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.5)  # the waiter is blocked, its backoff grown past 0.25 s
        released = time.monotonic()
        holder.release()
        t.join(30)
        assert got and got[0] - released < 0.2  # woken by NOTIFY, not by its next poll
    finally:
        a.close()
        b.close()


# -- the waiter queue: release hands the lease over ------------------------------------------------


@pytest.fixture
def trio(pg_base: str, table: str) -> Iterator[list[PostgreSQLBackend]]:
    """Three backends on one table: three processes as far as the queue can tell (each has its
    own listener connection and listener key)."""
    backends = [open_backend(f"{pg_base}?table={table}") for _ in range(3)]
    assert all(isinstance(b, PostgreSQLBackend) for b in backends)
    yield backends  # type: ignore[misc]
    for b in backends:
        b.close()


def _queued(sql: psycopg.Connection[tuple[object, ...]], table: str) -> int:
    row = sql.execute(f'SELECT count(*) FROM "{table}_waiters"').fetchone()
    return int(row[0]) if row else 0


def _taken(sql: psycopg.Connection[tuple[object, ...]], table: str, ago: str) -> None:
    """Move the start of lease ``n`` to ``ago`` before the server's clock: ``'1 hour'``, a
    lease held for long (its release hands over); ``'-1 hour'``, one taken just now — and
    the queue's waiters an hour younger, in the same order, so none has waited
    ``STARVED_MS`` — so that its release rings, whatever this machine's pace."""
    sql.execute(f'UPDATE "{table}" SET acquired_at = clock_timestamp() - %s::interval '
                "WHERE name = 'n'", (ago,))  # fmt: skip
    if ago.startswith("-"):
        sql.execute(f'UPDATE "{table}_waiters" SET queued_at = queued_at + interval \'1 hour\'')


def _turn_due(sql: psycopg.Connection[tuple[object, ...]], table: str, owner: str) -> bool:
    """Whether ``owner``'s queue row was rung at least a turn ago by the server's clock."""
    row = sql.execute(
        f"SELECT rung_at <= clock_timestamp() - interval '{TURN_MS} milliseconds' "
        f'FROM "{table}_waiters" WHERE owner = %s', (owner,)
    ).fetchone()
    return bool(row and row[0])


def test_release_of_a_lease_held_long_hands_it_to_the_oldest_waiter_with_a_new_token(
    trio: list[PostgreSQLBackend], sql: psycopg.Connection[tuple[object, ...]], table: str
) -> None:
    a, b, c = trio
    first, second, third = _owner(), _owner(), _owner()
    granted = a.acquire("n", first, INFO, 30)
    assert isinstance(granted, Grant) and granted.token is not None
    wb = b.wait_in_line("n", second, '{"host":"b","pid":2}', 30, 1)
    wc = c.wait_in_line("n", third, '{"host":"c","pid":3}', 30, 1)
    _taken(sql, table, "1 hour")
    assert a.release("n", first)
    assert wb.wait(5)
    handed = wb.take_grant()
    assert handed is not None and handed.token is not None and handed.token > granted.token
    assert not wc.wait(0.2) and wc.take_grant() is None  # still held: only b was woken
    info = a.inspect("n")
    assert info is not None and info.token == handed.token and info.owner.host == "b"
    wb.close()
    _taken(sql, table, "1 hour")
    assert b.release("n", second)  # …and on to c, the next in line
    assert wc.wait(5)
    last = wc.take_grant()
    assert last is not None and last.token is not None and last.token > handed.token
    wc.close()
    assert c.release("n", third) and a.inspect("n") is None


def test_release_of_a_lease_just_taken_rings_the_first_waiter_which_gets_its_turn(
    trio: list[PostgreSQLBackend], sql: psycopg.Connection[tuple[object, ...]], table: str
) -> None:
    """The line's turns (docs/stores/postgresql.md, "Waiting"): the release of a lease taken
    less than a turn ago frees the name and rings the first waiter only; for a turn anyone
    may take the free name (here the holder again, as a looping holder does); the first
    release after the turn hands the lease to the rung waiter, with a new token; a rung
    waiter's own attempt that takes the name takes its queue row with it."""
    a, b, c = trio
    first, second, third = _owner(), _owner(), _owner()
    assert isinstance(a.acquire("n", first, INFO, 30), Grant)
    wb = b.wait_in_line("n", second, '{"host":"b","pid":2}', 30, 1)
    wc = c.wait_in_line("n", third, '{"host":"c","pid":3}', 30, 1)
    _taken(sql, table, "-1 hour")
    assert a.release("n", first)
    assert wb.wait(5) and wb.take_grant() is None  # rung: its turn to try, nothing handed
    assert a.inspect("n") is None  # the name is free…
    again = a.acquire("n", first, INFO, 30)  # …and the holder may take it again at once
    assert isinstance(again, Grant) and again.token is not None
    assert not wc.wait(0.2)  # only the first in line was rung
    eventually(lambda: _turn_due(sql, table, second), what="b's turn is due")
    _taken(sql, table, "-1 hour")  # (a lease just taken: the turn alone decides)
    assert a.release("n", first)
    assert wb.wait(5)
    handed = wb.take_grant()
    assert handed is not None and handed.token is not None and handed.token > again.token
    info = a.inspect("n")
    assert info is not None and info.token == handed.token and info.owner.host == "b"
    assert _queued(sql, table) == 1  # b left the queue with the hand-over
    wb.close()
    _taken(sql, table, "-1 hour")
    assert b.release("n", second)  # rings c, the next in line
    assert wc.wait(5) and wc.take_grant() is None
    mine = c.acquire("n", third, '{"host":"c","pid":3}', 30)
    assert isinstance(mine, Grant) and mine.token is not None and mine.token > handed.token
    assert _queued(sql, table) == 0  # the attempt that took it left the queue
    wc.finish(mine)
    wc.close()
    assert c.release("n", third) and a.inspect("n") is None


def test_a_rung_waiter_is_not_rung_again_within_its_turn(
    trio: list[PostgreSQLBackend], sql: psycopg.Connection[tuple[object, ...]], table: str
) -> None:
    """Within a turn, releases wake nobody and hand nothing over: the rung waiter is already
    trying, and a holder looping on the name costs the waiters nothing."""
    a, b, _ = trio
    first, second = _owner(), _owner()
    assert isinstance(a.acquire("n", first, INFO, 30), Grant)
    wb = b.wait_in_line("n", second, INFO, 30, 1)
    _taken(sql, table, "-1 hour")
    assert a.release("n", first)
    assert wb.wait(5) and wb.take_grant() is None
    # Hold the turn open (its start moved an hour ahead: the server's clock stays within it),
    # whatever this machine's pace between the statements below.
    sql.execute(f'UPDATE "{table}_waiters" SET rung_at = clock_timestamp() + interval '
                "'1 hour' WHERE owner = %s", (second,))  # fmt: skip
    for _ in range(3):  # a holder looping on the name within the turn
        assert isinstance(a.acquire("n", first, INFO, 30), Grant)
        _taken(sql, table, "-1 hour")
        assert a.release("n", first)
        assert a.inspect("n") is None  # freed each time, never handed over…
    assert not wb.wait(0.2)  # …and the rung waiter was not woken again
    assert _queued(sql, table) == 1
    wb.close()


def test_a_waiter_queued_long_enough_is_handed_the_lease_turn_or_not(
    trio: list[PostgreSQLBackend], sql: psycopg.Connection[tuple[object, ...]], table: str
) -> None:
    """The starvation bound: once first has waited STARVED_MS in the queue, the next release
    hands it the lease even if the holder took it a moment ago and first was never rung."""
    a, b, _ = trio
    first, second = _owner(), _owner()
    assert isinstance(a.acquire("n", first, INFO, 30), Grant)
    wb = b.wait_in_line("n", second, INFO, 30, 1)
    _taken(sql, table, "-1 hour")
    sql.execute(f'UPDATE "{table}_waiters" SET queued_at = clock_timestamp() - %s * '
                "interval '1 millisecond'", (STARVED_MS + 1,))  # fmt: skip
    assert a.release("n", first)
    assert wb.wait(5) and wb.take_grant() is not None
    assert _queued(sql, table) == 0
    wb.close()
    assert b.release("n", second)


def test_a_rung_waiter_has_nobody_of_its_process_ahead() -> None:
    """``Waiter.ahead`` counts the waiters of its process queued before it, which a release
    serves first; a rung waiter is the server's first, whatever order its process queued
    its waiters in, so it polls as the first does."""

    class W:
        def __init__(self, seq: int, rung: bool = False) -> None:
            self.ticket, self.seq, self.rung = seq, seq, rung

    line = [W(1), W(2), W(3)]
    assert [queued_ahead(line, w) for w in line] == [0, 1, 2]
    line[2].rung = True
    assert queued_ahead(line, line[2]) == 0


def test_waiters_made_before_turns_get_their_column_on_first_use(
    trio: list[PostgreSQLBackend], sql: psycopg.Connection[tuple[object, ...]], table: str
) -> None:
    """Tables made by a latchkey before turns have no ``rung_at``: the first statement that
    needs it adds it (the store's create, as for missing tables), and the line works."""
    a, b, _ = trio
    a.init()
    sql.execute(f'ALTER TABLE "{table}_waiters" DROP COLUMN rung_at')
    first, second = _owner(), _owner()
    assert isinstance(a.acquire("n", first, INFO, 30), Grant)
    wb = b.wait_in_line("n", second, INFO, 30, 1)
    _taken(sql, table, "-1 hour")
    assert a.release("n", first)  # needs rung_at: added, then run again
    assert wb.wait(5) and wb.take_grant() is None
    mine = b.acquire("n", second, INFO, 30)
    assert isinstance(mine, Grant)
    wb.finish(mine)
    wb.close()
    assert _queued(sql, table) == 0 and b.release("n", second)
    columns = sql.execute(
        "SELECT count(*) FROM information_schema.columns WHERE table_name = %s "
        "AND column_name = 'rung_at'", (f"{table}_waiters",)
    ).fetchone()
    assert columns == (1,)


def test_a_queued_waiter_knows_how_many_of_its_process_are_served_before_it(
    trio: list[PostgreSQLBackend],
) -> None:
    """``Waiter.ahead``: the queued waiters of one name in this process that joined the queue
    before this one (a release hands the lease to the oldest, so they all come first); a
    semaphore's waiters are not queued (0); when the first is served the others move up."""
    a, b, _ = trio
    assert isinstance(a.acquire("n", _owner(), INFO, 30), Grant)
    line = [b.wait_in_line("n", _owner(), INFO, 30, 1) for _ in range(3)]
    assert [w.ahead for w in line] == [0, 1, 2]
    assert isinstance(a.acquire("s", _owner(), INFO, 30, 2), Grant)
    assert isinstance(a.acquire("s", _owner(), INFO, 30, 2), Grant)
    slots = [b.wait_in_line("s", _owner(), INFO, 30, 2) for _ in range(2)]
    assert [w.ahead for w in slots] == [0, 0]
    line[0].close()
    assert [w.ahead for w in line[1:]] == [0, 1]
    for waiter in (*line[1:], *slots):
        waiter.close()

    async def asyncio_line() -> None:  # the asyncio listener's twin
        backend = open_async_backend(a.url.raw)
        try:
            aline = [await backend.wait_in_line("n", _owner(), INFO, 30, 1) for _ in range(3)]
            assert [w.ahead for w in aline] == [0, 1, 2]
            await aline[0].close()
            assert [w.ahead for w in aline[1:]] == [0, 1]
            for waiter in aline[1:]:
                await waiter.close()
        finally:
            await backend.aclose()

    asyncio.run(asyncio_line())


def test_a_waiter_whose_process_is_gone_is_passed_over(
    trio: list[PostgreSQLBackend], sql: psycopg.Connection[tuple[object, ...]], table: str
) -> None:
    a, b, c = trio
    first, gone, alive = _owner(), _owner(), _owner()
    assert isinstance(a.acquire("n", first, INFO, 30), Grant)
    b.wait_in_line("n", gone, INFO, 30, 1)
    wc = c.wait_in_line("n", alive, '{"host":"c","pid":3}', 30, 1)
    key = b.io.listener.listener_key
    b.close()  # its listener connection ends, and with it the listener key: "process died"
    # The server frees the key when the listener's session has ended, just after the close.
    eventually(lambda: _key_free(sql, key), what="the gone process's listener key freed")
    assert _queued(sql, table) == 2  # b's row is still there…
    _taken(sql, table, "1 hour")
    assert a.release("n", first)
    assert wc.wait(5) and wc.take_grant() is not None  # …but the lease went to c
    info = a.inspect("n")
    assert info is not None and info.owner.host == "c"
    wc.close()
    assert c.release("n", alive)
    assert a.purge_expired() == 0 and _queued(sql, table) == 0  # purge drops b's row


def test_a_lease_handed_to_a_waiter_that_gave_up_goes_to_the_next(
    trio: list[PostgreSQLBackend], sql: psycopg.Connection[tuple[object, ...]], table: str
) -> None:
    a, b, c = trio
    first, quitter, patient = _owner(), _owner(), _owner()
    assert isinstance(a.acquire("n", first, INFO, 30), Grant)
    wb = b.wait_in_line("n", quitter, INFO, 30, 1)
    wc = c.wait_in_line("n", patient, '{"host":"c","pid":3}', 30, 1)
    _taken(sql, table, "1 hour")
    assert a.release("n", first)
    assert wb.wait(5)  # handed over just as b's wait timed out: the core never takes it
    wb.finish(Busy(1))
    _taken(sql, table, "1 hour")
    wb.close()  # b releases it, which hands it on to c
    assert wc.wait(5) and wc.take_grant() is not None
    info = a.inspect("n")
    assert info is not None and info.owner.host == "c"
    wc.close()


def test_a_waiter_that_acquired_by_retrying_leaves_the_queue(
    trio: list[PostgreSQLBackend], sql: psycopg.Connection[tuple[object, ...]], table: str
) -> None:
    a, b, _ = trio
    first, second = _owner(), _owner()
    assert isinstance(a.acquire("n", first, INFO, 0.2), Grant)
    wb = b.wait_in_line("n", second, INFO, 30, 1)
    assert _queued(sql, table) == 1
    eventually(lambda: isinstance(b.acquire("n", second, INFO, 30), Grant), timeout=5,
               what="the first lease expired and b took it over")  # fmt: skip
    wb.finish(Grant(None, None))
    wb.close()
    assert _queued(sql, table) == 0  # a stale row would later be handed a lease nobody awaits
    assert a.inspect("n") is not None  # and b's lease is left alone
    assert b.release("n", second)


def test_an_attempt_that_finds_the_lease_handed_to_it_is_a_grant_with_what_is_left(
    trio: list[PostgreSQLBackend], sql: psycopg.Connection[tuple[object, ...]], table: str
) -> None:
    a, b, _ = trio
    first, second = _owner(), _owner()
    assert isinstance(a.acquire("n", first, INFO, 30), Grant)
    wb = b.wait_in_line("n", second, INFO, 20, 1)
    _taken(sql, table, "1 hour")
    assert a.release("n", first)  # handed to b while b was not looking
    mine = b.acquire("n", second, INFO, 20)
    assert isinstance(mine, Grant) and mine.remaining is not None and 0 < mine.remaining <= 20
    assert isinstance(a.acquire("n", _owner(), INFO, 30), Busy)  # and it is nobody else's
    wb.finish(mine)
    wb.close()
    assert b.release("n", second)


_QUEUED_CHILD = """
import sys, latchkey
latchkey.connect(sys.argv[1]).lock("k", ttl="60s", wait="60s").acquire()
"""


def test_a_killed_waiting_process_is_passed_over_at_once(
    pg_base: str, table: str, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    """A real process dies while queued: the next release must not hand it the lease (that
    would stall the name for the lease's 60 s) but give it to the live waiter behind it."""
    url = f"{pg_base}?table={table}"
    first, second = latchkey.connect(url), latchkey.connect(url)
    try:
        holder = first.lock("k", ttl="60s")
        assert holder.acquire()
        child = subprocess.Popen([sys.executable, "-c", _QUEUED_CHILD, url])
        try:
            eventually(lambda: _queued(sql, table) == 1, timeout=30, what="the child queued")
            row = sql.execute(f'SELECT listener_key FROM "{table}_waiters"').fetchone()
            assert row is not None
            child_key = int(row[0])  # type: ignore[call-overload]
        finally:
            child.kill()
            child.wait()
        unsigned = child_key & 0xFFFF_FFFF_FFFF_FFFF

        def child_key_held() -> bool:
            found = sql.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 "
                "AND classid = %s::bigint::oid AND objid = %s::bigint::oid",
                (unsigned >> 32, unsigned & 0xFFFF_FFFF),
            ).fetchone()
            return bool(found and found[0])

        eventually(lambda: not child_key_held(), what="the server ended the child's sessions")
        assert _queued(sql, table) == 1  # the dead child's row is still in the queue
        got: list[float] = []
        waiter = second.lock("k", ttl="60s", wait="30s")
        t = threading.Thread(target=lambda: got.append(time.monotonic()) if waiter.acquire()
                             else None)  # fmt: skip
        t.start()
        eventually(lambda: _queued(sql, table) == 2, what="the live waiter queued")
        released = time.monotonic()
        assert holder.release()
        t.join(40)
        assert got and got[0] - released < 5  # handed over, not left to a 60 s lease
        info = first.inspect("k")
        assert info is not None and info.owner.pid == os.getpid()
        waiter.release()
    finally:
        first.close()
        second.close()


def test_a_queue_row_left_by_an_outage_gives_back_what_it_is_handed(
    trio: list[PostgreSQLBackend], sql: psycopg.Connection[tuple[object, ...]], table: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    a, b, _ = trio
    first, stale = _owner(), _owner()
    assert isinstance(a.acquire("n", first, INFO, 30), Grant)
    wb = b.wait_in_line("n", stale, INFO, 30, 1)
    original = Link.execute

    def dequeue_fails(link: Link, query: str, params: Any) -> Any:
        if query == b.store.DEQUEUE:  # type: ignore[attr-defined]
            raise psycopg.OperationalError("the server went away just then")
        return original(link, query, params)

    monkeypatch.setattr(Link, "execute", dequeue_fails)
    wb.finish(Grant(None, None))  # the wait ended (say it took the lock by retrying)…
    wb.close()  # …and could not leave the queue
    monkeypatch.undo()
    assert _queued(sql, table) == 1
    _taken(sql, table, "1 hour")
    assert a.release("n", first)  # hands the lease to b's stale row: nobody waits for it
    eventually(lambda: a.inspect("n") is None, timeout=5,
               what="b's listener gave the orphaned lease back")  # fmt: skip


def test_semaphore_waiters_are_not_queued(
    backend: PostgreSQLBackend, sql: psycopg.Connection[tuple[object, ...]], table: str
) -> None:
    backend.init()
    with backend.wait_in_line("s", _owner(), INFO, 30, 3):
        assert _queued(sql, table) == 0


def test_a_blocked_lock_returns_on_the_hand_over_without_retrying(
    pg_base: str, table: str
) -> None:
    url = f"{pg_base}?table={table}"
    a, b = latchkey.connect(url), latchkey.connect(url)
    try:
        holder = a.lock("h", ttl="60s")
        assert holder.acquire() and holder.token is not None
        first_token = holder.token
        attempts: list[float] = []
        backend = b.backend
        original = backend.acquire

        def counting(*args: object, **kwargs: object) -> object:
            attempts.append(time.monotonic())
            return original(*args, **kwargs)  # type: ignore[arg-type]

        backend.acquire = counting  # type: ignore[method-assign]
        result: list[latchkey.Lock] = []
        waiter = b.lock("h", ttl="60s", wait="30s")
        t = threading.Thread(target=lambda: result.append(waiter) if waiter.acquire() else None)
        t.start()
        eventually(lambda: len(attempts) >= 2 and a.backend.inspect("h") is not None,
                   what="the waiter is queued")  # fmt: skip
        released = time.monotonic()
        assert holder.release()
        t.join(30)
        assert result and waiter.token is not None and waiter.token > first_token
        remaining = waiter.remaining()
        assert remaining is not None and 0 < remaining <= 60
        # handed over: no attempt was needed after the release (a backoff retry may only
        # coincide with it by chance; at most one)
        assert len([t for t in attempts if t >= released]) <= 1
        waiter.release()
    finally:
        a.close()
        b.close()


# -- connection failures -------------------------------------------------------------------------


def test_wrong_password_is_unavailable_and_never_shown(tmp_path: Path) -> None:
    secret = f"Right-{uuid.uuid4().hex[:8]}"
    try:
        server = start_postgresql(tmp_path / "pg", password=secret)
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
        raise AssertionError("unreachable") from exc
    try:
        wrong = f"Wrong-{uuid.uuid4().hex[:8]}"
        for scheme in ("postgresql", "postgresql+advisory"):
            url = f"{scheme}://postgres:{wrong}@127.0.0.1:{server.port}/postgres"
            b = open_backend(url)
            with pytest.raises(StoreUnavailable) as caught:
                b.now()
            assert "password authentication failed" in str(caught.value)
            assert wrong not in str(caught.value) and wrong not in repr(b)
            assert secret not in str(caught.value)
            b.close()
        good = open_backend(server.url.replace("postgres@", "postgres@"))
        good.now()
        good.close()
    finally:
        server.stop()


def test_silent_server_times_out_as_unavailable() -> None:
    """A peer that accepts TCP but never answers: connect_timeout, not a hang."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # the kernel completes handshakes; nobody ever speaks
        port = listener.getsockname()[1]
        for scheme in ("postgresql", "postgresql+advisory"):
            b = open_backend(f"{scheme}://postgres@127.0.0.1:{port}/postgres?timeout=2")
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                b.acquire("n", _owner(), INFO, 10)
            assert time.monotonic() - started < 6
            b.close()


def test_closed_port_is_unavailable_at_once() -> None:
    b = open_backend(f"postgresql://postgres@127.0.0.1:{free_port()}/postgres?timeout=2")
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="postgresql store at"):
        b.inspect("n")
    assert time.monotonic() - started < 3
    b.close()


def test_restart_keeps_leases_and_the_stale_connection_is_replaced(
    own_server: RunningServer,
) -> None:
    url = f"{own_server.url}?timeout=2"
    holder, other = open_backend(url), open_backend(url)
    owner = _owner()
    granted = holder.acquire("n", owner, INFO, 60)
    assert isinstance(granted, Grant) and granted.token is not None
    assert isinstance(other.acquire("n", _owner(), INFO, 60), Busy)
    own_server.stop()
    with pytest.raises(StoreUnavailable):
        other.acquire("n", _owner(), INFO, 60)
    own_server.start()
    # The holder's idle connection died with the server: replaced before use, no error.
    assert holder.extend("n", owner, 60) is not None
    assert isinstance(other.acquire("n", _owner(), INFO, 60), Busy)  # no double grant
    assert holder.release("n", owner) is True
    after = other.acquire("n", _owner(), INFO, 60)
    assert isinstance(after, Grant) and after.token is not None
    assert after.token > granted.token  # the sequence survived the restart
    holder.close()
    other.close()


def test_fork_child_gets_its_own_connection(backend: PostgreSQLBackend) -> None:
    owner = _owner()
    assert isinstance(backend.acquire("n", owner, INFO, 60), Grant)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: use the inherited backend, then leave without cleanup
        code = 1
        try:
            info = backend.inspect("n")
            busy = backend.acquire("n", _owner(), INFO, 60)
            code = 0 if info is not None and isinstance(busy, Busy) else 2
        finally:
            os.write(write_fd, bytes([code]))
            os._exit(0)
    os.close(write_fd)
    assert os.read(read_fd, 1) == b"\x00"
    os.close(read_fd)
    os.waitpid(pid, 0)
    assert backend.release("n", owner) is True  # the parent's session is untouched


# -- the advisory store --------------------------------------------------------------------------


def test_advisory_keys_are_64_bit_hashes_seen_in_pg_locks(
    advisory: AdvisoryBackend, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    keys = {advisory_key(f"name{i}") for i in range(2000)}
    assert len(keys) == 2000
    assert any(k < 0 for k in keys) and any(k > 2**32 for k in keys)
    assert all(-(2**63) <= k < 2**63 for k in keys)
    assert advisory_key("n", "a") != advisory_key("n", "b") != advisory_key("n")
    assert advisory_key("a\x00b") != advisory_key("b", "a")  # prefix and name can't blur
    name = "nul\x00inside ✓"
    assert isinstance(advisory.acquire(name, _owner(), INFO, 10), Grant)
    unsigned = advisory.store.key(name) & (2**64 - 1)
    rows = sql.execute(
        "SELECT classid::bigint, objid::bigint, objsubid FROM pg_locks "
        "WHERE locktype = 'advisory' AND granted"
    ).fetchall()
    assert (unsigned >> 32, unsigned & 0xFFFF_FFFF, 1) in rows


def test_advisory_owners_in_one_process_exclude_each_other(advisory: AdvisoryBackend) -> None:
    first, second = _owner(), _owner()
    assert isinstance(advisory.acquire("n", first, INFO, 10), Grant)
    # Advisory locks are re-entrant per session: only the local map keeps `second` out.
    assert isinstance(advisory.acquire("n", second, INFO, 10), Busy)
    assert advisory.release("n", second) is False
    assert advisory.extend("n", second, 10) is None
    assert advisory.extend("n", first, 10) == Grant(None, None)
    assert advisory.release("n", first) is True
    assert advisory.inspect("n") is None


def test_advisory_holder_in_another_process_is_named(
    advisory: AdvisoryBackend, pg_base: str
) -> None:
    other = open_backend(advisory.url.raw)
    try:
        assert isinstance(other.acquire("n", _owner(), INFO, 10), Grant)
        info = advisory.inspect("n")
        assert info is not None and info.token is None and info.expires_at is None
        assert info.owner.pid == os.getpid()  # from the holding session's application_name
        busy = advisory.acquire("n", _owner(), INFO, 10)
        assert isinstance(busy, Busy) and busy.holder is not None
        assert busy.holder.owner.pid == os.getpid()
    finally:
        other.close()
    # Closing the session ended its lock (the server ends a session just after its client).
    eventually(lambda: advisory.inspect("n") is None, what="the lock gone with its session")


def test_advisory_force_release_ends_the_holding_session(advisory: AdvisoryBackend) -> None:
    holder = open_backend(advisory.url.raw)
    try:
        owner = _owner()
        assert isinstance(holder.acquire("n", owner, INFO, 10), Grant)
        assert isinstance(holder.acquire("m", owner, INFO, 10), Grant)
        assert advisory.force_release("n") is True
        # The session is gone, so both of its locks are: reported lost, never re-taken.
        assert holder.extend("n", owner, 10) is None
        assert holder.extend("m", owner, 10) is None
        assert holder.release("m", owner) is False
        assert advisory.inspect("m") is None
        assert isinstance(holder.acquire("n", _owner(), INFO, 10), Grant)  # a new session
    finally:
        holder.close()


def test_advisory_restart_loses_every_lock(own_server: RunningServer) -> None:
    url = own_server.url.replace("postgresql://", "postgresql+advisory://") + "?timeout=2"
    b = open_backend(url)
    owner = _owner()
    assert isinstance(b.acquire("n", owner, INFO, 10), Grant)
    own_server.stop()
    with pytest.raises(StoreUnavailable):
        b.extend("n", owner, 10)  # cannot tell yet: the server is down
    own_server.start()
    assert b.extend("n", owner, 10) is None  # the session died: lost, not re-acquired
    assert b.release("n", owner) is False
    assert b.inspect("n") is None
    assert isinstance(b.acquire("n", _owner(), INFO, 10), Grant)
    b.close()


def test_advisory_fork_child_does_not_inherit_the_locks(advisory: AdvisoryBackend) -> None:
    owner = _owner()
    assert isinstance(advisory.acquire("n", owner, INFO, 10), Grant)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            lost = advisory.extend("n", owner, 10) is None and not advisory.release("n", owner)
            busy = isinstance(advisory.acquire("n", _owner(), INFO, 10), Busy)
            code = 0 if lost and busy else 2
        finally:
            os.write(write_fd, bytes([code]))
            os._exit(0)
    os.close(write_fd)
    assert os.read(read_fd, 1) == b"\x00"
    os.close(read_fd)
    os.waitpid(pid, 0)
    assert advisory.extend("n", owner, 10) == Grant(None, None)
    assert advisory.release("n", owner) is True


def test_advisory_declares_what_it_cannot_do(advisory: AdvisoryBackend) -> None:
    caps = advisory.capabilities
    assert caps.session_tied and not caps.ttl and not caps.fencing and not caps.durable
    assert not caps.listing and not caps.semaphores and not caps.records and caps.push
    assert caps.blocking  # waiters wait in the server (pg_advisory_lock), not on a notice
    with pytest.raises(latchkey.errors.Unsupported):
        list(advisory.list())
    with pytest.raises(latchkey.errors.Unsupported):
        advisory.acquire("n", _owner(), INFO, 10, limit=2)


# -- the advisory store: waiting in the server -------------------------------------------------


def _app_name(pid: int) -> str:
    """The application_name every latchkey session of process ``pid`` sets."""
    return f"latchkey {pid}@{socket.gethostname()}".encode()[:63].decode("utf-8", "ignore")


def _advisory_waiters(sql: psycopg.Connection[tuple[object, ...]], pid: int) -> list[int]:
    """Server pids of process ``pid``'s sessions now waiting for an advisory lock."""
    rows = sql.execute(
        "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND wait_event = 'advisory' AND application_name = %s", (_app_name(pid),)
    ).fetchall()
    return [int(r[0]) for r in rows]  # type: ignore[call-overload]


def _holder_pid(sql: psycopg.Connection[tuple[object, ...]], key: int) -> int | None:
    unsigned = key & (2**64 - 1)
    row = sql.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 "
        "AND classid = %s::bigint::oid AND objid = %s::bigint::oid",
        (unsigned >> 32, unsigned & 0xFFFF_FFFF),
    ).fetchone()
    return None if row is None else int(row[0])  # type: ignore[call-overload]


# The waiter: counts the store calls its acquire makes, reports when it returned.
_CHILD_WAITER = """
import json, sys, time
import latchkey
store = latchkey.connect(sys.argv[1])
calls = {"acquire": 0, "acquire_blocking": 0}
for method in list(calls):
    def counted(*args, _method=method, _original=getattr(store.backend, method), **kwargs):
        calls[_method] += 1
        return _original(*args, **kwargs)
    setattr(store.backend, method, counted)
got = store.lock(sys.argv[2], ttl="60s", wait="60s").acquire()
print(json.dumps({"got": got, "at": time.monotonic(), **calls}), flush=True)
store.close()
"""


def test_advisory_waiter_in_another_process_is_granted_by_the_server(
    advisory: AdvisoryBackend, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    owner = _owner()
    assert isinstance(advisory.acquire("n", owner, INFO, 60), Grant)
    # timeout=30: one server-side wait (90% of it) outlasts anything this test does
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD_WAITER, f"{advisory.url.raw}&timeout=30", "n"],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2],
    )
    try:
        eventually(lambda: _advisory_waiters(sql, child.pid), what="the child waiting")
        released = time.monotonic()
        assert advisory.release("n", owner) is True
        out, _ = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    report = json.loads(out)
    assert report["got"] is True
    # One try, then one wait that the release itself ended: no polling, no retry.
    assert (report["acquire"], report["acquire_blocking"]) == (1, 1)
    assert report["at"] - released < 5  # CLOCK_MONOTONIC: one clock for every process


def test_advisory_wait_times_out_busy_with_the_holder_named(
    advisory: AdvisoryBackend, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    other = open_backend(advisory.url.raw)  # another session (in this process)
    try:
        assert isinstance(other.acquire("n", _owner(), INFO, 60), Grant)
        started = time.monotonic()
        busy = advisory.acquire_blocking("n", _owner(), INFO, 60, 1, 0.3)
        elapsed = time.monotonic() - started
        assert isinstance(busy, Busy) and busy.holders == 1
        assert busy.holder is not None and busy.holder.owner.pid == os.getpid()
        assert 0.3 <= elapsed < 2
        assert _advisory_waiters(sql, os.getpid()) == []  # the wait ended in the server
        assert len(advisory.io.idle) == 1  # its session went back to the pool, holding nothing
        # Through the core: the same answer, within the wait.
        waiter = latchkey.connect(advisory.url.raw)
        try:
            lock = waiter.lock("n", ttl="60s", wait="300ms")
            started = time.monotonic()
            assert lock.acquire() is False
            assert time.monotonic() - started < 2
            assert lock.holder is not None and lock.holder.owner.pid == os.getpid()
        finally:
            waiter.close()
    finally:
        other.close()


def test_advisory_killed_waiting_session_is_not_reused(
    advisory: AdvisoryBackend, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    other = open_backend(advisory.url.raw)
    try:
        held = _owner()
        assert isinstance(other.acquire("n", held, INFO, 60), Grant)
        errors: list[BaseException] = []

        def wait() -> None:
            try:
                advisory.acquire_blocking("n", _owner(), INFO, 60, 1, 30)
            except BaseException as exc:  # collected and asserted below
                errors.append(exc)

        t = threading.Thread(target=wait)
        t.start()
        (killed,) = eventually(lambda: _advisory_waiters(sql, os.getpid()), what="waiting")
        sql.execute("SELECT pg_terminate_backend(%s)", (killed,))
        t.join(30)
        assert len(errors) == 1 and isinstance(errors[0], StoreUnavailable)
        assert advisory.io.spares == set() and advisory.io.idle == []  # closed, not pooled
        assert other.release("n", held) is True
        granted = advisory.acquire_blocking("n", _owner(), INFO, 60, 1, 5)
        assert isinstance(granted, Grant)
        assert _holder_pid(sql, advisory.store.key("n")) not in (None, killed)
    finally:
        other.close()


def test_advisory_interrupted_wait_closes_its_session(
    advisory: AdvisoryBackend, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    """Ctrl-C while waiting in the server: the session may have been granted the lock just
    before the cancel; it is closed, so nobody holds the lock through it."""
    other = open_backend(advisory.url.raw)
    try:
        held = _owner()
        assert isinstance(other.acquire("n", held, INFO, 60), Grant)
        waiting: list[int] = []

        def interrupt() -> None:
            waiting.extend(eventually(lambda: _advisory_waiters(sql, os.getpid())))
            _thread.interrupt_main()

        t = threading.Thread(target=interrupt)
        t.start()
        with pytest.raises(KeyboardInterrupt):
            advisory.acquire_blocking("n", _owner(), INFO, 60, 1, 30)
        t.join(10)
        assert advisory.io.spares == set() and advisory.io.idle == []

        def gone() -> bool:
            row = sql.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                              (waiting[0],)).fetchone()
            return row == (0,)

        eventually(gone, what="the interrupted session closed")
        assert other.release("n", held) is True
        assert advisory.inspect("n") is None
    finally:
        other.close()


def test_advisory_a_dying_session_loses_only_its_own_locks(
    advisory: AdvisoryBackend, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    a, b, c = _owner(), _owner(), _owner()
    assert isinstance(advisory.acquire("a", a, INFO, 60), Grant)  # the main session
    # A free name is granted at once, on a spare session each (a holding spare never waits).
    assert isinstance(advisory.acquire_blocking("b", b, INFO, 60, 1, 5), Grant)
    assert isinstance(advisory.acquire_blocking("c", c, INFO, 60, 1, 5), Grant)
    pids = {n: _holder_pid(sql, advisory.store.key(n)) for n in "abc"}
    assert len(set(pids.values())) == 3 and None not in pids.values()
    sql.execute("SELECT pg_terminate_backend(%s)", (pids["b"],))
    eventually(lambda: _holder_pid(sql, advisory.store.key("b")) is None, what="b's session ended")
    assert advisory.extend("b", b, 60) is None  # LockLost for b only
    assert advisory.release("b", b) is False
    assert advisory.extend("a", a, 60) == Grant(None, None)
    assert advisory.extend("c", c, 60) == Grant(None, None)
    # The main session dies: "a" goes with it, "c" stays; try-acquires reconnect.
    sql.execute("SELECT pg_terminate_backend(%s)", (pids["a"],))
    eventually(lambda: _holder_pid(sql, advisory.store.key("a")) is None, what="a's session ended")
    assert advisory.extend("a", a, 60) is None
    assert advisory.extend("c", c, 60) == Grant(None, None)
    assert isinstance(advisory.acquire("c", _owner(), INFO, 60), Busy)
    info = advisory.inspect("c")
    assert info is not None and info.owner.pid == 1  # INFO: named from our own map
    assert advisory.release("c", c) is True
    assert advisory.inspect("c") is None


def test_advisory_threads_of_one_backend_queue_in_the_server(
    advisory: AdvisoryBackend, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    store = latchkey.connect(advisory.url.raw)
    try:
        first = store.lock("n", ttl="60s")
        assert first.acquire()
        got: list[bool] = []
        second = store.lock("n", ttl="60s", wait="30s")
        t = threading.Thread(target=lambda: got.append(second.acquire()))
        t.start()
        eventually(lambda: _advisory_waiters(sql, os.getpid()), what="the second lock waiting")
        assert got == []  # another session of this backend: the server makes it wait
        assert first.release() is True
        t.join(30)
        assert got == [True]
        assert first.acquire(wait=0) is False
        assert second.release() is True

        # Many threads, one name: one inside at a time, every hand-off through the server.
        inside, entries, errors = [0], [0], []

        def churn() -> None:
            try:
                for _ in range(30):
                    with store.lock("m", ttl="60s", wait="60s"):
                        inside[0] += 1
                        if inside[0] != 1:
                            errors.append(AssertionError("two holders at once"))
                        time.sleep(0)
                        inside[0] -= 1
                        entries[0] += 1
            except BaseException as exc:  # collected and asserted below
                errors.append(exc)

        threads = [threading.Thread(target=churn) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert errors == [] and entries[0] == 120
        backend = store.backend
        assert isinstance(backend, AdvisoryBackend)
        assert backend.store.held == {} and len(backend.io.idle) <= 2  # extra spares were closed
        assert backend.io.spares == set(backend.io.idle)
    finally:
        store.close()


def test_advisory_close_ends_every_session(
    advisory: AdvisoryBackend, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    assert isinstance(advisory.acquire("a", _owner(), INFO, 60), Grant)
    assert isinstance(advisory.acquire_blocking("b", _owner(), INFO, 60, 1, 5), Grant)
    assert isinstance(advisory.acquire_blocking("c", _owner(), INFO, 60, 1, 0.2), Grant)
    pids = [_holder_pid(sql, advisory.store.key(n)) for n in "abc"]
    advisory.close()

    def closed() -> bool:
        row = sql.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)",
                          (pids,)).fetchone()
        return row == (0,)

    eventually(closed, what="every session closed")


def test_advisory_fork_child_does_not_inherit_spare_sessions(advisory: AdvisoryBackend) -> None:
    owner = _owner()
    assert isinstance(advisory.acquire_blocking("b", owner, INFO, 60, 1, 5), Grant)
    assert isinstance(advisory.acquire_blocking("idle", _owner(), INFO, 60, 1, 5), Grant)
    assert advisory.release("idle", advisory.store.held[advisory.store.key("idle")].owner)
    assert len(advisory.io.idle) == 1
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            lost = advisory.extend("b", owner, 10) is None and not advisory.release("b", owner)
            busy = isinstance(advisory.acquire_blocking("b", _owner(), INFO, 10, 1, 0.1), Busy)
            code = 0 if lost and busy else 2
        finally:
            os.write(write_fd, bytes([code]))
            os._exit(0)
    os.close(write_fd)
    assert os.read(read_fd, 1) == b"\x00"
    os.close(read_fd)
    os.waitpid(pid, 0)
    assert advisory.extend("b", owner, 10) == Grant(None, None)
    assert advisory.release("b", owner) is True
    assert isinstance(advisory.acquire_blocking("x", _owner(), INFO, 10, 1, 5), Grant)  # pooled


# -- the asyncio backends ----------------------------------------------------------------------


def _url(pg_base: str, kind: str, **query: str) -> str:
    isolate = (f"table=t_{uuid.uuid4().hex[:12]}" if kind == "postgresql"
               else f"prefix=t{uuid.uuid4().hex[:12]}")  # fmt: skip
    extra = "".join(f"&{k}={v}" for k, v in query.items())
    return f"{pg_base.replace('postgresql://', kind + '://')}?{isolate}{extra}"


def _waiting_now(sql: psycopg.Connection[tuple[object, ...]], url: str, kind: str) -> int:
    """How many waiters of ``url`` wait now: queue rows (lease table) or sessions waiting in
    the server for an advisory lock (this process's)."""
    if kind == "postgresql":
        table = url.rsplit("table=", 1)[1].split("&")[0]
        with contextlib.suppress(psycopg.errors.UndefinedTable):
            row = sql.execute(f'SELECT count(*) FROM "{table}_waiters"').fetchone()
            return int(row[0]) if row else 0  # type: ignore[call-overload]
        return 0
    return len(_advisory_waiters(sql, os.getpid()))


def _count_calls(backend: Any, method: str) -> list[int]:
    """Count ``backend.<method>`` calls (the async runner looks methods up on the instance)."""
    calls = [0]
    original = getattr(backend, method)

    async def counted(*args: Any) -> Any:
        calls[0] += 1
        return await original(*args)

    setattr(backend, method, counted)
    return calls


def _count_handed(backend: Any) -> list[int]:
    """Count the leases a release handed to this backend's waiters (taken by the core)."""
    handed = [0]
    original = backend.wait_in_line

    async def wait_in_line(*args: Any) -> Any:
        waiter = await original(*args)
        take = waiter.take_grant

        async def take_grant() -> Any:
            grant = await take()
            handed[0] += grant is not None
            return grant

        waiter.take_grant = take_grant
        return waiter

    backend.wait_in_line = wait_in_line
    return handed


@pytest.mark.parametrize("kind", ["postgresql", "postgresql+advisory"])
def test_async_cancelled_waiting_acquire_leaves_nothing_held(
    pg_base: str, kind: str, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    url = _url(pg_base, kind)

    async def main() -> None:
        async with latchkey.connect_async(url) as holding, latchkey.connect_async(url) as store:
            holder = holding.lock("n", ttl="60s")
            assert await holder.acquire()
            waiting = asyncio.ensure_future(store.lock("n", ttl="60s", wait="30s").acquire())
            while not await asyncio.to_thread(_waiting_now, sql, url, kind):
                assert not waiting.done()
                await asyncio.sleep(0.01)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert await asyncio.to_thread(_waiting_now, sql, url, kind) == 0  # left the queue
            assert await holder.release()
            assert await store.inspect("n") is None  # nobody was handed it, nothing held
            again = store.lock("n", ttl="60s", wait=0)  # and the backend still works
            assert await again.acquire()
            assert await again.release()

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["postgresql", "postgresql+advisory"])
def test_async_blocked_waiter_is_woken_by_push_not_by_polling(
    pg_base: str, kind: str, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    """The lease table hands the lease over (no attempt after the release); the advisory
    store's waiter is granted inside its one server-side wait."""
    url = _url(pg_base, kind, timeout="30s")

    async def main() -> None:
        async with latchkey.connect_async(url) as holding, latchkey.connect_async(url) as store:
            attempts = _count_calls(store.backend, "acquire")
            blocks = _count_calls(store.backend, "acquire_blocking")
            holder = holding.lock("n", ttl="60s")
            assert await holder.acquire()
            handed = _count_handed(store.backend)
            waiting = asyncio.ensure_future(store.lock("n", ttl="60s", wait="25s").acquire())
            while not await asyncio.to_thread(_waiting_now, sql, url, kind):
                await asyncio.sleep(0.01)
            if kind == "postgresql":
                # Let the backoff reach its cap (retries ~1 s apart), so that no retry races
                # the release below: the lease must come by the hand-over, not an attempt.
                while attempts[0] < 9:
                    await asyncio.sleep(0.05)
            before = attempts[0]
            assert await holder.release()
            assert await waiting is True
            if kind == "postgresql":
                assert attempts[0] == before and handed == [1]
            else:
                assert attempts[0] == before == 1 and blocks[0] == 1

    asyncio.run(main())


def test_async_many_waiters_share_one_listener_and_all_get_the_lock(pg_base: str) -> None:
    url = _url(pg_base, "postgresql", timeout="30s")
    count = 300

    async def main() -> None:
        async with latchkey.connect_async(url) as store:
            holder = store.lock("n", ttl="60s")
            assert await holder.acquire()
            order: list[int] = []

            async def take(i: int) -> None:
                lock = store.lock("n", ttl="60s", wait="60s")
                assert await lock.acquire()
                order.append(i)
                assert await lock.release()

            tasks = [asyncio.ensure_future(take(i)) for i in range(count)]
            await asyncio.sleep(0.2)
            assert await holder.release()
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            assert sorted(order) == list(range(count))
            listener = store.backend.io.listener  # type: ignore[attr-defined]
            assert listener.connections == 1

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["postgresql", "postgresql+advisory"])
def test_async_silent_server_is_unavailable_within_the_timeout(kind: str) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # the kernel completes handshakes; nobody ever speaks
        port = listener.getsockname()[1]

        async def main() -> None:
            async with latchkey.connect_async(
                f"{kind}://postgres@127.0.0.1:{port}/postgres?timeout=2"
            ) as store:
                started = time.monotonic()
                with pytest.raises(StoreUnavailable):
                    await store.lock("n", ttl="10s", wait=0).acquire()
                assert time.monotonic() - started < 6

        asyncio.run(main())


@pytest.mark.parametrize("kind", ["postgresql", "postgresql+advisory"])
def test_async_stopped_server_is_unavailable_then_the_connection_is_replaced(
    own_server: RunningServer, kind: str
) -> None:
    url = f"{own_server.url.replace('postgresql://', kind + '://')}?timeout=2"

    async def main() -> None:
        async with latchkey.connect_async(url) as store:
            assert await store.now()
            own_server.stop()
            started = time.monotonic()
            with pytest.raises(StoreUnavailable) as caught:
                await store.lock("n", ttl="10s", wait=0).acquire()
            assert time.monotonic() - started < 2 + 4
            assert "password" not in str(caught.value)
            await asyncio.to_thread(own_server.start)
            lock = store.lock("n", ttl="10s", wait=0)
            assert await lock.acquire()  # a new connection, no error
            assert await lock.release()

    asyncio.run(main())


def test_async_statements_through_libpq_keep_the_values_and_survive_deallocate_all(
    pg_base: str, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    """The asyncio backends' acquire/release go through libpq with the loop watching the
    socket (AsyncSession.run_prepared): the same values as the row, prepared once per
    connection, prepared again after psycopg's DEALLOCATE ALL."""
    url = _url(pg_base, "postgresql")
    table = url.rsplit("table=", 1)[1]

    async def main() -> None:
        async with latchkey.connect_async(url) as store, latchkey.connect_async(
            url.replace("postgresql://", "postgresql+advisory://").replace("table=", "prefix=")
        ) as advisory:
            backend: Any = store.backend
            owner = _owner()
            grant = await backend.acquire("n\x00é'", owner, INFO, 12.5)
            assert isinstance(grant, Grant)
            row = await asyncio.to_thread(lambda: sql.execute(
                f'SELECT token, expires_at FROM "{table}" WHERE name = %s',
                ("n\x00é'".encode(),)).fetchone())  # fmt: skip
            assert row is not None and (grant.token, grant.expires_at) == row
            assert await backend.release("n\x00é'", owner) is True
            assert await backend.release("n\x00é'", owner) is False
            for b in (backend, advisory.backend):
                assert isinstance(await b.acquire("m", owner, INFO, 30), Grant)
                assert await b.release("m", owner) is True
                assert _session(b).prepared  # what run_prepared made
                session = _session(b)
                if b is advisory.backend:  # psycopg's own wait is about to register the
                    b.io.forget(session)  # socket: the loop's watch lets go (io/pgwatch.py)
                await session.conn.execute("DEALLOCATE ALL")  # as psycopg does after a ROLLBACK
                assert isinstance(await b.acquire("m", owner, INFO, 30), Grant)
                assert await b.release("m", owner) is True

    asyncio.run(main())


@pytest.mark.parametrize("where", ["extend", "release"])
def test_async_a_statement_cancelled_in_flight_discards_its_connection(
    pg_base: str, sql: psycopg.Connection[tuple[object, ...]], where: str
) -> None:
    """A coroutine cancelled while its statement runs in the server (here: blocked on a lock
    another connection holds) leaves no half-read connection behind: it is closed, and the
    next call opens a new one and works. (An acquire runs to its end instead: below.)"""
    url = _url(pg_base, "postgresql")
    table = url.rsplit("table=", 1)[1]

    async def main() -> None:
        async with latchkey.connect_async(url) as store:
            backend: Any = store.backend
            owner = _owner()
            await backend.init()
            assert isinstance(await backend.acquire("n", owner, INFO, 60), Grant)
            blocker = await psycopg.AsyncConnection.connect(pg_base)
            try:
                await blocker.execute(f'LOCK TABLE "{table}" IN ACCESS EXCLUSIVE MODE')
                session = _session(backend)
                conn_before = session.conn
                call = (backend.extend("n", owner, 60) if where == "extend"
                        else backend.release("n", owner))  # fmt: skip
                task = asyncio.ensure_future(call)
                while not await asyncio.to_thread(lambda: sql.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                ).fetchone()[0]):  # type: ignore[index]
                    assert not task.done()
                    await asyncio.sleep(0.01)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert session.conn is None and conn_before.closed  # closed, not pooled
                assert all(link is not session for link, _ in backend.io.pool._idle)
            finally:
                await blocker.rollback()
                await blocker.close()
            assert await backend.release("n", owner) is True  # the cancelled call never ran
            assert isinstance(await backend.acquire("n", owner, INFO, 60), Grant)
            assert await backend.release("n", owner) is True

    asyncio.run(main())


def test_async_an_acquire_cancelled_in_flight_runs_to_its_end(
    pg_base: str, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    """An acquire cancelled while its statement waits in the server (here for the row lock
    of an expired lease another connection holds) is not dropped: it runs to its end, then
    the core's release after the cancellation ends what it granted. Dropped (its connection
    closed), the statement would still run in the server, which does not notice a client
    gone while it waits — after that release, which waits for nothing (the row it sees is
    not the owner's) — and grant a lease to nobody for its TTL."""
    url = _url(pg_base, "postgresql")
    table = url.rsplit("table=", 1)[1]

    def lock_waits() -> int:  # statements on this test's table waiting for a lock
        waiting = """SELECT count(*) FROM pg_stat_activity
            WHERE wait_event_type = 'Lock' AND position(%s in query) > 0"""
        return int(sql.execute(waiting, (table,)).fetchone()[0])  # type: ignore[index]

    async def main() -> None:
        async with latchkey.connect_async(url) as store:
            backend: Any = store.backend
            await backend.init()
            assert isinstance(await backend.acquire("n", _owner(), INFO, 60), Grant)
            sql.execute(f'UPDATE "{table}" SET expires_at = now() - interval \'1 s\'')
            blocker = await psycopg.AsyncConnection.connect(pg_base)
            try:  # the expired lease's row locked: a taker waits for it, a release does not
                await blocker.execute(f'SELECT 1 FROM "{table}" FOR UPDATE')
                task = asyncio.ensure_future(store.lock("n", ttl="60s", wait=0).acquire())
                while not await asyncio.to_thread(lock_waits):
                    assert not task.done()
                    await asyncio.sleep(0.01)
                task.cancel()
                # Dropped, it would end at once; run to its end, it waits for the row. Then:
                await asyncio.wait({task}, timeout=1.0)
            finally:
                await blocker.rollback()
                await blocker.close()
            with pytest.raises(asyncio.CancelledError):
                await task
            while await asyncio.to_thread(lock_waits):
                await asyncio.sleep(0.01)  # (dropped: the statement is still running)
            assert await store.inspect("n") is None, "a cancelled acquire left a lease"

    asyncio.run(main())


def test_async_advisory_waits_in_the_server_are_capped_and_the_rest_wait_their_turn(
    pg_base: str, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    """More waiters than MAX_WAITS: only MAX_WAITS spare sessions wait in the server (the
    server's connections are few); every waiter still gets the lock in turn."""
    from latchkey.stores.pg_advisory import MAX_WAITS

    url = _url(pg_base, "postgresql+advisory", timeout="30s")
    count = MAX_WAITS + 20

    async def main() -> None:
        async with latchkey.connect_async(url) as holding, latchkey.connect_async(url) as store:
            holder = holding.lock("n")
            assert await holder.acquire()
            taken: list[int] = []

            async def waiter(i: int) -> None:
                async with store.lock("n", wait="60s"):
                    taken.append(i)

            def waiting() -> int:
                return _waiting_now(sql, url, "postgresql+advisory")

            tasks = [asyncio.ensure_future(waiter(i)) for i in range(count)]
            while await asyncio.to_thread(waiting) < MAX_WAITS:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # had the cap not held, more would be waiting by now
            assert await asyncio.to_thread(waiting) == MAX_WAITS
            assert not taken
            assert await holder.release()
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            assert sorted(taken) == list(range(count))

    asyncio.run(main())


# -- asyncio advisory sessions: the loop watches a session's socket between statements
# (io/pgwatch.py), and the waiting task is woken by the watch itself.


def _counted_loop() -> tuple[asyncio.AbstractEventLoop, list[int]]:
    """A loop whose turns are counted (each turn selects once), and the count."""
    turns = [0]

    class Counting(selectors.DefaultSelector):
        def select(self, timeout: float | None = None) -> Any:
            turns[0] += 1
            return super().select(timeout)

    return asyncio.SelectorEventLoop(Counting()), turns


def test_async_advisory_statement_takes_one_turn_of_the_loop(pg_base: str) -> None:
    """An uncontended acquire + release is two statements on the main session, and two turns
    of the loop: the reply wakes the waiting task in the turn its socket is reported readable
    (a future per wait, set by a reader callback, took a second turn per statement)."""
    url = _url(pg_base, "postgresql+advisory")
    loop, turns = _counted_loop()

    async def main() -> int:
        async with latchkey.connect_async(url) as store:
            for _ in range(3):  # connected, statements prepared
                lock = store.lock("n", ttl="60s", wait=0)
                assert await lock.acquire() and await lock.release()
            before = turns[0]
            for _ in range(50):
                lock = store.lock("n", ttl="60s", wait=0)
                assert await lock.acquire()
                assert await lock.release()
            return turns[0] - before

    try:
        counted = loop.run_until_complete(main())
    finally:
        loop.close()
    assert counted <= 2 * 50 + 2, f"{counted} turns of the loop for 50 pairs"


def test_async_advisory_cancelled_acquire_keeps_the_other_locks(
    pg_base: str, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    """A caller cancelled at any point of a quick acquire on the shared main session — before
    its statement, while the task waits on the session's watch for the reply, after it: the
    session (and the other locks in it) survives, and the cancelled owner holds nothing; one
    done before the cancel came holds the lock, as any acquire that returned True.

    The cancel comes after 0, 1, 2, … turns of the loop (then further apart), until the
    acquire is done before it comes: every stage is tried, however many turns the reply
    takes on this machine."""
    url = _url(pg_base, "postgresql+advisory")

    async def scenario(yields: int) -> bool:
        """Whether the cancel cut the acquire (False: the acquire was done first)."""
        name = f"async-cut-{yields}"
        store = latchkey.connect_async(url)
        backend: Any = store.backend
        kept = store.lock(f"async-cut-kept-{yields}", ttl="60s", wait=0)
        assert await kept.acquire() is True
        main_pid = backend.io.main.id
        lock = store.lock(name, ttl="60s", wait=0)
        task = asyncio.ensure_future(lock.acquire())
        for _ in range(yields):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await store.inspect(name)  # after whatever the cancelled acquire left running
        assert backend.io.main is not None and backend.io.main.id == main_pid
        assert _holder_pid(sql, backend.store.key(kept.name)) == main_pid
        cut = task.cancelled()
        if cut:
            assert _holder_pid(sql, backend.store.key(name)) is None
        else:  # done before the cancel came: held, as any acquire that returned True
            assert task.result() is True
            assert _holder_pid(sql, backend.store.key(name)) == main_pid
            assert await lock.release() is True
        assert await kept.release() is True
        await store.aclose()
        return cut

    cuts = []
    steps = [*range(30), *(int(30 * 1.25**i) for i in range(1, 30))]
    for yields in steps:
        cuts.append(asyncio.run(scenario(yields)))
        if not cuts[-1]:
            break
    assert not cuts[-1], "the acquire never finished before the cancel"
    assert sum(cuts) >= 2  # cut before it began, and at least once on its way


def test_async_advisory_cancelled_statement_cut_by_its_deadline_is_a_cancellation(
    own_server: RunningServer,
) -> None:
    """The caller cancels while a quick statement waits for a frozen server's reply: the
    statement is held to its end — here its deadline (timeout + 1 s), which ends the
    session — and then the caller's CancelledError comes out, not StoreUnavailable (that
    dropped the cancellation). After the thaw the store works on a new session."""
    url = f"{own_server.url.replace('postgresql://', 'postgresql+advisory://')}?timeout=1"

    async def main() -> float:
        async with latchkey.connect_async(url) as store:
            backend: Any = store.backend
            assert await store.lock("warm", ttl="60s", wait=0).acquire()
            first = backend.io.main.id
            with own_server.frozen():
                task = asyncio.ensure_future(store.lock("n", ttl="60s", wait=0).acquire())
                await asyncio.sleep(0.1)
                assert not task.done()
                started = time.monotonic()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                took = time.monotonic() - started
            lock = store.lock("n", ttl="60s", wait="20s")  # (the ended session may hold it
            assert await lock.acquire()  # until its server process has gone)
            assert backend.io.main.id != first
            assert await lock.release()
            return took

    took = asyncio.run(main())
    assert took < 1 + 1 + 2, f"{took:.1f}s"


def test_async_advisory_idle_session_ended_by_the_server_is_let_go_and_replaced(
    pg_base: str, sql: psycopg.Connection[tuple[object, ...]]
) -> None:
    """The server ends the main session while it sits idle, its socket watched by the loop:
    the watch lets go of it (the goodbye is left for the idle check; watched, the loop would
    report it at every turn), and the next acquire runs on a new session."""
    url = _url(pg_base, "postgresql+advisory")

    async def main() -> None:
        async with latchkey.connect_async(url) as store:
            backend: Any = store.backend
            lock = store.lock("n", ttl="60s", wait=0)
            assert await lock.acquire() and await lock.release()
            first = backend.io.main
            watch = first.watch
            assert watch.watching is asyncio.get_running_loop()
            sql.execute("SELECT pg_terminate_backend(%s)", (first.id,))
            deadline = time.monotonic() + 10
            while watch.watching is not None:
                assert time.monotonic() < deadline, "still watching an ended connection"
                await asyncio.sleep(0.01)
            assert await lock.acquire()
            assert backend.io.main is not first and backend.io.main.id != first.id
            assert await lock.release()

    asyncio.run(main())


def test_async_advisory_store_moves_to_the_running_loop(pg_base: str) -> None:
    """One asyncio store used from one loop, then another (asyncio.run twice; two loops, one
    still open): its session's socket is watched by the loop that runs the statement."""
    url = _url(pg_base, "postgresql+advisory")
    store = latchkey.connect_async(url)

    async def pair(tag: str) -> str:
        lock = store.lock("n", ttl="60s", wait=0)
        assert await lock.acquire() and await lock.release()
        return tag

    assert asyncio.run(pair("first")) == "first"
    assert asyncio.run(pair("second")) == "second"
    loop, other = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(pair("third")) == "third"
        assert other.run_until_complete(pair("fourth")) == "fourth"
        assert loop.run_until_complete(pair("fifth")) == "fifth"
        loop.run_until_complete(store.aclose())
    finally:
        loop.close()
        other.close()


@pytest.mark.parametrize("kind", ["postgresql", "postgresql+advisory"])
def test_libpq_parameters_in_the_url_reach_the_server(pg_base: str, table: str, kind: str) -> None:
    """A DSN's own libpq parameters pass through (issue 15): the server sees the application
    name, and ``options`` adds to latchkey's own settings instead of replacing them."""
    app = f"lk-{uuid.uuid4().hex[:8]}"
    base = pg_base.replace("postgresql://", f"{kind}://", 1)
    url = f"{base}?application_name={app}&connect_timeout=3&options=-c%20work_mem%3D5MB"
    if kind == "postgresql":
        url += f"&table={table}"
    with latchkey.connect(url) as store, store.lock(f"n-{app}", ttl="30s"):
        with psycopg.connect(pg_base, autocommit=True) as sql:
            row = sql.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app,)
            ).fetchone()
        assert row is not None and row[0] >= 1
