"""Row claiming in the application's own table (seed 002, issue 13): ``store.rows(...)`` with
``take`` (one transaction, FOR UPDATE SKIP LOCKED) and ``lease`` (a fenced lease per row), on
the SQL stores, in the sync and the asyncio API; ``Unsupported`` everywhere else."""

from __future__ import annotations

import asyncio
import inspect
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

import latchkey
import latchkey._core.rows as rows_core
from latchkey import InvalidName, InvalidValue, StoreUnavailable, Unsupported
from latchkey._core.waiting import Backoff
from tests.appdb import AppDB
from tests.helpers import eventually
from tests.servers import with_query


@pytest.fixture
def db(store: latchkey.Store, store_url: str) -> Iterator[AppDB]:
    if not store.capabilities.rows:
        pytest.skip(f"{store.scheme} store claims no rows")
    app = AppDB(store_url)
    try:
        yield app
    finally:
        app.close()

#: Why the tests of the lease's locking read skip MySQL/MariaDB.
MYSQL_READS = (
    "MySQL/MariaDB leases read and claim in autocommit (slower there with locking reads: "
    "rows_sql.rows_lease), so a concurrent lessee may collide and a locked row is not skipped"
)


def processed(db: AppDB, table: str) -> list[int]:
    return [
        row[0]
        for row in db.execute(f"SELECT id FROM {table} WHERE processed_at IS NOT NULL ORDER BY id")
    ]


def mark(batch: latchkey.TakeBatch, db: AppDB, table: str, row: dict[str, object]) -> None:
    batch.execute(db.sql(f"UPDATE {table} SET processed_at = 1 WHERE id = %s"), (row["id"],))


# -- every store ------------------------------------------------------------------------------


def test_other_stores_raise_unsupported_naming_themselves(store: latchkey.Store) -> None:
    if store.capabilities.rows:
        assert store.scheme in ("sqlite", "postgresql", "mysql")
        return
    with pytest.raises(Unsupported, match=re.escape(f"the {store.scheme} store")):
        store.rows("events", key="id")


def test_bad_identifiers_are_rejected_before_any_io() -> None:
    # Port 1: nothing listens there; InvalidName must come before any attempt to connect.
    for url in ("postgresql://nobody@127.0.0.1:1/db", "mysql://nobody@127.0.0.1:1/db"):
        store = latchkey.connect(url)
        for bad in ("events; DROP TABLE events", 'ev"ents', "ev ents", "1events", "", "a.b.c",
                    "events--", "ev`ents", None):  # fmt: skip
            with pytest.raises(InvalidName, match="table") as caught:
                store.rows(bad)  # type: ignore[arg-type]
            assert repr(bad) in str(caught.value)
        with pytest.raises(InvalidName, match="key"):
            store.rows("events", key="id) OR (1=1")
        with pytest.raises(InvalidName, match="column"):
            store.rows("events", columns=["id", "body FROM x; --"])
        with pytest.raises(InvalidName):
            store.rows("events", columns="body")  # type: ignore[arg-type]
        rows = store.rows("events", where="processed_at IS NULL")
        for limit in (0, -1, True, 1.5, "3"):
            with pytest.raises(InvalidValue, match="limit"):
                rows.take(limit=limit)  # type: ignore[arg-type]
            with pytest.raises(InvalidValue, match="limit"):
                rows.lease(limit=limit, ttl=5)  # type: ignore[arg-type]
        for ttl in (0, -1, "soon"):
            with pytest.raises(InvalidValue, match="ttl"):
                rows.lease(ttl=ttl)
        with pytest.raises(InvalidValue, match="wait"):
            rows.take(wait=-1)
        with pytest.raises(InvalidValue, match="where"):
            store.rows("events", where="  ")
        store.close()


def test_an_unreachable_server_is_store_unavailable_not_an_empty_batch() -> None:
    for url in (
        "postgresql://nobody@127.0.0.1:1/db?timeout=1",
        "mysql://nobody@127.0.0.1:1/db?timeout=1",
    ):
        store = latchkey.connect(url)
        with pytest.raises(StoreUnavailable), store.rows("events").take(limit=5):
            pytest.fail("the batch must not open")
        with pytest.raises(StoreUnavailable), store.rows("events").lease(limit=5, ttl=5):
            pytest.fail("the batch must not open")
        store.close()


# -- take ---------------------------------------------------------------------------------------


def test_take_hands_out_due_rows_as_dicts_and_commits_on_exit(
    store: latchkey.Store, db: AppDB
) -> None:
    table = db.create_events(5)
    queue = store.rows(table, key="id", where="processed_at IS NULL", order_by="id")
    with queue.take(limit=3) as batch:
        assert batch and len(batch) == 3
        assert [row["id"] for row in batch] == [1, 2, 3]
        assert set(batch.rows[0]) == {"id", "body", "processed_at", "worker"}
        assert batch.rows[0]["body"] == "event 1" and batch.rows[0]["processed_at"] is None
        for row in batch:
            mark(batch, db, table, row)
        assert batch.execute(
            db.sql(f"SELECT count(*) FROM {table} WHERE processed_at = %s"), (1,)
        ) == [(3,)]
    assert processed(db, table) == [1, 2, 3]
    with queue.take(limit=10) as batch:
        assert [row["id"] for row in batch] == [4, 5]


def test_an_exception_rolls_back_and_the_rows_are_due_again_at_once(
    store: latchkey.Store, db: AppDB
) -> None:
    table = db.create_events(3)
    queue = store.rows(table, where="processed_at IS NULL", order_by="id")

    class Boom(Exception):
        pass

    with pytest.raises(Boom), queue.take(limit=2) as batch:
        for row in batch:
            mark(batch, db, table, row)
        raise Boom
    assert processed(db, table) == []
    with queue.take(limit=2, wait=0) as batch:
        assert [row["id"] for row in batch] == [1, 2]


