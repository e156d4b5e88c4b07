"""Row claiming without a server: the SKIP LOCKED version decision, the statements each
dialect writes, and the take rules driven by hand (no I/O)."""

from __future__ import annotations

from typing import Any

import pytest

from latchkey._core.ops import CALL, SLEEP
from latchkey._core.rows import RowsCore, TakeCore
from latchkey._types import RowSpec
from latchkey.errors import Unsupported
from latchkey.stores.base import Capabilities
from latchkey.stores.mysql import MySQL
from latchkey.stores.postgresql import PostgreSQL
from latchkey.stores.rows_sql import skip_locked_supported
from latchkey.stores.sql import Query
from latchkey.stores.sqlite import SQLite


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ("10.11.6-MariaDB", True),
        ("10.6.0-MariaDB-log", True),
        ("11.4.2-MariaDB-ubu2404", True),
        ("5.5.5-10.6.12-MariaDB", True),  # the old replication prefix
        ("10.5.23-MariaDB-0+deb11u1", False),
        ("5.5.5-10.4.1-MariaDB", False),
        ("10.3.39-MariaDB", False),
        ("8.0.35", True),
        ("8.4.0-commercial", True),
        ("8.0.0-dmr", False),
        ("5.7.44-log", False),
        ("something else", False),
    ],
)
def test_skip_locked_by_server_version(version: str, supported: bool) -> None:
    assert skip_locked_supported(version) is supported


def test_take_on_a_server_without_skip_locked_is_unsupported_naming_its_version() -> None:
    store = object.__new__(MySQL)
    steps = store.check_skip_locked()
    assert next(steps) == Query("SELECT VERSION()")
    with pytest.raises(Unsupported, match=r"10\.5\.9-MariaDB.*lease works here"):
        steps.send(([("10.5.9-MariaDB",)], 1))
    again = store.check_skip_locked()  # asked once per store
    with pytest.raises(Unsupported):
        next(again)


SPEC = RowSpec("events", "id", "processed_at IS NULL AND tag LIKE 'a%'", "id", ("body",))


@pytest.mark.parametrize(
    ("store_class", "expected"),
    [
        (PostgreSQL, 'SELECT "events"."id", "events"."body" FROM "events" WHERE (processed_at '
                     "IS NULL AND tag LIKE 'a%') ORDER BY id LIMIT 5 FOR UPDATE SKIP LOCKED"),
        (MySQL, "SELECT `events`.`id`, `events`.`body` FROM `events` WHERE (processed_at "
                "IS NULL AND tag LIKE 'a%') ORDER BY id LIMIT 5 FOR UPDATE SKIP LOCKED"),
        (SQLite, 'SELECT "events"."id", "events"."body" FROM "events" WHERE (processed_at '
                 "IS NULL AND tag LIKE 'a%') ORDER BY id LIMIT 5"),
    ],
)  # fmt: skip
def test_the_take_statement_of_each_dialect(store_class: Any, expected: str) -> None:
    store = object.__new__(store_class)
    store.table = "latchkey_locks"
    assert store.rows_select(SPEC, 5, store.ROWS.LOCKING, None) == expected


def test_the_lease_statements_name_rows_as_the_lease_table_does() -> None:
    store = object.__new__(PostgreSQL)
    store.table, store.schema = "locks", None
    free = store.rows_select(RowSpec("app.events", "id"), 3, "", "")
    assert free == (
        'SELECT "app"."events".* FROM "app"."events" WHERE NOT EXISTS (SELECT 1 FROM "locks" '
        "AS latchkey_lease WHERE latchkey_lease.name = convert_to('app.events:' || "
        "\"app\".\"events\".\"id\"::text, 'UTF8') AND latchkey_lease.expires_at > now()) "
        "LIMIT 3"
    )
    mine = store.rows_select(RowSpec("events", "id"), 3, "", "ab12")
    assert "EXISTS (SELECT 1" in mine and "latchkey_lease.owner = 'ab12'" in mine
    with pytest.raises(ValueError, match="not spliced"):
        store.rows_select(RowSpec("events", "id"), 3, "", "x' OR '1'='1")


class FakeStore:
    capabilities = Capabilities(rows=True)
    scheme, url = "fake", "fake://"


class Handle:
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows


def test_take_waits_with_backoff_until_a_row_is_due() -> None:
    take = TakeCore(RowsCore(FakeStore(), "events"), limit=2, wait=30)
    steps = take._begin()
    answers = [Handle([]), Handle([]), Handle([{"id": 1}])]
    op = next(steps)
    sleeps, finished = [], 0
    try:
        while True:
            kind, target, method, args = op
            if kind == SLEEP:
                sleeps.append(args[0])
                op = steps.send(None)
            elif target is None and method == "subscribe":  # a store without push: none
                assert args == ("latchkey.rows:events",)
                op = steps.send(None)
            elif target is None:
                assert (kind, method, args) == (CALL, "rows_take", (take.spec, 2))
                op = steps.send(answers.pop(0))
            else:  # an empty batch holds nothing: finished at once
                assert method == "finish" and args == (True,)
                finished += 1
                op = steps.send(None)
    except StopIteration:
        pass
    assert take.rows == [{"id": 1}] and finished == 2
    assert len(sleeps) == 2 and all(0 < s <= 0.25 for s in sleeps)


class PushStore(FakeStore):
    capabilities = Capabilities(rows=True, push=True)


def test_a_waiting_take_subscribes_asks_again_and_wakes_on_a_notice() -> None:
    """After an empty first answer: subscribe to the table's wake name, ask again at once (a
    notice sent before the subscription is not lost), then wait on the waiter; a notice ends
    the wait and the next ask finds the row; the waiter is closed at the end."""
    take = TakeCore(RowsCore(PushStore(), "events"), limit=1, wait=30)
    steps = take._begin()
    waiter = object()
    script: list[tuple[Any, str, Any]] = [
        (None, "rows_take", Handle([])),
        ("finish", "", None),
        (None, "subscribe", waiter),
        (None, "rows_take", Handle([])),
        ("finish", "", None),
        (waiter, "wait", True),  # woken by a notice
        (None, "rows_take", Handle([{"id": 9}])),
        (waiter, "close", None),
    ]
    op = next(steps)
    seen = []
    try:
        while True:
            kind, target, method, args = op
            assert kind == CALL, op
            seen.append((target, method))
            expected_target, expected_method, answer = script.pop(0)
            if expected_target == "finish":  # an empty batch's handle, finished at once
                assert method == "finish"
            else:
                assert (target, method) == (expected_target, expected_method), seen
            if method == "wait":
                assert 0 < args[0] <= 0.005  # the first delay: a notice, not a poll, woke it
            op = steps.send(answer)
    except StopIteration:
        pass
    assert script == [] and take.rows == [{"id": 9}]


def test_the_wake_statement_is_postgresqls_notify_on_the_lease_tables_channel() -> None:
    store = object.__new__(PostgreSQL)
    store.channel = "latchkey_leases"
    wake = "latchkey.rows:app.events"
    assert store.rows_wake_sql(wake) == (
        f"SELECT pg_notify('latchkey_leases', '{wake.encode().hex()}')"
    )
    store.channel = "x'); DROP TABLE t; --"
    with pytest.raises(ValueError, match="not spliced"):
        store.rows_wake_sql(wake)
    assert object.__new__(MySQL).rows_wake_sql(wake) is None
    assert object.__new__(SQLite).rows_wake_sql(wake) is None
