"""Issue 17 item 2: MariaDB's bells (``latchkey.stores.mysql_bells``) — a release in one
process wakes a waiter in another at once, instead of at its next poll.

Every waiter here has its polls slowed to every 15-30 s (the core's ``Backoff`` replaced), so
a wait that ends within the few seconds the tests allow was ended by a ring, not by a poll.
Holders and waiters run in other processes (``subprocess``), against the suite's MariaDB, in
the sync API and the asyncio one. MySQL (not MariaDB) has no bells; the server here is
always MariaDB (Debian has no MySQL 8).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pymysql
import pytest

import latchkey
from latchkey._core import waiting
from latchkey.stores import open_backend
from latchkey.stores.io.mysql_dsn import connect_args
from latchkey.stores.mysql import MySQLBackend
from latchkey.stores.mysql_tables import CREATE
from tests.helpers import eventually
from tests.servers import with_query

STORE_ROWS = {"mysql"}
#: How long a rung waiter may take to return here: far below its slowed polls (7.5 s at the
#: soonest), far above a ring (a few ms), whatever the machine's load.
RUNG_WITHIN = 5.0

SLOW_POLLS = """
import latchkey._core.waiting as waiting
_Backoff = waiting.Backoff
waiting.Backoff = lambda cap=0, rng=None: _Backoff(initial=15.0, cap=30.0, rng=rng)
"""
# Holds argv[2] until a line comes on stdin, then releases it.
HOLDER = """
import sys, latchkey
with latchkey.connect(sys.argv[1]) as store:
    lock = store.lock(sys.argv[2], ttl="60s")
    assert lock.acquire()
    print("held", flush=True)
    sys.stdin.readline()
    assert lock.release()
    print("released", flush=True)
"""
# Waits for argv[2] (polls slowed), prints its token, holds it a moment, releases it.
WAITER = SLOW_POLLS + """
import sys, time, latchkey
with latchkey.connect(sys.argv[1]) as store:
    lock = store.lock(sys.argv[2], ttl="60s", wait="60s")
    assert lock.acquire()
    print(lock.token, flush=True)
    time.sleep(0.05)
    assert lock.release()