def test_where_order_by_and_columns(store: latchkey.Store, db: AppDB) -> None:
    table = db.create_events(10)
    # A '%' in where needs no escaping: the statement is sent without parameters.
    # where may name the table itself (the statements use no alias for it).
    queue = store.rows(table, key="id", where=f"{table}.processed_at IS NULL AND id % 2 = 0",
                       order_by="id DESC", columns=["body"])  # fmt: skip
    with queue.take(limit=3) as batch:
        assert batch.rows == [{"id": 10, "body": "event 10"}, {"id": 8, "body": "event 8"},
                              {"id": 6, "body": "event 6"}]  # fmt: skip
    with queue.lease(limit=2, ttl=30) as leased:
        assert leased.rows == [{"id": 10, "body": "event 10"}, {"id": 8, "body": "event 8"}]


def test_an_empty_batch_is_falsy_and_the_body_still_runs(store: latchkey.Store, db: AppDB) -> None:
    table = db.create_events(2)
    queue = store.rows(table, where="processed_at IS NOT NULL")
    ran = []
    started = time.monotonic()
    with queue.take(limit=5, wait=0) as batch:
        ran.append(True)
        assert not batch and len(batch) == 0 and list(batch) == []
        with pytest.raises(InvalidValue, match="empty"):
            batch.execute(f"SELECT 1 FROM {table}")
    with queue.lease(limit=5, ttl=10, wait=0) as leased:
        ran.append(True)
        assert not leased and len(leased) == 0
    assert ran == [True, True] and time.monotonic() - started < 3


def test_wait_returns_a_row_inserted_later(store: latchkey.Store, db: AppDB) -> None:
    table = db.create_events(0)
    queue = store.rows(table, where="processed_at IS NULL")
    later = AppDB(db.url)
    timer = threading.Timer(0.3, lambda: later.insert(table, [7]))
    timer.start()
    try:
        started = time.monotonic()
        with queue.take(limit=5, wait="20s") as batch:
            assert [row["id"] for row in batch] == [7]
            assert time.monotonic() - started < 15
            mark(batch, db, table, batch.rows[0])
        started = time.monotonic()
        with queue.take(limit=5, wait=0.3) as batch:  # nothing more: empty after the wait
            assert not batch
        assert time.monotonic() - started >= 0.25
    finally:
        timer.join()
        later.close()


def _count_asks(store: latchkey.Store, method: str) -> list[int]:
    """Count the backend's ``method`` calls once each has answered (the real call still
    happens): in the asyncio mode the facade's target is the AsyncBackend, whose primitive is
    a coroutine."""
    backend = store.backend
    target = getattr(backend, "_target", backend)
    real = getattr(target, method)
    asks: list[int] = []
    if inspect.iscoroutinefunction(real):

        async def counted_async(*args: Any) -> Any:
            answer = await real(*args)
            asks.append(1)
            return answer

        setattr(target, method, counted_async)
    else:

        def counted(*args: Any) -> Any:
            answer = real(*args)
            asks.append(1)
            return answer

        setattr(target, method, counted)
    return asks


def _mariadb(store: latchkey.Store) -> bool:
    """Whether a mysql:// store is on MariaDB (learned at its first connection)."""
    store.inspect("connect")
    backend = store.backend
    return bool(getattr(getattr(backend, "_target", backend).store, "prepared", False))


NOTIFY = """
import sys, latchkey
with latchkey.connect(sys.argv[1]) as store:
    store.rows(sys.argv[2]).notify()
"""


