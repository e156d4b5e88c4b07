"""SQLite's own behaviour under contention: what the conformance suite cannot see.

A waiting attempt at a name that an attempt through the same store object found busy a moment
ago reads the name's live leases first, without SQLite's one write lock, and answers busy from
that read; only a name that looks free is attempted in a write transaction. So while another
connection keeps the write lock (a holder's release, another process's attempt), a contended
attempt is answered at once instead of waiting for the lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import latchkey
from latchkey.stores import sqlite as sqlite_store
from latchkey.stores.io import doorbell
from latchkey.stores.io.doorbell import Doorbells


def test_an_attempt_at_a_name_found_busy_reads_before_it_takes_the_write_lock(
    tmp_path: Path,
) -> None:
    path = tmp_path / "locks.db"
    holder = latchkey.connect(f"sqlite:///{path}")
    waiter = latchkey.connect(f"sqlite:///{path}?timeout=2")
    writer = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        with holder.lock("job", ttl="30s"):
            assert waiter.lock("job", ttl="30s", wait=0).acquire() is False  # found busy
            writer.execute("BEGIN IMMEDIATE")  # the write lock, kept
            try:
                started = time.monotonic()
                again = waiter.lock("job", ttl="30s", wait=0)
                assert again.acquire() is False  # answered from a read: no write lock needed
                assert time.monotonic() - started < 1.0  # not after the 2 s busy timeout
                assert again.holder is not None and again.holder.token is not None
                # A name never found busy still needs the write lock: it waits for it, and
                # a store that cannot get it within its timeout is unavailable, never "busy".
                other = waiter.lock("other", ttl="30s", wait=0)
                try:
                    other.acquire()
                    raise AssertionError("took a lease without the write lock")
                except latchkey.StoreUnavailable:
                    pass
            finally:
                writer.execute("ROLLBACK")
        assert waiter.lock("job", ttl="30s", wait=0).acquire() is True  # free: read, then taken
    finally:
        writer.close()
        holder.close()
        waiter.close()


# -- the line's turns and reservations (stores/sqlite.py, "Waiting") ------------------------------


def _room_waiter(path: Path, name: str, came_ago: float = 0.0) -> socket.socket:
    """A waiter's socket in ``name``'s room, as a waiting process binds it, that came
    ``came_ago`` seconds ago (it never attempts: the test reads what the releases send it)."""
    room = Doorbells(str(path)).room(name)
    os.makedirs(room, exist_ok=True)
    came = (time.time_ns() - int(came_ago * 1e9)) // 1000
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(os.path.join(room, f"{came:013x}-{os.getpid()}-{os.urandom(4).hex()}"))
    sock.setblocking(False)
    return sock


def _rung(sock: socket.socket) -> bool:
    """Whether a release rang ``sock`` (a ring is sent before the release returns)."""
    try:
        sock.recv(64)
    except BlockingIOError:
        return False
    return True


def _mark_rung(sock: socket.socket, ago: float) -> None:
    """As a ring ``ago`` seconds back would have marked it."""
    os.utime(sock.getsockname(), ns=(doorbell.RUNG, time.time_ns() - int(ago * 1e9)))


def _reservations(path: Path) -> list[tuple[str, int]]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        rows = conn.execute(
            "SELECT owner, expires_at - CAST((julianday('now') - 2440587.5) * 86400000.0 "
            "AS INTEGER) FROM latchkey_locks WHERE substr(owner, 1, 1) = '~'"
        ).fetchall()
    return [(str(owner), int(left)) for owner, left in rows]


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[Path, latchkey.Store, latchkey.Store]]:
    path = tmp_path / "locks.db"
    a, b = latchkey.connect(f"sqlite:///{path}"), latchkey.connect(f"sqlite:///{path}")
    try:
        yield path, a, b
    finally:
        a.close()
        b.close()


@contextlib.contextmanager
def _held_with_first(
    path: Path, store: latchkey.Store, came_ago: float = 0.0
) -> Iterator[tuple[latchkey.Lock, socket.socket]]:
    """"job" held through ``store``, and a waiter's socket first in its room."""
    lock = store.lock("job", ttl="30s")
    assert lock.acquire(wait=0)
    first = _room_waiter(path, "job", came_ago)
    try:
        yield lock, first
    finally:
        first.close()


def test_a_release_rings_a_waiter_never_rung_and_frees_the_name(two: Any) -> None:
    path, a, b = two
    with _held_with_first(path, a) as (lock, first):
        lock.release()
        assert _rung(first)
        assert os.stat(first.getsockname()).st_atime_ns == doorbell.RUNG  # marked: its turn
        assert _reservations(path) == []
        assert b.lock("job", ttl="30s").acquire(wait=0)  # free: anyone may take it


