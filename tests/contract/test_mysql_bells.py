"""Issue 17 item 2: MariaDB's bells (``latchkey.stores.mysql_bells``) — a release in one
process wakes a waiter in another at once, instead of at its next poll.

Every waiter here has its polls slowed to every 15-30 s (the core's ``Backoff`` replaced), so
a wait that ends within the few seconds the tests allow was ended by a ring, not by a poll.
Holders and waiters run in other processes (``subprocess``), against the suite's MariaDB, in
the sync API and the asyncio one. MySQL (not MariaDB) has no bells; the server here is
always MariaDB (Debian has no MySQL 8).
"""

from __future__ import annotations

import contextlib
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
from latchkey._types import Busy, Grant
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
        # Marked by the statement after the bell's INSERT: visible a moment later.
        eventually(
            lambda: sql("SELECT waited FROM {t} WHERE name = %s", b"n") == ((1,),),
            what="the lease marked waited",
        )
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
    sql("INSERT INTO {t}_bells (name, server, conn, since) "
        "VALUES (%s, @@server_id, 4000000000, '2000-01-01')", b"d")
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


# -- hand-over: the release that rings a bell hands the lease to its heir, in its own commit --

HEIR = "e" * 32
INFO = '{"host": "heir"}'


@pytest.fixture
def fake_bell(sql: Callable[..., Any], store_url: str) -> Iterator[Any]:
    """A bell of a process that is not latchkey: a raw connection sleeping in the server, put
    in ``name``'s line naming ``heir`` (its TTL 5 s). Returns its connection id; ``rung``
    (an attribute of the fixture function) is set when a KILL ends its sleep."""
    backend = open_backend(store_url)
    assert isinstance(backend, MySQLBackend)
    conn = pymysql.connect(**connect_args(backend))
    backend.close()
    with conn.cursor() as cur:
        cur.execute("SELECT CONNECTION_ID()")
        (conn_id,) = cur.fetchone()
    rung = threading.Event()

    def sleep() -> None:
        with conn.cursor() as cur, contextlib.suppress(pymysql.err.OperationalError):
            cur.execute("SELECT SLEEP(60)")
            return  # slept it out: never rung
        rung.set()

    thread = threading.Thread(target=sleep, daemon=True)
    thread.start()

    def put(name: str, heir: str | None) -> int:
        sql("INSERT INTO {t}_bells (name, server, conn, since, heir, info, ttl) "
            "VALUES (%s, @@server_id, %s, UTC_TIMESTAMP(6), %s, %s, 5000000)",
            name.encode(), conn_id, heir, INFO if heir else None)  # fmt: skip
        sql("UPDATE {t} SET waited = 1 WHERE name = %s", name.encode())
        return int(conn_id)

    put.rung = rung  # type: ignore[attr-defined]
    yield put
    with contextlib.suppress(Exception):
        sql(f"KILL CONNECTION {int(conn_id)}")
    thread.join(5)
    conn.close()


def _row(sql: Callable[..., Any], name: str) -> tuple[Any, ...] | None:
    rows = sql("SELECT owner, token, owner_info, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), "
               "expires_at) FROM {t} WHERE name = %s AND slot = 0", name.encode())  # fmt: skip
    return tuple(rows[0]) if rows else None


def test_a_release_hands_the_lease_to_the_first_bells_heir_in_its_own_commit(
    store_url: str, sql: Callable[..., Any], fake_bell: Any
) -> None:
    """When the release returns, the lease is the heir's — a newer fencing token, the heir's
    JSON and TTL — and the heir's bell has been rung and taken out of the line."""
    with latchkey.connect(store_url) as store:
        lock = store.lock("h", ttl="60s")
        assert lock.acquire()
        fake_bell("h", HEIR)
        assert lock.release()
        owner, token, info, micros = _row(sql, "h") or (None, 0, None, 0)
        assert owner == HEIR and int(token) > (lock.token or 0)
        assert str(info if isinstance(info, str) else info.decode()) == INFO
        assert 0 < int(micros) <= 5_000_000
        assert _bells(sql, "h") == 0
        assert fake_bell.rung.wait(RUNG_WITHIN)
        info_h = store.inspect("h")
        # a live lease: nobody else can take the name
        assert info_h is not None and [h.token for h in info_h.holders] == [int(token)]