"""


def _slow_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    slow = waiting.Backoff
    monkeypatch.setattr(
        waiting, "Backoff", lambda cap=0, rng=None: slow(initial=15.0, cap=30.0, rng=rng)
    )


@pytest.fixture
def sql(store_url: str) -> Iterator[Callable[..., Any]]:
    """Runs a statement on the store's server (``{t}``: the store's table); its rows."""
    backend = open_backend(store_url)
    assert isinstance(backend, MySQLBackend)
    backend.init()
    if not backend.store.prepared:
        backend.close()
        pytest.skip("mysql: not run: the server is not MariaDB (MySQL has no bells)")
    conn = pymysql.connect(**connect_args(backend))  # (autocommit)
    table = backend.store.table

    def run(statement: str, *params: Any) -> Any:
        with conn.cursor() as cur:
            cur.execute(statement.replace("{t}", table), params or None)
            return cur.fetchall()

    yield run
    conn.close()
    backend.close()


def _bells(sql: Callable[..., Any], name: str) -> int:
    return int(sql("SELECT COUNT(*) FROM {t}_bells WHERE name = %s", name.encode())[0][0])


def _spawn(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.communicate()  # (closes its pipes)


def _waiting_thread(store: latchkey.Store, name: str, got: dict[str, Any]) -> threading.Thread:
    def wait() -> None:
        lock = store.lock(name, ttl="60s", wait="60s")
        got["acquired"] = lock.acquire()
        got["token"] = lock.token
        lock.release()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def test_a_release_in_another_process_rings_the_waiter(
    store_url: str, sql: Callable[..., Any], connect: Callable[[str], latchkey.Store],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    _slow_polls(monkeypatch)
    holder = _spawn(HOLDER, store_url, "n")
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "held"
        store = connect(store_url)
        got: dict[str, Any] = {}
        thread = _waiting_thread(store, "n", got)
        eventually(lambda: _bells(sql, "n") == 1, what="the waiter's bell in line")
        assert sql("SELECT waited FROM {t} WHERE name = %s", b"n") == ((1,),)  # marked
        holder.stdin.write("\n")
        holder.stdin.flush()
        thread.join(RUNG_WITHIN)
        assert not thread.is_alive(), "the release did not ring the waiter"
        assert got["acquired"] and got["token"]
        assert holder.stdout.readline().strip() == "released"
        eventually(lambda: _bells(sql, "n") == 0, what="the bell out of line")
        live = "SELECT * FROM {t} WHERE name = %s AND expires_at > UTC_TIMESTAMP(6)"
        assert sql(live, b"n") == ()
    finally:
        _stop(holder)


def test_waiting_processes_are_rung_in_the_order_they_came(
    store_url: str, sql: Callable[..., Any]
) -> None:
    """Three processes wait; each release (the holder's, then each waiter's own) rings the
    process that came first of those still waiting: grants (their fencing tokens) follow
    arrival, and none is left to its slowed polls."""
    holder = latchkey.connect(store_url)
    lock = holder.lock("q", ttl="60s")
    assert lock.acquire()
    waiters: list[subprocess.Popen[str]] = []
    try:
        for count in (1, 2, 3):
            waiters.append(_spawn(WAITER, store_url, "q"))
            eventually(lambda n=count: _bells(sql, "q") == n, what=f"{count} bells in line")  # type: ignore[misc]
        assert lock.release()
        tokens = []
        for proc in waiters:
            out, _ = proc.communicate(timeout=3 * RUNG_WITHIN)
            assert proc.returncode == 0
            tokens.append(int(out))
        assert tokens == sorted(tokens) and tokens[0] > (lock.token or 0)
    finally:
        for proc in waiters:
            _stop(proc)
        holder.close()


def test_a_dead_process_bell_is_passed_over(
    store_url: str, sql: Callable[..., Any], connect: Callable[[str], latchkey.Store],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A bell whose process died (its connection gone) first in line: the release's KILL
    finds no such connection, takes it out and rings the next."""
    _slow_polls(monkeypatch)
    store = connect(store_url)
    holder = store.lock("d", ttl="60s")
    assert holder.acquire()
    sql("INSERT INTO {t}_bells VALUES (%s, @@server_id, 4000000000, '2000-01-01')", b"d")
    waiter = _spawn(WAITER, store_url, "d")
    try:
        eventually(lambda: _bells(sql, "d") == 2, what="the live bell behind the dead one")
        assert holder.release()
        out, _ = waiter.communicate(timeout=RUNG_WITHIN)
        assert waiter.returncode == 0 and int(out) > (holder.token or 0)
        assert sql("SELECT * FROM {t}_bells WHERE conn = 4000000000") == ()
    finally:
        _stop(waiter)