def test_within_first_s_turn_a_release_rings_nobody_and_frees_the_name(two: Any) -> None:
    path, a, b = two
    first = _room_waiter(path, "job")
    try:
        _mark_rung(first, 0.0)  # rung just now: its turn has begun
        for _ in range(3):  # a holder looping on the name, within the turn
            lock = a.lock("job", ttl="30s")
            assert lock.acquire(wait=0)
            lock.release()
            assert not _rung(first)
        assert _reservations(path) == []
        assert b.lock("job", ttl="30s").acquire(wait=0)
    finally:
        first.close()


def test_after_the_turn_the_release_reserves_the_name_for_first(two: Any) -> None:
    path, a, b = two
    with _held_with_first(path, a) as (lock, first):
        _mark_rung(first, sqlite_store.TURN_MS / 1000 + 1.0)  # its turn is over
        assert lock.release() is True  # ours, and live: kept for first
        assert _rung(first)
        ((owner, left),) = _reservations(path)
        ticket = os.path.basename(first.getsockname())
        assert owner == "~" + ticket and 0 < left <= sqlite_store.RESERVE_MS
        again = a.lock("job", ttl="30s")
        assert again.acquire(wait=0) is False  # nobody barges past a reservation
        assert again.holder is None  # nobody's lease: no holder to name
        assert b.inspect("job") is None and list(b.list()) == []  # nor shown as one


def test_a_first_that_waited_long_gets_a_reservation_without_a_turn(two: Any) -> None:
    path, a, _ = two
    came_ago = sqlite_store.STARVED_MS / 1000 + 1.0
    with _held_with_first(path, a, came_ago) as (lock, first):
        lock.release()  # never rung, but starved: served now
        assert _rung(first)
        assert [owner for owner, _ in _reservations(path)] == [
            "~" + os.path.basename(first.getsockname())
        ]
        with contextlib.closing(sqlite3.connect(path)) as conn:  # the reservation lapses
            conn.execute("UPDATE latchkey_locks SET expires_at = expires_at - 600000")
            conn.commit()
        assert a.lock("job", ttl="30s").acquire(wait=0)  # then anyone may take the name


def test_a_reservation_for_a_waiter_whose_process_is_gone_is_undone(two: Any) -> None:
    path, a, b = two
    lock = a.lock("job", ttl="30s")
    assert lock.acquire(wait=0)
    gone = _room_waiter(path, "job", came_ago=60.0)  # first, long waiting, then killed:
    stale = gone.getsockname()
    gone.close()  # its socket file stays, refusing bytes
    second = _room_waiter(path, "job")
    try:
        lock.release()
        assert not os.path.exists(stale)  # passed over, and removed
        assert _rung(second)  # the next in line is rung instead
        assert _reservations(path) == []
        assert b.lock("job", ttl="30s").acquire(wait=0)  # the name is free at once
    finally:
        second.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_waiter_a_name_is_reserved_for_takes_it(
    two: Any, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real blocked acquire (sync, or asyncio in a loop of its own) whose turn is over:
    the release reserves the name for it, and its attempt takes the reserved slot with a new
    fencing token (the reservation made to outlast the wait: only its waiter can take it)."""
    monkeypatch.setattr(sqlite_store, "RESERVE_MS", 600_000)
    path, a, b = two
    lock = a.lock("job", ttl="30s")
    assert lock.acquire(wait=0)
    outcome: dict[str, Any] = {}

    def wait_sync() -> None:
        waiter = b.lock("job", ttl="30s")
        outcome["acquired"] = waiter.acquire(wait=30)
        outcome["token"] = waiter.token
        waiter.release()

    async def wait_async() -> None:
        store = latchkey.connect_async(f"sqlite:///{path}")
        try:
            waiter = store.lock("job", ttl="30s")
            outcome["acquired"] = await waiter.acquire(wait=30)
            outcome["token"] = waiter.token
            await waiter.release()
        finally:
            await store.aclose()

    thread = threading.Thread(
        target=wait_sync if mode == "sync" else lambda: asyncio.run(wait_async())
    )
    thread.start()
    room = Doorbells(str(path)).room("job")
    deadline = time.monotonic() + 30
    while not (os.path.isdir(room) and os.listdir(room)):  # the waiter's doorbell is bound
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.005)
    (ticket,) = os.listdir(room)
    os.utime(os.path.join(room, ticket), ns=(doorbell.RUNG, time.time_ns() - 10**9))
    token = lock.token
    lock.release()
    thread.join(30)
    assert outcome == {"acquired": True, "token": token + 1}  # the very next token: no barger
    assert _reservations(path) == []  # taken, not left to lapse