def test_a_release_hands_nothing_to_a_gone_process_and_rings_the_next(
    store_url: str, sql: Callable[..., Any], fake_bell: Any
) -> None:
    """The first bell's process is gone (its KILL fails): the hand-over to its heir is undone
    in the same transaction and the next bell is rung; the name is free, its lease nobody's."""
    with latchkey.connect(store_url) as store:
        lock = store.lock("g", ttl="60s")
        assert lock.acquire()
        sql("INSERT INTO {t}_bells (name, server, conn, since, heir, info, ttl) "
            "VALUES (%s, @@server_id, 4000000000, '2000-01-01', %s, '{}', 5000000)",
            b"g", "d" * 32)  # fmt: skip
        fake_bell("g", None)
        assert lock.release()
        assert fake_bell.rung.wait(RUNG_WITHIN)  # the next bell, rung
        assert store.inspect("g") is None
        assert sql("SELECT * FROM {t} WHERE name = %s AND expires_at > UTC_TIMESTAMP(6)",
                   b"g") == ()  # fmt: skip
        assert _bells(sql, "g") == 0


def _mariadb(store_url: str) -> MySQLBackend:
    """A sync backend of the store, connected (it knows the server is MariaDB: bells)."""
    backend = open_backend(store_url)
    assert isinstance(backend, MySQLBackend)
    backend.init()
    return backend


def _waiting(backend: MySQLBackend, name: str, owner: str) -> Any:
    """A blocked acquire's waiter, as the core makes it (``wait_in_line``): this process's
    bell in ``name``'s line, naming ``owner`` as heir if it is the first."""
    return backend.wait_in_line(name, owner, INFO, 30.0, 1)


def _heirs(sql: Callable[..., Any], name: str) -> list[str | None]:
    return [row[0] for row in sql("SELECT heir FROM {t}_bells WHERE name = %s", name.encode())]


def test_a_heir_handed_the_lease_as_its_wait_ran_out_passes_it_on(
    store_url: str, sql: Callable[..., Any]
) -> None:
    """A release hands the lease to a waiter whose wait is ending without it (the race at its
    timeout): the waiter's close gives it back — the name is free again, not held by an
    owner nobody will use until its TTL."""
    backend = _mariadb(store_url)
    with latchkey.connect(store_url) as holder_store:
        holder = holder_store.lock("t", ttl="60s")
        assert holder.acquire()
        waiter = _waiting(backend, "t", HEIR)
        try:
            assert _heirs(sql, "t") == [HEIR]
            assert holder.release()
            assert (_row(sql, "t") or ("",))[0] == HEIR  # handed over
        finally:
            waiter.finish(Busy(1))  # the wait's outcome: it ran out
            waiter.close()
        assert sql("SELECT * FROM {t} WHERE name = %s AND expires_at > UTC_TIMESTAMP(6)",
                   b"t") == ()  # fmt: skip
        assert _bells(sql, "t") == 0
    backend.close()


def test_the_bell_names_the_next_waiter_of_the_process_when_the_first_leaves(
    store_url: str, sql: Callable[..., Any]
) -> None:
    backend = _mariadb(store_url)
    with latchkey.connect(store_url) as holder_store:
        holder = holder_store.lock("n", ttl="60s")
        assert holder.acquire()
        first = _waiting(backend, "n", HEIR)
        second = _waiting(backend, "n", "f" * 32)
        assert _heirs(sql, "n") == [HEIR]  # one bell per process, naming its first waiter
        first.finish(Busy(1))
        first.close()
        assert _heirs(sql, "n") == ["f" * 32]
        assert holder.release()
        assert (_row(sql, "n") or ("",))[0] == "f" * 32  # handed to the second
        second.finish(Busy(1))
        second.close()  # (and gives it back: it ran out too)
        assert sql("SELECT * FROM {t} WHERE name = %s AND expires_at > UTC_TIMESTAMP(6)",
                   b"n") == ()  # fmt: skip
    backend.close()


def test_a_heir_whose_wait_failed_gives_its_lease_back_at_its_next_acquire(
    store_url: str, sql: Callable[..., Any]
) -> None:
    """A wait that ends by an error adds no round trip (its caller gets the error within its
    timeout): a lease handed to it meanwhile is released by the process's next acquire of the
    name, before that acquire's own attempt, and never returned as if won by it."""
    backend = _mariadb(store_url)
    with latchkey.connect(store_url) as holder_store:
        holder = holder_store.lock("o", ttl="60s")
        assert holder.acquire()
        waiter = _waiting(backend, "o", HEIR)
        assert holder.release()
        handed = int((_row(sql, "o") or ("", 0))[1])
        waiter.close()  # no finish: the wait raised
        assert ("o", HEIR) in backend.store.orphans
        grant = backend.acquire("o", HEIR, INFO, 30.0, 1)
        assert isinstance(grant, Grant) and grant.token > handed  # not the handed lease
        assert backend.store.orphans[("o", HEIR)] is not None  # given back; kept a while
    backend.close()