def test_a_force_release_rings_every_waiting_process(
    store_url: str, sql: Callable[..., Any], connect: Callable[[str], latchkey.Store],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    _slow_polls(monkeypatch)
    holder = _spawn(HOLDER, store_url, "f")
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        store = connect(store_url)
        got: dict[str, Any] = {}
        thread = _waiting_thread(store, "f", got)
        eventually(lambda: _bells(sql, "f") == 1, what="the waiter's bell in line")
        with latchkey.connect(store_url) as admin:
            assert admin.force_release("f")
        thread.join(RUNG_WITHIN)
        assert not thread.is_alive(), "the force-release did not ring the waiter"
        assert got["acquired"]
    finally:
        _stop(holder)


def test_an_uncontended_lease_is_never_marked_and_leaves_no_bell(
    store_url: str, sql: Callable[..., Any], connect: Callable[[str], latchkey.Store]
) -> None:
    store = connect(store_url)
    with store.lock("u", ttl="60s"):
        assert sql("SELECT waited FROM {t} WHERE name = %s", b"u") == ((0,),)
        assert store.lock("u", ttl="60s", wait=0).acquire() is False  # a try never waits
    assert sql("SELECT * FROM {t} WHERE name = %s", b"u") == ()  # deleted, not kept
    assert _bells(sql, "u") == 0


def test_a_table_made_before_the_bells_gets_its_column(
    store_url: str, sql: Callable[..., Any]
) -> None:
    """A lease table made by latchkey 0.1 (no ``waited`` column): the first connection
    that finds it so adds the column, and leases work as before."""
    old = "old_" + os.urandom(4).hex()
    create = CREATE.split("CREATE TABLE IF NOT EXISTS {t}_meta")[0]
    column = next(line + "\n" for line in create.splitlines() if line.split()[:1] == ["waited"])
    assert column in create
    sql(create.replace(column, "").replace("{t}", old))
    assert "waited" not in {row[0] for row in sql(f"SHOW COLUMNS FROM {old}")}
    with latchkey.connect(with_query(store_url, table=old)) as store, store.lock("x") as lock:
        assert lock.token
        assert "waited" in {row[0] for row in sql(f"SHOW COLUMNS FROM {old}")}


def test_a_lost_bell_leaves_its_waiters_to_their_polls_and_the_next_wait_rings_again(
    store_url: str, sql: Callable[..., Any], connect: Callable[[str], latchkey.Store]
) -> None:
    """The bell's connection killed under a waiting process (a server restart, a DBA's
    KILL): its waiters are woken, try, and go on polling; the wait still ends with the lease
    once the holder releases; the next wait of the process starts a new bell, which rings."""
    store = connect(store_url)
    holder = _spawn(HOLDER, store_url, "k")
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "held"
        got: dict[str, Any] = {}
        thread = _waiting_thread(store, "k", got)
        eventually(lambda: _bells(sql, "k") == 1, what="the waiter's bell in line")
        (bell,) = sql("SELECT conn FROM {t}_bells WHERE name = %s", b"k")[0]
        sql(f"KILL CONNECTION {int(bell)}")
        holder.stdin.write("\n")
        holder.stdin.flush()
        thread.join(30)  # by its polls (at most 250 ms apart), not by a ring
        assert not thread.is_alive() and got["acquired"]
    finally:
        _stop(holder)
    holder = _spawn(HOLDER, store_url, "k")  # again: a new bell, rung
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "held"
        got = {}
        thread = _waiting_thread(store, "k", got)
        eventually(lambda: _bells(sql, "k") == 1, what="the new bell in line")
        (again,) = sql("SELECT conn FROM {t}_bells WHERE name = %s", b"k")[0]
        assert int(again) != int(bell)
        holder.stdin.write("\n")
        holder.stdin.flush()
        thread.join(RUNG_WITHIN)
        assert not thread.is_alive() and got["acquired"]
    finally:
        _stop(holder)


def test_one_process_waiting_for_two_names_is_rung_for_each(
    store_url: str, sql: Callable[..., Any], connect: Callable[[str], latchkey.Store],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """One bell, two names: a ring (the server does not say for which name) wakes the first
    waiter of each; the one whose name is still held goes back to sleep, its bell back in
    that line, and the other name's release later rings it too."""
    _slow_polls(monkeypatch)
    holders = [_spawn(HOLDER, store_url, name) for name in ("a", "b")]
    try:
        for proc in holders:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "held"
        store = connect(store_url)
        got_a: dict[str, Any] = {}
        got_b: dict[str, Any] = {}
        first = _waiting_thread(store, "a", got_a)
        second = _waiting_thread(store, "b", got_b)
        eventually(lambda: _bells(sql, "a") == 1 and _bells(sql, "b") == 1, what="both lines")
        for proc, thread in ((holders[0], first), (holders[1], second)):
            assert proc.stdin is not None
            proc.stdin.write("\n")
            proc.stdin.flush()
            thread.join(RUNG_WITHIN)
            assert not thread.is_alive(), "a release did not ring its waiter"
            eventually(lambda: len(sql("SELECT * FROM {t}_bells WHERE name IN ('a', 'b')")) < 2,
                       what="one line fewer")  # fmt: skip
        assert got_a["acquired"] and got_b["acquired"]
    finally:
        for proc in holders:
            _stop(proc)