def _woken(
    store: latchkey.Store, queue: latchkey.Rows, mode: str, make_due: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[list[int], int]:  # fmt: skip
    """A take (or lease) waits for due rows of ``queue`` in a thread, its polls slowed to
    every 15-30 s so that only a notice can end its wait in time; once it has subscribed and
    asked again, ``make_due()`` makes a row due and sends the notice. The ids it got and how
    many times it asked the store."""
    monkeypatch.setattr(rows_core, "Backoff", lambda cap: Backoff(initial=15.0, cap=30.0))
    asks = _count_asks(store, f"rows_{mode}")
    got: dict[str, list[int]] = {}

    def wait_for_rows() -> None:
        batch_of = queue.take(limit=5, wait="60s") if mode == "take" else queue.lease(
            limit=5, ttl="30s", wait="60s")  # fmt: skip
        with batch_of as batch:
            got["ids"] = [row["id"] for row in batch]

    waiting = threading.Thread(target=wait_for_rows)
    waiting.start()
    try:
        eventually(lambda: len(asks) >= 2, timeout=10, what="asked again after subscribing")
        make_due()
        waiting.join(timeout=10)
        assert not waiting.is_alive(), "the notice did not wake the waiting batch"
    finally:
        waiting.join()
    return got["ids"], len(asks)


@pytest.mark.parametrize("mode", ["take", "lease"])
def test_a_notify_from_another_process_wakes_a_waiting_take_or_lease(
    store: latchkey.Store, db: AppDB, store_url: str, mode: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """``rows.notify()`` after new rows commit wakes the batches waiting for due rows of
    that table at once, in other processes too (PostgreSQL: a NOTIFY; SQLite: the doorbells
    of this machine; MariaDB: the bells); the row is inserted and the notice sent, from
    another process, only after the waiter subscribed and asked once more."""
    if store.scheme == "mysql" and not _mariadb(store):
        pytest.skip("mysql: no push between processes on MySQL (MariaDB rings its bells)")
    table = db.create_events(0)
    queue = store.rows(table, where="processed_at IS NULL")

    def make_due() -> None:
        db.insert(table, [7])
        subprocess.run([sys.executable, "-c", NOTIFY, store_url, table], check=True,
                       timeout=60)  # fmt: skip

    assert _woken(store, queue, mode, make_due, monkeypatch) == ([7], 3)


def test_notify_wakes_a_waiting_take_of_the_same_store_on_every_sql_store(
    store: latchkey.Store, db: AppDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within one process (MySQL/MariaDB too, whose waiters otherwise only poll): a notify
    through the same store wakes its waiting takes."""
    table = db.create_events(0)
    queue = store.rows(table, where="processed_at IS NULL")

    def make_due() -> None:
        db.insert(table, [3])
        queue.notify()

    assert _woken(store, queue, "take", make_due, monkeypatch)[0] == [3]


def test_wake_sql_in_the_applications_own_transaction(
    store: latchkey.Store, db: AppDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL: ``rows.wake_sql`` (all literals) run in the transaction that inserts the
    rows wakes the waiters when it commits; the other stores have none (None)."""
    table = db.create_events(0)
    queue = store.rows(table, where="processed_at IS NULL")
    if store.scheme != "postgresql":
        assert queue.wake_sql is None
        return
    wake = queue.wake_sql
    assert wake is not None and wake.startswith("SELECT pg_notify('")

    def make_due() -> None:
        db.execute("BEGIN")
        db.insert(table, [5])
        db.execute(wake)  # delivered at COMMIT, with the row
        db.execute("COMMIT")

    assert _woken(store, queue, "take", make_due, monkeypatch)[0] == [5]


def test_two_takes_never_get_the_same_row(store: latchkey.Store, db: AppDB) -> None:
    table = db.create_events(4)
    queue = store.rows(table, where="processed_at IS NULL", order_by="id")
    if store.scheme == "sqlite":
        # SQLite serialises writers: the second take waits for the first to commit.
        got: list[int] = []
        with queue.take(limit=2) as first:
            assert [row["id"] for row in first] == [1, 2]
            worker = threading.Thread(target=lambda: got.extend(take_and_mark(queue, db, table)))
            worker.start()
            time.sleep(0.3)
            assert got == []  # still waiting for the write lock
            for row in first:
                mark(first, db, table, row)
        worker.join(20)
        assert got == [3, 4]
        return
    with queue.take(limit=2) as first:
        started = time.monotonic()
        with queue.take(limit=2, wait=0) as second:  # SKIP LOCKED: the next rows, no wait
            assert time.monotonic() - started < 2
            assert [row["id"] for row in first] == [1, 2]
            assert [row["id"] for row in second] == [3, 4]
            with queue.take(limit=2, wait=0) as third:
                assert not third
            for row in second:
                mark(second, db, table, row)
        for row in first:
            mark(first, db, table, row)
    assert processed(db, table) == [1, 2, 3, 4]


def take_and_mark(queue: latchkey.Rows, db: AppDB, table: str) -> list[int]:
    with queue.take(limit=2, wait="20s") as batch:
        for row in batch:
            mark(batch, db, table, row)
        return [row["id"] for row in batch]


def test_a_failed_statement_leaves_no_connection_in_a_transaction(
    store: latchkey.Store, db: AppDB, name: str
) -> None:
    table = db.create_events(3)
    queue = store.rows(table, where="processed_at IS NULL", order_by="id")
    with pytest.raises(Exception) as caught, queue.take(limit=1) as batch:
        batch.execute("SELECT no_such_column FROM no_such_table")
    assert not isinstance(caught.value, StoreUnavailable)  # the application's own error
    for _ in range(10):  # every pooled connection is usable and out of any transaction
        lock = store.lock(name, ttl=10, wait=0)
        assert lock.acquire()
        assert lock.release()
    with queue.take(limit=3) as batch:
        assert [row["id"] for row in batch] == [1, 2, 3]


# -- lease --------------------------------------------------------------------------------------


def test_lease_tokens_done_and_inspect(store: latchkey.Store, db: AppDB) -> None:
    table = db.create_events(3)
    queue = store.rows(table, where="processed_at IS NULL", order_by="id")
    with queue.lease(limit=2, ttl="30s") as batch:
        assert [row["id"] for row in batch] == [1, 2]
        first, _ = batch.rows
        token = batch.token(first)
        assert isinstance(token, int) and token > 0
        info = store.inspect(f"{table}:1")
        assert info is not None and info.token == token  # an ordinary lease
        assert batch.remaining() > 20 and not batch.expired
        assert batch.done(first) is True
        assert batch.done(first) is False
        assert store.is_free(f"{table}:1")
        assert not store.is_free(f"{table}:2")
    assert store.is_free(f"{table}:2")  # the end of the batch released the rest
    with queue.lease(limit=1, ttl="30s") as again:
        assert [row["id"] for row in again] == [1]
        assert again.token(again.rows[0]) > token  # strictly increasing per row
        with pytest.raises(InvalidValue):
            again.token({"id": 3})


def test_leased_rows_are_skipped_by_other_leases(store: latchkey.Store, db: AppDB) -> None:
    table = db.create_events(5)
    queue = store.rows(table, where="processed_at IS NULL", order_by="id")
    with queue.lease(limit=2, ttl="30s") as first, queue.lease(limit=2, ttl="30s") as second:
        assert [row["id"] for row in first] == [1, 2]
        assert [row["id"] for row in second] == [3, 4]
        # execute in a lease: a short transaction of its own, committed at once
        for row in second:
            second.execute(
                db.sql(f"UPDATE {table} SET processed_at = 1 WHERE id = %s"), (row["id"],)
            )
            second.done(row)
        assert processed(db, table) == [3, 4]
    with queue.lease(limit=5, ttl="30s") as rest:
        assert [row["id"] for row in rest] == [1, 2, 5]


def test_an_exception_in_a_lease_gives_the_rows_back_at_once(
    store: latchkey.Store, db: AppDB
) -> None:
    table = db.create_events(2)
    queue = store.rows(table, where="processed_at IS NULL", order_by="id")
    with pytest.raises(KeyError), queue.lease(limit=2, ttl="1h"):
        raise KeyError("boom")
    with queue.lease(limit=2, ttl="1h", wait=0) as batch:
        assert [row["id"] for row in batch] == [1, 2]


def test_a_lease_not_done_comes_back_after_its_ttl(store: latchkey.Store, db: AppDB) -> None:
    table = db.create_events(1)
    queue = store.rows(table, where="processed_at IS NULL")
    crashed = queue.lease(limit=1, ttl=0.5)
    crashed.__enter__()  # a worker that dies holding the lease: never exits
    old = crashed.token(crashed.rows[0])
    with queue.lease(limit=1, ttl=30) as other:
        assert not other  # still leased

    def comes_back() -> int | None:
        with queue.lease(limit=1, ttl=30) as batch:
            return batch.token(batch.rows[0]) if batch else None

    token = eventually(comes_back, timeout=15, what="the crashed worker's row back")
    assert token > old


def test_a_row_finished_elsewhere_is_not_leased(store: latchkey.Store, db: AppDB) -> None:
    table = db.create_events(3)
    queue = store.rows(table, where="processed_at IS NULL", order_by="id")
    with queue.take(limit=1) as batch:  # finished by a take: never leased afterwards
        mark(batch, db, table, batch.rows[0])
    with queue.lease(limit=3, ttl=30) as leased:
        assert [row["id"] for row in leased] == [2, 3]
        for row in leased:
            assert row["processed_at"] is None


def test_a_lease_skips_rows_a_transaction_has_locked(store: latchkey.Store, db: AppDB) -> None:
    """The candidates are read FOR UPDATE SKIP LOCKED in the claim's own transaction: rows
    locked by another transaction (here a take's) are not leased, nor waited for."""
    if store.scheme == "sqlite":
        pytest.skip("SQLite locks the database, not rows: a take holds it for its batch")
    if store.scheme == "mysql":
        pytest.skip(MYSQL_READS)
    table = db.create_events(5)
    queue = store.rows(table, where="processed_at IS NULL", order_by="id")
    with queue.take(limit=2) as taken:
        assert [row["id"] for row in taken] == [1, 2]
        started = time.monotonic()
        with queue.lease(limit=2, ttl=30) as leased:
            assert [row["id"] for row in leased] == [3, 4]
        assert time.monotonic() - started < 2
        for row in taken:
            mark(taken, db, table, row)
    with queue.lease(limit=5, ttl=30) as rest:
        assert [row["id"] for row in rest] == [3, 4, 5]


def test_concurrent_lessees_get_full_disjoint_batches(store: latchkey.Store, db: AppDB) -> None:
    """Lessees asking at the same moment do not collide on the same first rows: each gets a
    full batch of its own, in one claim."""
    if store.scheme == "mysql":
        pytest.skip(MYSQL_READS)
    lessees, limit = 6, 5
    table = db.create_events(lessees * limit)
    queue = store.rows(table, where="processed_at IS NULL", order_by="id")
    start, hold = threading.Barrier(lessees), threading.Event()
    got: list[list[int]] = []
    errors: list[BaseException] = []

    def lessee() -> None:
        try:
            start.wait(10)
            with queue.lease(limit=limit, ttl=60) as batch:
                got.append([row["id"] for row in batch])
                hold.wait(30)  # keep the leases until every lessee has its batch
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=lessee) for _ in range(lessees)]
    for thread in threads:
        thread.start()
    try:
        eventually(lambda: len(got) + len(errors) == lessees, timeout=30, what="every batch")
    finally:
        hold.set()
        for thread in threads:
            thread.join(30)
    assert not errors, errors
    assert sorted(len(ids) for ids in got) == [limit] * lessees, got
    assert sorted(i for ids in got for i in ids) == list(range(1, lessees * limit + 1))


def test_done_many_rows_in_one_call(store: latchkey.Store, db: AppDB) -> None:
    table = db.create_events(4)
    queue = store.rows(table, where="processed_at IS NULL", order_by="id")
    with queue.lease(limit=4, ttl=30) as batch:
        one, two, three, _ = batch.rows
        assert batch.done(one, two) is True
        assert store.is_free(f"{table}:1") and store.is_free(f"{table}:2")
        assert not store.is_free(f"{table}:3")
        assert batch.done(two, three) is False  # two was done already; three is ended now
        assert store.is_free(f"{table}:3")
        assert not store.is_free(f"{table}:4")


def test_complete_commits_the_work_and_ends_the_leases_together(
    store: latchkey.Store, db: AppDB
) -> None:
    table = db.create_events(4)
    queue = store.rows(table, where="processed_at IS NULL", order_by="id")
    update = db.sql(f"UPDATE {table} SET processed_at = 1 WHERE id = %s")
    with queue.lease(limit=3, ttl=30) as batch:
        one, two, three = batch.rows
        with batch.complete(one) as tx:
            tx.execute(update, (one["id"],))
            assert tx.execute(
                db.sql(f"SELECT processed_at FROM {table} WHERE id = %s"), (1,)
            ) == [(1,)]  # in the transaction: seen
            if store.scheme != "sqlite":  # (SQLite: the writer holds the file; no reader test)
                assert processed(db, table) == []  # not committed yet
            assert not store.is_free(f"{table}:1")  # the lease too
        assert processed(db, table) == [1]
        assert store.is_free(f"{table}:1")
        with batch.complete(two, three) as tx:  # several rows: one transaction
            for row in (two, three):
                tx.execute(update, (row["id"],))
        assert processed(db, table) == [1, 2, 3]
        assert store.is_free(f"{table}:2") and store.is_free(f"{table}:3")
        assert batch.done(one) is False  # completed: not held any more
        with pytest.raises(InvalidValue, match="not held"):
            batch.complete(two)
        with pytest.raises(InvalidValue, match="not held"):
            batch.complete({"id": 4})
    with queue.lease(limit=5, ttl=30) as rest:
        assert [row["id"] for row in rest] == [4]


def test_an_exception_in_complete_rolls_back_and_the_lease_stays(
    store: latchkey.Store, db: AppDB
) -> None:
    table = db.create_events(2)
    queue = store.rows(table, where="processed_at IS NULL", order_by="id")
    with queue.lease(limit=1, ttl=30) as batch:
        (row,) = batch.rows
        with pytest.raises(KeyError), batch.complete(row) as tx:
            tx.execute(db.sql(f"UPDATE {table} SET processed_at = 1 WHERE id = %s"), (1,))
            raise KeyError("boom")
        assert processed(db, table) == []
        assert not store.is_free(f"{table}:1")  # still ours: a second try may complete it
        with batch.complete(row) as tx:
            tx.execute(db.sql(f"UPDATE {table} SET processed_at = 1 WHERE id = %s"), (1,))
    assert processed(db, table) == [1]


@pytest.mark.parametrize("taken", [False, True], ids=["expired", "taken-over"])
def test_complete_on_a_lost_lease_rolls_back_and_raises(
    store: latchkey.Store, db: AppDB, taken: bool
) -> None:
    table = db.create_events(2)
    queue = store.rows(table, where="processed_at IS NULL", order_by="id")
    done = db.create_done()
    slow = queue.lease(limit=1, ttl=0.3)
    with slow as batch:
        (row,) = batch.rows
        eventually(lambda: store.is_free(f"{table}:1"), timeout=10, what="the lease to end")
        other = queue.lease(limit=1, ttl=30)
        if taken:  # another worker leased the row since
            other.__enter__()
            assert [r["id"] for r in other.rows] == [1]
        with pytest.raises(latchkey.LockLost, match="rolled back"), batch.complete(row) as tx:
            tx.execute(db.sql(f"INSERT INTO {done} (event_id, token) VALUES (%s, %s)"),
                       (1, batch.token(row)))  # fmt: skip
            tx.execute(db.sql(f"UPDATE {table} SET processed_at = 1 WHERE id = %s"), (1,))
        assert processed(db, table) == [] and db.execute(f"SELECT * FROM {done}") == []
        if taken:
            assert not store.is_free(f"{table}:1")  # the other worker's lease is untouched
            with other.complete(other.rows[0]) as tx:
                tx.execute(db.sql(f"UPDATE {table} SET processed_at = 1 WHERE id = %s"), (1,))
            other.__exit__(None, None, None)
            assert processed(db, table) == [1]


def test_lease_without_skip_locked_still_leases_correctly(
    store: latchkey.Store, db: AppDB
) -> None:
    """Leases on MySQL/MariaDB read, claim and read again in autocommit statements (the
    path every MySQL/MariaDB lease takes, SKIP LOCKED or not); told here that its server
    lacks SKIP LOCKED, as MySQL < 8.0.1 and MariaDB < 10.6 do, which take refuses."""
    if store.scheme != "mysql":
        pytest.skip("the read path is MySQL/MariaDB's")
    sql_store = store.backend.store
    sql_store._skip_locked, sql_store._server_version = False, "5.7.44"
    table = db.create_events(5)
    queue = store.rows(table, where="processed_at IS NULL", order_by="id")
    with queue.lease(limit=1, ttl=30) as first:
        assert [row["id"] for row in first] == [1]
        first.execute(db.sql(f"UPDATE {table} SET processed_at = 1 WHERE id = %s"), (1,))
        first.done(first.rows[0])
    with queue.lease(limit=2, ttl=30) as a, queue.lease(limit=2, ttl=30) as b:
        assert [row["id"] for row in a] == [2, 3] and [row["id"] for row in b] == [4, 5]
        with a.complete(*a.rows) as tx:
            for row in a:
                tx.execute(db.sql(f"UPDATE {table} SET processed_at = 1 WHERE id = %s"),
                           (row["id"],))  # fmt: skip
    assert processed(db, table) == [1, 2, 3]
    with pytest.raises(Unsupported, match=re.escape("5.7.44")), queue.take(limit=1):
        pytest.fail("no take without SKIP LOCKED")


# -- a lessee that loses the race for a row it read: made to happen, on the server stores ----

#: A live lease row inserted by hand (in: name, owner), as the blocker below holds it.
BLOCKER_ROW = {
    "mysql": "INSERT INTO {t} (name, slot, owner, owner_info, token, acquired_at, expires_at) "
    "VALUES (%s, 0, %s, '{{}}', NULL, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 1 HOUR)",
    "postgresql": "INSERT INTO {t} (name, slot, owner, owner_info, token, acquired_at, "
    "expires_at) VALUES (%s, 0, %s, '{{}}', nextval('{t}_fence'), now(), "
    "now() + interval '1 hour')",
}
#: How many statements wait for a row lock in the lease table {t} right now.
CLAIM_WAITS = {
    "mysql": "SELECT count(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT' "
    "AND trx_query LIKE 'INSERT INTO {t} %'",
    "postgresql": "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
    "AND query LIKE '%{t}%'",
}


class HeldAtItsClaim:
    """A lessee stopped for sure in its claim of ``name``: another connection holds a live
    lease row of ``name`` inserted and not committed, so the lessee's upsert of that name —
    the first of its names in byte order, which it claims in that order — waits for it, as
    information_schema.innodb_trx or pg_stat_activity shows (awaited, never guessed with a
    sleep). Its read did not see that row (a plain consistent read on MySQL/MariaDB; the
    statement's snapshot on PostgreSQL, whose rows it also locked) and picked ``name``'s row
    as a candidate. What the test does meanwhile happens between the read and the claim;
    :meth:`release` lets the claim go on."""

    def __init__(self, db: AppDB, lease_table: str, name: str, lessee: object) -> None:
        self.db, self.lease_table = db, lease_table
        self.blocker = AppDB(db.url)
        self.blocker.execute("BEGIN")
        self.blocker.execute(BLOCKER_ROW[db.scheme].format(t=lease_table),
                             (name.encode(), "b" * 32))  # fmt: skip
        self.result: list[object] = []
        self.thread = threading.Thread(target=lambda: self.result.append(self._run(lessee)))
        self.thread.start()
        eventually(self.waiting, timeout=20, what="the lessee's claim waiting for the row")

    @staticmethod
    def _run(lessee: object) -> object:
        try:
            batch = lessee()  # type: ignore[operator]
            batch.__enter__()
            return batch
        except BaseException as exc:
            return exc

    def waiting(self) -> bool:
        [(count,)] = self.db.execute(CLAIM_WAITS[self.db.scheme].format(t=self.lease_table))
        return bool(count)

    def release(self, commit: bool = False) -> latchkey.LeaseBatch:
        """End the blocker's transaction (COMMIT: its row becomes another holder's live
        lease); the lessee's batch, once its claim (and, on MySQL, its second read) is done."""
        assert self.thread.is_alive() and self.waiting(), "the lessee stopped waiting early"
        self.blocker.execute("COMMIT" if commit else "ROLLBACK")
        self.thread.join(30)
        self.blocker.close()
        (batch,) = self.result
        assert not isinstance(batch, BaseException), batch
        return batch  # type: ignore[return-value]


#: Why the tests of the read, claim and second read skip PostgreSQL.
MYSQL_ONLY = "PostgreSQL locks the rows it reads: no other lessee gets them between read and claim"


def lease_table_of(url: str) -> str:
    return parse_qs(urlsplit(url).query).get("table", ["latchkey_locks"])[0]


@pytest.fixture
def patient(store: latchkey.Store, store_url: str, connect: Any) -> Iterator[latchkey.Store]:
    """The store (a server's) with a 30 s timeout: a claim may wait for a row lock that long
    (MySQL's innodb_lock_wait_timeout is half the timeout, PostgreSQL's statement_timeout
    all of it), however slow the machine."""
    if store.scheme not in BLOCKER_ROW:
        pytest.skip(f"{store.scheme}: no row-lock wait to hold a lessee in")
    slow = connect(with_query(store_url, timeout="30s"))
    slow.init()  # the lease table, which the blocker writes to
    try:
        yield slow
    finally:
        slow.close()


def test_a_lease_fills_its_batch_after_losing_a_claim_to_a_lease_committed_meanwhile(
    patient: latchkey.Store, store_url: str, db: AppDB
) -> None:
    """PostgreSQL: a lessee locks rows 1-3 (none leased in its snapshot), then its claim of
    row 1 waits for another transaction's lease of it, which commits: that claim fails, and
    the lessee reads again — a fresh snapshot, which sees that lease — and fills its batch
    with row 4."""
    if patient.scheme != "postgresql":
        pytest.skip("MySQL/MariaDB: a lease that lost a claim keeps what it got (tested below)")
    table = db.create_events(5)
    queue = patient.rows(table, where="processed_at IS NULL", order_by="id")
    held = HeldAtItsClaim(db, lease_table_of(store_url), f"{table}:1",
                          lambda: queue.lease(limit=3, ttl=60))  # fmt: skip
    with queue.lease(limit=5, ttl=60) as meanwhile:  # rows 1-3 are locked: skipped
        assert [row["id"] for row in meanwhile] == [4, 5]
    batch = held.release(commit=True)
    assert [row["id"] for row in batch] == [2, 3, 4]
    for row in batch:
        info = patient.inspect(f"{table}:{row['id']}")
        assert info is not None and info.token == batch.token(row)
    one = patient.inspect(f"{table}:1")
    assert one is not None and one.holders[0].owner.pid == 0  # the blocker's, untouched
    batch.__exit__(None, None, None)


def test_mysql_lessee_that_loses_the_race_gets_only_what_it_leased(
    patient: latchkey.Store, store_url: str, db: AppDB
) -> None:
    """MySQL/MariaDB: between a lessee's read (rows 1-4) and its claim, another lessee
    leases row 3, a worker finishes row 2 (complete: its lease ends with the work), another
    leases row 4 and gives it back unfinished. The lessee then gets rows 1 and 4 only — not 3
    (another's), not 2 (no longer due: its second read drops it and gives the lease back at
    once) — with row 4's token above the one before it, and every row stays accounted for."""
    if patient.scheme != "mysql":
        pytest.skip(MYSQL_ONLY)
    table = db.create_events(5)

    def queue(where: str = "") -> latchkey.Rows:
        return patient.rows(table, where=f"processed_at IS NULL{where}", order_by="id")

    held = HeldAtItsClaim(db, lease_table_of(store_url), f"{table}:1",
                          lambda: queue().lease(limit=4, ttl=60))  # fmt: skip
    winner = queue(" AND id = 3").lease(limit=1, ttl=60)
    winner.__enter__()
    assert [row["id"] for row in winner] == [3]
    with queue(" AND id = 2").lease(limit=1, ttl=60) as finisher:
        assert [row["id"] for row in finisher] == [2]
        with finisher.complete(*finisher.rows) as tx:
            tx.execute(f"UPDATE {table} SET processed_at = 1 WHERE id = %s", (2,))
    with queue(" AND id = 4").lease(limit=1, ttl=60) as giver:
        assert [row["id"] for row in giver] == [4]
        given_back = giver.token(giver.rows[0])
    batch = held.release()

    assert [row["id"] for row in batch] == [1, 4]
    assert all(row["processed_at"] is None for row in batch)
    one, four = batch.rows
    assert batch.token(four) > given_back  # fenced: above the lease that row had before
    for row, holder in ((one, batch), (four, batch), (winner.rows[0], winner)):
        info = patient.inspect(f"{table}:{row['id']}")
        assert info is not None and info.token == holder.token(row)
    assert patient.is_free(f"{table}:2") and processed(db, table) == [2]
    states = {s.key: (s.state, s.lease and s.lease.token) for s in queue().status()}
    assert states == {
        1: ("leased", batch.token(one)), 3: ("leased", winner.token(winner.rows[0])),
        4: ("leased", batch.token(four)), 5: ("free", None),
    }  # fmt: skip
    with queue().lease(limit=5, ttl=60) as rest:
        assert [row["id"] for row in rest] == [5]
    batch.__exit__(None, None, None)
    winner.__exit__(None, None, None)
    with queue().lease(limit=5, ttl=60) as everything:
        assert [row["id"] for row in everything] == [1, 3, 4, 5]  # nothing lost


@pytest.mark.parametrize("blocker", ["rolled-back", "committed"])
def test_mysql_lessee_that_loses_every_row_gets_an_empty_batch(
    patient: latchkey.Store, store_url: str, db: AppDB, blocker: str
) -> None:
    """MySQL/MariaDB: between a lessee's read (rows 1 and 2) and its claim, another lessee
    leases row 2 and row 1 stops being due — the application marks it done (the blocker
    rolls back: the claim gets row 1's lease, its second read drops the row and gives the
    lease back) or another holder's lease of it commits (the claim gets nothing and, reading
    again, finds nothing due). Either way the batch is empty and no lease is left behind."""
    if patient.scheme != "mysql":
        pytest.skip(MYSQL_ONLY)
    table = db.create_events(2)
    queue = patient.rows(table, where="processed_at IS NULL", order_by="id")
    held = HeldAtItsClaim(db, lease_table_of(store_url), f"{table}:1",
                          lambda: queue.lease(limit=2, ttl=60))  # fmt: skip
    with patient.rows(table, where="processed_at IS NULL AND id = 2").lease(ttl=60) as winner:
        assert [row["id"] for row in winner] == [2]
        if blocker == "rolled-back":
            db.execute(f"UPDATE {table} SET processed_at = 1 WHERE id = 1")
        batch = held.release(commit=blocker == "committed")
        assert not batch and batch.rows == []
        info = patient.inspect(f"{table}:2")
        assert info is not None and info.token == winner.token(winner.rows[0])
        one = patient.inspect(f"{table}:1")
        if blocker == "rolled-back":
            assert one is None  # leased by the claim, given back by the second read
        else:
            assert one is not None and one.holders[0].owner.pid == 0  # the blocker's, as it was
        batch.__exit__(None, None, None)
    with queue.lease(limit=2, ttl=60) as rest:
        assert [row["id"] for row in rest] == [2]  # row 1: done, or the blocker's


def test_status_shows_free_leased_and_locked_rows(store: latchkey.Store, db: AppDB) -> None:
    table = db.create_events(5)
    queue = store.rows(table, where="processed_at IS NULL", order_by="id")
    with queue.lease(limit=1, ttl="1m") as leased:
        token = leased.token(leased.rows[0])
        if store.scheme == "sqlite":  # a take would hold the write lock: locks are unknown
            states = queue.status()
            assert [(s.key, s.state, s.locked) for s in states][:2] == [
                (1, "leased", None), (2, "free", None),
            ]  # fmt: skip
            return
        with queue.take(limit=2) as taken:
            assert [row["id"] for row in taken] == [1, 2]  # a take ignores leases
            states = queue.status(limit=4)
    assert [(s.key, s.state) for s in states] == [
        (1, "leased+locked"), (2, "locked"), (3, "free"), (4, "free"),
    ]  # fmt: skip
    lease = states[0].lease
    assert lease is not None and lease.token == token and lease.expires_at is not None
    with queue.take(limit=5, wait=0) as again:  # status left no lock behind
        assert len(again) == 5


def test_a_server_failure_inside_a_take_is_store_unavailable(
    store: latchkey.Store, db: AppDB
) -> None:
    if store.scheme == "sqlite":
        pytest.skip("no server to fail")
    table = db.create_events(3)
    queue = store.rows(table, where="processed_at IS NULL", order_by="id")
    with pytest.raises(StoreUnavailable), queue.take(limit=2) as batch:
        kill_the_session_in_a_transaction(db)  # what a server restart does to it
        batch.execute(db.sql(f"UPDATE {table} SET processed_at = 1 WHERE id = %s"), (1,))
    assert processed(db, table) == []  # rolled back by the server
    with queue.take(limit=3) as batch:  # the dead connection was not pooled
        assert [row["id"] for row in batch] == [1, 2, 3]
    # The failure caught inside the block: the end of the block cannot commit, and says so.
    with (
        pytest.raises(StoreUnavailable, match="nothing was committed"),
        queue.take(limit=1) as batch,
    ):
        kill_the_session_in_a_transaction(db)
        with pytest.raises(StoreUnavailable):
            batch.execute(f"SELECT 1 FROM {table}")
    with queue.take(limit=3) as batch:
        assert len(batch) == 3


def kill_the_session_in_a_transaction(db: AppDB) -> None:
    if db.scheme == "postgresql":
        killed = db.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE state LIKE 'idle in transaction%' AND pid <> pg_backend_pid()"
        )
    else:  # innodb_trx is a cached view (refreshed every 0.1 s): kill every idle session of
        # this database but ours, as a restart would (the pool reopens the others)
        killed = db.execute(
            "SELECT id FROM information_schema.processlist "
            "WHERE id <> CONNECTION_ID() AND command = 'Sleep' AND db = DATABASE()"
        )
        for (thread,) in killed:
            db.execute(f"KILL {int(thread)}")
    assert killed


