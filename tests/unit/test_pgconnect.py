"""How latchkey splits a PostgreSQL URL's hosts into connection attempts (stores/io/pgconnect.py),
as libpq and psycopg would; no server (the connects themselves: tests/contract/
test_postgresql_connect.py)."""

from __future__ import annotations

import psycopg
import pytest

from latchkey.stores.io.pgconnect import attempts, where


def test_one_host_is_one_attempt_with_its_parameters_unchanged() -> None:
    params = {"host": "db", "port": "5433", "dbname": "app", "password": "s3cret"}
    assert attempts(params) == [params]


def test_hosts_are_tried_in_order_each_with_its_port_or_the_only_one() -> None:
    plan = attempts({"host": "h1,h2", "port": "1,2", "target_session_attrs": "read-write"})
    assert [(a["host"], a["port"]) for a in plan] == [("h1", "1"), ("h2", "2")]
    assert all(a["target_session_attrs"] == "read-write" for a in plan)  # libpq checks each
    plan = attempts({"host": "h1,h2", "port": "7"})
    assert [(a["host"], a["port"]) for a in plan] == [("h1", "7"), ("h2", "7")]
    plan = attempts({"host": "h1,h2", "hostaddr": "10.0.0.1,10.0.0.2"})
    assert [a["hostaddr"] for a in plan] == ["10.0.0.1", "10.0.0.2"]


@pytest.mark.parametrize(
    "params",
    [
        {"host": "h1,h2", "port": "1,2,3"},
        {"host": "h1,h2", "hostaddr": "10.0.0.1,10.0.0.2,10.0.0.3"},
    ],
)
def test_lists_that_do_not_match_are_libpqs_error(params: dict[str, str]) -> None:
    with pytest.raises(psycopg.OperationalError, match="could not match"):
        attempts(params)


def test_prefer_standby_tries_every_host_as_a_standby_first() -> None:
    plan = attempts({"host": "h1,h2", "target_session_attrs": "prefer-standby"})
    assert [(a["host"], a["target_session_attrs"]) for a in plan] == [
        ("h1", "standby"), ("h2", "standby"), ("h1", "any"), ("h2", "any"),
    ]  # fmt: skip


def test_load_balance_random_tries_every_host_once() -> None:
    hosts = [f"h{i}" for i in range(8)]
    plan = attempts({"host": ",".join(hosts), "load_balance_hosts": "random"})
    assert sorted(a["host"] for a in plan) == sorted(hosts)


def test_an_attempt_is_named_by_host_and_port_only() -> None:
    assert where({"host": "db", "hostaddr": "10.0.0.1", "port": "6", "password": "x"}) == (
        "db (10.0.0.1):6"
    )
    assert where({"host": "/var/run/postgresql"}).startswith("/var/run/postgresql:")