def test_a_heir_that_took_the_name_itself_is_named_no_more_once_it_releases(
    store_url: str, sql: Callable[..., Any], fake_bell: Any
) -> None:
    """A waiter named heir wins the name by its own attempt (a barge) while another process
    waits behind: its release does not hand the lease to itself, and stops its bell naming
    it, so no later release hands a lease to an owner that no longer waits."""
    backend = _mariadb(store_url)
    waiter = _waiting(backend, "b", HEIR)  # the name is free: the core's next attempt wins
    grant = backend.acquire("b", HEIR, INFO, 30.0, 1)
    assert isinstance(grant, Grant)
    fake_bell("b", "f" * 32)  # another process waits behind ours
    assert backend.release("b", HEIR)  # our bell is first: it rings this process, no hand-over
    assert sql("SELECT * FROM {t} WHERE name = %s AND expires_at > UTC_TIMESTAMP(6)",
               b"b") == ()  # fmt: skip
    assert HEIR not in _heirs(sql, "b")
    with latchkey.connect(store_url) as other, other.lock("b", ttl="60s"):
        pass  # the next holder's release hands over to the other process's waiter
    assert (_row(sql, "b") or ("",))[0] == "f" * 32
    waiter.finish(grant)
    waiter.close()
    backend.close()


def test_an_asyncio_waiter_cancelled_leaves_the_line_at_once(
    store_url: str, sql: Callable[..., Any]
) -> None:
    """A cancel (``asyncio.timeout`` around an acquire) is no store failure: the waiter takes
    its bell out of the line before it returns (no ring for it is lost on the next)."""
    import asyncio

    from latchkey.stores import open_async_backend

    async def main() -> None:
        backend = open_async_backend(store_url)
        await backend.init()
        try:
            with latchkey.connect(store_url) as holder_store:
                holder = holder_store.lock("c", ttl="60s")
                assert holder.acquire()
                waiter = await backend.wait_in_line("c", HEIR, INFO, 30.0, 1)
                assert _heirs(sql, "c") == [HEIR]  # named, as a sync waiter
                task = asyncio.ensure_future(waiter.wait(30.0))
                await asyncio.sleep(0)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await waiter.close()
                assert _bells(sql, "c") == 0
                assert holder.release()
        finally:
            await backend.aclose()

    asyncio.run(main())


def _running(sql: Callable[..., Any], text: str) -> int:
    """Sessions whose statement (as the server shows it) contains ``text`` now (not
    INNODB_LOCK_WAITS: InnoDB refreshes it only after 100 ms without a read)."""
    running = """SELECT COUNT(*) FROM information_schema.PROCESSLIST
        WHERE ID != CONNECTION_ID() AND LOCATE(%s, INFO) > 0"""
    return int(sql(running, text)[0][0])


@pytest.fixture
def locker(store_url: str) -> Iterator[tuple[pymysql.Connection[Any], str]]:
    """Another session (not autocommit), for transactions that hold InnoDB locks on the
    store's table; and that table's name."""
    backend = open_backend(store_url)
    assert isinstance(backend, MySQLBackend)
    backend.init()
    conn = pymysql.connect(**{**connect_args(backend), "autocommit": False})
    yield conn, backend.store.table
    conn.close()
    backend.close()


def test_a_bell_leaving_never_holds_the_bells_table_while_it_waits_for_a_lease(
    store_url: str, sql: Callable[..., Any], locker: tuple[Any, str]
) -> None:
    """A rung waiter that leaves without the lease passes the ring on if the name is free:
    it reads the lease table with a lock (a statement that is not a plain SELECT) and may
    wait for a release's row lock. A release holds that row lock while it still has the
    bells table to write (it takes the rung bell out of the line): the leaving statement
    must not hold the bells table as it waits, or each waits for the other until a
    lock-wait timeout ends one (2 s stalls were seen under load)."""
    conn, table = locker
    with latchkey.connect(store_url) as store, store.lock("w", ttl="60s"):
        with conn.cursor() as cur:  # a release in flight: the lease row locked
            cur.execute(f"SELECT * FROM {table} WHERE name = %s FOR UPDATE", (b"w",))
        backend = open_backend(store_url)
        assert isinstance(backend, MySQLBackend)
        failed: list[BaseException] = []

        def leave() -> None:
            try:
                backend.io.run(backend.store.bell_out("w", 4000000001, True), "wait")
            except BaseException as exc:  # reported below
                failed.append(exc)

        thread = threading.Thread(target=leave, daemon=True)
        try:
            thread.start()
            eventually(lambda: _running(sql, f"FROM {table} WHERE name") == 1,
                       what="the bell's read waiting")  # fmt: skip
            with conn.cursor() as cur:  # the release takes its rung bell out: not held up
                cur.execute("SET SESSION lock_wait_timeout = 1")
                cur.execute(f"DELETE FROM {table}_bells WHERE name = %s", (b"w",))
            conn.commit()
            thread.join(10)
            assert not thread.is_alive() and not failed, failed
        finally:
            conn.rollback()
            thread.join(10)
            backend.close()