def test_many_concurrent_async_takes_on_sqlite_do_not_starve(tmp_path: Path) -> None:
    """More takes waiting for SQLite's write lock than a shared executor has threads: the
    holder still commits (each take's statements run on a thread of its own)."""
    url = f"sqlite:///{tmp_path}/app.db"
    db = AppDB(url)
    table = db.create_events(40)

    async def worker(queue: latchkey.AsyncRows) -> int:
        done = 0
        while True:
            async with queue.take(limit=2, wait=0) as batch:
                if not batch:
                    return done
                for row in batch:
                    await asyncio.sleep(0.005)
                    sql = f"UPDATE {table} SET processed_at = 1 WHERE id = ?"
                    await batch.execute(sql, (row["id"],))
                    done += 1

    async def main() -> list[int]:
        async with latchkey.connect_async(url) as store:
            queue = store.rows(table, where="processed_at IS NULL", order_by="id")
            return await asyncio.gather(*(worker(queue) for _ in range(12)))

    assert sum(asyncio.run(main())) == 40
    assert processed(db, table) == list(range(1, 41))
    db.close()


def test_an_error_in_where_is_the_drivers_own_and_leaves_the_store_usable(
    store: latchkey.Store, db: AppDB, name: str
) -> None:
    table = db.create_events(2)
    broken = store.rows(table, where="no_such_column IS NULL")
    for attempt in (
        lambda: broken.take(limit=1).__enter__(),
        lambda: broken.lease(limit=1, ttl=5).__enter__(),
        lambda: broken.status(),
    ):
        with pytest.raises(Exception) as caught:
            attempt()
        assert not isinstance(caught.value, latchkey.LatchkeyError), caught.value
        assert "no_such_column" in str(caught.value)
    for _ in range(10):  # no pooled connection was left inside a transaction
        lock = store.lock(name, ttl=10, wait=0)
        assert lock.acquire() and lock.release()
    with store.rows(table, where="processed_at IS NULL").take(limit=5) as batch:
        assert len(batch) == 2


