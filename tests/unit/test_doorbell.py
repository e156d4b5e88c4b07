"""SQLite's doorbells (stores/io/doorbell.py): real sockets in real directories.

A release on one connection wakes a waiter on another (as two processes would be), a ring
that comes before the wait is not lost, a waiter killed without leaving is cleaned up by the
next ring, the last waiter removes the room, and a database whose path is too long for a
socket keeps its rooms in the temporary directory.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest

import latchkey
from latchkey._types import Grant
from latchkey.stores.io import doorbell
from latchkey.stores.io.doorbell import AsyncBell, Bell
from latchkey.stores.io.doorbell import Doorbells as _Doorbells

OPEN: list[_Doorbells] = []


def Doorbells(path: str) -> _Doorbells:  # the class, its ringer closed after the test
    bells = _Doorbells(path)
    OPEN.append(bells)
    return bells


@pytest.fixture(autouse=True)
def _close_ringers() -> Iterator[None]:
    yield
    while OPEN:
        OPEN.pop().close()


def test_a_ring_before_the_wait_is_not_lost(tmp_path: Path) -> None:
    bells = Doorbells(str(tmp_path / "locks.db"))
    sock = bells.listen("jobs:nightly")
    assert sock is not None
    bell = Bell(sock, bells, "jobs:nightly")
    bells.ring(("jobs:nightly",))
    bells.ring(("jobs:nightly",))  # two releases: one wake-up, both bytes read
    assert bell.wait(5.0) is True
    assert bell.wait(0.0) is False  # drained
    bell.close()


def test_only_the_names_waiters_are_rung(tmp_path: Path) -> None:
    bells = Doorbells(str(tmp_path / "locks.db"))
    sock = bells.listen("a")
    assert sock is not None
    bell = Bell(sock, bells, "a")
    bells.ring(("b",))
    assert bell.wait(0.05) is False
    bell.close()


def test_the_last_waiter_removes_the_room_and_stale_sockets_are_removed(tmp_path: Path) -> None:
    bells = Doorbells(str(tmp_path / "locks.db"))
    room = bells.room("n")
    first, second = bells.listen("n"), bells.listen("n")
    assert first is not None and second is not None
    assert len(os.listdir(room)) == 2
    stale = first.getsockname()
    first.close()  # the first in line, killed before it could leave: its socket file stays
    bells.ring(("n",))  # refused there: removed, and the ring goes to the next in line
    assert os.listdir(room) == [os.path.basename(second.getsockname())]
    assert Path(stale).exists() is False
    bell = Bell(second, bells, "n")
    assert bell.wait(5.0) is True
    bell.close()
    assert not os.path.exists(room)


def test_a_long_database_path_keeps_its_rooms_in_the_temporary_directory(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 80)
    deep.mkdir()
    bells = Doorbells(str(deep / "locks.db"))
    assert not bells.dir.startswith(str(deep))
    again = Doorbells(str(deep / "." / "locks.db"))  # another process, the same file
    assert again.dir == bells.dir
    sock = bells.listen("x")
    assert sock is not None
    bell = Bell(sock, bells, "x")
    again.ring(("x",))
    assert bell.wait(5.0) is True
    bell.close()


def test_a_blocked_acquire_is_woken_by_the_release_not_by_polling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    woken: list[bool] = []
    in_line = threading.Event()
    wait = Bell.wait

    def spy(self: Bell, timeout: float) -> bool:
        if woken:  # a wait after one that timed out: the attempt between them found it busy,
            in_line.set()  # so a release from now on rings this bell (buffered if early)
        answer = wait(self, timeout)
        woken.append(answer)
        return answer

    monkeypatch.setattr(Bell, "wait", spy)
    with latchkey.connect(url) as holder_store, latchkey.connect(url) as waiter_store:
        holder = holder_store.lock("n", ttl="60s")
        holder.acquire()
        got: list[bool] = []
        lock = waiter_store.lock("n", ttl="60s", wait="30s")
        waiter = threading.Thread(target=lambda: got.append(lock.acquire()))
        waiter.start()
        # Released only while the waiter is in its second wait: released just after its
        # first one timed out, the attempt in between could take the lock without a ring.
        assert in_line.wait(30)
        holder.release()
        waiter.join(30)
        assert got == [True]
        assert woken[-1] is True  # the wait that ended was ended by the doorbell


def test_the_asyncio_bell_is_woken_without_a_thread(tmp_path: Path) -> None:
    async def main() -> bool:
        bells = Doorbells(str(tmp_path / "locks.db"))
        sock = bells.listen("n")
        assert sock is not None
        bell = AsyncBell(sock, bells, "n")
        asyncio.get_running_loop().call_later(0.05, bells.ring, ("n",))
        try:
            return await bell.wait(30.0)
        finally:
            await bell.close()

    assert asyncio.run(main()) is True


def test_listen_answers_none_where_no_room_can_be_made(tmp_path: Path) -> None:
    bells = Doorbells(str(tmp_path / "locks.db"))
    blocker = Path(bells.dir)
    blocker.write_text("a file where the rooms' directory would be")
    try:
        assert bells.listen("n") is None
    finally:
        blocker.unlink()


def test_a_full_socket_does_not_block_the_ringer(tmp_path: Path) -> None:
    bells = Doorbells(str(tmp_path / "locks.db"))
    sock = bells.listen("n")
    assert sock is not None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)  # the kernel's minimum
    for _ in range(1000):  # far more than the buffer holds: never blocks, never raises
        bells.ring(("n",))
    doorbell.leave(sock)


def test_a_release_rings_the_first_in_line_and_a_force_release_everyone(tmp_path: Path) -> None:
    bells = Doorbells(str(tmp_path / "locks.db"))
    first_sock = bells.listen("n")
    second_sock = bells.listen("n")
    assert first_sock is not None and second_sock is not None
    first, second = Bell(first_sock, bells, "n"), Bell(second_sock, bells, "n")
    bells.ring(("n",))
    assert first.wait(5.0) is True
    assert second.wait(0.05) is False  # one release, one waiter woken: no herd
    bells.ring(("n",), everyone=True)
    assert first.wait(5.0) is True and second.wait(5.0) is True
    first.finish(Grant(1, datetime.now(timezone.utc)))
    first.close()
    second.finish(Grant(2, datetime.now(timezone.utc)))
    second.close()


def test_a_waiter_that_leaves_without_the_lease_passes_its_ring_on(tmp_path: Path) -> None:
    bells = Doorbells(str(tmp_path / "locks.db"))
    first_sock = bells.listen("n")
    second_sock = bells.listen("n")
    assert first_sock is not None and second_sock is not None
    first, second = Bell(first_sock, bells, "n"), Bell(second_sock, bells, "n")
    bells.ring(("n",))  # meant for the first, who gives up (its wait timed out) instead
    first.close()
    assert second.wait(5.0) is True
    second.close()


def test_a_take_or_lease_connection_rings_too(tmp_path: Path) -> None:
    """Row leases release on their pinned connection (leases whose rows were done meanwhile):
    that connection answers the doorbell's requests as the shared one does."""
    import sqlite3

    from latchkey.stores.io.doorbell import Listen, Ring
    from latchkey.stores.io.sqlite import answer_on

    bells = Doorbells(str(tmp_path / "locks.db"))
    conn = sqlite3.connect(str(tmp_path / "locks.db"))
    try:
        bell = answer_on(conn, Listen("n"), bells)
        assert isinstance(bell, Bell)
        assert answer_on(conn, Ring(("n",)), bells) is True  # a waiter was rung
        assert bell.wait(5.0) is True
        bell.close()
        assert answer_on(conn, Listen("n"), None) is None  # an in-memory database: no bells
    finally:
        conn.close()