def test_a_waiter_is_named_heir_only_for_a_mutex_it_can_be_handed() -> None:
    from latchkey.stores.mysql_bells import heir_of
    from latchkey.stores.mysql_tables import INFO_MAX

    assert heir_of("o" * 32, "{}", 1.5, 1) == ("o" * 32, "{}", 1_500_000)
    assert heir_of("o" * 32, "{}", 1.5, 2) is None  # a semaphore's waiter: rung only
    assert heir_of("", "", 0.0, 1) is None  # a rows subscriber
    assert heir_of("o" * 32, "x" * (INFO_MAX + 1), 1.5, 1) is None  # too long for the table


def test_a_bells_table_made_before_the_hand_over_gets_its_heir_columns(
    store_url: str, sql: Callable[..., Any]
) -> None:
    """Tables made by latchkey 0.2 (bells without ``heir``, ``info``, ``ttl``): the first
    connection that finds them so adds the columns, and a release hands over as here."""
    from latchkey.stores.mysql_tables import INFO_MAX, SCHEMA_VERSION

    old = "old_" + os.urandom(4).hex()
    create = CREATE.format(t=old, version=SCHEMA_VERSION, info_max=INFO_MAX)
    heir_lines = [line for line in create.splitlines() if line.split()[:1] in (["heir"],
                                                                                 ["info"], ["ttl"])]
    assert len(heir_lines) == 3
    for line in heir_lines:
        create = create.replace(line + "\n", "")
    for statement in create.split(";\n"):  # (a statement ends a line; comments hold ";")
        if statement.strip():
            sql(statement)
    assert "heir" not in {row[0] for row in sql(f"SHOW COLUMNS FROM {old}_bells")}
    url = with_query(store_url, table=old)
    with latchkey.connect(url) as store, store.lock("x") as lock:
        assert lock.token
        assert {"heir", "info", "ttl"} <= {row[0] for row in sql(f"SHOW COLUMNS FROM {old}_bells")}


# Loops on argv[2] until argv[3] seconds pass: acquire with a short wait (many run out, some
# just as a release hands them the lease), hold a moment, release. Prints how many it got.
# argv[4] "async": the asyncio API, each wait cancelled by asyncio.timeout after 0.5-5 ms.
SHORT_WAITS = """
import asyncio, random, sys, time, latchkey
url, name, seconds, mode = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
end, got = time.monotonic() + seconds, 0
if mode == "sync":
    with latchkey.connect(url) as store:
        while time.monotonic() < end:
            lock = store.lock(name, ttl="60s", wait=0.02)
            if lock.acquire():
                time.sleep(0.002)
                assert lock.release()
                got += 1
else:
    async def main():
        global got
        async with latchkey.connect_async(url) as store:
            while time.monotonic() < end:
                lock = store.lock(name, ttl="60s", wait="10s")
                try:
                    async with asyncio.timeout(random.uniform(0.0005, 0.005)):
                        acquired = await lock.acquire()
                except TimeoutError:
                    continue
                if acquired:
                    await asyncio.sleep(0.002)
                    assert await lock.release()
                    got += 1
    asyncio.run(main())
print(got, flush=True)
"""


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_waits_that_run_out_as_leases_are_handed_over_leave_no_lease_behind(
    store_url: str, sql: Callable[..., Any], mode: str
) -> None:
    """Four processes take turns on one name with 20 ms waits (60 s leases): waits run out
    (sync) or are cancelled (asyncio: during a bell-in, an attempt, a sleep) all the time,
    some just as a release hands them the lease. Nothing is left behind: all get the name,
    and when they stop nobody holds it (a lease stranded with a waiter that left would stay
    live for its 60 s). With asyncio heirs, this failed in 9 of 10 runs while a bell could
    leave a line outside the turn, and in 4 of 8 while a cancelled attempt was dropped."""
    procs = [_spawn(SHORT_WAITS, store_url, "s", "3", mode) for _ in range(4)]
    counts = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        counts.append(int(out))
    assert min(counts) > 0, counts
    handed = "SELECT COUNT(*) FROM {t} WHERE name = %s AND expires_at > UTC_TIMESTAMP(6)"
    assert sql(handed, b"s") == ((0,),), "a lease was left to a waiter that had gone"
    # (a bell row of a process that stopped mid-wait may remain: the next release's KILL
    # finds its connection gone and removes it)
    with latchkey.connect(store_url) as store:
        assert store.lock("s", wait=0).acquire()