def test_a_frozen_server_ends_a_take_within_the_timeout(
    store_row: object,
    running_server: object,
    store_url: str,
    connect: object,
) -> None:
    """A take on a server that stops answering (SIGSTOP: its kernel still acknowledges, so no
    TCP timeout fires): opening the batch, and a statement inside one, fail with
    StoreUnavailable within the timeout plus the one-second local margin — never hang — and
    the store works again after the thaw."""
    from tests import servers

    assert isinstance(running_server, servers.RunningServer)
    store = connect(servers.with_query(store_url, timeout="1s"))  # type: ignore[operator]
    if not store.capabilities.rows:
        pytest.skip(f"{store.scheme} store claims no rows")
    app = AppDB(store_url)
    table = app.create_events(3)
    app.close()
    queue = store.rows(table, where="processed_at IS NULL", order_by="id")
    bound = 1.0 + 1.0 + 1.5
    with queue.take(limit=1) as batch:  # its connection is pooled, idle, when the freeze comes
        assert len(batch) == 1
    update = AppDB.placeholder_of(store_url).join(
        (f"UPDATE {table} SET processed_at = 1 WHERE id = ", "")
    )
    with pytest.raises(StoreUnavailable), queue.take(limit=1) as batch:
        with running_server.frozen():
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                batch.execute(update, (1,))
            took = time.monotonic() - started
    assert took < bound, f"a statement in a take: {took:.1f}s to report the frozen server"
    with running_server.frozen():
        started = time.monotonic()
        with pytest.raises(StoreUnavailable), queue.take(limit=1):
            pytest.fail("no batch from a frozen server")
        took = time.monotonic() - started
    assert took < bound, f"opening a take: {took:.1f}s to report the frozen server"
    eventually(lambda: _takes(queue), timeout=30, what="takes work after the thaw")
    store.close()


def _takes(queue: latchkey.Rows) -> bool:
    try:
        with queue.take(limit=3) as batch:
            return len(batch) == 3  # nothing was committed by the failed takes
    except StoreUnavailable:
        return False
